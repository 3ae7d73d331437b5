"""Random sweep 9: the global strides of layouts whose shards lost a dim's place (each
shard holds at most one element of it) are kept beside the shards, as torch would have
them, so that ``.view`` decides as torch's; indexing with bools beside other indices;
... (see each test's docstring)."""
import random

import pytest
import torch

import workbench as wb
from tests.random_programs import run_program
from workbench.parallel import strides
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate import distribute

R, S = wb.Replicate(), wb.Shard


def _x(*shape, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=dtype)


def _same_strides(d, t):
    """d's strides are t's on every dim of more than one element (a size-1 dim's stride is
    arbitrary in torch), and is_contiguous agrees."""
    assert d.is_contiguous() == t.is_contiguous()
    assert all(d.stride(k) == t.stride(k) for k in range(t.ndim) if t.shape[k] > 1), \
        (d.stride(), t.stride())


# ---- item 2: view after a transpose whose shards hold one element of a dim -----------------
def test_seed_1040236_view_after_transpose_raises_as_torch():
    """Was: a result where torch raises ("view size is not compatible"): the shards of the
    clone are (4, 1) and (3, 1), whose strides cannot tell the transposed order."""
    mesh = wb.Mesh([[[2], [7]], [[0], [5]], [[3], [6]], [[1], [4]]])
    x = _x(2, 7)
    t1 = distribute(x, mesh, parse_placements(["P(max)", "S(1)", "R"]), seed=238)
    # (the seed's clone reduce-scattered the P(max) into this layout; a clone keeps a
    # Partial since compile18, as DTensor's: the layout is laid out explicitly here)
    t5 = torch.positive(torch.nn.functional.softplus(t1.transpose(1, 0)).redistribute(
        mesh, parse_placements(["S(1)", "S(0)", "R"])).clone().sigmoid_())
    r5 = torch.positive(torch.nn.functional.softplus(t1.full().transpose(1, 0)).clone()
                        .sigmoid_())
    assert strides.lost_dims(t5)              # every shard holds one column or none
    _same_strides(t5, r5)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        r5.view(-1)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        t5.view(-1)
    assert torch.equal(t5.reshape(-1).full(), r5.reshape(-1))


def test_seed_1040236_program_is_ok():
    out = run_program(random.Random(1040236))
    assert out.status == "ok", out.detail


@pytest.mark.parametrize("heads_dim", [1, 2])
def test_view_of_freshly_sharded_heads_still_works(heads_dim):
    """4 heads over 4 ranks: every shard holds one head; a contiguous tensor views."""
    x = _x(2, 4, 5, 8) if heads_dim == 1 else _x(2, 5, 4, 8)
    d = wb.shard_tensor(x, wb.Mesh.grid((4,), ["tp"]), [S(heads_dim)])
    assert strides.lost_dims(d) == (heads_dim,)
    _same_strides(d, x)
    for shape in ((-1,), (2, -1), (2, x.shape[1], -1)):
        assert torch.equal(d.view(*shape).full(), x.view(*shape))


@pytest.mark.parametrize("f", [
    lambda t: t.transpose(1, 2),
    lambda t: t.transpose(1, 2).exp(),
    lambda t: t.transpose(1, 2).clone(),
    lambda t: torch.positive(t.permute(2, 0, 3, 1) * 2),
    lambda t: t.transpose(1, 2).contiguous(),
    lambda t: t.transpose(1, 2) + t.transpose(1, 2).exp(),
    lambda t: torch.zeros_like(t.transpose(1, 2)),
    lambda t: t.transpose(1, 2).detach(),
])
def test_strides_follow_torch_through_ops(f):
    """stride(), is_contiguous() and view() of results of ops on a layout whose shards
    hold one head each: torch's (was NotImplementedError for stride(), and a view judged
    on no strides at all)."""
    x = _x(2, 5, 4, 8)
    d = wb.shard_tensor(x, wb.Mesh.grid((4,), ["tp"]), [S(2)])
    got, want = f(d), f(x)
    _same_strides(got, want)
    for shape in ((-1,), (2, -1), (2, 4, -1)):
        try:
            ref = want.view(*shape)
        except RuntimeError:
            with pytest.raises(RuntimeError, match="view size is not compatible"):
                got.view(*shape)
        else:
            assert torch.equal(got.view(*shape).full(), ref)


