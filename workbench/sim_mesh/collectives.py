"""Collectives over the simulated mesh: exact math, modeled cost, traced, differentiable.

Every simulated rank's local tensor lives in one *stacked* tensor with one
leading axis per mesh dimension: ``x[i, j]`` is the local tensor of the rank at
mesh coordinate ``(i, j)``.  An axis of size 1 means "every rank along this mesh
dimension holds the same values" (a replicated copy is not stored; it is a
stride-0 view when needed).  A collective is then one tensor operation over a
leading axis, e.g. all-reduce is ``x.sum(axis, keepdim=True)``, so simulating 64
ranks costs about what the same arithmetic costs on one tensor.

When local shapes differ (uneven shards) the same operations run on
:class:`Cells`: the same leading grid, one tensor per cell.  The math of both forms
lives in :mod:`workbench.sim_mesh.grid`; each collective below is written once: check,
record in the trace, run the form's math, attach the backward communication.  On
torch.distributed the same collectives run on process groups (:func:`_dist`).

Autograd flows through every collective: the math is ordinary differentiable
torch operations, and a tiny identity node records the backward communication
in the trace when the gradient passes (the backward of all-gather is
reduce-scatter, of all-reduce is all-reduce, of all-to-all the reverse
all-to-all).  ``expanded=True`` asks for an output that every rank will use
differently (the backward then reduces); the default keeps replicated results
compact (their gradient is already the full gradient, as in Megatron's ``g``).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from . import backends as _B
from . import cost as _cost
from . import padded as _padded
from . import reduce_scatter_op as _rs
from .backward_pass import in_weight_pass
from . import grad_record as _gr
from .grad_record import mute_backward, on_backward_steps
from .grid import REDUCE_OPS, Cells, CellGrid, Stacked, chunk_bounds, ops_for
from .grid import all_to_all_sent as _a2a_sent
from .grid import gather_sent as _gather_sent
from .profiles import profile_memo as _profile_memo
from .trace import current_trace

__all__ = ["Cells", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "padded_all_reduce",
           "broadcast", "expand_replicas", "send_recv", "record_collective", "nbytes_of",
           "on_backward_steps", "mute_backward",
           "chunk_bounds",
           "REDUCE_OPS", "all_to_all_v", "all_to_all_v_time", "record_all_to_all_v"]


def _bytes_only(fn):
    """Run a collective with autocast off: it moves the ranks' bytes, and its simulated
    math (``torch.cat`` / ``torch.stack`` of the shards) is no autocast op (under
    ``torch.autocast("cpu", dtype=torch.bfloat16)`` torch's ``cat`` refuses float16
    shards: a gather of float16 shards raised; seed 2004533 of the wide random sweep)."""
    import functools

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not _autocast_on():
            return fn(*args, **kwargs)
        with torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)
    return run


_autocast_on = getattr(torch._C, "_is_any_autocast_enabled",
                       lambda: torch.is_autocast_enabled("cpu"))


def nbytes_of(x) -> int:
    """Bytes of one rank's (largest) local tensor (a tensor, or Cells)."""
    return ops_for(x).rank_bytes(x, 0)


def _rank_bytes(x, nd: int) -> int:
    """Bytes of one rank's (largest) local tensor in a grid with ``nd`` leading axes."""
    return ops_for(x).rank_bytes(x, nd)


def record_collective(kind: str, mesh, axis: int | None, nbytes: int, label: str = "",
                      groups=None, overlap: bool = False, sent: int | None = None):
    """Record ``kind`` on every group along mesh ``axis`` in the current trace.

    ``nbytes`` follows the cost model's convention (see :mod:`workbench.sim_mesh.cost`).
    ``sent``: the bytes the busiest rank sends where the ranks send different amounts
    (uneven pieces: an all-to-all's, all-gather's, reduce-scatter's): recorded as the
    event's bytes and priced
    (``cost.sent_buffer``) in place of (p-1)/p of ``nbytes``.
    Returns the handles (empty when no trace is being recorded)."""
    tr = current_trace()
    if tr is None:
        return []
    args = {"mesh_dim": mesh.dim_names[axis] if axis is not None else "",
            "buffer_bytes": int(nbytes)}
    if sent is not None:
        gs = [g for g in (mesh.groups(axis) if groups is None else groups) if len(g) > 1]
        return [tr.record_collective(g, kind, _cost.price(kind, _cost.sent_buffer(
                    kind, sent, len(g)), g, tr.profile), bytes=int(sent), label=label,
                    args=dict(args), overlap=overlap) for g in gs]
    return [tr.record_collective(g, kind, dur, bytes=wire, label=label,
                                 args=dict(args), overlap=overlap)
            for g, dur, wire in _priced_groups(kind, mesh, axis, nbytes, groups, tr.profile)]


