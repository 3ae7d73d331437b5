"""DualPipe: DeepSeek-V3's bidirectional pipeline.

DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, sec. 3.2.1 and Table 2; the reference
implementation is deepseek-ai/DualPipe (``dualpipe.py``, its eight steps, followed here).
Each of the p ranks (p even) holds two copies of the model's stages: stage r of the copy
fed from rank 0 and stage p - 1 - r of the copy fed from rank p - 1 (the "dualpipe"
layout of :class:`~.actions.Schedule`: chunk 0 and chunk 1).  Half of the m micro-batches
enter at rank 0 and flow down (chunk 0), the other half enter at rank p - 1 and flow up
(chunk 1), so both ends start at once and the warm-up bubble is halved.  The backward is
split into B (input gradient) and W (weight gradient) as in zero bubble, and in the
steady state a rank runs the forward of one direction beside the backward of the
other ("F&B": the report overlaps their compute with the other's all-to-all and
pipeline communication; here they run one after the other, F then B).

Rank r, with h = min(r, p - 1 - r) and phase 0 the direction whose inputs reach it first
(chunk 0 on the first half of the ranks, chunk 1 on the second):

1. 2 (p/2 - h - 1) forwards of phase 0;
2. h + 1 pairs: forward phase 0, forward phase 1;
3. p/2 - h - 1 times: B of phase 1 (W deferred), that W, forward phase 1;
4. m/2 - p + h + 1 times (the steady state): F0 & B1, then F1 & B0;
5. p/2 - h - 1 times: B1, then F1 & B0;
6. h + 1 pairs B1, B0, the second half of them deferring their W;
7. p/2 - h - 1 times: a deferred W, then B0 (W deferred);
8. the h + 1 deferred W's left.

Table 2 (per rank; F, B the forward and the full backward of a chunk, W its weight part,
F&B an overlapped forward and backward pair): bubble (p/2 - 1)(F&B + B - 3W), parameters
2x (two copies), activations p + 1 micro-batches (1F1B: (p - 1)(F + B), 1x, p).
:func:`dualpipe_costs` prices each steady-state pair as one F&B block, so that
``simulate`` reproduces the table (exactly when F = B = W; see ``formulas.py``).  It needs
m >= 2p (the reference implementation asserts it).
"""
from __future__ import annotations

from collections import deque

from ._check import check_pm
from .actions import Action, Schedule

__all__ = ["dualpipe", "dualpipe_costs"]


def dualpipe(p: int, m: int) -> Schedule:
    """The DualPipe schedule over ``p`` ranks (even) and ``m`` micro-batches (even, m >= 2p).

    >>> print(dualpipe(2, 4).to_text()[0])
    rank 0: F0 F2c1 F1 B2c1 W2c1 F3c1 B0 W0 B3c1 W3c1 B1 W1
    """
    rows, _ = _build(p, m)
    return Schedule(p, m, 2, rows, name="dualpipe", split_backward=True, layout="dualpipe")


def dualpipe_costs(schedule: Schedule, f=1.0, b=1.0, w=1.0, fb=None) -> dict:
    """Costs for :func:`~.simulate.simulate` that run each steady-state forward-backward
    pair of ``schedule`` (a :func:`dualpipe` schedule) as one block of ``fb`` seconds
    (Table 2's F&B; default f + b + w, the pair without overlap): the pair's F costs fb,
    its B and W nothing, so both outputs leave when the pair ends, as when the two run
    overlapped.  Other actions cost f, b, w.  ``simulate(s, **dualpipe_costs(s, ...))``."""
    if not isinstance(schedule, Schedule) or schedule.name != "dualpipe":
        raise ValueError("dualpipe_costs(schedule=...): give a schedule built by dualpipe(p, m)")
    rows, pairs = _build(schedule.p, schedule.m)
    if rows != schedule.actions:
        raise ValueError("dualpipe_costs: the schedule was edited after dualpipe() built it; "
                         "its F&B pairs are unknown")
    for arg, x in (("f", f), ("b", b), ("w", w), ("fb", 0.0 if fb is None else fb)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < float("inf"):
            raise ValueError(f"dualpipe_costs({arg}={x!r}): a cost must be a finite number of "
                             f"seconds >= 0, e.g. {arg}=1.0")
    fb = f + b + w if fb is None else fb
    lead = {(r, a) for r, a, _ in pairs}
    rest = {(r, x) for r, a, bw in pairs for x in bw}
    return {"f": lambda a, r: fb if (r, a) in lead else f,
            "b": lambda a, r: 0.0 if (r, a) in rest else b,
            "w": lambda a, r: 0.0 if (r, a) in rest else w}


def _build(p: int, m: int):
    """(rows, pairs): pairs lists (rank, F, (B, W)) of the overlapped F&B pairs."""
    check_pm("dualpipe", p, m, per=3)
    if p % 2:
        raise ValueError(f"dualpipe(p={p}): DualPipe pairs rank r with rank p - 1 - r; use an "
                         f"even number of ranks, e.g. p={p + 1}")
    if m % 2 or m < 2 * p:
        raise ValueError(f"dualpipe(p={p}, m={m}): half the micro-batches enter at each end "
                         f"and the reference implementation needs m >= 2p; use an even "
                         f"m >= {2 * p}")
    half, nh = m // 2, p // 2
    rows, pairs = [], []
    for r in range(p):
        h = min(r, p - 1 - r)
        second = r >= nh
        row: list[Action] = []
        nxt_f, nxt_b = [0, 0], [0, 0]
        deferred: deque = deque()

        def chunk(ph):                       # phase 0: the direction that arrives first
            return ph if not second else 1 - ph

        def F(ph):
            c = chunk(ph)
            row.append(Action("F", c * half + nxt_f[ph], c))
            nxt_f[ph] += 1

        def B(ph, zb=False):
            c = chunk(ph)
            mb = c * half + nxt_b[ph]
            nxt_b[ph] += 1
            row.append(Action("B", mb, c))
            (deferred.append if zb else row.append)(Action("W", mb, c))

        def W():
            row.append(deferred.popleft())

        def FB(ph_f, ph_b):                  # a forward and a full backward, overlapped
            F(ph_f)
            B(ph_b)
            pairs.append((r, row[-3], (row[-2], row[-1])))

        for _ in range(2 * (nh - h - 1)):    # 1: warm-up, phase 0
            F(0)
        for _ in range(h + 1):               # 2: both directions
            F(0)
            F(1)
        for _ in range(nh - h - 1):          # 3: zero-bubble B1, its W, F1
            B(1, zb=True)
            W()
            F(1)
        for i in range(half - p + h + 1):    # 4: steady state, F&B pairs
            if i == 0 and h == nh - 1:       # the middle ranks' first pair is not
                F(0)                         # overlapped (as in the reference)
                B(1)
            else:
                FB(0, 1)
            FB(1, 0)
        for _ in range(nh - h - 1):          # 5: B1, then F1 & B0
            B(1)
            FB(1, 0)
        s6, zb = h + 1, False                # 6: B1 B0, the later half deferring W
        for i in range(s6):
            if i == s6 // 2 and h % 2 == 1:
                zb = True
            B(1, zb)
            if i == s6 // 2 and h % 2 == 0:
                zb = True
            B(0, zb)
        for _ in range(nh - h - 1):          # 7: W, then B0 with W deferred
            W()
            B(0, zb=True)
        while deferred:                      # 8: the deferred W's
            W()
        rows.append(tuple(row))
    return tuple(rows), pairs
