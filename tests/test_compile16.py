"""compile16: the O1/O2 search prices a program's ``t.redistribute`` result that is then
sliced by its recorded way back, as O0 and eager do.

A program's ``t.redistribute`` copy is marked when it runs, at every level, as eager's
``wb.reshard`` result (``lower.execute_program``): a reader that slices it sends its
gradient back to the reshard's source by one plan (an all-to-all, or nothing), not the
slice's all-gather.  O0 priced that way (``propagate.greedy``: ``pinned_way``); the
whole-graph search (O1/O2) set no way and priced the slice's all-gather, and the step
(``schedule.build_schedule``, every level) modeled the all-gather too.  Now the search
gives each state's pinned copy its way (``propagate.pinned_way``) and prices it, and the
step lays out the way's steps, one rule for both (``strategy.way_steps``, which the
dispatcher's chooser prices): modeled collectives are the run's, and the search's
estimate is the step's.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import workbench as wb
from tests.test_slice15 import CASES, OUT, PROFILE, _comm, _program, _v, traced_run

LEVELS = ("O1", "O2")


def _modeled(prog):
    """(kind, buffer bytes) of the collectives rank 0 runs in the modeled step."""
    st = prog.step()
    return Counter((e.name, e.args["buffer_bytes"]) for e in st.trace.events
                   if e.stream == "comm" and 0 in e.ranks)


def _run(case, level):
    f, tr, y, x, _ = traced_run(*case[1:], level)
    return f, tuple(y.placements), Counter(_comm(tr)), y.full().detach(), x.grad.full()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_modeled_collectives_are_the_runs(case, level):
    """O1 / O2: the modeled step's collectives (kind, buffer bytes, rank 0) are those the
    run records, forward and backward; the strategy, the collectives, the values and the
    gradient are eager's."""
    prog, ps, run, out, grad = _run(case, level)
    _, e_ps, e_run, e_out, e_grad = _run(case, "eager")
    assert _modeled(prog) == run, (prog.schedule, run)
    assert ps == e_ps == OUT.get(case[0], tuple(case[3]))
    assert run == e_run
    torch.testing.assert_close(out, e_out, rtol=0, atol=0)
    torch.testing.assert_close(grad, e_grad, rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_o0_step_models_the_way(case):
    """O0's step too (the schedule is every level's): no all-gather for the slice's
    backward where the run sends the way's all-to-all or nothing."""
    prog, _, run, _, _ = _run(case, "O0")
    assert _modeled(prog) == run, (prog.schedule, run)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_search_estimate_is_the_step(case):
    """The search's estimate of its layout is the O1 step's replayed time, and prices the
    reader of the pinned copy as greedy (O0, eager's chooser) does: the same backward."""
    name, mesh_shape, src, oth, oshape = case
    mesh = wb.Mesh.grid(mesh_shape, ["dp", "tp"][-len(mesh_shape):])
    x = wb.shard_tensor(_v((8, 16), 0), mesh, src).requires_grad_()
    o = wb.shard_tensor(_v(oshape, 1), mesh, oth)
    prog = wb.compile(_program(mesh), x, o, level="O1")
    assert prog.assignment.time == pytest.approx(prog.step().time, rel=1e-12, abs=0)
    mul = next(n for n in prog.graph.nodes if n.op == "mul")
    a, gr = prog.assignment, prog.greedy
    assert a.choice[mul.nid].strategy == gr.choice[mul.nid].strategy
    assert a.costs[mul.nid].bwd_comm == pytest.approx(gr.costs[mul.nid].bwd_comm, rel=1e-12)
    assert a.time <= gr.time


def test_way_only_where_the_copy_gathers():
    """A program's t.redistribute that gathers nothing (S(1) -> S(0): an all-to-all) has
    no way back: its slice is priced and modeled as before, and the modeled step is the
    run's."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    x = wb.shard_tensor(_v((8, 16), 0), mesh, [wb.Shard(1)]).requires_grad_()
    o = wb.shard_tensor(_v((8, 16), 1), mesh, [wb.Shard(0)])

    def f(t, u):
        return t.redistribute(mesh, [wb.Shard(0)]) * u
    for level in ("O0",) + LEVELS:
        prog = wb.compile(f, x, o, level=level)
        with wb.trace(PROFILE) as tr:
            y = prog(x, o)
            y.sum().backward()
        assert _modeled(prog) == Counter(_comm(tr)), level
        x.grad = None


@pytest.mark.parametrize("level", ("O0",) + LEVELS)
def test_copy_read_whole_reduces_back_to_its_source(level):
    """A program's t.redistribute copy read as it is by an op whose output is split
    (``t.redistribute(R) @ w``, w S(1)): its gradient goes back to the source by one
    reduce-scatter (the way's), which the search and greedy price (not the all-reduce of
    the gathered bytes: O0's estimate 13.47 us against its step's 12.04); the estimate is
    the step, the step's collectives the run's and eager's, values one device's."""
    mesh = wb.Mesh.grid((4,), ["tp"])

    def f(t, w):
        return t.redistribute(mesh, [wb.Replicate()]) @ w
    xr = _v((8, 16), 0).requires_grad_()
    (xr @ _v((16, 8), 1)).sum().backward()
    got = []
    for lv in ("eager", level):
        x = wb.shard_tensor(_v((8, 16), 0), mesh, [wb.Shard(0)]).requires_grad_()
        w = wb.shard_tensor(_v((16, 8), 1), mesh, [wb.Shard(1)])
        p = f if lv == "eager" else wb.compile(f, x, w, level=lv)
        with wb.trace(PROFILE) as tr:
            y = p(x, w)
            y.sum().backward()
        torch.testing.assert_close(x.grad.full(), xr.grad, rtol=0, atol=0)
        got.append((tuple(y.placements), Counter(_comm(tr))))
    assert got[0] == got[1]
    assert Counter(k for k, _ in got[1][1]) == Counter(["all_gather", "reduce_scatter"])
    assert _modeled(p) == got[1][1]
    a = p.greedy if level == "O0" else p.assignment
    base = p.stages[0][2].time
    assert a.time == pytest.approx(base, rel=1e-12, abs=0)
