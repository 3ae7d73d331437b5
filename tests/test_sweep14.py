"""Random sweep 14: NaN / inf / signed-zero differences from one device found by the random
sweep (``benchmarks/random_sweep.py``) and probes, and the ops torch has that the op table
lacked (torch.mode, logaddexp, nextafter, ldexp, special.xlog1py / zeta, igamma, gcd / lcm,
renorm, pairwise_distance, Tensor.unfold).  Each test holds a DistTensor call to torch on
the full tensor; the docstrings say what was wrong before."""
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute

M1 = wb.Mesh.grid(2, ["a"])
M2 = wb.Mesh([[0, 1], [2, 3]])
INF = float("inf")


def _d(x, ps, mesh=M2, seed=3):
    return distribute(x, mesh, parse_placements(ps), seed=seed)


def _same(got, want):
    """Values equal with NaNs in the same places and zeros of the same sign."""
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(want)), (got, want)


# ---- a partial sum times a factor holding inf: matmul-class ops --------------------------

_MATMULS = {
    "matmul": torch.matmul, "mm": torch.mm,
    "bmm": lambda a, b: torch.bmm(a.unsqueeze(0), b.unsqueeze(0)),
    "linear": lambda a, b: F.linear(a, b.t()),
    "einsum": lambda a, b: torch.einsum("ij,jk->ik", a, b),
    "addmm": lambda a, b: torch.addmm(torch.ones((), dtype=a.dtype), a, b),
}


@pytest.mark.parametrize("op", sorted(_MATMULS))
@pytest.mark.parametrize("partial_first", [True, False])
@pytest.mark.parametrize("mesh,ps", [(M1, ["P(sum)"]), (M2, ["P(sum)", "S(0)"]),
                                     (M2, ["R", "P(sum)"])])
def test_partial_sum_matmul_by_a_factor_holding_inf(op, partial_first, mesh, ps):
    """x P(sum) @ w with w holding inf: part by part a_ik inf + b_ik inf is nan where the
    parts differ in sign, where one device gives x_ik inf = +-inf (mul / div had the guard,
    the matmul-class ops not: nan in every such column)."""
    f = _MATMULS[op]
    x = torch.tensor([[1.0, 2.0], [0.5, -1.0]], dtype=torch.float64)
    w = torch.tensor([[INF, 1.0, -2.0], [2.0, 3.0, -INF]], dtype=torch.float64)
    vals = (x, w) if partial_first else (w.t().contiguous(), x.t().contiguous())
    refs = [v.clone().requires_grad_(True) for v in vals]
    want = f(*refs)
    k = 0 if partial_first else 1                                  # the partial input
    ds = [distribute(v, mesh, parse_placements(ps if i == k else ["R"] * mesh.ndim),
                     seed=5).requires_grad_(True) for i, v in enumerate(vals)]
    got = f(*ds)
    _same(got.full(), want.detach())
    gy = torch.arange(want.numel(), dtype=torch.float64).reshape(want.shape) / 4 - 0.6
    (want * gy).sum().backward()
    (got * gy).sum().backward()
    for d, r in zip(ds, refs):
        torch.testing.assert_close(d.grad.full(), r.grad, equal_nan=True)


