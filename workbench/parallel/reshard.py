"""Reshard: turn one layout into another with the cheapest plan of collectives.

A plan is plain data: a list of :class:`Step` (collective, mesh dim, bytes each
rank sends, modeled time) that can be printed, priced, drawn and executed.
One step changes the placement of one mesh dimension; each edit is a
collective of the scaling book:

    S(d) -> R      all_gather        removes a subscript
    P    -> R      all_reduce        removes {U}
    P    -> S(d)   reduce_scatter    turns {U} into a subscript
    S(a) -> S(b)   all_to_all        moves a subscript
    R    -> S(d)   local slice       no traffic
    R    -> P      local             no traffic (first rank keeps the value)
    S(d) -> P      local zero-pad    no traffic

Multi-dimensional changes are searched (Dijkstra over placements, priced on the
hardware profile) so the plan is the cheapest valid order.  A move on mesh dim i
that touches tensor dim d is only valid while no mesh dim to its right also
shards d (the nesting of DTensor's left-to-right order).  Across meshes the
data moves by send/recv.
"""
from __future__ import annotations

import heapq
import math
from functools import lru_cache
from dataclasses import dataclass, replace as _replace

import torch
from torch.overrides import handle_torch_function, has_torch_function

from ..sim_mesh import backends as _B
from ..sim_mesh import collectives as C
from ..sim_mesh import cost as _cost
from ..sim_mesh import grid as _grid
from ..sim_mesh.mesh import Mesh
from ..sim_mesh.profiles import DEFAULT_PROFILE, get_profile
from ..sim_mesh.trace import current_trace
from . import dist_uneven, layout, storage, strides
from .dist_tensor import DistTensor, shard_tensor
from .spec import TensorSpec
from .placement import (Replicate, check_partial_dtype, fmt_placements,
                        normalize_placements)
from .reshard_search import _moves as _search_moves, _pops, plan_steps
from . import reshard_backward as _rb

__all__ = ["Step", "Plan", "plan_reshard", "reshard"]

_LOCAL = ("local_slice", "local_partial", "local_pad", "local_relabel")
# bytes each rank sends, as a multiple of (p-1)/p of the buffer (ring algorithms)
_EXACT = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


@dataclass(frozen=True)
class Step:
    """One step of a reshard plan."""
    kind: str                       # all_gather | all_reduce | reduce_scatter | all_to_all |
                                    # send_recv | local_slice | local_partial | local_pad
    mesh_dim: int | None            # the mesh dim it runs along (None for send/recv)
    mesh_dim_name: str
    src: tuple                      # placements before
    dst: tuple                      # placements after
    bytes: int                      # bytes the busiest rank sends (0 for local steps)
    time: float                     # modeled seconds on the plan's profile
    buffer_bytes: int = 0           # the collective's buffer (cost-model convention)
    groups: int = 0                 # how many groups run it at once
    note: str = ""

    def __str__(self) -> str:
        where = f"on {self.mesh_dim_name}" if self.mesh_dim_name else ""
        move = f"{fmt_placements(self.src)} -> {fmt_placements(self.dst)}"
        return (f"{self.kind:<15}{where:<10}{move:<28}{self.bytes:>12,d} B"
                f"{self.time * 1e6:>10.2f} us  {self.note}").rstrip()


