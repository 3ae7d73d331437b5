"""Interleaved 1F1B: Megatron-LM's virtual pipeline.

Narayanan et al. SC21, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", sec. 2.2.2.  Each rank holds ``v`` model chunks
instead of one contiguous block of layers: chunk c of rank r is layer-stage
c * p + r, so a micro-batch visits every rank v times.  A chunk's forward and
backward take 1/v of a full stage's time, so the pipeline fills and drains v
times faster: the bubble shrinks to (p - 1)(t_f + t_b) / v per rank, for v times
more point-to-point messages.

Megatron orders the work in groups of p micro-batches per chunk (which is why it
requires m % p == 0): forward step k on a rank runs micro-batch
(k // (p v)) * p + k % p on chunk (k // p) % v, and backward step k the same
micro-batch on chunk v - 1 - (k // p) % v.  Rank r warms up with
2 (p - r - 1) + (v - 1) p forwards (all of them when m == p), then alternates one
forward and one backward, then drains the remaining backwards.
"""
from __future__ import annotations

from ._check import check_pm
from .actions import Action, Schedule
from .one_f_one_b import one_f_one_b

__all__ = ["interleaved_1f1b"]


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B over ``p`` ranks, ``m`` micro-batches, ``v`` chunks per rank.

    ``v == 1`` is plain 1F1B.  Like Megatron-LM, requires ``m % p == 0``.

    >>> print(interleaved_1f1b(2, 2, 2))
    interleaved_1f1b: p=2 m=2 v=2
    rank 0: F0 F1 F0c1 F1c1 B0c1 B1c1 B0 B1
    rank 1: F0 F1 F0c1 F1c1 B0c1 B1c1 B0 B1
    """
    check_pm("interleaved_1f1b", p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        up, down = (m // p + 1) * p, m // p * p      # the multiples of p either side of m
        fix = f"use m={up} or m={down}" if down else f"use m={up}"     # m < p: no m below
        raise ValueError(f"interleaved_1f1b(m={m}, p={p}): the number of micro-batches must be "
                         f"a multiple of the pipeline size (Megatron-LM requires it too); {fix}")
    total = m * v                                # forwards (and backwards) per rank

    def fwd(k: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    rows = []
    for r in range(p):
        if m == p:                               # Megatron: all warm-up when m == p
            warmup = total
        else:
            warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        row = [fwd(k) for k in range(warmup)]    # warm-up: fill all v chunks
        for k in range(total - warmup):          # steady state: 1F then 1B
            row += [fwd(warmup + k), bwd(k)]
        row += [bwd(k) for k in range(total - warmup, total)]   # cool-down
        rows.append(tuple(row))
    return Schedule(p, m, v, tuple(rows), name="interleaved_1f1b")
