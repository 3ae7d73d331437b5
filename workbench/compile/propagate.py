"""Whole-graph propagation: choose every intermediate's placement for the whole program.

The dispatcher chooses op by op (greedy): each op takes the strategy whose own
communication is cheapest, blind to what its consumers will need.  Here every op's
strategy is chosen for the program at once, to minimise the modeled step time

    sum over ops of  forward communication   (the reshard plans into the strategy)
                   + backward communication  (each plan's transpose: all_gather <->
                     reduce_scatter, all_to_all <-> all_to_all, all_reduce <-> all_reduce,
                     a local slice <-> all_gather; and the all-reduce of the gradient of
                     an input replicated where the op's outputs diverge: the dispatcher's
                     expanded replicas, Megatron's ``f`` / DDP's gradient all-reduce)
                   + compute, forward and backward (the op table's cost on the busiest
                     rank's local shapes, priced on the profile's roofline: the kernels
                     and launches ``prog.step()`` lays out, :mod:`.kernels`)
  + the reshards of pinned tensors (an output pinned to Replicate).

The whole-graph search prices what the compiled program runs: one reshard per tensor
and layout, shared by every consumer that reads that layout (the ``cancel_reshards`` pass
drops the repeats; autograd sums the consumers' gradients and runs the reshard's backward
once), so a consumer reading a layout already made pays nothing for it
(:attr:`NodeCost.reused`); a pinned tensor is resharded where it is made, and its made
layout stays readable.  On these terms the whole-graph assignment's :attr:`Assignment.time`
is the O1 ``prog.step()`` (blocking collectives in series with the kernels), tested in
``tests/test_compile_estimate_agrees.py``.  :func:`greedy` prices the dispatcher (and O0,
which keeps every reshard): each consumer pays its own, but the gradient of a gather
repeated for a second consumer is reduced once (its readers meet, as eager's do).

Search (DP on live layouts, beam on DAGs, memory as the tie-break and ``memory_limit``):
:mod:`.search`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..parallel.ops_table.strategy import (BACKWARD_OF, _way_price, grad_reduction_steps,
                                                 infer_on, step_price)
from ..parallel.ops_table.table import TABLE
from ..parallel.placement import Partial, Replicate, normalize_placements
from ..parallel.reshard import plan_reshard_cached
from ..parallel.reshard_backward import per_rank_dims, way_noted
from .extrema import as_run, inner_bytes, runs_even
from ..parallel.spec import TensorSpec
from ..sim_mesh.profiles import get_profile
from .kernels import op_kernels
from .int_partials import reduced_first
from .mesh_trips import trip_events

__all__ = ["Assignment", "propagate", "greedy", "initial", "NodeCost", "BACKWARD_OF"]

# the collective a forward reshard step's gradient passes through: the dispatcher's
# chooser's map (ops_table/strategy.py, which says why an all_gather and an all_reduce have
# none), one place.  Pricing those too counted collectives the run never makes (the tiny
# Llama's O1 step: 39 priced against 37 run).


@dataclass(frozen=True)
class NodeCost:
    fwd_comm: float
    bwd_comm: float
    compute: float          # forward + backward kernels (launches included)
    memory: int = 0         # bytes per rank kept: outputs, and inputs laid out anew
    reused: tuple = ()      # input positions read from a layout an earlier reshard made

    @property
    def total(self) -> float:
        return self.fwd_comm + self.bwd_comm + self.compute


@dataclass
class Assignment:
    """One placement for every tensor: the strategy each op runs, and its price."""
    graph: object
    mesh: object
    profile: str
    placements: dict            # vid -> placements as produced (inputs: as given)
    choice: dict                # nid -> Candidate (strategy + plans from the inputs)
    costs: dict                 # nid -> NodeCost
    pins: dict                  # vid -> pinned placements
    pin_cost: float = 0.0
    how: str = ""               # "greedy" | "whole-graph"
    states: int = 0             # search states expanded
    reduced: dict = field(default_factory=dict)   # (nid, vid) -> (made, reduced) layouts:
    #   greedy's partial sums reduced before the op, as the dispatcher's int_summed
    #   (lowered as a reshard of their own: lower.py)

    @property
    def time(self) -> float:
        """Modeled step time of the program under this assignment (module docstring)."""
        return sum(c.total for c in self.costs.values()) + self.pin_cost

    @property
    def memory(self) -> int:
        """Bytes per rank the ops' outputs and re-laid-out inputs hold (module docstring)."""
        return sum(c.memory for c in self.costs.values())

    @property
    def comm_time(self) -> float:
        return sum(c.fwd_comm + c.bwd_comm for c in self.costs.values()) + self.pin_cost

    @property
    def bytes(self) -> int:
        """Bytes each rank sends in the forward reshards (the busiest rank's)."""
        b = sum(p.total_bytes for nid, c in self.choice.items()
                for k, p in enumerate(c.plans)
                if p is not None and k not in self.costs[nid].reused)
        b += sum(inner_bytes(c) for c in self.choice.values())     # (extrema.py)
        b += sum(plan_reshard_cached(TensorSpec(self.graph.values[vid].shape, self.mesh, src,
                                                self.graph.values[vid].dtype, _trusted=True),
                                     red, self.profile).total_bytes
                 for (_n, vid), (src, red) in self.reduced.items())
        return b + sum(_pin_bytes(self, vid, ps) for vid, ps in self.pins.items())

    def __str__(self):
        g = self.graph
        lines = [f"{self.how}: modeled step {self.time * 1e6:.2f} us "
                 f"(communication {self.comm_time * 1e6:.2f} us), "
                 f"{self.bytes:,d} B sent per rank forward"]
        for n in g.nodes:
            c = self.choice[n.nid]
            lines.append(f"  {n.name:<18} {c}")
        return "\n".join(lines)


