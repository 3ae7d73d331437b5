"""Defects left by the fourth random sweep and found by the fifth (benchmarks/random_sweep.py
with tests/random_programs_habits.py), each in its smallest form, held to one device."""
from __future__ import annotations

import math

import pytest
import torch

import workbench as wb
from workbench.parallel.placement import Partial, Replicate, Shard
from workbench.parallel.validate import distribute

MESH = wb.Mesh.grid(2)
NAN, INF = float("nan"), float("inf")
LAYOUTS = [[Replicate()], [Shard(0)], [Partial("sum")]]


def _grads(fn, x, ps, g=None, seed=1):
    """x's gradient of ``(fn(x) * g).sum()`` on one device and on a DistTensor laid out
    as ``ps`` (``g``: ones by default)."""
    r = x.clone().requires_grad_()
    out = fn(r)
    g = torch.ones_like(out) if g is None else g
    torch.autograd.backward(out, g)
    d = distribute(x, MESH, ps, seed=seed).requires_grad_()
    got = fn(d)
    torch.testing.assert_close(got.full(), out.detach(), equal_nan=True)
    torch.autograd.backward(got, distribute(g, MESH, [Replicate()]))
    return d.grad.full(), r.grad


# ---- 1. max() / min() and amax / amin: torch's even gradient --------------------------------

@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("ps", LAYOUTS, ids=str)
@pytest.mark.parametrize("upstream", [1.5, NAN], ids=["g", "nan_g"])
def test_max_of_a_tensor_holding_nan_gives_the_nans_the_gradient(kind, ps, upstream):
    # seed 971900: t.max() - t.min() of a tensor holding NaN (log of negatives): torch's
    # max() gives each NaN element an even share (zeros elsewhere, even when the upstream
    # gradient is NaN); built from amax here, the gradient was NaN everywhere
    x = torch.tensor([1.0, NAN, 3.0, NAN, 3.0, 0.0], dtype=torch.float64)
    got, want = _grads(lambda t: getattr(t, kind)(), x, ps,
                       torch.tensor(upstream, dtype=torch.float64))
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("kind", ["max", "min", "amax", "amin"])
@pytest.mark.parametrize("ps", LAYOUTS + [[Partial("max")]], ids=str)
def test_a_tie_across_ranks_shares_the_gradient_evenly(kind, ps):
    # found beside seed 971900: three equal maxima, two on rank 0 and one on rank 1, got
    # 1/4, 1/4, 1/2 (the local amax split the tie on rank 0, the P(max) all-reduce split
    # it again between the ranks); torch gives 1/3 each
    x = torch.tensor([1.0, 3.0, 3.0, 2.0, -1.0, 3.0], dtype=torch.float64)
    x = x if kind in ("max", "amax") else -x
    got, want = _grads(lambda t: getattr(t, kind)(), x, ps)
    torch.testing.assert_close(got, want)
    assert torch.equal(want, torch.tensor([0, 1, 1, 0, 0, 1], dtype=torch.float64) / 3)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dims", [0, (0, 2), -1], ids=str)