@dataclass(frozen=True)
class Plan:
    """A reshard plan: steps plus what they connect."""
    shape: tuple
    dtype: torch.dtype
    src_mesh: Mesh
    src: tuple
    dst_mesh: Mesh
    dst: tuple
    steps: tuple
    profile: str

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.steps)

    @property
    def total_time(self) -> float:
        return sum(s.time for s in self.steps)

    def collectives(self) -> list[str]:
        return [s.kind for s in self.steps if s.kind not in _LOCAL]

    def __str__(self) -> str:
        head = (f"reshard {tuple(self.shape)} {fmt_placements(self.src)} -> "
                f"{fmt_placements(self.dst)}"
                + ("" if self.src_mesh == self.dst_mesh else
                   f" (mesh {list(self.src_mesh.ranks)} -> {list(self.dst_mesh.ranks)})")
                + f" on {self.profile}")
        if not self.steps:
            return head + "\n  (nothing to do)"
        body = "\n".join("  " + str(s) for s in self.steps)
        return (f"{head}\n{body}\n  total {self.total_bytes:,d} B {self.total_label()}, "
                f"{self.total_time * 1e6:.2f} us")

    def uneven(self) -> bool:
        """True where a step's ranks send different amounts (its bytes: the busiest's)."""
        return any(s.note.startswith("busiest rank") for s in self.steps)

    def total_label(self) -> str:
        """What :attr:`total_bytes` is: per rank, or (uneven steps) the sum of each
        step's busiest rank, an upper bound of any one rank's bytes."""
        return ("sent per rank" if not self.uneven() else
                "(sum of each step's busiest rank)")

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{s.kind}</td><td>{s.mesh_dim_name}</td><td>{fmt_placements(s.src)}</td>"
            f"<td>{fmt_placements(s.dst)}</td><td>{s.bytes:,d}"
            f"{' (' + s.note + ')' if s.note.startswith('busiest rank') else ''}</td>"
            f"<td>{s.time * 1e6:.2f}</td></tr>"
            for s in self.steps)
        return ("<table><tr><th>step</th><th>mesh dim</th><th>from</th><th>to</th>"
                f"<th>bytes/rank</th><th>us</th></tr>{rows}</table>")


# ---- planning ----------------------------------------------------------------------------

def _elem(dtype) -> int:
    return dtype.itemsize                 # (a 0-d torch.empty per call cost the planner 40%)


def _nbytes(shape, mesh, ps, dtype) -> int:
    return layout.local_numel_max(shape, mesh, ps) * _elem(dtype)


def _moves(shape, mesh, ps, dtype, profile):
    """Every single-mesh-dim move from placements ``ps``: (kind, i, new_ps, nbytes).

    The moves themselves are listed once, by ``reshard_search._moves`` (which edits of one
    placement are legal: nesting, the Partial ops the dtype has, a mesh dim of one rank);
    here each gets its bytes: the new placements' largest shard for an all-gather, the old
    ones' for the other collectives, none for a local step."""
    for kind, i, nxt, whose in _search_moves(len(shape), tuple(mesh.shape), _pops(dtype),
                                             tuple(ps)):
        yield kind, i, nxt, (0 if whose is None else
                             _nbytes(shape, mesh, nxt if whose else ps, dtype))


def a2a_sent(shape, dtype, mesh, ps, nxt, i) -> tuple[int, int] | None:
    """(fewest, most) bytes a rank sends in the all-to-all ``ps`` -> ``nxt`` on mesh dim
    ``i`` (``layout.all_to_all_sent``); None where every rank sends (p-1)/p of the
    largest shard (even shards: the ring formula is exact)."""
    if layout._is_even(tuple(shape), mesh.shape, tuple(ps)) and \
            layout._is_even(tuple(shape), mesh.shape, tuple(nxt)):
        return None
    return layout.all_to_all_sent(tuple(shape), mesh.shape, tuple(ps), i, nxt[i].dim,
                                  _elem(dtype))


def step_sent(kind, shape, dtype, mesh, ps, nxt, i) -> int | None:
    """The bytes the busiest rank sends in step ``kind`` ``ps`` -> ``nxt`` on mesh dim
    ``i`` where the ranks' pieces are uneven (None where the ring formula on the largest
    buffer is exact): an all-to-all's (:func:`a2a_sent`), an all-gather's or
    reduce-scatter's, (p-1) times the largest piece (``layout.gather_sent``: the
    gathered shards, the kept pieces), the bytes the trace records for it on either
    executor (``collectives.all_gather``), forward and backward."""
    if kind == "all_to_all":
        r = a2a_sent(shape, dtype, mesh, ps, nxt, i)
        return None if r is None else r[1]
    if kind in ("all_gather", "reduce_scatter"):
        pieces = ps if kind == "all_gather" else nxt
        if layout._is_even(tuple(shape), mesh.shape, tuple(pieces)):
            return None
        return layout.gather_sent(tuple(shape), mesh, tuple(pieces), i, _elem(dtype))
    return None


