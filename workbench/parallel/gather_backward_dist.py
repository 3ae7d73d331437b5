"""The op's own gather on torch.distributed: the gradient's way back once, as DTensor's.

An op whose strategy asks for Replicate from a sharded input gathers it and gives every
rank its own view.  PyTorch DTensor runs that redistribute inside the op's dispatch,
below autograd (torch 2.13, git cf30153, torch/distributed/tensor/_dispatch.py; the
gradient's way back: _redistribute.py:1771-1862 ``Redistribute.backward``): every use's
backward gives the input a Partial gradient, autograd sums the uses, and one
redistribution takes the sum to the input's layout (``P -> S(d)``: one reduce-scatter).
The simulator records that program (:func:`.reshard_backward.gather`).  On
torch.distributed each use's gather had its own backward instead: an all-reduce of the
gathered gradient (``expand_replicas``, Megatron's ``f``) then the local slice, once per
op (q, k and v of one input: three all-reduces of the whole, for one reduce-scatter).

Here the input's local meets a stand-in for its gathered copy (:class:`_Meet`, one per
input and layout, as the simulator's identity node): each use's gathered copy carries its
gradient to the stand-in (:class:`_Use`), autograd sums them, and the stand-in's backward
runs the reshard planner's plan from the summed Partial gradient back to the input's
layout, on the process groups, recording the steps the simulator records.  The forward
gathers are each op's, as before.

A REPLICATED input held once along dims the op gives every rank a view of (x read by the
column-parallel q, k and v; not tagged ``_wb_replica_axes`` there, the simulator's
``loc.shape[i] == 1``) meets the same stand-in, with no plan or alongside a gathered dim:
the readers' Partial gradients summed, then one ``P -> R`` all-reduce per dim (label
"grad of a replicated input"), as the simulator's; before, one all-reduce per reader.

Covered where the simulator covers it (even shards, a stacked local that takes part in
autograd) and the op's plan is none, or all-gathers along the dims it then gives every
rank a view of, and may also move other mesh dims that are not Partial nor given per rank
(local_slice(dp) then all_gather(tp)): the uses' gradients meet in the plan's layout
there and the stand-in's one redistribution reduces first, as the simulator's.  Other
plans keep each collective's own backward (the ordinary path, as on the simulator).
"""
from __future__ import annotations

import weakref

import torch

from ..sim_mesh import backends as _B
from ..sim_mesh import collectives as C
from ..sim_mesh.profiles import DEFAULT_PROFILE
from ..sim_mesh.trace import current_trace, suspend
from . import layout
from . import reshard_backward as _rb
from .dist_tensor import DistTensor
from .placement import Partial, Replicate
from .spec import TensorSpec

__all__ = ["gather", "mark", "use_marked", "KEY"]

KEY = "_wb_reshard_src"   # on a wb.reshard result's gathered local: (source, its local, version, src)

LABEL = "grad of a gathered input"     # the simulator's labels (reshard_backward.gather)
LABEL_REPLICATED = "grad of a replicated input"
LABEL_RESHARD = "reshard backward"     # reshard_backward.mark's


class _Way:
    """One input's way back: its layout, the Partial layout of the summed gradient, and
    the label its steps are recorded under (the simulator's)."""
    __slots__ = ("mesh", "shape", "dtype", "back", "grad", "label")

    def __init__(self, mesh, shape, dtype, back, grad, label=LABEL):
        self.mesh, self.shape, self.dtype, self.back, self.grad = mesh, shape, dtype, back, grad
        self.label = label


class _Meet(torch.autograd.Function):
    """The input's local -> a stand-in of its gathered copy's shape (zeros, stride 0, no
    memory).  Backward: the uses' summed gradient redistributed to the input's layout."""

    @staticmethod
    def forward(ctx, x, way, gathered_shape):
        ctx.way = way
        return x.new_zeros(()).expand(gathered_shape)

    @staticmethod
    def backward(ctx, g):
        # a split backward's W walking B's graph again (sim_mesh.backward_pass): the same
        # values again (W's weights upstream need them), recorded once per micro-batch,
        # by the shared rule the simulator's node follows (grad_record._BackwardSteps:
        # recorded_by_b / mark_recorded); was recorded by both B and W, two
        # reduce-scatters per micro-batch where the whole backward has one.  A node that
        # only W runs (a weight's, met by every micro-batch) records in each W.
        from ..sim_mesh.backward_pass import mark_recorded, recorded_by_b
        again = recorded_by_b(ctx)
        if not again:
            mark_recorded(ctx)
        return _redistribute(ctx.way, g, record=not again), None, None


