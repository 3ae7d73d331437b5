"""The chooser's shortcut for a new shape: the first candidate that moves nothing.

The dispatcher decides once per input layout (``dispatch._first_call``), and a layout
includes the shapes; a serving engine's packed step has a new token count at almost
every step, so every op of the step is decided again.  The full decision
(:func:`strategy.infer`) prices every candidate the rule offers with the reshard
planner, a Dijkstra search over placements (``reshard._plan_same_mesh``): 90% of a
first call of the tp=2 engine (cProfile, ``benchmarks/new_shapes.py --profile``: 4,329
searches for 648 first calls), the rest torch's meta checks, the rule, the output
shapes.  ``reshard_search.py`` makes each search faster; this module avoids them.

What of that decision depends on the shape?  The chooser ranks candidates by
(time + deferred time, bytes + deferred bytes, the rule's order).  A candidate whose
inputs reach what it requires by local steps only (slice, keep-on-one-rank, relabel:
no collective, no zero-padding) and that defers nothing ranks (0.0, 0): no candidate
can rank lower (no price is negative), so the first such candidate in the rule's order is the chosen one,
whatever the others cost.  Whether a candidate is of that kind does not depend on the
shape either, as long as the tensors are not tiny:

* the planner's cost of a path is (modeled time, bytes, zero-pads, steps), compared in
  that order.  Local steps cost (0, 0, pads, 1) whatever the shape; a collective on a
  mesh dim of p >= 2 ranks moves ``f * nb * (p - 1) / p > 0`` bytes when its buffer
  ``nb > 0``.  So while every local shard holds a byte, the search pops only
  zero-cost states before it reaches a target that local steps reach, in the same
  order at every shape (the pushes of costly states only shift the tie-breaking
  counter, not the order of the zero-cost ones): the plan is the same list of steps,
  and none of a local step's fields depends on the shape except a zero-pad's buffer
  (not used here).  The plan found at one shape is the plan at every other;
* a plan with a collective or a zero-pad at one shape has one at every shape (no
  local path exists, or the best local path pads); such a candidate then ranks above
  (0, 0) when the wire bytes of every collective (and of the reduce-scatter a zero-pad
  is ranked as) are >= 1: ``(p - 1) * nb // p >= 1`` (``cost.wire_bytes``) holds for
  every p >= 2 once ``nb >= 2``.

Both hold when every tensor input has ``numel * itemsize >= 2 * mesh.size`` bytes: the
largest shard of any layout holds at least numel / mesh.size elements (``torch.chunk``
gives the first rank the most).  Smaller inputs take the full decision.

So for a new shape :func:`choose` runs the rule (it may depend on the shape), walks
its strategies in order, classifies each input's move by a plan found once per
(ndim, dtype, mesh, src, dst, profile) (:data:`_TEMPLATES`), prices the deferred
reductions exactly, and stops at the first candidate that moves nothing.  The
:class:`FreeDecision` it returns holds that candidate; its full ranking and reason,
which explain() and the validator read, are the full decision's, computed when first
read.  Where no candidate moves nothing (a partial sum that must be all-reduced, a
sharded input that must be gathered) the full decision runs: those choices trade
collectives against each other, and the profile's prices of them depend on the bytes
(latency against bandwidth, and NCCL's protocol thresholds in ``topology.choose``).

:data:`COUNTS` counts both ways (tests hold the engine's full decisions to it).
"""
from __future__ import annotations

import contextlib

from ...sim_mesh import cost as _cost
from ..placement import Replicate
from . import strategy as _st
from .table import on_change

__all__ = ["choose", "FreeDecision", "COUNTS", "disabled"]

COUNTS = {"full": 0, "free": 0}     # decisions made the full way / by the shortcut
_ON = [True]


@contextlib.contextmanager
def disabled():
    """Every decision the full way meanwhile (tests and benchmarks compare the two)."""
    _ON.append(False)
    try:
        yield
    finally:
        _ON.pop()

_LOCAL_FREE = ("local_slice", "local_partial", "local_relabel")
_TEMPLATES: dict = {}   # (ndim, dtype, mesh, src, dst, profile) -> steps (free) or None


class FreeDecision:
    """A decision whose chosen candidate moves nothing; ``candidates`` and ``reason`` are
    the full decision's (:func:`strategy.infer`), computed when first read."""
    __slots__ = ("op", "specs", "chosen", "_key", "_full")

    def __init__(self, op, specs, chosen, key):
        self.op, self.specs, self.chosen, self._key, self._full = op, specs, chosen, key, None

    def full(self) -> _st.Decision:
        if self._full is None:
            self._full = _st._infer_cached(*self._key)
        return self._full

    @property
    def candidates(self) -> tuple:
        return self.full().candidates

    @property
    def reason(self) -> str:
        return self.full().reason

    @property
    def inputs(self) -> tuple:
        return self.chosen.strategy.inputs

    @property
    def outputs(self) -> tuple:
        return self.chosen.strategy.outputs

    def __str__(self) -> str:
        return str(self.full())


