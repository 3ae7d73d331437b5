"""The backward of a reshard, as DTensor's: the gradient redistributed back, once.

PyTorch DTensor (torch 2.13, git cf30153, torch/distributed/tensor/_redistribute.py:1771-1862,
``_redistribute_backward``): ``Redistribute.backward`` takes the gradient in whatever
placements the next ops' backward gave it (summed over them by autograd) and
redistributes it to the input's placements (a Partial target is kept Replicate where the
gradient is sharded or replicated).  An op that read the resharded tensor converted it at
the aten level, below autograd, so that conversion has no backward of its own.  After
``reshard(x, [Replicate()])`` of an ``x`` laid out ``[Shard(1)]``, a linear whose weight
is sharded by rows gives the input a Partial gradient: one reduce-scatter to ``Shard(1)``.

Here every collective records its own conjugate (``sim_mesh.collectives``), and the two
meet on the gathered tensor: the all-gather's output is one compact copy, the dispatcher
gives every rank its own view of it (``expand_replicas``, an all-reduce in backward), and
the all-gather's backward then slices locally.  The same numbers, but a reduce-scatter's
communication recorded as an all-reduce (twice its bytes), once per op reading it.
Likewise an op that slices the gathered copy to another dim (an all-gather in backward,
then the local slice to the source's dim) where DTensor moves one all-to-all.

So :func:`mark` gives a reshard's result that gathered some mesh dim (``S(d) -> R``) a
backward event of its own, whose steps are planned when the gradient passes; where the
dispatcher converts it for an op (:func:`convert`) along a replicated mesh dim (gives
every rank its view, or slices it), the per-collective events along that dim are muted
and the op's use is noted instead: Partial where every rank used its own view, ``S(k)``
where the op sliced it (Replicate, where it used the one copy, needs nothing).  In
backward the event records the reshard planner's plan from those placements back to the
source's ``S(d)`` (and to Replicate on the dims that were replicated already: the
all-reduce of Megatron's ``f``).  The gradients themselves are autograd's, unchanged.

The op's OWN reshard (:func:`gather`): an op whose strategy asks for Replicate from a
sharded input gathers it itself and gives every rank a view.  DTensor runs that
redistribute inside the op's dispatch, below autograd (``_dispatch.py``): the op's backward
gives the input a Partial gradient, autograd sums the uses' gradients, and one
redistribution takes the sum to the input's layout (``P -> S(d)``: a reduce-scatter).  The
same identity node sits on the input itself, once per input, local and layout however many
ops gather it (q, k and v of one sequence-parallel input: one reduce-scatter, not three
all-reduces).  Notebook 16's eager tiny Llama on a 2x2 mesh (a100): 350.88 -> 337.61 us, 55
-> 53 collectives: each MLP norm output's two all-reduces (4.82 us each) become one
reduce-scatter (4.17 us), and the layer-1 q/k/v weights, gathered over tp, are
reduce-scattered over tp then all-reduced over dp at half the bytes (4.17 + 4.68 us, not
2 x 4.82): the order of FSDP2's HSDP (torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py:618-662), where DTensor's mesh-dim order all-reduces first.

On torch.distributed :func:`mark` notes the source instead, with the same way
(:func:`way_key`; :func:`way_of` reads either, the chooser's key), and the ops that give
every rank a view of the gathered copy or slice it along a gathered dim send their
gradients through :mod:`.gather_backward_dist`'s one stand-in of it, merged as
:func:`_merged` merges the uses: the same one redistribution, run on the process groups
(tdway17: before, the chooser priced a slice there as a plain input's and the slice kept
its all-gather in backward).

Not covered (each collective's own event, as before): results held as cells; a gathered tensor reaching an op through other ops first (``y.t()``); a
Partial source: its gradient is all-reduced (the op that made the Partial value computes
its local backward from the whole gradient, design (b) of the DESIGN note; DTensor leaves
it Partial for that op's own backward rule to reduce); an input written in place between
two ops that gather it (two meeting points: one reduce-scatter each).

An op's plan that also moves a mesh dim it does not give every rank a view of (x
``[R, S(0)]`` on dp x tp, sliced over dp to ``S(1)`` then gathered over tp): each reader's
gradient is ``[S(1), P]``; the readers meet in that layout and the one redistribution
takes the sum back to ``[R, S(0)]``, reducing first (reduce-scatter over tp, then
all-gather over dp), the plan's every dim muted.  Recorded before: the slice's own
backward (an all-gather over dp of a tp shard) per reader, then one reduce-scatter over
tp, an order no processes can run (tdreshard4).  A Partial source there, or such a dim
also given per rank, takes the ordinary path.

A REPLICATED input read per rank by several ops (x read by the column-parallel q, k and v,
or gate and up of a SwiGLU) goes through :func:`gather` too: held once along the dims the
ops give every rank a view of, it gets the same identity node, so the readers' Partial
gradients are summed first and all-reduced once (label "grad of a replicated input"), as
DTensor's ``P + P -> P`` then one redistribution, and as Megatron-LM's one fused QKV / fc1
behind one ``copy_to_tensor_model_parallel_region``; before, one all-reduce per reader.
(The tensor-parallel styles' own ``f``, ``tensor_parallel.py``, is unchanged.)  The
compiled program (``workbench.compile``) marks its reshards as ``wb.reshard`` does and
prices these reductions once per input copy (``compile/grad_ways.py``).

The chooser prices a marked input by its way (slice15): :func:`way_key` is what
:func:`mark` records and what the dispatcher hands the decision (``dispatch._grads``);
``ops_table/strategy.backward_price`` prices an op's slice of the gathered copy as the
plan :func:`way_use`'s gradient takes back to the source (one all-to-all, or nothing back
to the source's dim; DTensor's), where it priced the slice's own all-gather and the
chooser gathered the other operand instead (tests/test_reshardbwd.py).  A compiled
program's ``t.redistribute`` (a pinned ``kept_copy``) gets the same key at O0
(``compile/propagate.pinned_way``), its copy is marked when the program runs, and its
consumers' input reshards note their use on the way (:func:`execute_marked`): eager and
O0 the same strategy and collectives (tests/test_slice15.py).

Two more (eager13, ``benchmarks/eager_comm_probe.py``): an uneven source held as cells
(6 rows over 4 ranks) that its readers gather takes the same one node (over all its cells)
and one reduce-scatter, where each reader all-reduced; and a mesh dim the op's plan takes
R -> P(sum) (a row-parallel linear's replicated bias, its first rank keeping the value)
gives the readers' gradient Replicate there, not Partial: no all-reduce of the bias's
gradient over tp, as O0 and DTensor.
"""
from __future__ import annotations