def step_records(s, shape, dtype, mesh, groups=None) -> list:
    """The keyword arguments (``groups``, ``sent``) to record plan step ``s`` of a tensor
    ``shape`` / ``dtype`` with (``collectives.record_collective``), one dict per group
    where its pieces are uneven: each group's own busiest rank, (p-1) times its largest
    piece for an all-gather / reduce-scatter (``grid.gather_sent``), its busiest sender's
    shard less the piece it keeps for an all-to-all (``grid.all_to_all_sent``), as the
    simulator records the cells of an executed step (``collectives.all_gather``); ``[{}]``
    (every group at the buffer's ring formula) where even.  ``groups``: those to record
    (torch.distributed: this process's), default the mesh dim's.  What a gradient's way
    back records on both executors (``reshard_backward._Way.steps``,
    ``gather_backward_dist._redistribute``); before (uneven18) its (p-1)/p of the largest
    buffer: (8, 10) f64 P -> S(1) on 4 ranks 480 B where a rank sends 576 B."""
    d = s.mesh_dim
    if step_sent(s.kind, shape, dtype, mesh, s.src, s.dst, d) is None:
        return [{} if groups is None else {"groups": list(groups)}]
    e = _elem(dtype)
    out = []
    for g in (mesh.groups(d) if groups is None else groups):
        if len(g) < 2:
            continue
        if s.kind == "all_to_all":
            shapes = [layout.local_shape(shape, mesh, s.src, r) for r in g]
            sent = _grid.all_to_all_sent(shapes, s.dst[d].dim, len(g), e)
        else:
            pieces = s.src if s.kind == "all_gather" else s.dst
            sent = _grid.gather_sent([math.prod(layout.local_shape(shape, mesh, pieces, r))
                                      for r in g], e)
        out.append({"groups": [g], "sent": sent})
    return out


@lru_cache(maxsize=65536)
def _price_step(kind, i, nbytes, mesh, profile, sent=None) -> tuple[int, float, int]:
    """(bytes the busiest rank sends, modeled seconds, groups) of a step whose buffer is
    ``nbytes``; ``sent``: the busiest rank's bytes where the pieces are uneven (an
    all-to-all, all-gather or reduce-scatter, :func:`step_sent`), priced as such
    (``cost.sent_buffer``)."""
    if kind in _LOCAL:
        return 0, 0.0, 0
    groups = mesh.groups(i)
    p = mesh.shape[i]
    if sent is not None:
        nb = _cost.sent_buffer(kind, sent, p)
        return sent, max(_cost.price(kind, nb, g, profile) for g in groups), len(groups)
    t = max(_cost.price(kind, nbytes, g, profile) for g in groups)
    return _cost.wire_bytes(kind, nbytes, p), t, len(groups)


def _labelled(steps, shape, dtype, mesh) -> list:
    """Steps with a note where ranks send different amounts (uneven all-to-all): the
    step's bytes are the busiest rank's; the note gives the range."""
    out = []
    for s in steps:
        if s.kind == "all_to_all":
            r = a2a_sent(shape, dtype, mesh, s.src, s.dst, s.mesh_dim)
            if r is not None and r[0] != r[1]:
                s = _replace(s, note=(f"busiest rank; ranks send {r[0]:,d}..{r[1]:,d} B "
                                      + s.note).rstrip())
        out.append(s)
    return out


def _plan_same_mesh(shape, dtype, mesh, src, dst, profile) -> list[Step]:
    if src == dst:
        return []
    start = tuple(src)
    best = {start: (0.0, 0, 0, 0)}
    heap = [((0.0, 0, 0, 0), 0, start, [])]
    counter = 1
    while heap:
        cost, _, ps, path = heapq.heappop(heap)
        if ps == dst:
            return path
        if best.get(ps, cost) < cost:
            continue
        for kind, i, nxt, nb in _moves(shape, mesh, ps, dtype, profile):
            sent = step_sent(kind, shape, dtype, mesh, ps, nxt, i)
            wire, t, ng = _price_step(kind, i, nb, mesh, profile, sent)
            exact = (_EXACT.get(kind, 0.0) * nb * (mesh.shape[i] - 1) / mesh.shape[i]
                     if sent is None else sent)
            # cheapest time, then fewest bytes (unrounded), then no zero-padding detours,
            # then fewest steps
            c = (cost[0] + t, cost[1] + exact, cost[2] + (kind == "local_pad"), cost[3] + 1)
            if nxt not in best or c < best[nxt]:
                best[nxt] = c
                buf = _nbytes(shape, mesh, nxt, dtype) if kind == "local_pad" else nb
                step = Step(kind, i, mesh.dim_names[i], ps, nxt, wire, t, buf, ng)
                heapq.heappush(heap, (c, counter, nxt, path + [step]))
                counter += 1
    raise ValueError(f"no reshard plan from {fmt_placements(src)} to {fmt_placements(dst)}")


