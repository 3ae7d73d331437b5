"""ZB-H1: zero-bubble pipeline with the backward split into B and W.

Qi et al. 2024, "Zero Bubble (Almost) Pipeline Parallelism", ICLR 2024, sec. 3.
The backward of a layer is two computations: B, the gradient with respect to
the layer's input, which the previous stage waits for, and W, the gradient
with respect to its weights, which nobody waits for until the optimizer step.
ZB-H1 runs B as early as 1F1B runs its backward and defers W to fill the idle
time that 1F1B leaves in the cool-down.  With t_F = t_B = t_W the bubble falls
from (p - 1)(t_F + t_B + t_W) for 1F1B to (p - 1)(t_F + t_B - t_W), a third,
while no rank keeps more than p micro-batches in flight, 1F1B's peak.

Rank r (phases as in the reference DeepSpeed/Megatron implementation):

* warm-up:      p - r - 1 forwards, as in 1F1B;
* 1F1B, W held: r steps of one F and one B, whose W is deferred;
* steady state: one F, one B, one W (the oldest deferred one);
* cool-down:    one B and one W per remaining micro-batch;
* W fill:       the r deferred W's run where 1F1B would idle.
"""
from __future__ import annotations

from ._check import check_pm
from .actions import Action, Schedule

__all__ = ["zb_h1"]


def zb_h1(p: int, m: int) -> Schedule:
    """The ZB-H1 schedule over ``p`` ranks and ``m`` micro-batches.

    >>> print(zb_h1(2, 3))
    zb_h1: p=2 m=3 v=1 (backward split into B and W)
    rank 0: F0 F1 B0 W0 F2 B1 W1 B2 W2
    rank 1: F0 B0 F1 B1 W0 F2 B2 W1 W2
    """
    check_pm("zb_h1", p, m, per=3)                 # F, B and W per micro-batch
    F = [Action("F", i) for i in range(m)]
    B = [Action("B", i) for i in range(m)]
    W = [Action("W", i) for i in range(m)]
    rows = []
    for r in range(p):
        f = b = w = 0                            # next F, B, W to run
        warmup = min(p - r - 1, m)
        row = F[:warmup]                         # warm-up: as in 1F1B
        f = warmup
        for _ in range(r):                       # 1F1B with W held back
            if f == m:
                break
            row += [F[f], B[b]]
            f, b = f + 1, b + 1
        while f < m:                             # steady state: F, B, W
            row += [F[f], B[b], W[w]]
            f, b, w = f + 1, b + 1, w + 1
        while b < m:                             # cool-down: B, W
            row += [B[b], W[w]]
            b, w = b + 1, w + 1
        row += W[w:]                             # W fill: deferred W's fill the bubble
        rows.append(tuple(row))
    return Schedule(p, m, 1, tuple(rows), name="zb_h1", split_backward=True)