import weakref

import torch

from ..sim_mesh import backends as _B
from ..sim_mesh import collectives as C
from ..sim_mesh.trace import current_trace
from . import storage
from .dist_tensor import DistTensor
from .placement import Partial, Replicate
from .spec import TensorSpec

__all__ = ["mark", "marked", "way_of", "convert", "gather", "KEY", "way_key", "way_use",
           "way_noted", "per_rank_dims", "execute_marked"]

KEY = "_wb_reshard_bwd"       # on the marked local tensor: its _Way


class _Way:
    """A reshard result's way back: the layout it has, the one its gradient goes back
    to, and the placements the ops reading it give the gradient (``uses``)."""
    __slots__ = ("mesh", "shape", "dtype", "dst", "back", "axes", "uses", "label")

    def __init__(self, mesh, shape, dtype, dst, back, axes, label="reshard backward"):
        self.mesh, self.shape, self.dtype = mesh, shape, dtype
        self.dst, self.back, self.axes = dst, back, axes
        self.uses: list = []
        self.label = label

    @property
    def key(self) -> tuple:
        """(dst, back, axes): :func:`way_key`'s, what the chooser prices it by."""
        return self.dst, self.back, self.axes

    @property
    def key_with_uses(self) -> tuple:
        """:attr:`key`, and where earlier readers noted their gradient layouts, those
        (``uses``) as a 4th element: the chooser prices a further read as what it adds to
        the one redistribution back (``ops_table/strategy.way_steps``; the dispatcher's
        ``_grads``)."""
        return self.key + (tuple(self.uses),) if self.uses else self.key

    def steps(self):
        """The collectives that bring the gradient back (when it passes)."""
        tr = current_trace()
        if tr is None or not self.uses:
            return []
        from .reshard import plan_reshard_cached, step_records
        out = []
        for grad in _merged(self.uses):
            plan = plan_reshard_cached(TensorSpec(self.shape, self.mesh, grad, self.dtype,
                                                  _trusted=True), self.back, tr.profile.name)
            names = self.mesh.dim_names
            # (uneven pieces: each group's busiest rank, as an executed step's cells)
            out += [(s.kind, self.mesh, s.mesh_dim, s.buffer_bytes,
                     f"{self.label} {s.src[s.mesh_dim]}->{s.dst[s.mesh_dim]} on "
                     f"{names[s.mesh_dim]}", kw) for s in plan.steps if s.bytes
                    for kw in step_records(s, self.shape, self.dtype, self.mesh)]
        return out