_PRICED_MAX = 1 << 14           # collectives remembered per profile; then it starts again


def _priced_groups(kind, mesh, axis, nbytes, groups, profile) -> tuple:
    """(group, seconds, bytes each rank sends) of every group of more than one rank along
    mesh ``axis`` (or of ``groups``): ``cost.price`` and ``cost.wire_bytes``, memoized
    per profile on the mesh's own groups (the trace prices the same collectives every
    step; the types of nbytes and axis in the key, so that a bool still raises)."""
    key = (kind, type(nbytes), nbytes, mesh, type(axis), axis) if groups is None else None
    memo = _profile_memo("collective_groups", profile) if key is not None else None
    try:
        got = memo.get(key) if memo is not None else None
    except TypeError:                   # a mesh-like object that does not hash: not kept
        memo, got = None, None
    if got is not None:
        return got
    got = tuple((g, _cost.price(kind, nbytes, g, profile),
                 _cost.wire_bytes(kind, nbytes, len(g)))
                for g in (mesh.groups(axis) if groups is None else groups)
                if len(g) > 1)          # one rank: nothing moves, nothing to record
    if memo is not None:
        if len(memo) >= _PRICED_MAX:
            memo.clear()
        memo[key] = got
    return got


class _BackwardEvent(torch.autograd.Function):
    """Identity whose backward records a collective (the backward communication)."""

    @staticmethod
    def forward(ctx, info, *xs):
        ctx.info = info
        # no gradient (None) stays None, as through torch's own view: materialized as
        # zeros, a replicated parameter that got no gradient (vector_norm(a @ b, 0))
        # had b.grad zeros where torch leaves it None
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs) if len(xs) > 1 else xs[0].view_as(xs[0])

    @staticmethod
    def backward(ctx, *grads):
        if all(g is None for g in grads):
            return (None,) * (1 + len(grads))    # nothing flows back: no collective runs
        if getattr(ctx, "recorded", False) and in_weight_pass():
            return (None,) + grads       # a split backward's W walking B's graph again
        ctx.recorded = True
        kind, mesh, axis, nbytes, label, groups, sent = ctx.info
        if sent is None:
            record_collective(kind, mesh, axis, nbytes, label, groups=groups)
        else:                            # each group's busiest rank (an uneven all-to-all)
            for g, s in zip(groups, sent):
                record_collective(kind, mesh, axis, nbytes, label, groups=[g], sent=s)
        return (None,) + grads


def _on_backward(x, kind, mesh, axis, nbytes, label, groups=None, sent=None):
    """Attach a backward event to x (a tensor or Cells) if it takes part in autograd.
    ``sent``: where the ranks send different amounts, the busiest rank's bytes of each of
    ``groups`` (:func:`record_collective`'s ``sent``)."""
    if _gr.MUTED and _gr.muted(mesh, axis):
        return x
    if isinstance(x, torch.Tensor):            # the stacked form: one tensor
        if x.requires_grad and torch.is_grad_enabled():
            return _BackwardEvent.apply((kind, mesh, axis, nbytes, label, groups, sent), x)
        return x
    if not torch.is_grad_enabled():
        return x
    F = ops_for(x)
    items = F.tensors(x)
    idx = [i for i, t in enumerate(items) if t.requires_grad]
    if not idx:
        return x
    outs = _BackwardEvent.apply((kind, mesh, axis, nbytes, label, groups, sent),
                                *[items[i] for i in idx])
    outs = outs if isinstance(outs, tuple) else (outs,)
    items = list(items)
    for i, o in zip(idx, outs):
        items[i] = o
    return F.rebuild(x, items)


