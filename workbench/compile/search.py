"""The whole-graph search: every op's strategy chosen for the program at once, on the
objective :mod:`.propagate` prices.

Search: states are the placements of the *live* tensors (made, and read later), with the
other layouts a reshard already made of any tensor still read (a later consumer reads
that copy for nothing, as the program does: ``propagate``'s docstring); states with the
same live placements and layouts merge, keeping the cheaper (dynamic programming: exact
on a chain, whose live set is one tensor); the ``beam`` cheapest states go on (a search
on DAGs).  The greedy chooser's own path is kept in the beam at every step, so the result
is never worse than greedy's, on the same objective, by construction.

Memory: each op's candidate also keeps bytes per rank, its outputs in the layout it makes
and the inputs its plans lay out anew (a gathered batch, a replicated weight), all held
for the backward (:attr:`NodeCost.memory`; their sum, :attr:`Assignment.memory`, bounds
the activation memory from above: nothing is freed early).  At equal time (to a
femtosecond) the search prefers less memory; ``memory_limit`` (bytes per rank) drops
every partial assignment above it.  Under a limit, "never worse than greedy" holds where
greedy's own assignment fits it.
"""
from __future__ import annotations

import torch

from ..parallel.ops_table.table import TABLE
from .int_partials import int_safe
from .propagate import Assignment, _norm_pins, _Pricer, initial, pinned_way

__all__ = ["propagate"]


def _read_after(graph):
    """For each node index k: every value (inputs and parameters too) read by a node
    after k, or returned: the tensors whose extra layouts a state keeps."""
    after, seen = [], set(graph.output_vids())
    for n in reversed(graph.nodes):
        after.append(frozenset(seen))
        seen.update(v for v in n.inputs if v is not None)
    after.reverse()
    return after


def _live_after(graph):
    """For each node index k: the op outputs read by a node after k, or returned (inputs,
    parameters and constants keep their placements in every state: not part of a key)."""
    last = {}
    for n in graph.nodes:
        for vid in n.inputs:
            if vid is not None:
                last[vid] = n.nid
    end = len(graph.nodes)
    for vid in graph.output_vids():
        last[vid] = end
    live = []
    alive = set()
    for k, n in enumerate(graph.nodes):
        alive |= set(n.outs)
        alive = {v for v in alive if last.get(v, -1) > k}
        live.append(tuple(sorted(alive)))
    return live


def _rank(total, mem):
    """Time first (to a femtosecond: sums in another order differ in the last bits), then
    memory."""
    return (round(total, 15), mem)


