"""The math of the collectives on the two simulated forms of a grid of local tensors.

Every simulated rank's local tensor lives in a grid with one leading axis per mesh
dimension (size 1 along a mesh dim where every rank holds the same values):

* :class:`Stacked`: one tensor ``x[i, j, ...]``; a collective is one tensor operation
  over a leading axis (all-reduce is ``x.sum(axis, keepdim=True)``), so 64 ranks cost
  about what the same arithmetic costs on one tensor;
* :class:`CellGrid`: :class:`Cells`, one tensor per rank, when shard shapes differ
  (uneven ``torch.chunk`` splits); the same operations run one line of the grid at a
  time.

Both offer the same operations with the same meaning; :func:`ops_for` picks one, so
:mod:`workbench.sim_mesh.collectives` writes each collective once.  Reductions keep
the tensor's dtype, as torch.distributed's do.
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch

from . import reduce_scatter_op as _rs

__all__ = ["Cells", "Stacked", "CellGrid", "ops_for", "reduce", "chunk_bounds", "chunks",
           "split_axis", "REDUCE_OPS"]

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
        for c in itertools.product(*[range(k) for k in base]):
            cs = [c[:axis] + (k,) + c[axis + 1:] for k in range(n)]
            yield cs, [self[x] for x in cs]

    def with_axis(self, axis: int, n: int, fill) -> "Cells":
        """A new grid whose ``axis`` has size n; ``fill(coord)`` gives each cell."""
        lead = list(self.lead)
        lead[axis] = n
        items = [fill(c) for c in itertools.product(*[range(k) for k in lead])]
        return Cells(lead, items)


class _StackCells(torch.autograd.Function):
    """``torch.stack`` of per-rank tensors whose gradients come back as separate tensors.

    torch.stack's backward unbinds the incoming gradient; after a sum over the stacked
    axis that gradient is an expand (stride 0), so every rank's piece views the same
    memory, and autograd may keep such a piece as a leaf's ``.grad``: the next backward
    then adds into that memory once per rank (``ls = [a, b, c]``;
    ``torch.stack(ls).sum(0).mul(w).sum().backward()`` twice gives ``a.grad == 4 w``, in
    plain torch 2.13 too).  Pieces that share memory are copied."""

    @staticmethod
    def forward(ctx, *ts):
        return torch.stack(ts)

    @staticmethod
    def backward(ctx, g):
        gs = g.unbind(0)
        if len(gs) > 1 and g.stride(0) == 0:
            return tuple(t.clone() for t in gs)
        return gs


def stack(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(ts)`` (along a new dim 0) for per-rank tensors: see :class:`_StackCells`.
    Autocast off: the ranks' tensors side by side are no autocast op (torch's ``stack``
    under ``torch.autocast("cpu", dtype=torch.bfloat16)`` refuses float16 shards; seed
    2004533 of the wide random sweep raised)."""
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return stack(ts)
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return _StackCells.apply(*ts)
    return torch.stack(list(ts))


class _Extreme(torch.autograd.Function):
    """The max / min over the ranks (``dim`` of the stack) whose gradient goes evenly to
    the ranks that hold the result, a NaN result's to the ranks that hold NaN: torch's
    ``evenly_distribute_backward`` (torch 2.13, ``FunctionsManual.cpp``, the CPU branch:
    ``mask = isnan(self) if isnan(result) else self == result``, zeros off the mask),
    applied per element.  ``amax`` / ``amin``'s own backward masks ``self == result``
    only: no rank equals a NaN result, a count of 0, and the gradient was NaN where one
    device's passes through (``R -> P(min) -> R`` of a NaN: wide seed 2016720's log1p of
    values below -1, t1.grad NaN where torch gives 1 / (1 + x))."""

    @staticmethod
    def forward(ctx, x, dim, keepdim, op):
        y = (torch.amax if op == "max" else torch.amin)(x, dim, keepdim=True)
        ctx.save_for_backward(x, y)
        ctx.dim, ctx.keepdim = dim, keepdim
        return y if keepdim else y.squeeze(dim)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        if not ctx.keepdim:
            g = g.unsqueeze(ctx.dim)
        hit = (x == y) | (x.isnan() & y.isnan())
        count = hit.sum(ctx.dim, keepdim=True)
        return torch.where(hit, g / count, g.new_zeros(())), None, None, None


def reduce(stack: torch.Tensor, dim: int, op: str, keepdim=True) -> torch.Tensor:
    """``op`` over ``dim`` in the tensor's own dtype, as torch.distributed reduces
    (``torch.sum`` alone would turn int32 into int64)."""
    if op == "sum":
        if stack.is_floating_point():
            return stack.sum(dim, keepdim=keepdim)
        return stack.sum(dim, keepdim=keepdim, dtype=stack.dtype)
    if op == "avg":
        return stack.mean(dim, keepdim=keepdim)
    if op in ("max", "min"):
        if torch.is_grad_enabled() and stack.requires_grad:
            return _Extreme.apply(stack, dim, keepdim, op)
        return (stack.amax if op == "max" else stack.amin)(dim, keepdim=keepdim)
    raise ValueError(f"op={op!r}: unknown reduction; use one of {list(REDUCE_OPS)}")


