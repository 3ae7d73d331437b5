"""Pipeline schedules as data: generators, a validator and a simulator.

    >>> from workbench.parallel.schedules import one_f_one_b, simulate
    >>> r = simulate(one_f_one_b(4, 8))
    >>> r.bubble_fraction                 # (p-1)/(m+p-1) = 3/11
    0.2727272727272727

Naive before optimized: :func:`gpipe` (all forward, then all backward),
:func:`one_f_one_b`, :func:`interleaved_1f1b`, :func:`zb_h1`; on two chunks per
rank, :func:`zb_v` (V-shaped placement) and :func:`dualpipe` (two model copies, fed
from both ends).  Hand-written
schedules: :meth:`Schedule.from_text`, checked by :func:`validate`.
"""
from .actions import KINDS, Action, Schedule, Transfer, transfers
from .formulas import BubbleFormula, formula_bubble
from .gpipe import gpipe
from .interleaved import interleaved_1f1b
from .one_f_one_b import one_f_one_b
from .simulate import Blocks, SimulationResult, simulate
from .validate import ScheduleError, validate
from .zero_bubble import zb_h1
from .dualpipe import dualpipe, dualpipe_costs
from .zb_v import zb_v
from .execute import PipelineRun, run_pipeline

SCHEDULES = {
    "GPipe": lambda p, m, v=1: gpipe(p, m),
    "1F1B": lambda p, m, v=1: one_f_one_b(p, m),
    "Interleaved 1F1B": lambda p, m, v=1: interleaved_1f1b(p, m, v),
    "ZB-H1": lambda p, m, v=1: zb_h1(p, m),
}
"""Display name -> ``build(p, m, v)``, the schedules the course offers side by side."""

__all__ = ["KINDS", "Action", "Schedule", "Transfer", "transfers", "gpipe", "one_f_one_b",
           "interleaved_1f1b", "zb_h1", "dualpipe", "dualpipe_costs", "zb_v", "validate", "ScheduleError",
           "simulate",
           "SimulationResult", "Blocks", "formula_bubble", "BubbleFormula", "SCHEDULES",
           "run_pipeline", "PipelineRun"]
