"""ZB-V: the zero-bubble schedule on a V-shaped stage placement.

Qi, Wan, Huang, Lin, "Zero Bubble (Almost) Pipeline Parallelism" (ICLR 2024; the arXiv
version 2401.10241 adds ZB-V) and "Pipeline Parallelism with Controllable Memory"
(NeurIPS 2024, where it is V-ZB).  The model is cut into 2p chunks; rank r holds chunk
r and chunk 2p - 1 - r (the "v" layout of :class:`~.actions.Schedule`), so a micro-batch
goes down the ranks and back up: rank 0 holds the first and the last stage, and the
forward and backward dependencies both trace a "V".  The backward is split into B (input
gradient) and W (weight gradient); W's fill the waits.  Published comparison (sail-sg's
description of the schedules, assuming T_F = T_B = T_W): bubble rate 0 (1F1B (p - 1)/m),
activation memory 1x 1F1B's (p micro-batches, i.e. 2p chunk activations of half a stage
each), pipeline communication 2x.

The bubble there is counted per rank from its first forward to its last action (the
authors' schedulers count a rank's idle time only once it has started; the start-up skew
is absorbed across iterations by their optimizer post-validation): what
``SimulationResult.span_bubble`` measures.

The construction (the heuristic of the authors' ZB-V scheduler, sail-sg/zero-bubble-
pipeline-parallelism, ``zbv.py``, written anew here), timed with the costs given:

1. warm-up: one forward of chunk 0 on every rank; then from the last rank down, each rank
   fills the wait for its chunk-1 input with chunk-0 forwards (ranks 0..r in step, within
   the memory bound), then runs its first chunk-1 forward; then later ranks catch up with
   forwards, alternating chunks, until each holds as many as the rank before it;
2. steady state, 2m rounds: every rank runs one B (chunk 1 first, chunk 0 once its
   gradient has arrived: chunk-0 ranks from the last down, then chunk-1 ranks from the
   first up) and one F (chunk 1 when its input has arrived, else chunk 0), and before
   each, runs deferred W's while they fit in the wait for the input, and one more when
   the wait would exceed the bubble budget; W's also run when the memory bound (2p chunk
   activations, 1F1B's p micro-batches) is reached;
3. the remaining W's.

Each of the four ways to use the bubble budget (an extra W before B, before F, both,
neither) is built, and the one with the smallest largest per-rank bubble kept.
"""
from __future__ import annotations

from collections import deque

from ._check import check_pm
from .actions import Action, Schedule

__all__ = ["zb_v"]

_F, _B, _W = 0, 1, 2


