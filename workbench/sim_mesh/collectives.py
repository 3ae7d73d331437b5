"""Collectives over the simulated mesh: exact math, modeled cost, traced, differentiable.

Every simulated rank's local tensor lives in one *stacked* tensor with one
leading axis per mesh dimension: ``x[i, j]`` is the local tensor of the rank at
mesh coordinate ``(i, j)``.  An axis of size 1 means "every rank along this mesh
dimension holds the same values" (a replicated copy is not stored; it is a
stride-0 view when needed).  A collective is then one tensor operation over a
leading axis, e.g. all-reduce is ``x.sum(axis, keepdim=True)``, so simulating 64
ranks costs about what the same arithmetic costs on one tensor.

When local shapes differ (uneven shards) the same operations run on
:class:`Cells`: the same leading grid, one tensor per cell.

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
from .trace import current_trace

__all__ = ["Cells", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
           "broadcast", "expand_replicas", "send_recv", "record_collective", "nbytes_of",
           "chunk_bounds",
           "REDUCE_OPS"]

REDUCE_OPS = ("sum", "avg", "max", "min")


class Cells:
    """A grid (shape ``lead``) of per-rank local tensors whose shapes may differ."""
    __slots__ = ("lead", "items")

    def __init__(self, lead: Sequence[int], items: Sequence[torch.Tensor]):
        self.lead = tuple(lead)
        self.items = list(items)
        if len(self.items) != math.prod(self.lead):
            raise ValueError(f"Cells: {len(self.items)} tensors for a grid of shape {self.lead}")

    def index(self, coord) -> int:
        i = 0
        for c, n in zip(coord, self.lead):
            i = i * n + (c if n > 1 else 0)
        return i

    def __getitem__(self, coord) -> torch.Tensor:
        return self.items[self.index(coord)]

    def coords(self):
        import itertools
        return itertools.product(*[range(n) for n in self.lead])

    @property
    def dtype(self):
        return self.items[0].dtype

    def requires_grad(self) -> bool:
        return any(t.requires_grad for t in self.items)

    def lines(self, axis: int):
        """Yield (coords of the line, tensors along ``axis``) for every line."""
        n = self.lead[axis]
        base = list(self.lead)
        base[axis] = 1
        import itertools
        for c in itertools.product(*[range(k) for k in base]):
            cs = [c[:axis] + (k,) + c[axis + 1:] for k in range(n)]
            yield cs, [self[x] for x in cs]

    def with_axis(self, axis: int, n: int, fill) -> "Cells":
        """A new grid whose ``axis`` has size n; ``fill(coord)`` gives each cell."""
        lead = list(self.lead)
        lead[axis] = n
        import itertools
        items = [fill(c) for c in itertools.product(*[range(k) for k in lead])]
        return Cells(lead, items)


def nbytes_of(x) -> int:
    """Bytes of one rank's (largest) local tensor."""
    if isinstance(x, Cells):
        return max(t.numel() for t in x.items) * x.items[0].element_size()
    return x.numel() * x.element_size()