def propagate(graph, placements, mesh, profile, pins=None, beam: int = 4,
              per_op: int = 6, memory_limit: int | None = None) -> Assignment:
    """The whole-graph assignment (module docstring): never worse than :func:`greedy`
    (under ``memory_limit``, where greedy's fits)."""
    pr = _Pricer(graph, mesh, profile)
    pins = _norm_pins(graph, mesh, pins)
    base = initial(graph, placements, mesh)
    for vid, ps in pins.items():
        if graph.values[vid].kind != "op" and base[vid] != ps:
            raise ValueError(f"pin of {graph.values[vid].kind} %{vid} "
                             f"({graph.values[vid].name}): inputs and parameters take the "
                             "placements they are given; reshard them before compiling")
    live = _live_after(graph)
    live = list(zip(live, _read_after(graph)))
    outs = set(graph.output_vids())
    # a state: (cost, placements of live vids (dict), choices (tuple of (nid, cand, cost)), greedy?)
    # choices as a linked list (previous, (nid, candidate, cost)): no copying per step
    # (placements of the live op outputs only, {vid: the other layouts a reshard made})
    states = [(0.0, ({}, {}), None, True, 0)]
    gbest = None                           # greedy's own next state
    expanded = 0
    for k, n in enumerate(graph.nodes):
        nxt = {}
        for cost, pl, ch, is_greedy, mem in states:
            for j, (c, nc, extra, keep, key) in enumerate(
                    _candidates(n, pl, pr, base, pins, outs, live[k], per_op)):
                expanded += 1
                total = cost + nc.total + extra
                m = mem + nc.memory
                if memory_limit is not None and m > memory_limit:
                    continue
                # the flag: this state is greedy's own path, or costs no more time and
                # memory than it with the same live layout (so its best continuation does
                # no worse than greedy's)
                g_here = is_greedy and j == 0
                new_s = (total, keep, (ch, (n.nid, c, nc, extra)), g_here, m)
                if g_here:
                    gbest = new_s
                front = nxt.setdefault(key, [])
                if memory_limit is None:
                    # one state per live layout: the least time, then memory (the same
                    # continuations follow each: exact)
                    old = front[0] if front else None
                    if old is None or _rank(total, m) < _rank(old[0], old[4]):
                        if old is not None and old[3] and total <= old[0] and m <= old[4]:
                            new_s = new_s[:3] + (True, m)
                        front[:] = [new_s]
                    elif g_here and old[0] <= total and old[4] <= m:
                        front[0] = old[:3] + (True, old[4])
                    continue
                # under a limit, the states no other beats in both time and memory: the
                # faster one may not fit later where the leaner one does
                for i, o in enumerate(front):
                    if o[0] <= total and o[4] <= m:
                        if g_here:
                            front[i] = o[:3] + (True, o[4])
                        break
                else:
                    beaten = [o for o in front if total <= o[0] and m <= o[4]]
                    if any(o[3] for o in beaten):
                        new_s = new_s[:3] + (True, m)
                    front[:] = [o for o in front if o not in beaten] + [new_s]
        if not nxt:
            # the beam may have dropped the lean paths: search for memory alone, and run
            # the leanest complete assignment where it fits; else name what it needs (a
            # limit that works, not a partial state's figure)
            lean = _leanest(graph, pr, base, pins, live, outs, width=max(beam, 64),
                            per_op=per_op)
            if lean[4] <= memory_limit:
                states = [lean]
                break
            raise ValueError(f"memory_limit={memory_limit:,d} B per rank: no assignment keeps "
                             f"{n.name}'s activations under it (the leanest assignment the "
                             f"search finds needs {lean[4]:,d} B per rank); raise "
                             "memory_limit to at least that, or shard the inputs and "
                             "parameters more")
        ranked = sorted((st for front in nxt.values() for st in front),
                        key=lambda s: _rank(s[0], s[4]))
        states = ranked[:beam]
        if not any(s[3] for s in states):
            g_state = next((s for s in ranked if s[3]), gbest)
            if g_state is not None:          # (under a memory limit greedy may not fit)
                states.append(g_state)
        gbest = None
    # (every pin, the outputs' too, is priced where its tensor is made)
    _, pl, link, _, _ = min(states, key=lambda s: _rank(s[0], s[4]))
    ch = []
    while link is not None:
        link, step = link
        ch.append(step)
    ch.reverse()
    placements_all = dict(base)
    choice, costs = {}, {}
    extra = 0.0
    for nid, c, nc, pin_t in ch:
        choice[nid], costs[nid] = c, nc
        extra += pin_t
        for vid, ps in zip(graph.nodes[nid].outs, c.strategy.outputs):
            placements_all[vid] = tuple(ps)
    for vid, ps in pins.items():
        if vid not in outs and graph.values[vid].kind == "op":
            placements_all[vid] = ps        # pinned intermediates are resharded at once
    return Assignment(graph, mesh, pr.pname, placements_all, choice, costs, pins, extra,
                      "whole-graph", expanded)


