"""A PyTorch user's ordinary loop on the wrappers, second sweep (habits6): each test holds
a habit to plain PyTorch on one device (or torch's documented semantics) and failed
before its fix.

1. a forward under ``torch.inference_mode()`` between training steps (evaluation) on
   simulated ranks raised ``AttributeError: 'NoneType' object has no attribute
   '_sequence_nr'`` (DDP, FSDP, fully_shard, DDP + ZeroRedundancyOptimizer);
2. ``loss.backward(retain_graph=True); loss.backward()`` through FSDP / fully_shard
   left the gradient of the first backward only (the second reduced nothing, silently);
"""
import pytest
import torch
from torch import nn

import workbench as wb


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))


def batches(k=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g))
            for _ in range(k)]


def mse(out, y):
    return ((out - y) ** 2).mean()


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def wrap(kind, model, n=4):
    """(mesh, the wrapped model) on n simulated data-parallel ranks."""
    mesh = wb.Mesh.grid(n, ["dp"])
    if kind in ("ddp", "zero"):
        return mesh, wb.DistributedDataParallel(model, mesh)
    if kind == "fsdp":
        return mesh, wb.FullyShardedDataParallel(model, mesh)
    if kind == "fsdp_units":
        return mesh, wb.FullyShardedDataParallel(model, mesh, units={nn.Linear})
    assert kind == "fully_shard"
    wb.fully_shard(model[0], mesh=mesh)
    return mesh, wb.fully_shard(model, mesh=mesh)


def optimizer(kind, w, mesh, cls=torch.optim.SGD, params=None, **kw):
    params = w.parameters() if params is None else params
    if kind == "zero":
        return wb.ZeroRedundancyOptimizer(params, cls, mesh, **kw)
    return cls(params, **kw)


def full(w) -> dict:
    """The wrapped model's weights as one device's state dict (module's own names)."""
    out = {}
    for k, v in w.state_dict().items():
        v = v.full() if isinstance(v, wb.DistTensor) else v
        out[k.removeprefix("module.")] = v.detach().clone()
    return out


def assert_same_model(w, ref):
    got, want = full(w), ref.state_dict()
    assert list(got) == list(want)
    for k in want:
        close(got[k], want[k])


def dist(x, mesh):
    return wb.shard_tensor(x, mesh, [wb.Shard(0)])


KINDS = ["ddp", "zero", "fsdp", "fsdp_units", "fully_shard"]


# ---- 1. an inference_mode forward between steps ----------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_an_inference_mode_forward_between_steps_is_one_devices(kind):
    ref = mlp()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    mesh, w = wrap(kind, mlp())
    opt = optimizer(kind, w, mesh, lr=0.1, momentum=0.9)
    for x, y in batches():
        ropt.zero_grad()
        mse(ref(x), y).backward()
        ropt.step()
        opt.zero_grad()
        mse(w(dist(x, mesh)), dist(y, mesh)).backward()
        opt.step()
        with torch.inference_mode():
            want = ref(x)
            got = w(dist(x, mesh))           # raised AttributeError (_sequence_nr)
        assert not got.requires_grad
        close(got.full(), want)
    assert_same_model(w, ref)
    if kind.startswith("fsdp") or kind == "fully_shard":
        wrapper = w if kind != "fully_shard" else w._wb_fully_shard.wrapper
        assert wrapper.gathered.alive() == 0     # nothing kept for a backward that won't come


# ---- 2. a second backward through a retained graph -------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_second_backward_through_a_retained_graph_adds_its_gradient(kind):
    ref = mlp()
    mesh, w = wrap(kind, mlp())
    x, y = batches(1)[0]
    loss = mse(ref(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    loss = mse(w(dist(x, mesh)), dist(y, mesh))
    loss.backward(retain_graph=True)
    loss.backward()                          # FSDP: reduced nothing (a countdown used up)
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    optimizer(kind, w, mesh, lr=1.0).step()
    assert_same_model(w, ref)
