"""plan.in_flight_peak walks one rank of interleaved 1F1B without building the schedule:
the same peaks as walking every action of the built schedule, and clear errors."""
import random

import pytest

from workbench.parallel.schedules import interleaved_1f1b, one_f_one_b
from workbench.parallel.schedules.interleaved import rank_order
from workbench.plan import in_flight_peak as P


def _walk(sched, rank):
    """Every vector of chunks in flight right after each forward (the walk before)."""
    cur, seen = [0] * sched.v, set()
    for a in sched.actions[rank]:
        if a.kind == "F":
            cur[a.chunk] += 1
            seen.add(tuple(cur))
        elif a.kind == "B":
            cur[a.chunk] -= 1
    return seen


@pytest.mark.parametrize("pp,k,v", [(2, 1, 2), (2, 3, 3), (3, 2, 2), (4, 2, 2), (4, 1, 4),
                                    (5, 3, 3), (8, 2, 6), (4, 6, 2)])
def test_peak_matches_walk_of_built_schedule(pp, k, v):
    m, rng = pp * k, random.Random(pp * 100 + k * 10 + v)
    sched = interleaved_1f1b(pp, m, v)
    for r in range(pp):
        seen = _walk(sched, r)
        for _ in range(6):
            b = [rng.choice([0.0, 1.0, rng.uniform(0, 10)]) for _ in range(v)]
            want = max(sum(n * x for n, x in zip(c, b)) for c in seen)
            assert P.peak_bytes("interleaved_1f1b", pp, m, v, r, b) == want
        # the kept vectors are among the walk's and none is below another
        kept = P.in_flight_counts("interleaved_1f1b", pp, m, v, r)
        assert set(kept) <= seen
        assert not any(x != y and all(a <= c for a, c in zip(x, y)) for x in kept for y in kept)


def test_rank_order_is_the_schedule_rows():
    sched = interleaved_1f1b(4, 8, 3)
    for r in range(4):
        order = rank_order(4, 8, 3, r)
        assert [a.kind == "F" for a in sched.actions[r]] == [f for f, _ in order]
        assert len(order) == 2 * 8 * 3


def test_other_kinds_keep_the_schedule_walk():
    sched = one_f_one_b(4, 8)
    for r in range(4):
        assert P.peak_bytes("1f1b", 4, 8, 1, r, [2.0]) == 2.0 * max(c[0] for c in _walk(sched, r))


def test_errors():
    with pytest.raises(ValueError, match="rank=4"):
        P.in_flight_counts("interleaved_1f1b", 4, 8, 2, 4)
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        P.in_flight_counts("interleaved_1f1b", 4, 6, 2, 0)
    with pytest.raises(ValueError, match="cannot be negative"):
        P.peak_bytes("interleaved_1f1b", 4, 8, 2, 0, [1.0, -1.0])
