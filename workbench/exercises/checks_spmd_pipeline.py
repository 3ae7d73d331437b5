"""Checks for the exercises of notebooks 04 (SPMD propagation) and 07 (pipeline parallelism):
this module gathers them under their old import path; they live in
:mod:`.checks_spmd` (Megatron's MLP plan), :mod:`.checks_spmd_rule` (a rule for cumsum)
and :mod:`.checks_pipeline` (07).

As in :mod:`.checks`: a right answer prints one "Correct: ..." line; a wrong one raises
:class:`~.checks.CheckError` saying what is wrong, e.g.

    your rule lets the scanned dim stay sharded ([S(1)] -> [S(1)]) for a cumsum over
    dim 1: each rank scans only its own piece, so rank 1's values miss the sums of
    rank 0's piece ...

Expected values are derived there, not by the code under test: the MLP plan's output is
compared with one device's; cumsum strategies with ``torch.cumsum``; the best hand
schedule by an exhaustive search priced with the pipeline checks' own list scheduler
(:func:`_makespan`); the micro-batch counts and the zero-bubble idle time from the
published formulas.  The student's own answer is interpreted with the library
(``explain``, ``validate``, ``simulate``), as a notebook would.
"""
from __future__ import annotations

from .checks_pipeline import (_best_makespan, _makespan, check_hand_schedule,  # noqa: F401
                              check_min_microbatches, check_zb_bubble)
from .checks_spmd import check_mlp_plan  # noqa: F401
from .checks_spmd_rule import check_cumsum_rule  # noqa: F401

__all__ = ["check_mlp_plan", "check_cumsum_rule", "check_hand_schedule",
           "check_min_microbatches", "check_zb_bubble"]
