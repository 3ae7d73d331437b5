"""``amax`` / ``amin`` whose gradient is needed across ranks, as the compiled program runs
them (helper compile12).

Eagerly such a call takes the op table's other form (``ops_table/extreme_grad.py``: torch's
even gradient among ties): the P(max) / P(min) the rule's strategy names is reduced inside
the op, which returns it Replicated there.  The whole-graph choice read the rule alone:
its consumers were planned on the Partial that never exists (``squeeze`` of ``amin``
forced on P(min) met a Replicate at run time: a raw RuntimeError at O0 / O1 / O2, wide
probe seed 47).  Here the candidates of such a node are the ones the run makes: each
Partial(max / min) output Replicated, its all-reduce priced with the op (the reshard
planner's plan, as the op's inner reshard runs it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..parallel.placement import Replicate
from ..parallel.ops_table.extreme_grad import crosses_ranks
from ..parallel.ops_table.strategy import Candidate
from ..parallel.reshard import plan_reshard_cached
from ..parallel.spec import TensorSpec

__all__ = ["reduced", "runs_even", "as_run", "inner_bytes"]


@dataclass(frozen=True)
class RunCandidate(Candidate):
    """A candidate whose op reduces its own output: ``inner``, that reduction's plan."""
    inner: object = None


def inner_bytes(cand) -> int:
    """Bytes each rank sends in the reduction ``cand``'s op runs itself (0: none)."""
    inner = getattr(cand, "inner", None)
    return inner.total_bytes if inner is not None else 0


def reduced(ps) -> tuple:
    """``ps`` with each Partial(max / min) Replicated."""
    return tuple(Replicate() if p.is_partial() and p.reduce_op in ("max", "min") else p
                 for p in ps)


def runs_even(graph, node, in_ps) -> bool:
    """True when ``node`` (amax / amin) takes the even-gradient form with its input in
    ``in_ps``: the input needs grad, grad mode is on, and the extreme crosses ranks."""
    if node.op not in ("amax", "amin") or not node.grad or not node.inputs or \
            node.inputs[0] is None or in_ps[0] is None:
        return False
    if not graph.values[node.inputs[0]].requires_grad:
        return False
    dims = node.attrs.get("dim") or tuple(range(len(graph.values[node.inputs[0]].shape)))
    nd = len(graph.values[node.inputs[0]].shape) or 1
    dims = tuple(d % nd for d in dims)

    class _X:                       # (crosses_ranks reads the placements only)
        placements = in_ps[0]
    return crosses_ranks(_X, dims)


def as_run(graph, node, dec, mesh, profile):
    """``dec`` with each candidate's Partial(max / min) output Replicated, the reduction's
    time and bytes added to the candidate's (the order kept)."""
    v = graph.values[node.outs[0]]
    cands = []
    for c in dec.candidates:
        out = tuple(c.strategy.outputs[0])
        red = reduced(out)
        if red == out:
            cands.append(c)
            continue
        plan = plan_reshard_cached(TensorSpec(v.shape, mesh, out, v.dtype, _trusted=True),
                                   red, profile)
        st = replace(c.strategy, outputs=(red,) + tuple(c.strategy.outputs[1:]))
        cands.append(RunCandidate(st, c.plans, c.time + plan.total_time,
                                  c.bytes + plan.total_bytes, c.deferred_time,
                                  c.deferred_bytes, inner=plan))
    # (in the dispatcher's order: O0 keeps its choice, which ranks the rule's candidates
    # without the reduction the other form adds; the search prices each with it)
    return replace(dec, candidates=tuple(cands))
