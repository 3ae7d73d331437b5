"""Defects found by the fourth random sweep (benchmarks/random_sweep.py on the generator
extended with tests/random_programs_habits.py: calls torch refuses are now held to torch's
error), each in its smallest form."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.placement import Partial, Replicate, Shard
from workbench.parallel.validate import distribute

MESH = wb.Mesh.grid(2)


def _raises_as_torch(call, *tensors):
    """``call`` on plain tensors raises; on their DistTensors (every layout given) it raises
    the same type and leaves them as they were."""
    plain = [t for t, _ in tensors]
    with pytest.raises(Exception) as want:
        call(*plain)
    dists = [distribute(t, MESH, ps, seed=1) for t, ps in tensors]
    before = [d.full().clone() for d in dists]
    with pytest.raises(type(want.value)):
        call(*dists)
    for d, b in zip(dists, before):
        assert torch.equal(d.full(), b)


PRODUCTS = {
    "matmul": lambda a, b: torch.matmul(a, b), "@": lambda a, b: a @ b,
    "mm": lambda a, b: torch.mm(a, b), "linear": lambda a, b: F.linear(a, b.mT),
    "einsum": lambda a, b: torch.einsum("ij,jk->ik", a, b),
}


@pytest.mark.parametrize("op", PRODUCTS)
@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("ps", [[Replicate()], [Shard(0)], [Shard(1)]], ids=str)
def test_a_product_of_two_dtypes_raises_as_torch(op, k, ps):
    if op == "einsum" and k == 0:
        pytest.skip("torch.einsum of an empty contraction returns zeros in the second "
                    "operand's dtype; so does ours (test_sweep5)")
    # seed 940000-range sweep: torch.matmul(float32 (2, 0) stack, float64) returned a
    # float64 result where torch raises RuntimeError (torch's meta kernels do not check
    # the dtypes; the zero-size local product promoted)
    a = torch.randn(4, k, dtype=torch.float32)
    b = torch.randn(k, 2, dtype=torch.float64)
    _raises_as_torch(PRODUCTS[op], (a, ps), (b, [Replicate()]))


def test_a_linear_bias_of_another_dtype_raises_as_torch():
    x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    b = torch.randn(2, dtype=torch.float32)
    _raises_as_torch(F.linear, (x, [Shard(0)]), (w, [Replicate()]), (b, [Replicate()]))


def test_bmm_of_two_dtypes_raises():
    a = torch.randn(2, 3, 4, dtype=torch.float32)
    b = torch.randn(2, 4, 2, dtype=torch.float64)
    _raises_as_torch(torch.bmm, (a, [Shard(0)]), (b, [Shard(0)]))


def test_same_dtype_products_still_run():
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    d = wb.shard_tensor(a, MESH, [Shard(0)])
    torch.testing.assert_close((d @ b).full(), a @ b)
    with torch.autocast("cpu", dtype=torch.bfloat16):     # autocast casts both first
        got = d @ b
        assert got.dtype == torch.bfloat16
        want = a @ b
    torch.testing.assert_close(got.full(), want)


@pytest.mark.parametrize("xps", [[Shard(0)], [Replicate()]], ids=str)
@pytest.mark.parametrize("wps", [[Shard(0)], [Partial("max")]], ids=str)
def test_linear_with_no_input_features_is_the_bias(xps, wps):
    # seed 960218: F.linear((0,) replicated, (2, 0) column-sharded weight, bias) raised a
    # raw RuntimeError (reshape(-1, 0) of the weight slices); torch gives the bias
    x, w, b = torch.randn(0, dtype=torch.float64), torch.randn(2, 0, dtype=torch.float64), \
        torch.randn(2, dtype=torch.float64)
    for xs in (x, torch.randn(3, 0, dtype=torch.float64)):
        got = F.linear(distribute(xs, MESH, xps if xs.dim() > 1 else [Replicate()], seed=2),
                       distribute(w, MESH, wps, seed=3), distribute(b, MESH, [Shard(0)]))
        torch.testing.assert_close(got.full(), F.linear(xs, w, b))


@pytest.mark.parametrize("op", ["neg", "abs"])
def test_a_unary_out_of_another_dtype_raises_as_torch(op):
    # seed 941975: torch.neg(float64, out=float32 DistTensor) wrote a cast result where
    # torch raises RuntimeError ("Found dtype Float but expected Double")
    x = torch.randn(4, 3, dtype=torch.float64)
    f = getattr(torch, op)
    with pytest.raises(RuntimeError):
        f(x, out=torch.zeros(4, 3, dtype=torch.float32))
    d = wb.shard_tensor(x, MESH, [Shard(0)])
    z = wb.shard_tensor(torch.zeros(4, 3, dtype=torch.float32), MESH, [Shard(0)])
    with pytest.raises(RuntimeError):
        f(d, out=z)
    assert torch.equal(z.full(), torch.zeros(4, 3)), "the refused write changed out"


@pytest.mark.parametrize("op", ["add", "exp"])
def test_a_binary_or_float_out_still_casts_as_torch(op):
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    f = (lambda a, out: torch.add(a, y, out=out)) if op == "add" else torch.exp
    want = torch.zeros(4, 3, dtype=torch.float32)
    f(x, out=want)
    z = wb.shard_tensor(torch.zeros(4, 3, dtype=torch.float32), MESH, [Shard(0)])
    f(wb.shard_tensor(x, MESH, [Shard(0)]), out=z)
    torch.testing.assert_close(z.full(), want)


@pytest.mark.parametrize("whole", [True, False], ids=["copy_", "view_copy_"])
@pytest.mark.parametrize("ps", [[Shard(0)], [Replicate()]], ids=str)
def test_copy_of_a_tracked_value_over_a_tracked_result_gives_zero_grads(whole, ps):
    # seed 941030: v = f(x).clone(); v.copy_(y) with y requiring grad: torch gives x a
    # zero gradient (CopyBackwards); here x's history was dropped and x.grad was None
    x, y = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    g = torch.randn(5, dtype=torch.float64)

    def run(a, b):
        v = (a.exp() * 2).clone()
        v.copy_(b) if whole else v[1:].copy_(b[1:])
        (v * g).sum().backward()
    r, ry = x.clone().requires_grad_(), y.clone().requires_grad_()
    run(r, ry)
    d = wb.shard_tensor(x, MESH, ps).requires_grad_()
    dy = wb.shard_tensor(y, MESH, [Replicate()]).requires_grad_()
    run(d, dy)
    assert d.grad is not None and dy.grad is not None
    torch.testing.assert_close(d.grad.full(), r.grad)
    torch.testing.assert_close(dy.grad.full(), ry.grad)


@pytest.mark.parametrize("ps", [[Shard(0)], [Replicate()], [Partial("sum")]], ids=str)
def test_setitem_of_a_tracked_float_into_an_int_tensor_is_torchs(ps):
    # seed 941145: x_int[4:5] = y (float64, requires grad) raised a raw RuntimeError
    # ("Autograd not support dtype: Long"); torch writes the truncated value, and records
    # the write (inplace15, sweep lead 2012384): the int tensor gets a grad_fn and its next
    # differentiable op raises that error.  A DistTensor refuses the write itself, saying
    # so, before writing; the fix it names (the value detached) writes torch's values
    x = torch.arange(12).reshape(6, 2)
    y = torch.tensor(2.75, dtype=torch.float64, requires_grad=True)
    want = x.clone()
    want[4:5] = y
    assert want.requires_grad and want.grad_fn is not None
    with pytest.raises(RuntimeError, match="Autograd not support dtype: Long"):
        want + 1
    d = distribute(x, MESH, ps, seed=5)
    with pytest.raises(RuntimeError, match=r"(?s)Autograd not support dtype: Long.*detach"):
        d[4:5] = wb.shard_tensor(y.detach(), MESH, [Replicate()]).requires_grad_()
    assert torch.equal(d.full(), x)                 # nothing written
    d[4:5] = wb.shard_tensor(y.detach(), MESH, [Replicate()]).requires_grad_().detach()
    assert d.dtype == torch.int64 and not d.requires_grad
    assert torch.equal(d.full(), want.detach())


def test_inplace_add_of_a_partial_into_a_slice_of_a_sharded_copy():
    # the case tests/test_sweep4_dtensor.py does not hold to DTensor: every rank's local
    # is its chunk of the one-device value
    g = torch.Generator().manual_seed(18)
    x = torch.randint(-4, 5, (5, 4), generator=g).double()
    y = torch.randint(-4, 5, (4,), generator=g).double()
    mesh = wb.Mesh([[0, 1], [2, 3]])
    v = wb.shard_tensor(x, mesh, [Shard(0), Replicate()]).clone()
    v[1:].add_(distribute(y, mesh, [Partial("sum"), Replicate()], seed=2))
    w = x.clone()
    w[1:].add_(y)
    assert tuple(v.placements) == (Shard(0), Replicate())
    for r, rows in ((0, w[:3]), (1, w[:3]), (2, w[3:]), (3, w[3:])):
        torch.testing.assert_close(v.local(r), rows)


def test_copy_over_an_uneven_tracked_result_keeps_every_cells_gradient():
    # seed 941030: 5 rows on 3 ranks (cells of 2, 2, 1): only the first cell's old history
    # got torch's gradient (logit's nan out of its domain); the others got zeros
    mesh = wb.Mesh([2, 1, 0])
    x = torch.tensor([-1.2, 0.65, -1.08, -0.31, 0.5], dtype=torch.float64)
    y, g = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)

    def run(a, b):
        ((torch.logit(a) * 2).clone().copy_(b) * g).sum().backward()
    r = x.clone().requires_grad_()
    run(r, y.clone().requires_grad_())
    d = wb.shard_tensor(x, mesh, [Shard(0)]).requires_grad_()
    run(d, wb.shard_tensor(y, mesh, [Replicate()]).requires_grad_())
    torch.testing.assert_close(d.grad.full(), r.grad, equal_nan=True)


@pytest.mark.parametrize("kind", ["max", "min"])
def test_max_of_an_empty_tensor_raises_torchs_error_type(kind):
    # seeds 940195 and 6 more: x.max() of an empty DistTensor raised amax's IndexError
    # where torch raises RuntimeError
    x = torch.zeros(3, 0)
    with pytest.raises(RuntimeError):
        getattr(x, kind)()
    with pytest.raises(RuntimeError):
        getattr(wb.shard_tensor(x, MESH, [Shard(0)]), kind)()


@pytest.mark.parametrize("ps", [[Shard(0)], [Shard(1)], [Replicate()]], ids=str)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_cross_entropy_of_integer_logits_raises_as_torch(dtype, ps):
    # seed 970628: F.cross_entropy(x.sort(0)[1], t) (int64 logits) returned a loss where
    # torch raises NotImplementedError (no integer log_softmax kernel)
    x, t = torch.ones(4, 2, dtype=dtype), torch.tensor([0, 1, 1, 0])
    with pytest.raises(NotImplementedError):
        F.cross_entropy(x, t)
    with pytest.raises(NotImplementedError):
        F.cross_entropy(wb.shard_tensor(x, MESH, ps), t)


@pytest.mark.parametrize("ps", [[Shard(0)], [Replicate()], [Shard(2)]], ids=str)
def test_view_of_a_non_contiguous_dist_tensor_raises_as_torch(ps):
    # seed 970294: x.permute(2, 1, 0).view(-1) returned a result where torch raises
    x = torch.randn(4, 3, 4)
    for f in (lambda t: t.permute(2, 1, 0).view(-1), lambda t: t.transpose(0, 1).view(12, 4)):
        with pytest.raises(RuntimeError):
            f(x)
        with pytest.raises(RuntimeError):
            f(wb.shard_tensor(x, MESH, ps))
    for f in (lambda t: t.view(12, 4), lambda t: t.transpose(0, 1).reshape(-1),
              lambda t: t.permute(2, 1, 0).contiguous().view(-1),
              lambda t: t.transpose(1, 2).view(4, 4, 3)):
        torch.testing.assert_close(f(wb.shard_tensor(x, MESH, ps)).full(), f(x))
