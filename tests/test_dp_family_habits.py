"""A user's training loop on the data-parallel family's DistTensor modes (dp beside tp on
(2, 2) ranks): torch's and wb's clip_grad_norm_ give one device's norm or raise, Zero3's
module habits (state_dict, load_state_dict, zero_grad, requires_grad_, .to) read and write
its shards, never its stale templates."""
import math

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.strategies.data_parallel import DataParallel
from workbench.parallel.strategies.zero3 import Zero3

PLAN = {"0": "colwise", "2": "rowwise"}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def one_device_norm(norm_type):
    m, (x, y) = mlp(), batch()
    ((m(x) - y) ** 2).mean().backward()
    return torch.nn.utils.get_total_norm([p.grad for p in m.parameters()], norm_type)


def parallel():
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    return mesh, wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")


def backward(f, mesh):
    x, y = batch()
    xd = wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()])
    yd = wb.shard_tensor(y, mesh, [wb.Shard(0), wb.Replicate()])
    ((f(xd) - yd) ** 2).mean().backward()


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("kind", ["ddp", "dp0"])
def test_torch_clip_over_ddp_replicas_is_one_devices_norm(kind, norm_type):
    mesh, model = parallel()
    if kind == "ddp":
        w = wb.DistributedDataParallel(model, mesh, "dp")
        with w.no_sync():               # (outside it backward sums them itself, as torch's)
            backward(w, mesh)
    else:
        w = DataParallel([p for _, p in wb.dist_parameters(model)], mesh)
        backward(model, mesh)
    with pytest.raises(RuntimeError, match="finish_gradient_synchronization"):
        torch.nn.utils.clip_grad_norm_(w.parameters(), 1.0, norm_type)   # not summed yet
    with pytest.raises(RuntimeError, match="finish_gradient_synchronization"):
        wb.clip_grad_norm_(model.parameters(), 1.0, norm_type)
    w.finish_gradient_synchronization()
    ref = one_device_norm(norm_type)
    got = torch.nn.utils.clip_grad_norm_(w.parameters(), 1e9, norm_type)
    assert torch.allclose(got, ref, rtol=1e-5), (got, ref)      # was sqrt(2) x on dp=2
    assert torch.allclose(wb.clip_grad_norm_(model.parameters(), 1e9, norm_type), ref,
                          rtol=1e-5)
    # clipped to half of it: the model's global norm becomes that (one device's clip)
    torch.nn.utils.clip_grad_norm_(w.parameters(), ref.item() / 2, norm_type)
    after = wb.clip_grad_norm_(model.parameters(), 1e9, norm_type)
    assert torch.allclose(after, ref / 2, rtol=1e-4)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_2_clip_raises_naming_why(zero):
    mesh, model = parallel()
    DataParallel([p for _, p in wb.dist_parameters(model)], mesh, zero=zero)
    backward(model, mesh)
    for fn in (wb.clip_grad_norm_, wb.clip_grad_value_):
        with pytest.raises(RuntimeError, match=r"inside step\(\)"):
            fn(model.parameters(), 1.0)


@pytest.mark.parametrize("cls", ["fsdp", "zero3"])
def test_fsdp_dist_clip_is_one_devices_or_raises(cls):
    mesh, model = parallel()
    w = Zero3(model, mesh, "dp") if cls == "zero3" else \
        wb.FullyShardedDataParallel(model, mesh, "dp")
    backward(w, mesh)
    w.finish_gradient_synchronization()
    got = torch.nn.utils.clip_grad_norm_(w.parameters(), 1e9)
    assert torch.allclose(got, one_device_norm(2.0), rtol=1e-5)
    # the module's own parameters clip the shards, as FSDP2's (habits4; it raised)
    assert torch.allclose(wb.clip_grad_norm_(model.parameters(), 1e9), got, rtol=1e-6)


def test_zero3_module_state_dict_tracks_the_trained_shards_and_loads_into_them():
    mesh, model = parallel()
    z = Zero3(model, mesh, "dp", lr=1e-2)
    backward(z, mesh)
    z.step()
    full = z.full_state_dict()
    sd = model.state_dict()
    assert set(sd) == set(full)
    for k, v in sd.items():
        assert isinstance(v, wb.DistTensor) and torch.equal(v.full(), full[k]), k
    assert set(z.state_dict()) == set(full)
    # load a one-device state dict (full tensors) into the module: the shards take it
    ref = mlp().state_dict()
    model.load_state_dict(ref)
    for k, v in z.full_state_dict().items():
        assert torch.equal(v, ref[k]), k
    # a failed load leaves the shards untouched
    bad = dict(ref)
    bad["0.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict(bad)
    for k, v in z.full_state_dict().items():
        assert torch.equal(v, ref[k]), k
    # the forward reads the loaded values (one device's output)
    x, _ = batch()
    out = z(wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()])).full()
    assert torch.allclose(out, mlp()(x), atol=1e-6)