def _pin_bytes(a, vid, ps) -> int:
    via = a.graph.vias.get(vid)
    if via is None:
        return _plan(a, vid, ps).total_bytes
    there = _plan(a, vid, via[1], via[0])
    moved = TensorSpec(there.shape, via[0], there.dst, there.dtype, _trusted=True)
    from ..parallel.reshard import plan_reshard
    return there.total_bytes + plan_reshard(moved, a.mesh, list(ps),
                                            profile=a.profile).total_bytes


def _plan(a, vid, ps, mesh=None):
    """The reshard of ``vid`` from the layout its op made (pinned: resharded at once) to
    ``ps``."""
    v = a.graph.values[vid]
    src = a.placements[vid]
    if v.kind == "op" and v.producer in a.choice:
        n = a.graph.nodes[v.producer]
        src = tuple(a.choice[n.nid].strategy.outputs[n.outs.index(vid)])
    spec = TensorSpec(v.shape, a.mesh, src, v.dtype, _trusted=True)
    if mesh is not None:                    # (a round trip's way there: mesh_trips.py)
        from ..parallel.reshard import plan_reshard
        return plan_reshard(spec, mesh, list(ps), profile=a.profile)
    return plan_reshard_cached(spec, tuple(ps), a.profile)


class _Pricer:
    """Prices one op's candidate (cached: the search asks the same questions often)."""

    def __init__(self, graph, mesh, profile, grads=False):
        self.g, self.mesh, self.profile = graph, mesh, get_profile(profile)
        # decide as the dispatcher does with the inputs' requires_grad (greedy: O0, eager's
        # choice, which prices those inputs' reshards in backward too)
        self.grads = grads
        # vid -> the way back of a program's ``t.redistribute`` result, as eager's
        # ``wb.reshard`` marks it (``reshard_backward.way_key``; :func:`greedy` sets them
        # where it reshards a pin, lowering marks the copy so): its readers' decisions price
        # it as the dispatcher prices a marked input (``strategy.backward_price``)
        self.ways = {}
        self.pname = self.profile.name
        self._compute, self._dec = {}, {}
        self.backward = backward_nodes(graph)

    def spec(self, vid, ps):
        v = self.g.values[vid]
        return TensorSpec(v.shape, self.mesh, ps, v.dtype, _trusted=True)

    def run_dtype(self, vid):
        """The dtype the run gives value ``vid``: the graph's, but under CPU autocast (the
        capture records none of its casts) ``search.effective_dtypes``'."""
        eff = self.__dict__.get("_eff")
        if eff is None:
            eff = {}
            if any(n.amp is not None for n in self.g.nodes):
                from .search import effective_dtypes
                eff = effective_dtypes(self.g)
            self._eff = eff
        return eff.get(vid, self.g.values[vid].dtype)

    def decision(self, node, in_ps):
        key = (node.nid, in_ps)
        d = self._dec.get(key)
        if d is None:
            # an elementwise rule is asked with the dtypes the run gives (a bf16 P(sum)
            # under autocast passes no add: ops_table/pointwise.py _sixteen_bit_result), as
            # the dispatcher asks it at run time
            run = TABLE[node.op].op_class == "elementwise"
            specs = tuple(None if vid is None else TensorSpec(
                self.g.values[vid].shape, self.mesh, ps,
                self.run_dtype(vid) if run else self.g.values[vid].dtype, _trusted=True)
                for vid, ps in zip(node.inputs, in_ps))
            grads = tuple(vid is not None and self.g.values[vid].requires_grad and
                          self.ways.get(vid, True) for vid in node.inputs) \
                if self.grads else ()
            dec = infer_on(self.pname, node.op, *specs, _grads=grads, **node.attrs)
            if runs_even(self.g, node, in_ps):    # its Partial reduced inside (extrema.py)
                dec = as_run(self.g, node, dec, self.mesh, self.pname)
            d = self._dec[key] = (specs, dec)
        return d

    def compute(self, node, specs, cand) -> float:
        key = (node.nid, cand.strategy.inputs, cand.strategy.outputs)
        t = self._compute.get(key)
        if t is not None:
            return t
        t = op_kernels(self.g, self.mesh, self.profile, node, specs, cand,
                       node.nid in self.backward).time(self.profile)
        self._compute[key] = t
        return t

    def backward_comm(self, node, specs, cand, reused=(), shared=(), repeated=(),
                      ways=None) -> float:
        """The transposes of the forward plans (but the ``reused`` positions': the
        program runs their reshard once, for an earlier consumer; and the ``repeated``
        ones': a gather run again for this reader, O0's, runs without autograd and its
        gradient goes back through the first gather's copy, ``lower.execute_program``),
        and the gradient
        reduction of each input read per rank, once per input copy: with its first reader
        in program order (not the ``reused`` positions, whose copy an earlier consumer's
        reshard made, nor the ``shared`` ones, a copy an earlier op read per rank), the
        reshard planner's plan from the Partial gradient back to the copy's layout (a
        gathered copy's: the source's shards), as the run records it (``grad_ways.py``).
        ``ways``: vid -> the way back of a program's ``t.redistribute`` result read here
        (:func:`pinned_way`; None: :attr:`ways`, greedy's; the search gives its state's)."""
        t = 0.0
        ways = self.ways if ways is None else ways
        st = cand.strategy
        if node.nid not in self.backward:
            return 0.0
        diverge = [i for i in range(self.mesh.ndim)
                   if any(not ps[i].is_replicate() for ps in st.outputs)]
        for pos, (vid, spec, plan, req) in enumerate(zip(node.inputs, specs, cand.plans,
                                                         st.inputs)):
            if vid is None or not self.g.values[vid].requires_grad:
                continue
            if plan is not None and pos not in reused and pos not in repeated:
                skip = ()
                if vid in ways:
                    # a program's t.redistribute result sliced: its way back to the
                    # source, not the slice's all-gather (strategy.backward_price)
                    t_, _b, skip = _way_price(spec, plan, ways[vid], self.pname,
                                              self.profile)
                    t += t_
                for s in plan.steps:
                    kind = BACKWARD_OF.get(s.kind)
                    if kind is None or s.mesh_dim is None or s.mesh_dim in skip:
                        continue
                    nb = s.buffer_bytes or _local_bytes(spec.shape, self.mesh, s.src, spec.dtype)
                    t += step_price(s, spec, self.profile, back=True, nbytes=nb)[0]
            # (a parameter held once per rank along a mesh dim, a data-parallel optimizer's
            # replicas or a sequence-parallel norm's copies: its gradient stays each rank's
            # there and the optimizer reduces it once per step, whatever the layout:
            # ``Graph.replica_dims``; priced, the search gathered the batch over dp to save
            # reductions the step makes anyway, 4 all-gathers more than eager's)
            own = self.g.replica_dims.get(vid, ())
            dims = [i for i in diverge if req[i].is_replicate() and i not in own]
            if dims and pos not in reused and pos not in shared and pos not in repeated:
                t += self.grad_reduction(vid, plan, tuple(req), dims, ways.get(vid))
        return t

    def grad_reduction(self, vid, plan, req, dims, way=None) -> float:
        """The time of one input copy's gradient reduction (``backward_comm``); ``way``:
        the copy's way back where it is a program's ``t.redistribute`` result
        (:func:`pinned_way`): read as it is, its gradient goes back to the reshard's
        source, as eager's marked copy's (``grad_ways.py``: a reduce-scatter, not the
        all-reduce of the gathered bytes)."""
        spec = self.spec(vid, req)
        return sum(step_price(s, spec, self.profile)[0]     # (uneven: the busiest rank's)
                   for s in grad_reduction_steps(spec, plan, dims, way, self.pname))

    def shared_reads(self, node, in_ps, cand, seen):
        """The input positions of ``node`` that read per rank a copy an earlier op read
        per rank (``seen``: the (vid, layout) copies read so far, the value's own layout,
        not a reshard's), and the copies it reads so first."""
        st = cand.strategy
        if node.nid not in self.backward:
            return (), ()
        diverge = [i for i in range(self.mesh.ndim)
                   if any(not ps[i].is_replicate() for ps in st.outputs)]
        shared, first = [], []
        for pos, (vid, ps, req, plan) in enumerate(zip(node.inputs, in_ps, st.inputs,
                                                       cand.plans)):
            if vid is None or req is None or not self.g.values[vid].requires_grad or \
                    not any(req[i].is_replicate() for i in diverge) or \
                    (plan is not None and plan.steps and tuple(req) != ps):
                continue
            key = ("read", tuple(req),
                   tuple(i for i in diverge if req[i].is_replicate()))   # (gather's key)
            if key in seen.get(vid, ()) or key in first:
                shared.append(pos)
            else:
                first.append((vid, key))
        return tuple(shared), tuple(first)

    def repeated_gathers(self, node, in_ps, cand, made):
        """The input positions of ``node`` whose reshard repeats a gather an earlier op
        ran (``made``: the (vid, source layout, layout) gathers so far; the dispatcher and
        O0 run each consumer's own): eager's readers of one gathered value meet on it and
        its gradient is reduced once (``reshard_backward.gather``; O0's run reads the
        first copy, ``lower.execute_program``), priced with the first gather's reader.
        Adds this node's new gathers to ``made``."""
        out = []
        for pos, (vid, ps, req, plan) in enumerate(zip(node.inputs, in_ps,
                                                       cand.strategy.inputs, cand.plans)):
            if vid is None or req is None or plan is None or not plan.steps or \
                    not any(a.is_shard() and b.is_replicate() for a, b in zip(ps, req)):
                continue
            key = (vid, tuple(ps), tuple(req))
            if key in made:
                out.append(pos)
            made.add(key)
        return tuple(out)

    def price(self, node, specs, cand, reused=(), shared=(), repeated=(),
              ways=None) -> NodeCost:
        """``reused``: the input positions whose layout an earlier reshard (or a pin)
        already made: the program reads that copy (``passes/reshards.py``), so their
        plan costs no communication, forward or backward, and no memory again;
        ``repeated``: a gather run again (forward communication, no backward); ``ways``:
        :meth:`backward_comm`'s."""
        reused = tuple(sorted(reused))
        fwd = cand.time if not reused else sum(
            p.total_time for k, p in enumerate(cand.plans) if p is not None and k not in reused)
        return NodeCost(fwd, self.backward_comm(node, specs, cand, reused, shared, repeated,
                                                ways),
                        self.compute(node, specs, cand), self.memory(node, specs, cand, reused),
                        reused)

    def memory(self, node, specs, cand, reused=()) -> int:
        n = 0
        # a view's output is its input's storage (the op table's op_class "view")
        for vid, ps in zip(node.outs, cand.strategy.outputs) \
                if TABLE[node.op].op_class != "view" else ():
            v = self.g.values[vid]
            n += _local_bytes(v.shape, self.mesh, tuple(ps), v.dtype)
        for pos, (spec, plan, req) in enumerate(zip(specs, cand.plans, cand.strategy.inputs)):
            if spec is not None and plan is not None and plan.steps and pos not in reused:
                n += _local_bytes(spec.shape, self.mesh, tuple(req), spec.dtype)
        return n

    def pin_cost(self, vid, src, dst) -> float:
        via = self.g.vias.get(vid)
        if tuple(src) == tuple(dst) and via is None:
            return 0.0
        spec = self.spec(vid, tuple(src))
        if via is not None:
            # a round trip to another mesh: the clock of eager's two calls, forward and
            # backward, every rank's (mesh_trips.trip_events: what the step replays)
            v = self.g.values[vid]
            return trip_events(spec, via, tuple(dst), self.pname,
                               v.requires_grad and v.producer in self.backward)[2]
        p = plan_reshard_cached(spec, tuple(dst), self.pname)
        t = p.total_time
        if self.g.values[vid].requires_grad:
            v = self.g.values[vid]
            for s in p.steps:
                kind = BACKWARD_OF.get(s.kind)
                if kind is not None and s.mesh_dim is not None:
                    # (a local slice's backward all_gather: the gathered size, as above)
                    nb = s.buffer_bytes or _local_bytes(v.shape, self.mesh, s.src, v.dtype)
                    t += step_price(s, spec, self.profile, back=True, nbytes=nb)[0]
        return t


