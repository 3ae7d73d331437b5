"""Lowering: an :class:`~.propagate.Assignment` as a distributed program, and running it.

The program is a list of instructions, in order:

* ``Reshard(vid, src, dst, plan)``: bring a tensor to the placements its consumer
  needs (the plan's collectives, priced);
* ``Run(nid, strategy)``: the op, on inputs already laid out as its strategy requires.

Each consumer gets its own reshard from the placements its input was made in, as the
dispatcher does it op by op; the ``cancel_reshards`` pass (``passes/reshards.py``, from O1)
then removes the ones that bring a tensor back to a layout it already has.  Where one is
left (O0), a gather run again for a second consumer records its collective, as eager
does, and the consumer reads the first copy: autograd sums the readers' gradients there
and reduces them once, as eager's meet on the gathered input (``reshard_backward.gather``).

Running: every tensor is a DistTensor of the simulated mesh (or, under torch.distributed,
of this process's rank); each ``Reshard`` runs its plan (``wb.reshard``, traced), each
``Run`` calls the user's torch callable with the dispatcher forced to the chosen
strategy (``dispatch.force_candidate``), so the local op, autograd and the trace are the
dispatcher's own.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..parallel.dispatch import dispatch, force_candidate
from ..parallel.dispatch_local import as_dist
from ..parallel.ops_table.table import TABLE
from ..parallel.dist_tensor import DistTensor
from ..parallel.placement import Replicate, fmt_placements
from ..parallel import reshard_backward as _rb
from ..parallel.reshard import execute, plan_reshard_cached, reshard
from ..parallel.spec import TensorSpec
from .extrema import reduced as _reduced
from .graph import map_refs
from .int_partials import laid_inside
from .mesh_trips import trip, via_plans
from .propagate import program_pin

__all__ = ["Reshard", "Run", "lower", "execute_program"]


@dataclass
class Reshard:
    vid: int
    src: tuple
    dst: tuple
    plan: object
    why: str = ""            # "input of <op>" / "pinned"
    via: tuple | None = None  # pinned: (other mesh, placements) of a round trip there
    #                           and back (mesh_trips.py); ``plan``: its way there
    marks: bool = False      # a program's t.redistribute: its copy gets eager's way back
    #                          (a round trip's copy: marked by eager's own reshard calls)
    inside: bool = False     # run by the dispatcher inside the op, as eager's call lays
    #                          it out (made_partial_inside): the run hands the op its input

    def __str__(self):
        colls = ", ".join(f"{s.kind} on {s.mesh_dim_name}" if s.mesh_dim_name else s.kind
                          for s in self.plan.steps) or "nothing"
        return (f"  reshard %{self.vid} {fmt_placements(self.src)} -> {fmt_placements(self.dst)}: "
                f"{colls}, {self.plan.total_bytes:,d} B, {self.plan.total_time * 1e6:.2f} us"
                + (f", via mesh {list(self.via[0].ranks)} {fmt_placements(self.plan.dst)} "
                   "and back (the way back's steps run there: on the run's trace)"
                   if self.via else "")
                + (f"  ({self.why})" if self.why else ""))


@dataclass
class Run:
    nid: int
    strategy: object
    fused: str = ""


def lower(graph, assignment) -> list:
    """The instruction list of ``assignment`` (module docstring): one reshard per input
    that needs one, the op, then a pinned output's reshard."""
    mesh, prof = assignment.mesh, assignment.profile
    cur = {v.vid: assignment.placements[v.vid] for v in graph.values if v.kind != "op"}
    prog = []
    pins = assignment.pins
    vias = getattr(graph, "vias", {})
    outs = set(graph.output_vids())
    reduced = getattr(assignment, "reduced", {})
    for n in graph.nodes:
        st = assignment.choice[n.nid].strategy
        src_of = {}
        for vid in dict.fromkeys(n.inputs):
            red = reduced.get((n.nid, vid))
            if red is not None and cur[vid] == red[0]:
                # greedy's partial sum reduced before the op, as the dispatcher's
                # (propagate.greedy: int_summed); then from there to the op's layout
                v = graph.values[vid]
                spec = TensorSpec(v.shape, mesh, cur[vid], v.dtype, _trusted=True)
                prog.append(Reshard(vid, cur[vid], red[1],
                                    plan_reshard_cached(spec, red[1], prof),
                                    f"reduced first: input of {n.name}"))
                src_of[vid] = red[1]
        for vid, req in zip(n.inputs, st.inputs):
            src = src_of.get(vid, cur[vid] if vid is not None else None)
            if vid is None or req is None or tuple(req) == src or \
                    graph.values[vid].kind == "fresh" or \
                    laid_inside(graph, n, vid, req):    # (the dispatcher's, inside)
                continue
            v = graph.values[vid]
            spec = TensorSpec(v.shape, mesh, src, v.dtype, _trusted=True)
            prog.append(Reshard(vid, src, tuple(req),
                                plan_reshard_cached(spec, tuple(req), prof), f"input of {n.name}",
                                inside=made_partial_inside(n, src, req)))
        prog.append(Run(n.nid, st))
        for vid, ps in zip(n.outs, st.outputs):
            cur[vid] = tuple(ps)
            via = vias.get(vid)
            if vid in pins and (tuple(ps) != pins[vid] or via is not None):
                v = graph.values[vid]
                spec = TensorSpec(v.shape, mesh, tuple(ps), v.dtype, _trusted=True)
                plan = via_plans(spec, via, pins[vid], prof)[0] if via is not None else \
                    plan_reshard_cached(spec, pins[vid], prof)
                prog.append(Reshard(vid, tuple(ps), pins[vid], plan,
                                    "pinned output" if vid in outs else "pinned", via,
                                    via is None and program_pin(graph, mesh, vid, pins[vid])))
                cur[vid] = pins[vid]
    return prog


