"""A DistTensor behaves like a torch.Tensor, or raises clearly: in-place ops (methods,
``+=``, ``x[i] = v``, ``copy_``, ``nn.init``, ``out=``, ``inplace=True``) on every layout
(Replicate, Shard with uneven torch.chunk shards, Partial from unequal parts, 2-d
meshes), ``==`` / ``!=`` / ``in``, ``//`` and bitwise operators, one-operand einsum,
``.data``, scalar conversions. Every case is held to the full tensor computed by torch
on one device (values, dtype, shape), checks placements, and that a failed call leaves
its inputs untouched."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import workbench as wb
from workbench.parallel import NoRuleError
from workbench.parallel.placement import check_partial_dtype
from tests.strategies import meshes
from tests.test_dist_tensor_property import layouts, make

R, S, P = wb.Replicate(), wb.Shard, wb.Partial
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
M3 = wb.Mesh.grid(3, ["a"])                  # 5 rows on 3 ranks: 2, 2, 1
M22 = wb.Mesh.grid((2, 2), ["a", "b"])
LAYOUTS = [(M3, [R]), (M3, [S(0)]), (M3, [S(1)]), (M3, [P("sum")]), (M3, [P("max")]),
           (M22, [S(0), S(1)]), (M22, [P("sum"), S(0)]), (M22, [S(1), P("sum")]),
           (M22, [R, P("avg")])]
IDS = [f"{m.shape}-{[str(p) for p in ps]}" for m, ps in LAYOUTS]


def ints(shape, seed=0, lo=-9, hi=10, dtype=torch.float32):
    """Small integers (exact in every partial sum), as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def dist(x, mesh, ps, seed=1):
    """``x`` laid out by ``ps``; Partial from unequal parts (no coincidence passes). The
    local tensors are views of a copy of ``x`` (from_local keeps what it is given)."""
    return make(x.clone(), mesh, list(ps), torch.Generator().manual_seed(seed))


def snapshot(d):
    return [t.detach().clone() for t in d.locals()], d.placements, d.shape, d.dtype


def same_as(d, snap):
    locs, ps, shape, dtype = snap
    return (d.placements == ps and d.shape == shape and d.dtype == dtype
            and all(torch.equal(a, b) for a, b in zip(d.locals(), locs)))


# ---- in-place ops on random meshes and layouts ------------------------------------------

def _mask(shape):
    return ints(shape, 7, 0, 2).bool()