@pytest.mark.parametrize("bias", [False, True])
def test_partial_sum_conv_by_a_weight_holding_inf(bias):
    """conv1d of a P(sum) input by a weight holding inf: the partial sum is reduced first
    (the bias is added, not a factor: not read)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, dtype=torch.float64, generator=g)
    w = torch.randn(3, 2, 2, dtype=torch.float64, generator=g)
    w[0, 1, 0] = INF
    b = torch.randn(3, dtype=torch.float64, generator=g) if bias else None
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want = F.conv1d(xr, wr, b)
    dx = _d(x, ["P(sum)"], M1).requires_grad_(True)
    dw = _d(w, ["R"], M1).requires_grad_(True)
    got = F.conv1d(dx, dw, None if b is None else _d(b, ["R"], M1))
    _same(got.full(), want.detach())
    gy = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (want * gy).sum().backward()
    (got * gy).sum().backward()
    torch.testing.assert_close(dx.grad.full(), xr.grad, equal_nan=True)
    torch.testing.assert_close(dw.grad.full(), wr.grad, equal_nan=True)


def test_partial_sum_matmul_without_inf_stays_partial():
    """No inf in the factor: x P(sum) @ w keeps its partial output (nothing reduced)."""
    x = torch.tensor([[1.0, 2.0], [0.5, -1.0]], dtype=torch.float64)
    w = torch.tensor([[0.0, 1.0], [2.0, 3.0]], dtype=torch.float64)
    got = _d(x, ["P(sum)"], M1) @ _d(w, ["R"], M1)
    assert got.placements[0].is_partial()
    torch.testing.assert_close(got.full(), x @ w)


# ---- var / std of a slice holding inf: torch's var_backward ---------------------------------

_VARS = {
    "var1": lambda t: t.var(1), "var0": lambda t: torch.var(t, 0, keepdim=True),
    "var": lambda t: t.var(), "std1": lambda t: t.std(1),
    "var_mean": lambda t: torch.var_mean(t, 1)[0], "std_mean": lambda t: torch.std_mean(t, 1)[0],
    "var_mean_both": lambda t: sum(torch.var_mean(t, 1, correction=0)),
}


@pytest.mark.parametrize("fn", sorted(_VARS))
@pytest.mark.parametrize("mesh,ps", [(M1, ["R"]), (M1, ["S(1)"]), (M2, ["S(0)", "S(1)"])])
@pytest.mark.parametrize("which", ["inf", "both"])
def test_var_gradient_of_a_slice_holding_inf(fn, mesh, ps, which):
    """A row holding inf: torch's var_backward is (2 / (N - c)) grad (x - mean), -inf beside
    the inf's own nan (x - mean = finite - inf); the composition's gradient through the
    mean, -2 sum(x - mean) / N = nan, made the whole row nan."""
    f = _VARS[fn]
    x = torch.tensor([[1.0, INF, 2.0, 3.0], [1.0, 2.0, 4.0, -1.0],
                      [-INF if which == "both" else 0.25, 0.5, 1.0, 2.0]], dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    want = f(xr)
    dx = distribute(x, mesh, parse_placements(ps)).requires_grad_(True)
    got = f(dx)
    torch.testing.assert_close(got.full(), want.detach(), equal_nan=True)
    gy = torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64).reshape(want.shape)
    (want * gy).sum().backward()
    (got * gy).sum().backward()
    torch.testing.assert_close(dx.grad.full(), xr.grad, equal_nan=True)


# ---- signed zeros of a partial sum scaled part by part -------------------------------------

_ZEROS = torch.tensor([[0.0, 1.0, 0.0], [0.0, -0.0, 2.0]], dtype=torch.float64)
_SCALES = {
    "mul_tensor": lambda a: a * _ZEROS, "mul_0": lambda a: a * 0, "rmul_0.0": lambda a: 0.0 * a,
    "torch.mul": lambda a: torch.mul(a, _ZEROS), "mul_bool": lambda a: a * (_ZEROS != 0),
    "mul_long": lambda a: a * (_ZEROS != 0).long(),
    "div_inf": lambda a: a / torch.full((3,), INF, dtype=torch.float64),
    "div_int0": lambda a: a / torch.tensor([1, 0, 2]),
}


@pytest.mark.parametrize("op", sorted(_SCALES))
@pytest.mark.parametrize("mesh,ps", [(M1, ["P(sum)"]), (M2, ["S(1)", "P(sum)"])])
def test_partial_sum_times_zero_keeps_the_sign(op, mesh, ps):
    """v * 0 is -0 for v < 0 on one device; part by part a * 0 + b * 0 with parts of either
    sign is +0 (seed 2005232 wide: digamma(-0) = +inf read -inf); a divisor holding inf
    the same; a divisor holding 0 of an integer tensor gave nan (inf - inf) where torch
    gives +-inf (integer divisors were not read)."""
    f = _SCALES[op]
    x = torch.tensor([[-1.5, 2.0, -0.25], [0.5, -3.0, 1.0]], dtype=torch.float64)
    _same(f(_d(x, ps, mesh)).full(), f(x))


def test_partial_sum_times_a_nonzero_factor_stays_partial():
    """A factor with no zero and no inf: the product stays partial (nothing read changes)."""
    x = torch.tensor([[-1.5, 2.0, -0.25], [0.5, -3.0, 1.0]], dtype=torch.float64)
    for f in (lambda a: a * 2.0, lambda a: a * (_ZEROS + 1.5), lambda a: a / 3):
        got = f(_d(x, ["P(sum)"], M1))
        assert got.placements[0].is_partial()
        torch.testing.assert_close(got.full(), f(x))


def test_bfloat16_gradient_of_a_replicated_input_is_summed_per_rank():
    """Documented, not matched (seed 1061466): a float32 0-d input added to a bfloat16
    tensor sharded over 2 ranks.  One device sums the bfloat16 gradient in one kernel and
    rounds once to bfloat16 (7.0); here each rank's gradient is summed and cast to float32
    by autograd (torch's engine: sum_to, then the input's dtype), and the ranks' float32
    values are summed (7.013671875), as DTensor's all-reduce of a replicated input's
    gradient: both within half a bfloat16 ulp of the exact sum."""
    a = torch.tensor([[2.013095262850718, 0.2324157861326391, -0.7603877096222161]],
                     dtype=torch.float64)
    b = torch.tensor(0.4966769516468048, dtype=torch.float32)
    gy = torch.tensor([[-0.1796875, -0.494140625, 7.6875]], dtype=torch.bfloat16)
    ar, br = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    ((ar.to(torch.bfloat16) + br) * gy).sum().backward()
    da = _d(a, ["S(1)"], M1).requires_grad_(True)
    db = _d(b, ["R"], M1).requires_grad_(True)
    ((da.to(torch.bfloat16) + db) * _d(gy, ["S(1)"], M1)).sum().backward()
    got, want = db.grad.full(), br.grad
    per_rank = sum(c.sum().float() for c in gy.chunk(2, 1))       # ranks: 2 and 1 columns
    assert got == per_rank == 7.015625 and want == gy.sum().float() == 7.0
    exact = gy.double().sum()
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs())) - 7)
    assert abs(got.double() - exact) <= ulp / 2 and abs(want.double() - exact) <= ulp / 2


# ---- ops torch has that the table lacked ----------------------------------------------------

from tests.spmd_harness import check_op  # noqa: E402
from workbench.parallel.ops_table.strategy import NoRuleError  # noqa: E402

_G = torch.Generator().manual_seed(14)
_X = torch.randn(4, 6, generator=_G, dtype=torch.float64)
_Y = torch.randn(4, 6, generator=_G, dtype=torch.float64)
_P, _Q = _X.abs() + 0.3, _Y.abs() + 0.2
_T3 = torch.randn(3, 4, 5, generator=_G, dtype=torch.float64)
_MESHES = [M1, wb.Mesh.grid((2, 2), ["a", "b"])]
_I1 = torch.tensor([1, -2, 3, 0, 1, 2])

# name -> (function, inputs, layouts of Partial too, gradient checked)
NEW_OPS = {
    "logaddexp": (torch.logaddexp, [_X, _Y], True, True),
    "logaddexp2": (torch.logaddexp2, [_X, _Y[0]], True, True),
    "nextafter": (torch.nextafter, [_X, _Y], True, True),
    "xlog1py": (torch.special.xlog1py, [_X, _P], True, True),
    "special.xlogy": (torch.special.xlogy, [_X, _P], True, True),
    "zeta": (lambda x, q: torch.special.zeta(x + 1.5, q), [_P, _Q], True, False),
    "igamma": (torch.igamma, [_P, _Q], True, False),
    "gammaincc": (torch.special.gammaincc, [_P, _Q], True, False),
    "gcd": (lambda a, b: torch.gcd((a * 4).long(), (b * 4).long()), [_X, _Y], True, False),
    "lcm": (lambda a, b: torch.lcm((a * 4).long(), (b * 4).long()), [_X, _Y], True, False),
    "ldexp": (lambda x: torch.ldexp(x, _I1), [_X], True, True),
    "mode": (lambda x: tuple(torch.mode(x, 1)), [_X], True, True),
    "mode_ties": (lambda x: tuple(torch.mode((x * 2).round(), 0, True)), [_X], False, False),
    "renorm": (lambda x: torch.renorm(x, 2, 0, 1.0), [_X], True, True),
    "renorm_3d": (lambda x: x.renorm(1, -1, 2.0), [_T3], True, True),
    "pairwise_distance": (F.pairwise_distance, [_X, _Y], True, True),
    "pairwise_distance_bcast": (lambda a, b: F.pairwise_distance(a, b, 1.5, keepdim=True),
                                [_X, _Y[0]], True, True),
    "unfold": (lambda x: x.unfold(1, 3, 2), [_X], True, True),
    "unfold_overlap": (lambda x: x.unfold(0, 2, 1), [_X], True, True),
    "unfold_3d": (lambda x: x.unfold(-1, 2, 2), [_T3], True, True),
}


@pytest.mark.parametrize("name", sorted(NEW_OPS))
def test_new_op_equals_one_device_on_every_layout(name):
    """Every combination of R / S(d) / P(sum) (unequal parts) per input on a 2-rank and a
    2x2 mesh: values, shapes and dtypes as torch's (ties of mode: exact values only, no
    Partial, whose parts' sum rounds)."""
    fn, ins, partial, _ = NEW_OPS[name]
    # two floating inputs: a fixed quarter of the 2x2 mesh's 256 combinations (crc32 of the
    # layouts), every one of the 2-rank mesh's 16
    few = sum(x.is_floating_point() for x in ins) > 1
    n = check_op(fn, ins, meshes=_MESHES, partial=partial,
                 skip=lambda mesh, combo: few and mesh.ndim == 2 and
                 zlib.crc32(str(combo).encode()) % 4 != 0)
    assert n >= 12
    dist = [_d(x, ["S(0)", "R"]) for x in ins]
    outs, refs = fn(*dist), fn(*ins)
    for o, r in zip(outs if isinstance(outs, tuple) else (outs,),
                    refs if isinstance(refs, tuple) else (refs,)):
        assert o.dtype == r.dtype and o.shape == r.shape