class _Use(torch.autograd.Function):
    """One op's gathered copy (computed without autograd) on the stand-in: its gradient
    goes to the stand-in as it is (a Partial sum: each rank used its own view)."""

    @staticmethod
    def forward(ctx, stand_in, gathered):
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _redistribute(way, g, record=True):
    from .reshard import execute, plan_reshard_cached, step_records  # (imports dispatch)
    tr = current_trace()
    plan = plan_reshard_cached(TensorSpec(way.shape, way.mesh, way.grad, way.dtype,
                                          _trusted=True), way.back,
                               tr.profile.name if tr is not None else DEFAULT_PROFILE)
    if tr is not None and record:          # the steps, as the simulator labels them
        names = way.mesh.dim_names
        for s in plan.steps:
            if s.bytes:
                d = s.mesh_dim
                # this process's group (uneven: its busiest rank's bytes, the simulator's)
                for kw in step_records(s, way.shape, way.dtype, way.mesh,
                                       [_B.group(way.mesh, d)[1]]):
                    C.record_collective(s.kind, way.mesh, d, s.buffer_bytes,
                                        f"{way.label} {s.src[d]}->{s.dst[d]} on {names[d]}",
                                        **kw)
    with suspend(), torch.no_grad():       # recorded above, once
        t = DistTensor(g.contiguous(), way.mesh, way.grad, way.shape, way.dtype)
        return execute(plan, t)._local


_STAND_INS: dict = {}       # id(DistTensor) -> (weakref, {(axes, placements): entry})


def _stand_in(t, axes, gathered_shape, label=LABEL, grad=None):
    """``t``'s stand-in for its gathered copy along ``axes`` (its uses' gradient laid out
    ``grad``; default: ``t``'s layout, Partial on ``axes``): the one made for its present
    local and layout if there is one (every op gathering it meets there), else a new one."""
    if grad is None:
        grad = tuple(Partial() if i in axes else p for i, p in enumerate(t.placements))
    key = id(t)
    hit = _STAND_INS.get(key)
    if hit is None or hit[0]() is not t:
        def gone(ref, key=key):
            if _STAND_INS.get(key, (None,))[0] is ref:
                del _STAND_INS[key]
        hit = _STAND_INS[key] = (weakref.ref(t, gone), {})
    ways = hit[1]
    loc = t._local
    k = (axes, tuple(t.placements), grad, label)
    got = ways.get(k)
    if got is not None and got[0] is loc and got[1] == loc._version and \
            tuple(got[2].shape) == tuple(gathered_shape):
        return got[2]
    way = _Way(t.mesh, tuple(t.shape), t.dtype, tuple(t.placements), grad, label)
    y = _Meet.apply(loc, way, tuple(gathered_shape))
    ways[k] = (loc, loc._version, y)
    return y