def chunk_bounds(length: int, n: int, k: int) -> tuple[int, int]:
    """(start, size) of chunk ``k`` when ``length`` is split in ``n`` by torch.chunk
    (10 on 4: 3, 3, 3, 1; 5 on 4: 2, 2, 1, 0)."""
    cs = -(-length // n) if length else 0          # ceil(length / n)
    start = min(k * cs, length)
    return start, max(0, min(cs, length - start))


def chunks(t: torch.Tensor, dim: int, n: int) -> list[torch.Tensor]:
    """torch.chunk, padded with empty tensors to exactly n pieces."""
    return [t.narrow(dim, *chunk_bounds(t.shape[dim], n, k)) for k in range(n)]


def _divides(length: int, n: int, what: str) -> None:
    if length % n:
        raise ValueError(f"{what}: a local dim of {length} does not split evenly over {n} "
                         "ranks, so the shards cannot be stacked; pass Cells (uneven shards)")


def split_axis(x: torch.Tensor, d: int, n: int) -> torch.Tensor:
    """``x.unflatten(d, (n, -1))`` as one view (splitting a dim never needs a copy;
    Tensor.unflatten is a Python wrapper, slower on the hot path)."""
    s = x.shape
    return x.view(s[:d] + (n, s[d] // n) + s[d + 1:])


class Stacked:
    """The grid as one tensor ``(*lead, *local)``: every shard has one shape."""

    @staticmethod
    def lead(x, nd: int) -> tuple:
        return tuple(x.shape[:nd])

    @staticmethod
    def rank_bytes(x, nd: int) -> int:
        return (x.numel() // max(1, math.prod(x.shape[:nd]))) * x.element_size()

    @staticmethod
    def tensors(x) -> list:
        return [x]

    @staticmethod
    def requires_grad(x) -> bool:
        return x.requires_grad

    @staticmethod
    def rebuild(x, items):
        return items[0]

    @staticmethod
    def all_reduce(x, nd, axis, op, n):
        return reduce(x, axis, op)

    @staticmethod
    def all_gather(x, nd, axis, dim, n):
        # each rank's result contiguous, as torch.distributed's all_gather_into_tensor (and
        # backends._all_gather's cat) gives it: the flatten can be a view with the gathered
        # pieces outermost (a (2, 5, 1) shard of dim 2 of 3 ranks: strides (5, 1, 10)),
        # and then a user's full_tensor().view(-1) raised here where torch's works
        y = x.movedim(axis, nd - 1 + dim)
        return y.flatten(nd - 1 + dim, nd + dim).contiguous().unsqueeze(axis)

    @staticmethod
    def reduce_scatter(x, nd, axis, dim, op, n):
        _divides(x.shape[nd + dim], n, "reduce_scatter")
        if op in _rs.OPS:           # one operator a dispatch mode sees (reduce_scatter_op)
            return _rs.run(x, nd, axis, dim, op)
        return _rs.scatter_view(reduce(x, axis, op), nd, axis, dim, n)   # (.., 1, .., L)

    @staticmethod
    def all_to_all(x, nd, axis, split_dim, concat_dim, n):
        L = x.shape[nd + split_dim]
        _divides(L, n, "all_to_all")
        y = split_axis(x, nd + split_dim, n)                     # new axis at nd+split_dim
        y = y.movedim(nd + split_dim, nd)                        # (..A.., n_dst, *L')
        # now axis `axis` is the source rank; swap source and destination
        y = y.movedim(axis, nd)                                  # (..A\axis.., n_dst, n_src, *L')
        y = y.movedim(nd - 1, axis)                              # destination back at `axis`
        # y: (..., n_dst at axis, ..., n_src at nd, *L'); concat n_src into concat_dim
        return y.movedim(nd, nd + concat_dim).flatten(nd + concat_dim, nd + concat_dim + 1)

    @staticmethod
    def expand(x, axis, n):
        """Every rank along ``axis`` sees the one copy (a stride-0 view)."""
        shape = list(x.shape)
        shape[axis] = n
        return x.expand(*shape)         # (ints: torch parses a list argument slower)

    @staticmethod
    def pick(x, axis, root):
        return x.narrow(axis, root, 1)


def all_to_all_sent(shapes, split_dim: int, n: int, elem: int) -> int:
    """Bytes the busiest of one group's ``n`` ranks sends in an all-to-all that cuts each
    rank's shard (``shapes``, in group order) along ``split_dim`` in torch.chunk pieces:
    rank k keeps piece k and sends the rest.  Uneven shards send different amounts (a
    shard of 4 rows on 3 ranks is cut 2, 2, 0: the third rank keeps none and sends all 4);
    even ones all send (p-1)/p of their shard.  The one definition for the simulator's
    cells (:meth:`CellGrid.all_to_all_sent`) and a torch.distributed process, which knows
    its group's shapes from the layout (``collectives.all_to_all``'s ``sizes``)."""
    return max((rank_sent(shape, split_dim, n, k, elem) for k, shape in enumerate(shapes)),
               default=0)


def rank_sent(shape, split_dim: int, n: int, k: int, elem: int) -> int:
    """Bytes rank ``k`` of ``n`` sends in that all-to-all (:func:`all_to_all_sent`): its
    shard (``shape``) less the torch.chunk piece k of ``split_dim`` it keeps."""
    numel, L = math.prod(shape), shape[split_dim]
    kept = chunk_bounds(L, n, k)[1]
    return (numel - (numel // L * kept if L else 0)) * elem


def gather_sent(pieces, elem: int) -> int:
    """Bytes the busiest of one group's ranks sends in an all-gather, or a reduce-scatter,
    whose members' pieces are ``pieces`` (numels, in group order; the gathered shards, the
    kept pieces): (p-1) times the largest.  Every rank sends p-1 pieces, each padded to the
    largest as DTensor pads them (torch 2.13, git cf30153, torch/distributed/tensor/
    placement_types.py ``_to_replicate_tensor`` :591, ``_reduce_shard_tensor`` :475) and
    :mod:`.padded` runs them on torch.distributed; the ring formula (p-1)/p n on the padded
    buffer p x the largest piece.  Rows 2, 2, 0 of f32 on 3 ranks: 2 x 8 = 16 B (the
    formula on the largest unpadded buffer, 16 B, floored: 10 B).  The one definition for
    the simulator's cells, a torch.distributed process (its shard and the layout's
    ``sizes``) and the planner (``parallel.layout.gather_sent``)."""
    pieces = list(pieces)
    return (len(pieces) - 1) * max(pieces, default=0) * elem


class CellGrid:
    """The grid as :class:`Cells`: the same operations, one line of the grid at a time."""

    @staticmethod
    def lead(x, nd: int) -> tuple:
        return x.lead

    @staticmethod
    def rank_bytes(x, nd: int) -> int:
        return max(t.numel() for t in x.items) * x.items[0].element_size()

    @staticmethod
    def tensors(x) -> list:
        return x.items

    @staticmethod
    def requires_grad(x) -> bool:
        return any(t.requires_grad for t in x.items)

    @staticmethod
    def rebuild(x, items):
        return Cells(x.lead, items)

    @staticmethod
    def _collapse(x, axis, items):
        lead = list(x.lead)
        lead[axis] = 1
        return Cells(lead, items)

    @staticmethod
    def all_reduce(x, nd, axis, op, n):
        return CellGrid._collapse(x, axis, [reduce(stack(ts), 0, op, keepdim=False)
                                            for _, ts in x.lines(axis)])

    @staticmethod
    def all_gather(x, nd, axis, dim, n):
        return CellGrid._collapse(x, axis, [torch.cat(ts, dim) for _, ts in x.lines(axis)])

    @staticmethod
    def reduce_scatter(x, nd, axis, dim, op, n):
        out = {}
        for cs, ts in x.lines(axis):
            for c, piece in zip(cs, chunks(reduce(stack(ts), 0, op, keepdim=False), dim, n)):
                out[c] = piece
        return Cells(x.lead, [out[c] for c in x.coords()])

    @staticmethod
    def all_to_all_sent(ts, split_dim, n) -> int:
        """Bytes the busiest of one group's ranks (their shards ``ts``, in group order)
        sends in :meth:`all_to_all` (:func:`all_to_all_sent`)."""
        return all_to_all_sent([tuple(t.shape) for t in ts], split_dim, n,
                               ts[0].element_size() if ts else 0)

    @staticmethod
    def all_to_all(x, nd, axis, split_dim, concat_dim, n):
        out = {}
        for cs, ts in x.lines(axis):
            pieces = [chunks(t, split_dim, n) for t in ts]
            for j, c in enumerate(cs):
                out[c] = torch.cat([pieces[k][j] for k in range(n)], concat_dim)
        return Cells(x.lead, [out[c] for c in x.coords()])

    @staticmethod
    def expand(x, axis, n):
        return x.with_axis(axis, n, lambda c: x[c[:axis] + (0,) + c[axis + 1:]])

    @staticmethod
    def pick(x, axis, root):
        return CellGrid._collapse(x, axis, [ts[root] for _, ts in x.lines(axis)])


def ops_for(x):
    """The operations for the form ``x`` takes."""
    return CellGrid if isinstance(x, Cells) else Stacked