def made_partial_inside(n, src, req) -> bool:
    """An input of a product (mul, div, a matmul-class op) that the op's strategy takes as a
    partial sum (or average) where it is not one yet (a linear's replicated bias, or its
    replicated x, made P(sum) on one rank: ``R -> P(sum)``, no collective): its reshard
    stays in the program (printed, priced) but the run hands the op the input as it is,
    laid out by the dispatcher inside the op, as eager's call does it.
    Laid out before, it reached the dispatcher partial, which then read the factors for
    inf (``dispatch._unsafe_factor``) and all-reduced it where eager's call, handed the
    replicated value, never does (a row-parallel linear whose weight holds inf: O0 one
    all-reduce, eager none; compile18)."""
    if src is None or not (n.op in ("mul", "div") or TABLE[n.op].op_class == "matmul"):
        return False
    return any(q.is_partial() and q.reduce_op in ("sum", "avg") and not p.is_partial()
               for p, q in zip(src, req))


def _pick(node, strategy):
    def pick(dec):
        if dec.op != node.op:
            return None
        want = strategy.inputs
        if node.op in ("amax", "amin") and dec.specs and dec.specs[0] is not None and \
                want[0] is not None and tuple(want[0]) != _reduced(want[0]) and \
                tuple(dec.specs[0].placements) == _reduced(want[0]):
            # the even-gradient form (ops_table/extreme_grad.py) reduced its input's
            # P(max) / P(min) before its inner amax (custom_function._reduce_extremum):
            # that call takes the reduced input as it is; forced back onto the Partial it
            # reduced its output once more (narrow probe seed 205: two all-reduces, eager 1)
            for c in dec.candidates:
                if tuple(c.strategy.inputs[0]) == tuple(dec.specs[0].placements) and \
                        tuple(c.strategy.inputs[1:]) == tuple(want[1:]) and \
                        tuple(_reduced(o) for o in c.strategy.outputs) == \
                        tuple(_reduced(o) for o in strategy.outputs):
                    return c
        for c in dec.candidates:
            if c.strategy.inputs == strategy.inputs and c.strategy.outputs == strategy.outputs:
                return c
        for c in dec.candidates:    # amax / amin reducing its own Partial (extrema.py)
            if c.strategy.inputs == strategy.inputs and \
                    tuple(_reduced(o) for o in c.strategy.outputs) == strategy.outputs:
                return c
        raise RuntimeError(f"{node.name}: the chosen strategy {strategy} is not among the "
                           "rule's candidates at run time (the inputs changed layout?)")
    # a partial sum reduced first from its values (dispatch._unsafe_factor): the op runs as
    # eager's, not this strategy (planned for the Partial input: it made the reduced value
    # Partial again, compile17b)
    pick.eager_when_reduced = True
    return pick


