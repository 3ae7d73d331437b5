"""Review revG: fully_shard / DDP / DCP wrappers against torch's own behaviour."""
import pytest
import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import workbench as wb
from tests.test_fully_shard import V, MLPBlock, batches, tp_model, wrap_tp_fsdp


def _ac_tp_fsdp_run(monkeypatch, mp, ac):
    """(loss, total grad norm) of one step of the TP + fully_shard model, each block's MLP
    under activation checkpointing (``ac``: None, or use_reentrant's value)."""
    if ac is not None:
        def fwd(self, x):
            return x + checkpoint(lambda h: self.down(torch.tanh(self.up(h))), x,
                                  use_reentrant=ac)
        monkeypatch.setattr(MLPBlock, "forward", fwd)
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    m = wrap_tp_fsdp(tp_model(), mesh, mp_policy=mp)
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


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_muon_over_laid_out_storage_refused_before_the_step(wrapper):
    # torch.optim.Muon (torch 2.13, _muon.py) orthogonalizes each 2-d parameter's update
    # and scales lr by its shape: over FSDP's (N, chunk) storage (2-d for any parameter)
    # or DDP's (N, d) rows of a 1-d one it took the storage as the matrix, a silently
    # other update than one device's (which refuses a 1-d parameter)
    from torch import nn
    torch.manual_seed(0)
    lin = nn.Linear(3, 5, bias=False) if wrapper == "fsdp" else nn.Linear(3, 5)
    mesh = wb.Mesh.grid(2, ["dp"])
    if wrapper == "fsdp":
        w = wb.FullyShardedDataParallel(lin, mesh)
        params = list(w.parameters())
    else:
        w = wb.DistributedDataParallel(lin, mesh)
        # habits11: p.ndim is the module's, so Muon refuses the 1-d bias at construction,
        # as on one device; the weight's (2, 5, 3) rows it takes, and the step refuses
        with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
            torch.optim.Muon([lin.bias], lr=0.1)
        params = [lin.weight]
    opt = torch.optim.Muon(params, lr=0.1)
    out = w(torch.randn(4, 3))
    (out.full() if isinstance(out, wb.DistTensor) else out).sum().backward()
    before = [p.detach().clone() for p in params]
    with pytest.raises(NotImplementedError, match="Muon"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


def _read_before_run_grad_norm(monkeypatch, wrap, first):
    """Total grad norm after one training step of a TP model whose forward reads
    head.weight before head runs (``first``: a forward run before it: no_grad / a
    training step's forward and backward)."""
    from tests.test_fully_shard import TPNet

    def fwd(self, ids):
        w = self.head.weight                  # read before head runs in this forward
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h) + 0.1 * F.linear(h, w)
    monkeypatch.setattr(TPNet, "forward", fwd)
    m, mesh = tp_model(), None
    if wrap:
        mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
        wrap_tp_fsdp(m, mesh)
    ids, y = batches(k=1)[0]

    def loss():
        out = m(wb.shard_tensor(ids, mesh, ["S(0)", "R"]) if wrap else ids)
        out = out.full() if isinstance(out, wb.DistTensor) else out
        return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))
    if first == "no_grad":
        with torch.no_grad():
            loss()
    elif first == "accumulate":             # gradient accumulation: two backwards
        loss().backward()
    loss().backward()
    return torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9).item()


@pytest.mark.parametrize("first", ["no_grad", "accumulate"])
def test_a_weight_read_before_its_module_runs_is_this_forwards(monkeypatch, first):
    # the copy an earlier forward gathered (no_grad: no autograd to the shard) was read
    # by the next forward while the shard's version was unchanged: head.weight's use
    # before head ran gave the shard no gradient (norm 0.883 for one device's 0.940)
    want = _read_before_run_grad_norm(monkeypatch, False, first)
    got = _read_before_run_grad_norm(monkeypatch, True, first)
    assert got == pytest.approx(want, rel=1e-5)