def test_zero3_module_zero_grad_requires_grad_and_to_reach_the_shards():
    mesh, model = parallel()
    z = Zero3(model, mesh, "dp")
    backward(z, mesh)
    assert all(p.grad is not None for p in z.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in z.parameters())
    model.requires_grad_(False)
    assert not any(p.requires_grad for p in z.parameters())
    model.requires_grad_(True)
    assert all(p.requires_grad for p in z.parameters())
    with pytest.raises(NotImplementedError, match="before wrapping"):
        model.double()
    assert all(p.dtype == torch.float32 for p in z.parameters())


def test_ddp_dist_module_double_keeps_the_optimizers_replicas():
    mesh, model = parallel()
    w = wb.DistributedDataParallel(model, mesh, "dp")
    before = list(w.parameters())
    model.double()
    after = list(w.parameters())
    assert all(a is b for a, b in zip(before, after))       # the optimizer's leaves
    assert all(p.dtype == torch.float64 for p in after)


@pytest.mark.parametrize("kind", ["ddp", "dp0"])
def test_ddp_replicas_accumulate_over_synced_backwards_and_sync_once(kind):
    """Two backwards, each followed by finish_gradient_synchronization (called twice the
    second time), no zero_grad between: one device's accumulated gradient, as torch DDP."""
    m, (x, y) = mlp(), batch()
    for _ in range(2):
        ((m(x) - y) ** 2).mean().backward()
    ref = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])
    mesh, model = parallel()
    if kind == "ddp":
        w = f = wb.DistributedDataParallel(model, mesh, "dp")
    else:
        w, f = DataParallel([p for _, p in wb.dist_parameters(model)], mesh), model
    backward(f, mesh)
    w.finish_gradient_synchronization()
    backward(f, mesh)
    w.finish_gradient_synchronization()
    w.finish_gradient_synchronization()              # idempotent: summed once
    got = torch.nn.utils.clip_grad_norm_(w.parameters(), 1e9)
    assert torch.allclose(got, ref, rtol=1e-5), (got, ref)
    full = {n: p.grad.full() for n, p in wb.dist_parameters(model)}
    for n, p in m.named_parameters():
        assert torch.allclose(full[n], p.grad, atol=1e-6), n


def test_ddp_dist_state_dict_zero_grad_requires_grad_and_double():
    mesh, model = parallel()
    w = wb.DistributedDataParallel(model, mesh, "dp")
    leaves = list(w.parameters())
    sd = w.state_dict()
    assert set(sd) == {"module." + k for k in mlp().state_dict()}
    assert all(isinstance(v, wb.DistTensor) for v in sd.values())
    ref = {k: v + 1.0 for k, v in mlp().state_dict().items()}       # one device's values
    w.load_state_dict({"module." + k: v for k, v in ref.items()})
    assert all(a is b for a, b in zip(leaves, w.parameters()))      # in place: the optimizer's
    w.check_replicas()                                              # every replica loaded
    for k, v in w.full_state_dict().items():
        assert torch.equal(v, ref[k]), k
    with pytest.raises(RuntimeError, match="Missing key"):
        w.load_state_dict({k: v for k, v in ref.items()})           # no "module." prefix
    for k, v in w.full_state_dict().items():
        assert torch.equal(v, ref[k]), k                            # untouched
    backward(w, mesh)
    w.finish_gradient_synchronization()
    w.zero_grad()
    assert all(p.grad is None for p in w.parameters())
    w.requires_grad_(False)
    assert not any(p.requires_grad for p in w.parameters())
    w.requires_grad_(True)
    w.double()
    assert all(a is b and a.dtype == torch.float64 for a, b in zip(leaves, w.parameters()))
    assert all(v.dtype == torch.float64 for v in w.full_state_dict().values())


