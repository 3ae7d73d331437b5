"""``torch.searchsorted``: where each value would go in a sorted
innermost dim (a binary search per value: pytorch/pytorch 059ed76,
aten/src/ATen/native/Bucketization.cpp, ``cus_lower_bound`` / ``cus_upper_bound``).

``sorted_sequence`` is 1-D (searched for every value) or N-D with the values' leading
dims (row i of the values searched in row i of the sequence); the output has the
values' shape, int64 (int32 with ``out_int32``).  Per mesh dim:

    sequence R,    values R                 -> R
    sequence R,    values S(d)              -> S(d)    each rank searches its own values
                                                       in the whole sequence
    sequence S(b), values S(b), b a leading -> S(b)    (N-D) each rank its own rows
                   (batch) dim
    sequence S(last)                        -> whole   the search dim is gathered first

The search dim stays whole: the count of a shard's elements below a value would sum to
the global position for a clean sorted sequence, but a NaN (sorted last) breaks the
binary search's order, so the shards' answers would not add up to torch's; the
dispatcher gathers it (an all-gather in the trace).  ``sorter`` (the argsort of an
unsorted sequence) is laid out as the sequence.  No Partial passes.  (``bucketize``,
the same search with 1-D boundaries, has its rule in ``pointwise_math.py``.)
"""
from __future__ import annotations

import math

import torch

from ..placement import Replicate, Shard
from . import costs
from .samples import Sample
from .strategy import combine
from .table import register
from ._util import broadcast_shapes

__all__ = ["searchsorted_rule"]

R = Replicate()


def searchsorted_rule(seq, values=None, sorter=None, **_):
    """searchsorted: the sequence's search dim whole; the values' dims (and, N-D, the
    leading dims both share) pass."""
    n_in = 1 + (values is not None) + (sorter is not None)
    opts = [((R,) * n_in, (R,), "replicated")]
    m = seq.ndim
    if values is not None:
        if m == 1:
            for d in range(values.ndim):
                if values.shape[d] > 1:
                    opts.append(((R, Shard(d)) + ((R,) if sorter is not None else ()),
                                 (Shard(d),), f"values dim {d} sharded: each rank searches "
                                 "its own values in the whole sequence"))
        else:
            for b in range(m - 1):
                if seq.shape[b] > 1:
                    opts.append(((Shard(b),) * n_in, (Shard(b),),
                                 f"leading dim {b} sharded on both: each rank its own rows"))
            if values.shape[m - 1] > 1:
                opts.append(((R, Shard(m - 1)) + ((R,) if sorter is not None else ()),
                             (Shard(m - 1),), "the values' last dim sharded: each rank "
                             "searches its own values in the whole rows"))
    return combine(seq.mesh.ndim, [opts] * seq.mesh.ndim, n_in)


def _parse(sorted_sequence, input, *, out_int32=False, right=False, side=None, out=None,
           sorter=None):
    if out is not None:
        raise TypeError("searchsorted(out=...) on a DistTensor: assign the result")
    if side is not None and side not in ("left", "right"):
        raise RuntimeError(f"torch.searchsorted(): side can only be 'left' or 'right' but "
                           f"got {side}")
    if side is not None and right and side == "left":
        raise RuntimeError("torch.searchsorted(): side and right can't be set to opposites, "
                           "got side of left while right was True")
    attrs = {"right": bool(right) or side == "right", "out_int32": bool(out_int32)}
    if isinstance(input, (int, float)) and not isinstance(input, bool):
        attrs["scalar"] = input                 # one value: a 0-d output
        ins = (sorted_sequence,)
        if sorter is not None:
            raise NotImplementedError("searchsorted(sequence, scalar, sorter=...) on a "
                                      "DistTensor: give the value as a tensor")
        return ins, attrs
    ins = (sorted_sequence, input) + ((sorter,) if sorter is not None else ())
    return ins, attrs


def _local(nd, ctx, seq, values=None, sorter=None, *, right, out_int32, scalar=None):
    m = seq.dim() - nd
    if values is None:                                  # a scalar value
        # torch wraps the scalar as a number (searchsorted_scalar_tensor): the search
        # compares in the promoted dtype (2.5 in an int64 sequence is not 2)
        values = torch.full(tuple(seq.shape[:nd]), scalar, device=seq.device,
                            dtype=torch.result_type(seq, scalar))
    ts = [seq, values] + ([sorter] if sorter is not None else [])
    lead = broadcast_shapes(*[tuple(t.shape[:nd]) for t in ts])
    seq, values, *rest = [t.expand(lead + tuple(t.shape[nd:])).contiguous() for t in ts]
    srt = rest[0] if rest else None
    vshape = tuple(values.shape[nd:])
    if m == 1 and nd:                                   # one sequence, any values: rows
        values = values.reshape(lead + (-1,))
    out = torch.searchsorted(seq, values, right=right, out_int32=out_int32, sorter=srt)
    return out.reshape(lead + vshape)


def _cost(ins, outs, **_):
    """A binary search per value: ceil(log2(n + 1)) compares in a row of n
    (``cus_lower_bound``); the values and the sequence read, the positions written."""
    seq = ins[0]
    n = seq.shape[-1] if seq.dim() else 1
    f = outs[0].numel() * max(1, math.ceil(math.log2(n + 1)))
    return costs.Cost(f, sum(costs.nbytes(t) for t in ins) + costs.nbytes(outs[0]), 0, 0)


register("searchsorted", [torch.searchsorted], parse=_parse, rule=searchsorted_rule,
         local=_local, cost=_cost, op_class="data_movement",
         sample=lambda g: [
             Sample(torch.searchsorted, (torch.sort(g.rn(8)).values, g.rn(5, 6))),
             Sample(torch.searchsorted, (torch.sort(g.grid(7)).values, g.grid(4, 3)),
                    {"right": True}),
             Sample(torch.searchsorted, (torch.sort(g.rn(4, 6), dim=1).values, g.rn(4, 3))),
             Sample(torch.searchsorted, (torch.sort(g.rn(8)).values, 0.25))])
