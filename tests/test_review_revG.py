"""Review revG: fully_shard / DDP / DCP wrappers against torch's own behaviour."""
import pytest
import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import workbench as wb
from tests.test_fully_shard import V, MLPBlock, batches, tp_model


def _ac_tp_fsdp_run(monkeypatch, mp, ac):
    """(loss, total grad norm) of one step of the TP + fully_shard model, each block's MLP
    under activation checkpointing (``ac``: None, or use_reentrant's value)."""
    if ac is not None:
        def fwd(self, x):
            return x + checkpoint(lambda h: self.down(torch.tanh(self.up(h))), x,
                                  use_reentrant=ac)
        monkeypatch.setattr(MLPBlock, "forward", fwd)
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    m = tp_model()
    wb.parallelize_module(m, mesh, {"blocks.*.up": wb.ColwiseParallel(),
                                    "blocks.*.down": wb.RowwiseParallel()})
    wb.parallelize(m, mesh)
    for b in m.blocks:
        wb.fully_shard(b, mesh=mesh["dp"], mp_policy=mp)
    wb.fully_shard(m, mesh=mesh["dp"], mp_policy=mp)
    ids, y = batches(k=1)[0]
    out = m(wb.shard_tensor(ids, mesh, ["S(0)", "R"]))
    loss = F.cross_entropy(out.full().float().reshape(-1, V), y.reshape(-1))
    loss.backward()
    return loss.item(), torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9).item()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpoint_recompute_reads_the_param_dtype_copy(monkeypatch, reentrant):
    # FSDP2: inside a block's backward (its recompute) module.weight is the unsharded
    # parameter in param_dtype, as in its forward.  Here the recompute read a fresh fp32
    # gather of the shard (not in forward): "expected scalar type BFloat16 but found Float"
    mp = wb.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    want = _ac_tp_fsdp_run(monkeypatch, mp, None)
    got = _ac_tp_fsdp_run(monkeypatch, mp, reentrant)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_ddp_forward_sync_buffers_true_is_torchs_default():
    # torch 2.13 DDP: forward_sync_buffers=None means True (broadcast_buffers' successor:
    # rank 0's buffers before each forward), the behaviour built here; True was refused
    # with "leave it None"
    from torch import nn
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    m.eval()
    x = torch.randn(4, 3)
    want = m(x)
    mesh = wb.Mesh.grid(2, ["dp"])
    d = wb.DistributedDataParallel(m, mesh, forward_sync_buffers=True)
    out = d(x)
    torch.testing.assert_close(out.full() if isinstance(out, wb.DistTensor) else out, want)
    with pytest.raises(NotImplementedError, match="forward_sync_buffers=False"):
        wb.DistributedDataParallel(nn.Linear(3, 4), mesh, forward_sync_buffers=False)