# ---- in-place init after wrapping (plain modules' rows and shards, DistTensor shards) ------
def _wrapped_linears():
    mesh = wb.Mesh.grid(2, ["dp"])
    torch.manual_seed(0)
    ddp = wb.DistributedDataParallel(nn.Linear(6, 4), mesh)
    torch.manual_seed(0)
    fsdp = wb.FullyShardedDataParallel(nn.Linear(6, 4), mesh)
    m2, model = parallel()
    z = Zero3(model, m2, "dp")
    return [(ddp.module, ddp), (fsdp.module, fsdp), (model[0], z)]


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("init", [
    lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)), nn.init.xavier_normal_,
    lambda t: nn.init.trunc_normal_(t, std=0.02), lambda t: t.normal_(0.0, 0.02)])
def test_random_init_after_wrapping_is_one_devices_draw(which, init):
    """Was refused (habits12 made it one device's): the values one device draws in the
    module's shape with the same seed, the generator advanced as far; the module's own
    reset_parameters too, but on Zero3's templates over DistTensors (still refused)."""
    lin, w = _wrapped_linears()[which]
    params = list(w.parameters())
    want = torch.empty(params[0]._wb_shape)
    torch.manual_seed(5)
    init(want)
    after = torch.rand(())
    torch.manual_seed(5)
    with torch.no_grad():
        init(params[0])
    assert torch.equal(torch.rand(()), after)
    assert torch.equal(params[0].full_tensor(), want)
    if which < 2:                           # the module's own reset_parameters too
        ref = nn.Linear(6, 4)
        torch.manual_seed(6)
        ref.reset_parameters()
        torch.manual_seed(6)
        lin.reset_parameters()
        for a, b in zip(w.full_state_dict().values(), ref.state_dict().values()):
            assert torch.equal(a, b)
    else:
        with pytest.raises(RuntimeError, match="before wrapping"):
            lin.reset_parameters()


def test_constant_init_after_wrapping_is_one_devices():
    for lin, w in _wrapped_linears()[:2]:
        for p in w.parameters():
            nn.init.zeros_(p)
        sd = w.full_state_dict()
        assert all(torch.equal(v, torch.zeros_like(v)) for v in sd.values())


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_data_parallel_clip_then_step_is_one_devices(zero):
    """DataParallel(zero).clip_grad_norm_ (ZeRO-1/2: the optimizer's, after its
    reduce-scatter) returns one device's norm and the step is one device's clipped step."""
    m, (x, y) = mlp(), batch()
    ((m(x) - y) ** 2).mean().backward()
    ref = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
    torch.nn.utils.clip_grad_norm_(m.parameters(), ref.item() / 2)
    torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0).step()
    mesh, model = parallel()
    dp = DataParallel([p for _, p in wb.dist_parameters(model)], mesh, zero=zero, lr=1e-2)
    backward(model, mesh)
    with wb.trace() as tr:
        got = dp.clip_grad_norm_(ref.item() / 2)
    assert torch.allclose(got, ref, rtol=1e-5), (got, ref)
    if zero:    # ZeRO-1: its reduce-scatter (ZeRO-2: in backward), the norm parts (scalars)
        ev = tr.collectives()
        assert "all_reduce" in {e.name for e in ev} <= {"reduce_scatter", "all_reduce"}
        # (one over every rank, Megatron-LM's distributed optimizer: fixlist9)
        assert [(e.label, e.ranks) for e in ev if e.name == "all_reduce"] == \
            [("clip_grad norm over dp x tp", tuple(mesh.ranks))]
    dp.step()
    for n, p in m.named_parameters():
        got = dict(wb.dist_parameters(model))[n].full()
        assert torch.allclose(got, p.detach(), atol=1e-6), n


@pytest.mark.parametrize("init", ["normal", "zeros", "setitem"])
def test_writing_a_zero3_template_raises_and_changes_nothing(init):
    """After Zero3 moved a parameter into flat shards, the module's DistTensor is a stale
    template the forward never reads: an in-place write to it raises (initialize before
    wrapping), and neither the template nor the shards change."""
    mesh, model = parallel()
    z = Zero3(model, mesh, "dp", lr=1e-2)
    w = model[0].weight
    before, shards = w.full().clone(), z.full_state_dict()
    with pytest.raises(RuntimeError, match="initialize before wrapping"):
        with torch.no_grad():
            if init == "normal":
                torch.nn.init.normal_(w)
            elif init == "zeros":
                w.zero_()
            else:
                w[0] = 1.0
    assert torch.equal(w.full(), before)
    for k, v in z.full_state_dict().items():
        assert torch.equal(v, shards[k]), k