def gather(t: DistTensor, plan, expand, mesh, even: bool, label: str):
    """The local an op runs on, for input ``t`` (torch.distributed) that the op gives
    every rank a view of along mesh dims ``expand``, after its own reshard ``plan`` (None
    or no steps: as it is): where ``t`` is one copy along some of them (gathered by the
    plan, ``S(d) -> R``, or replicated and held once), the gradient's way back from the
    ranks' partial sums is recorded and run once for all such uses (module docstring), as
    the simulator's :func:`.reshard_backward.gather`.  None where that is not the case
    (the caller runs the ordinary path)."""
    from .reshard import execute
    loc = t._local
    # (an uneven source: this process's shard, gathered by the padded collectives, its
    # summed gradient reduce-scattered back to its length, as the simulator's cells, eager13)
    if type(loc) is not torch.Tensor or not even or not loc.requires_grad or \
            not torch.is_grad_enabled() or not _B.is_distributed(mesh) or \
            not (t.mesh is mesh or t.mesh == mesh):
        return None
    steps = plan is not None and bool(plan.steps)
    src = plan.src if steps else tuple(t.placements)
    had = tuple(getattr(loc, "_wb_replica_axes", ()))
    # the dims the gradient comes back along as partial sums: gathered ones, and
    # replicated ones held once (a dim already one copy per rank, tagged, had its sum
    # recorded where that copy was made: the simulator's ``loc.shape[i] == 1``)
    axes = tuple(i for i in expand if src[i].is_shard() or
                 (src[i].is_replicate() and i not in had))
    if not axes:
        return None
    # a plan that also moves other mesh dims (local_slice(dp) then all_gather(tp)): the
    # uses' gradients meet in the plan's layout there and the one redistribution takes
    # their sum back, reducing first, as the simulator's (reshard_backward.gather); a
    # Partial source or such a dim also given per rank: the ordinary path, as there
    other = sorted({s.mesh_dim for s in plan.steps} - set(axes)) if steps else []
    if any(src[i].is_partial() or i in expand for i in other) or \
            any(s.kind != "all_gather" for s in plan.steps if s.mesh_dim in axes):
        return None          # (a step outside them keeps its own backward: ordinary path)
    # (a dim the plan takes R -> P(sum), a row-parallel linear's replicated bias: every
    # process's gradient of its copy is the whole gradient (KeepOnFirst's backward, the
    # identity), so Replicate there, as the simulator's (reshard_backward._gather_facts).
    # Recorded and run as Partial, the bias's gradient was all-reduced over tp: tp times
    # one device's on a dp x tp mesh, 5.06 off in tests/test_eager13.py's MLP, eager13)
    grad = tuple(Partial() if i in axes else
                 Replicate() if i in other and p.is_replicate() and plan.dst[i].is_partial()
                 and plan.dst[i].reduce_op == "sum" else
                 plan.dst[i] if i in other else p
                 for i, p in enumerate(src))
    if steps:
        with torch.no_grad():              # each op's forward gather, recorded as before
            gathered = execute(plan, DistTensor(loc.detach(), t.mesh, t.placements,
                                                t.shape, t.dtype, t.names))._local
        want = layout.local_shape(t.shape, mesh, plan.dst, _B.rank())
        if tuple(gathered.shape[mesh.ndim:]) != tuple(want):
            raise AssertionError(f"{label}: the gathered copy has shape "
                                 f"{tuple(gathered.shape)}, not the layout's {tuple(want)}")
    else:
        gathered = loc.detach()            # replicated: the one copy, as it is
    kind = LABEL if any(src[i].is_shard() for i in axes) else LABEL_REPLICATED
    out = _Use.apply(_stand_in(t, axes, gathered.shape, kind, grad), gathered)
    _B.tag(out, had + axes)
    rest = [i for i in expand if i not in axes and i not in had]
    if rest:                               # Partial dims: their own all-reduce, as before
        out = C.expand_replicas(out, mesh, rest, label=label)
    return out


# ---- wb.reshard's own result (reshard_backward.mark, on torch.distributed) ----------------

def mark(out: DistTensor, t: DistTensor, src) -> DistTensor:
    """``out``, ``wb.reshard(t, ...)``'s result from placements ``src`` that gathered some
    mesh dim (``S(d) -> R``), noted with its source, so that the ops giving every rank a
    view of it (:func:`use_marked`) send their gradient the simulator's way
    (:func:`.reshard_backward.mark`): their Partial sums meet on a stand-in of ``t``'s
    gathered copy and one redistribution takes them back (``P -> S(d)``: one
    reduce-scatter, as DTensor's ``Redistribute.backward``).  Before (fixlist14, measured
    on 2 gloo processes: x ``[S(0)]`` resharded to ``[R]`` and read by two matmuls with
    column-sharded weights) each process all-reduced the gathered gradient (96 B) and the
    all-gather's backward sliced it, where the simulator records one reduce-scatter.
    An op's local slice of it along a gathered dim meets there too (:func:`use_marked`),
    and every reader of the mark meets on one stand-in (:class:`_MarkMeet`) whose
    backward merges their gradients as the simulator's way merges its uses (tdway17).
    The mark carries the simulator's way (:func:`.reshard_backward.way_key`), what the
    dispatcher's chooser prices its readers by.  Other uses (the one copy used as it is,
    or resharded further by the op off the gathered dims) keep the ordinary path, the
    all-gather's own backward.  An uneven source is marked too, as the simulator marks
    its cells (uneven18: x (8, 10) S(1) on 4 gloo processes, gathered and read by a
    column-parallel matmul, went back by an all-reduce of 960 B where the simulator
    reduce-scatters, 576 B; sliced to S(0), the chooser gathered the other operand)."""
    loc = out._local
    if type(loc) is not torch.Tensor or not loc.requires_grad or not torch.is_grad_enabled() \
            or not _B.is_distributed(out.mesh) or t is None or t is out or \
            not (t.mesh is out.mesh or t.mesh == out.mesh):
        return out
    tl = t._local
    if type(tl) is not torch.Tensor or not tl.requires_grad or \
            tuple(src) != tuple(t.placements) or \
            not any(a.is_shard() and b.is_replicate() for a, b in zip(src, out.placements)):
        return out
    # its way back by the simulator's rule (reshard_backward.way_key; the dims held once:
    # those not tagged one copy per rank, the simulator's ``loc.shape[i] == 1``), what the
    # dispatcher's chooser prices its readers by (dispatch._grads: reshard_backward.way_of)
    # and where they note their gradients' layouts (``uses``), as the simulator's mark
    had = tuple(getattr(loc, "_wb_replica_axes", ()))
    key = _rb.way_key(src, tuple(out.placements),
                      tuple(i for i in range(out.mesh.ndim) if i not in had))
    way = _rb._Way(out.mesh, tuple(out.shape), out.dtype, *key) if key is not None else None
    loc.__dict__[KEY] = (t, tl, tl._version, tuple(src), way)
    return out