@pytest.mark.parametrize("placements", [[R], [S(3)], [S(0)]])
def test_reshard_keeps_the_strides(placements):
    """DTensor.redistribute keeps the spec's strides: a transposed layout stays one."""
    x = _x(2, 5, 4, 8)
    d = wb.shard_tensor(x, wb.Mesh.grid((4,), ["tp"]), [S(2)]).transpose(1, 2)
    _same_strides(wb.reshard(d, d.mesh, placements), x.transpose(1, 2))


def test_leaf_gradient_has_the_leafs_strides():
    """torch's AccumulateGrad lays a leaf's gradient out as the leaf."""
    x = _x(3, 4)
    leaf = x.t().clone().t().requires_grad_()      # (3, 4) of strides (1, 3)
    d = wb.shard_tensor(x.t(), wb.Mesh.grid((3,), ["a"]), [S(1)]).clone().t()
    d = d.detach().requires_grad_()
    (leaf * 2).sum().backward()
    (d * 2).sum().backward()
    _same_strides(d, leaf)
    _same_strides(d.grad, leaf.grad)


def test_view_of_unknown_strides_is_judged_on_every_order():
    """A layout whose strides are not known (built from the storage directly): a view
    that every order of the lost dim allows runs, one that depends on the order is
    refused, naming .reshape (was: judged on no strides, as if torch allowed it)."""
    mesh = wb.Mesh.grid((3,), ["a"])
    src = wb.shard_tensor(_x(3, 4, 5), mesh, [S(0)])
    d = wb.DistTensor(src._local, mesh, src.placements, src.shape)      # nothing kept
    with pytest.raises(NotImplementedError, match="cannot tell that dim"):
        d.stride()
    assert d.view(3, 4, 5, 1).shape == (3, 4, 5, 1)      # any order allows new dims
    assert d.view(1, 3, 4, 1, 5).shape == (1, 3, 4, 1, 5)
    for shape in ([60], [3, 20], [12, 5]):       # (4, 3, 5) strides would not allow them
        with pytest.raises(NotImplementedError, match=rf"\.reshape\({shape}\)".replace("[", r"\[")):
            d.view(shape)


# ---- item 3: indexing.mixed_index ended with an AssertionError shape guard ------------------
def _u8(v):
    return torch.tensor(v, dtype=torch.uint8)


INDICES = [
    (True, [0, 1]),                          # was AssertionError: True read as the int 1
    (None, True, slice(None), [1, 2]),       # was AssertionError
    (0, [1, 2], True),                       # was AssertionError
    (_u8(1), [0, 1]),                        # was AssertionError: a 0-d uint8 is a bool
    ([0, 1], _u8(1)),
    (_u8(0), 0),                             # was a (4,) result, torch's (0, 3, 4)
    (torch.tensor(True), 0),                 # was IndexError: tuple index out of range
    (torch.tensor(True),), (True,), (False,), (True, False), (Ellipsis, True),
    (True, 0),                               # were refused (NotImplementedError)
    (True, [0, 1], True), (_u8(2),),
    ([0.5, 1.2],), ([],), ([[]],), ([], [0]), ([0.7], [1]),   # lists as torch reads them
    ([True], 0),                             # was a result: torch's mask-shape IndexError
    (torch.tensor(False), [0, 1]),           # was RuntimeError: torch's IndexError
    (slice(None), torch.tensor([True, False, True]), False),
    (torch.tensor(1.0), [0]),                # was RuntimeError: torch's IndexError
    ([1, 0], slice(None), [2, 3]), (torch.tensor([[0, 1]]), 1, [[2], [3]]),
    ([0, -1], slice(1, None), [-4, 3]), (1, [5]), ([0, 2], 0, 0),   # bounds: torch's
    ([[0, 1], [1, 0]],),
]


def _torch_or_error(f):
    try:
        return f(), None
    except Exception as e:                   # noqa: BLE001 - compared with ours
        return None, e


@pytest.mark.parametrize("placements", [[S(0)], [S(1)], [S(2)], [R]])
@pytest.mark.parametrize("k", range(len(INDICES)))
def test_mixed_indices_are_torchs(k, placements):
    """Bools beside other indices (a new dim indexed by [0] or []), 0-d uint8 tensors (a
    bool), lists (int64 unless bool), mask shapes and bounds: torch's result or torch's
    exception type (mixed_index's AssertionError is not reached)."""
    idx = INDICES[k]
    x = torch.arange(24.0, dtype=torch.float64).reshape(2, 3, 4)
    d = wb.shard_tensor(x, wb.Mesh.grid((2,), ["a"]), placements)
    want, err = _torch_or_error(lambda: x[idx])
    if err is not None:
        with pytest.raises(type(err)):
            d[idx]
        return
    got = d[idx]
    assert got.shape == want.shape and torch.equal(got.full(), want)