def plan_reshard(t, mesh: Mesh | None = None, placements=None, profile=None) -> Plan:
    """The cheapest plan that moves ``t`` (a DistTensor or TensorSpec) to
    ``placements`` on ``mesh`` (default: its own mesh), priced on ``profile``
    (default: the current trace's, else the default profile)."""
    if not isinstance(t, (DistTensor, TensorSpec)):
        raise TypeError(f"plan_reshard(t={type(t).__name__}): expected a DistTensor or a "
                        "TensorSpec")
    if mesh is None:
        mesh = t.mesh
    if not isinstance(mesh, Mesh):
        raise TypeError(f"plan_reshard(mesh={mesh!r:.60}): expected a workbench Mesh")
    if placements is None:
        raise ValueError("placements=None: give the target placements, e.g. [Replicate()]")
    if profile is None:
        tr = current_trace()
        profile = tr.profile if tr is not None else None
    prof = get_profile(profile)
    shape = tuple(t.shape)
    dst = normalize_placements(placements, mesh, len(shape))
    check_partial_dtype(dst, t.dtype)
    src = tuple(t.placements)
    if mesh == t.mesh:
        return _plan_cached(shape, t.dtype, mesh, src, dst, prof.name)
    else:
        steps = _plan_cross_mesh(shape, t.dtype, t.mesh, src, mesh, dst, prof)
    return Plan(shape, t.dtype, t.mesh, src, mesh, dst, tuple(steps), prof.name)


def _plan_cross_mesh(shape, dtype, smesh, src, dmesh, dst, prof) -> list[Step]:
    """Same mesh shape: reshard on the source mesh, then rank i sends to rank i.
    Other shapes: replicate on the source mesh, then each target rank receives its
    shard from one source rank (round robin)."""
    nb = _nbytes(shape, dmesh, dst, dtype)
    if smesh.shape == dmesh.shape:
        steps = _labelled(_plan_same_mesh(shape, dtype, smesh, src, dst, prof), shape,
                          dtype, smesh)
        pairs = list(zip(smesh.ranks, dmesh.ranks))
        before = dst
    else:
        before = tuple(Replicate() for _ in smesh.shape)
        steps = _labelled(_plan_same_mesh(shape, dtype, smesh, src, before, prof), shape,
                          dtype, smesh)
        pairs = _cross_pairs(smesh, dmesh)
    pairs = [(a, b) for a, b in pairs if a != b]
    t, sent = _sends(pairs, nb, prof)
    steps.append(Step("send_recv", None, "", before, dst, sent, t, nb, len(pairs),
                      note=f"{len(pairs)} pairs"))
    return steps


def _sends(pairs, nb, prof) -> tuple[float, int]:
    """(modeled time, bytes the busiest rank sends) of the point-to-point sends
    ``pairs``, run in order as the trace runs them: a send starts once both its ranks
    are free, so a rank that feeds several targets sends one after the other."""
    clock: dict[int, float] = {}
    sent: dict[int, int] = {}
    for a, b in pairs:
        start = max(clock.get(a, 0.0), clock.get(b, 0.0))
        clock[a] = clock[b] = start + _cost.price("send_recv", nb, (a, b), prof)
        sent[a] = sent.get(a, 0) + nb
    return max(clock.values(), default=0.0), max(sent.values(), default=0)


def _cross_pairs(smesh, dmesh):
    """Which source rank serves each target rank: itself if it is in both, else
    round robin over the source ranks."""
    out = []
    k = 0
    for b in dmesh.ranks:
        if b in smesh:
            out.append((b, b))
        else:
            out.append((smesh.ranks[k % smesh.size], b))
            k += 1
    return out


# ---- execution -------------------------------------------------------------------------------