def backward_nodes(graph) -> set:
    """The nodes a backward from the program's outputs runs through: an output of theirs
    requires grad and reaches an output (an op whose result nothing returned reads, dead
    code the forward still runs, has no backward: no kernel, no gradient reduction)."""
    needed = set(graph.output_vids())
    out = set()
    for n in reversed(graph.nodes):
        if any(o in needed and graph.values[o].requires_grad for o in n.outs):
            out.add(n.nid)
            needed.update(v for v in n.inputs if v is not None)
    return out


def _local_bytes(shape, mesh, ps, dtype) -> int:
    from ..parallel import layout
    n = 1
    for s in layout.max_local_shape(shape, mesh, ps):
        n *= s
    # (dtype.itemsize: a complex dtype too; finfo / iinfo raised TypeError for complex128
    # and the search refused a complex program with a raw error, compile12)
    return n * dtype.itemsize


def initial(graph, placements, mesh):
    """vid -> placements of the inputs, parameters and constants."""
    R = (Replicate(),) * mesh.ndim
    out = {}
    read = {i for n in graph.nodes for i in n.inputs if i is not None} | \
        set(graph.output_vids())
    for v in graph.values:
        if v.kind == "op":
            continue
        got = placements.get(v.vid)
        if isinstance(got, tuple):
            m, ps = got
            if m != mesh and v.kind == "param" and v.vid not in read:
                # read by no op of the graph: the experts' weights on the expert mesh,
                # which the expert_parallel node's dispatcher reads itself (as eager)
                out[v.vid] = R
                continue
            if m != mesh:
                raise ValueError(f"{v.kind} {v.name!r} lives on mesh {list(m.ranks)}, the "
                                 f"program on {list(mesh.ranks)}; compile a program on one "
                                 "mesh (reshard it onto the other first)")
            out[v.vid] = tuple(ps)
        else:
            out[v.vid] = R
    return out


