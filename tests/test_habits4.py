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
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(w.parameters(), 1e9), want)
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9), want)
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


# ---- 1. DistributedDataParallel's names are torch DDP's ------------------------------------
def bn_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def torch_ddp_names(m):
    """torch DDP registers the module as its child ``module``: its names (as
    ``nn.parallel.DistributedDataParallel`` gives them; checked against torch's own under
    torchrun in dist_scripts/habits_check.py)."""
    holder = nn.Module()
    holder.module = m
    return ([n for n, _ in holder.named_parameters()], [n for n, _ in holder.named_buffers()],
            [n for n, _ in holder.named_modules()], list(holder.state_dict()))


@pytest.mark.parametrize("tp", [False, True], ids=["plain", "beside-tp"])
def test_ddp_names_are_torch_ddps_and_name_its_state_dict_keys(tp):
    """``named_parameters()`` / ``named_buffers()`` / ``named_modules()`` gave the module's
    own names while ``state_dict()`` had torch DDP's ``module.`` keys: a name from one was
    not a key of the other, nor torch DDP's name."""
    params, buffers, modules, keys = torch_ddp_names(bn_mlp())
    if tp:
        mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
        m = wb.parallelize(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), mesh,
                           {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
        params, _, modules, keys = torch_ddp_names(
            nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
        ddp = wb.DistributedDataParallel(m, mesh, "dp")
    else:
        ddp = wb.DistributedDataParallel(bn_mlp(), wb.Mesh.grid(2, ["dp"]))
        assert [n for n, _ in ddp.named_buffers()] == buffers
    assert [n for n, _ in ddp.named_parameters()] == params      # was without "module."
    assert [n for n, _ in ddp.named_modules()] == modules
    assert [n for n, _ in ddp.named_children()] == ["module"]
    assert list(ddp.state_dict()) == keys
    assert set(params) <= set(keys)
    assert [n for n, _ in ddp.named_parameters(prefix="x")] == ["x." + n for n in params]
    assert list(ddp.named_parameters(recurse=False)) == []        # torch DDP holds none
    assert ddp.get_submodule("module.0") is ddp.module[0]
    if not tp:
        assert all(ddp.get_parameter(n) is p for n, p in ddp.named_parameters())
    # the optimizer's param_groups by name (a weight-decay split): the state dict's keys
    sd = ddp.state_dict()
    for n, _ in ddp.named_parameters():
        assert n in sd, n
    # a torch DDP checkpoint (its keys, one device's tensors) loads, and ours loads into
    # a plain module once the prefix is taken off, as torch documents for its own
    ref = bn_mlp() if not tp else nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    assert not ddp.load_state_dict({"module." + k: v for k, v in ref.state_dict().items()}
                                   ).missing_keys
    plain = bn_mlp() if not tp else nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    sd = {k: v.full() if isinstance(v, wb.DistTensor) else v for k, v in ddp.state_dict().items()}
    nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")   # torch's habit
    plain.load_state_dict(sd)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[k], v, msg=k)


@pytest.mark.slow
def test_torchrun_2x2_clip_over_zero3_shards_and_the_modules_parameters_is_one_devices(
        tmp_path_factory):
    """Under torchrun each process's ZeRO-3 shard holds 1/dp of its tensor-parallel
    storage; torch's clip_grad_norm_ over the shards raised ("the combined norm over
    DistTensor shards is not built for this mode"), and over the module's parameters
    raised naming the shards.  Now the shards' partial norms are reduced over the mesh's
    groups (a tp-replicated copy counted once): one device's norm and clipped step."""
    from tests.torchrun_support import json_rows, tp_2x2
    out, text = tp_2x2(tmp_path_factory, "habits4_clip_check.py")   # one launch: 2 x 2 checks
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert len(rows) == 4 * 3 * 2 * 2                   # ranks x wrappers x params x norms
    for r in rows:
        assert "raised" not in r, r
        got, want = r["norm"]
        assert abs(got - want) <= 1e-5 * want and r["params"] < 1e-6, r
    for case in {tuple(r["case"]) for r in rows}:       # every rank clips by one norm
        assert len({r["norm"][0] for r in rows if tuple(r["case"]) == case}) == 1, case


def test_ddp_over_disttensors_lists_a_tied_weight_under_each_name_without_dedup():
    """torch DDP's named_parameters(remove_duplicate=False) gives a tied weight under
    each of its names; the DistTensor mode gave it once (its first name)."""
    m, plain = tied(), tied()
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    wb.parallelize(m, mesh)
    ddp = wb.DistributedDataParallel(m, mesh, "dp")
    want, _, _, _ = torch_ddp_names(plain)
    assert [n for n, _ in ddp.named_parameters()] == want
    every = list(ddp.named_parameters(remove_duplicate=False))
    assert [n for n, _ in every] == [
        "module." + n for n, _ in plain.named_parameters(remove_duplicate=False)]
    assert every[0][1] is every[-1][1]                   # emb.weight is head.weight
    m.double()
    assert [n for n, _ in ddp.named_parameters()] == want        # the replicas kept
    assert all(p.dtype == torch.float64 for p in ddp.parameters())
