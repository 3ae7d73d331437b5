"""A PyTorch user's habits on the wrappers, round 16 (habits16): habits15's leftovers, each
held to one device's plain PyTorch (or a raise naming the fix), on simulated ranks.

1. Freezing through the optimizer's parameter (``opt_param.requires_grad_(False)``, the
   shard FSDP / Zero3 over tensor parallelism hand the optimizer): the module's own
   parameters read ``requires_grad`` True still (fully_shard's agreed): now the shard's.
2. The DDP-over-TP view error said "every replica's shards" under torch.distributed too,
   where the storage is this process's tensor-parallel shard: worded for each case.
3. ``nn.init.normal_`` on Zero3's shards over tensor parallelism raised (FSDP's gave one
   device's draw): now one device's draw too (``_wb_draw_store``, laid_out._one_draw).
"""
import copy

import pytest
import torch
from torch import nn

import workbench as wb

from .test_habits15 import Wrapped


@pytest.mark.parametrize("kind", ["fsdp_tp", "zero3_tp", "fully_shard_tp", "ddp_tp", "zero_tp"])
def test_freezing_the_optimizers_parameter_is_read_on_the_module(kind):
    """Before: FSDP / Zero3 over 2 x 2 read [True, True, True, True] on the module after
    ``wr.params()[1].requires_grad_(False)`` (the optimizer's parameter read False)."""
    wr = Wrapped(kind)
    ps = wr.params()
    ps[1].requires_grad_(False)
    assert [p.requires_grad for p in ps] == [True, False, True, True]
    assert [p.requires_grad for p in wr.m.parameters()] == [True, False, True, True]
    assert wr.m[0].bias.requires_grad is False
    ps[1].requires_grad_(True)
    assert [p.requires_grad for p in wr.m.parameters()] == [True] * 4
    wr.m[0].bias.requires_grad_(False)          # the other direction (a guard)
    assert [p.requires_grad for p in ps] == [True, False, True, True]
    assert [p.requires_grad for p in wr.m.parameters()] == [True, False, True, True]


def test_ddp_over_tp_view_error_names_the_processs_shard_when_distributed():
    """The view error on simulated ranks names every replica's shards (as before); under
    torch.distributed (one process's storage, ``(1, 1, *local)``) this process's shard,
    gathered from every tensor-parallel process.  Before: "every replica's shards" in both."""
    from workbench.parallel.strategies.laid_out_replicas import view_refusal
    wr = Wrapped("ddp_tp")
    p = wr.params()[0]
    with pytest.raises(NotImplementedError, match=r"every replica's shards \(shape "
                       r"\(2, 2, 3, 3\)\).*\(6, 3\).*model\.<name>\.full\(\)"):
        p[0]
    msg = view_refusal("__getitem__", (1, 1, 3, 3), (6, 3), True)
    assert "this process's tensor-parallel shard (shape (1, 1, 3, 3))" in msg
    assert "every replica" not in msg and "model.<name>.full()" in msg
    # the flag the wrapper sets, and what its copies carry
    assert p._wb_distributed is False
    with torch.no_grad():
        assert p.detach()._wb_distributed is False


@pytest.mark.parametrize("kind", ["fsdp_tp", "zero3_tp"])
def test_normal_init_of_the_optimizers_parameters_is_one_devices_draw(kind):
    """``nn.init.normal_`` on FSDP's / Zero3's shards over tensor parallelism (and on
    ``p.data``): one device's draw of the module's shape, as torch's fully_shard-then-init;
    the forward and a step after it one device's.  Before: Zero3 raised "in-place init of a
    parameter after wrapping" (FSDP's a guard)."""
    from .test_habits15 import assert_same_model, batches, mk, ref_backward
    from .test_habits11 import close
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    ps = wr.params()
    for draw in (ref, None):
        torch.manual_seed(3)
        with torch.no_grad():
            torch.nn.init.normal_(ref[0].weight if draw is ref else ps[0], 0.0, 0.02)
            torch.nn.init.normal_(ref[2].weight.data if draw is ref else ps[2].data, 1.0, 0.5)
    assert_same_model(wr, ref)
    x, y = batches(1)[0]
    with torch.no_grad():
        close(wr.out(x), ref(x))
    opt, ro = wr.optimizer(), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    wr.backward(x, y)
    ref_backward(ref, x, y)
    opt.step()
    ro.step()
    assert_same_model(wr, ref)


def test_ddp_over_disttensors_of_one_whole_replica_gives_torchs_views():
    """DDP over a module's DistTensors on a one-rank mesh (``parallelize(m, mesh, {})``;
    under torchrun each process's replica is the same ``(1, *shape)`` storage): the storage
    holds one whole replica, so ``p.flatten()`` / ``p.T`` / ``p.grad.flatten()`` are the
    views torch's DDP gives.  Was: refused ("no view of it exists here"), which also broke
    test_fixlist2's torchrun DDP script (``p.grad.flatten()``)."""
    torch.manual_seed(0)
    mesh = wb.Mesh.grid(1, ["dp"])
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    ref = copy.deepcopy(m)
    ddp = wb.DistributedDataParallel(wb.parallelize(m, mesh, {}), mesh)
    x = torch.randn(3, 4, dtype=torch.float64)
    ddp(wb.shard_tensor(x, mesh, [wb.Replicate()])).sum().backward()
    ddp.finish_gradient_synchronization()
    ref(x).sum().backward()
    for p, r in zip(ddp.parameters(), ref.parameters()):
        assert torch.equal(p.flatten().detach(), r.detach().flatten())
        g = p.grad.flatten()
        assert type(g) is torch.Tensor and g.shape == (r.numel(),)
        torch.testing.assert_close(g, r.grad.flatten(), rtol=0, atol=1e-15)
        if r.dim() == 2:
            assert torch.equal(p.T.detach(), r.detach().T)
    two = wb.Mesh.grid(2, ["dp"])                      # two replicas: still refused
    d2 = wb.DistributedDataParallel(wb.parallelize(copy.deepcopy(ref), two, {}), two)
    with pytest.raises(NotImplementedError, match="no view of it exists here"):
        next(iter(d2.parameters())).flatten()
