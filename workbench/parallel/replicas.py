"""Replicas on torch.distributed: made equal (broadcast) or checked equal.

On simulated ranks a global tensor is one object, so its replicas cannot differ; on
torch.distributed every process holds its own copy and nothing keeps them equal.  As
``torch.distributed.tensor.distribute_tensor`` does (``src_data_rank=0``: "the rank of
the source data for the logical/global tensor ... we use group_rank=0 on each
DeviceMesh dimension as the source data to preserve the single-device semantic"),
:func:`broadcast_global` gives every process the tensor of the process at group index
``src`` on every mesh dim, and :func:`check_replicas` (the debug check of
``from_local(..., check_replicas=True)``) compares each process's copy with its group's
first rank's and raises on every process of the group if one differs.  Both first
check that shapes and dtypes agree (a broadcast of unequal sizes would hang or
corrupt), with an all-reduce of a fixed-size header (max == min).
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ..sim_mesh import backends as _B

__all__ = ["broadcast_global", "check_replicas"]

_MAX_DIMS = 64                      # torch's own limit on a tensor's number of dims


def _header(t):
    """(ndim, dtype code, shape padded with -1): equal on two processes iff both hold
    tensors of the same shape and dtype.  crc32: the same on every process."""
    h = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
    h[0], h[1] = t.dim(), zlib.crc32(str(t.dtype).encode())
    h[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _same_layout(t, mesh, axis, fn, arg) -> None:
    pg, ranks = _B.group(mesh, axis)
    hi, lo = _header(t), -_header(t)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=pg)
    dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=pg)
    if not torch.equal(hi, -lo):
        raise ValueError(f"{fn}({arg}): the processes {list(ranks)} along mesh dim "
                         f"{mesh.dim_names[axis]!r} hold tensors of different shapes or dtypes "
                         f"(this process, rank {dist.get_rank()}: {tuple(t.shape)} {t.dtype}); "
                         "give every process the same global tensor")


class _TakeValue(torch.autograd.Function):
    """The value of ``src`` (the source rank's), the gradient to the local ``x``."""

    @staticmethod
    def forward(ctx, x, src):
        return src

    @staticmethod
    def backward(ctx, g):
        return g, None


def broadcast_global(x: torch.Tensor, mesh, src: int, fn: str = "shard_tensor"):
    """Every process's copy of the global ``x`` becomes the one of the process at index
    ``src`` along every mesh dim (one broadcast per dim of size > 1).  ``x`` is not
    modified; a result that requires grad passes its gradient to this process's ``x``."""
    b = x.detach().clone(memory_format=torch.contiguous_format)
    for axis, n in enumerate(mesh.shape):
        if n > 1:
            _same_layout(x, mesh, axis, fn, "x")
            _B.broadcast_(b, mesh, axis, root=src)
    return _TakeValue.apply(x, b) if x.requires_grad else b


def check_replicas(t: torch.Tensor, mesh, placements, fn: str = "from_local") -> None:
    """Raise (on every process of the group) if this process's ``t`` differs from its
    group's first rank's along a mesh dim where ``placements`` say Replicate."""
    for axis, p in enumerate(placements):
        if not p.is_replicate() or mesh.shape[axis] == 1:
            continue
        _same_layout(t, mesh, axis, fn, "locals_")
        pg, ranks = _B.group(mesh, axis)
        b = t.detach().clone(memory_format=torch.contiguous_format)
        _B.broadcast_(b, mesh, axis, root=0)
        me = ranks.index(dist.get_rank())
        flag = torch.tensor([0 if torch.equal(b, t.detach()) else me + 1], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
        if flag.item():
            raise ValueError(
                f"{fn}(check_replicas=True): rank {ranks[flag.item() - 1]} holds a different "
                f"tensor than rank {ranks[0]} under Replicate() on mesh dim "
                f"{mesh.dim_names[axis]!r} (processes {list(ranks)}); make the copies equal "
                "(wb.shard_tensor broadcasts from the first rank), use Partial() if they are "
                "parts of a sum, or pass check_replicas=False")