INPLACE = {      # name -> (on a DistTensor d (and a DistTensor y), on a plain tensor)
    "add_": (lambda d, y: d.add_(y), lambda x, y: x.add_(y)),
    "add_alpha": (lambda d, y: d.add_(y, alpha=2), lambda x, y: x.add_(y, alpha=2)),
    "add_scalar": (lambda d, y: d.add_(3), lambda x, y: x.add_(3)),
    "sub_": (lambda d, y: d.sub_(y), lambda x, y: x.sub_(y)),
    "mul_": (lambda d, y: d.mul_(y), lambda x, y: x.mul_(y)),
    "mul_scalar": (lambda d, y: d.mul_(-2), lambda x, y: x.mul_(-2)),
    "div_": (lambda d, y: d.div_(4), lambda x, y: x.div_(4)),
    "iadd": (lambda d, y: d.__iadd__(y), lambda x, y: x.__iadd__(y)),
    "isub": (lambda d, y: d.__isub__(2), lambda x, y: x.__isub__(2)),
    "imul": (lambda d, y: d.__imul__(y), lambda x, y: x.__imul__(y)),
    "ifloordiv": (lambda d, y: d.__ifloordiv__(4), lambda x, y: x.__ifloordiv__(4)),
    "copy_": (lambda d, y: d.copy_(y), lambda x, y: x.copy_(y)),
    "copy_plain": (lambda d, y: d.copy_(y.full()[0]), lambda x, y: x.copy_(y[0])),
    "zero_": (lambda d, y: d.zero_(), lambda x, y: x.zero_()),
    "fill_": (lambda d, y: d.fill_(2.5), lambda x, y: x.fill_(2.5)),
    "clamp_": (lambda d, y: d.clamp_(-3, 4), lambda x, y: x.clamp_(-3, 4)),
    "relu_": (lambda d, y: d.relu_(), lambda x, y: x.relu_()),
    "neg_": (lambda d, y: d.neg_(), lambda x, y: x.neg_()),
    "abs_": (lambda d, y: d.abs_(), lambda x, y: x.abs_()),
    "masked_fill_": (lambda d, y: d.masked_fill_(_mask(d.shape), 7.0),
                     lambda x, y: x.masked_fill_(_mask(x.shape), 7.0)),
    "masked_fill_zero": (lambda d, y: d.masked_fill_(_mask(d.shape), 0.0),
                         lambda x, y: x.masked_fill_(_mask(x.shape), 0.0)),
    "setitem_row": (lambda d, y: d.__setitem__(0, 5.0), lambda x, y: x.__setitem__(0, 5.0)),
    "setitem_slice": (lambda d, y: d.__setitem__((..., slice(1, None, 2)), -4.0),
                      lambda x, y: x.__setitem__((..., slice(1, None, 2)), -4.0)),
    "setitem_2d": (lambda d, y: d.__setitem__((slice(1, None, 2), -1), -4.0),
                   lambda x, y: x.__setitem__((slice(1, None, 2), -1), -4.0)),
    "setitem_value": (lambda d, y: d.__setitem__(slice(None), y),
                      lambda x, y: x.__setitem__(slice(None), y)),
    "clamp_min_": (lambda d, y: d.clamp_min_(0.5), lambda x, y: x.clamp_min_(0.5)),
    "lerp_": (lambda d, y: d.lerp_(y, 0.25), lambda x, y: x.lerp_(y, 0.25)),
    "row_view_zero_": (lambda d, y: d[1:].zero_(), lambda x, y: x[1:].zero_()),
    "col_view_fill_": (lambda d, y: d[..., -1].fill_(3.0), lambda x, y: x[..., -1].fill_(3.0)),
    "index_put_": (lambda d, y: d.index_put_((torch.tensor([0, 0]),), torch.tensor(3.0),
                                             accumulate=True),
                   lambda x, y: x.index_put_((torch.tensor([0, 0]),), torch.tensor(3.0),
                                             accumulate=True)),
}


@SETTINGS
@given(data=st.data())
def test_inplace_ops_equal_one_device_on_random_layouts(data):
    mesh = data.draw(meshes(max_ranks=6, max_dims=2), "mesh")
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=2), "shape"))
    name = data.draw(st.sampled_from(sorted(INPLACE)), "op")
    x, yv = ints(shape, 1), ints(shape, 2)
    ps = data.draw(layouts(len(shape), mesh, torch.float32), "x layout")
    yps = data.draw(layouts(len(shape), mesh, torch.float32), "y layout")
    d, y = dist(x, mesh, ps, 3), dist(yv, mesh, yps, 4)
    ysnap = snapshot(y)
    on_dist, on_plain = INPLACE[name]
    ref = x.clone()
    try:
        on_plain(ref, yv.clone())
    except (IndexError, RuntimeError) as e:     # torch refuses (e.g. a 2-d index on 1-d) ...
        snap = snapshot(d)
        with pytest.raises(type(e)):
            on_dist(d, y)
        assert same_as(d, snap) and same_as(y, ysnap)          # ... and so do we: untouched
        return
    before = id(d)
    with wb.allow_replicate_fallback():         # index_put_ has no rule: gathered, traced
        out = on_dist(d, y)
    if "view" not in name:
        assert out is None or out is d         # the same object, as torch returns self
    assert id(d) == before and d.placements == tuple(ps), (d.placements, ps)
    assert d.dtype == ref.dtype and d.shape == ref.shape
    torch.testing.assert_close(d.full(), ref, rtol=0, atol=1e-6)
    assert same_as(y, ysnap), "the other operand changed"


