"""1F1B: one forward, one backward (PipeDream-Flush, Megatron-LM's default).

Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"
(PipeDream-2BW/-Flush) and Narayanan et al. SC21, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", sec. 2.2.1.

Same bubble as GPipe, (p - 1)(t_f + t_b) per rank, but a rank starts a backward as
soon as one is possible, so rank r never holds more than p - r micro-batches of
activations (GPipe holds m).  Three phases on rank r:

* warm-up:      p - r - 1 forwards fill the pipeline below this rank;
* steady state: alternate one forward and one backward;
* cool-down:    the remaining backwards drain the pipeline.
"""
from __future__ import annotations

from ._check import check_pm
from .actions import Action, Schedule

__all__ = ["one_f_one_b"]


def one_f_one_b(p: int, m: int) -> Schedule:
    """The 1F1B schedule over ``p`` ranks and ``m`` micro-batches.

    >>> print(one_f_one_b(3, 4))
    1f1b: p=3 m=4 v=1
    rank 0: F0 F1 F2 B0 F3 B1 B2 B3
    rank 1: F0 F1 B0 F2 B1 F3 B2 B3
    rank 2: F0 B0 F1 B1 F2 B2 F3 B3
    """
    check_pm("one_f_one_b", p, m)
    fwd = [Action("F", i) for i in range(m)]
    bwd = [Action("B", i) for i in range(m)]
    rows = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        row = fwd[:warmup]                       # warm-up: fill the pipeline
        for i in range(m - warmup):              # steady state: 1F then 1B
            row += [fwd[warmup + i], bwd[i]]
        row += bwd[m - warmup:]                  # cool-down: drain the backwards
        rows.append(tuple(row))
    return Schedule(p, m, 1, tuple(rows), name="1f1b")