@pytest.mark.parametrize("ps", [[Shard(0)], [Shard(2)], [Shard(1)]], ids=str)
def test_amax_over_sharded_dims_with_ties_is_torchs(dims, keepdim, ps):
    x = torch.tensor([[[1.0, 2.0], [2.0, 2.0], [0.0, 5.0]],
                      [[2.0, 0.0], [2.0, 2.0], [5.0, 5.0]],
                      [[2.0, 2.0], [1.0, 1.0], [5.0, -1.0]]], dtype=torch.float64)
    g = torch.randn(x.amax(dims, keepdim).shape, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    got, want = _grads(lambda t: t.amax(dims, keepdim) * g, x, ps)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("ps", [[Shard(0)], [Shard(1)]], ids=str)
def test_the_inf_norm_with_ties_across_ranks_is_torchs(ps):
    # vector_norm(ord=inf) is amax(|x|): torch splits its gradient evenly among the ties
    x = torch.tensor([[3.0, -3.0, 1.0], [0.5, 3.0, -3.0]], dtype=torch.float64)
    got, want = _grads(lambda t: torch.linalg.vector_norm(t, math.inf), x, ps)
    torch.testing.assert_close(got, want)


def test_the_even_gradient_runs_under_autograd_grad_and_twice():
    x = torch.tensor([3.0, 1.0, 3.0, 2.0], dtype=torch.float64)
    r = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(r.amax() * r.sum(), r, create_graph=True)
    d = wb.shard_tensor(x, MESH, [Shard(0)]).requires_grad_()
    (got,) = torch.autograd.grad(d.amax() * d.sum(), d, create_graph=True)
    torch.testing.assert_close(got.full(), want)
    (want2,) = torch.autograd.grad(want.sum(), r)
    (got2,) = torch.autograd.grad(got.sum(), d)
    torch.testing.assert_close(got2.full(), want2)


def test_no_grad_amax_keeps_its_partial_result():
    # the even gradient runs only when a gradient is due: under no_grad (and for a
    # tensor that needs none) amax keeps its P(max) result, reduced when read
    d = wb.shard_tensor(torch.arange(6.0), MESH, [Shard(0)])
    assert d.amax().placements == (Partial("max"),)
    with torch.no_grad():
        assert d.requires_grad_().amax().placements == (Partial("max"),)


# ---- 2. the 0-"norm": the count of nonzeros, no gradient -------------------------------------

NORM0 = {"vector_norm": lambda t: torch.linalg.vector_norm(t, 0),
         "vector_norm_dim": lambda t: torch.linalg.vector_norm(t, 0, dim=1, keepdim=True),
         "norm": lambda t: t.norm(0), "linalg_norm": lambda t: torch.linalg.norm(t, 0, dim=0)}


@pytest.mark.parametrize("op", NORM0)
@pytest.mark.parametrize("ps", [[Replicate()], [Shard(0)], [Shard(1)]], ids=str)
def test_the_zero_norm_counts_nan_and_inf_and_gives_no_gradient(op, ps):
    # torch's linalg_vector_norm_backward returns no gradient for ord 0: x.grad stays None
    # (here it was zeros, which an optimizer steps); and NaN != 0 counts, where the zero
    # that carried that gradient (clamp(x, 0, 0) * 0) made the norm NaN
    x = torch.tensor([[1.0, NAN, 0.0], [INF, 2.0, 0.0], [0.0, 0.0, -3.0]], dtype=torch.float64)
    r = x.clone().requires_grad_()
    want = NORM0[op](r)
    want.sum().backward()
    assert r.grad is None
    d = distribute(x, MESH, ps, seed=1).requires_grad_()
    got = NORM0[op](d)
    assert got.requires_grad
    torch.testing.assert_close(got.full(), want.detach())
    got.sum().backward()
    assert d.grad is None
    for t in (r, d):                                        # another path: its gradient only
        (NORM0[op](t).sum() + (t * 2).nansum()).backward()
    torch.testing.assert_close(d.grad.full(), r.grad)


def test_the_zero_norm_of_a_0d_tensor_requires_grad_as_torchs():
    r = torch.tensor(-2.0, requires_grad=True)
    want = torch.linalg.vector_norm(r, 0)
    d = wb.shard_tensor(torch.tensor(-2.0), MESH, [Replicate()]).requires_grad_()
    got = torch.linalg.vector_norm(d, 0)
    assert got.requires_grad == want.requires_grad
    torch.testing.assert_close(got.full(), want.detach())
    got.backward()
    assert d.grad is None


# ---- 3. torch's exception types -------------------------------------------------------------

def _as_torch(call, x, ps):
    """``call`` on ``x`` and on its DistTensor laid out as ``ps``: the same exception
    type (``x`` untouched), or the same value."""
    try:
        want, err = call(x.clone()), None
    except Exception as e:                      # noqa: BLE001 - the type is what is held
        want, err = None, e
    d = distribute(x, MESH, ps, seed=1)
    before = d.full().clone()
    if err is not None:
        with pytest.raises(type(err)):
            call(d)
        assert torch.equal(d.full(), before)
        return
    got = call(d)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.full(), w)


@pytest.mark.parametrize("kw", [{"dim": 1}, {"dim": -2, "keepdim": True}, {}, {"dim": 0}],
                         ids=str)