def use_marked(x: DistTensor, plan, expand, mesh, even: bool, label: str):
    """The local an op runs on, for ``x`` (:func:`mark`'s) that it gives every rank a view
    of along ``expand`` with no further reshard, or slices along the dims the reshard
    gathered (``plan``: local slices there only, as ``S(k)`` of the gathered copy): the
    gathered copy (or its slice, taken without autograd) on the stand-in of its source,
    the gradient's way back one redistribution from the readers' gradients, Partial sums
    or ``S(k)`` shards (label "reshard backward", the simulator's
    :func:`.reshard_backward.convert`: an all-to-all back where the slice is to another
    dim than the source's, nothing where it is the source's), the reader's layout noted on
    the way (:func:`.reshard_backward.way_use`, the chooser's price of it).  Before
    (tdway17) a slice kept its own backward here, an all-gather of the gradient, where the
    simulator and DTensor send the all-to-all or nothing.  Uneven pieces too (``even``,
    the op's layouts, is not needed: the padded collectives run the way back; uneven18).
    None where that is not the case (the caller runs the ordinary path)."""
    t, tl, ver, src, way = x._local.__dict__[KEY]
    steps = plan is not None and bool(plan.steps)
    if not torch.is_grad_enabled() or \
            t._local is not tl or tl._version != ver or \
            not (x.mesh is mesh or x.mesh == mesh):
        return None
    dst = tuple(x.placements)
    had = tuple(getattr(x._local, "_wb_replica_axes", ()))
    if steps:
        # a slice of the gathered copy along dims the way holds once, given per rank
        # nowhere: each step a local slice on such a dim (other steps keep their own
        # backward: the ordinary path)
        if way is None or expand or tuple(plan.src) != dst or \
                any(s.kind != "local_slice" or s.mesh_dim not in way.axes
                    for s in plan.steps):
            return None
        grad, moved = _rb.way_use(dst, way.axes, tuple(plan.dst), ())
        if not moved or way.back != tuple(t.placements):
            return None
        from .reshard import execute
        with torch.no_grad():
            piece = execute(plan, DistTensor(x._local.detach(), x.mesh, x.placements,
                                             x.shape, x.dtype, x.names))._local
        if grad not in way.uses:
            way.uses.append(grad)
        out = _mark_use(x, t, tl, way, grad, piece)
        _B.tag(out, had)
        return out
    # the dims held as one copy that the op gives every rank a view of: gathered ones, and
    # replicated ones (their Partial sums all-reduced, as the simulator's way does)
    axes = tuple(i for i in expand if dst[i].is_replicate() and i not in had and
                 not src[i].is_partial())
    if not any(src[i].is_shard() for i in axes):
        return None
    grad = tuple(Partial() if i in axes else p for i, p in enumerate(dst))
    g = None
    if way is not None:                    # noted as the simulator's convert notes it
        g, moved = _rb.way_use(dst, way.axes, dst, expand)
        if moved and g not in way.uses:
            way.uses.append(g)
    if g == grad and way.back == tuple(t.placements):
        out = _mark_use(x, t, tl, way, grad, x._local.detach())
    else:
        out = _Use.apply(_stand_in(t, axes, x._local.shape, LABEL_RESHARD, grad),
                         x._local.detach())
    _B.tag(out, had + axes)
    rest = [i for i in expand if i not in axes and i not in had]
    if rest:                               # Partial dims: their own all-reduce, as before
        out = C.expand_replicas(out, mesh, rest, label=label)
    return out


