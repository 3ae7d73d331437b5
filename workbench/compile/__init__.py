"""Dynamic to static: ``wb.compile`` captures a program (``torch.export``, or tracing
torch calls on meta tensors), chooses its placements over the whole graph, runs its
passes and runs it as one graph on the simulated ranks.

    capture.py / export.py   the program as a Graph of op-table calls (graph.py)
                             (capture's parts: tracer.py, trace_calls.py, capture_meta.py,
                             capture_trees.py, capture_errors.py)
    writes.py                in-place writes into values the program made, as new values
    propagate.py             the step's price of a placement, and greedy's choice
    search.py                whole-graph placements (DP / beam; memory as tie-break or limit)
    lower.py                 the distributed program: reshards + ops; running it
    buckets.py               the O2 run's gradient buckets (one all-reduce per bucket)
    schedule.py              the step (forward + backward) on the modeled clock
    passes/                  fusion, reshard removal, bucketing, overlap, graph sink
    program.py               ``compile`` and ``CompiledProgram`` (levels O0 / O1 / O2)
                             (program_args.py, program_run.py, program_report.py)
    guards.py                what each call checks against the capture (guard_module.py,
                             guard_tensors.py, references.py, frozen.py)
"""
from .graph import Graph, GraphBreak, Node, Value  # noqa: F401
from .capture import CaptureError  # noqa: F401
from .program import LEVELS, CompiledProgram, compile  # noqa: F401

__all__ = ["compile", "CompiledProgram", "LEVELS", "Graph", "GraphBreak", "CaptureError"]


class _CallableModule(__import__("types").ModuleType):
    """``wb.compile(fn, ...)`` calls :func:`compile`, while ``workbench.compile`` stays the
    package (so ``import workbench.compile.capture`` works as for any package)."""

    def __call__(self, *args, **kwargs):
        return compile(*args, **kwargs)


__import__("sys").modules[__name__].__class__ = _CallableModule