def reshard(t, mesh: Mesh | None = None, placements=None, *, profile=None, expanded=()):
    """Execute :func:`plan_reshard`'s plan; every step is recorded in the trace.

    On error nothing is changed: ``t`` is never modified (reshard returns a new
    DistTensor).  ``expanded`` (mesh dims) asks that replicated results along
    those dims be given per rank (used by the SPMD dispatcher)."""
    if not isinstance(t, DistTensor) and isinstance(t, torch.Tensor) and \
            has_torch_function((t,)):
        # a torch function mode sees the call (wb.compile's tracer records it on its
        # stand-ins, compile/tracer.py), as torch.overrides lets a library's own function
        # be overridden; a mode that passes it on reaches the TypeError below
        return handle_torch_function(reshard, (t,), t, mesh, placements, profile=profile,
                                     expanded=expanded)
    if not isinstance(t, DistTensor):
        raise TypeError(f"reshard(t={type(t).__name__}): expected a DistTensor; "
                        "use shard_tensor() for a plain tensor")
    if mesh is None or mesh is t.mesh:
        key = _plan_key(t, placements, profile)
        try:
            plan = _PLANS.get(key) if key is not None else None
        except TypeError:           # unhashable placements: plan without the cache
            key = plan = None
        if plan is None:
            plan = plan_reshard(t, t.mesh, placements, profile=profile)
            if key is not None:
                if len(_PLANS) > 4096:
                    _PLANS.clear()
                _PLANS[key] = plan
        out = _run(plan, t)
    else:
        plan = plan_reshard(t, mesh, placements, profile=profile)
        out = execute(plan, t)
    if out is not t and not _reduces(plan, t) and _shares_memory(out, t):
        # local steps slice or expand t's memory; the result gets its own (as DTensor's
        # Shard._replicate_to_shard clones), so that writing into it leaves t alone
        out._local = storage.map_tensors(out._local, torch.clone)
    if out is not t and out.mesh is t.mesh:
        _rb.mark(out, plan.src, t)   # its gradient's way back: reshard_backward.py
        # the global tensor is unchanged, so is the order of its sequence (seq_order.py)
        out._ring_order = getattr(t, "_ring_order", None)
        out._ring_also = getattr(t, "_ring_also", ())
    if out is not t and (getattr(t, "_gstride", None) is not None or strides.lost_dims(out)) \
            and strides.known(t):
        strides.keep(out, strides.global_stride(t))    # DTensor.redistribute keeps them
    return out


_REDUCING = ("all_reduce", "reduce_scatter")


def _agree_unsummed(t, plan) -> None:
    """Under torch.distributed, before a reshard reduces a data-parallel wrapper's
    gradient not yet summed over its processes (``p.grad`` of ZeRO-1/2's replicas before
    ``step``, DDP's under ``no_sync``: Partial("sum") over dp, ``_wb_unsummed`` on its
    storage, ``grad_replicas.GradReplicas._replica_grad``): every process of the sum makes
    the same read, or the reader gets an error naming the fix (``agreed_reads.agree``).
    Before (readsync), ``if rank == 0: print(p.grad.norm())`` under torchrun left rank 0
    in an all-reduce its peers never joined: it paired with their next collective (the
    step's reduce-scatter) and the job died in gloo's timeout ('Application timeout
    caused pair closure').  Only those gradients: the step's own collectives and every
    other reshard (all processes run them) pay no store round trip."""
    if not _B.is_distributed(t.mesh) or not any(s.kind in _REDUCING for s in plan.steps):
        return
    read = unsummed_read(t)
    if read is not None:
        from ..sim_mesh.agreed_reads import agree
        agree(*read, "summed over")


def unsummed_read(t):
    """(the processes of the sum, the read's words) for :func:`_agree_unsummed` where
    ``t`` is a wrapper's gradient not yet summed (under torch.distributed), else None."""
    from ..sim_mesh import backends as _B
    axes = {a for x in storage.tensors(t._local) for a in getattr(x, "_wb_unsummed", ())}
    axes = sorted(a for a in axes if t.placements[a].is_partial())
    if not axes:
        return None
    mine = _B.coordinate(t.mesh)
    ranks = [r for r in t.mesh.ranks
             if all(t.mesh.coordinate(r)[i] == mine[i] for i in range(t.mesh.ndim)
                    if i not in axes)]
    names = " x ".join(repr(t.mesh.dim_names[a]) for a in axes)
    return ranks, (f"a gradient {tuple(t.shape)} before its wrapper sums it over {names} "
                   "(p.grad before opt.step(), or inside no_sync())")


