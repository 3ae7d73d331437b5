"""Reductions, scans, arg-reductions, topk, softmax. Rules: ``rules/reduction.py``.
Dims are wrapped here (an out-of-range dim is PyTorch's IndexError, never a wrap)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..rules import reduction as rr
from . import costs
from ._util import shift, wrap_dim, wrap_dims
from .table import register

T = torch.Tensor


def _dims(dim, ndim):
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return None
    return tuple(sorted(wrap_dims(dim, ndim)))


def _sum_parse(x, dim=None, keepdim=False, *, dtype=None):
    return (x,), {"dim": _dims(dim, x.ndim), "keepdim": bool(keepdim), "dtype": dtype}


def _minmax_parse(x, dim=(), keepdim=False):
    return (x,), {"dim": _dims(dim, x.ndim), "keepdim": bool(keepdim), "dtype": None}


def _reduction(kind):
    def local(nd, ctx, x, dim=None, keepdim=False, dtype=None):
        ln = x.dim() - nd
        dims = tuple(range(nd, x.dim())) if dim is None else tuple(d + nd for d in dim)
        if not dims:                  # a 0-d tensor: reducing it is the identity (and cast)
            if kind == "sum" and dtype is None and not x.dtype.is_floating_point:
                return x.to(torch.int64)
            return x if dtype is None else x.to(dtype)
        if kind == "sum":
            return x.sum(dims, keepdim=keepdim, dtype=dtype)
        if kind == "mean":
            # divide by the GLOBAL count: a shard's sum / N is a correct partial mean,
            # even for uneven shards
            if ctx is None:
                return x.mean(dims, keepdim=keepdim, dtype=dtype)
            shape = ctx.in_specs[0].shape
            n = math.prod(shape[d] for d in (range(ln) if dim is None else dim))
            return x.sum(dims, keepdim=keepdim, dtype=dtype) / n
        if any(x.shape[d] == 0 for d in dims):       # an empty shard: max's identity
            shape = x.sum(dims, keepdim=keepdim).shape
            if x.dtype == torch.bool:
                ident = kind == "amin"                # or: False; and: True
            elif x.dtype.is_floating_point or x.dtype.is_complex:
                ident = float("-inf") if kind == "amax" else float("inf")
            else:                                      # integers have no inf: their extremes
                info = torch.iinfo(x.dtype)
                ident = info.min if kind == "amax" else info.max
            return torch.full(shape, ident, dtype=x.dtype, device=x.device)
        if kind == "amax":
            return x.amax(dims, keepdim=keepdim)
        return x.amin(dims, keepdim=keepdim)
    return local


for _k, _fs, _parse, _rule in (("sum", (torch.sum, T.sum), _sum_parse, rr.sum_rule),
                               ("mean", (torch.mean, T.mean), _sum_parse, rr.mean_rule),
                               ("amax", (torch.amax, T.amax), _minmax_parse, rr.amax_rule),
                               ("amin", (torch.amin, T.amin), _minmax_parse, rr.amin_rule)):
    register(_k, _fs, parse=_parse, rule=_rule, local=_reduction(_k),
             cost=costs.reduction(1), op_class="reduction")          # one add / compare each


# ---- softmax, log_softmax -----------------------------------------------------------------

def _softmax_parse(x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise TypeError("softmax(dim=None) on a DistTensor: give the dim to normalize, "
                        "e.g. softmax(x, dim=-1)")
    return (x,), {"dim": wrap_dim(dim, x.ndim), "dtype": dtype}


def _softmax_local(fn):
    def local(nd, ctx, x, dim, dtype=None):
        return fn(x, shift(dim, x.dim() - nd, nd), dtype=dtype)
    return local


# softmax: max, subtract, exp, sum, divide: 5 FLOPs per element (log_softmax: max,
# subtract, exp, sum, log per row, subtract: 5)
for _n, _fs in (("softmax", (torch.softmax, T.softmax, F.softmax)),
                ("log_softmax", (torch.log_softmax, T.log_softmax, F.log_softmax))):
    register(_n, _fs, parse=_softmax_parse, rule=rr.softmax_rule,
             local=_softmax_local(getattr(torch, _n)), cost=costs.elementwise(5),
             op_class="norm")


# ---- cumsum, argmax / argmin, topk ------------------------------------------------------

def _cumsum_parse(x, dim, *, dtype=None):
    return (x,), {"dim": wrap_dim(dim, x.ndim), "dtype": dtype}


def _cumsum_local(nd, ctx, x, dim, dtype=None):
    return torch.cumsum(x, shift(dim, x.dim() - nd, nd), dtype=dtype)


register("cumsum", [torch.cumsum, T.cumsum], parse=_cumsum_parse, rule=rr.cumsum_rule,
         local=_cumsum_local, cost=costs.reduction(1), op_class="reduction")   # one add each


def _arg_parse(x, dim=None, keepdim=False):
    return (x,), {"dim": None if dim is None else wrap_dim(dim, x.ndim), "keepdim": bool(keepdim)}


def _arg_local(fn):
    def local(nd, ctx, x, dim=None, keepdim=False):
        if dim is None:               # over the flattened local tensor (replicated only)
            flat = x.reshape(tuple(x.shape[:nd]) + (-1,))
            out = fn(flat, nd)
            return out.reshape(tuple(x.shape[:nd]) + (1,) * (x.dim() - nd)) if keepdim else out
        return fn(x, shift(dim, x.dim() - nd, nd), keepdim=keepdim)
    return local


for _n in ("argmax", "argmin"):
    register(_n, [getattr(torch, _n), getattr(T, _n)], parse=_arg_parse, rule=rr.arg_rule,
             local=_arg_local(getattr(torch, _n)), cost=costs.reduction(1),
             op_class="reduction")                                      # one compare each


def _topk_parse(x, k, dim=-1, largest=True, sorted=True):
    return (x,), {"k": int(k), "dim": wrap_dim(dim, x.ndim), "largest": bool(largest),
                  "sorted": bool(sorted)}


def _topk_local(nd, ctx, x, k, dim, largest, sorted):
    return tuple(torch.topk(x, k, shift(dim, x.dim() - nd, nd), largest, sorted))


def _topk_cost(ins, outs, k, **_):
    """A heap selection: each element compared with the heap root and, when it enters,
    sifted down log2(k) levels (Knuth, TAOCP vol. 3, 5.2.3): n ceil(log2(k + 1))."""
    n = ins[0].numel()
    f = n * max(1, math.ceil(math.log2(k + 1)))
    return costs.Cost(f, costs.nbytes(ins[0]) + sum(costs.nbytes(o) for o in outs), 0,
                      costs.backward_bytes(ins, outs[:1], costs.nbytes(outs[1])))


register("topk", [torch.topk, T.topk], parse=_topk_parse, rule=rr.topk_rule,
         local=_topk_local, cost=_topk_cost, op_class="reduction", n_out=2)
TOPK_RESULT = torch.return_types.topk
