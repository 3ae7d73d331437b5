"""plan16: an uneven all-to-all's bytes in a reshard plan are the busiest rank's, exact
(were (p-1)/p of the largest shard, rounded down: 10 B where ranks send 8..16 B), the
trace records what each group's busiest rank sends, and the clock prices that."""
import math

import pytest
import torch

import workbench as wb
from workbench.parallel import layout


def _sent(shape, mesh, src, dst, rank, elem):
    """Bytes ``rank`` sends in src -> dst: its shard less the part it keeps (the
    intersection of its shard boxes before and after), from the global bounds alone."""
    a = layout.shard_bounds(shape, mesh, src, rank)
    b = layout.shard_bounds(shape, mesh, dst, rank)
    held = math.prod(n for _, n in a)
    kept = math.prod(max(0, min(s0 + n0, s1 + n1) - max(s0, s1))
                     for (s0, n0), (s1, n1) in zip(a, b))
    return (held - kept) * elem


def _check(shape, mesh, src, dst):
    torch.manual_seed(0)
    x = wb.shard_tensor(torch.randn(shape), mesh, src)
    plan = wb.plan_reshard(x, mesh, dst, profile="a100")
    with wb.trace(profile="a100") as tr:
        y = wb.reshard(x, mesh, dst)
    assert torch.equal(y.full(), x.full())
    steps = [s for s in plan.steps if s.kind == "all_to_all"]
    events = [e for e in tr.events if e.name == "all_to_all"]
    assert steps and events
    for s in steps:
        i = s.mesh_dim
        per_rank = {r: _sent(shape, mesh, s.src, s.dst, r, 4) for r in mesh.ranks}
        assert s.bytes == max(per_rank.values())            # the busiest rank's, exact
        lo, hi = min(per_rank.values()), max(per_rank.values())
        if lo != hi:
            assert f"ranks send {lo:,d}..{hi:,d} B" in s.note and "busiest" in s.note
        for e in events:
            if set(e.ranks) in [set(g) for g in mesh.groups(i)]:
                assert e.bytes == max(per_rank[r] for r in e.ranks)
    return plan, tr


@pytest.mark.parametrize("shape,src,dst", [((4, 3), ["S(1)"], ["S(0)"]),
                                           ((5, 7), ["S(0)"], ["S(1)"]),
                                           ((7, 2), ["S(1)"], ["S(0)"])])
def test_plan_bytes_are_the_runs_1d(shape, src, dst):
    _check(shape, wb.Mesh([0, 1, 2], ["x"]), src, dst)


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 5), (5, 4), (5, 7)])
def test_plan_bytes_are_the_runs_2d(shape):
    mesh = wb.Mesh([[0, 1, 2], [3, 4, 5]], ["a", "b"])
    _check(shape, mesh, ["S(0)", "S(1)"], ["S(1)", "S(0)"])


def test_the_reviewed_case_prints_the_busiest_rank():
    # (3, 5) on 2 x 3: the all-to-all on b; ranks hold 2x2, 2x2, 2x1 / 1x2, 1x2, 1x1 and
    # cut them 1|1|0 rows: the third rank of each group keeps nothing
    mesh = wb.Mesh([[0, 1, 2], [3, 4, 5]], ["a", "b"])
    plan, _ = _check((3, 5), mesh, ["S(0)", "S(1)"], ["S(1)", "S(0)"])
    (s,) = [s for s in plan.steps if s.kind == "all_to_all"]
    assert "busiest rank; ranks send" in str(s) and f"{s.bytes:,d} B" in str(s)


def test_clock_prices_the_busiest_rank():
    # uneven: shards 4 x 4096 on 3 ranks cut 2, 2, 0 rows: rank 2 sends 4 x 4096 floats;
    # even: shards 6 x 4096 cut 2, 2, 2: every rank sends 4 x 4096 floats. Same bytes on
    # the busiest rank, same time (was: the uneven one priced at 2/3 of its largest shard)
    mesh = wb.Mesh([0, 1, 2], ["x"])
    times = []
    for rows in (4, 6):
        x = wb.shard_tensor(torch.zeros(rows, 3 * 4096), mesh, ["S(1)"])
        with wb.trace(profile="a100") as tr:
            wb.reshard(x, mesh, ["S(0)"])
        (e,) = [e for e in tr.events if e.name == "all_to_all"]
        assert e.bytes == 4 * 4096 * 4
        plan = wb.plan_reshard(x, mesh, ["S(0)"], profile="a100")
        (s,) = [s for s in plan.steps if s.kind == "all_to_all"]
        assert s.bytes == e.bytes and s.time == pytest.approx(e.duration, rel=1e-12)
        times.append(e.duration)
    assert times[0] == pytest.approx(times[1], rel=1e-12)


def test_labels_say_busiest_rank_where_uneven():
    mesh = wb.Mesh([[0, 1, 2], [3, 4, 5]], ["a", "b"])
    uneven = wb.plan_reshard(wb.TensorSpec((5, 7), mesh, ["S(0)", "S(1)"]), mesh,
                             ["S(1)", "S(0)"], profile="a100")
    even = wb.plan_reshard(wb.TensorSpec((6, 6), mesh, ["S(0)", "S(1)"]), mesh,
                           ["S(1)", "S(0)"], profile="a100")
    assert uneven.uneven() and not even.uneven()
    assert "sum of each step's busiest rank" in str(uneven)
    assert "sent per rank" in str(even) and "busiest" not in str(even)
    assert "busiest rank" in uneven._repr_html_()
    from workbench.viz.placements import render_reshard_text
    text = render_reshard_text(uneven)
    assert "busiest rank" in text and "B/rank" not in text.split("all_to_all")[1].split("\n\n")[0]