@pytest.mark.parametrize("mesh,ps", LAYOUTS, ids=IDS)
def test_inplace_reaches_views_and_leaves_reshard_sources_alone(mesh, ps):
    x = ints((5, 4), 1)
    d = dist(x, mesh, ps)
    v = d.data                                   # a detached alias, as Tensor.data
    v.mul_(3)
    torch.testing.assert_close(d.full(), x * 3)
    d.data[1:3] = 0.0                            # through a view of the alias
    ref = x * 3
    ref[1:3] = 0
    torch.testing.assert_close(d.full(), ref)
    # reshard's result owns its memory (as DTensor's redistribute): writing it leaves d
    to = [R] * mesh.ndim if any(not p.is_replicate() for p in ps) else [S(0)]
    r = wb.reshard(d, mesh, to)
    r.add_(100)
    torch.testing.assert_close(d.full(), ref)
    torch.testing.assert_close(r.full(), ref + 100)


def test_inplace_on_a_replicated_source_does_not_reach_its_shards():
    a = wb.shard_tensor(ints((6, 4)), M3, [R])
    b = wb.reshard(a, M3, [S(0)])                  # a local slice
    c = wb.reshard(a, M3, [P("max")])              # a local copy per rank
    b.zero_()
    c.fill_(1.0)
    torch.testing.assert_close(a.full(), ints((6, 4)))


# ---- torch's autograd rules ---------------------------------------------------------------

@pytest.mark.parametrize("mesh,ps", LAYOUTS[:6], ids=IDS[:6])
def test_inplace_on_a_leaf_that_requires_grad_raises_as_torch(mesh, ps):
    d = wb.shard_tensor(ints((5, 4)), mesh, ps).requires_grad_()
    snap = snapshot(d)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        torch.ones(2, requires_grad=True).add_(1)              # torch's own rule ...
    for f in (lambda: d.add_(1), lambda: d.zero_(), lambda: d.normal_(),
              lambda: d.__setitem__(0, 1.0), lambda: d.copy_(d.detach() * 2)):
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            f()                                                 # ... and ours
        assert same_as(d, snap) and d.requires_grad and d.is_leaf
    with torch.no_grad():                                       # how nn.init and optimizers write
        d.mul_(2)
        d[0] = 1.0
    ref = ints((5, 4)) * 2
    ref[0] = 1
    torch.testing.assert_close(d.full(), ref)
    assert d.requires_grad and d.is_leaf


# (a Partial(max / avg) LEAF's .grad is another matter: the leaf w's layout stays R/S/P(sum))
SUM_LAYOUTS = [(i, lp) for i, lp in zip(IDS, LAYOUTS)
               if all(p.is_replicate() or p.is_shard() or p == P("sum") for p in lp[1])]


@pytest.mark.parametrize("mesh,ps", [lp for _, lp in SUM_LAYOUTS], ids=[i for i, _ in SUM_LAYOUTS])
def test_inplace_on_a_non_leaf_records_autograd_as_torch(mesh, ps):
    x, w = ints((5, 4), 1), ints((5, 4), 2)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    h = xr * wr
    h.mul_(3)
    h[0] = 2.0
    h += xr
    h.relu_()
    (h * wr).sum().backward()
    xd = wb.shard_tensor(x, mesh, [R] * mesh.ndim).requires_grad_()
    wd = wb.shard_tensor(w, mesh, ps).requires_grad_()
    hd = xd * wd
    hd.mul_(3)
    hd[0] = 2.0
    hd += xd
    hd.relu_()
    (hd * wd).sum().backward()
    torch.testing.assert_close(hd.full(), h.detach())
    torch.testing.assert_close(xd.grad.full(), xr.grad)
    torch.testing.assert_close(wd.grad.full(), wr.grad)


def test_requires_grad_setter_follows_torch():
    d = wb.shard_tensor(ints((4, 4)), M3, [S(0)])
    d.requires_grad = True
    assert d.requires_grad and d.is_leaf
    with pytest.raises(RuntimeError, match="leaf variables"):
        (d * 2).requires_grad = False


# ---- random fills and nn.init -----------------------------------------------------------