def _reduces(plan, t) -> bool:
    """True if a step of the plan reduces on the simulator: its result is new memory, and
    so is everything after it (the result cannot share t's memory: no check needed)."""
    if storage.holds_own(t.mesh):
        return False
    for s in plan.steps:
        if s.kind in _REDUCING:
            return True
    return False


def _shares_memory(a, b) -> bool:
    # a ZeroTensor (torch's gradient of sgn on real inputs, at::_efficientzerotensor) has
    # no memory to share, and torch refuses to give its data pointer
    def ptrs(t):
        return {x.untyped_storage().data_ptr() for x in storage.tensors(t._local)
                if not x._is_zerotensor()}
    return bool(ptrs(a) & ptrs(b))


_PLANS: dict = {}    # (t.spec, placements as given, profile name) -> plan on t's own mesh


def _plan_key(t, placements, profile):
    """What plan_reshard's plan on t's own mesh depends on (it plans by the profile's
    name), or None where a key would cost more than planning (a Profile object; a key
    holding unhashable placements fails in the lookup: the caller plans uncached)."""
    if type(placements) is list or type(placements) is tuple:
        placements = tuple(placements)
    elif not isinstance(placements, str):
        return None
    if profile is None:
        tr = current_trace()
        profile = tr.profile.name if tr is not None else DEFAULT_PROFILE
    elif not isinstance(profile, str):
        return None
    return (t.spec, placements, profile)


def execute(plan: Plan, t):
    """Run a plan's steps on ``t`` and return the new DistTensor."""
    if not isinstance(plan, Plan) or not isinstance(t, DistTensor):
        raise TypeError(f"execute(plan={type(plan).__name__}, t={type(t).__name__}): expected "
                        "a Plan from plan_reshard and the DistTensor it was made for")
    if tuple(t.placements) != plan.src or t.mesh != plan.src_mesh or tuple(t.shape) != plan.shape:
        raise ValueError("execute(plan, t): the plan was made for another tensor layout "
                         f"({fmt_placements(plan.src)} of {plan.shape}); plan again")
    return _run(plan, t)


def _run(plan: Plan, t):
    """execute's steps, for a plan known to be made for t's layout."""
    _agree_unsummed(t, plan)
    steps = plan.steps
    k = 0
    while k < len(steps):
        s = steps[k]
        k += 1
        if s.kind == "send_recv":
            t = _send(t, plan.dst_mesh, s.dst)
        elif s.kind == "local_relabel":
            t = DistTensor(t._local, t.mesh, s.dst, t.shape, t.dtype, t.names)
        elif s.kind == "reduce_scatter" and k < len(steps) and _gathers_back(s, steps[k]) \
                and (y := _all_reduce_in_two(t, s, steps[k])) is not None:
            t, k = y, k + 1
        elif s.kind == "local_pad" and k < len(steps) and _pads_for(s, steps[k]):
            y = _padded_all_reduce(t, s, steps[k])
            if y is None:
                t = _local_step(t, s.mesh_dim, s.dst)
            else:
                t, k = y, k + 1
        else:
            # a run of collective and local steps passes the local data from one to the
            # next; one DistTensor at its end
            loc, ps = t._local, t.placements
            while True:
                if s.kind in _LOCAL:
                    loc = _local_loc(loc, t, ps, s.mesh_dim, s.dst)
                else:
                    loc = _collective_loc(loc, t, ps, s)
                ps = s.dst
                if k == len(steps) or steps[k].kind in ("send_recv", "local_relabel",
                                                        "local_pad"):
                    break
                s = steps[k]
                k += 1
            t = DistTensor(loc, t.mesh, ps, t.shape, t.dtype, t.names)
    return t


def _pads_for(pad: Step, nxt: Step) -> bool:
    """A zero-pad S(d) -> P(sum) that the next step all-reduces on the same mesh dim:
    together an all-gather of the shards (the planner may choose the pair where the
    profile prices the all-reduce below the all-gather)."""
    i = pad.mesh_dim
    return nxt.kind == "all_reduce" and nxt.mesh_dim == i and nxt.src == pad.dst


