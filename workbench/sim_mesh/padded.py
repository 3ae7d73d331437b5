"""Collectives on uneven shards over torch.distributed: pad, run the even collective, unpad.

The simulator holds uneven shards (``torch.chunk`` sizes: 75 rows over 2 ranks are 38, 37)
as cells and moves them exactly.  A process group's collectives need equal buffers, so
PyTorch DTensor pads every shard to the largest chunk before the collective and cuts the
padding off after it (torch 2.13, git cf30153, torch/distributed/tensor/placement_types.py
``Shard._split_tensor`` :184 and ``_to_replicate_tensor`` :591 (all-gather),
``_reduce_shard_tensor`` :475 (reduce-scatter), ``_to_new_shard_dim`` :739 (all-to-all);
``pad_tensor`` / ``unpad_tensor`` in _collective_utils.py :215 / :245).  The same here, for
the three collectives that change a shard's size.

``sizes`` are the group members' lengths along the moving dim, in group order (member k's
shard is the k-th piece of the group's block: ``parallel/dist_uneven.py`` computes them
from the layout, since a process sees only its own shard).  The padding travels on the
wire, as it does for DTensor; the trace records the layout's bytes (the simulator's).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .backends import reduce_scatter_single_, wire

__all__ = ["all_gather", "reduce_scatter", "all_to_all", "own_piece"]

def _pad(t, dim, size):
    """``t`` zero-padded at the end of ``dim`` to length ``size`` (DTensor's pad_tensor)."""
    extra = size - t.shape[dim]
    if extra == 0:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1 - dim) + [0, extra])


def own_piece(t, sizes, k, dim):
    """Member ``k``'s piece of ``t`` cut along ``dim`` into ``sizes`` (a gradient's local
    slice: no communication)."""
    return t.narrow(dim, sum(sizes[:k]), sizes[k]).contiguous()


def all_gather(t, pg, sizes, dim):
    """Every member's shard along ``dim`` (of lengths ``sizes``), side by side."""
    n, m = len(sizes), max(sizes)
    p = _pad(wire(t), dim, m).contiguous()       # (a conjugate view resolved)
    out = torch.empty(n * p.numel(), dtype=t.dtype, device=t.device)
    dist.all_gather_single(out, p.reshape(-1), group=pg)
    parts = out.reshape((n,) + tuple(p.shape)).unbind(0)
    return torch.cat([q.narrow(dim, 0, s) for q, s in zip(parts, sizes)], dim)


def reduce_scatter(t, pg, sizes, dim, op="sum"):
    """``op`` over the group, then member k keeps its piece of length ``sizes[k]``."""
    m = max(sizes)
    pieces = torch.stack([_pad(c, dim, m).contiguous() for c in t.split(list(sizes), dim)])
    out = torch.empty(pieces[0].numel(), dtype=t.dtype, device=t.device)
    reduce_scatter_single_(out, pieces.reshape(-1), op, pg)     # NaN kept by max / min
    k = dist.get_group_rank(pg, dist.get_rank())
    return out.reshape(pieces.shape[1:]).narrow(dim, 0, sizes[k])


def all_to_all(x, pg, k, split_sizes, concat_sizes, split_dim, concat_dim):
    """Member ``k`` cuts ``split_dim`` into ``split_sizes``, sends piece j to member j,
    and concatenates what it receives along ``concat_dim`` (member j's piece is
    ``concat_sizes[j]`` long there)."""
    ms, mc = max(split_sizes), max(concat_sizes)
    send = []
    for c in x.split(list(split_sizes), split_dim):
        send.append(_pad(_pad(c, split_dim, ms), concat_dim, mc).contiguous())
    send = torch.stack(send)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    return torch.cat([q.narrow(split_dim, 0, split_sizes[k]).narrow(concat_dim, 0, c)
                      for q, c in zip(recv.unbind(0), concat_sizes)], concat_dim)


def _all_reduce(t, pg):
    t = t.contiguous().clone()
    dist.all_reduce(t, group=pg)
    return t


# ---- differentiable, with the simulator's autograd contract (backends.py) ---------------

class AllGather(torch.autograd.Function):
    """S(dim) -> R on uneven shards; backward: a reduce-scatter where every rank used its
    own view (``expanded``), else this rank's slice of the one copy's gradient."""

    @staticmethod
    def forward(ctx, x, pg, sizes, k, dim, expanded):
        ctx.pg, ctx.sizes, ctx.k, ctx.dim, ctx.expanded = pg, sizes, k, dim, expanded
        return all_gather(x, pg, sizes, dim)

    @staticmethod
    def backward(ctx, g):
        if ctx.expanded:
            g = reduce_scatter(g, ctx.pg, ctx.sizes, ctx.dim)
        else:
            g = own_piece(g, ctx.sizes, ctx.k, ctx.dim)
        return g, None, None, None, None, None


class ReduceScatter(torch.autograd.Function):
    """P -> S(dim) on uneven shards; backward: the all-gather of the gradient's shards."""

    @staticmethod
    def forward(ctx, x, pg, sizes, dim, op):
        ctx.pg, ctx.sizes, ctx.dim = pg, sizes, dim
        return reduce_scatter(x, pg, sizes, dim, op)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.pg, ctx.sizes, ctx.dim), None, None, None, None


class AllToAll(torch.autograd.Function):
    """S(concat_dim) -> S(split_dim) on uneven shards; backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, pg, k, split_sizes, concat_sizes, split_dim, concat_dim):
        ctx.args = (pg, k, concat_sizes, split_sizes, concat_dim, split_dim)
        return all_to_all(x, pg, k, split_sizes, concat_sizes, split_dim, concat_dim)

    @staticmethod
    def backward(ctx, g):
        return (all_to_all(g, *ctx.args),) + (None,) * 6


class SliceOwn(torch.autograd.Function):
    """R -> S(dim) on uneven shards: keep this rank's piece; backward all-gathers the
    gradient (R), as backends.SliceOwn does for even ones."""

    @staticmethod
    def forward(ctx, x, pg, sizes, k, dim):
        ctx.pg, ctx.sizes, ctx.dim = pg, sizes, dim
        return own_piece(x, sizes, k, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.pg, ctx.sizes, ctx.dim), None, None, None, None
