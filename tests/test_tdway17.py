"""tdway17: a marked copy's way back on torch.distributed as in the simulator.

``t.redistribute(mesh, [R])`` (``wb.reshard``) of a sharded ``x`` records the gradient's way
back to ``x`` once (``reshard_backward.mark``): a reader that slices the gathered copy sends
its gradient back by one redistribution (an all-to-all, or nothing back to x's own dim),
and the dispatcher's chooser prices it so (``dispatch._grads`` gives the way's key;
slice15, chooser17).  On torch.distributed the mark was another one
(``gather_backward_dist.mark``: x noted, no key), so ``_grads`` gave ``True``: the chooser
priced the slice as a plain input's (an all-gather in backward) and gathered the other
operand instead, and at O0 (whose choice is the simulator's) the slice kept its own
backward, an all-gather.  Measured before on 4 gloo processes (rank 0, buffer bytes,
tests/dist_scripts/tdway17_check.py): eager S1-R-mul-S0 output Replicate and forward
[all_gather 1024, all_gather 1024] where the simulator slices (output S(0), forward
[all_gather 1024], backward [all_to_all 256]); O0 backward [all_gather 1024] for the
simulator's [all_to_all 256] (S1-R-mul-S1 and the row: for nothing; two-slices: two
all-gathers for one all-to-all).  Now both marks carry the way by one rule
(``reshard_backward.way_key``; ``reshard_backward.way_of`` reads either) and a slicing
reader on torch.distributed meets the stand-in of x (``gather_backward_dist.use_marked``,
also from O0's ``reshard_backward.execute_marked``): the same placements, collectives
(kind, bytes) forward and backward, values and gradients on every process.  A mark's
readers meet on one stand-in of x (``gather_backward_dist._MarkMeet``) and their
gradients are merged as the simulator's way merges its uses (``reshard_backward._merged``):
a column-parallel reader (Partial) and a slicing one (S(0)) go back by one
reduce-scatter (per-rank-then-slice: backward [all_to_all 256, all_to_all 256,
reduce_scatter 1024] before, one stand-in per gradient layout, for the simulator's
[all_to_all 256, reduce_scatter 1024]).

Also (O0, the simulator alone): ``reshard_backward.way_noted`` takes the per-rank dims of
the reader (``per_rank_dims``), as eager's ``convert`` notes them: a slice after a per-rank
read is priced 0 B back, as eager prices it (test_o0_notes_a_per_rank_reader_as_eager).
"""
from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch

import workbench as wb

R, S = wb.Replicate, wb.Shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "dist_scripts"))
import tdway17_check as chk  # noqa: E402

CASES = [(p[0], level) for p in chk.PROGRAMS for level in chk.LEVELS]


@pytest.fixture(scope="module")
def torchrun_rows(tmp_path_factory):
    """tests/dist_scripts/tdway17_check.py's rows (4 gloo processes; the shared FOUR_PROC
    launch, tests/torchrun_support.py)."""
    from tests.torchrun_support import four_proc, json_rows
    out, text = four_proc(tmp_path_factory, "tdway17_check.py")
    assert out.returncode == 0, out.stderr[-3000:]
    return json_rows(text)


def simulated(name, level):
    _, shape, names, x_pl, others = next(p for p in chk.PROGRAMS if p[0] == name)
    return chk.run(wb.Mesh.grid(shape, list(names)), level, x_pl, others)


def check_rows(name, level, rows):
    """Every process's row for ``name`` at ``level`` against the simulator's run of the
    same program (rank 0's collectives: the programs are symmetric over the ranks)."""
    sim = simulated(name, level)
    mine = [r for r in rows if r["case"] == name and r["level"] == level]
    assert sorted(r["rank"] for r in mine) == [0, 1, 2, 3], mine
    assert not [r for r in mine if "raised" in r], mine
    assert sim["diff_out"] == 0 and sim["diff_grad"] == 0, sim
    for r in mine:
        for k in ("placements", "grad_placements", "fwd", "bwd"):
            assert r[k] == sim[k], (name, level, r["rank"], k, r[k], sim[k])
        assert r["diff_out"] == 0 and r["diff_grad"] == 0, r
    return sim


@pytest.mark.parametrize("name,level", CASES, ids=[f"{n}-{lv}" for n, lv in CASES])
def test_marked_copy_on_torchrun_as_simulated(name, level, torchrun_rows):
    sim = check_rows(name, level, torchrun_rows)
    # the simulator's figures (slice15, chooser17): the slice's way back, no all-gather
    # on a 1-D mesh; the output the other operand's layout
    if name in ("S1-R-mul-S1", "S1-R-mul-row-S0"):
        assert sim["bwd"] == [], sim
    elif name in ("S1-R-mul-S0", "two-slices"):
        assert sim["bwd"] == [["all_to_all", 256]], sim
        assert sim["placements"] == ["Shard(dim=0)"], sim
    elif name == "per-rank-then-slice":
        # the matmul's Partial and the product's S(0) merged: one reduce-scatter back
        # (the all-to-all is the sum's, of the matmul's S(1) output to the product's S(0))
        assert sim["bwd"] == [["all_to_all", 256], ["reduce_scatter", 1024]], sim
    else:
        assert sim["bwd"] == [["all_gather", 512], ["all_to_all", 512]], sim