@pytest.mark.parametrize("ps", [[Replicate()], [Shard(0)], [Shard(2)], [Partial("min")]],
                         ids=str)
def test_aminmax_over_an_empty_dim_raises_torchs_type(kw, ps):
    # seed 990449: aminmax(dim) over an empty dim raised the meta kernel's RuntimeError
    # ('reducing over zero-size dimension...') where torch's CPU kernel raises IndexError
    x = torch.randn(4, 0, 3, dtype=torch.float64)
    _as_torch(lambda t: torch.aminmax(t, **kw), x, ps)


@pytest.mark.parametrize("index", [[5], [-9, 1], [0]], ids=str)
@pytest.mark.parametrize("ps", [[Replicate()], [Shard(0)], [Shard(2)], [Partial("max")]],
                         ids=str)
def test_indexing_an_empty_tensor_out_of_bounds_is_torchs_empty_result(index, ps):
    # seed 990970: x[tensor([1])] of a (1, 1, 1, 0) tensor raised IndexError; torch's index
    # kernel reads no element of an empty result and checks no bound: an empty result
    x = torch.randn(2, 0, 3, dtype=torch.float64)
    for call in (lambda t: t[torch.tensor(index)], lambda t: t[..., torch.tensor(index)],
                 lambda t: t[index], lambda t: t[:, torch.tensor(index)]):
        _as_torch(call, x, ps)


OUTS = {"neg": lambda a, out: torch.neg(a, out=out),
        "add": lambda a, out: torch.add(a, torch.arange(3.0, dtype=torch.float64), out=out),
        "sum": lambda a, out: torch.sum(a, 0, out=out),
        "cat": lambda a, out: torch.cat([a, a], 0, out=out)}


@pytest.mark.parametrize("op", OUTS)
@pytest.mark.parametrize("zs", [(0,), (3, 3), (2, 2, 2)], ids=str)
@pytest.mark.parametrize("zps", [[Replicate()], [Shard(0)], [Partial("sum")]], ids=str)
def test_an_out_of_another_shape_is_resized_as_torch(op, zs, zps):
    # out= of another shape raised RuntimeError ('a DistTensor is not resized'); torch
    # resizes out (silently when it is empty, with a UserWarning when it is not)
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    z0 = torch.zeros(zs, dtype=torch.float64)
    with pytest.warns(UserWarning, match="resized") if z0.numel() else _no_resize_warning():
        want = OUTS[op](x, z0.clone())
    d, z = distribute(x, MESH, [Shard(0)], seed=1), distribute(z0, MESH, zps, seed=2)
    with pytest.warns(UserWarning, match="resized") if z0.numel() else _no_resize_warning():
        got = OUTS[op](d, z)
    assert got is z and z.shape == want.shape
    torch.testing.assert_close(z.full(), want)
    z.add_(1)                                   # a working DistTensor of its new shape
    torch.testing.assert_close(z.full(), want + 1)


class _no_resize_warning:
    def __enter__(self):
        import warnings
        self._cm = warnings.catch_warnings(record=True)
        self._w = self._cm.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        assert not [w for w in self._w if "resized" in str(w.message)]


def test_an_out_that_is_a_view_or_has_views_is_not_resized():
    d = wb.shard_tensor(torch.randn(4, 3, dtype=torch.float64), MESH, [Shard(0)])
    base = wb.shard_tensor(torch.zeros(2, 5, dtype=torch.float64), MESH, [Replicate()])
    for z in (base[0], base):                   # a view; then base, which has one
        before = base.full().clone()
        with pytest.raises(NotImplementedError, match="resize"):
            torch.neg(d, out=z)
        assert torch.equal(base.full(), before) and base.shape == (2, 5)


EMPTY_PRODUCTS = {"bmm": (torch.bmm, (2, 4, 0), (2, 0, 2)),
                  "matmul_3d": (torch.matmul, (2, 4, 0), (2, 0, 2)),
                  "matmul_2d_3d": (torch.matmul, (4, 0), (2, 0, 2)),
                  "bmm_empty_result": (torch.bmm, (2, 0, 3), (2, 3, 2)),
                  "einsum": (lambda a, b: torch.einsum("bij,bjk->bik", a, b), (2, 4, 0),
                             (2, 0, 2))}