def test_list_of_sequences_indexes_as_a_tuple():
    """torch (NumPy's deprecated rule): x[[[0, 1], [1, 2]]] is x[[0, 1], [1, 2]], with a
    warning; it was one 2-d index tensor here, a (2, 2, 3, 4) result for torch's (2, 4)."""
    x = torch.arange(24.0).reshape(2, 3, 4)
    d = wb.shard_tensor(x, wb.Mesh.grid((2,), ["a"]), [S(1)])
    for idx in ([[0, 1], [1, 2]], [0, slice(None), [1, 3]], [0, None]):
        with pytest.warns(UserWarning, match="non-tuple sequence"):
            want = x[idx]
        with pytest.warns(UserWarning, match="non-tuple sequence"):
            got = d[idx]
        assert torch.equal(got.full(), want)
    assert torch.equal(d[[0, 1]].full(), x[[0, 1]])        # no sequence inside: an index


# ---- item 1: the sweep's refusals where torch computes an answer ---------------------------
@pytest.mark.parametrize("seed", [
    1042115, 1043049,     # bmm float32 x float64 of an empty contraction: refused
    1044382, 1044502,     # a partial sum times a tensor holding inf / nan: refused
])
def test_sweep_seeds_are_ok(seed):
    out = run_program(random.Random(seed))
    assert out.status == "ok", out.detail


def test_a_partial_sum_squared_with_an_infinite_value_is_torchs():
    """``d * d`` of a partial sum: the rule reduces one operand, whose value (inf) was then
    the factor of the other's parts: refused.  Now reduced first: torch's inf; a nan
    factor gives nan part by part as the sum does (no longer refused)."""
    mesh = wb.Mesh.grid((2,), ["a"])
    x = torch.tensor([1.0, float("inf"), -2.0, float("nan")], dtype=torch.float64)
    d = wb.from_local([x / 2, x / 2], mesh, [wb.Partial()])
    torch.testing.assert_close((d * d).full(), x * x, equal_nan=True)
    w = torch.tensor([1.0, float("nan"), 2.0, 3.0], dtype=torch.float64)
    e = wb.from_local([w / 4, w * 3 / 4], mesh, [wb.Partial()])
    torch.testing.assert_close((e * w).full(), w * w, equal_nan=True)
    assert (e * w).placements == (wb.Partial(),)        # nan: scaled part by part


def test_bmm_of_two_dtypes_with_an_empty_contraction_is_torchs():
    mesh = wb.Mesh.grid((2,), ["a"])
    a = torch.randn(2, 4, 0, dtype=torch.float64)
    b = torch.randn(2, 0, 3, dtype=torch.float32)
    got = torch.bmm(wb.shard_tensor(a, mesh, [S(1)]), wb.shard_tensor(b, mesh, [R]))
    want = torch.bmm(a, b)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got.full(), want)


# ---- item 1: the sweep's wrong answers -------------------------------------------------------
@pytest.mark.parametrize("shape,kw", [((0,), {}), ((2, 0), dict(dim=1)), ((0, 4), dict(dim=0)),
                                      ((1,), {}), ((2, 1), dict(dim=1))])
@pytest.mark.parametrize("fn", ["var", "std", "var_mean", "std_mean"])
def test_var_of_no_element_is_a_positive_nan(fn, shape, kw):
    """torch's var of no element is a positive nan (its kernel's), of one element with
    correction 1 a negative one (0 / 0); ours was 0 / 0 for both: signbit read True where
    torch's reads False (seed 1045897)."""
    x = torch.full(shape, 5.0, dtype=torch.float64)
    mesh = wb.Mesh.grid((2,), ["a"])
    d = wb.shard_tensor(x, mesh, [S(x.ndim - 1)] if x.shape[-1] >= 2 else [R])
    f = getattr(torch, fn)
    want, got = f(x, **kw), f(d, **kw)
    for w, g in zip(want if isinstance(want, tuple) else (want,),
                    got if isinstance(got, tuple) else (got,)):
        assert torch.equal(torch.signbit(g.full()), torch.signbit(w))


def test_seed_1045897_is_ok():
    out = run_program(random.Random(1045897))
    assert out.status == "ok", out.detail