INITS = {
    "normal_": lambda t, g: t.normal_(1.0, 2.0, generator=g),
    "uniform_": lambda t, g: t.uniform_(-1, 3, generator=g),
    "bernoulli_": lambda t, g: t.bernoulli_(0.3, generator=g),
    "init.normal_": lambda t, g: torch.nn.init.normal_(t, 0.5, 2.0, generator=g),
    "init.uniform_": lambda t, g: torch.nn.init.uniform_(t, -2, 2, generator=g),
    "init.zeros_": lambda t, g: torch.nn.init.zeros_(t),
    "init.ones_": lambda t, g: torch.nn.init.ones_(t),
    "init.constant_": lambda t, g: torch.nn.init.constant_(t, 0.25),
    "init.xavier_uniform_": lambda t, g: torch.nn.init.xavier_uniform_(t, 2.0, generator=g),
    "init.xavier_normal_": lambda t, g: torch.nn.init.xavier_normal_(t, generator=g),
    "init.kaiming_uniform_": lambda t, g: torch.nn.init.kaiming_uniform_(t, a=0.1, generator=g),
    "init.kaiming_normal_": lambda t, g: torch.nn.init.kaiming_normal_(
        t, mode="fan_out", generator=g),
    "init.trunc_normal_": lambda t, g: torch.nn.init.trunc_normal_(t, generator=g),
    "init.trunc_normal_narrow": lambda t, g: torch.nn.init.trunc_normal_(t, a=-0.1, b=0.4,
                                                                          generator=g),
    "init.eye_": lambda t, g: torch.nn.init.eye_(t),
    "init.sparse_": lambda t, g: torch.nn.init.sparse_(t, 0.4, generator=g),
}


@pytest.mark.parametrize("name", sorted(INITS))
@pytest.mark.parametrize("mesh,ps", LAYOUTS[1:7], ids=IDS[1:7])
def test_random_init_is_one_devices_draw_and_keeps_the_leaf(name, mesh, ps):
    """The full tensor is what one device draws with the same generator state."""
    ref = torch.full((5, 4), 9.0, requires_grad=True)
    torch.manual_seed(0)                        # sparse_ draws its rows from the global one
    INITS[name](ref, torch.Generator().manual_seed(5)) if name.startswith("init.") else \
        torch.no_grad()(lambda: INITS[name](ref, torch.Generator().manual_seed(5)))()
    d = dist(torch.full((5, 4), 9.0), mesh, ps).requires_grad_()
    before = id(d)
    torch.manual_seed(0)
    with torch.no_grad() if not name.startswith("init.") else torch.enable_grad():
        out = INITS[name](d, torch.Generator().manual_seed(5))
    assert out is d and id(d) == before and d.placements == tuple(ps)
    assert d.requires_grad and d.is_leaf
    torch.testing.assert_close(d.full(), ref.detach(), rtol=0, atol=0)


def test_random_fill_follows_the_global_generator():
    d = wb.shard_tensor(torch.zeros(7, 3), M3, [S(0)])
    torch.manual_seed(11)
    with torch.no_grad():
        d.normal_()
    torch.manual_seed(11)
    torch.testing.assert_close(d.full(), torch.randn(7, 3), rtol=0, atol=0)