def _check(x, mesh, axis, what: str):
    """The grid operations for ``x`` and ``axis`` as an index, once both are known good
    (a fast path for the common case; the slow one names what is wrong)."""
    shape = mesh.shape
    nd = len(shape)
    if type(axis) is int and 0 <= axis < nd and isinstance(x, torch.Tensor) \
            and x.dim() >= nd and x.shape[axis] == shape[axis]:
        return Stacked, axis
    if not isinstance(x, (torch.Tensor, Cells)):
        raise TypeError(f"{what}(x={type(x).__name__}): expected the stacked local tensor "
                        "(one leading axis per mesh dim) or Cells")
    axis = mesh.dim(axis)
    F = ops_for(x)
    if len(F.lead(x, nd)) != nd:
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}, but a {nd}-d mesh needs one "
                         f"leading axis per mesh dim {mesh.dim_names} before the local shape")
    if F.lead(x, nd)[axis] != mesh.shape[axis]:
        raise ValueError(f"{what}: the input is the same on every rank along mesh dim "
                         f"{mesh.dim_names[axis]!r} (a replicated copy); nothing to {what}")
    return F, axis


def _dim(x, nd: int, d, what: str, arg: str) -> int:
    """Local tensor dim ``d`` of ``x`` (a stack with ``nd`` leading axes, or Cells) as a
    non-negative index, or an IndexError naming it."""
    local_ndim = x.items[0].dim() if isinstance(x, Cells) else x.dim() - nd
    if type(d) is int and -local_ndim <= d < local_ndim:
        return d if d >= 0 else d + local_ndim
    raise IndexError(f"{what}({arg}={d!r}): the local tensor has {local_ndim} dims; "
                     f"use a dim in [{-local_ndim}, {local_ndim - 1}]")


def _check_op(op):
    if op not in REDUCE_OPS:
        raise ValueError(f"op={op!r}: unknown reduction; use one of {list(REDUCE_OPS)}")


# ---- the collectives ------------------------------------------------------------------

@_bytes_only
def all_reduce(x, mesh, axis: int, op: str = "sum", *, expanded: bool = False, label: str = "",
               nbytes=None):
    """Every rank gets ``op`` over its group's tensors (P -> R).  ``nbytes``
    (torch.distributed): the bytes to record, where the layout's largest shard is not
    this process's (uneven shards; the simulator records the largest)."""
    _check_op(op)
    if _B.is_distributed(mesh):
        y = _dist("all_reduce", x, mesh, axis, label,
                  lambda l, pg, n, k: _B.AllReduce.apply(l, pg, n, op, expanded),
                  bwd=expanded, nbytes=nbytes)
        return _B.tag(y, (axis,)) if expanded else y
    F, axis = _check(x, mesh, axis, "all_reduce")
    n = mesh.shape[axis]
    if not expanded and current_trace() is None:
        return F.all_reduce(x, mesh.ndim, axis, op, n)      # nothing to record
    nb = F.rank_bytes(x, mesh.ndim)
    record_collective("all_reduce", mesh, axis, nb, label)
    y = F.all_reduce(x, mesh.ndim, axis, op, n)
    if expanded:
        return _on_backward(F.expand(y, axis, n), "all_reduce", mesh, axis, nb, label)
    return y


@_bytes_only
def all_gather(x, mesh, axis: int, dim: int, *, expanded: bool = False, label: str = "",
               sizes=None, nbytes=None):
    """Concatenate the group's shards along local ``dim`` (S(dim) -> R).  ``sizes``
    (torch.distributed, uneven shards): the members' lengths along ``dim``
    (:mod:`.padded`); ``nbytes``: as :func:`all_reduce`'s.

    Uneven shards (cells; on torch.distributed, where ``nbytes`` is given): each group's
    event records the bytes its busiest rank sends, (p-1) times its largest shard
    (``grid.gather_sent``: padded, as DTensor and :mod:`.padded` send it), priced as such
    (``cost.sent_buffer``), and so does the backward reduce-scatter (``expanded``)."""
    if _B.is_distributed(mesh):
        fn = (lambda l, pg, n, k: _B.AllGather.apply(l, pg, n, dim, k, expanded)) \
            if _even(sizes) else \
            (lambda l, pg, n, k: _padded.AllGather.apply(l, pg, tuple(sizes), k, dim, expanded))
        sent = None if nbytes is None else _dist_gather_sent(x, mesh, axis, dim, sizes, False)
        y = _dist("all_gather", x, mesh, axis, label, fn, out_bytes=True, bwd=expanded,
                  nbytes=nbytes, sent=sent, grad=None if sent is None else (nbytes, sent))
        return _B.tag(y, (axis,)) if expanded else y
    F, axis = _check(x, mesh, axis, "all_gather")
    dim = _dim(x, mesh.ndim, dim, "all_gather", "dim")
    nd, n = mesh.ndim, mesh.shape[axis]
    y = F.all_gather(x, nd, axis, dim, n)
    if not expanded and current_trace() is None:
        return y                             # nothing to record
    nb = F.rank_bytes(y, nd)                 # the cost model's buffer: the gathered tensor
    groups = sent = None
    if F is CellGrid and n > 1:              # uneven: each group's busiest rank
        groups = list(mesh.groups(axis))
        sent = tuple(_cells_gather_sent(x, mesh, axis, g) for g in groups)
        for g, s in zip(groups, sent):
            record_collective("all_gather", mesh, axis, nb, label, groups=[g], sent=s)
    else:
        record_collective("all_gather", mesh, axis, nb, label)
    if expanded:
        return _on_backward(F.expand(y, axis, n), "reduce_scatter", mesh, axis, nb, label,
                            groups=groups, sent=sent)
    return y


