"""validate(): hand-written schedules, and the message naming the first broken rule."""
from __future__ import annotations

import pytest

from workbench.parallel.schedules import (Action, Schedule, ScheduleError, gpipe, one_f_one_b,
                                          simulate, validate, zb_h1)


def broken(rows, **kw):
    return Schedule.from_text(rows, **kw)


def test_hand_written_schedule_from_text_is_1f1b():
    s = Schedule.from_text(["F0 F1 B0 B1",
                            "F0 B0 F1 B1"])
    assert (s.p, s.m, s.v, s.split_backward, s.name) == (2, 2, 1, False, "custom")
    assert validate(s) is s
    assert s.actions == one_f_one_b(2, 2).actions
    assert simulate(s).bubble_fraction == simulate(one_f_one_b(2, 2)).bubble_fraction


def test_other_ways_to_build_by_hand():
    text = "rank 0: F0 B0 W0\nrank 1: F0 B0 W0"
    from_str = Schedule.from_text(text)
    from_tuples = Schedule.from_text([[("F", 0), ("B", 0), ("W", 0)]] * 2)
    from_actions = Schedule(2, 1, 1, [[Action("F", 0), Action("B", 0), Action("W", 0)]] * 2,
                            split_backward=True)
    assert from_str == from_tuples == from_actions and from_str.split_backward
    validate(from_str)
    assert str(from_str).splitlines()[1:] == ["rank 0: F0 B0 W0", "rank 1: F0 B0 W0"]


@pytest.mark.parametrize("rows, message", [
    # B before its own F on the same rank
    (["F0 B0 F1 B1 F2 B2 F3 B3", "F0 B0 F1 B1 F2 B2 F3 B3", "F0 B0 F1 B1 F2 B2 B3 F3"],
     "rank 2 runs B3 before F3 on rank 2"),
    # W before its B
    (["F0 B0 W0", "F0 W0 B0"], "rank 1 runs W0 before B0 on rank 1"),
    # a cross-rank cycle: rank 0 waits for B0 from rank 1, which waits for F1 from rank 0
    (["F0 B0 F1 B1", "F1 B1 F0 B0"],
     "B0 on rank 0 needs B0 from rank 1, which comes later: deadlock. Waiting ranks: "
     "rank 0 waits at B0 (position 1) for B0 of rank 1; rank 1 waits at F1 (position 0) "
     "for F1 of rank 0."),
    (["F0 F1 B0 B1", "F0 F1 B0"], "rank 1 never runs B1"),
    (["F0 F1 B0 B1 F1", "F0 F1 B0 B1"], "rank 0 runs F1 twice (positions 1 and 4)"),
    (["F0 F1 B0 B1", "F0 F1 B0 B1 W0"], "rank 1 runs W0 (position 4) but the schedule does not "
                                        "split the backward"),
])
def test_broken_schedules_name_the_first_broken_rule(rows, message):
    s = broken(rows, split_backward=False) if "W0 (position" in message else broken(rows)
    with pytest.raises(ScheduleError) as err:
        validate(s)
    assert message in str(err.value)
    with pytest.raises(ScheduleError):          # simulate refuses it the same way
        simulate(s, w=1 if s.split_backward else None)


def test_deadlock_message_follows_the_chain_of_waiting_ranks():
    # ranks 1 and 2 wait on each other; rank 0 waits behind them
    s = Schedule.from_text(["F0 F1 B0 B1", "F0 B0 F1 B1", "F1 F0 B0 B1"])
    with pytest.raises(ScheduleError) as err:
        validate(s)
    assert str(err.value) == (
        "B0 on rank 0 needs B0 from rank 1, which is itself waiting: deadlock. Waiting ranks: "
        "rank 0 waits at B0 (position 2) for B0 of rank 1; rank 1 waits at B0 (position 1) for "
        "B0 of rank 2; rank 2 waits at F1 (position 0) for F1 of rank 1. Reorder the rows so "
        "that each action's input is produced earlier.")


def test_out_of_range_actions():
    with pytest.raises(ScheduleError, match=r"rank 0 runs F2 \(position 1\) but m=2"):
        validate(Schedule.from_text(["F0 F2 B0 B1", "F0 F1 B0 B1"], m=2))
    with pytest.raises(ScheduleError, match=r"v=1: chunks are 0..0"):
        validate(Schedule.from_text(["F0 B0 F0c1", "F0 B0"], v=1))


def test_memory_limit():
    validate(one_f_one_b(4, 8), memory_limit=4)
    with pytest.raises(ScheduleError, match=r"rank 0 holds 4 micro-batch activations after "
                                            r"starting F3 \(position 3\), over memory_limit=3"):
        validate(one_f_one_b(4, 8), memory_limit=3)
    with pytest.raises(ScheduleError, match="over memory_limit=7"):
        validate(gpipe(2, 8), memory_limit=7)
    validate(zb_h1(4, 8), memory_limit=4)              # ZB-H1: 1F1B's peak
    with pytest.raises(ValueError, match=r"validate\(memory_limit=0\)"):
        validate(one_f_one_b(2, 2), memory_limit=0)


def test_construction_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"Schedule p=3 but actions has 2 rows"):
        Schedule(3, 2, 1, (("F0",), ("F0",)))
    with pytest.raises(ValueError, match=r"action 'X1'.*'F3'"):
        Schedule.from_text(["F0 X1"])
    with pytest.raises(ValueError, match=r"Action kind='Q'"):
        Action("Q", 0)
    with pytest.raises(ValueError, match=r"Action mb=-1"):
        Action("F", -1)
    with pytest.raises(TypeError, match=r"validate\(schedule=list\)"):
        validate([["F0"]])
