"""Check a schedule before running it: every action once, in an order that can run.

:func:`validate` raises :class:`ScheduleError` naming the first broken rule:

1. shape: an action's micro-batch or chunk out of range, W in a schedule that
   does not split the backward;
2. each rank runs F and B (and W, when split) exactly once per micro-batch and
   chunk: "rank 1 runs F2 twice", "rank 0 never runs B3";
3. order on one rank: B after its F, W after its B: "rank 2 runs B3 before F3 on
   rank 2";
4. order across ranks: F on stage s needs F from stage s - 1 and B on stage s
   needs B from stage s + 1.  If each rank runs its row in order and some rank
   waits forever, the schedule deadlocks: "F1 on rank 1 needs F1 from rank 0,
   which comes later: deadlock", followed by the cycle of waiting ranks;
5. optionally memory: no rank holds more than ``memory_limit`` micro-batch
   activations at once (counted as in :func:`~.simulate.simulate`).
"""
from __future__ import annotations

from ._engine import run
from .actions import Action, Schedule

__all__ = ["ScheduleError", "validate", "check_structure", "deadlock_message"]


class ScheduleError(ValueError):
    """A schedule that cannot run as written (the message says why and where)."""


def validate(schedule: Schedule, memory_limit: int | None = None) -> Schedule:
    """Raise :class:`ScheduleError` at the first broken rule; return the schedule if valid.

    ``memory_limit`` is the most micro-batch activations (per chunk) a rank may
    hold at once; None means no limit."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate(schedule={type(schedule).__name__}): pass a Schedule, e.g. "
                        f"one_f_one_b(4, 8) or Schedule.from_text([...])")
    check_structure(schedule)
    zeros = [[0.0] * len(row) for row in schedule.actions]
    out = run(schedule, zeros, 0.0)
    if out.blocked:
        raise ScheduleError(deadlock_message(schedule, out.pos, out.blocked))
    if memory_limit is not None:
        if isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit < 1:
            raise ValueError(f"validate(memory_limit={memory_limit!r}): give the most micro-batch "
                             f"activations a rank may hold, an int >= 1 (or None for no limit)")
        for r, row in enumerate(schedule.actions):
            held = 0
            for i, a in enumerate(row):
                held += _delta(a, schedule.split_backward)
                if held > memory_limit:
                    raise ScheduleError(
                        f"rank {r} holds {held} micro-batch activations after starting {a} "
                        f"(position {i}), over memory_limit={memory_limit}: run a backward "
                        f"before this forward (1F1B holds at most p - r on rank r)")
    return schedule


def _delta(a: Action, split: bool) -> int:
    """+1 when a forward starts; -1 when the action that frees its activations ends."""
    if a.kind == "F":
        return 1
    return -1 if (a.kind == "W") == split else 0


def check_structure(schedule: Schedule) -> None:
    """Rules 1-3 of the module docstring, rank by rank; raise at the first broken one."""
    s = schedule
    kinds = ("F", "B", "W") if s.split_backward else ("F", "B")
    need = len(kinds) * sum(len(s.chunks_of(mb)) for mb in range(s.m))
    dual, half = s.layout == "dualpipe", s.m // 2     # DualPipe: one chunk per micro-batch
    for r, row in enumerate(s.actions):
        where: dict[tuple, int] = {}
        for i, a in enumerate(row):
            if a.kind == "W" and not s.split_backward:
                raise ScheduleError(f"rank {r} runs {a} (position {i}) but the schedule does not "
                                    f"split the backward: build it with split_backward=True")
            if a.mb >= s.m:
                raise ScheduleError(f"rank {r} runs {a} (position {i}) but m={s.m}: "
                                    f"micro-batches are 0..{s.m - 1}")
            if a.chunk >= s.v:
                raise ScheduleError(f"rank {r} runs {a} (position {i}) but v={s.v}: "
                                    f"chunks are 0..{s.v - 1}")
            key = (a.kind, a.mb, a.chunk)
            if dual and a.chunk != (a.mb >= half):
                raise ScheduleError(f"rank {r} runs {a} (position {i}) but in the "
                                    f"{s.layout!r} layout micro-batch {a.mb} runs on chunk "
                                    f"{s.chunks_of(a.mb)[0]} only")
            if key in where:
                raise ScheduleError(f"rank {r} runs {a} twice (positions {where[key]} and {i})")
            where[key] = i
        if len(where) != need:
            for mb in range(s.m):
                for c in s.chunks_of(mb):
                    for k in kinds:
                        if (k, mb, c) not in where:
                            raise ScheduleError(
                                f"rank {r} never runs {Action(k, mb, c)}: every rank runs "
                                f"{', '.join(kinds)} once for each of m={s.m} micro-batches "
                                f"on each of its v={s.v} chunks")
        for (k, mb, c), i in where.items():
            before = {"B": "F", "W": "B"}.get(k)
            if before and where[(before, mb, c)] > i:
                raise ScheduleError(f"rank {r} runs {Action(k, mb, c)} before "
                                    f"{Action(before, mb, c)} on rank {r}")


def deadlock_message(schedule: Schedule, pos: list[int], blocked: dict) -> str:
    """Explain a deadlock: the first waiting rank, then the cycle of ranks waiting on each other."""
    first = min(blocked)
    lines, seen, r = [], set(), first
    while r not in seen:
        seen.add(r)
        a = schedule.actions[r][pos[r]]
        dep = blocked[r]
        q = dep.owner
        dep_pos = schedule.position(q, dep.action)
        when = "which comes later" if dep_pos > pos[q] else "which is itself waiting"
        if r == first:
            head = f"{a} on rank {r} needs {dep.action} from rank {q}, {when}: deadlock."
        lines.append(f"rank {r} waits at {a} (position {pos[r]}) for {dep.action} "
                     f"of rank {q}")
        r = q
    return (head + " Waiting ranks: " + "; ".join(lines)
            + ". Reorder the rows so that each action's input is produced earlier.")
