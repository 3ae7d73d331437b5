"""GPipe: all forwards, then all backwards (the naive pipeline schedule).

Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using
Pipeline Parallelism".  Every rank runs the forward of all ``m`` micro-batches,
then all their backwards, then the optimizer steps once (synchronous semantics).
Simple and correct, but every rank keeps the activations of all ``m``
micro-batches alive at the turn from forward to backward, and the pipeline fills
and drains once per step: the bubble is (p - 1)(t_f + t_b) per rank, a fraction
(p - 1)/(m + p - 1) of the step.  1F1B (:mod:`.one_f_one_b`) keeps the same bubble
with at most p micro-batches in flight.
"""
from __future__ import annotations

from ._check import check_pm
from .actions import Action, Schedule

__all__ = ["gpipe"]


def gpipe(p: int, m: int) -> Schedule:
    """All-forward-all-backward over ``p`` ranks and ``m`` micro-batches.

    >>> print(gpipe(2, 3))
    gpipe: p=2 m=3 v=1
    rank 0: F0 F1 F2 B0 B1 B2
    rank 1: F0 F1 F2 B0 B1 B2
    """
    check_pm("gpipe", p, m)
    fwd = [Action("F", i) for i in range(m)]
    bwd = [Action("B", i) for i in range(m)]
    # the same order on every rank: forwards fill the pipeline, backwards drain it
    row = tuple(fwd + bwd)
    return Schedule(p, m, 1, (row,) * p, name="gpipe")