def _leanest(graph, pr, base, pins, live, outs, width: int, per_op: int):
    """The complete assignment of least memory the search finds (states keyed by live
    layout keep their leanest; the ``width`` leanest go on), as a state tuple
    (time, live placements, choices, greedy?, memory)."""
    states = [(0.0, ({}, {}), None, False, 0)]
    for k, n in enumerate(graph.nodes):
        nxt = {}
        for cost, pl, ch, _, mem in states:
            for c, nc, extra, keep, key in _candidates(n, pl, pr, base, pins, outs, live[k],
                                                       per_op):
                st = (cost + nc.total + extra, keep, (ch, (n.nid, c, nc, extra)), False,
                      mem + nc.memory)
                old = nxt.get(key)
                if old is None or (st[4], round(st[0], 15)) < (old[4], round(old[0], 15)):
                    nxt[key] = st
        states = sorted(nxt.values(), key=lambda s: (s[4], round(s[0], 15)))[:width]
    return states[0]


def _candidates(n, state, pr, base, pins, outs, live_k, per_op):
    """Node ``n``'s first ``per_op`` candidates from the ``state`` (live placements, other
    layouts made): each as (candidate, its NodeCost, the pins' reshard time, the state
    after it, its key).  An input read in a layout already made is reused
    (``propagate``'s docstring); a pinned tensor is resharded where it is made."""
    pl, avail = state
    live, read = live_k
    in_ps = tuple(None if v is None else pl[v] if v in pl else base[v] for v in n.inputs)
    specs, dec = pr.decision(n, in_ps)
    cands = _precise(n, in_ps, int_safe(n, dec, per_op, pr), pr)
    # the ways back of the program's t.redistribute results this op reads, as greedy's
    # (the state's own: a ("way", key) among the pinned value's layouts made)
    ways = {vid: w[1] for vid in n.inputs if vid is not None
            for w in avail.get(vid, ()) if type(w) is tuple and w[:1] == ("way",)}
    for c in cands:
        made = {}
        reused = []
        for pos, (vid, ps, req, plan) in enumerate(zip(n.inputs, in_ps, c.strategy.inputs,
                                                         c.plans)):
            if vid is None or req is None or plan is None or not plan.steps or \
                    tuple(req) == ps or pr.g.values[vid].kind == "fresh":
                continue
            req = tuple(req)
            if req in avail.get(vid, ()) or req in made.get(vid, ()):
                reused.append(pos)
            else:
                made.setdefault(vid, set()).add(req)
        # a copy an earlier op read per rank: its gradient reduction priced there
        shared, first = pr.shared_reads(n, in_ps, c, avail)
        nc = pr.price(n, specs, c, reused, shared, ways=ways)
        new = dict(pl)
        new_av = {v: set(a) for v, a in avail.items()}
        for v, a in made.items():
            new_av.setdefault(v, set()).update(a)
        for v, key in first:
            new_av.setdefault(v, set()).add(key)
        extra = 0.0
        for vid, ps in zip(n.outs, c.strategy.outputs):
            new[vid] = tuple(ps)
            new_av.pop(vid, None)
            if vid in pins and tuple(ps) != pins[vid]:
                extra += pr.pin_cost(vid, ps, pins[vid])
                new[vid] = pins[vid]
                new_av[vid] = {tuple(ps)}
                # a program's t.redistribute: its copy's way back, as eager's wb.reshard
                # marks it (propagate.pinned_way; lowering marks the copy so at any level)
                way = pinned_way(pr.g, pr.mesh, pr.pname, vid, ps, pins[vid])
                if way is not None:
                    new_av[vid].add(("way", way))
        keep = {v: new[v] for v in live}
        av = {v: frozenset(a) for v, a in new_av.items() if v in read and a}
        yield c, nc, extra, (keep, av), (tuple(sorted(keep.items())),
                                         tuple(sorted((v, tuple(sorted(a, key=repr)))
                                                      for v, a in av.items())))


_NARROW = (torch.bfloat16, torch.float16)