def _merged(uses):
    """One gradient layout for all the uses (autograd sums their gradients): per mesh dim
    Partial if any use left it Partial, else the one sharding they agree on; each use's
    own where two uses sharded the same mesh dim differently."""
    out = []
    for i in range(len(uses[0])):
        ps = {u[i] for u in uses if not u[i].is_replicate()}
        if len(ps) > 1 and not any(p.is_partial() for p in ps):
            return uses
        out.append(Partial() if len(ps) > 1 else ps.pop() if ps else Replicate())
    return [tuple(out)]


def mark(out: DistTensor, src, source: DistTensor | None = None) -> DistTensor:
    """``out`` (a reshard's result from placements ``src`` on its own mesh, of ``source``)
    with its way back, where it gathered some mesh dim and a gradient will pass
    (simulated, stacked; on torch.distributed :func:`.gather_backward_dist.mark` notes
    the source, so that the ops reading it per rank send their gradient the same way)."""
    loc = out._local
    if _B.is_distributed(out.mesh):
        from . import gather_backward_dist
        return gather_backward_dist.mark(out, source, src)
    if type(loc) is not torch.Tensor or not loc.requires_grad or not torch.is_grad_enabled():
        return out
    key = way_key(src, tuple(out.placements),
                  tuple(i for i in range(out.mesh.ndim) if loc.shape[i] == 1))
    if key is None:
        return out
    dst, back, axes = key
    way = _Way(out.mesh, tuple(out.shape), out.dtype, dst, back, axes)
    y = C.on_backward_steps(loc, way.steps)
    y.__dict__[KEY] = way
    out._local = y
    return out


def way_key(src, dst, once) -> tuple | None:
    """``(dst, back, axes)``: the way back :func:`mark` records for a reshard from
    placements ``src`` (the plan's) to ``dst`` whose result is held once along mesh dims
    ``once``, or None where it records none (no mesh dim gathered, ``S(d) -> R``).
    ``axes``: the replicated dims held once; ``back``: the layout the gradient goes back
    to (the source's shard on the gathered dims, ``dst`` elsewhere: replicated, or
    all-reduced from Partial, stays replicated).  The one rule of eager's mark and of the
    chooser's price of it (``ops_table/strategy.backward_price``; ``wb.compile``'s O0 for
    a program's ``t.redistribute``, ``compile/propagate.greedy``)."""
    src, dst = tuple(src), tuple(dst)
    if not any(a.is_shard() and b.is_replicate() for a, b in zip(src, dst)):
        return None
    axes = tuple(i for i, b in enumerate(dst) if b.is_replicate() and i in once)
    back = tuple(a if i in axes and a.is_shard() else b
                 for i, (a, b) in enumerate(zip(src, dst)))
    return dst, back, axes


def way_use(dst, axes, final, expand) -> tuple:
    """``(grad, moved)``: the gradient layout an op gives a marked input (way ``dst``,
    ``axes``) that it reads laid out ``final`` (its plan's target, or ``dst``), expanded
    per rank along ``expand``, and the marked dims whose collectives' own backward is
    muted for it (:func:`convert`; () where the op uses the one copy: the ordinary path)."""
    grad, moved = list(dst), []
    for i in axes:
        p = final[i]
        if p.is_shard():
            grad[i] = p                            # the op sliced it: its gradient S(k)
        elif p.is_replicate() and i in expand:
            grad[i] = Partial()                    # every rank its own view: partial sums
        else:
            continue       # one copy used (or R -> P, whose other ranks hold zeros): R
        moved.append(i)
    return tuple(grad), tuple(moved)


def per_rank_dims(strategy, ndim: int) -> tuple:
    """Per input of an op's ``strategy`` (None where the input has no layout), the mesh
    dims the op gives every rank a view of it (``expand``): those its outputs diverge
    along (some output not Replicate) where the input is required Replicate.  The one rule
    of the dispatcher's run (``dispatch._prepare``) and of ``wb.compile``'s note of a
    reader on a marked copy (:func:`way_noted`, ``compile/propagate.greedy``)."""
    diverge = [i for i in range(ndim)
               if any(not ps[i].is_replicate() for ps in strategy.outputs)]
    return tuple(() if req is None else tuple(i for i in diverge if req[i].is_replicate())
                 for req in strategy.inputs)


