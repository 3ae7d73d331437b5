"""The compiled step on the modeled clock: a schedule of kernels and collectives.

A compiled program knows its whole step before it runs, so its timeline can be laid out
ahead: the forward in program order, then the backward in reverse, each op's kernels
priced by the op table's cost on the busiest rank (``ops_table/pricing.py``, the
dispatcher's own), each reshard's collectives and their backward (all_gather <->
reduce_scatter, all_to_all <-> all_to_all, all_reduce <-> all_reduce, a local slice's
all_gather), and the reduction of every gradient whose input was replicated where the
op's outputs diverge (a parameter's: data parallelism's gradient all-reduce; an
activation's: Megatron's ``f``), once per input copy however many ops read it, as eager
records it (``grad_ways.py``).  :func:`replay` records the schedule into a
:class:`~workbench.sim_mesh.trace.Trace` with the clock's own rules (blocking collectives
stall compute; async ones run on the comm stream beside it until waited for).

The O2 passes edit the schedule (``passes/bucket.py``, ``overlap.py``, ``sink.py``) and
each is replayed before and after, so the trace shows what it saved.

Assumed, as the clock assumes: one launch per kernel (two for a matmul's backward: its
dgrad and wgrad GEMMs, as ``pricing.py``), in series with the kernel
(``profiles.launch_overhead``; notebook 12 says where that overcounts).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from ..parallel.ops_table.table import TABLE
from ..sim_mesh.profiles import get_profile
from ..sim_mesh.trace import Trace, suspend
from .lower import Reshard
from .kernels import launch_time, op_kernels
from ..parallel.ops_table.strategy import back_step, way_steps
from ..parallel.reshard_backward import per_rank_dims, way_noted
from .propagate import BACKWARD_OF, _local_bytes, pinned_way
from .grad_ways import GradWays, sent_by_group as _sent
from .mesh_trips import trip_events

__all__ = ["Item", "Schedule", "build_schedule", "replay", "StepReport"]

_COLL = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


@dataclass
class Item:
    kind: str                   # "compute" | "comm"
    name: str
    phase: str                  # "forward" | "backward"
    kernel: float = 0.0         # compute: seconds of the kernel(s) alone
    launches: int = 0           # compute: host launches
    op_class: str = ""
    coll: str = ""              # comm: all_gather | all_reduce | reduce_scatter | all_to_all
    mesh_dim: int = 0
    nbytes: int = 0             # comm: the buffer (cost-model convention)
    grad: bool = False          # comm: a parameter's gradient reduction (bucketable)
    after: int = -1             # comm: the compute item whose result it sends (-1: none)
    before: int | None = None   # comm: the compute item that needs it (None: end of step)
    async_: bool = False        # comm: on the comm stream, waited for before `before`
    tag: str = ""               # what a pass did
    uid: int = -1               # stable number (after / before name compute items by it)
    kernels: int = 0            # compute: kernels it runs (launched one by one, or sunk)
    members: tuple = ()         # grad comm: the (node, input position, mesh dim) it reduces
    dtype: object = torch.float32   # compute: the dtype whose path prices its launches
    ranks: tuple = ()           # comm: a round trip's event on its own ranks (the other
    #                             mesh's, or a send's pair: mesh_trips.trip_events), with
    wire: int = 0               # its wire bytes and
    dur: float = 0.0            # its duration as recorded (not the mesh dim's groups)
    sent: tuple = ()            # comm, uneven pieces: ((group, its busiest rank's bytes),
    #                             ...), recorded and priced so (grad_ways.sent_by_group);
    #                             () the ring formula on nbytes


@dataclass
class Schedule:
    items: list
    mesh: object
    profile: object
    graph_launch: bool = False  # sink: the whole graph is launched once

    def next_uid(self) -> int:
        return max((i.uid for i in self.items), default=-1) + 1

    def copy(self):
        return Schedule([copy.copy(i) for i in self.items], self.mesh, self.profile,
                        self.graph_launch)

    def __str__(self):
        lines = []
        for k, it in enumerate(self.items):
            if it.kind == "compute":
                lines.append(f"#{it.uid:<4} {it.phase[:3]} {it.name:<22} {it.kernel * 1e6:8.2f} us"
                             f" + {it.launches} launch" + (f"  [{it.tag}]" if it.tag else ""))
            else:
                mode = f"async, waited before #{it.before}" if it.async_ and it.before is not None \
                    else "async, waited at the end" if it.async_ else "blocking"
                lines.append(f"#{it.uid:<4} {it.phase[:3]} {it.coll:<15} {it.name:<14} "
                             f"{it.nbytes:>10,d} B  {mode}" + (f"  [{it.tag}]" if it.tag else ""))
        return "\n".join(lines)


@dataclass
class StepReport:
    """What one replay of the schedule cost on the clock (rank 0's streams)."""
    time: float
    compute: float
    comm: float
    exposed: float              # communication time with no compute beside it
    launch: float               # host launch time in the compute stream
    kernels: int
    collectives: int
    trace: Trace = field(repr=False, default=None)
    # what the replay cannot know, stated (the program's data_dependent: program_report.py)
    assumed: tuple = ()

    def __str__(self):
        return (f"step {self.time * 1e6:.2f} us: compute {self.compute * 1e6:.2f} us "
                f"({self.kernels} kernels, launches {self.launch * 1e6:.2f} us), "
                f"communication {self.comm * 1e6:.2f} us ({self.collectives} collectives, "
                f"exposed {self.exposed * 1e6:.2f} us)")


def _launch(profile, dtype) -> float:
    return launch_time(profile, dtype)


def build_schedule(prog) -> Schedule:
    """The step of ``prog`` (module docstring): forward, then backward in reverse."""
    g, a, mesh = prog.graph, prog.assignment, prog.mesh
    prof = get_profile(a.profile)
    items: list[Item] = []
    made = {}                    # vid -> index of the compute item that made it
    fwd_of = {}                  # nid -> (compute item index or -1)
    from .propagate import _Pricer
    pr = _Pricer(g, mesh, a.profile)
    ways = GradWays(g, mesh, pr.pname)     # the gradient reductions, one per input copy
    bwd = []                     # per Run, in forward order: (node, specs, cand, dtype, cost)
    pending = []
    pinned = {}                  # producer nid -> the pinned reshards of its outputs
    attached = []                # the reshards the program runs for the next op's inputs
    way_of = {}                  # id(reshard) -> the way back of the marked copy it reads
    way_uses = {}                # vid -> its way with the readers' noted uses so far
    trips = {}                   # id(reshard) -> a round trip's recorded backward events
    for ins in prog.program:
        if isinstance(ins, Reshard):
            # a reader's reshard of a program's t.redistribute copy: that copy's way back
            # (lower.py marks it; reshard_backward.execute_marked)
            pin = ways.made_by.get((ins.vid, tuple(ins.src)))
            if pin is not None and pin.marks and not ins.why.startswith("pinned"):
                way = pinned_way(g, mesh, pr.pname, ins.vid, pin.src, pin.dst)
                if way is not None:
                    way_of[id(ins)] = way
            own = ways.reshard(ins)     # False: O0's gather repeated, no backward of its own
            if ins.via is not None:
                # a round trip to another mesh: every event eager's two calls record,
                # on their own ranks (mesh_trips.trip_events)
                v = g.values[ins.vid]
                fw, trips[id(ins)], _ = trip_events(
                    pr.spec(ins.vid, ins.src), ins.via, ins.dst, prof,
                    v.requires_grad and v.producer in pr.backward)
                pending.extend(_trip_items(ins, fw, "forward", made.get(ins.vid, -1)))
            for s in ins.plan.steps if ins.via is None else ():
                if s.kind in _COLL:
                    v = g.values[ins.vid]
                    pending.append(Item("comm", f"%{ins.vid}", "forward", coll=s.kind,
                                        mesh_dim=s.mesh_dim, nbytes=s.buffer_bytes,
                                        after=made.get(ins.vid, -1),
                                        sent=_sent(s, v.shape, v.dtype, mesh)))
            if not ins.why.startswith("pinned") and own:
                attached.append(ins)
            if ins.why.startswith("pinned"):
                pinned.setdefault(g.values[ins.vid].producer, []).append(ins)
                for it in pending:
                    it.before = None
                items.extend(pending)
                pending = []
            continue
        n = g.nodes[ins.nid]
        entry = TABLE[n.op]
        c = a.choice[n.nid]
        ways.read(n, c.strategy)
        # a reader of a program's t.redistribute copy that reads it as it is, per rank
        # (Partial gradient): noted on the way first, as the run's way holds every
        # reader's use when the gradient passes (reshard_backward._merged); the backward
        # below prices each slicing reader by what it adds to them.  (Without it, O0's
        # step modeled a slice's all-to-all back that the run merges into the per-rank
        # readers' one reduce-scatter, tdway17.)
        for vid, req, dims in zip(n.inputs, c.strategy.inputs,
                                  per_rank_dims(c.strategy, mesh.ndim)):
            pin = ways.made_by.get((vid, tuple(req))) if vid is not None and dims else None
            if pin is not None and pin.marks and pin.why.startswith("pinned"):
                way = pinned_way(g, mesh, pr.pname, vid, pin.src, pin.dst)
                if way is not None:
                    way_uses[vid] = way_noted(way_uses.get(vid, way), req, None, dims)
        specs = tuple(None if v is None else pr.spec(v, ps) for v, ps in
                      zip(n.inputs, c.strategy.inputs))
        kn = op_kernels(g, mesh, prof, n, specs, c, n.nid in pr.backward)
        idx = len(items) + len(pending)
        for it in pending:
            it.before = idx
        items.extend(pending)
        pending = []
        if kn.forward:
            kern, nl = kn.forward
            items.append(Item("compute", n.name, "forward", kernel=kern, launches=nl,
                              op_class=entry.op_class, kernels=nl, dtype=kn.dtype))
            fwd_of[n.nid] = len(items) - 1
        else:
            fwd_of[n.nid] = made.get(next((v for v in n.inputs if v is not None), -1), -1)
        for vid in n.outs:
            made[vid] = fwd_of[n.nid]
        specs_in = tuple(None if v is None else pr.spec(v, cur_ps) for v, cur_ps in
                         zip(n.inputs, [None if v is None else a.placements[v]
                                        for v in n.inputs]))
        bwd.append((n, specs_in, c, kn, attached))
        attached = []
    items.extend(pending)
    # backward, in reverse
    for n, specs_in, c, kn, resh in reversed(bwd):
        if n.nid not in pr.backward:            # (dead code: no backward)
            continue
        entry = TABLE[n.op]
        # a pinned output's gradient comes back through its reshard first
        for ins in reversed(pinned.get(n.nid, ())):
            v = g.values[ins.vid]
            last = max((k for k, it in enumerate(items) if it.kind == "compute"), default=-1)
            if ins.via is not None:
                items.extend(_trip_items(ins, trips[id(ins)], "backward", last))
                continue
            for s in reversed(ins.plan.steps):
                kind = BACKWARD_OF.get(s.kind)
                if kind is not None and s.mesh_dim is not None:
                    nb = s.buffer_bytes or _local_bytes(v.shape, mesh, s.src, v.dtype)
                    items.append(Item("comm", f"%{ins.vid}", "backward", coll=kind,
                                      mesh_dim=s.mesh_dim, nbytes=nb, after=last,
                                      sent=_sent(back_step(s), v.shape, v.dtype, mesh)))
        here = len(items)
        if kn.backward:
            kern, nl = kn.backward
            items.append(Item("compute", n.name, "backward", kernel=kern, launches=nl,
                              op_class=entry.op_class, kernels=nl, dtype=kn.dtype))
        st = c.strategy
        # the gradients of the inputs read per rank, once per input copy after its last
        # reader's backward (grad_ways.py: eager's reshard_backward)
        for kind, i, nb, vid, members, sent in ways.steps(n.nid):
            leaf = g.values[vid].kind in ("param", "input")
            items.append(Item("comm", f"grad %{vid}" if leaf else f"%{vid}", "backward",
                              coll=kind, mesh_dim=i, nbytes=nb, grad=bool(members),
                              after=here, members=members, sent=sent))
        for pos, (vid, spec, plan, req) in enumerate(zip(n.inputs, specs_in, c.plans,
                                                         st.inputs)):
            if vid is None or not g.values[vid].requires_grad:
                continue
            # the backward of the reshard the program ran for this input (one per
            # producer and layout: a consumer reading a layout an earlier reshard made,
            # or the pin's, runs none, and autograd passes the summed gradient back
            # through that reshard once)
            ins = next((r for r in resh if r.vid == vid and r.dst == tuple(req)), None)
            if ins is not None:
                resh.remove(ins)
                plan = ins.plan
                spec = pr.spec(vid, ins.src)
                moved = ()
                if id(ins) in way_of:
                    # a slice of a program's t.redistribute result: the way back to the
                    # reshard's source instead of the slice's all-gather, the one rule
                    # the search prices (strategy.way_steps; propagate.backward_comm)
                    # (readers before this one noted their gradient layouts: this
                    # one adds to the one redistribution back what they did not plan,
                    # as the run's way merges them, reshard_backward._merged)
                    way = way_of[id(ins)]
                    seen = way_uses.get(vid)
                    if seen is not None:
                        way = seen
                    back, moved = way_steps(spec, plan, way, pr.pname)
                    way_uses[vid] = way_noted(way, spec.placements, plan)
                    for s in back:
                        items.append(Item("comm", f"%{vid}", "backward", coll=s.kind,
                                          mesh_dim=s.mesh_dim, nbytes=s.buffer_bytes,
                                          after=here,
                                          sent=_sent(s, spec.shape, spec.dtype, mesh)))
                for s in reversed(plan.steps):
                    kind = BACKWARD_OF.get(s.kind)
                    if kind is None or s.mesh_dim is None or s.mesh_dim in moved:
                        continue
                    nb = s.buffer_bytes or _local_bytes(spec.shape, mesh, s.src, spec.dtype)
                    items.append(Item("comm", f"%{vid}", "backward", coll=kind,
                                      mesh_dim=s.mesh_dim, nbytes=nb, after=here,
                                      sent=_sent(back_step(s), spec.shape, spec.dtype,
                                                 mesh)))
    # a backward collective is needed by the next backward kernel
    nxt = None
    for k in range(len(items) - 1, -1, -1):
        it = items[k]
        if it.kind == "compute":
            nxt = k
        elif it.phase == "backward" and it.before is None and not it.grad:
            it.before = nxt
    # a collective's data is made by the last kernel before it (an op without a backward
    # kernel names none of its own): the passes never issue it earlier
    last = -1
    for k, it in enumerate(items):
        if it.kind == "compute":
            last = k
        elif not (0 <= it.after < k and items[it.after].kind == "compute"):
            it.after = last if it.after != -1 or it.phase == "backward" else -1
    for k, it in enumerate(items):
        it.uid = k               # after / before were positions: now names that passes keep
    return Schedule(items, mesh, prof)


def _trip_items(ins, events, phase, after) -> list:
    """A round trip's recorded events (``mesh_trips.trip_events``) as comm items."""
    return [Item("comm", f"%{ins.vid}", phase, coll=name, mesh_dim=None, nbytes=nb,
                 after=after, ranks=ranks, wire=wire, dur=dur, tag="round trip")
            for name, ranks, nb, wire, dur in events]


def replay(schedule: Schedule) -> StepReport:
    """Record ``schedule`` on a fresh trace (module docstring) and read the step off it."""
    mesh, prof = schedule.mesh, schedule.profile
    ranks = tuple(mesh.ranks)
    waits: dict = {}             # item index -> handles to wait for before it
    tail = []
    launch_total = 0.0
    kernels = 0
    dt = torch.float32
    with suspend():
        tr = Trace(prof)
        if schedule.graph_launch:      # the whole graph enqueued at once
            lt = _launch(prof, dt)
            tr.record_compute(ranks, "graph launch", lt, label="launch",
                              args={"launch": lt})
            launch_total += lt
        for k, it in enumerate(schedule.items):
            if it.kind == "compute":
                for h in waits.pop(it.uid, ()):
                    tr.wait(h)
                lt = it.launches * _launch(prof, it.dtype)   # its dtype's path (as run)
                launch_total += lt
                kernels += it.kernels
                tr.record_compute(ranks, it.name, it.kernel + lt, label=it.phase,
                                  args={"launch": lt, "phase": it.phase})
                continue
            hs = _record(tr, it, mesh)
            if it.async_:
                (waits.setdefault(it.before, []) if it.before is not None
                 else tail).extend(hs)
        for hs in list(waits.values()) + [tail]:
            for h in hs:
                tr.wait(h)
    return _report(tr, ranks[0], launch_total, kernels)


def _record(tr, it, mesh):
    from ..sim_mesh import cost as _c
    hs = []
    if it.sent:                  # uneven pieces: each group's busiest rank (Item.sent)
        return [tr.record_collective(grp, it.coll, _c.price(it.coll, _c.sent_buffer(
                    it.coll, b, len(grp)), grp, tr.profile), bytes=b,
                    label=f"{it.phase} {it.name}",
                    args={"mesh_dim": mesh.dim_names[it.mesh_dim],
                          "buffer_bytes": int(it.nbytes), "tag": it.tag},
                    overlap=it.async_) for grp, b in it.sent]
    if it.ranks:                 # a round trip's event, as recorded (mesh_trips.py)
        return [tr.record_collective(it.ranks, it.coll, it.dur, bytes=it.wire,
                                     label=f"{it.phase} {it.name}",
                                     args={"mesh_dim": None, "buffer_bytes": int(it.nbytes),
                                           "tag": it.tag}, overlap=it.async_)]
    for grp in mesh.groups(it.mesh_dim):
        if len(grp) == 1:
            continue
        dur = _c.price(it.coll, it.nbytes, grp, tr.profile)
        hs.append(tr.record_collective(grp, it.coll, dur,
                                       bytes=_c.wire_bytes(it.coll, it.nbytes, len(grp)),
                                       label=f"{it.phase} {it.name}",
                                       args={"mesh_dim": mesh.dim_names[it.mesh_dim],
                                             "buffer_bytes": int(it.nbytes), "tag": it.tag},
                                       overlap=it.async_))
    return hs


def _merge(iv):
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _report(tr, rank, launch_total, kernels) -> StepReport:
    evs = tr.events
    comp = _merge([(e.start, e.end) for e in evs if e.stream == "compute" and rank in e.ranks])
    comm = _merge([(e.start, e.end) for e in evs if e.stream == "comm" and rank in e.ranks])
    exposed = 0.0
    for s, e in comm:
        covered = sum(max(0.0, min(e, b) - max(s, a)) for a, b in comp)
        exposed += (e - s) - covered
    return StepReport(tr.time(), sum(b - a for a, b in comp), sum(b - a for a, b in comm),
                      exposed, launch_total, kernels,
                      sum(1 for e in evs if e.stream == "comm" and rank in e.ranks), tr)


def trace_report(tr, rank: int = 0) -> StepReport:
    """The same figures read off a trace a program recorded as it ran: a launch per
    compute event (``profiles.launch_overhead``), none for a kernel run in a sunk graph
    (``args["sunk"]``), the graph's own launch event as it is."""
    lt = _launch(tr.profile, torch.float32)
    comp = [e for e in tr.events if e.stream == "compute" and rank in e.ranks]
    launch = sum(e.duration if e.label == "launch" else 0.0 if e.args.get("sunk") else lt
                 for e in comp)
    return _report(tr, rank, launch, sum(1 for e in comp if e.label != "launch"))


__all__ += ["trace_report"]