def test_nn_module_init_and_zero_grad_on_parallelized_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 5)
    wb.parallelize(lin, M3, {"": "colwise"})
    torch.nn.init.xavier_uniform_(lin.weight, generator=torch.Generator().manual_seed(2))
    torch.nn.init.zeros_(lin.bias)
    ref = torch.empty(5, 6)
    torch.nn.init.xavier_uniform_(ref, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(lin.weight.full(), ref, rtol=0, atol=0)
    assert torch.equal(lin.bias.full(), torch.zeros(5)) and lin.weight.requires_grad


# ---- == != in, hashing -------------------------------------------------------------------

@pytest.mark.parametrize("mesh,ps", LAYOUTS, ids=IDS)
def test_eq_ne_are_elementwise_and_in_is_torchs_bool(mesh, ps):
    x = ints((5, 4), 1)
    d = dist(x, mesh, ps)
    for got, ref in ((d == 2.0, x == 2.0), (d != d, x != x), (2.0 == d, 2.0 == x),
                     (d == dist(x.flip(0), mesh, ps, 5), x == x.flip(0)),
                     (d != x[0], x != x[0])):
        assert isinstance(got, wb.DistTensor) and got.dtype == torch.bool
        assert got.shape == ref.shape and torch.equal(got.full(), ref)
    for v in (2.0, 100.0, x[3, 1].item(), torch.tensor(-9.0), x[1]):
        assert (v in d) is (v in x)
    with pytest.raises(RuntimeError, match="only supports Tensor or scalar"):
        "a" in d                                           # noqa: B015 (torch's error)
    assert (d == None) is False and (d != None) is True   # noqa: E711 (as torch)
    assert hash(d) == id(d) and {d: 1}[d] == 1 and d in {d} and len({d, d.detach()}) == 2


# ---- operators that raised TypeError --------------------------------------------------------

BINOPS = {"//": lambda a, b: a // b, "&": lambda a, b: a & b, "|": lambda a, b: a | b,
          "^": lambda a, b: a ^ b, "<<": lambda a, b: a << b, ">>": lambda a, b: a >> b,
          "%": lambda a, b: a % b}


@pytest.mark.parametrize("op", sorted(BINOPS))
@pytest.mark.parametrize("mesh,ps", LAYOUTS[:4] + LAYOUTS[5:7], ids=IDS[:4] + IDS[5:7])
def test_floordiv_and_bitwise_operators(op, mesh, ps):
    f = BINOPS[op]
    x = ints((5, 4), 1, -20, 21, torch.int64)
    k = ints((5, 4), 2, 1, 4, torch.int64)
    d, dk = dist(x, mesh, ps), wb.shard_tensor(k, mesh, [R] * mesh.ndim)
    snap = snapshot(d)
    for got, ref in ((f(d, 3), f(x, 3)), (f(d, dk), f(x, k)), (f(7, dk), f(7, k)),
                     (f(d, k), f(x, k))):
        assert isinstance(got, wb.DistTensor)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got.full(), ref), op
    assert same_as(d, snap)
    if op == "//":
        xf = ints((5, 4), 1)
        assert torch.equal((dist(xf, mesh, ps) // 4).full(), xf // 4)
        assert torch.equal((-7.5 // dist(xf.abs() + 1, mesh, ps)).full(), -7.5 // (xf.abs() + 1))


@pytest.mark.parametrize("mesh,ps", LAYOUTS[:4], ids=IDS[:4])
def test_invert_and_bitwise_errors_are_torchs(mesh, ps):
    x = ints((5, 4), 1, -20, 21, torch.int64)
    d = dist(x, mesh, ps)
    assert torch.equal((~d).full(), ~x) and torch.equal((~(d > 0)).full(), ~(x > 0))
    df = dist(x.float(), mesh, ps)
    snap = snapshot(df)
    with pytest.raises(RuntimeError, match="not implemented for 'Float'"):
        df & 1
    with pytest.raises(TypeError):
        d + "a"
    assert same_as(df, snap)


# ---- one-operand einsum ---------------------------------------------------------------------

@pytest.mark.parametrize("eq", ["ij->ji", "ii->i", "ij->", "ii->", "ij->j", "ij->ij"])
@pytest.mark.parametrize("mesh,ps", LAYOUTS, ids=IDS)
def test_one_operand_einsum(eq, mesh, ps):
    x = ints((5, 5), 1)
    got = torch.einsum(eq, dist(x, mesh, ps))
    ref = torch.einsum(eq, x)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got.full(), ref)


# ---- errors that leave the DistTensor untouched ---------------------------------------------

@pytest.mark.parametrize("mesh,ps", LAYOUTS[:4], ids=IDS[:4])
def test_inplace_errors_are_torchs_and_leave_inputs_untouched(mesh, ps):
    xi = dist(ints((5, 4), 1, dtype=torch.int64), mesh, ps)
    xf = dist(ints((5, 4), 1), mesh, ps)
    snaps = snapshot(xi), snapshot(xf)
    cases = [
        (RuntimeError, "can't be cast|Promotion", lambda: xi.add_(1.5)),    # float into long
        (RuntimeError, "doesn't match the broadcast shape",
         lambda: xf.add_(torch.ones(3, 5, 4))),
        (RuntimeError, "can't be cast", lambda: torch.add(xf, 1, out=xi.bool())),
        (IndexError, "out of bounds|out of range", lambda: xf.__setitem__(7, 1.0)),
        (RuntimeError, "shape mismatch|expand|match", lambda: xf.__setitem__(0, torch.ones(3))),
        (NotImplementedError, "resize_", lambda: xf.resize_(3)),
        (NoRuleError, r"i0_\(\).*\[.*\].*allow_replicate_fallback",   # (cumprod_, then
         lambda: xf.i0_()),                                          # renorm_: rules now)
    ]
    for exc, msg, f in cases:
        with pytest.raises(exc, match=msg):
            f()
        assert same_as(xi, snaps[0]) and same_as(xf, snaps[1])


# ---- out=, inplace=True, torch.fn_ ---------------------------------------------------------

@pytest.mark.parametrize("mesh,ps", LAYOUTS, ids=IDS)
def test_out_inplace_kwarg_and_torch_underscore_functions(mesh, ps):
    x, y = ints((5, 4), 1), ints((5, 4), 2)
    d, e = dist(x, mesh, ps), dist(y, mesh, ps, 6)
    out = dist(torch.zeros(5, 4), mesh, ps, 7)
    assert torch.add(d, e, alpha=2, out=out) is out and out.placements == tuple(ps)
    torch.testing.assert_close(out.full(), x + 2 * y)
    assert F.relu(d, inplace=True) is d
    torch.testing.assert_close(d.full(), x.relu())
    torch.relu_(e)
    torch.testing.assert_close(e.full(), y.relu())
    torch.eye(5, 4, out=out)
    torch.testing.assert_close(out.full(), torch.eye(5, 4))


def test_inplace_view_ops_relabel_the_same_object():
    x = ints((5, 4), 1)
    d = wb.shard_tensor(x, M22, [S(0), S(1)])
    assert d.t_() is d and d.shape == (4, 5) and d.placements == (S(1), S(0))
    torch.testing.assert_close(d.full(), x.t())
    d.unsqueeze_(0)
    assert d.shape == (1, 4, 5) and d.placements == (S(2), S(1))
    torch.testing.assert_close(d.full(), x.t()[None])


# ---- .data, scalar conversions, iteration -------------------------------------------------

def test_data_setter_aliases_and_keeps_requires_grad():
    d = wb.shard_tensor(ints((5, 4)), M3, [S(0)]).requires_grad_()
    other = wb.shard_tensor(ints((4, 2), 3), M22, [R, S(1)])
    d.data = other
    assert d.shape == (4, 2) and d.mesh == M22 and d.placements == (R, S(1))
    assert d.requires_grad and d.is_leaf
    other.data.add_(1)                        # d aliases other's data, as torch
    torch.testing.assert_close(d.full(), ints((4, 2), 3) + 1)
    with pytest.raises(TypeError, match="give a DistTensor"):
        d.data = torch.zeros(4, 2)


def test_scalar_conversions_iteration_and_numpy():
    x = ints((5, 4), 1)
    d = dist(x, M22, [P("sum"), S(0)])
    one = dist(torch.tensor([2.5]), M3, [P("sum")])
    assert float(one) == 2.5 and int(one) == 2 and bool(one) and one.item() == 2.5
    assert f"{dist(torch.tensor(1.25), M3, [P('sum')]):.1f}" == f"{torch.tensor(1.25):.1f}"
    assert d.tolist() == x.tolist() and np.array_equal(np.asarray(d), x.numpy())
    rows = list(d)
    assert len(rows) == 5 and all(torch.equal(r.full(), x[i]) for i, r in enumerate(rows))
    with pytest.raises(RuntimeError, match="ambiguous"):
        bool(d)
    with pytest.raises(RuntimeError, match="cannot be converted to Scalar"):
        d.item()
    with pytest.raises(TypeError, match="0-d"):
        iter(dist(torch.tensor(1.0), M3, [R]))
    c = copy.deepcopy(d)
    c.add_(1)
    torch.testing.assert_close(d.full(), x)
    torch.testing.assert_close(c.full(), x + 1)


def test_orthogonal_init_under_the_replicate_fallback():
    """orthogonal_ runs a QR (no SPMD rule: it raises, or runs gathered under the fallback)."""
    ref = torch.empty(5, 4)
    torch.nn.init.orthogonal_(ref, generator=torch.Generator().manual_seed(1))
    for mesh, ps in LAYOUTS[:6]:
        d = dist(torch.zeros(5, 4), mesh, ps).requires_grad_()
        with pytest.raises(NoRuleError, match="linalg_qr"):
            torch.nn.init.orthogonal_(d)
        assert torch.equal(d.full(), torch.zeros(5, 4))
        with wb.allow_replicate_fallback():
            torch.nn.init.orthogonal_(d, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(d.full(), ref, rtol=0, atol=1e-6)
        assert d.is_leaf and d.requires_grad and d.placements == tuple(ps)


def test_dirac_init_writes_through_setitem():
    ref = torch.zeros(4, 3, 3)
    torch.nn.init.dirac_(ref)
    for mesh, ps in LAYOUTS[:6]:
        d = dist(torch.ones(4, 3, 3), mesh, ps)
        torch.nn.init.dirac_(d)
        assert torch.equal(d.full(), ref)


# ---- views: a write into x[i] reaches x (torch's view semantics), or raises ---------------

@pytest.mark.parametrize("mesh,ps", LAYOUTS, ids=IDS)
def test_writes_through_views_reach_the_base_or_raise(mesh, ps):
    x = ints((5, 4), 1)
    d, ref = dist(x, mesh, ps), x.clone()
    for f in (lambda t: t[1:].zero_(), lambda t: t[:, 2].fill_(7.0), lambda t: t.T.mul_(2),
              lambda t: t[3][1].fill_(-1.0), lambda t: t[2:4].__setitem__(0, 9.0)):
        f(d)
        f(ref)
        assert torch.equal(d.full(), ref) and d.placements == tuple(ps)
    snap = snapshot(d)
    try:
        d.view(20).add_(1)                      # a view op that must move data: raises ...
        ref.view(20).add_(1)
    except NotImplementedError as e:
        assert "view of a DistTensor" in str(e) and "base" in str(e)
        assert same_as(d, snap)                 # ... untouched
    assert torch.equal(d.full(), ref)
    e = dist(ints((1, 4)), mesh, [R] * mesh.ndim)
    with pytest.raises(RuntimeError, match="single memory location"):
        e.expand(3, 4).add_(1)                  # as torch


@pytest.mark.parametrize("mesh,ps", [lp for _, lp in SUM_LAYOUTS], ids=[i for i, _ in SUM_LAYOUTS])
def test_writes_through_views_are_recorded_by_autograd(mesh, ps):
    x, w = ints((5, 4), 1), ints((5, 4), 2)
    xr = x.clone().requires_grad_()
    h = xr * 2
    h[1:].mul_(3)
    h[:, 1].add_(xr[:, 0])
    (h * w).sum().backward()
    xd = dist(x, mesh, ps).requires_grad_()
    hd = xd * 2
    hd[1:].mul_(3)
    hd[:, 1].add_(xd[:, 0])
    (hd * w).sum().backward()
    assert torch.equal(hd.full(), h.detach()) and torch.equal(xd.grad.full(), xr.grad)
    with pytest.raises(RuntimeError, match="view of a leaf Variable"):
        xd[0].zero_()
    assert torch.equal(xd.full(), x)


# ---- facts, factories, any / all -----------------------------------------------------------

@pytest.mark.parametrize("mesh,ps", LAYOUTS, ids=IDS)
def test_facts_and_like_factories_follow_torch(mesh, ps):
    x = ints((5, 4), 1)
    d = dist(x, mesh, ps)
    for name in ("is_floating_point", "is_complex", "is_signed", "element_size", "nelement",
                 "ndimension", "get_device"):
        assert getattr(d, name)() == getattr(x, name)(), name
    for name in ("is_cuda", "is_cpu", "is_meta", "is_sparse", "layout", "itemsize", "nbytes"):
        assert getattr(d, name) == getattr(x, name), name
    assert d.cpu() is d and np.array_equal(d.numpy(), x.numpy())
    with pytest.raises(RuntimeError, match="detach"):
        d.detach().requires_grad_().numpy()
    for f in (torch.zeros_like, torch.ones_like, lambda t: torch.full_like(t, 3.5),
              lambda t: torch.zeros_like(t, dtype=torch.bool),
              lambda t: torch.randn_like(t) if torch.manual_seed(4) else None,
              lambda t: t.new_ones((2, 3)), lambda t: t.new_tensor([1, 2]),
              lambda t: t.new_full((3,), 2.0, dtype=torch.float64)):
        got, ref = f(d), f(x)
        assert isinstance(got, wb.DistTensor) and got.mesh == mesh
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got.full(), ref)
    z = torch.ones_like(d, requires_grad=True)
    assert z.requires_grad and z.is_leaf and z.placements == tuple(ps)


ANY_ALL = {"any": lambda t: t.any(), "all": lambda t: t.all(), "any(0)": lambda t: t.any(0),
           "all(1, keepdim)": lambda t: torch.all(t, 1, keepdim=True),
           "any(dim=())": lambda t: t.any(dim=()), "all((-1, 0))": lambda t: t.all(dim=(-1, 0))}


def _holds(ps, dtype) -> bool:
    try:
        check_partial_dtype(ps, dtype)          # e.g. P(sum) of bools is not a layout
        return True
    except ValueError:
        return False


ANY_CASES = [(m, ps, dt) for m, ps in LAYOUTS for dt in (torch.float32, torch.bool, torch.int64)
             if _holds(ps, dt)]


@pytest.mark.parametrize("mesh,ps,dtype", ANY_CASES,
                         ids=[f"{m.shape}-{[str(p) for p in ps]}-{dt}" for m, ps, dt in ANY_CASES])
def test_any_all(mesh, ps, dtype):
    x = ints((5, 4), 1, -1, 2).to(dtype)
    d = dist(x, mesh, ps)
    for name, f in ANY_ALL.items():
        got, ref = f(d), f(x)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got.full(), ref), name


def test_new_rules_have_no_wrong_candidate():
    """The validator forces every candidate of the new rules (uneven splits, unequal
    Partial parts) against one device."""
    from workbench.parallel.validate import validate
    rep = validate(["floor_divide", "bitwise_xor", "bitwise_not", "lerp", "any", "all",
                    "einsum"], meshes=((3,), (2, 2)), max_layouts=1, missing=False)
    assert rep.wrong == [] and not rep.skipped and rep.runs > 50, rep


@pytest.mark.parametrize("mesh,ps", LAYOUTS, ids=IDS)
def test_masks_given_as_dist_tensors_and_gradients_written_in_place(mesh, ps):
    x = ints((5, 4), 1)
    d, ref = dist(x, mesh, ps), x.clone()
    d[d > 0] = 0.0                               # a DistTensor mask (gathered, traced)
    ref[ref > 0] = 0
    assert torch.equal(d.full(), ref)
    d.masked_fill_(d < -3, 1.5)
    assert torch.equal(d.full(), ref.masked_fill(ref < -3, 1.5))
    if (mesh, ps) not in [lp for _, lp in SUM_LAYOUTS]:
        return
    w = dist(x, mesh, ps).requires_grad_()
    (w * w).sum().backward()
    w.grad.mul_(0.5)                             # clip_grad_norm_'s scaling, zero_grad(False)
    assert torch.equal(w.grad.full(), x)
    w.grad.zero_()
    assert torch.equal(w.grad.full(), torch.zeros(5, 4))