def way_noted(way, placements, plan, expand=()) -> tuple:
    """``way`` (:func:`way_key`'s, or with its ``uses``) after a reader laid out
    ``placements`` read it by ``plan`` (None or a reshard plan), expanded per rank along
    ``expand`` (:func:`per_rank_dims`), and noted its gradient's layout, as
    :func:`_note_use` notes it on the run's way: the 4-tuple the chooser prices a further
    reader by (``ops_table/strategy.way_steps``); ``way`` itself where the read notes
    nothing (not laid out as marked, or the one copy used).  (Noted without ``expand``,
    O0 missed a per-rank reader's Partial gradient that eager notes, and priced a later
    slice of the copy as an all-to-all back where eager prices it 0, as merged into the
    Partial's one reduce-scatter: O0 gathered the other operand instead, tdway17.)"""
    dst, _back, axes = way[:3]
    uses = tuple(way[3]) if len(way) > 3 else ()
    if tuple(placements) != dst:
        return way
    final = plan.dst if plan is not None and plan.steps else dst
    grad, moved = way_use(dst, axes, final, expand)
    if not moved or grad in uses:
        return way
    return tuple(way[:3]) + (uses + (grad,),)


def way_of(t: DistTensor):
    """``t``'s way back (a :class:`_Way`) where it is a reshard's result that :func:`mark`
    gave one, simulated or on torch.distributed (:func:`.gather_backward_dist.mark`, by
    the same :func:`way_key`), and it is still laid out as marked; else None.  What the
    dispatcher's chooser prices its readers by (``dispatch._grads``: the way's
    ``key_with_uses``), on either backend: the torch.distributed mark was priced as a plain
    input before (tdway17), so a slice of it cost an all-gather in backward there and the
    chooser gathered the other operand where the simulator slices."""
    loc = t._local
    d = getattr(loc, "__dict__", None)
    if not d or type(loc) is not torch.Tensor:
        return None
    way = d.get(KEY)
    if way is None:
        from .gather_backward_dist import KEY as DIST_KEY
        hit = d.get(DIST_KEY)
        # (its source written in place or rebound since: its readers take the ordinary
        # path, gather_backward_dist.use_marked, and are priced so)
        way = hit[4] if hit is not None and hit[0]._local is hit[1] and \
            hit[1]._version == hit[2] else None
    return way if way is not None and way.shape == tuple(t.shape) else None


def marked(t: DistTensor) -> bool:
    """True if ``t`` is a reshard's result that :func:`mark` gave a way back (simulated
    or on torch.distributed)."""
    from .gather_backward_dist import KEY as DIST_KEY
    d = getattr(t._local, "__dict__", ())
    return KEY in d or DIST_KEY in d


def convert(t: DistTensor, plan, expand, mesh, even: bool, label: str):
    """The local an op runs on, for input ``t`` (marked by :func:`mark`) that the op's
    strategy converts by ``plan`` (None or a reshard plan) then expands along mesh dims
    ``expand``, its gradient's way back noted on ``t``'s mark.  None where the op uses the
    one copy on every marked dim, or ``t`` is not laid out as marked any more (the caller
    runs the ordinary path)."""
    moved = _note_use(t, plan, expand)
    if moved is None:
        return None
    with C.mute_backward(mesh, moved):
        return local_for_op(t, plan, mesh, even, expand, label)


def _note_use(t, plan, expand):
    """The marked dims an op reading ``t`` (marked) by ``plan`` then ``expand`` takes
    over, its gradient layout noted on the way; None where the ordinary path runs
    (:func:`convert`)."""
    way = t._local.__dict__[KEY]
    if tuple(t.placements) != way.dst or tuple(t.shape) != way.shape or \
            not (way.mesh is t.mesh or way.mesh == t.mesh) or not torch.is_grad_enabled():
        return None
    final = plan.dst if plan is not None and plan.steps else way.dst
    grad, moved = way_use(way.dst, way.axes, final, expand)
    if not moved:
        return None
    if grad not in way.uses:
        way.uses.append(grad)
    return moved


