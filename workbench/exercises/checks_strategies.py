"""Checks for the exercises of notebooks 05 (data parallel and ZeRO), 06 (tensor and
sequence parallel) and 08 (hybrid parallel): this module gathers them under their old
import path; each notebook's checks live in their own module
(:mod:`.checks_data_parallel`, :mod:`.checks_sequence_parallel`, :mod:`.checks_hybrid`).

As in :mod:`.checks`: a right answer prints one "Correct: ..." line; a wrong one raises
:class:`~.checks.CheckError` saying what is wrong, e.g.

    your buckets are [1052672, 5248000]; expected 2 bucket(s): right sizes, wrong order:
    backward produces the last layer's gradients first, and the buckets fill (and are
    sent) in that order

Expected values are derived there, independently of the code under test: bucket sizes
by filling whole gradients in backward order by hand, bytes and memory from the
published formulas (ring collectives, ZeRO, Korthikanti et al.), a rank's groups from
its coordinates, model-state bytes from the values a rank holds.  The one exception is
:func:`check_best_layout`, whose exercise is to ask the simulator.  The exercise's
numbers are the keyword defaults.
"""
from __future__ import annotations

from .checks_data_parallel import (_mlp, check_bucket_sizes, check_zero3_traffic,  # noqa: F401
                                   check_zero_max_params)
from .checks_hybrid import (_state_bytes, check_best_layout, check_hybrid_groups,  # noqa: F401
                            check_hybrid_state_bytes)
from .checks_sequence_parallel import (_activation_bytes, check_sp_f_g,  # noqa: F401
                                       check_sp_max_microbatch, check_tp_sp_layer_bytes)

__all__ = ["check_bucket_sizes", "check_zero_max_params", "check_zero3_traffic",
           "check_tp_sp_layer_bytes", "check_sp_f_g", "check_sp_max_microbatch",
           "check_hybrid_groups", "check_hybrid_state_bytes", "check_best_layout"]