def choose(op: str, specs: tuple, attrs: dict, check: bool = False, grads: tuple = ()):
    """The decision for ``op`` on ``specs``: a :class:`FreeDecision` where a candidate
    moves nothing (module docstring), else :func:`strategy.infer`'s.  ``check``: also
    run the full decision and raise if its choice differs (the dispatcher's validator).
    ``grads``: per input, whether it requires grad (its plan's transposes are priced too:
    ``strategy.backward_price``; a local slice of such an input is no free move, its
    gradient is all-gathered back)."""
    frozen = tuple(sorted((k, _st._freeze(v)) for k, v in attrs.items()))
    profile = _st._profile_name()
    key = (op, tuple(specs), frozen, profile, _st.grads_key(grads))
    dec = _free(key) if _ON[-1] else None
    if dec is None:
        COUNTS["full"] += 1
        try:
            return _st._infer_cached(*key)
        finally:
            _st._HANDOFF[0] = None
    _st._HANDOFF[0] = None          # (only a full decision made at once takes it)
    COUNTS["free"] += 1
    if check and dec.full().chosen != dec.chosen:
        raise AssertionError(f"{op}: the zero-communication shortcut chose {dec.chosen}, "
                             f"the full decision {dec.full().chosen}")
    return dec


def _free(key):
    op, specs, frozen, profile, grads = key
    mesh = None
    for s in specs:
        if s is not None:
            if s.shape.numel() * s.dtype.itemsize < 2 * s.mesh.size:
                return None                       # tiny: a collective could move 0 bytes
            if mesh is not None and s.mesh is not mesh and s.mesh != mesh:
                return None
            mesh = s.mesh
    rule = _st.RULES.get(op)
    if mesh is None or rule is None:
        return None
    strategies = _st.call_rule(rule, specs, dict(frozen))
    _st.hand_off(op, specs, frozen, rule, strategies)   # the full decision's, if it follows
    # (the strategies as strategy.distinct walks them, handed to the full decision once
    # all are walked; each input's move classified once per call: task speed18b)
    ranked, seen, moves = [], set(), {}
    bools = _st._dtype_checked(specs)
    for order, st in enumerate(strategies):
        n = len(seen)
        seen.add((st.inputs, st.outputs))
        if len(seen) == n or bools and not _st._bool_ok(specs, st):
            continue
        ranked.append((order, st))
        plans = []
        for k, (spec, req) in enumerate(zip(specs, st.inputs)):
            if spec is None or req is None:
                plans.append(None)
                continue
            req = tuple(req)
            steps = moves.get((k, req), False)
            if steps is False:
                steps = moves[(k, req)] = _steps(spec, req, profile)
            if steps is None or grads and grads[k] and \
                    any(s_.kind in _st.BACKWARD_PRICED for s_ in steps):
                break
            plans.append(_plan(spec, req, steps, profile))
        else:
            dt, db = _deferred(mesh, st, profile)
            if dt == 0 and db == 0:
                return FreeDecision(op, specs, _st.Candidate(st, tuple(plans), 0.0, 0), key)
            if dt < 0 or db < 0:
                return None
            continue
    _st.hand_off(op, specs, frozen, rule, strategies, ranked)
    return None


def _steps(spec, dst: tuple, profile: str):
    """The plan's steps from ``spec`` to ``dst`` if local steps without zero-padding
    reach it (the same steps at every shape: module docstring), else None."""
    src = tuple(spec.placements)
    if src == dst:
        return ()
    key = (spec.ndim, spec.dtype, spec.mesh, src, dst, profile)
    try:
        return _TEMPLATES[key]
    except KeyError:
        pass
    if _needs_collective(src, dst, spec.mesh.shape):
        free = None
    else:
        from ..reshard import plan_reshard_cached
        steps = plan_reshard_cached(spec, dst, profile).steps
        free = steps if all(s.kind in _LOCAL_FREE for s in steps) else None
    if len(_TEMPLATES) > 16384:
        _TEMPLATES.clear()
    _TEMPLATES[key] = free
    return free


def _needs_collective(src: tuple, dst: tuple, mesh_shape: tuple) -> bool:
    """No path of local steps leads from ``src`` to ``dst``, by the planner's moves
    (``reshard_search._moves``): on a mesh dim of more than one rank the free ones turn
    Replicate into Shard (a local slice) or Partial (kept on one rank), and nothing else
    (a relabel is on a dim of one rank only); so a dim not Replicate in ``src`` that
    differs in ``dst`` stays a difference every local step leaves.  Then every plan has
    a step that is not free, and :func:`_steps` is None without the planner's search:
    the dry run of a 16-rank cp x tp x dp layout searched ~480 plans for the shortcut,
    ~90% of its CPU, nearly all of moves it then refused (task speed18b)."""
    return any(a != b and n > 1 and not isinstance(a, Replicate)
               for a, b, n in zip(src, dst, mesh_shape))


def _plan(spec, dst, steps, profile):
    """The planner's Plan for ``spec`` with ``steps`` (as ``reshard._plan_cached`` makes it)."""
    from ..reshard import Plan
    return Plan(tuple(spec.shape), spec.dtype, spec.mesh, tuple(spec.placements), spec.mesh,
                dst, steps, profile)


def _deferred(mesh, st, profile):
    """(time, bytes) of the reductions ``st`` defers, as ``strategy.strategy_cost`` ranks
    them."""
    dt, db = 0.0, 0
    for i, nb in getattr(st, "deferred", ()):
        t_, b_ = _st.deferred_price(mesh, i, nb, profile)
        dt += t_
        db += b_
    return dt, db


on_change(_TEMPLATES.clear)