def _cells_gather_sent(x, mesh, axis, g) -> int:
    """``grid.gather_sent`` of group ``g``'s cells of ``x`` (its members' pieces)."""
    ts = _line(x, mesh, axis, g)
    return _gather_sent([t.numel() for t in ts], ts[0].element_size())


def _dist_gather_sent(x, mesh, axis, dim, sizes, whole: bool) -> int:
    """``grid.gather_sent`` of this process's group on torch.distributed: the members'
    pieces are this process's local ``x`` (``whole``: the reduce-scatter's input, the
    group's block) with the ``dim`` lengths of ``sizes`` (the layout's; even where None):
    what the simulator counts on its cells."""
    nd = mesh.ndim
    n = mesh.shape[mesh.dim(axis)]
    local = list(x.shape[nd:])
    d = dim % len(local)
    if sizes is None:
        sizes = [chunk_bounds(local[d], n, k)[1] for k in range(n)] if whole \
            else [local[d]] * n
    rest = math.prod(local[:d] + local[d + 1:])
    return _gather_sent([rest * s for s in sizes], x.element_size())


class _PlusZero(torch.autograd.Function):
    """``x + 0`` both ways: what a sum with zeros does to a value (exact, but a -0.0
    becomes +0.0), forward and backward."""

    @staticmethod
    def forward(ctx, x):
        return x + 0

    @staticmethod
    def backward(ctx, g):
        return g + 0


@_bytes_only
def padded_all_reduce(x, mesh, axis: int, dim: int, *, label: str = ""):
    """What zero-padding each shard of local ``dim`` to its group's length (S(dim) -> P(sum),
    no traffic) then an all-reduce (P(sum) -> R) computes, without the padded buffer:
    every rank ends with the group's shards side by side, each value plus the zeros the
    sum adds (``x + 0``, so exact, and a -0.0 turns +0.0 as in the sum; the gradient
    likewise).  Recorded as the all-reduce of the padded buffer it stands for; stacked
    shards on the simulator only (the caller runs the two steps otherwise)."""
    F, axis = _check(x, mesh, axis, "all_reduce")
    if F is not Stacked or _B.is_distributed(mesh):
        raise ValueError("padded_all_reduce: stacked shards on the simulator only")
    nd, n = mesh.ndim, mesh.shape[axis]
    dim = _dim(x, nd, dim, "all_reduce", "dim")
    y = F.all_gather(x, nd, axis, dim, n)                # a view: the shards side by side
    if current_trace() is not None:
        record_collective("all_reduce", mesh, axis, F.rank_bytes(y, nd), label)
    if y.requires_grad and torch.is_grad_enabled():
        return _PlusZero.apply(y)
    return y + 0