def execute_program(graph, prog, mesh, bindings, grad_buckets=None):
    """Run ``prog`` with ``bindings`` (vid -> DistTensor or plain tensor for the inputs,
    parameters and constants); returns the program's result.  ``grad_buckets``: a
    :class:`~.buckets.GradBuckets` that reduces the gradients of the inputs it names in
    its buckets (O2).  Each ``router_topk`` node's outputs go to the layer
    ``graph.stats_layers`` names for it (``MoE.record_stats``: its ``last_stats``)."""
    layers = iter(graph.stats_layers)
    avail = {}                       # vid -> {placements: tensor}
    # a plain 0-d floating CPU tensor, handed to mul / div as it is: the dispatcher reads
    # it as a number (dispatch._unsafe_scale: a nan reduces a partial sum first), as
    # eager's call, where a replicated copy is a factor it reads only for inf (compile18)
    numbers = {vid: x for vid, x in bindings.items() if type(x) is torch.Tensor and
               x.dim() == 0 and x.device.type == "cpu" and x.dtype.is_floating_point}
    for vid, x in bindings.items():
        if not isinstance(x, DistTensor):     # a plain tensor: replicated, as the
            x = as_dist(x, mesh)              # dispatcher takes it (gradients flow back)
        avail[vid] = {tuple(x.placements): x}
    cur = {vid: next(iter(d)) for vid, d in avail.items()}
    gathered = {}                    # (vid, src, dst) -> (source tensor, its marked copy)
    for ins in prog:
        if isinstance(ins, Reshard) and ins.inside:
            continue        # (the op's dispatcher lays it out: made_partial_inside)
        if isinstance(ins, Reshard):
            have = avail[ins.vid]
            src = have.get(ins.src)
            if src is None and any(p.is_partial() and p.reduce_op in ("max", "min")
                                   for p in ins.src):
                # amax / amin with a gradient across ranks reduce their own P(max) /
                # P(min) inside the op (ops_table/extreme_grad.py: torch's even gradient),
                # so the Partial the strategy names never exists: the reduced value is
                # what the op returned; the rest of the reshard runs from it
                reduced = tuple(Replicate() if p.is_partial() else p for p in ins.src)
                src = have.get(reduced)
                if src is not None:
                    out = _trip(src, ins) if ins.via is not None else \
                        reshard(src, src.mesh, list(ins.dst)) if reduced != ins.dst else src
                    have[ins.dst] = out
                    if ins.why.startswith("pinned"):
                        cur[ins.vid] = ins.dst
                    continue
            if src is None and ins.vid in cur and cur[ins.vid] in have and \
                    ins.src not in have:
                # the op that made it reduced a partial sum first, from the values
                # (dispatch._unsafe_factor: a factor holding 0 or inf) and ran as eager's,
                # so its output is in eager's layout, not the planned one: the reshard runs
                # from the layout made (values exact; its collectives are the run's, the
                # step states it: program_report.data_dependent)
                made = have[cur[ins.vid]]
                out = _trip(made, ins) if ins.via is not None else \
                    reshard(made, made.mesh, list(ins.dst)) if cur[ins.vid] != ins.dst \
                    else made
                have[ins.dst] = out
                if ins.why.startswith("pinned"):
                    cur[ins.vid] = ins.dst
                continue
            if src is None:
                raise RuntimeError(f"reshard %{ins.vid}: not available in "
                                   f"{fmt_placements(ins.src)}")
            t = src if isinstance(src, DistTensor) else as_dist(src, mesh)
            key = (ins.vid, ins.src, ins.dst)
            again = gathered.get(key)
            if again is not None and again[0] is src and not ins.why.startswith("pinned"):
                # the same gather again (O0 keeps each consumer's reshard): eager runs
                # the collective again, and its readers' gradients meet on the source
                # (reshard_backward.gather: one reduction, as DTensor's P + P -> P);
                # here they meet on the first copy (equal values), whose way back
                # reduces once (grad_ways.py: one group per gathered value)
                with torch.no_grad():
                    execute(ins.plan, t)
                have[ins.dst] = again[1]
                continue
            out = _trip(t, ins) if ins.via is not None else \
                _rb.execute_marked(ins.plan, t)     # (t marked: as eager's op reads it)
            if out is not t and out.mesh is t.mesh and ins.marks:
                # a program's t.redistribute: its way back, as eager's wb.reshard result's
                # (reshard_backward.mark; priced so: propagate.pinned_way)
                _rb.mark(out, ins.plan.src, t)
            elif out is not t and out.mesh is t.mesh and not ins.why.startswith("pinned"):
                # its gradient's way back, as wb.reshard's (reshard_backward.mark): a
                # gathered copy read per rank reduce-scatters once (grad_ways.py; a pinned
                # copy is the value's layout from then on: reduced as such)
                _rb.mark(out, ins.plan.src, t)
                if _rb.marked(out):
                    gathered[key] = (src, out)
            if ins.via is not None:
                have.clear()     # a round trip's copy replaces its source (passes/reshards.py)
            have[ins.dst] = out
            if ins.why.startswith("pinned"):
                cur[ins.vid] = ins.dst
            continue
        n = graph.nodes[ins.nid]
        st = ins.strategy
        want = {}         # vid -> the layouts its uses ask for, in the op's input order
        for vid, req in zip(n.inputs, st.inputs):
            if vid is not None and req is not None:
                want.setdefault(vid, []).append(tuple(req))

        def arg(r):
            # a value used twice by one op may be wanted in two layouts (matmul(x, x) as
            # Shard x Replicate): each use takes the next layout its value is wanted in
            if r.vid in numbers and n.op in ("mul", "div"):
                return numbers[r.vid]
            have = avail[r.vid]
            reqs = want.get(r.vid)
            ps = (reqs.pop(0) if len(reqs) > 1 else reqs[0]) if reqs else None
            if ps is not None and ps in have:
                return have[ps]
            return have[cur[r.vid]]
        if grad_buckets is not None:
            arg = _bucketed(arg, graph, n, st, mesh, grad_buckets)
        args = map_refs(n.args, arg)
        kwargs = map_refs(n.kwargs, arg)
        with force_candidate(_pick(n, st)), \
                (torch.no_grad() if not n.grad else contextlib.nullcontext()), \
                torch.autocast("cpu", enabled=n.amp is not None,
                               dtype=n.amp if n.amp is not None else torch.bfloat16):
            if TABLE[n.op].extra.get("runs_itself"):
                # the op's function itself on its inputs laid out as its rule asks (f / g
                # of a tensor-parallel region: ops_table/megatron.py), as eager's hook
                out = n.func(*args, **kwargs)
            else:
                out = dispatch(n.func, args, kwargs)     # the dispatcher, as DistTensor calls it
        if n.op == "router_topk" and graph.stats_layers:
            w, e, slot, aux = out
            next(layers).record_stats(e, slot, aux)
        found = []
        _match(n.out_tree, out, found)
        for vid, t in found:
            ps = tuple(t.placements) if isinstance(t, DistTensor) else None
            want = tuple(st.outputs[n.outs.index(vid)]) if vid in n.outs else ps
            if ps is not None and ps != want and _reduced(ps) == want:
                # planned as the even-gradient form's Replicated result (extrema.py) and
                # run without it (its input needs no grad at this call): reduced here
                t = reshard(t, t.mesh, list(want))
                ps = want
            avail[vid] = {ps: t}
            cur[vid] = ps
    return map_refs(graph.output, lambda r: avail[r.vid][cur[r.vid]])