# ---- the readers of one mark meet once (the simulator's _Way: its uses merged) ------------

MEET = "_wb_reshard_meet"   # on the marked local: (source local, its version, stand-in, state)


class _MarkMeet(torch.autograd.Function):
    """The mark's source local -> a scalar stand-in every reader of the mark meets on.
    Backward (after every reader's, autograd's order): the readers' gradients, kept per
    layout by :class:`_MarkUse`, merged as the simulator's way merges its uses
    (:func:`.reshard_backward._merged`) and redistributed back to the source's layout."""

    @staticmethod
    def forward(ctx, x, way, state):
        ctx.way, ctx.state = way, state
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, g):
        from ..sim_mesh.backward_pass import mark_recorded, recorded_by_b
        again = recorded_by_b(ctx)          # (as _Meet: a split backward's W walks again)
        if not again:
            mark_recorded(ctx)
        buckets, ctx.state["buckets"] = ctx.state["buckets"], {}
        return _mark_back(ctx.way, buckets, record=not again), None, None


class _MarkUse(torch.autograd.Function):
    """One reader's piece of the marked copy (computed without autograd) on the mark's
    stand-in: its gradient (laid out ``grad``: Partial where every rank used its view,
    ``S(k)`` where it sliced) is summed into the mark's bucket for that layout."""

    @staticmethod
    def forward(ctx, stand_in, piece, state, grad):
        ctx.state, ctx.grad = state, grad
        return piece.view_as(piece)

    @staticmethod
    def backward(ctx, g):
        b = ctx.state["buckets"]
        have = b.get(ctx.grad)
        b[ctx.grad] = g.clone() if have is None else have + g
        return g.new_zeros(()), None, None, None


def _mark_use(x, t, tl, way, grad, piece):
    """``piece`` (a reader's local of mark ``x``, its gradient laid out ``grad``) on the
    mark's one stand-in of source ``t`` (made on the first reader)."""
    d = x._local.__dict__
    hit = d.get(MEET)
    if hit is None or hit[0] is not tl or hit[1] != tl._version:
        state = {"buckets": {}}
        hit = d[MEET] = (tl, tl._version, _MarkMeet.apply(tl, way, state), state)
    return _MarkUse.apply(hit[2], piece, hit[3], grad)


def _to_layout(g, way, u, m):
    """Gradient local ``g`` laid out ``u`` as a local laid out ``m`` (``m`` Partial where
    ``u`` shards or replicates a mesh dim, the same elsewhere): its shard placed at its
    offset in zeros (a shard's sum is the Partial's), a replicated one kept on the first
    rank of that dim (its Partial), as the simulator's merged gradient holds them."""
    rank = _B.rank()
    mesh = way.mesh
    coord = mesh.coordinate(rank)
    out = g.new_zeros(layout.local_shape(way.shape, mesh, m, rank))
    if any(a.is_replicate() and b.is_partial() and coord[i] != 0
           for i, (a, b) in enumerate(zip(u, m))):
        return out
    bu = layout.shard_bounds(way.shape, mesh, u, rank)
    bm = layout.shard_bounds(way.shape, mesh, m, rank)
    idx = tuple(slice(su - sm, su - sm + n) for (su, n), (sm, _) in zip(bu, bm))
    out[idx] = g
    return out


def _mark_back(way, buckets, record=True):
    """The gradient of the mark's source: the readers' gradients (``buckets``, per
    layout) merged as the simulator's way (:func:`.reshard_backward._merged` of its noted
    uses) and each merged layout redistributed back to ``way.back``, recorded as there."""
    uses = [u for u in way.uses if u in buckets] + [u for u in buckets if u not in way.uses]
    layouts = _rb._merged(uses)
    total = None
    for m in layouts:
        acc = None
        for u, g in buckets.items():
            if u == m:
                c = g
            elif len(layouts) == 1:            # merged: Partial where they differ
                c = _to_layout(g, way, u, m)
            else:                              # each its own plan, as the simulator's
                continue
            acc = c if acc is None else acc + c
        back = _Way(way.mesh, way.shape, way.dtype, way.back, m, LABEL_RESHARD)
        out = _redistribute(back, acc, record)
        total = out if total is None else total + out
    return total
