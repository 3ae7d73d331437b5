"""The reshard planner's search, fast: the same Dijkstra as ``reshard._plan_same_mesh``
(which stays as the readable version), with the same pushes in the same order, so the
same plan, step for step.

``_plan_same_mesh`` is a Dijkstra search over placement tuples (the scaling book's
"edit one subscript per collective", priced on the profile).  Profiling the dispatcher's
first calls (``benchmarks/new_shapes.py --profile``) put ~90% of a full decision in it:
each search expands tens of states and every move recomputed what does not change
during a search.  Here, per search, each state's bytes are computed once; the moves out
of a state, which depend only on (tensor ndim, mesh shape, the dtype's Partial ops),
are listed once per process; each (kind, mesh dim, bytes) is priced once; and a path is
a chain of parent links, its Steps made only for the plan returned.  Every cost is the
same float expression in the same order as in ``_plan_same_mesh``, and ties still go
to the first push (the counter), so the result is identical
(``tests/test_dispatch_cache_shapes.py`` holds the two to each other on random
layouts).
"""
from __future__ import annotations

import heapq
from functools import lru_cache

import torch

from . import layout
from .placement import Partial, Replicate, Shard

__all__ = ["plan_steps"]


def _pops(dtype) -> tuple:
    """The Partial ops the dtype has (placement.check_partial_dtype): no sum or avg of
    bools (max / min are logical or / and), no avg of integers."""
    return (("sum", "avg", "max", "min") if dtype.is_floating_point or dtype.is_complex else
            ("max", "min") if dtype == torch.bool else ("sum", "max", "min"))


def _blocked(ps, i, dims) -> bool:
    return any(isinstance(p, Shard) and p.dim in dims for p in ps[i + 1:])


class _Graph:
    """The placement states of one (tensor ndim, mesh shape, Partial ops), numbered as
    they are met, and the moves out of each, listed once: (kind, mesh dim, the new
    state's number, whose bytes: 1 the new state's, 0 the old one's, None: a local step)."""

    def __init__(self, ndim: int, mesh_shape: tuple, pops: tuple):
        self.ndim, self.mesh_shape, self.pops = ndim, mesh_shape, pops
        self.ids: dict = {}
        self.states: list = []
        self.moves: list = []

    def id(self, ps: tuple) -> int:
        k = self.ids.get(ps)
        if k is None:
            k = self.ids[ps] = len(self.states)
            self.states.append(ps)
            self.moves.append(None)
        return k

    def out(self, k: int) -> tuple:
        m = self.moves[k]
        if m is None:
            m = self.moves[k] = tuple((kind, i, self.id(nxt), whose) for kind, i, nxt, whose
                                      in _moves(self.ndim, self.mesh_shape, self.pops,
                                                self.states[k]))
        return m


@lru_cache(maxsize=1024)
def _graph(ndim: int, mesh_shape: tuple, pops: tuple) -> _Graph:
    return _Graph(ndim, mesh_shape, pops)


def _moves(ndim: int, mesh_shape: tuple, pops: tuple, ps: tuple) -> list:
    """The legal single-mesh-dim moves (``reshard._moves`` adds their bytes): (kind,
    mesh dim, new placements, whose
    bytes: 1 the new placements', 0 the old ones', None: a local step)."""
    out = []
    for i, p in enumerate(ps):
        cands = [Replicate()] + [Shard(d) for d in range(ndim)]
        for new in cands + [Partial(op) for op in pops]:
            if new == p:
                continue
            nxt = ps[:i] + (new,) + ps[i + 1:]
            if mesh_shape[i] == 1:
                if not (isinstance(new, Shard) and _blocked(ps, i, {new.dim})) and \
                        not (isinstance(p, Shard) and _blocked(ps, i, {p.dim})):
                    out.append(("local_relabel", i, nxt, None))
                continue
            if isinstance(p, Replicate):
                if isinstance(new, Shard):
                    if _blocked(ps, i, {new.dim}):
                        continue
                    out.append(("local_slice", i, nxt, None))
                else:
                    out.append(("local_partial", i, nxt, None))
            elif isinstance(p, Shard):
                if _blocked(ps, i, {p.dim} | ({new.dim} if isinstance(new, Shard) else set())):
                    continue
                if isinstance(new, Replicate):
                    out.append(("all_gather", i, nxt, 1))
                elif isinstance(new, Shard):
                    out.append(("all_to_all", i, nxt, 0))
                elif new.reduce_op == "sum":
                    out.append(("local_pad", i, nxt, None))
            else:  # Partial
                if isinstance(new, Replicate):
                    out.append(("all_reduce", i, nxt, 0))
                elif isinstance(new, Shard):
                    if _blocked(ps, i, {new.dim}):
                        continue
                    out.append(("reduce_scatter", i, nxt, 0))
    return out


_SENT = ("all_to_all", "all_gather", "reduce_scatter")


def plan_steps(shape, dtype, mesh, src, dst, profile, price_step, exact_factor) -> list:
    """``reshard._plan_same_mesh(shape, dtype, mesh, src, dst, profile)``'s steps.
    ``price_step``: reshard's ``_price_step``; ``exact_factor``: its ``_EXACT``."""
    from .reshard import Step, step_sent
    if src == dst:
        return []
    mshape, elem = mesh.shape, dtype.itemsize
    graph = _graph(len(shape), mshape, _pops(dtype))
    states = graph.states
    names = mesh.dim_names
    nbytes: dict = {}            # state -> bytes of its largest shard

    def nb_of(k):
        n = nbytes.get(k)
        if n is None:
            n = nbytes[k] = layout.local_numel_max(shape, mesh, states[k]) * elem
        return n

    priced: dict = {}           # (kind, mesh dim, bytes) -> (wire, time, groups, exact)

    def price(kind, i, nb, sent=None):
        k = (kind, i, nb, sent)
        r = priced.get(k)
        if r is None:
            wire, t, ng = price_step(kind, i, nb, mesh, profile, sent)
            exact = (exact_factor.get(kind, 0.0) * nb * (mshape[i] - 1) / mshape[i]
                     if sent is None else sent)
            r = priced[k] = (wire, t, ng, exact)
        return r

    start, goal = graph.id(tuple(src)), graph.id(tuple(dst))
    best = {start: (0.0, 0, 0, 0)}
    heap = [((0.0, 0, 0, 0), 0, start, None)]
    counter = 1
    while heap:
        cost, _, k, node = heapq.heappop(heap)
        if k == goal:
            steps = []
            while node is not None:
                node, (kind, i, a, b, wire, t, buf, ng) = node
                steps.append(Step(kind, i, names[i], states[a], states[b], wire, t, buf, ng))
            return steps[::-1]
        if best.get(k, cost) < cost:
            continue
        for kind, i, nxt, whose in graph.out(k):
            nb = 0 if whose is None else nb_of(nxt if whose else k)
            sent = None
            if kind in _SENT:            # uneven: the busiest rank's bytes (reshard.step_sent)
                sent = step_sent(kind, shape, dtype, mesh, states[k], states[nxt], i)
            wire, t, ng, exact = price(kind, i, nb, sent)
            c = (cost[0] + t, cost[1] + exact, cost[2] + (kind == "local_pad"), cost[3] + 1)
            old = best.get(nxt)
            if old is None or c < old:
                best[nxt] = c
                buf = nb_of(nxt) if kind == "local_pad" else nb
                heapq.heappush(heap, (c, counter, nxt,
                                      (node, (kind, i, k, nxt, wire, t, buf, ng))))
                counter += 1
    return None