@_bytes_only
def reduce_scatter(x, mesh, axis: int, dim: int, op: str = "sum", *, label: str = "",
                   sizes=None, nbytes=None):
    """Reduce over the group, then rank k keeps chunk k of local ``dim`` (P -> S(dim)).
    ``sizes``, ``nbytes``: as :func:`all_gather`'s; uneven pieces record each group's
    busiest rank, (p-1) times its largest kept piece, forward and backward (as there)."""
    _check_op(op)
    if _B.is_distributed(mesh):
        sent = None if nbytes is None else _dist_gather_sent(x, mesh, axis, dim, sizes, True)
        grad = None if sent is None else (nbytes, sent)
        if not _even(sizes):
            return _dist("reduce_scatter", x, mesh, axis, label,
                         lambda l, pg, n, k: _padded.ReduceScatter.apply(l, pg, tuple(sizes),
                                                                         dim, op),
                         nbytes=nbytes, sent=sent, grad=grad)
        return _dist("reduce_scatter", x, mesh, axis, label,
                     lambda l, pg, n, k: _B.ReduceScatter.apply(l, pg, n, dim, op),
                     nbytes=nbytes, sent=sent, grad=grad)
    F, axis = _check(x, mesh, axis, "reduce_scatter")
    nd, n = mesh.ndim, mesh.shape[axis]
    dim = _dim(x, nd, dim, "reduce_scatter", "dim")
    runs = _rs.RUNS[0]
    y = F.reduce_scatter(x, nd, axis, dim, op, n)
    if current_trace() is None and not F.requires_grad(y):
        return y                          # nothing to record now or in backward
    nb = F.rank_bytes(x, nd)
    groups = sent = None
    if F is CellGrid and n > 1:           # uneven: each group's busiest rank (its kept pieces)
        groups = list(mesh.groups(axis))
        sent = tuple(_cells_gather_sent(y, mesh, axis, g) for g in groups)
    if not (F is Stacked and op in _rs.OPS and _rs.RUNS[0] == runs):
        if sent is None:
            record_collective("reduce_scatter", mesh, axis, nb, label)
        else:
            for g, s in zip(groups, sent):
                record_collective("reduce_scatter", mesh, axis, nb, label, groups=[g], sent=s)
    # (else a cache served the operator's output, as selective checkpointing's recompute
    # does for a saved one: nothing moved, nothing to record; reduce_scatter_op)
    return _on_backward(y, "all_gather", mesh, axis, nb, label, groups=groups, sent=sent)


@_bytes_only
def all_to_all(x, mesh, axis: int, split_dim: int, concat_dim: int, *, label: str = "",
               sizes=None, nbytes=None, grad_nbytes=None):
    """Rank k splits local ``split_dim`` in n, sends piece j to rank j, and concatenates
    what it receives along ``concat_dim`` (S(concat_dim) -> S(split_dim)).  ``sizes``
    (torch.distributed, uneven shards): the members' lengths along ``split_dim`` after
    and along ``concat_dim`` before (:mod:`.padded`); ``nbytes``: as :func:`all_reduce`'s,
    ``grad_nbytes`` the same for the backward's buffer (the largest output shard).

    Uneven shards (cells; on torch.distributed, where ``nbytes`` is given): the members
    send different amounts, and each group's event records the bytes its busiest rank
    sends (``grid.all_to_all_sent``), priced as such (``cost.sent_buffer``), forward and
    backward (which cuts the gradient along ``concat_dim``): the same on both executors."""
    if _B.is_distributed(mesh):
        sent = grad = None
        if nbytes is not None:
            sent, gsent = _dist_a2a_sent(x, mesh, axis, split_dim, concat_dim, sizes)
            grad = (nbytes if grad_nbytes is None else grad_nbytes, gsent)
        if sizes is not None and not (_even(sizes[0]) and _even(sizes[1])):
            split, concat = tuple(sizes[0]), tuple(sizes[1])
            return _dist("all_to_all", x, mesh, axis, label,
                         lambda l, pg, n, k: _padded.AllToAll.apply(l, pg, k, split, concat,
                                                                    split_dim, concat_dim),
                         nbytes=nbytes, sent=sent, grad=grad)
        return _dist("all_to_all", x, mesh, axis, label,
                     lambda l, pg, n, k: _B.AllToAll.apply(l, pg, n, split_dim, concat_dim),
                     nbytes=nbytes, sent=sent, grad=grad)
    F, axis = _check(x, mesh, axis, "all_to_all")
    split_dim = _dim(x, mesh.ndim, split_dim, "all_to_all", "split_dim")
    concat_dim = _dim(x, mesh.ndim, concat_dim, "all_to_all", "concat_dim")
    nd, n = mesh.ndim, mesh.shape[axis]
    nb = F.rank_bytes(x, nd)
    if F is not CellGrid or n == 1:
        record_collective("all_to_all", mesh, axis, nb, label)
        y = F.all_to_all(x, nd, axis, split_dim, concat_dim, n)
        return _on_backward(y, "all_to_all", mesh, axis, nb, label)
    # uneven shards: each group's events carry its busiest rank's bytes
    groups = mesh.groups(axis)
    if current_trace() is not None:
        for g in groups:
            record_collective("all_to_all", mesh, axis, nb, label, groups=[g],
                              sent=CellGrid.all_to_all_sent(_line(x, mesh, axis, g), split_dim, n))
    y = F.all_to_all(x, nd, axis, split_dim, concat_dim, n)
    if not (torch.is_grad_enabled() and F.requires_grad(y)):
        return y
    # the backward's own buffer: the gradient's shards (y's), cut along concat_dim
    return _on_backward(y, "all_to_all", mesh, axis, F.rank_bytes(y, nd), label,
                        groups=list(groups), sent=tuple(
                            CellGrid.all_to_all_sent(_line(y, mesh, axis, g), concat_dim, n)
                            for g in groups))


