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

Priced: the trip's two plans (``propagate._Pricer.pin_cost``).  The step's schedule
(``prog.step()``) holds every collective and send the trip records, on whichever ranks
(the program mesh's, the other mesh's, the sends between them), forward and backward:
:func:`trip_events` makes eager's two calls (:func:`trip`, the run's own) on zeros of the
value's shape under a trace of their own, and the schedule replays what they recorded
(their backward from a gradient in the pinned placements, as the op reading the copy
sends it back).  It was the first plan's collectives only: the way back's, the sends and
the backward on the other mesh were left out (compile17).
"""
from __future__ import annotations

from ..parallel.spec import TensorSpec
from .capture_errors import CaptureError

__all__ = ["mesh_trips", "via_plans", "trip", "trip_events"]


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
                               "holds one mesh (its search, lowering and step place and "
                               "price every value there); the program runs eagerly.  To "
                               "compile the work there, compile it as a program of its own "
                               "(wb.compile(g, t_there)) and call that from this function",
                               where=where)
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


def trip(t, via, dst):
    """A round trip's two calls, eager's: ``t`` to ``via`` (other mesh, placements), then
    back to ``t``'s mesh in ``dst`` (the run's, ``lower.execute_program``)."""
    from ..parallel.reshard import reshard
    there = reshard(t, via[0], list(via[1]))
    return reshard(there, t.mesh, list(dst))


_EVENTS: dict = {}


def trip_events(spec, via, dst, profile, grad: bool):
    """``(forward, backward, seconds)``: the communication events (name, ranks, buffer
    bytes, wire bytes, duration) :func:`trip` records for a tensor of ``spec`` on
    ``profile``, run on zeros under a trace of its own; backward (``grad``: the value
    requires grad) from a gradient of zeros in ``dst``; ``seconds``: the two traces'
    clocks (the trip's share of the step: the search prices it so, ``propagate``).  The
    schedule replays the events (``schedule.build_schedule``)."""
    from ..sim_mesh.profiles import get_profile
    key = (tuple(spec.shape), spec.dtype, spec.mesh, tuple(spec.placements), via[0],
           tuple(via[1]), tuple(dst), get_profile(profile).name, bool(grad))
    got = _EVENTS.get(key)
    if got is None:
        if len(_EVENTS) > 4096:
            _EVENTS.clear()
        got = _EVENTS[key] = _record(spec, via, dst, profile, grad)
    return got


def _record(spec, via, dst, profile, grad):
    import torch
    from ..parallel.dist_tensor import distribute_tensor
    from ..sim_mesh.trace import suspend, trace

    def zeros(ps):
        with suspend(), torch.no_grad():
            return distribute_tensor(torch.zeros(spec.shape, dtype=spec.dtype), spec.mesh,
                                     list(ps))

    def comm(tr):
        return tuple((e.name, tuple(e.ranks), int(e.args.get("buffer_bytes") or e.bytes),
                      int(e.bytes), e.duration) for e in tr.events if e.stream == "comm")
    t = zeros(spec.placements)
    grad = grad and (spec.dtype.is_floating_point or spec.dtype.is_complex)
    if grad:
        t.requires_grad_()
    with torch.enable_grad(), trace(profile) as fw:
        out = trip(t, via, dst)
    if not (grad and out.requires_grad):
        return comm(fw), (), fw.time()
    g = zeros(dst)
    with trace(profile) as bw:
        out.backward(g)
    return comm(fw), comm(bw), fw.time() + bw.time()