def _precise(n, in_ps, cands, pr) -> list:
    """``cands`` less those that add a 16-bit float partial sum at 16 bits where eager adds
    it wider or reduces it first (the first of the rest, where any is left):

    * an elementwise op with a 16-bit result keeps a partial sum partial
      (:func:`_narrow_partial_sum`);
    * an elementwise op with a wider result (bfloat16 ``x @ w`` partial + a float32
      residual: eager's add takes the partial and sums the parts in float32, the
      reduction after it in float32) is given the 16-bit partial reduced first, rounded
      to 16 bits once more (a Llama MoE layer under bf16 autocast at O1: 1 bf16 ulp at the
      residual, enough to flip a token's expert, logits 0.022 off one device, eager 0.004)
      where a candidate takes it partial."""
    if TABLE[n.op].op_class != "elementwise":
        return cands
    eff = pr.__dict__.get("_eff")
    if eff is None:
        eff = pr._eff = effective_dtypes(pr.g)
    keep = [c for c in cands if not _narrow_partial_sum(n, c, eff)]
    out = [eff.get(o) for o in n.outs]
    if any(d is not None and d.is_floating_point and d not in _NARROW for d in out):
        narrow = [k for k, (vid, ps) in enumerate(zip(n.inputs, in_ps))
                  if vid is not None and ps is not None and eff.get(vid) in _NARROW and
                  any(p.is_partial() and p.reduce_op == "sum" for p in ps)]
        if narrow:
            takes = [c for c in keep if all(
                c.strategy.inputs[k] is not None and
                all(q.is_partial() for p, q in zip(in_ps[k], c.strategy.inputs[k])
                    if p.is_partial()) for k in narrow)]
            keep = takes or keep
    return keep or cands


def effective_dtypes(g) -> dict:
    """vid -> the dtype the run gives it: the graph's, but under CPU autocast (a node's
    ``amp``), whose casts the capture does not record: torch's policy by op name
    (``parallel/autocast.py``: lower-precision ops give the autocast dtype, the float32
    list float32), elementwise ops their floating inputs' promoted dtype, others their
    first input's."""
    from ..parallel.autocast import POLICY
    eff = {v.vid: v.dtype for v in g.values}
    for n in g.nodes:
        if n.amp is None:
            ins = [eff[v] for v in n.inputs if v is not None]
            if not ins or all(eff[o] == g.values[o].dtype for o in n.outs):
                continue
        kind = POLICY.get(n.op) if n.amp is not None else None
        floats = [eff[v] for v in n.inputs if v is not None and eff[v].is_floating_point]
        for o in n.outs:
            if not g.values[o].dtype.is_floating_point or g.values[o].dtype == torch.float64:
                continue
            if kind == "lower":
                eff[o] = n.amp
            elif kind == "fp32":
                eff[o] = torch.float32
            elif floats and TABLE[n.op].op_class == "elementwise":
                d = floats[0]
                for x in floats[1:]:
                    d = torch.promote_types(d, x)
                eff[o] = d
            elif floats and TABLE[n.op].op_class in ("view", "data_movement", "norm",
                                                     "reduction", "elementwise"):
                eff[o] = floats[0]
    return eff


def _narrow_partial_sum(n, cand, eff) -> bool:
    """An elementwise op that keeps a bfloat16 / float16 partial sum partial (``P + P ->
    P``, ``2 * P``): each rank's part is rounded to 16 bits at its own size, which with
    cancelling parts is far above the sum's (softmax(x @ w1 + x @ w2) under bf16 autocast:
    0.15 off eager, which reduced each product first, in float32 as torch.sum of the
    ranks' parts does, and rounded once; eager 0.001 off one device).  The search leaves
    such candidates out (the dispatcher's own choice, O0, keeps eager's)."""
    # (``eff``: the dtypes the run gives the values, :func:`effective_dtypes`)
    if TABLE[n.op].op_class != "elementwise" or not any(eff.get(o) in _NARROW
                                                         for o in n.outs):
        return False
    st = cand.strategy
    return any(p.is_partial() and p.reduce_op in ("sum", "avg") for ps in st.outputs for p in ps) \
        and any(req is not None and any(p.is_partial() for p in req) for req in st.inputs)
