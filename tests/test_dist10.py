"""dist10: the same program on torch.distributed (4 gloo processes) as on simulated ranks.

A partial sum times a factor holding inf (divided by one holding 0) on some processes
only: x [Partial, Replicate] times a [Replicate, Shard(0)] factor on a 2 x 2 mesh.  The
dispatcher reduces the partial sum first where such a factor is met
(dispatch._unsafe_factor), reading values; under torch.distributed each process reads its
own shards, and before this the processes holding the inf held a Replicate product, the
others a Partial one (divergent placements: the next read's collectives did not pair).
Now they decide together through the job's store (agreed_reads.agree_any), not by a
collective: the decision is made inside reads one process may make alone (``d * d`` of
``p.grad.norm()`` on rank 0 only, tests/test_readsync.py), where the reverted all-reduce
(2e408050) paired with the peers' next collective.

tests/dist_scripts/dist10_check.py runs :data:`PROGRAMS` on each process; each process's
placements, local shard and full value are held to the simulated run's same rank and to
one device.
"""
import math

import pytest
import torch

import workbench as wb
from tests.dist_scripts.dist10_check import HYBRID, PROGRAMS, TIMEOUT_S, hybrid, result, whole


def _simulated(name):
    """PROGRAMS[name] on simulated ranks: (the output, the mesh)."""
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])

    def build(local_of, placements):
        return wb.DistTensor.from_local([local_of(r) for r in mesh.ranks], mesh, placements)
    return PROGRAMS[name][0](mesh, build), mesh


def _same(a, b):
    """Equal lists of floats, inf and nan included (nan equal to nan)."""
    ta, tb = torch.tensor(a), torch.tensor(b)
    return ta.shape == tb.shape and bool(torch.equal(ta.isnan(), tb.isnan())) and \
        bool(torch.equal(ta.nan_to_num(0.0, 7e30, -7e30), tb.nan_to_num(0.0, 7e30, -7e30)))


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_simulated_programs_are_one_devices(name):
    """The simulated side alone (fast): one device's value; a factor holding inf anywhere
    (a divisor holding 0; a partial part holding inf in ``x * x``) reduces the partial sum
    first (Replicate on dp), a finite one keeps it partial."""
    y, _ = _simulated(name)
    assert _same(y.full().tolist(), PROGRAMS[name][1]().tolist())
    first = y.placements[0]
    assert first.is_partial() == (name == "mul_finite"), y.placements


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """tests/dist_scripts/dist10_check.py's rows: one 4-process launch a session, whichever
    pytest-xdist worker runs this module's tests first."""
    from tests.torchrun_support import own_launch
    return own_launch("dist10_check.py", nproc=4, tmp_path_factory=tmp_path_factory)


@pytest.mark.slow
def test_each_process_holds_the_simulated_ranks_placements_and_one_devices_values(rows):
    for name in PROGRAMS:
        sim, mesh = _simulated(name)
        want = result(sim)
        assert _same(want["full"], PROGRAMS[name][1]().tolist())
        for rank in range(4):
            got = rows[(rank, name)]
            assert got["placements"] == want["placements"], (name, rank, got)
            assert _same(got["full"], want["full"]), (name, rank, got)
            assert _same(got["local"], sim.local(rank).tolist()), (name, rank, got)


@pytest.mark.slow
def test_a_lone_product_ends_in_an_error_naming_the_fix_and_the_job_goes_on(rows):
    lone = rows[(0, "lone_mul")]
    assert isinstance(lone["out"], str), lone
    assert "process(es) [1, 2, 3] did not make this read" in lone["out"], lone
    assert "make the same reads on every process" in lone["out"], lone
    assert TIMEOUT_S - 0.5 <= lone["s"] < 60, lone
    want = PROGRAMS["mul_inf_col1"][1]().tolist()
    assert math.isinf(want[2])
    for rank in range(4):
        got = rows[(rank, "after_lone")]
        assert got["placements"] == "(Replicate(), Shard(dim=0))", got
        assert _same(got["full"], want), got


@pytest.mark.slow
def test_reads_one_process_makes_alone_work_without_a_collective_or_raise_naming_the_fix(rows):
    """A replicated loss read on rank 0 alone (``float``, ``.item()``, a format, ``repr``)
    needs no collective: one device's value.  A fully_shard gradient's norm read on rank 0
    alone (last in the job) waits in an all-reduce its peers never join, as torch's
    ``_NormPartial`` does; it ends after init()'s timeout_s in an error naming the fix
    (before: gloo's "Timed out waiting 8000ms for recv operation to complete" alone), and
    so does a partial sum's ``.item()`` after it (gloo's "Application timeout caused pair
    closure" alone)."""
    loss = float(whole() @ torch.tensor([1., 2., 3., -1.]))      # one device's
    assert loss == 3.25
    assert rows[(0, "lone_replicated")]["out"][:3] == [loss, loss, "3.2500"]
    assert rows[(0, "lone_replicated")]["out"][3].startswith("DistTensor f32[] shape=()")
    assert [rows[(r, "loss")]["out"] for r in range(4)] == [loss] * 4
    lone = rows[(0, "lone_grad_norm")]
    assert "a read of a norm of a wrapper's gradient shards" in lone["out"], lone
    assert f"init()'s timeout_s={TIMEOUT_S} s" in lone["out"], lone
    assert "make the same reads on every process" in lone["out"], lone
    assert TIMEOUT_S - 0.5 <= lone["s"] < 60, lone
    lone = rows[(0, "lone_item")]       # gloo closed the pairs: at once, told the same
    assert "a read of a DistTensor f32[]{U_dp}" in lone["out"], lone
    assert "make the same reads on every process" in lone["out"], lone
    assert "restart the job" in lone["out"] and lone["s"] < 60, lone


@pytest.mark.slow
def test_hybrid_tp_training_with_dropout_and_clip_is_the_simulated_runs(rows):
    """tp x fully_shard(dp) and tp x DDP(dp) (dist10_check.hybrid): every process's clip
    norms and parameters after three AdamW steps are the simulated run's (the reduction
    order differs: 1e-6), and its generator stands where the simulated run's does
    (dropout drew the same numbers)."""
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    for kind in HYBRID:
        want = hybrid(kind, mesh)
        assert min(want["norms"]) > 0.5        # every step clipped
        for rank in range(4):
            got = rows[(rank, kind)]
            assert got["norms"] == pytest.approx(want["norms"], rel=1e-6), (kind, rank)
            assert got["sums"] == pytest.approx(want["sums"], rel=1e-6, abs=1e-7), (kind, rank)
            assert got["rng"] == want["rng"], (kind, rank)
