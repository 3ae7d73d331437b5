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
2x (two copies), activations p + 1 micro-batches (1F1B: (p - 1)(F + B), 1x, p).  Without
the overlap F&B = F + B, and with the B and W of this module (B the input gradient):
(p/2 - 1)(F + 2B - W).  It needs m >= 2p (the reference implementation asserts it).
"""
from __future__ import annotations

from collections import deque

from ._check import check_pm
from .actions import Action, Schedule

__all__ = ["dualpipe"]


def dualpipe(p: int, m: int) -> Schedule:
    """The DualPipe schedule over ``p`` ranks (even) and ``m`` micro-batches (even, m >= 2p).

    >>> print(dualpipe(2, 4).to_text()[0])
    rank 0: F0 F2c1 F1 B2c1 W2c1 F3c1 B0 W0 B3c1 W3c1 B1 W1
    """
    check_pm("dualpipe", p, m, per=3)
    if p % 2:
        raise ValueError(f"dualpipe(p={p}): DualPipe pairs rank r with rank p - 1 - r; use an "
                         f"even number of ranks, e.g. p={p + 1}")
    if m % 2 or m < 2 * p:
        raise ValueError(f"dualpipe(p={p}, m={m}): half the micro-batches enter at each end "
                         f"and the reference implementation needs m >= 2p; use an even "
                         f"m >= {2 * p}")
    half, nh = m // 2, p // 2
    rows = []
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

        for _ in range(2 * (nh - h - 1)):    # 1: warm-up, phase 0
            F(0)
        for _ in range(h + 1):               # 2: both directions
            F(0)
            F(1)
        for _ in range(nh - h - 1):          # 3: zero-bubble B1, its W, F1
            B(1, zb=True)
            W()
            F(1)
        for _ in range(half - p + h + 1):    # 4: steady state, F&B pairs
            F(0)
            B(1)
            F(1)
            B(0)
        for _ in range(nh - h - 1):          # 5: B1, then F1 & B0
            B(1)
            F(1)
            B(0)
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
    return Schedule(p, m, 2, tuple(rows), name="dualpipe", split_backward=True,
                    layout="dualpipe")
