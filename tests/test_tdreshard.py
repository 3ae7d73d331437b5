"""The same program on torchrun as on simulated ranks (task tdreshard): uneven shards run
with padded collectives on torch.distributed (sim_mesh/padded.py, as DTensor), so both
executors choose the same strategies; and an op's own gather of a sharded input gets one
redistribution of the summed gradients back on both (parallel/gather_backward_dist.py).

One gloo launch (8 processes) runs every case (tests/dist_scripts/tdreshard_check.py,
sharing the launch with test_distributed_engine's 8-process run: torchrun_support.
EIGHT_PROC); the simulator runs the same programs here and holds the processes' saved
parameter and gradient shards.  Held equal: the values and gradients (both
against plain PyTorch), each rank's collectives (kind, bytes, group), and for tiny
dp 2 x tp 2 x pp 2 sp the loss, the modeled step and every parameter and gradient shard.

Failed before: the torchrun step was 0.56319 ms for the simulator's 0.648783 (the last
stage's vocabulary of 75 is 38/37 over tp: torch.distributed took an even candidate and
all-gathered the logits, one all-gather of 9,600 B per micro-batch where the simulator
moves two all-to-alls each way and two count all-reduces); the uneven programs raised
NotImplementedError ("uneven shards are not supported on torch.distributed yet"); the
gathered input's gradient was all-reduced once per matmul then sliced on torchrun (two
all-reduces of 64 B where the simulator records one reduce-scatter of 64 B).  After the
simulator summed a replicated input's readers before one reduction (reshardbwd3),
torchrun still all-reduced per reader: gather_2d's x, replicated on dp and read by two
matmuls, two all-reduces of 48 B over dp where the simulator records one; and in the
training step the last stage's replicated lm_head weight (75 x 64) had its one
all-reduce over tp (19,200 B) recorded six collectives later on torchrun in the first
micro-batch of step 2 (the fused AdamW left the weight's version counter 0, so its
meeting point from step 1 was reused; the simulator's foreach AdamW bumps it).
gather_mixed (x gathered over tp by the matmuls and replicated, held once, over dp: one
reduce-scatter then one all-reduce for both readers) passed before too: it pins the mixed
case.  gather_sliced (x [R, S(0)] read by two matmuls whose plan slices it over dp then
gathers it over tp; tdreshard4): the simulator now reduces the readers' summed gradient
first (reduce-scatter over tp, then all-gather over dp); torch.distributed took the
ordinary path (each collective's own backward, per reader) and its collectives differed:
failed before gather_backward_dist took such plans, passes after.
"""
import os
import sys

import pytest
import torch

import workbench as wb
from tests.torchrun_support import EIGHT_PROC, eight_proc, json_rows, part_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist_scripts", "tdreshard_check.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import tdreshard_check as prog  # noqa: E402

TOL = 1e-5


def _sim_programs():
    out = {}
    for name, shape, names, fn in prog.PROGRAMS:
        mesh = wb.Mesh.grid(shape, list(names))
        res, tr = prog.run_program(fn, mesh)
        out[name] = (res, {r: prog.comm_of(tr, r) for r in mesh.ranks})
    return out


def _sim_train():
    from workbench.recipes.hybrid import Hybrid
    recs, tr, model = prog.trained(Hybrid(**prog.TRAIN))
    params = {n: p.full().detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.full().detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return recs, {r: prog.comm_of(tr, r) for r in range(8)}, params, grads


def _collectives(comm):
    return [c for c in comm if c[0] != "send_recv"]


def _messages(comm):
    return sorted(c for c in comm if c[0] == "send_recv")


def _sim_train_zb():
    from workbench.recipes.hybrid import Hybrid
    recs, tr, _ = prog.trained(Hybrid(**prog.TRAIN_ZB))
    return recs, {r: prog.comm_of(tr, r) for r in range(8)}


PART = "tdreshard_check.py {dir}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    sim = _sim_programs()
    recs, comm, params, grads = _sim_train()
    sim["train_zb"] = _sim_train_zb()
    # one launch: every 8-process part (torchrun_support.EIGHT_PROC: with
    # test_distributed_engine's dp 2 x tp 2 x pp 2 run)
    out, text = eight_proc(tmp_path_factory, PART)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["case"], r["rank"]): r for r in json_rows(text)}
    shards = part_dir(EIGHT_PROC, tmp_path_factory, PART)
    for r in range(8):           # each process's parameter and gradient shards, held here
        got = rows[("train", r)]
        if "raised" in got:
            continue
        diffs = {}
        for name, (loc, bounds, grad) in torch.load(shards / f"train_rank{r}.pt").items():
            sl = tuple(slice(s, s + n) for s, n in bounds)
            diffs[name] = [prog._diff(loc, params[name][sl]),
                           None if grad is None else prog._diff(grad, grads[name][sl])]
        assert sorted(diffs) == got["params"], r
        got["params"] = diffs
    return sim, (recs, comm, params, grads), rows


