"""ZB-V: the zero-bubble schedule on a V-shaped stage placement.

Qi, Wan, Huang, Lin, "Zero Bubble (Almost) Pipeline Parallelism" (ICLR 2024; the arXiv
version 2401.10241 adds ZB-V) and "Pipeline Parallelism with Controllable Memory"
(NeurIPS 2024, where it is V-ZB).  The model is cut into 2p chunks; rank r holds chunk
r and chunk 2p - 1 - r (the "v" layout of :class:`~.actions.Schedule`), so a micro-batch
goes down the ranks and back up: rank 0 holds the first and the last stage, and the
forward and backward dependencies both trace a "V".  The backward is split into B
(input gradient) and W (weight gradient), W filling the gaps.  Published comparison
(sail-sg's description of the schedules, assuming T_F = T_B = T_W): bubble rate 0 (1F1B
(p - 1)/m), activation memory 1x 1F1B's (p micro-batches: 2p chunk activations, each
half a stage's), pipeline communication 2x.

This generator builds the schedule greedily, as the ZB papers' heuristic schedulers do:
each rank, when free, runs the first of these that can run now:

1. a B whose gradient has arrived (the later stage's first: it unblocks the earlier ranks);
2. an F whose input has arrived, if the rank holds fewer than 2p chunk activations
   (1F1B's peak; ZB-V's memory bound), the later chunk's first;
3. a deferred W (the oldest);

and otherwise waits for the next arrival.  The order is found with F, B and W of equal
cost (the paper's setting); :func:`~.simulate.simulate` then times it with any costs.
"""
from __future__ import annotations

import heapq
from collections import deque

from ._check import check_pm
from .actions import Action, Schedule

__all__ = ["zb_v"]


def zb_v(p: int, m: int) -> Schedule:
    """The ZB-V schedule over ``p`` ranks and ``m`` micro-batches (m >= p).

    >>> zb_v(2, 2).actions[0][:4]
    (Action('F', 0), Action('F', 1), Action('F', 0, chunk=1), Action('B', 0, chunk=1))
    """
    check_pm("zb_v", p, m, v=2, per=3)
    if m < p:
        raise ValueError(f"zb_v(p={p}, m={m}): the V schedule fills its warm-up with the "
                         f"first p micro-batches; use m >= p (m={p})")
    sched = Schedule(p, m, 2, tuple(() for _ in range(p)), name="zb_v", split_backward=True,
                     layout="v")
    last, limit = 2 * p - 1, 2 * p
    f_done, b_done = {}, {}                  # (stage, mb) -> end time
    next_f = [[0, 0] for _ in range(p)]      # per rank and chunk: the next micro-batch
    next_b = [[0, 0] for _ in range(p)]
    held = [0] * p
    wq = [deque() for _ in range(p)]
    rows = [[] for _ in range(p)]
    free = [(0.0, r, r) for r in range(p)]   # (time the rank is free, order, rank)
    seq = p
    remaining = 6 * m * p                    # F, B, W on two chunks per rank and mb
    pending: list = []                       # arrival times still to come
    while remaining:
        t, _, r = heapq.heappop(free)
        act = None
        for c in (1, 0):                     # 1. B, the later stage (chunk 1) first
            mb = next_b[r][c]
            s = sched.stage(r, c)
            if mb < m and (s, mb) in f_done and f_done[(s, mb)] <= t and \
                    (s == last or b_done.get((s + 1, mb), float("inf")) <= t):
                act = Action("B", mb, c)
                next_b[r][c] += 1
                break
        if act is None and held[r] < limit:  # 2. F, the later chunk first
            for c in (1, 0):
                mb = next_f[r][c]
                s = sched.stage(r, c)
                if mb < m and (s == 0 or f_done.get((s - 1, mb), float("inf")) <= t):
                    act = Action("F", mb, c)
                    next_f[r][c] += 1
                    break
        if act is None and wq[r]:            # 3. a deferred W
            act = wq[r].popleft()
        if act is None:                      # wait for the next arrival after t
            later = [x for x in pending if x > t]
            if later:
                nxt = min(later)
            elif any(x <= t for x, _, _ in free):
                nxt = t                      # ranks free at t act first, then look again
            else:
                raise RuntimeError(f"zb_v(p={p}, m={m}): the greedy order stalled at "
                                   f"t={t} on rank {r} (a bug: please report)")
            seq += 1
            heapq.heappush(free, (nxt, seq, r))
            continue
        end = t + 1.0
        s = sched.stage(r, act.chunk)
        if act.kind == "F":
            f_done[(s, act.mb)] = end
            held[r] += 1
        elif act.kind == "B":
            b_done[(s, act.mb)] = end
            wq[r].append(Action("W", act.mb, act.chunk))
        else:
            held[r] -= 1
        pending.append(end)
        rows[r].append(act)
        remaining -= 1
        seq += 1
        heapq.heappush(free, (end, seq, r))
    return Schedule(p, m, 2, tuple(map(tuple, rows)), name="zb_v", split_backward=True,
                    layout="v")