def _padded_all_reduce(t, pad: Step, ar: Step):
    """Both steps at once on stacked shards (the same values and the same trace event as
    running them one after the other, without the padded buffer, n times the data);
    None where they must run one by one (uneven shards, torch.distributed)."""
    if storage.holds_own(t.mesh):
        return None
    x = storage.for_layout(t._local, t.shape, t.mesh, t.placements, pad.dst, ar.dst)
    if storage.is_cells(x):
        return None
    i = pad.mesh_dim
    label = (f"{ar.src[i]}->{ar.dst[i]} on {t.mesh.dim_names[i]}"
             if current_trace() is not None else "")
    y = C.padded_all_reduce(x, t.mesh, i, pad.src[i].dim, label=label)
    return DistTensor(y, t.mesh, ar.dst, t.shape, t.dtype, t.names)


def _gathers_back(rs: Step, ag: Step) -> bool:
    """A reduce-scatter P -> S(d) that the next step all-gathers back on the same mesh
    dim: together P -> R, an all-reduce done in two (the planner chooses the pair where
    the profile prices it below the all-reduce: NCCL's ring all-reduce is these two
    phases)."""
    i = rs.mesh_dim
    return ag.kind == "all_gather" and ag.mesh_dim == i and ag.src == rs.dst \
        and rs.src[i].is_partial() and ag.dst[i].is_replicate()


class _SumBackward(torch.autograd.Function):
    """``y`` (P -> R of ``x``, computed apart) with the all-reduce's backward: the
    replicated result's gradient is every rank's partial input's gradient (Megatron-LM's
    ``g``, ``_ReduceFromModelParallelRegion``: all-reduce forward, identity backward; the
    simulator's compact sum expands it)."""

    @staticmethod
    def forward(ctx, x, box):
        ctx.shape = x.shape
        ctx.set_materialize_grads(False)
        return box[0]             # a fresh tensor (not a view: in-place writes stay legal)

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None
        return (g if g.shape == ctx.shape else g.expand(ctx.shape)), None


def _all_reduce_in_two(t, rs: Step, ag: Step):
    """P -> R as a reduce-scatter and an all-gather (both recorded as they run), with the
    all-reduce's backward (:class:`_SumBackward`).  Run step by step, the reduce-scatter's
    backward all-gathered the gradient that the all-gather's backward had just split
    from a replicated one: a gradient already whole on every rank, gathered again (toy
    GPT, h 512, s 512, tp 8 on A100s: 12.75 us per row-parallel output; dry run /
    estimate 1.136 -> 1.00; tests/test_plan11.py).  None where it runs step by step
    (no gradient wanted, uneven shards, a replicated result laid out per rank)."""
    loc = t._local
    if not (isinstance(loc, torch.Tensor) and loc.requires_grad and torch.is_grad_enabled()):
        return None
    if not (storage._is_even(t.shape, t.mesh, t.placements)
            and storage._is_even(t.shape, t.mesh, ag.dst)):
        return None
    y = _collective_loc(_collective_loc(loc, t, t.placements, rs), t, rs.dst, ag)
    i = ag.mesh_dim
    want = tuple(loc.shape) if _B.is_distributed(t.mesh) else \
        tuple(1 if k == i else n for k, n in enumerate(loc.shape))
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != want:
        raise RuntimeError(f"reshard: P -> R on mesh dim {i} as a reduce-scatter and an "
                           f"all-gather gave a local of shape {tuple(getattr(y, 'shape', ()))}"
                           f", not {want} (a bug in the collectives' layouts)")
    return DistTensor(_SumBackward.apply(loc, [y.detach()]), t.mesh, ag.dst, t.shape,
                      t.dtype, t.names)


def _collective_step(t, s: Step):
    y = _collective_loc(t._local, t, t.placements, s)
    return DistTensor(y, t.mesh, s.dst, t.shape, t.dtype, t.names)