@pytest.mark.parametrize("op", EMPTY_PRODUCTS)
@pytest.mark.parametrize("ps", [[Replicate()], [Shard(0)], [Shard(1)]], ids=str)
def test_a_two_dtype_product_torch_returns_for_is_torchs(op, ps):
    # torch's bmm returns zeros before its same-dtype check when the contraction or the
    # result is empty (in the second operand's dtype); here that raised RuntimeError, as
    # torch does for any other size, then a NotImplementedError naming the fix; sweep9:
    # torch's zeros, in torch's dtype, and each operand's gradient in its own dtype
    fn, sa, sb = EMPTY_PRODUCTS[op]
    a = torch.randn(sa).requires_grad_()
    b = torch.randn(sb, dtype=torch.float64).requires_grad_()
    da = distribute(a.detach(), MESH, ps, seed=1).requires_grad_()
    db = distribute(b.detach(), MESH, [Replicate()], seed=2).requires_grad_()
    try:
        want = fn(a, b)                 # torch returns (matmul (4, 0) @ (2, 0, 2) raises
    except RuntimeError:                # RuntimeError where an operand requires grad)
        with pytest.raises(RuntimeError, match="same dtype"):
            fn(da, db)
        want = fn(a.detach(), b.detach())       # ...and returns where none does
        got = fn(da.detach(), db.detach())
        assert got.dtype == want.dtype and torch.equal(got.full(), want)
        return
    got = fn(da, db)
    assert got.dtype == want.dtype and torch.equal(got.full(), want)
    want.sum().backward()
    got.sum().backward()
    for d, t in ((da, a), (db, b)):
        g = d.grad.full() if d.grad is not None else torch.zeros_like(t)
        assert g.dtype == t.dtype and torch.equal(g, t.grad if t.grad is not None else
                                                  torch.zeros_like(t))


@pytest.mark.parametrize("eq", ["bi,bj->bij", "ij,ij->ij", "i,j->ij"])
@pytest.mark.parametrize("ps", [[Replicate()], [Shard(0)]], ids=str)
def test_an_einsum_with_no_contraction_promotes_as_torch(eq, ps):
    # torch.einsum multiplies when no index is summed over both operands (torch.mul's
    # promotion): it raised RuntimeError here
    lhs = eq.split("->")[0].split(",")
    sizes = {"b": 2, "i": 4, "j": 3}
    a = torch.randn([sizes[c] for c in lhs[0]])
    b = torch.randn([sizes[c] for c in lhs[1]], dtype=torch.float64)
    want = torch.einsum(eq, a, b)
    got = torch.einsum(eq, distribute(a, MESH, ps, seed=1), distribute(b, MESH, [Replicate()]))
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got.full(), want)


# ---- 5. the new sweep (seeds 990000-991499) ---------------------------------------------------

@pytest.mark.parametrize("op", ["add", "mul", "sub"])
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_a_wide_partial_meeting_a_narrow_result_is_reduced_first(op, low):
    # seed 991342: bf16 (5,) + float32 0-d P(sum) is bf16; the partial's parts were each
    # rounded to bf16 and summed there: 1 bf16 ulp off one device's single rounding
    mesh = wb.Mesh([0, 1, 2, 3])
    x = torch.tensor([-0.889, -1.118, 1.443, 0.11187715893066007, -1.539], dtype=torch.float64)
    y = torch.tensor(-0.8529085516929626, dtype=torch.float32)
    d = distribute(x, mesh, [Replicate()], seed=960).to(low)
    p = distribute(y, mesh, [Partial("sum")], seed=423)
    f = getattr(torch, op)
    got = f(d, p)
    want = f(x.to(low), p.full())
    assert got.dtype == want.dtype == low
    assert torch.equal(got.full(), want)
    assert not any(q.is_partial() for q in got.placements)


@pytest.mark.parametrize("ps", [[Replicate()], [Shard(0)], [Partial("sum")]], ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bfloat16])
def test_fill_writes_the_number_in_the_tensors_dtype(ps, dtype):
    # seed 992249: x.fill_(1.8) of a float64 DistTensor wrote 1.7999999523 (the number
    # went through a float32 tensor first); torch fills in x's dtype
    x = torch.zeros(3, 3, dtype=dtype)
    d = distribute(x, MESH, ps, seed=1)
    for v in (1.8, 2.7, True):
        assert torch.equal(d.fill_(v).full(), x.clone().fill_(v))