def program_pin(graph, mesh, vid, ps) -> bool:
    """Whether pin ``ps`` of ``vid`` is the program's own ``t.redistribute`` (capture's
    ``Graph.pins``; not the caller's ``pin=`` over it): its copy is marked as eager's
    ``wb.reshard`` result is (``lower.execute_program``)."""
    own = graph.pins.get(vid)
    return own is not None and \
        tuple(normalize_placements(own[1], mesh, len(graph.values[vid].shape))) == tuple(ps)


def pinned_way(graph, mesh, pname, vid, src, dst):
    """The way back eager's ``wb.reshard`` gives a program's ``t.redistribute`` of value
    ``vid`` from ``src`` to ``dst`` (``reshard_backward.way_key`` of the planner's plan,
    the copy held once: a fresh reshard's), or None (no such pin, no gradient, nothing
    gathered)."""
    if tuple(src) == tuple(dst) or not graph.values[vid].requires_grad or \
            vid in getattr(graph, "vias", {}) or not program_pin(graph, mesh, vid, dst):
        return None                      # (a round trip's way back: its own reshards')
    from ..parallel.reshard_backward import way_key
    v = graph.values[vid]
    plan = plan_reshard_cached(TensorSpec(v.shape, mesh, tuple(src), v.dtype, _trusted=True),
                               tuple(dst), pname)
    if not plan.steps:
        return None
    return way_key(plan.src, tuple(dst), tuple(range(mesh.ndim)))


