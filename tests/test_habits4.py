"""A PyTorch user's ordinary loop on the wrappers (habits4): each test holds a habit to
plain PyTorch (one device, or torch's own wrapper in a one-process gloo group) and failed
before its fix."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.strategies.zero3 import Zero3


class Tied(nn.Module):
    """An embedding and an output head sharing one weight (GPT-2's tying)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):                              # (B, T) -> (B, T, V)
        return self.head(torch.tanh(self.lin(self.emb(ids))))


def tied():
    torch.manual_seed(0)
    return Tied()


def ids():
    return torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["fsdp", "zero3"])
def test_tied_weight_stays_one_object_after_a_forward_over_disttensors(kind):
    """torch FSDP2 sets a tied parameter on every module sharing it (``_fsdp_param.py``
    ``_setattr_on_modules``): ``head.weight is emb.weight`` holds after a forward.  The
    DistTensor modes gathered one copy per module, so it went False (values right)."""
    ref, m = tied(), tied()
    mesh = wb.Mesh.grid((2, 1), ["dp", "tp"])
    wb.parallelize(m, mesh)
    w = Zero3(m, mesh, "dp") if kind == "zero3" else wb.FullyShardedDataParallel(m, mesh, "dp")
    out = w(wb.shard_tensor(ids(), mesh, ["S(0)", "R"])).full()
    assert m.head.weight is m.emb.weight                 # was False
    torch.testing.assert_close(out, ref(ids()))
    out.sum().backward()
    ref(ids()).sum().backward()
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(w.parameters(), 1e9),
                               torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    assert m.head.weight is m.emb.weight


# ---- 2. torch's clip_grad_norm_(model.parameters()) under ZeRO-3 over DistTensors -------------
PLAN = {"0": "colwise", "2": "rowwise"}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def xy(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def zero3_over_tp(kind, dims=(2, 2)):
    mesh = wb.Mesh.grid(dims, ["dp", "tp"])
    model = wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")
    w = Zero3(model, mesh, "dp", lr=0.1) if kind == "zero3" else \
        wb.FullyShardedDataParallel(model, mesh, "dp")
    return mesh, model, w


@pytest.mark.parametrize("which", ["model.parameters()", "attributes after forward"])
@pytest.mark.parametrize("kind,dims", [("fsdp", (2, 2)), ("fsdp", (3, 2)), ("zero3", (2, 2))])
def test_torch_clip_over_the_modules_parameters_is_one_devices_clip(kind, dims, which):
    """FSDP2's ``model.parameters()`` are its sharded DTensor parameters, so the user's
    ``clip_grad_norm_(model.parameters(), c)`` gives the global norm and clips.  Over the
    module ``FullyShardedDataParallel`` / ``Zero3`` wrapped (DistTensor mode) it raised,
    naming the wrapper's parameters(); now it clips the shards: one device's norm, and the
    step after it is one device's clipped step."""
    ref, (x, y) = mlp(), xy()
    ((ref(x) - y) ** 2).mean().backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), norm.item() / 3)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    mesh, model, w = zero3_over_tp(kind, dims)
    opt = torch.optim.SGD(w.parameters(), lr=0.1)      # (Zero3's own step is AdamW)
    pl = [wb.Shard(0), wb.Replicate()]
    ((w(wb.shard_tensor(x, mesh, pl)) - wb.shard_tensor(y, mesh, pl)) ** 2).mean().backward()
    w.finish_gradient_synchronization()
    ps = list(model.parameters()) if which == "model.parameters()" else \
        [model[0].weight, model[0].bias, model[2].weight, model[2].bias]
    got = torch.nn.utils.clip_grad_norm_(ps, norm.item() / 3)        # raised
    torch.testing.assert_close(got, want)
    after = torch.nn.utils.clip_grad_norm_(w.parameters(), 1e9)      # the shards clipped
    torch.testing.assert_close(after, want / 3, rtol=1e-4, atol=1e-6)
    opt.step()
    full = w.full_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), msg=n)


def test_torch_clip_value_over_the_modules_parameters_clamps_the_shards():
    ref, (x, y) = mlp(), xy()
    ((ref(x) - y) ** 2).mean().backward()
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
    mesh, model, w = zero3_over_tp("fsdp")
    pl = [wb.Shard(0), wb.Replicate()]
    ((w(wb.shard_tensor(x, mesh, pl)) - wb.shard_tensor(y, mesh, pl)) ** 2).mean().backward()
    w.finish_gradient_synchronization()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)        # raised
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full(), r.grad, msg=n)