def _line(x, mesh, axis, g) -> list:
    """The cells of group ``g`` (mesh ranks along ``axis``) in group order."""
    c = mesh.coordinate(g[0])
    return [x[tuple(ci if ln > 1 else 0 for ci, ln in
                    zip(c[:axis] + (k,) + c[axis + 1:], x.lead))] for k in range(len(g))]


def _dist_a2a_sent(x, mesh, axis, split_dim, concat_dim, sizes) -> tuple[int, int]:
    """The bytes the busiest member of this process's group sends in the all-to-all and in
    its backward (``grid.all_to_all_sent``): the members' shards are this process's with
    the ``concat_dim`` lengths of ``sizes`` (the layout's; even where None), their outputs
    with the ``split_dim`` lengths: what the simulator counts on its cells."""
    nd = mesh.ndim
    n = mesh.shape[mesh.dim(axis)]
    local = list(x.shape[nd:])
    sd, cd = split_dim % len(local), concat_dim % len(local)
    if sizes is None:
        split = tuple(chunk_bounds(local[sd], n, k)[1] for k in range(n))
        concat = (local[cd],) * n
    else:
        split, concat = tuple(sizes[0]), tuple(sizes[1])

    def shape(d, length, d2=None, length2=None):
        out = list(local)
        out[d] = length
        if d2 is not None:
            out[d2] = length2
        return tuple(out)

    elem = x.element_size()
    fwd = [shape(cd, c) for c in concat]
    bwd = [shape(sd, s, cd, sum(concat)) for s in split]
    return _a2a_sent(fwd, sd, n, elem), _a2a_sent(bwd, cd, n, elem)


@_bytes_only
def broadcast(x, mesh, axis: int, root: int = 0, *, label: str = ""):
    """Every rank of the group gets the tensor of the group's ``root``-th rank
    (simulation only: no reshard plan broadcasts)."""
    if _B.is_distributed(mesh):
        raise NotImplementedError("broadcast on a torch.distributed mesh: use "
                                  "torch.distributed.broadcast on the group's process group")
    F, axis = _check(x, mesh, axis, "broadcast")
    if not isinstance(root, int) or not 0 <= root < mesh.shape[axis]:
        raise ValueError(f"broadcast(root={root!r}): the group along "
                         f"{mesh.dim_names[axis]!r} has {mesh.shape[axis]} ranks; use a root "
                         f"in [0, {mesh.shape[axis] - 1}]")
    nb = F.rank_bytes(x, mesh.ndim)
    record_collective("broadcast", mesh, axis, nb, label)
    return F.pick(x, axis, root)