def _trip(t, ins):
    """A round trip's two calls, eager's (``mesh_trips.trip``): to the other mesh, back."""
    return trip(t, ins.via, ins.dst)


def _bucketed(arg, graph, n, st, mesh, gb):
    """``arg`` with the inputs whose gradients ``gb`` reduces given their per-rank copies
    here, behind their buckets' markers (``buckets.py``)."""
    from ..parallel import layout
    from .graph import Ref
    # (a "fresh" input, dropout's mask, is made by the op's parse on each call: no value
    # of the program holds it, and no gradient is reduced for it)
    fresh = {v for v in n.inputs if v is not None and graph.values[v].kind == "fresh"}
    if not all(layout.is_even(tuple(r.shape), mesh, req) for r, req in
               zip([arg(Ref(v)) if v is not None and v not in fresh else None
                    for v in n.inputs], st.inputs)
               if r is not None and req is not None) or \
            not all(layout.is_even(tuple(graph.values[o].shape), mesh, ps)
                    for o, ps in zip(n.outs, st.outputs)):
        return arg                       # uneven shards: the dispatcher runs it per rank
    swap = {}
    for pos, vid in enumerate(n.inputs):
        axes = () if vid is None or vid in fresh else gb.axes(n.nid, pos)
        if not axes or vid in swap:
            continue
        t = arg(Ref(vid))
        if not isinstance(t, DistTensor):
            continue
        here = tuple(p for p, v in enumerate(n.inputs) if v == vid)
        way = getattr(t._local, "__dict__", {}).get(_rb.KEY)     # a gathered copy
        nb = None
        if way is not None:
            from .propagate import _local_bytes
            nb = _local_bytes(way.shape, mesh, way.back, way.dtype)
        loc = gb.expand(n.nid, here, t._local, axes, nb)
        if loc is not None:
            swap[vid] = DistTensor(loc, t.mesh, t.placements, t.shape, t.dtype, t.names)
    if not swap:
        return arg
    return lambda r: swap[r.vid] if r.vid in swap else arg(r)


def _match(tree, out, found):
    from .graph import Ref
    if isinstance(tree, Ref):
        found.append((tree.vid, out))
    elif isinstance(tree, (tuple, list)):
        for a, b in zip(tree, out):
            _match(a, b, found)
    elif isinstance(tree, dict):
        for k in tree:
            _match(tree[k], out[k], found)