def execute_marked(plan, t: DistTensor) -> DistTensor:
    """``reshard.execute(plan, t)`` for a consumer of ``t``, a marked reshard result
    (compiled lowering's input reshard, ``compile/lower.execute_program``): as
    :func:`convert` does it for the dispatcher, a slice along a gathered dim has no
    backward of its own and the gradient's layout is noted on the way (one
    redistribution back to the source: an all-to-all, or nothing back to the source's
    dim, where the slice's own backward all-gathered it)."""
    from .reshard import execute
    d = getattr(t._local, "__dict__", ())
    if plan is not None and plan.steps and _B.is_distributed(t.mesh):
        # on torch.distributed: the slice on the stand-in of the mark's source, as the
        # dispatcher's reader (gather_backward_dist.use_marked; before, tdway17, the
        # slice's own backward: an all-gather where the simulator sends the all-to-all)
        from . import gather_backward_dist, layout
        if gather_backward_dist.KEY in d:
            loc = gather_backward_dist.use_marked(
                t, plan, (), t.mesh, layout.is_even(t.shape, t.mesh, plan.src) and
                layout.is_even(t.shape, t.mesh, plan.dst), "reshard")
            if loc is not None:
                return DistTensor(loc, t.mesh, tuple(plan.dst), t.shape, t.dtype, t.names)
    moved = _note_use(t, plan, ()) if KEY in d else None
    if moved is None:
        return execute(plan, t)
    with C.mute_backward(t.mesh, moved):
        return execute(plan, t)


def local_for_op(t, plan, mesh, even, expand, label):
    """The local tensor an op runs on: ``t`` resharded by ``plan`` (None or no steps: as
    it is), laid out for the run (uneven shards: ``storage.for_run``), and expanded to one
    copy per rank over the replicated mesh dims ``expand`` (``collectives.expand_replicas``,
    whose backward sums the copies' gradients)."""
    if plan is not None and plan.steps:
        from .reshard import execute          # (reshard imports this module)
        t = execute(plan, t)
    out = t._local
    if not even or type(out) is not torch.Tensor:
        out = storage.for_run(out, mesh, even)
    if expand:
        out = C.expand_replicas(out, mesh, expand, label=label)
    return out


# ---- the op's own gather (module docstring) -------------------------------------------

_GATHERED: dict = {}        # id(DistTensor) -> (weakref, {(axes, placements): entry})


def _entries(t) -> dict:
    key = id(t)
    hit = _GATHERED.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]

    def gone(ref, key=key):
        if _GATHERED.get(key, (None,))[0] is ref:
            del _GATHERED[key]
    out: dict = {}
    _GATHERED[key] = (weakref.ref(t, gone), out)
    return out


def _source(t, axes, back, label, grad=None):
    """``t``'s local through its way's identity node: the one made for ``t``'s present
    local and layout and the readers' gradient layout ``grad`` (default: ``back`` with
    Partial on ``axes``) if there is one (every op reading it per rank meets there), else
    a new one."""
    loc = t._local
    ways = _entries(t)
    if grad is None:
        grad = tuple(Partial() if i in axes else p for i, p in enumerate(back))
    key = (axes, tuple(t.placements), grad)
    hit = ways.get(key)
    version = _version(loc)
    if hit is not None and hit[0] is loc and hit[1] == version and \
            hit[3].shape == tuple(t.shape) and hit[3].mesh is t.mesh:
        return hit[2], hit[3]
    way = _Way(t.mesh, tuple(t.shape), t.dtype, tuple(t.placements), back, axes,
               label=label)
    # every reader's gradient: Partial along the dims it is given per rank (the key's)
    way.uses.append(grad)
    y = C.on_backward_steps(loc, way.steps)
    ways[key] = (loc, version, y, way)
    return y, way


def _version(loc):
    """The local's in-place version (each cell's, for uneven shards)."""
    if type(loc) is torch.Tensor:
        return loc._version
    return tuple(x._version for x in loc.items)


def _lead(loc, nd: int) -> tuple:
    return tuple(loc.shape[:nd]) if type(loc) is torch.Tensor else tuple(loc.lead)