@pytest.mark.parametrize("call", [
    lambda t: torch.linalg.vector_norm(t, -math.inf, (-3,)),
    lambda t: torch.linalg.norm(t, math.inf, -3), lambda t: t.norm(math.inf, dim=-3),
    lambda t: torch.linalg.matrix_norm(t, math.inf, dim=(-3, -4))])
@pytest.mark.parametrize("ps", [[Replicate()], [Shard(1)]], ids=str)
def test_an_inf_norm_over_a_negative_dim_of_an_empty_tensor_is_torchs(call, ps):
    # seed 991550: torch's meta kernel judged dim -3 of a (4, 5, 3, 0) tensor as if it were
    # the empty dim 3 and raised RuntimeError; torch's CPU kernel returns a (4, 3, 0) result
    _as_torch(call, torch.zeros(4, 5, 3, 0, dtype=torch.float64), ps)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_of_a_non_float_tensor_raises_torchs_type(dtype, training):
    # seed 995514: F.batch_norm of an int64 DistTensor raised RuntimeError (the meta
    # check's eager re-run on expanded zeros failed in mean()); torch: NotImplementedError
    x = torch.ones(4, 3, dtype=dtype)
    stats = () if training else (torch.zeros(3), torch.ones(3))
    _as_torch(lambda t: torch.nn.functional.batch_norm(t, *(stats or (None, None)),
                                                       training=training), x, [Shard(0)])


@pytest.mark.parametrize("eq", ["...ij,jk->...ik", "ij,jk->ik"])
def test_an_einsum_of_a_bool_and_a_float_raises_torchs_type(eq):
    # seed 995785: torch raises NotImplementedError ('"bmm" not implemented for 'Bool'');
    # here the same-dtype check raised RuntimeError
    a = torch.ones((2, 3, 2) if eq.startswith("...") else (3, 2), dtype=torch.bool)
    b = torch.randn(2, 1, dtype=torch.float64)
    with pytest.raises(NotImplementedError):
        torch.einsum(eq, a, b)
    with pytest.raises(NotImplementedError, match="Bool"):
        torch.einsum(eq, distribute(a, MESH, [Shard(0)]), distribute(b, MESH, [Replicate()]))


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("ps", [[Replicate()], [Shard(0)]], ids=str)
def test_index_put_of_another_dtype_raises_as_torch(accumulate, ps):
    # seed 994561: index_put_(..., float64 values, accumulate=True) into a float32 tensor
    # cast the values where torch raises RuntimeError ('Index put requires the source and
    # destination dtypes match')
    x = torch.zeros(4, 2)
    for v in (torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.int64)):
        _as_torch(lambda t: t.index_put_((torch.tensor([0, 0]),), v, accumulate=accumulate),
                  x, ps)
    _as_torch(lambda t: t.index_put_((torch.tensor([0, 0]),), torch.ones(2),
                                     accumulate=accumulate), x, ps)


# ---- 4. hypothesis examples independent of the modules loaded before -----------------------

def test_hypothesis_examples_do_not_depend_on_the_modules_loaded(tmp_path, monkeypatch):
    # hypothesis draws "local constants" from every local module in sys.modules: the
    # random-programs property test drew another program (and failed) after ten other test
    # files were imported; tests/conftest.py keeps that pool empty
    from hypothesis import given, settings, strategies as st
    seen = []

    @settings(max_examples=60, database=None)
    @given(st.lists(st.floats(allow_nan=False), min_size=3, max_size=3),
           st.integers())
    def draw(xs, n):
        seen.append((tuple(xs), n))

    draw()
    first = list(seen)
    seen.clear()
    (tmp_path / "sweep5_constants.py").write_text(
        "A = [0.123456789, 98765.4321, 31337, -271828, 1e-7, 6.02e23]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    importlib.import_module("sweep5_constants")
    try:
        draw()
    finally:
        import sys
        sys.modules.pop("sweep5_constants", None)
    assert seen == first
