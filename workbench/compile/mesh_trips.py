"""A program's trip to another mesh and back: ``wb.reshard(wb.reshard(t, other, ps1),
mesh, ps2)`` (or ``redistribute``), the tensor moved to another mesh (or a submesh) and
straight back to the program's.

The graph holds one mesh (every value's placements are the program mesh's: the search,
the lowering and the step's schedule price them there), so a value that lives on another
mesh cannot be one of its values.  A round trip with nothing in between can: capture
records each call as a ``kept_copy`` pinned to its placements (``tracer.py``); here the
first copy's pin is taken off (it stays a copy, in its input's layout, on the program
mesh) and the second's output is pinned to ``ps2`` *via* ``(other, ps1)``: the run makes
eager's two calls there (``wb.reshard`` to the other mesh, then back: the same
collectives, sends, clock and autograd way back, ``lower.execute_program``).

Anything else on another mesh breaks the graph, as before (the program runs eagerly): an
op on the moved tensor, a second reader of it, the moved tensor returned, a reshard from
it that names no mesh (its own: the other) or another one still.

Priced: the trip's two plans (``propagate._Pricer.pin_cost``); the step's schedule
(``prog.step()``) holds the first plan's collectives (on the program mesh) and none of the
second's, which run on the other mesh's ranks (the run's trace records them all).
"""
from __future__ import annotations

from ..parallel.spec import TensorSpec
from .capture_errors import CaptureError

__all__ = ["mesh_trips", "via_plans"]


def mesh_trips(graph, mesh) -> dict:
    """vid -> (other mesh, its placements) of each round trip of ``graph`` (its first pin
    removed from ``graph.pins``); raises :class:`CaptureError` where a value lives on
    another mesh otherwise (module docstring)."""
    pins = graph.pins
    away = {}                                   # vid -> (mesh, placements, where)
    for vid, (m, ps, where) in pins.items():
        if m is not None and m != mesh:
            away[vid] = (m, ps, where)
    if not away:
        return {}
    readers = {vid: [] for vid in away}
    for n in graph.nodes:
        for vid in set(i for i in n.inputs if i is not None):
            if vid in readers:
                readers[vid].append(n)
    outs = set(graph.output_vids())
    trips = {}
    for vid, (m, ps, where) in away.items():
        rd = readers[vid]
        back = pins.get(rd[0].outs[0]) if len(rd) == 1 and rd[0].op == "kept_copy" else None
        if vid in outs or back is None or back[0] is None or back[0] != mesh or \
                any(x is not None and x != vid for x in rd[0].inputs) or \
                any(a is not None and not isinstance(a, (int, float, str)) and
                    getattr(a, "vid", vid) != vid for a in rd[0].args):
            raise CaptureError(f"redistribute at {where[0]}:{where[1]} ({where[2]}) to a mesh "
                               "other than the program's, and the tensor is not moved "
                               "straight back to it (an op on it, another reader, a "
                               "reshard to its own or a third mesh, or returned): the graph "
                               "holds one mesh; the program runs eagerly", where=where)
        trips[rd[0].outs[0]] = (m, ps)
    for vid in away:
        del pins[vid]
    return trips


def via_plans(spec, via, dst, profile):
    """The two plans of a round trip (``mesh_trips.py``): ``spec`` to ``via`` (other
    mesh, placements), then from there to ``dst`` on ``spec``'s mesh."""
    from ..parallel.reshard import plan_reshard
    there = plan_reshard(spec, via[0], list(via[1]), profile=profile)
    moved = TensorSpec(spec.shape, via[0], there.dst, spec.dtype, _trusted=True)
    return there, plan_reshard(moved, spec.mesh, list(dst), profile=profile)
