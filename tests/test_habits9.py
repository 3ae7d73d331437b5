"""A PyTorch user's habits on the wrappers, fifth sweep (habits9): each test holds a habit to
plain PyTorch on one device (or torch's own wrapper) and failed before its fix, unless it
says it pins behaviour that already held.

1. ``p.flatten().normal_()`` (``reshape(-1)``, ``ravel()``, ``contiguous()``) on
   ``fully_shard`` over tensor-parallel DistTensors (non-contiguous chunks): a copy,
   written and dropped, the parameter silently unchanged (one device: a view that writes
   it).  Now a write into such a copy raises; reading it is torch's copy;
2. ``torch.autograd.grad(loss, ddp.parameters())`` (or the module's DistTensor parameters)
   under DDP over DistTensors returned each replica's own gradient share, never averaged
   (0.034 off one device's): raises as over plain DDP's rows (habits7).
"""
import pytest
import torch
from torch import nn

import workbench as wb

from .test_habits6 import full, mlp, mse, wrap  # noqa: F401  (the same tiny MLP, wrappers)


# ---- 1. a reshape that copies a non-contiguous wrapped parameter -------------------------
RESHAPES = {"flatten": lambda p: p.flatten(), "reshape": lambda p: p.reshape(-1),
            "ravel": lambda p: p.ravel(), "contiguous": lambda p: p.contiguous(),
            "torch.flatten": lambda p: torch.flatten(p), "data_flatten": lambda p:
            p.data.flatten(), "detach_reshape": lambda p: p.detach().reshape(-1),
            "view_of_copy": lambda p: p.flatten()[3:]}
WRITES = {"normal_": lambda t: t.normal_(0.0, 0.2), "init.normal_": lambda t:
          nn.init.normal_(t, std=0.2), "uniform_": lambda t: t.uniform_(-0.1, 0.1),
          "zero_": lambda t: t.zero_(), "mul_": lambda t: t.mul_(2.0),
          "copy_": lambda t: t.copy_(torch.ones_like(t)), "setitem": lambda t:
          t.__setitem__(0, 1.0), "iadd": lambda t: t.__iadd__(1.0)}


def _tp_fully_shard():
    from tests.test_fixlist7 import _tp_fully_shard as make
    return make()


@pytest.mark.parametrize("reshape", list(RESHAPES))
def test_a_write_into_a_copying_reshape_of_a_non_contiguous_parameter_raises(reshape):
    """Before: no error, the parameter unchanged (the copy took the draw)."""
    m, ref, mesh = _tp_fully_shard()
    params = dict(m.named_parameters())
    p = params["blocks.0.up.weight"]
    with torch._C.DisableTorchFunctionSubclass():
        assert not p.is_contiguous()            # the wrapper's layout, dp-minor chunks
    before = {n: q.detach().clone() for n, q in params.items()}
    for name, write in WRITES.items():
        with pytest.raises(RuntimeError, match="into a copy of a wrapped parameter: .*not "
                           "contiguous.*Write through the parameter itself"):
            with torch.no_grad():
                write(RESHAPES[reshape](p))
    for n, q in params.items():
        assert torch.equal(q.detach(), before[n]), n
    from tests.test_fixlist7 import _trains_as_one_device
    _trains_as_one_device(m, ref, mesh)


def test_a_copying_reshape_still_reads_and_backprops_as_torchs():
    m, _, _ = _tp_fully_shard()
    p = dict(m.named_parameters())["blocks.0.up.weight"]
    with torch._C.DisableTorchFunctionSubclass():
        want = p.detach().reshape(-1).clone()
    f = p.flatten()
    assert torch.equal(f.detach().as_subclass(torch.Tensor), want)
    assert f.requires_grad and type(f * 2) is torch.Tensor and type(f.clone()) is torch.Tensor
    weights = torch.arange(f.numel(), dtype=f.dtype)
    (f * weights).sum().backward()
    with torch._C.DisableTorchFunctionSubclass():
        torch.testing.assert_close(p.grad.reshape(-1), weights)


@pytest.mark.parametrize("kind", ["fsdp", "fully_shard", "ddp"])
def test_a_contiguous_storage_still_gives_views_and_torchs_copies(kind):
    """Over contiguous storages (DDP's rows, FSDP's chunks) flatten() is a view (habits8:
    elementwise writes reach the parameter); p.mT.flatten() is a plain copy, as torch's
    (one device copies there too)."""
    mesh, w = wrap(kind, mlp())
    p = next(q for n, q in w.named_parameters() if n.endswith("0.weight"))
    t = p.mT.flatten()
    assert type(t) is torch.Tensor
    with torch.no_grad():
        t.zero_()                               # a copy, as torch's: p unchanged
        assert p.detach().abs().sum() > 0
        p.flatten().zero_()                     # a view: p zeroed
    assert full(w)["0.weight"].abs().sum() == 0


# ---- 2. torch.autograd.grad over DDP over DistTensors ------------------------------------
def _ddp_dist():
    from tests.test_habits5 import PLAN, mlp as mlp16
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    model = wb.parallelize(mlp16(), mesh, PLAN, mesh_dim="tp")
    return mesh, model, wb.DistributedDataParallel(model, mesh, "dp")


@pytest.mark.parametrize("which", ["ddp.parameters", "model.parameters", "one_replica"])
def test_autograd_grad_over_ddp_over_dist_tensors_raises(which):
    """Before: each replica its own rank's share, not summed over dp (0.034 off one
    device's gradient of 0.weight); now torch DDP's unsupported call raises, nothing run,
    and the graph is still there for loss.backward()."""
    from tests.test_habits5 import batches, dist, mlp as mlp16
    mesh, model, ddp = _ddp_dist()
    x, y = batches(1)[0]
    loss = mse(ddp(dist(x, mesh)), dist(y, mesh))
    inputs = {"ddp.parameters": lambda: list(ddp.parameters()),
              "model.parameters": lambda: list(model.parameters()),
              "one_replica": lambda: next(iter(ddp.parameters()))}[which]()
    with pytest.raises(RuntimeError, match="torch.autograd.grad over DistributedDataParallel"
                       ".*loss.backward\\(\\)"):
        torch.autograd.grad(loss, inputs)
    assert all(p.grad is None for p in ddp.parameters())
    loss.backward()
    ref = mlp16()
    mse(ref(x), y).backward()
    sd = dict(ddp.module.named_parameters())
    for n, q in ref.named_parameters():
        torch.testing.assert_close(sd[n].grad.full(), q.grad, rtol=1e-5, atol=1e-6)