def _rank_bytes(x, nd: int) -> int:
    """Bytes of one rank's (largest) local tensor in a stack with ``nd`` leading axes,
    or in Cells."""
    if isinstance(x, Cells):
        return nbytes_of(x)
    return (x.numel() // max(1, math.prod(x.shape[:nd]))) * x.element_size()


def _needs_grad(x) -> bool:
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad() if isinstance(x, Cells) else x.requires_grad


def record_collective(kind: str, mesh, axis: int | None, nbytes: int, label: str = "",
                      groups=None, overlap: bool = False):
    """Record ``kind`` on every group along mesh ``axis`` in the current trace.

    ``nbytes`` follows the cost model's convention (see :mod:`workbench.sim_mesh.cost`).
    Returns the handles (empty when no trace is being recorded)."""
    tr = current_trace()
    if tr is None:
        return []
    if groups is None:
        groups = mesh.groups(axis)
    handles = []
    for g in groups:
        p = len(g)
        if p == 1:
            continue                  # one rank: nothing moves, nothing to record
        dur = _cost.price(kind, nbytes, g, tr.profile)
        handles.append(tr.record_collective(
            g, kind, dur, bytes=_cost.wire_bytes(kind, nbytes, p), label=label,
            args={"mesh_dim": mesh.dim_names[axis] if axis is not None else "",
                  "buffer_bytes": int(nbytes)}, overlap=overlap))
    return handles


class _BackwardEvent(torch.autograd.Function):
    """Identity whose backward records a collective (the backward communication)."""

    @staticmethod
    def forward(ctx, info, *xs):
        ctx.info = info
        return tuple(x.view_as(x) for x in xs) if len(xs) > 1 else xs[0].view_as(xs[0])

    @staticmethod
    def backward(ctx, *grads):
        kind, mesh, axis, nbytes, label, groups = ctx.info
        record_collective(kind, mesh, axis, nbytes, label, groups=groups)
        return (None,) + grads


def _on_backward(x, kind, mesh, axis, nbytes, label, groups=None):
    """Attach a backward event to x (a tensor or Cells) if it takes part in autograd."""
    info = (kind, mesh, axis, nbytes, label, groups)
    if isinstance(x, Cells):
        idx = [i for i, t in enumerate(x.items) if t.requires_grad]
        if not idx or not torch.is_grad_enabled():
            return x
        outs = _BackwardEvent.apply(info, *[x.items[i] for i in idx])
        outs = outs if isinstance(outs, tuple) else (outs,)
        items = list(x.items)
        for i, o in zip(idx, outs):
            items[i] = o
        return Cells(x.lead, items)
    if x.requires_grad and torch.is_grad_enabled():
        return _BackwardEvent.apply(info, x)
    return x


def _check_axis(x, mesh, axis, full: bool, what: str):
    n = x.lead[axis] if isinstance(x, Cells) else x.shape[axis]
    if full and n != mesh.shape[axis]:
        raise ValueError(f"{what}: the input is the same on every rank along mesh dim "
                         f"{mesh.dim_names[axis]!r} (a replicated copy); nothing to {what}")


def _reduce(stack: torch.Tensor, dim: int, op: str, keepdim=True) -> torch.Tensor:
    """``op`` over ``dim`` in the tensor's own dtype, as torch.distributed reduces
    (torch.sum would turn int32 into int64)."""
    if op == "sum":
        if stack.is_floating_point() or stack.is_complex():
            return stack.sum(dim, keepdim=keepdim)
        return stack.sum(dim, keepdim=keepdim, dtype=stack.dtype)
    if op == "avg":
        return stack.mean(dim, keepdim=keepdim)
    if op == "max":
        return stack.amax(dim, keepdim=keepdim)
    if op == "min":
        return stack.amin(dim, keepdim=keepdim)
    raise ValueError(f"op={op!r}: unknown reduction; use one of {list(REDUCE_OPS)}")


def _expand_axis(x: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[axis] = n
    return x.expand(shape)


# ---- the collectives ------------------------------------------------------------------

def all_reduce(x, mesh, axis: int, op: str = "sum", *, expanded: bool = False, label: str = ""):
    """Every rank gets ``op`` over its group's tensors (P -> R)."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op={op!r}: unknown reduction; use one of {list(REDUCE_OPS)}")
    if _B.is_distributed(mesh):
        y = _dist("all_reduce", x, mesh, axis, label,
                  lambda l, pg, n, k: _B.AllReduce.apply(l, pg, n, op, expanded),
                  bwd=expanded)
        return _B.tag(y, (axis,)) if expanded else y
    _check_axis(x, mesh, axis, True, "all_reduce")
    n = mesh.shape[axis]
    nb = _rank_bytes(x, mesh.ndim)
    record_collective("all_reduce", mesh, axis, nb, label)
    if isinstance(x, Cells):
        out = x.with_axis(axis, 1, lambda c: None)
        items = []
        for cs, ts in x.lines(axis):
            items.append(_reduce(torch.stack(ts), 0, op, keepdim=False))
        out = Cells(out.lead, items)
        if expanded:
            out = out.with_axis(axis, n, lambda c: out[c])
            return _on_backward(out, "all_reduce", mesh, axis, nb, label)
        return out
    y = _reduce(x, axis, op)
    if expanded:
        return _on_backward(_expand_axis(y, axis, n), "all_reduce", mesh, axis, nb, label)
    return y


def all_gather(x, mesh, axis: int, dim: int, *, expanded: bool = False, label: str = ""):
    """Concatenate the group's shards along local ``dim`` (S(dim) -> R)."""
    if _B.is_distributed(mesh):
        y = _dist("all_gather", x, mesh, axis, label,
                  lambda l, pg, n, k: _B.AllGather.apply(l, pg, n, dim, k, expanded),
                  out_bytes=True, bwd=expanded)
        return _B.tag(y, (axis,)) if expanded else y
    _check_axis(x, mesh, axis, True, "all_gather")
    nd, n = mesh.ndim, mesh.shape[axis]
    if isinstance(x, Cells):
        items = [torch.cat(ts, dim) for _, ts in x.lines(axis)]
        out = Cells(x.with_axis(axis, 1, lambda c: None).lead, items)
        nb = max(t.numel() for t in items) * items[0].element_size()
        record_collective("all_gather", mesh, axis, nb, label)
        if expanded:
            out = out.with_axis(axis, n, lambda c: out[c])
            return _on_backward(out, "reduce_scatter", mesh, axis, nb, label)
        return out
    y = x.movedim(axis, nd - 1 + dim)
    y = y.flatten(nd - 1 + dim, nd + dim).unsqueeze(axis)
    nb = _rank_bytes(y, nd)
    record_collective("all_gather", mesh, axis, nb, label)
    if expanded:
        return _on_backward(_expand_axis(y, axis, n), "reduce_scatter", mesh, axis, nb, label)
    return y


def reduce_scatter(x, mesh, axis: int, dim: int, op: str = "sum", *, label: str = ""):
    """Reduce over the group, then rank k keeps chunk k of local ``dim`` (P -> S(dim))."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op={op!r}: unknown reduction; use one of {list(REDUCE_OPS)}")
    if _B.is_distributed(mesh):
        return _dist("reduce_scatter", x, mesh, axis, label,
                     lambda l, pg, n, k: _B.ReduceScatter.apply(l, pg, n, dim, op))
    _check_axis(x, mesh, axis, True, "reduce_scatter")
    nd, n = mesh.ndim, mesh.shape[axis]
    if isinstance(x, Cells):
        nb = nbytes_of(x)
        record_collective("reduce_scatter", mesh, axis, nb, label)
        red = {}
        for cs, ts in x.lines(axis):
            pieces = torch.stack(ts)
            r = _reduce(pieces, 0, op, keepdim=False)
            chunks = _chunks(r, dim, n)
            for k, c in enumerate(cs):
                red[c] = chunks[k]
        out = Cells(x.lead, [red[c] for c in x.coords()])
        return _on_backward(out, "all_gather", mesh, axis, nb, label)
    tracing = current_trace() is not None
    nb = _rank_bytes(x, nd) \
        if tracing or x.requires_grad else 0
    if tracing:
        record_collective("reduce_scatter", mesh, axis, nb, label)
    y = _reduce(x, axis, op)                                         # (.., 1, .., L)
    shape = y.shape
    L = shape[nd + dim]
    if axis == nd - 1 and dim == 0:
        # the chunk index lands where the mesh axis was: one view does it
        y = y.view(shape[:axis] + (n, L // n) + shape[nd + 1:])
    else:
        y = y.squeeze(axis).unflatten(nd - 1 + dim, (n, L // n)).movedim(nd - 1 + dim, axis)
    return _on_backward(y, "all_gather", mesh, axis, nb, label) if y.requires_grad else y


def all_to_all(x, mesh, axis: int, split_dim: int, concat_dim: int, *, label: str = ""):
    """Rank k splits local ``split_dim`` in n, sends piece j to rank j, and concatenates
    what it receives along ``concat_dim`` (S(concat_dim) -> S(split_dim))."""
    if _B.is_distributed(mesh):
        return _dist("all_to_all", x, mesh, axis, label,
                     lambda l, pg, n, k: _B.AllToAll.apply(l, pg, n, split_dim, concat_dim))
    _check_axis(x, mesh, axis, True, "all_to_all")
    nd, n = mesh.ndim, mesh.shape[axis]
    nb = _rank_bytes(x, nd)
    record_collective("all_to_all", mesh, axis, nb, label)
    if isinstance(x, Cells):
        res = {}
        for cs, ts in x.lines(axis):
            pieces = [_chunks(t, split_dim, n) for t in ts]
            for j, c in enumerate(cs):
                res[c] = torch.cat([pieces[k][j] for k in range(n)], concat_dim)
        out = Cells(x.lead, [res[c] for c in x.coords()])
    else:
        L = x.shape[nd + split_dim]
        # split: (..., n_src, ..., L[split] -> (n_dst, L/n)) ; move n_dst to the front
        y = x.unflatten(nd + split_dim, (n, L // n))            # new axis at nd+split_dim
        y = y.movedim(nd + split_dim, nd)                        # (..A.., n_dst, *L')
        # now axis `axis` is the source rank; swap source and destination
        y = y.movedim(axis, nd)                                  # (..A\axis.., n_dst, n_src, *L')
        y = y.movedim(nd - 1, axis)                              # destination back at `axis`
        # y: (..., n_dst at axis, ..., n_src at nd, *L'); concat n_src into concat_dim
        y = y.movedim(nd, nd + concat_dim).flatten(nd + concat_dim, nd + concat_dim + 1)
        out = y
    return _on_backward(out, "all_to_all", mesh, axis, nb, label)


def broadcast(x, mesh, axis: int, root: int = 0, *, label: str = ""):
    """Every rank of the group gets the tensor of the group's ``root``-th rank."""
    _check_axis(x, mesh, axis, True, "broadcast")
    nb = _rank_bytes(x, mesh.ndim)
    record_collective("broadcast", mesh, axis, nb, label)
    if isinstance(x, Cells):
        return Cells(x.with_axis(axis, 1, lambda c: None).lead,
                     [ts[root] for _, ts in x.lines(axis)])
    return x.narrow(axis, root, 1)


def expand_replicas(x, mesh, axes: Sequence[int], *, label: str = ""):
    """Give every rank along ``axes`` its own copy of a replicated tensor.

    Forward moves no data (the copies are views).  Backward sums the ranks'
    gradients: an all-reduce per axis, recorded in the trace.  This is the
    explicit form of what autograd would otherwise do silently when a
    replicated tensor meets per-rank computation (Megatron's ``f``)."""
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
    for a in axes:
        n = mesh.shape[a]
        if isinstance(x, Cells):
            if x.lead[a] != 1:
                continue                  # already one copy per rank: nothing to expand
            nb = nbytes_of(x)
            src = x
            x = x.with_axis(a, n, lambda c, a=a, src=src: src[c[:a] + (0,) + c[a + 1:]])
        else:
            if x.shape[a] != 1:
                continue
            nb = _rank_bytes(x, mesh.ndim)
            x = _expand_axis(x, a, n)
        x = _on_backward(x, "all_reduce", mesh, a, nb, label or "grad of a replicated tensor")
    return x


_BWD = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_to_all": "all_to_all",
        "all_reduce": "all_reduce"}


def _dist(kind, x, mesh, axis, label, fn, out_bytes=False, record=True, bwd=True):
    """Run a collective on torch.distributed: x is this process's stacked local
    (every leading axis of size 1)."""
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
        nb = (y if out_bytes else x).numel() * x.element_size()
        record_collective(kind, mesh, axis, nb, label, groups=[g])
        if bwd and kind in _BWD:
            y = _on_backward(y, _BWD[kind], mesh, axis, nb, label, groups=[g])
    return y


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


def chunk_bounds(length: int, n: int, k: int) -> tuple[int, int]:
    """(start, size) of chunk ``k`` when ``length`` is split in ``n`` by torch.chunk
    (10 on 4: 3, 3, 3, 1; 5 on 4: 2, 2, 1, 0)."""
    cs = -(-length // n) if length else 0          # ceil(length / n)
    start = min(k * cs, length)
    return start, max(0, min(cs, length - start))


def _chunks(t: torch.Tensor, dim: int, n: int) -> list[torch.Tensor]:
    """torch.chunk, padded with empty tensors to exactly n pieces."""
    return [t.narrow(dim, *chunk_bounds(t.shape[dim], n, k)) for k in range(n)]
