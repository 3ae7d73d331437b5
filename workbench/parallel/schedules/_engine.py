"""The event-driven core shared by :func:`validate` and :func:`simulate`.

Each rank runs its row in order.  An action starts when its rank is free and its
input has arrived: F on stage s waits for F on stage s - 1, B on stage s for B
on stage s + 1 (plus ``p2p`` seconds when the two stages sit on different
ranks).  A rank that must wait parks itself on the action it waits for and is
woken when that action completes, so every action is visited once: O(total
actions), whatever the order in which ranks are processed.
"""
from __future__ import annotations

from dataclasses import dataclass

from .actions import Action, Schedule


@dataclass(frozen=True, slots=True)
class Wait:
    """What a blocked rank waits for: ``action`` on rank ``owner``."""
    action: Action
    owner: int


@dataclass
class Run:
    starts: list[list[float]]      # starts[r][i]: start of actions[r][i]
    ends: list[list[float]]        # ends[r][i]
    pos: list[int]                 # next action index per rank (== len(row) when done)
    blocked: dict[int, Wait]       # rank -> what it waits for (empty when all done)


def run(schedule: Schedule, durations: list[list[float]], p2p: float) -> Run:
    """Time every action; ``durations[r][i]`` is the cost of ``actions[r][i]``.

    Assumes :func:`~.validate.check_structure` passed (each action once, local
    order right).  A deadlock is returned in ``Run.blocked``, not raised."""
    p, m, rows = schedule.p, schedule.m, schedule.actions
    stage_of = [[schedule.stage(r, c) for c in range(schedule.v)] for r in range(p)]
    if schedule.layout == "dualpipe":     # the rank of stage s depends on the copy (chunk)
        owner = [[schedule.placement(s, 0)[0], schedule.placement(s, m - 1)[0]]
                 for s in range(schedule.stages)]
    else:
        owner = [[schedule.placement(s)[0]] * schedule.v for s in range(schedule.stages)]
    last = schedule.stages - 1
    n_keys = schedule.stages * m
    f_end: list = [None] * n_keys          # F done on stage s, micro-batch mb: index s*m + mb
    g_end: list = [None] * n_keys          # input gradient of stage s ready (B done)
    starts = [[0.0] * len(row) for row in rows]
    ends = [[0.0] * len(row) for row in rows]
    pos, clock = [0] * p, [0.0] * p
    parked: dict[int, list[int]] = {}      # key (F: idx, B: n_keys + idx) -> waiting ranks
    waits: dict[int, tuple] = {}
    todo = list(range(p - 1, -1, -1))
    while todo:
        r = todo.pop()
        row, dur, st, en = rows[r], durations[r], starts[r], ends[r]
        i, t, n = pos[r], clock[r], len(row)
        while i < n:
            a = row[i]
            kind, mb = a.kind, a.mb
            s = stage_of[r][a.chunk]
            if kind == "F":
                if s:
                    e = f_end[(s - 1) * m + mb]
                    if e is None:
                        parked.setdefault((s - 1) * m + mb, []).append(r)
                        waits[r] = ("F", s - 1, mb)
                        break
                    if owner[s - 1][a.chunk] != r:
                        e += p2p
                    if e > t:
                        t = e
                st[i] = t
                t += dur[i]
                en[i] = t
                key = s * m + mb
                f_end[key] = t
            elif kind == "B":
                if s < last:
                    e = g_end[(s + 1) * m + mb]
                    if e is None:
                        parked.setdefault(n_keys + (s + 1) * m + mb, []).append(r)
                        waits[r] = ("B", s + 1, mb)
                        break
                    if owner[s + 1][a.chunk] != r:
                        e += p2p
                    if e > t:
                        t = e
                st[i] = t
                t += dur[i]
                en[i] = t
                key = s * m + mb
                g_end[key] = t
                key += n_keys
            else:                                  # W: needs only this rank's own B
                st[i] = t
                t += dur[i]
                en[i] = t
                i += 1
                continue
            woken = parked.pop(key, None)
            if woken:
                todo.extend(woken)
            i += 1
        pos[r], clock[r] = i, t
        if i == n:
            waits.pop(r, None)
    blocked = {}
    for r, (kind, s, mb) in waits.items():
        who, chunk = schedule.placement(s, mb)
        blocked[r] = Wait(Action(kind, mb, chunk), who)
    return Run(starts, ends, pos, blocked)