def _collective_loc(loc, t, ps, s: Step):
    """Step ``s`` on local data ``loc`` laid out as ``ps`` (t: its mesh, shape, dtype)."""
    x = storage.for_layout(loc, t.shape, t.mesh, ps, s.dst)
    i, old, new = s.mesh_dim, s.src[s.mesh_dim], s.dst[s.mesh_dim]
    label = f"{old}->{new} on {t.mesh.dim_names[i]}" if current_trace() is not None else ""
    kw = {}
    if storage.holds_own(t.mesh) and not (storage._is_even(t.shape, t.mesh, ps) and
                                          storage._is_even(t.shape, t.mesh, s.dst)):
        # one process, one shard: the members' lengths for the padded collectives, and
        # the bytes of the layout's largest buffer (what the simulator records)
        kw = dist_uneven.step_kwargs(s.kind, t.shape, t.dtype, t.mesh, ps, s.dst, i,
                                     storage.own_coord(t.mesh))
    if s.kind == "all_gather":
        y = C.all_gather(x, t.mesh, i, old.dim, label=label, **kw)
    elif s.kind == "all_reduce":
        y = C.all_reduce(x, t.mesh, i, old.reduce_op, label=label, **kw)
    elif s.kind == "reduce_scatter":
        y = C.reduce_scatter(x, t.mesh, i, new.dim, old.reduce_op, label=label, **kw)
    elif s.kind == "all_to_all":
        y = C.all_to_all(x, t.mesh, i, new.dim, old.dim, label=label, **kw)
    else:
        raise ValueError(f"unknown step {s.kind!r}")
    return storage.settle(y, t.shape, t.mesh, s.dst)


def _local_step(t, i: int, new_ps):
    """R -> S (slice), R -> P (first rank keeps the value) or S -> P(sum) (zero pad):
    see :func:`workbench.parallel.storage.local_step`."""
    y = _local_loc(t._local, t, t.placements, i, new_ps)
    return DistTensor(y, t.mesh, new_ps, t.shape, t.dtype, t.names)


def _local_loc(loc, t, ps, i: int, new_ps):
    old, new = ps[i], new_ps[i]
    label = f"{old}->{new} on {t.mesh.dim_names[i]}" if current_trace() is not None else ""
    return storage.local_step(loc, t.shape, t.mesh, ps, tuple(new_ps), i, label)


def _send(t, dmesh, dst_ps):
    """Move data from t's mesh to ``dmesh`` (see _plan_cross_mesh)."""
    if t.mesh.shape == dmesh.shape:
        y = C.send_recv(t._local, t.mesh, dmesh, label=f"{t.mesh.ranks} -> {dmesh.ranks}")
        return DistTensor(y, dmesh, dst_ps, t.shape, t.dtype, t.names)
    # t is replicated on its mesh: each target rank gets its shard from one source rank
    glob = storage.rank_view(t._local, t.mesh, t.mesh.ranks[0])
    out = shard_tensor(glob, dmesh, dst_ps, names=t.names)
    tr = current_trace()
    if tr is not None:
        nb = layout.local_numel_max(t.shape, dmesh, dst_ps) * _elem(t.dtype)
        for a, b in _cross_pairs(t.mesh, dmesh):
            if a != b:
                tr.record_collective((a, b), "send_recv",
                                     _cost.price("send_recv", nb, (a, b), tr.profile),
                                     bytes=nb, label=f"{a} -> {b}", args={"src": a, "dst": b})
    return out


@lru_cache(maxsize=16384)
def _plan_cached(shape, dtype, mesh, src, dst, profile) -> Plan:
    prof = get_profile(profile)
    # _plan_same_mesh's search, step for step, faster (reshard_search.py)
    steps = plan_steps(shape, dtype, mesh, src, dst, prof, _price_step, _EXACT)
    if steps is None:
        steps = _plan_same_mesh(shape, dtype, mesh, src, dst, prof)     # raises: no plan
    steps = _labelled(steps, shape, dtype, mesh)
    return Plan(shape, dtype, mesh, src, mesh, dst, tuple(steps), prof.name)


def plan_reshard_cached(spec, placements, profile: str) -> Plan:
    """plan_reshard on the same mesh, memoized (the SPMD chooser prices many candidates)."""
    dst = tuple(placements)
    return _plan_cached(tuple(spec.shape), spec.dtype, spec.mesh, tuple(spec.placements), dst, profile)