@pytest.mark.parametrize("name", sorted(n for n, v in NEW_OPS.items() if v[3]))
@pytest.mark.parametrize("ps", [["R", "R"], ["S(0)", "S(1)"], ["P(sum)", "S(0)"]])
def test_new_op_gradient_equals_one_device(name, ps):
    """The gradients of every input, laid out on the 2x2 mesh, equal torch's."""
    fn, ins, _, _ = NEW_OPS[name]
    refs = [x.clone().requires_grad_(True) for x in ins]
    want = fn(*refs)
    want = want[0] if isinstance(want, tuple) else want
    ds = [_d(x, ps if x.dim() >= 2 else [p if p != "S(1)" else "R" for p in ps],
             seed=7 + i).requires_grad_(True) for i, x in enumerate(ins)]
    got = fn(*ds)
    got = got[0] if isinstance(got, tuple) else got
    gy = torch.linspace(-1.0, 2.0, want.numel(), dtype=want.dtype).reshape(want.shape)
    (want * gy).sum().backward()
    (got * gy).sum().backward()
    for d, r in zip(ds, refs):
        torch.testing.assert_close(d.grad.full(), r.grad)


@pytest.mark.parametrize("call", [
    lambda a, b: torch.special.zeta(a + 1.5, b.abs() + 0.1),    # x's: not implemented
    lambda a, b: torch.igamma(a.abs() + 0.1, b.abs() + 0.1),    # input's: not implemented
])
def test_new_op_backward_torch_does_not_implement_raises_as_torch(call):
    a, b = _X.clone().requires_grad_(True), _Y.clone()
    with pytest.raises(RuntimeError):
        call(a, b).sum().backward()
    da = _d(_X, ["S(0)", "R"]).requires_grad_(True)
    with pytest.raises(RuntimeError):
        call(da, _d(_Y, ["R", "S(1)"])).sum().backward()