# ---- O0: a per-rank reader's use noted as eager notes it ------------------------------------

from tests.test_chooser17 import _v  # noqa: E402  (small integers: exact sums)


def _mixed(mesh):
    def f(t, w, o):
        y = t.redistribute(mesh, [R()])
        return (y @ w).sum() + (y * o).sum()     # y read per rank, then sliced
    return f


def _mixed_inputs(mesh):
    x = wb.shard_tensor(_v((8, 16), 0), mesh, [S(1)]).requires_grad_()
    w = wb.shard_tensor(_v((16, 8), 1), mesh, [S(1)])       # column-parallel: per rank
    o = wb.shard_tensor(_v((8, 1), 2), mesh, [S(0)])
    return x, w, o


def _mixed_run(level):
    mesh = wb.Mesh.grid((4,), ["tp"])
    x, w, o = _mixed_inputs(mesh)
    f = _mixed(mesh)
    if level != "eager":
        f = wb.compile(f, x, w, o, level=level)
    with wb.trace("a100") as tr:
        out = f(x, w, o)
        n = len([e for e in tr.collectives() if 0 in e.ranks])
        out.backward()
    ev = [(e.name, e.bytes) for e in tr.collectives() if 0 in e.ranks]
    return f, ev[:n], ev[n:], out.full().detach(), x.grad


def test_o0_notes_a_per_rank_reader_as_eager():
    """y = x.redistribute([R]) (x S(1) on 4 ranks) read per rank by a column-parallel
    matmul (its gradient Partial), then by ``y * o`` with o (8, 1) S(0).  Eager notes the
    matmul's Partial use on y's way and prices the slice of y to S(0) as 0 B back (merged
    into the Partial's one reduce-scatter); O0 noted the read without its per-rank dims,
    priced the slice's all-to-all back (192 B) and gathered o instead: forward
    [all_gather 768, all_gather 48] (wire bytes, rank 0) for eager's [all_gather 768].  Now
    O0's traced collectives, forward and backward, are eager's, and its modeled step is
    its run (it modeled an all-to-all of 192 B the run merges away).  Values and x's
    gradient one device's."""
    xr = _v((8, 16), 0).requires_grad_()
    ref = (xr @ _v((16, 8), 1)).sum() + (xr * _v((8, 1), 2)).sum()
    ref.backward()
    got = {}
    for level in ("eager", "O0"):
        f, fwd, bwd, out, grad = _mixed_run(level)
        torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)
        torch.testing.assert_close(grad.full(), xr.grad, rtol=0, atol=0)
        assert grad.placements == (S(1),)
        got[level] = (fwd, bwd)
        if level == "O0":
            st = f.step()
            modeled = Counter((e.name, e.bytes) for e in st.trace.events
                              if e.stream == "comm" and 0 in e.ranks)
            assert modeled == Counter(fwd + bwd), (modeled, fwd, bwd)
    assert got["eager"] == got["O0"], got
    assert got["eager"] == ([("all_gather", 768)], [("reduce_scatter", 768)]), got


def test_way_noted_with_per_rank_dims():
    """reshard_backward.way_noted: a read as it is along a dim given per rank notes
    Partial (eager's reshard_backward.convert); without ``expand`` the one copy is used,
    nothing noted; and the slice priced after the Partial adds nothing back
    (strategy.way_steps), where priced alone it is the all-to-all."""
    from workbench.parallel.ops_table.strategy import way_steps
    from workbench.parallel.reshard import plan_reshard
    from workbench.parallel.reshard_backward import per_rank_dims, way_noted
    mesh = wb.Mesh.grid((4,), ["tp"])
    spec = wb.TensorSpec((8, 16), mesh, [R()], torch.float64)
    way = ((R(),), (S(1),), (0,))
    assert way_noted(way, (R(),), None) == way
    noted = way_noted(way, (R(),), None, (0,))
    assert noted == way + (((wb.Partial(),),),)
    to0 = plan_reshard(spec, placements=[S(0)], profile="a100")
    assert [s.kind for s in way_steps(spec, to0, way, "a100")[0]] == ["all_to_all"]
    assert way_steps(spec, to0, noted, "a100")[0] == ()

    class St:                      # a column-parallel matmul's strategy: (R, S(1)) -> S(1)
        inputs = ((R(),), (S(1),))
        outputs = ((S(1),),)
    assert per_rank_dims(St, 1) == ((0,), ())