def gather(t: DistTensor, plan, expand, mesh, even: bool, label: str, memo=None):
    """The local an op runs on, for input ``t`` that the op gives every rank a view of
    along mesh dims ``expand``, after its own reshard ``plan`` (None or no steps: as it
    is): where ``t`` is one copy along some of them (gathered by the plan, ``S(d) -> R``,
    or replicated and held once), the gradient's way back from the ranks' partial sums
    to ``t``'s layout is recorded once per input, as DTensor's (module docstring), not an
    all-reduce per op reading it (and a local slice).  None where that is not the case
    (the caller runs the ordinary path): no such dim, no gradient, uneven shards or
    cells, a torch.distributed mesh."""
    loc = t._local
    # (an uneven source, held as cells, whose plan gives the op even shards: the op's own
    # gather of a sequence shard of 1 row over 2 ranks, eager13; before, each reader's
    # all-reduce and the all-gather's local slice, as the module docstring tells)
    if type(loc) is not torch.Tensor and not storage.is_cells(loc) or not even or \
            not storage.requires_grad(loc) or not torch.is_grad_enabled() or \
            _B.is_distributed(mesh) or not (t.mesh is mesh or t.mesh == mesh):
        return None
    # ``memo`` (the dispatcher's, one per prepared op and input: plan, expand and t's
    # layout fixed) keeps the facts below per lead shape of the local (compact or not)
    lead = _lead(loc, mesh.ndim)
    facts = memo.get(lead) if memo is not None else None
    if facts is None:
        facts = _gather_facts(plan, expand, tuple(t.placements), lead)
        if memo is not None:
            memo[lead] = facts
    if facts is False:
        return None
    src, axes, other, grad, way_label, muted = facts
    y, _ = _source(t, axes, src, way_label, grad)
    with C.mute_backward(mesh, muted):
        out = y
        if other is not None:                        # the plan's steps
            from .reshard import execute
            out = execute(plan, DistTensor(y, t.mesh, t.placements, t.shape, t.dtype,
                                           t.names))._local
        if type(out) is not torch.Tensor and storage.is_cells(out):
            out = storage.for_run(out, mesh, even)      # (as local_for_op: stacked)
        if type(out) is not torch.Tensor:
            bad = True
        else:
            shape = out.shape
            bad = False
            for i in axes:
                if shape[i] != 1:
                    bad = True
        if bad:
            raise AssertionError(f"{label}: the gathered copy is not one compact copy "
                                 "along the dims it is given per rank")
        return C.expand_replicas(out, mesh, expand, label=label)


def _gather_facts(plan, expand, placements, shape):
    """What :func:`gather` does for an input laid out ``placements`` whose local has
    ``shape``, given the op's ``plan`` and ``expand``: (source placements, the dims the
    gradient comes back along, the other dims the plan moves (None: no steps), the
    readers' gradient layout, the way's label, the dims muted meanwhile), or False where
    the ordinary path runs."""
    steps = plan is not None and bool(plan.steps)
    src = plan.src if steps else placements
    # the dims the gradient comes back along as partial sums: gathered ones, and
    # replicated ones held once (expand_replicas skips a dim already one copy per rank:
    # its gradient's sum is recorded where that copy was made); a Partial source keeps
    # its own all-reduce (see the module docstring)
    axes = tuple(i for i in expand if src[i].is_shard() or
                 (src[i].is_replicate() and shape[i] == 1))
    if not axes:
        return False
    gathered = any(src[i].is_shard() for i in axes)
    # a plan that also moves other mesh dims (local_slice(dp) then all_gather(tp)): each
    # reader's gradient leaves it in the plan's layout there (S(k) on dp, Partial on tp);
    # their collectives' own backward (an all-gather over dp of a tp shard, per reader)
    # would need the one reduction over tp first, which cannot run.  So the readers'
    # gradients meet in the plan's layout and the one redistribution brings the sum back
    # along every dim the plan moved, reducing first (the tp reduce-scatter, then the dp
    # all-gather), as DTensor (redistributes the readers' summed gradient once, below
    # autograd: module docstring).  A Partial source, or such a dim also given per rank,
    # keeps each collective's own backward there (the ordinary path).
    other = sorted({s.mesh_dim for s in plan.steps} - set(axes)) if steps else []
    if any(src[i].is_partial() or i in expand for i in other):
        return False
    # (a dim the plan takes R -> P(sum), the first rank keeping the value: a row-parallel
    # linear's replicated bias.  Its backward keeps the first rank's gradient, which is
    # the whole gradient: Replicate, as DTensor's redistribute backward keeps a Partial
    # target's gradient Replicate (module docstring) and as convert() notes it; recorded
    # as Partial it cost an all-reduce of the bias's gradient over that dim, eager13)
    grad = tuple(Partial() if i in axes else
                 Replicate() if i in other and p.is_replicate() and plan.dst[i].is_partial()
                 and plan.dst[i].reduce_op == "sum" else
                 plan.dst[i] if i in other else p
                 for i, p in enumerate(src))
    return (src, axes, tuple(other) if steps else None, grad,
            "grad of a gathered input" if gathered else "grad of a replicated input",
            tuple(axes) + tuple(other))
