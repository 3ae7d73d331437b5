"""Passes over a compiled program, each printable before and after (``program.log``).

Graph passes (before placements): ``fuse`` (matmul + bias, RMSNorm, SwiGLU, attention
into ``wb.ops`` calls).  Program passes (on the lowered instructions): ``cancel_reshards``.
Schedule passes (O2, on the step's timeline): ``bucket`` (small gradient all-reduces),
``overlap`` (collectives issued early and split), ``sink`` (the whole graph launched at
once).
"""
from __future__ import annotations

__all__ = ["run_graph_passes", "run_program_passes", "run_schedule_passes"]


def run_graph_passes(prog, graph):
    from .fuse import fuse
    return fuse(prog, graph)


def run_program_passes(prog, program):
    from .reshards import cancel_reshards
    return cancel_reshards(prog, program)


def run_schedule_passes(prog, schedule):
    from .bucket import bucket
    from .overlap import overlap
    from .sink import sink
    for p in (bucket, overlap, sink):
        schedule = p(prog, schedule)
    return schedule