@pytest.mark.parametrize("call,exc", [
    (lambda x: torch.gcd(x, x), RuntimeError),                 # floats: no gcd kernel
    (lambda x: torch.renorm(x[0], 2, 0, 1.0), RuntimeError),   # 1-d: needs 2 dims
    (lambda x: torch.renorm(x, -1, 0, 1.0), RuntimeError),     # a negative p
    (lambda x: x.unfold(1, 7, 1), RuntimeError),               # a window past the dim
    (lambda x: x.unfold(2, 1, 1), IndexError),                 # no dim 2
    (lambda x: x.unfold(1, 2, 0), RuntimeError),               # step 0
    (lambda x: torch.mode(x, 2), IndexError),
    (lambda x: torch.mode(x.to(torch.complex64), 1), NotImplementedError),
    (lambda x: F.pairwise_distance(x, x[:, :4]), RuntimeError),   # shapes do not broadcast
])
def test_new_op_errors_are_torchs(call, exc):
    """Bad arguments raise torch's exception type, on a DistTensor as on a tensor."""
    with pytest.raises(exc):
        call(_X)
    with pytest.raises(exc):
        call(_d(_X, ["S(0)", "S(1)"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_new_pointwise_ops_keep_torchs_dtypes(dtype):
    """16- and 32-bit inputs, and a float64 0-d beside them: the result dtype and values
    torch's (a 0-d tensor does not promote)."""
    x, y = _X.to(dtype), _Y.to(dtype)
    z = torch.tensor(0.5, dtype=torch.float64)
    for f in (torch.logaddexp, torch.logaddexp2, lambda a, b: torch.logaddexp(a, z),
              lambda a, b: torch.special.xlog1py(a, b.abs()), torch.nextafter):
        want = f(x, y)
        got = f(_d(x, ["S(1)", "R"]), _d(y, ["R", "S(0)"]))
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.full(), want)


def test_ldexp_of_integers_is_torchs_float():
    """An integer input and exponent: torch's mul(x, pow(2.0, e)) is the default float."""
    a = torch.tensor([[1, -3, 2], [0, 5, 7]])
    e = torch.tensor([2, 0, -1])
    want = torch.ldexp(a, e)
    got = torch.ldexp(_d(a, ["S(0)", "R"]), _d(e, ["R", "S(0)"]))
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got.full(), want)


def test_unfold_of_the_sharded_dim_gathers_and_others_stay_sharded():
    """A sharded dim being unfolded is made whole (a window may straddle two shards); a
    sharded dim not unfolded stays sharded; a Partial stays Partial (a view)."""
    d = _d(_X, ["S(1)", "S(0)"])
    u = d.unfold(1, 3, 2)
    assert tuple(p for p in u.placements) == (wb.Replicate(), wb.Shard(0))
    torch.testing.assert_close(u.full(), _X.unfold(1, 3, 2))
    p = _d(_X, ["P(sum)", "R"]).unfold(0, 2, 1)
    assert p.placements[0].is_partial()
    torch.testing.assert_close(p.full(), _X.unfold(0, 2, 1))


def test_unfold_and_mode_of_a_ring_ordered_dim_are_refused():
    """The windows (and mode's index) read positions along the dim: on a sequence in
    load-balanced ring order they would give another answer than on its own order."""
    from workbench.parallel.seq_order import RingOrderError
    from workbench.parallel.strategies.context_parallel import to_ring_layout
    mesh = wb.Mesh.grid(2, ["cp"])
    x = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    r = to_ring_layout(wb.shard_tensor(x, mesh, [wb.Replicate()]), "cp", 1)
    with pytest.raises(RingOrderError):
        r.unfold(1, 2, 1)
    with pytest.raises(RingOrderError):
        torch.mode(r, 1)
    u = r.unfold(2, 2, 1)                  # another dim: the windows and the order kept
    assert u.placements == r.placements and u._ring_order == r._ring_order


def test_zeta_gradient_in_q_and_igamma_in_x_equal_one_device():
    """torch implements zeta's gradient in q and igamma / igammac's in x only."""
    for f in (lambda a, b: torch.special.zeta(a.detach() + 1.5, b),
              lambda a, b: torch.igamma(a.detach(), b),
              lambda a, b: torch.igammac(a.detach(), b)):
        qr = _Q.clone().requires_grad_(True)
        (f(_P, qr) * _X).sum().backward()
        dq = _d(_Q, ["S(1)", "P(sum)"]).requires_grad_(True)
        (f(_d(_P, ["S(0)", "R"]), dq) * _d(_X, ["R", "R"])).sum().backward()
        torch.testing.assert_close(dq.grad.full(), qr.grad)


# ---- new sweep seeds (wide 2010200.., old 1064000..) ---------------------------------------

@pytest.mark.parametrize("ps", [["S(1)"], ["R"], ["P(sum)"]])
@pytest.mark.parametrize("src,to", [((1, 7), (14,)), ((1, 7), (2, 7, 1)),
                                    ((3, 1, 4), (3, 20)), ((3, 1, 4), (15, 4)),
                                    ((3, 1, 4), (3, 5, 2, 2)), ((3, 1, 4), (60,))])
def test_view_of_an_expanded_tensor_is_judged_on_its_zero_strides(ps, src, to):
    """x.expand(...).view(shape) raises where torch's does (an expanded dim has stride 0:
    it merges with no other); the global strides were judged dense, so view((14,)) of a
    (1, 7) tensor expanded to (2, 7) returned a result (seed 2011360 wide)."""
    x = torch.randn(src, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    big = (2, 7) if src == (1, 7) else (3, 5, 4)
    kind, want = _kind(lambda: x.expand(big).view(to))
    got_kind, got = _kind(lambda: _d(x, ps, M1).expand(big).view(to))
    assert got_kind == kind
    if kind == "ok":
        torch.testing.assert_close(got.full(), want)


def _kind(f):
    try:
        return "ok", f()
    except Exception as e:  # noqa: BLE001 - the type is compared with torch's
        return type(e), None


@pytest.mark.parametrize("mat", [(6, 0), (0, 3)])
@pytest.mark.parametrize("inp", [(), (1,), (6,)])
@pytest.mark.parametrize("beta", [-1.18, 1, 0])
def test_addmv_of_an_empty_matrix_is_torchs_cpu_kernel(mat, inp, beta):
    """addmv of a matrix with no element: torch's CPU kernel gives input * beta in input's
    own shape (a 0-d input, a 0-d result), zeros of (n,) for beta 0; was broadcast to (n,)
    (seed 2013627 wide)."""
    if inp == (6,) and mat[0] != 6:
        return
    i = torch.arange(1.0, 1.0 + (inp[0] if inp else 1), dtype=torch.float64).reshape(inp)
    m, v = torch.zeros(mat, dtype=torch.float64), torch.zeros(mat[1], dtype=torch.float64)
    ir = i.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # torch's deprecated resize of its output
        want = torch.addmv(ir, m, v, beta=beta, alpha=-0.76)
    di = _d(i, ["R"], M1).requires_grad_(True)
    got = torch.addmv(di, _d(m, ["S(0)"] if mat[0] else ["R"], M1), _d(v, ["R"], M1),
                      beta=beta, alpha=-0.76)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.full(), want.detach())
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(di.grad.full(), ir.grad)