def _norm_pins(graph, mesh, pins):
    out = {}
    for key, ps in (pins or {}).items():
        vid = key
        if isinstance(key, str):
            if key not in graph.params:
                raise KeyError(f"pin {key!r}: no parameter of that name; names are like "
                               f"{list(graph.params)[:4]}")
            vid = graph.params[key]
        if not isinstance(vid, int) or not 0 <= vid < len(graph.values):
            raise ValueError(f"pin {key!r}: give a value number (graph.values) or a "
                             "parameter name")
        out[vid] = tuple(normalize_placements(ps, mesh, len(graph.values[vid].shape)))
    return out


def greedy(graph, placements, mesh, profile, pins=None) -> Assignment:
    """The dispatcher's op-by-op choice (each op's cheapest candidate), priced."""
    pr = _Pricer(graph, mesh, profile, grads=torch.is_grad_enabled())
    pins = _norm_pins(graph, mesh, pins)
    pl = initial(graph, placements, mesh)
    choice, costs = {}, {}
    pin_cost = 0.0
    seen: dict = {}              # vid -> the copies read per rank so far (shared_reads)
    gathers: set = set()         # the gathers run so far (repeated_gathers)
    reduced = {}
    for n in graph.nodes:
        in_ps = tuple(None if v is None else pl[v] for v in n.inputs)
        first_cost = 0.0
        red = reduced_first(pr, n, in_ps)
        if red is not None:
            # an integer partial sum meets another output dtype: the dispatcher reduces
            # every partial sum first, then decides (dispatch._int_summed /
            # _partials_reduced; narrow probe seed 141: O0 reduce-scattered where eager
            # all-reduces then slices)
            for vid, a_, b_ in zip(n.inputs, in_ps, red):
                if vid is not None and a_ != b_ and (n.nid, vid) not in reduced:
                    reduced[(n.nid, vid)] = (a_, b_)
                    first_cost += pr.pin_cost(vid, a_, b_)
            in_ps = red
        specs, dec = pr.decision(n, in_ps)
        c = dec.chosen
        shared, first = pr.shared_reads(n, in_ps, c, seen)
        for vid, key in first:
            seen.setdefault(vid, set()).add(key)
        repeated = pr.repeated_gathers(n, in_ps, c, gathers)
        choice[n.nid], costs[n.nid] = c, pr.price(n, specs, c, shared=shared,
                                                   repeated=repeated)
        if first_cost:
            costs[n.nid] = dataclasses.replace(costs[n.nid],
                                               fwd_comm=costs[n.nid].fwd_comm + first_cost)
        expand = None
        for vid, spec, plan, k in zip(n.inputs, specs, c.plans, range(len(n.inputs))):
            if vid is not None and vid in pr.ways:
                # its gradient layout noted on the way, as the run's reshard notes it
                # (reshard_backward.execute_marked), with the dims the op reads it per
                # rank along (a Partial gradient: eager's reshard_backward.convert): the
                # next reader is priced by what it adds to the one redistribution back
                # (strategy.way_steps), as eager's
                if expand is None:
                    expand = per_rank_dims(c.strategy, mesh.ndim)
                pr.ways[vid] = way_noted(pr.ways[vid], spec.placements, plan, expand[k])
        for vid, ps in zip(n.outs, c.strategy.outputs):
            pl[vid] = tuple(ps)
            if vid in pins:          # resharded where it is made, as lowering does
                pin_cost += pr.pin_cost(vid, ps, pins[vid])
                way = pinned_way(graph, mesh, pr.pname, vid, ps, pins[vid])
                if way is not None and pr.grads:
                    pr.ways[vid] = way
                pl[vid] = pins[vid]
    return Assignment(graph, mesh, pr.pname, pl, choice, costs, pins, pin_cost, "greedy",
                      reduced=reduced)


from .search import propagate  # noqa: E402,F401  (the search, beside its pricing)
