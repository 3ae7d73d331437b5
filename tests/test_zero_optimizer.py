"""ZeroRedundancyOptimizer on simulated ranks: any torch.optim class, states sharded,
results bitwise equal to the unsharded optimizer (except the fused CPU kernel)."""
import pytest
import torch

import workbench as wb
from tests.dist_scripts.wrappers_model import data, loss_fn, make, one_device, wrapped


def ddp_run(mesh, opt_cls, zero: bool, **kw):
    # the toy's unused parameter: torch DDP trains it only with find_unused_parameters
    ddp = wb.DistributedDataParallel(make(), mesh, find_unused_parameters=True)
    opt = wb.ZeroRedundancyOptimizer(ddp.parameters(), opt_cls, mesh, **kw) if zero \
        else opt_cls(ddp.parameters(), **kw)
    for ids, y in data(5):
        opt.zero_grad()
        loss_fn(ddp(wb.shard_tensor(ids, mesh, ["S(0)"])), wb.shard_tensor(y, mesh, ["S(0)"])) \
            .backward()
        opt.step()
    return ddp.full_state_dict(), opt


@pytest.mark.parametrize("opt_cls,kw", [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1, foreach=True)),
    (torch.optim.Adam, dict(lr=1e-3, foreach=True))])
@pytest.mark.parametrize("n", [2, 4])
def test_bitwise_equal_to_the_unsharded_optimizer(n, opt_cls, kw):
    mesh = wb.Mesh.grid(n, ["dp"])
    got, _ = ddp_run(mesh, opt_cls, True, **kw)
    want, _ = ddp_run(mesh, opt_cls, False, **kw)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_one_devices_parameters(opt):
    got = wrapped("zero", opt, wb.Mesh.grid(4, ["dp"]))
    ref = one_device(opt)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-6, msg=k)


def test_states_are_sharded_by_owner():
    mesh = wb.Mesh.grid(2, ["dp"])
    _, opt = ddp_run(mesh, torch.optim.AdamW, True, lr=1e-3)
    held = {k: sum(s["exp_avg"].numel() for s in o.state.values())
            for k, o in opt.optimizers.items() if o is not None}
    # emb.weight 96 elements to one rank; hid.weight 64 + hid.bias 8 to the other (greedy);
    # frozen and unused get no state (no gradient)
    assert sorted(held.values()) == [72, 96]
    assert sum(held.values()) == 96 + 64 + 8


@pytest.mark.parametrize("n", [2, 4])
def test_fused_cpu_adamw_too_because_parameters_are_partitioned_whole(n):
    """Each owner runs the kernel on whole tensors, so even the fused CPU kernel sees
    the same tensors as the unsharded optimizer (measured bitwise equal, torch 2.13)."""
    mesh = wb.Mesh.grid(n, ["dp"])
    got, _ = ddp_run(mesh, torch.optim.AdamW, True, lr=1e-3, fused=True)
    want, _ = ddp_run(mesh, torch.optim.AdamW, False, lr=1e-3, fused=True)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_bad_optimizer_class_is_named():
    with pytest.raises(TypeError, match="optimizer_class="):
        wb.ZeroRedundancyOptimizer(make().parameters(), "adamw", wb.Mesh.grid(2, ["dp"]))
