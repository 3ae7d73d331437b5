"""RMSNorm keeps for backward only what a fused kernel keeps (x in its own dtype, the
weight, one float32 rstd per row) on every path: ``wb.ops.rms_norm`` on one device, the
op table's local implementation on the simulator's stacked tensors (the weight stored
once or as per-rank views), the course's Llama.  Values and gradients are held to
``F.rms_norm`` / ``nn.RMSNorm`` on one device; second derivatives to F.rms_norm's
composite in float64."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import workbench as wb
import workbench.ops as ops
from workbench.ops.rms_norm import default_eps, fused_rms_norm
from workbench.ops.testing import assert_close
from workbench.parallel.strategies.memory import saved_activation_bytes

MESH4 = wb.Mesh.grid(4, ["tp"])


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)


def _grads(fn, x, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    return (y, *torch.autograd.grad(y, (x, w), dy))


def _saved(fn, *args):
    """Bytes autograd keeps (each storage once); the inputs' storages listed apart."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,norm", [((3, 5, 16), (16,)), ((2, 4, 3, 8), (3, 8))])
def test_values_and_grads_equal_torch_rms_norm(dtype, shape, norm):
    x = randn(*shape, dtype=dtype)
    w = randn(*norm, dtype=dtype, seed=1)
    dy = randn(*shape, dtype=dtype, seed=2)
    want = _grads(lambda x, w: F.rms_norm(x, norm, w, 1e-5), x, w, dy)
    mod = nn.RMSNorm(norm, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        mod.weight.copy_(w)
    y = mod(x.clone().requires_grad_())
    assert_close(y, want[0], "nn.RMSNorm")
    for backend in ("native", "reference"):
        with ops.use(backend):
            got = _grads(lambda x, w: ops.rms_norm(x, w, eps=1e-5), x, w, dy)
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype == dtype
            assert_close(a, b, f"wb.ops.rms_norm {backend} #{i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eps_none_is_f_rms_norms_default(dtype):
    """F.rms_norm(eps=None) adds the float32 machine epsilon to a 16-bit x's mean square
    (its compute dtype); tiny rows show the difference from finfo(bfloat16).eps."""
    x, w = randn(4, 8, dtype=dtype, scale=1e-2), randn(8, dtype=dtype, seed=1)
    assert default_eps(dtype) == torch.finfo(torch.float32).eps
    want = F.rms_norm(x, (8,), w, None)
    assert_close(ops.rms_norm(x, w, None), want, "eps=None")
    assert not torch.allclose(F.rms_norm(x, (8,), w, torch.finfo(dtype).eps).float(),
                              want.float())


def test_saves_what_the_fused_kernel_saves():
    """bf16 x of 8 x 64: x (1,024 bytes), the weight, rstd (8 float32); F.rms_norm's CPU
    composite keeps a float32 copy of x and of x * rstd as well (6 bytes per element
    more, the figure the planner would miss)."""
    x, w = randn(8, 64, dtype=torch.bfloat16).requires_grad_(), \
        randn(64, dtype=torch.bfloat16, seed=1).requires_grad_()
    ours = _saved(lambda: ops.rms_norm(x, w))
    inputs = {x.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}
    extra = {k: v for k, v in ours.items() if k not in inputs}
    assert inputs <= set(ours)
    assert list(extra.values()) == [(8 * 4, torch.float32)]          # rstd, one per row
    c = ops.cost("rms_norm", x, w)
    assert sum(b for b, _ in ours.values()) == c.saved_bytes_fused
    composite = sum(b for b, _ in _saved(lambda: F.rms_norm(x, (64,), w)).values())
    assert composite - c.saved_bytes_fused >= 6 * x.numel()


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_double_backward_is_the_formulas(backend):
    """Second derivatives (create_graph) against torch's numerical check and F.rms_norm's
    composite: the backward re-derives rstd from x when building a graph."""
    x, w = randn(2, 3, 5, dtype=torch.float64), randn(5, dtype=torch.float64, seed=1)
    x.requires_grad_(), w.requires_grad_()
    with ops.use(backend):
        assert torch.autograd.gradgradcheck(lambda x, w: ops.rms_norm(x, w, eps=0.1), (x, w))
        dy = randn(2, 3, 5, dtype=torch.float64, seed=2)
        gx, gw = torch.autograd.grad(ops.rms_norm(x, w, eps=0.1), (x, w), dy,
                                     create_graph=True)
    hx, hw = torch.autograd.grad((gx ** 2).sum() + (gw ** 3).sum(), (x, w))
    rx, rw = torch.autograd.grad(F.rms_norm(x, (5,), w, 0.1), (x, w), dy, create_graph=True)
    want = torch.autograd.grad((rx ** 2).sum() + (rw ** 3).sum(), (x, w))
    assert_close(hx, want[0], "d2/dx")
    assert_close(hw, want[1], "d2/dw")


def test_broadcast_weight_gets_its_own_sums():
    """The simulator's per-rank weight views, (ranks, 1, h) against x (ranks, rows, h):
    each view's gradient sums its own rank's rows; no weight, as F.rms_norm(weight=None)."""
    x = randn(4, 6, 8, dtype=torch.float64).requires_grad_()
    w = randn(4, 1, 8, dtype=torch.float64, seed=1).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: fused_rms_norm(x, w, 1e-3, 1), (x, w))
    dy = randn(4, 6, 8, dtype=torch.float64, seed=2)
    gw, = torch.autograd.grad(fused_rms_norm(x, w, 1e-3, 1), w, dy)
    for r in range(4):
        want, = torch.autograd.grad(F.rms_norm(x[r], (8,), w[r, 0], 1e-3), w, dy[r])
        assert_close(gw[r], want[r], f"rank {r}")
    assert_close(fused_rms_norm(x, None, 1e-3, 2), F.rms_norm(x, (6, 8), None, 1e-3), "none")


@pytest.mark.parametrize("impl", ["torch", "workbench"])
@pytest.mark.parametrize("xp", [["S(0)"], ["R"]])
def test_dist_tensor_norm_saves_the_fused_kernels_tensors(impl, xp):
    """On the simulator (x of 8 x 16 x 32 in bf16 over 4 ranks, rows sharded or whole):
    one device's values and gradients, and per rank what the fused kernel keeps (x's
    shard, a float32 rstd per row; the weight is a parameter)."""
    dt = torch.bfloat16
    x, w = randn(8, 16, 32, dtype=dt), randn(32, dtype=dt, seed=1)
    dy = randn(8, 16, 32, dtype=dt, seed=2)
    fn = (lambda x, w: F.rms_norm(x, (32,), w, 1e-6)) if impl == "torch" else \
        (lambda x, w: wb.ops.rms_norm(x, w, eps=1e-6))
    want = _grads(fn, x, w, dy)
    dx = wb.shard_tensor(x, MESH4, xp).requires_grad_()
    dw = wb.shard_tensor(w, MESH4, ["R"]).requires_grad_()
    with wb.trace() as tr:
        y, rep = saved_activation_bytes(fn, dx, dw, params=(dw,), lead_dims=1)
        y.backward(wb.shard_tensor(dy, MESH4, y.placements))
    assert_close(y.full(), want[0], "y")
    assert_close(dx.grad.full(), want[1], "dx")
    assert_close(dw.grad.full(), want[2], "dw")
    rows = x.numel() // 32 // (4 if xp == ["S(0)"] else 1)
    assert rep.bytes == rows * 32 * 2 + rows * 4, rep.items
    if xp == ["S(0)"]:                             # the weight's gradient summed over ranks
        assert tr.counts()["all_reduce"] == 1


@pytest.mark.parametrize("xd,wd", [(torch.float32, torch.float64),
                                   (torch.bfloat16, torch.float32)])
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")   # torch's
def test_dist_tensor_mixed_dtypes_as_torch(xd, wd):
    """F.rms_norm with a weight of another dtype returns x's dtype and the weight's
    gradient in the weight's, on the simulator too."""
    x, w = randn(4, 8, 6, dtype=xd), randn(6, dtype=wd, seed=1)
    dy = randn(4, 8, 6, dtype=xd, seed=2)
    want = _grads(lambda x, w: F.rms_norm(x, (6,), w, 1e-6), x, w, dy)
    dx = wb.shard_tensor(x, MESH4, ["S(0)"]).requires_grad_()
    dw = wb.shard_tensor(w, MESH4, ["R"]).requires_grad_()
    y = F.rms_norm(dx, (6,), dw, 1e-6)
    y.backward(wb.shard_tensor(dy, MESH4, y.placements))
    for got, ref in zip((y, dx.grad, dw.grad), want):   # to x's precision, the lower
        assert got.dtype == ref.dtype
        assert_close(got.full().to(xd), ref.to(xd), "mixed dtypes")
