"""readsync: under torchrun, a read of a data-parallel gradient before the wrapper sums it
(``p.grad`` of ZeroRedundancyOptimizer(partition="chunks")'s replicas before ``step``:
Partial("sum") over dp, so its value is an all-reduce) made by some processes only.

Found (tests/dist_scripts/readsync_check.py, 2 gloo processes, init timeout_s=5): rank 0's
lone ``p.grad.norm()`` (the logging habit ``if rank == 0: print(p.grad.norm())``) entered an
all-reduce rank 1 never joined; it paired with rank 1's next collective and the job died in
``opt.step()`` ("Application timeout caused pair closure").  Now the reshard that sums such a
gradient first agrees the read with its peers through the job's store
(``reshard._agree_unsummed`` -> ``sim_mesh.agreed_reads.agree``, as fixlist16's parameter
reads): the lone reader gets an error naming the fix after timeout_s, no collective begun,
and the job goes on: the reads every process makes and the step are one device's.

And one program, one behaviour: ZeRO-2's ``p.grad`` raised ``GradInShard``'s refusal on
simulated ranks (backward reduce-scattered it) but read the gradient under torchrun (gloo's
calls block, so the gradient waits for step there); now it refuses on both.

The same launch holds torch's ShardedGradScaler on ZeRO-1/2 under torchrun
(tests/test_gradscaler.py: the simulated side).
"""
import pytest
import torch
from torch import nn

import workbench as wb

from .test_habits11 import close


def _one_device():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)
    ((ref(x) - y) ** 2).mean().backward()
    norms = [float(p.grad.norm()) for p in ref.parameters()]
    torch.optim.AdamW(ref.parameters(), lr=1e-2).step()
    return norms, [float(p.detach().sum()) for p in ref.parameters()]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """tests/dist_scripts/readsync_check.py's rows, from the session's one launch of
    torchrun_support.LONE_READS (with test_fixlist16's check, the same timeout_s=5)."""
    from tests.torchrun_support import lone_reads
    return lone_reads(tmp_path_factory, "readsync_check.py")


@pytest.mark.slow
def test_a_gradient_read_on_rank_0_only_ends_in_an_error_and_the_job_goes_on(rows):
    lone = rows[(0, "lone")]
    assert "a gradient (6, 3) before its wrapper sums it over 'dp'" in lone["out"]
    assert "process(es) [1] did not make this read within init()'s timeout_s=5 s" in lone["out"]
    assert 4.5 <= lone["s"] < 60
    norms, after = _one_device()
    for rank in (0, 1):
        assert rows[(rank, "both")]["out"] == pytest.approx(norms, rel=1e-5)
        assert rows[(rank, "after_step")]["out"] == pytest.approx(after, rel=1e-5, abs=1e-6)
        assert all("already reduce-scattered" in v for v in rows[(rank, "zero2")]["out"])


def test_simulated_zero2_refuses_the_read_as_torchrun_does_and_zero1_reads_exactly():
    """The simulated side of the same program: ZeRO-1's reads are one device's, ZeRO-2's
    refuse with the message torchrun gives (the test above)."""
    norms, _ = _one_device()
    for overlap in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3))
        mesh = wb.Mesh.grid(2, ["dp"])
        wb.parallelize(m, mesh)
        ps = [p for _, p in wb.dist_parameters(m)]
        wb.ZeroRedundancyOptimizer(ps, torch.optim.AdamW, mesh, "dp", partition="chunks",
                                   lr=1e-2, overlap_comm=overlap)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)
        ((m(wb.shard_tensor(x, mesh, [wb.Shard(0)])).full() - y) ** 2).mean().backward()
        if overlap:
            with pytest.raises(RuntimeError, match="already reduce-scattered"):
                ps[0].grad
        else:
            for p, want in zip(ps, norms):
                close(p.grad.norm().full(), torch.tensor(want))


@pytest.mark.slow
def test_sharded_grad_scaler_under_torchrun_is_one_devices(rows):
    """tests/dist_scripts/readsync_check.py (its scaler rows; 2 gloo processes, dp 2): torch's
    ShardedGradScaler on ZeRO-1 and ZeRO-2 (and on ``wb.fully_shard``; torch's GradScaler on
    ``wb.DistributedDataParallel``: guards), three AdamW steps, the second with an inf:
    every parameter after each step and the scale (2**10 -> 2**9) one device's
    GradScaler loop's, on both processes.  Before: the shards held no gradient when
    ``unscale_`` read them (the reduction waited for step), and ``scaler.step`` raised
    torch's "No inf checks were recorded for this optimizer".  A read of a shard's
    gradient on rank 0 alone (its first read reduce-scatters): an error naming the fix
    after init()'s timeout_s, and the job goes on."""
    from .test_gradscaler import SCALE, _data, _ref_step
    from .test_zero1tp import setup
    ref, _, ro = setup("zero1_dp")
    sc = torch.amp.GradScaler("cpu", init_scale=SCALE)
    want = []
    for x, y in _data():
        _ref_step(ref, ro, sc, x, y, 1e9)
        want.append(([float(p.detach().sum()) for p in ref.parameters()], sc.get_scale()))
    for rank in (0, 1):
        for stage in ("zero1", "zero2", "fully_shard", "ddp"):
            got = rows[(rank, f"scaler_{stage}")]["out"]
            for g, (sums, scale) in zip(got, want):
                assert g["scale"] == scale
                assert g["sums"] == pytest.approx(sums, rel=1e-5, abs=1e-6)
    assert want[-1][1] == SCALE / 2
    lone = rows[(0, "scaler_lone")]     # rank 0 alone reads a shard's gradient: told, no hang
    assert "the ZeroRedundancyOptimizer shards' .grad" in lone["out"]
    assert "process(es) [1] did not make this read" in lone["out"] and 4.5 <= lone["s"] < 60
