"""``torch.take``: elements of the input, read as 1-D in row-major order, at ``index``.

Per mesh dim (the input must be whole: an element's flat position mixes every dim):

    input R, index R      -> R
    input R, index S(d)   -> S(d)    each rank reads its own positions (the output has
                                     index's shape)

A sharded input is gathered first (the dispatcher's reshard: recorded in the trace); a
Partial input does not pass (the cheapest: reduced first).  Out-of-range positions raise
torch's ``IndexError``; negative ones count from the end, as torch.
"""
from __future__ import annotations

import torch

from ..placement import Replicate, Shard
from . import costs
from .samples import Sample
from .strategy import combine
from .table import register
from ._util import broadcast_shapes

__all__ = ["take_rule"]

R = Replicate()
T = torch.Tensor


def take_rule(x, index, **_):
    """take: the input replicated; index's dims pass to the output."""
    opts = [((R, R), (R,), "replicated")]
    opts += [((R, Shard(d)), (Shard(d),), f"index dim {d} sharded: each rank reads its own "
              "positions of the whole input") for d in range(index.ndim) if index.shape[d] > 1]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 2)


def _scalar_name(dtype) -> str:
    """torch's name of a dtype in its messages: Int, Short, Byte, BFloat16, Float."""
    return torch.empty(0, dtype=dtype).type().replace("torch.", "").replace("Tensor", "")


def _parse(x, index):
    if index.dtype != torch.int64:
        raise RuntimeError(f"take(): Expected a long tensor for index, but got "
                           f"{_scalar_name(index.dtype)}")
    return (x, index), {}


def _local(nd, ctx, x, index):
    if ctx is None:                                   # output shapes only (meta)
        return torch.take(x, index)
    n = x[(0,) * nd].numel()
    if index.numel():
        bad = (index < -n) | (index >= n)
        if bool(bad.any()):
            raise IndexError(f"out of range: tried to access index {int(index[bad][0])} on a "
                             f"tensor of {n} elements.")
    lead = broadcast_shapes(x.shape[:nd], index.shape[:nd])
    flat = x.reshape(tuple(x.shape[:nd]) + (n,)).expand(lead + (n,))
    pos = index.expand(lead + tuple(index.shape[nd:])).reshape(lead + (-1,))
    out = torch.gather(flat, nd, torch.where(pos < 0, pos + n, pos))
    return out.reshape(lead + tuple(index.shape[nd:]))


register("take", [torch.take, T.take], parse=_parse, rule=take_rule, local=_local,
         cost=costs.movement, op_class="data_movement",
         sample=lambda g: [Sample(torch.take, (g.rn(5, 6), g.ints(4, 3, lo=-30, hi=30))),
                           Sample(torch.take, (g.rn(7,), g.ints(6, lo=0, hi=7)))])