class _Builder:
    """Places actions rank by rank, each at its earliest time (module docstring)."""

    def __init__(self, p, m, cost, fill_b, fill_f):
        self.p, self.m, self.cost = p, m, cost
        self.fill_b, self.fill_f = fill_b, fill_f
        self.end = {}                          # (kind, chunk, rank, mb) -> end time
        self.t = [0.0] * p                     # each rank's clock
        self.n = [[[0, 0] for _ in range(3)] for _ in range(p)]   # n[r][kind][chunk]
        self.mem = [0] * p                     # chunk activations held
        self.limit = 2 * p
        self.bubble = [0.0] * p                # idle time since the rank's first action
        self.started = [False] * p
        self.wq = [deque() for _ in range(p)]
        self.rows = [[] for _ in range(p)]

    def dep(self, kind, c, r, mb):
        """End time of what (kind, chunk c, rank r, micro-batch mb) waits for, or None
        if that is not placed yet; -1.0 when it waits for nothing on another rank."""
        p = self.p
        if kind == _F:
            if c == 0:
                return -1.0 if r == 0 else self.end.get((_F, 0, r - 1, mb))
            return self.end.get((_F, 0, r, mb)) if r == p - 1 else \
                self.end.get((_F, 1, r + 1, mb))
        if c == 1:                               # stage 2p-1-r: gradient from rank r-1
            return self.end.get((_F, 1, r, mb)) if r == 0 else self.end.get((_B, 1, r - 1, mb))
        return self.end.get((_B, 1, r, mb)) if r == p - 1 else self.end.get((_B, 0, r + 1, mb))

    def put(self, kind, c, r):
        mb = self.n[r][kind][c]
        if mb >= self.m:
            raise RuntimeError(f"zb_v: rank {r} has no {'FBW'[kind]} left on chunk {c}")
        start = self.t[r]
        if kind != _W:
            d = self.dep(kind, c, r, mb)
            if d is None:
                raise RuntimeError(f"zb_v: {'FBW'[kind]}{mb}c{c} on rank {r} placed before "
                                   f"its input (a bug)")
            start = max(start, d)
            if self.started[r]:
                self.bubble[r] += start - self.t[r]
        self.started[r] = True
        self.t[r] = start + self.cost[kind]
        self.end[(kind, c, r, mb)] = self.t[r]
        self.n[r][kind][c] += 1
        self.mem[r] += {_F: 1, _B: 0, _W: -1}[kind]
        self.rows[r].append(Action("FBW"[kind], mb, c))
        if kind == _B:
            self.wq[r].append(c)

    def put_w(self, r):
        self.put(_W, self.wq[r].popleft(), r)

    def fill(self, r, wait_until, extra: bool):
        """Deferred W's that fit before ``wait_until``; one more if ``extra`` and the
        wait would still leave a larger bubble than the worst rank's so far."""
        while self.wq[r] and wait_until >= self.t[r] + self.cost[_W]:
            self.put_w(r)
        if extra and self.wq[r] and wait_until - self.t[r] > max(self.bubble) - self.bubble[r]:
            self.put_w(r)

    def ready(self, kind, c, r):
        return self.dep(kind, c, r, self.n[r][kind][c]) is not None

    def build(self):
        p, m, n = self.p, self.m, self.n
        for r in range(p):                                     # 1. warm-up
            self.put(_F, 0, r)
        for r in range(p - 1, -1, -1):
            if r < p - 1:
                arrive = self.end[(_F, 1, r + 1, 0)]
                while self.mem[r] + 2 * (r + 1) <= self.limit and n[r][_F][0] < m and \
                        self.t[r] + self.cost[_F] <= arrive:
                    for j in range(r + 1):
                        self.put(_F, 0, j)
            self.put(_F, 1, r)
        c = 0
        for r in range(1, p):
            while sum(n[r][_F]) < sum(n[r - 1][_F]) or n[r][_F][1] <= n[r - 1][_F][1] < m:
                for j in range(p - 1, r - 1, -1):
                    if n[j][_F][c] < m:
                        self.put(_F, c, j)
                c = 1 - c
        for _ in range(2 * m):                                 # 2. steady state
            ones, zeros = [], []               # ranks running B on chunk 1, chunk 0
            for r in range(p):
                if n[r][_B][0] >= n[r][_B][1]:
                    ones.append(r)
                elif r == p - 1 or self.ready(_B, 0, r) or n[r][_B][1] >= m:
                    zeros.append(r)
                else:
                    ones.append(r)
            for r, ch in [(r, 0) for r in reversed(zeros)] + [(r, 1) for r in ones]:
                d = self.dep(_B, ch, r, n[r][_B][ch])
                self.fill(r, -1.0 if d is None else d, self.fill_b or ch == 0)
                self.put(_B, ch, r)
            for r in range(p):
                ch = None
                if n[r][_F][1] >= m:
                    continue
                if n[r][_F][1] >= n[r][_F][0]:
                    ch = 0
                elif r == p - 1 or self.ready(_F, 1, r):
                    ch = 1
                elif n[r][_F][0] < m and self.ready(_F, 0, r):
                    ch = 0
                if ch is None:
                    continue
                while self.mem[r] + 1 > self.limit:
                    self.put_w(r)
                self.fill(r, self.dep(_F, ch, r, n[r][_F][ch]), self.fill_f)
                self.put(_F, ch, r)
        if any(n[r][k][ch] < m for r in range(p) for k in (_F, _B) for ch in (0, 1)):
            raise RuntimeError(f"zb_v(p={p}, m={m}): the steady state left forwards or "
                               f"backwards unplaced (a bug)")
        for r in range(p):                                     # 3. the last W's
            while self.wq[r]:
                self.put_w(r)
        return self


def zb_v(p: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> Schedule:
    """The ZB-V schedule over ``p`` ranks and ``m`` micro-batches (m >= p), its order
    built for chunk costs ``f``, ``b``, ``w`` (the papers' setting: all equal).

    >>> zb_v(2, 2).actions[0][:4]
    (Action('F', 0), Action('F', 1), Action('F', 0, chunk=1), Action('B', 0, chunk=1))
    """
    check_pm("zb_v", p, m, v=2, per=3)
    if m < p:
        raise ValueError(f"zb_v(p={p}, m={m}): the V schedule fills its warm-up with the "
                         f"first p micro-batches; use m >= p (m={p})")
    for arg, x in (("f", f), ("b", b), ("w", w)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < float("inf"):
            raise ValueError(f"zb_v({arg}={x!r}): a chunk cost must be a finite number > 0")
    best = None
    for fill_b in (True, False):
        for fill_f in (True, False):
            bl = _Builder(p, m, (float(f), float(b), float(w)), fill_b, fill_f).build()
            key = max(bl.bubble)
            if best is None or key < best[0]:
                best = (key, bl)
    rows = tuple(tuple(row) for row in best[1].rows)
    return Schedule(p, m, 2, rows, name="zb_v", split_backward=True, layout="v")