@pytest.mark.slow
@pytest.mark.parametrize("case", [p[0] for p in prog.PROGRAMS])
def test_programs_compute_as_plain_pytorch(runs, case):
    sim, _, rows = runs
    res, comm = sim[case]
    assert max(res.values()) < TOL, res                     # the simulator: plain PyTorch
    for r in comm:
        got = rows[(case, r)]
        assert "raised" not in got, got["raised"]
        assert max(got["diffs"].values()) < TOL, got["diffs"]   # torchrun: plain PyTorch


@pytest.mark.slow
@pytest.mark.parametrize("case", [p[0] for p in prog.PROGRAMS])
def test_programs_communicate_as_the_simulator(runs, case):
    _, comm = runs[0][case]
    for r, want in comm.items():
        got = runs[2][(case, r)]
        assert "raised" not in got, got["raised"]
        assert got["comm"] == want, (r, got["comm"], want)


@pytest.mark.slow
def test_hybrid_pipeline_step_values_are_the_simulators(runs):
    """tiny, dp 2 x tp 2 x pp 2 sp, 2 steps: every parameter and gradient shard, the loss."""
    _, (recs, comm, params, grads), rows = runs
    for r in range(8):
        got = rows[("train", r)]
        assert "raised" not in got, got["raised"]
        assert len(got["params"]) > 0
        for name, (dp, dg) in got["params"].items():
            assert dp < TOL, (r, name, dp)
            assert (dg is None) == (name not in grads), (r, name)
            assert dg is None or dg < TOL, (r, name, dg)
    lead = rows[("train", 0)]["records"]
    assert [g["loss"] for g in lead] == pytest.approx([s["loss"] for s in recs], rel=1e-6)


@pytest.mark.slow
def test_hybrid_pipeline_step_is_the_simulators(runs):
    """The same run: every rank's collectives and the modeled step."""
    _, (recs, comm, params, grads), rows = runs
    for r in range(8):
        got = rows[("train", r)]
        assert "raised" not in got, got["raised"]
        # in order, but for when a stage's messages are recorded: on torchrun by the
        # sender as it sends, in the simulator when the receiver runs (execute_dist.py)
        assert _collectives(got["comm"]) == _collectives(comm[r]), r
        assert _messages(got["comm"]) == _messages(comm[r]), r
    lead = rows[("train", 0)]["records"]
    assert [g["modeled_ms"] for g in lead] == pytest.approx([s["modeled_ms"] for s in recs],
                                                            rel=1e-9)


@pytest.mark.slow
def test_zero_bubble_step_is_the_simulators(runs):
    """The same model under ZB-H1 (B, then W walking the graph again): every rank's
    collectives and the modeled step.  Failed before: the simulator recorded the last
    stage's replicated lm_head weight's all-reduce over tp (19,200 B) once per step (W of
    micro-batches 2-4 took its shared way for B's, walked again) where torch.distributed
    runs it in each micro-batch's W (4): modeled 0.605411 ms against 0.610278."""
    recs, comm = runs[0]["train_zb"]
    rows = runs[2]
    for r in range(8):
        got = rows[("train_zb", r)]
        assert "raised" not in got, got["raised"]
        assert _collectives(got["comm"]) == _collectives(comm[r]), r
        assert _messages(got["comm"]) == _messages(comm[r]), r
    lead = rows[("train_zb", 0)]["records"]
    assert [g["loss"] for g in lead] == pytest.approx([s["loss"] for s in recs], rel=1e-6)
    assert [g["modeled_ms"] for g in lead] == pytest.approx([s["modeled_ms"] for s in recs],
                                                            rel=1e-9)
