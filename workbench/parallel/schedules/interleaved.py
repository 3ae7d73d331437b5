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

__all__ = ["interleaved_1f1b", "rank_order"]


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
    fwds = [Action("F", mb, c) for mb, c in _steps(p, v, m * v)]
    bwds = [Action("B", mb, v - 1 - c) for mb, c in _steps(p, v, m * v)]
    rows = []
    for r in range(p):                           # ranks share the Action objects
        rows.append(tuple(fwds[k] if fwd else bwds[k] for fwd, k in rank_order(p, m, v, r)))
    return Schedule(p, m, v, tuple(rows), name="interleaved_1f1b")


def _steps(p: int, v: int, total: int):
    """(micro-batch, chunk group) of forward step k = 0 .. total - 1 (module docstring):
    forward k runs that chunk, backward k the same micro-batch on chunk v - 1 - group."""
    return [((k // (p * v)) * p + k % p, (k // p) % v) for k in range(total)]


def rank_order(p: int, m: int, v: int, r: int):
    """Rank ``r``'s run order as (is_forward, k) pairs: forward step k or backward step k
    (``_steps``), Megatron's warm-up, steady 1F1B and cool-down; the one definition of the
    order, which :func:`interleaved_1f1b` builds its rows from and ``plan.in_flight_peak``
    walks for one rank without building the others' (checked m % p == 0, v >= 2)."""
    total = m * v                                # forwards (and backwards) per rank
    if m == p:                                   # Megatron: all warm-up when m == p
        warmup = total
    else:
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
    order = [(True, k) for k in range(warmup)]   # warm-up: fill all v chunks
    for k in range(total - warmup):              # steady state: 1F then 1B
        order += [(True, warmup + k), (False, k)]
    order += [(False, k) for k in range(total - warmup, total)]   # cool-down
    return order