@_bytes_only
def expand_replicas(x, mesh, axes: Sequence[int], *, label: str = ""):
    """Give every rank along ``axes`` its own copy of a replicated tensor.

    Forward moves no data (the copies are views).  Backward sums the ranks'
    gradients: an all-reduce per axis, recorded in the trace.  This is the
    explicit form of what autograd would otherwise do silently when a
    replicated tensor meets per-rank computation (Megatron's ``f``).

    A gradient reaching the copies in a narrower dtype than ``x`` (a float32 ``x`` added
    to a bfloat16 tensor) is summed to each rank's copy and cast to x's dtype by torch's
    autograd on that rank (the engine's ``sum_to`` then the input's dtype), and the ranks'
    values summed in x's dtype after: one 16-bit rounding per rank where one device rounds
    the whole sum once (random sweep seed 1061466: 7.015625 here, torch's 7.0, the exact
    sum 7.0137; both within half a bfloat16 ulp, as DTensor's all-reduce of a replicated
    input's gradient).  Not matched: torch's order would need the activation's gradient
    gathered before the sum (tests/test_sweep14.py pins it)."""
    if _B.is_distributed(mesh):
        for a in axes:
            had = getattr(x, "_wb_replica_axes", ())
            if a in had:
                continue                  # one copy per rank already (f, or data parallel)
            nb = x.numel() * x.element_size()
            x = _dist("expand_replicas", x, mesh, a, label,
                      lambda l, pg, n, k: _B.ExpandReplicas.apply(l, pg), record=False)
            x = _on_backward(x, "all_reduce", mesh, a, nb, label or "grad of a replicated tensor",
                             groups=[_B.group(mesh, a)[1]])
            _B.tag(x, had + (a,))
        return x
    F = ops_for(x)
    nd = mesh.ndim
    for a in axes:
        if type(a) is not int or not 0 <= a < nd:
            a = mesh.dim(a)
        if (x.lead[a] if F is not Stacked else x.shape[a]) != 1:
            continue                      # already one copy per rank: nothing to expand
        y = F.expand(x, a, mesh.shape[a])
        if F.requires_grad(x) and torch.is_grad_enabled() and \
                not (_gr.MUTED and _gr.muted(mesh, a)):          # (the bytes only then)
            y = _on_backward(y, "all_reduce", mesh, a, F.rank_bytes(x, nd),
                             label or "grad of a replicated tensor")
        x = y
    return x


_BWD = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_to_all": "all_to_all",
        "all_reduce": "all_reduce"}


def _even(sizes) -> bool:
    """No sizes given, or all the same: the even collective runs."""
    return sizes is None or len(set(sizes)) <= 1


def _dist(kind, x, mesh, axis, label, fn, out_bytes=False, record=True, bwd=True,
          nbytes=None, sent=None, grad=None):
    """Run a collective on torch.distributed: x is this process's stacked local
    (every leading axis of size 1).  ``sent``: the bytes the group's busiest rank sends
    (:func:`record_collective`); ``grad``: (nbytes, sent) of the backward's collective
    where they are not the forward's (an uneven all-to-all)."""
    if isinstance(x, Cells):
        raise NotImplementedError(f"{kind} on uneven shards over torch.distributed: pad the "
                                  "tensor so every mesh dim divides it")
    nd = mesh.ndim
    lead = tuple(x.shape[:nd])
    pg, g = _B.group(mesh, axis)
    k = g.index(_B.rank())
    y = fn(x.reshape(x.shape[nd:]), pg, len(g), k)
    y = y.reshape(lead + tuple(y.shape))
    if record:
        nb = (y if out_bytes else x).numel() * x.element_size() if nbytes is None else nbytes
        record_collective(kind, mesh, axis, nb, label, groups=[g], sent=sent)
        if bwd and kind in _BWD:
            gnb, gsent = (nb, None) if grad is None else grad
            y = _on_backward(y, _BWD[kind], mesh, axis, gnb, label, groups=[g],
                             sent=None if gsent is None else (gsent,))
    return y


@_bytes_only
def send_recv(x, src_mesh, dst_mesh, *, label: str = ""):
    """Rank i of ``src_mesh`` sends its local tensor to rank i of ``dst_mesh``
    (same mesh shape, row-major order).  Replicated axes stay compact; pairs on the
    same device move nothing."""
    if src_mesh.shape != dst_mesh.shape:
        raise ValueError(f"send_recv: mesh shapes differ ({src_mesh.shape} vs "
                         f"{dst_mesh.shape}); reshape the plan so the meshes match")
    nb = _rank_bytes(x, src_mesh.ndim)
    pairs = [(a, b) for a, b in zip(src_mesh.ranks, dst_mesh.ranks) if a != b]
    tr = current_trace()
    if tr is not None:
        for a, b in pairs:
            dur = _cost.price("send_recv", nb, (a, b), tr.profile)
            tr.record_collective((a, b), "send_recv", dur, bytes=nb, label=label,
                                 args={"src": a, "dst": b})
    groups = [(a, b) for a, b in pairs]
    return _on_backward(x, "send_recv", src_mesh, None, nb, label, groups=groups) if groups else x


# the uneven all-to-all (expert parallelism's token exchange): all_to_all_v.py
from .all_to_all_v import all_to_all_v, all_to_all_v_time, record_all_to_all_v  # noqa: E402
