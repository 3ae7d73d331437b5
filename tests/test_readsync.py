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


@pytest.mark.slow
def test_a_gradient_read_on_rank_0_only_ends_in_an_error_and_the_job_goes_on():
    from tests.torchrun_support import own_launch
    rows = own_launch("readsync_check.py")
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
