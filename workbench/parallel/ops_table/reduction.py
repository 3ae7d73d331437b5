"""Reductions (sum, mean, amax, amin, prod), scans (cumsum, cumprod), and softmax / log_softmax
(argmax, argmin and topk: ``sampling.py``).

Per mesh dim:

    S(d), d kept      -> S(d')      each shard reduces its own rows
    S(d), d reduced   -> P(sum)     sum, mean: partial sums   # sum(x) = sum_i sum(x_i)
                      -> P(max)     amax                      # max(x) = max_i max(x_i)
    P(sum)            -> P(sum)     sum, mean are linear
    softmax, cumsum over dim: dim whole on every rank (S(dim) -> R first);
    other dims pass; P(sum) passes cumsum (linear), not softmax.

Dims are wrapped by the parsers (an out-of-range dim is PyTorch's IndexError, never a
wrap), and by the rules again: ``wb.spmd.infer`` hands a rule the user's dims as given
(``dim=-1``), and a rule must decide for them what the dispatcher decides for the wrapped
dim (``tests/test_negdim.py``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..placement import Partial, Replicate, Shard
from . import costs
from ._util import shift, wrap_dim, wrap_dims
from .extreme_grad import extreme_form
from .samples import Sample
from .strategy import combine
from .table import TABLE, register

T = torch.Tensor
R = Replicate()


# ---- sum, mean, amax, amin -----------------------------------------------------------

def _norm_dims(dim, ndim):
    if dim is None:
        return tuple(range(ndim))
    return tuple(sorted(wrap_dims(dim, ndim)))


def reduction_options(x, dim, keepdim, kind, dtype=None):
    dims = _norm_dims(dim, x.ndim)
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim):
        if x.shape[d] <= 1:
            continue
        if d in dims:
            part = {"sum": "sum", "mean": "sum", "amax": "max", "amin": "min"}[kind]
            opts.append(((Shard(d),), (Partial(part),),
                         f"reduced dim {d} sharded: each rank reduces its shard, P({part})"))
        else:
            nd = d if keepdim else d - sum(1 for r in dims if r < d)
            opts.append(((Shard(d),), (Shard(nd),), f"kept dim {d} sharded passes through"))
    if kind in ("sum", "mean") and not _truncates(x.dtype, dtype):
        opts.append(((Partial("sum"),), (Partial("sum"),), "linear: P(sum) stays P(sum)"))
        # the mean of the parts' sums is the sum of their mean: P(avg) stays, no reduction
        # (DTensor's linear reduction strategy keeps any Partial of a sum / mean,
        # pytorch/pytorch torch/distributed/tensor/_ops/_math_ops.py
        # map_placements_after_reduction; was reduced first, and a bfloat16 P(avg)'s value
        # then depended on the path: wide seed 2015043, sum over a dim of size 1)
        opts.append(((Partial("avg"),), (Partial("avg"),), "linear: P(avg) stays P(avg)"))
    elif kind in ("amax", "amin"):
        p = "max" if kind == "amax" else "min"
        opts.append(((Partial(p),), (Partial(p),), f"P({p}) of a {kind} stays P({p})"))
    return opts


def _truncates(src, dtype):
    """``sum(dtype=int)`` of a float / complex: each element cast (truncated) before the
    sum, not a linear map of the parts (a float P(sum)'s parts truncated apart gave 2 off
    one device's sum, sweep17): no Partial passes."""
    return dtype is not None and not (dtype.is_floating_point or dtype.is_complex) and \
        (src.is_floating_point or src.is_complex)


def _reduction_rule(kind):
    def rule(x, dim=None, keepdim=False, dtype=None, **_):
        dim = _dims(dim, x.ndim)          # as the parse: () is every dim, -1 the last
        return combine(x.mesh.ndim, [reduction_options(x, dim, keepdim, kind, dtype)]
                       * x.mesh.ndim, 1)
    rule.__doc__ = f"{kind} over dims: sharded reduced dims give partial results."
    return rule


sum_rule, mean_rule, amax_rule, amin_rule = (_reduction_rule(k)
                                             for k in ("sum", "mean", "amax", "amin"))


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
        # a 0-d tensor's dim 0 (or -1) is the tensor itself: reduced as dim=None
        dims = tuple(range(nd, x.dim())) if dim is None or ln == 0 else \
            tuple(d + nd for d in dim)
        if not dims:                  # a 0-d tensor: reducing it is the identity (and cast)
            # (an integer / bool sums to int64; a complex stays complex: seed 2004150 wide)
            if kind == "sum" and dtype is None and not (x.dtype.is_floating_point
                                                        or x.dtype.is_complex):
                return x.to(torch.int64)
            if kind in ("amax", "amin"):  # torch's kernel on one element: its checks (a
                # complex raises NotImplementedError; here a result)
                return getattr(x.unsqueeze(-1), kind)(-1)
            return x if dtype is None else x.to(dtype)
        if kind == "sum":
            if dtype is None:           # the same overload, its arguments parsed sooner
                return x.sum(dims, keepdim)
            return x.sum(dims, keepdim=keepdim, dtype=dtype)
        if kind == "mean":
            # divide by the GLOBAL count: a shard's sum / N is a correct partial mean,
            # even for uneven shards
            if ctx is None:
                return x.mean(dims, keepdim=keepdim, dtype=dtype)
            shape = ctx.in_specs[0].shape
            n = math.prod(shape[d] for d in (range(ln) if dim is None or ln == 0 else dim))
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


_SAMPLES = {
    "sum": lambda g: [Sample(torch.sum, (g.rn(5, 6), 1)), Sample(torch.sum, (g.rn(5, 6),)),
                      Sample(torch.sum, (g.rn(5, 6), 0), {"keepdim": True}),
                      Sample(torch.sum, (g.ints(7, 3), 0))],
    "mean": lambda g: [Sample(torch.mean, (g.rn(5, 6), 0)),
                       Sample(torch.mean, (g.rn(5, 3, 2), (0, 2)))],
    "amax": lambda g: [Sample(torch.amax, (g.rn(5, 6), 1)),
                       Sample(torch.amax, (g.rn(5, 6), (0, 1)))],
    "amin": lambda g: [Sample(torch.amin, (g.rn(5, 6), 0)), Sample(torch.amin, (g.ints(7, 3), 1))],
}
for _k, _fs, _parse, _rule in (("sum", (torch.sum, T.sum), _sum_parse, sum_rule),
                               ("mean", (torch.mean, T.mean), _sum_parse, mean_rule),
                               ("amax", (torch.amax, T.amax), _minmax_parse, amax_rule),
                               ("amin", (torch.amin, T.amin), _minmax_parse, amin_rule)):
    register(_k, _fs, parse=_parse, rule=_rule, local=_reduction(_k),
             cost=costs.reduction(1), op_class="reduction",           # one add / compare each
             sample=_SAMPLES[_k])
for _k in ("amax", "amin"):     # a tie across ranks: torch's even gradient (extreme_grad.py)
    TABLE[_k].extra["other_form"] = extreme_form(_k, _minmax_parse)


# ---- softmax, log_softmax: along one dim ---------------------------------------------

def along_dim_options(x, dim, keepdim=True, linear=False):
    """dim whole; other dims pass (shifted when dim is dropped); P(sum) if linear.
    A negative dim counts from the end (the dispatcher's parse has wrapped it already;
    ``spmd.infer`` hands the rule the user's dim as given); out of range, torch's IndexError."""
    if dim is not None:
        dim = wrap_dim(dim, x.ndim)
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim):
        if (dim is None or d != dim) and x.shape[d] > 1 and dim is not None:
            o = d if keepdim or d < dim else d - 1
            opts.append(((Shard(d),), (Shard(o),), f"dim {d} sharded passes (op over {dim})"))
    if linear:
        opts.append(((Partial("sum"),), (Partial("sum"),), "linear: P(sum) stays P(sum)"))
    return opts


def softmax_rule(x, dim, **_):
    """softmax(dim): dim whole on every rank; other dims may stay sharded."""
    return combine(x.mesh.ndim, [along_dim_options(x, dim)] * x.mesh.ndim, 1)


def _softmax_parse(x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise TypeError("softmax(dim=None) on a DistTensor: give the dim to normalize, "
                        "e.g. softmax(x, dim=-1)")
    return (x,), {"dim": wrap_dim(dim, x.ndim), "dtype": dtype}


def _softmax_local(fn):
    def local(nd, ctx, x, dim, dtype=None):
        if x.dim() == nd:             # a 0-d tensor along its dim 0 (as torch)
            return fn(x.unsqueeze(-1), nd, dtype=dtype).squeeze(-1)
        return fn(x, shift(dim, x.dim() - nd, nd), dtype=dtype)
    return local


# softmax: max, subtract, exp, sum, divide: 5 FLOPs per element (log_softmax: max,
# subtract, exp, sum, log per row, subtract: 5)
for _n, _fs in (("softmax", (torch.softmax, T.softmax, F.softmax)),
                ("log_softmax", (torch.log_softmax, T.log_softmax, F.log_softmax))):
    register(_n, _fs, parse=_softmax_parse, rule=softmax_rule,
             local=_softmax_local(getattr(torch, _n)), cost=costs.elementwise(5),
             op_class="norm", sample={
                 "softmax": lambda g: [Sample(torch.softmax, (g.rn(5, 6), -1))],
                 "log_softmax": lambda g: [Sample(F.log_softmax, (g.rn(5, 6), 0))]}[_n])


# ---- cumsum --------------------------------------------------------------------------

def cumsum_rule(x, dim, dtype=None, **_):
    """cumsum(dim): dim whole (a scan crosses shards); other dims pass; linear, but for
    ``dtype=`` an integer of a float / complex: each element is truncated before the scan
    (as sum's :func:`_truncates`), so a Partial is reduced first (was: P(sum) passed, each
    part truncated apart, 1-3 off one device's cumsum: tests/test_sweep18.py)."""
    linear = not _truncates(x.dtype, dtype)
    return combine(x.mesh.ndim, [along_dim_options(x, dim, linear=linear)] * x.mesh.ndim, 1)


def _cumsum_parse(x, dim, *, dtype=None):
    return (x,), {"dim": wrap_dim(dim, x.ndim), "dtype": dtype}


def _cumsum_local(nd, ctx, x, dim, dtype=None):
    if x.dim() == nd:                 # a 0-d tensor along its dim 0 (as torch)
        return torch.cumsum(x.unsqueeze(-1), nd, dtype=dtype).squeeze(-1)
    return torch.cumsum(x, shift(dim, x.dim() - nd, nd), dtype=dtype)


register("cumsum", [torch.cumsum, T.cumsum], parse=_cumsum_parse, rule=cumsum_rule,
         local=_cumsum_local, cost=costs.reduction(1), op_class="reduction",   # one add each
         sample=lambda g: [Sample(torch.cumsum, (g.rn(5, 6), 1)),
                           Sample(torch.cumsum, (g.ints(7, 3), -2))])


# ---- prod, cumprod -------------------------------------------------------------------
# A product has no Partial placement (P(sum) is a sum): the reduced / scanned dim is
# whole on every rank (S(dim) -> R first); other dims pass. Integers and bools give
# int64 (torch's promotion for prod / cumprod), unless dtype= is given.

def prod_rule(x, dim=None, keepdim=False, **_):
    """prod over ``dim`` (None: every dim): that dim whole; other dims pass."""
    if dim is None:
        return combine(x.mesh.ndim, [[((R,), (R,), "replicated")]] * x.mesh.ndim, 1)
    return combine(x.mesh.ndim, [along_dim_options(x, dim, keepdim)] * x.mesh.ndim, 1)


def _prod_parse(x, *args, **kwargs):
    """``prod(x, *, dtype)`` (every element) or ``prod(x, dim, keepdim=False, *, dtype)``."""
    dtype = kwargs.pop("dtype", None)
    if not args and "dim" not in kwargs:
        if kwargs:
            raise TypeError(f"prod(): unexpected arguments {sorted(kwargs)}")
        return (x,), {"dim": None, "keepdim": False, "dtype": dtype}
    dim = kwargs.pop("dim") if "dim" in kwargs else args[0]
    keepdim = kwargs.pop("keepdim", args[1] if len(args) > 1 else False)
    if kwargs or len(args) > 2:
        raise TypeError(f"prod(): unexpected arguments {sorted(kwargs) or args[2:]}")
    if isinstance(dim, (tuple, list)):       # torch.prod takes one int dim
        raise TypeError(f"prod(dim={dim!r}): dim is one int on torch.prod; reduce one dim "
                        "at a time, or flatten first")
    return (x,), {"dim": wrap_dim(dim, x.ndim), "keepdim": bool(keepdim), "dtype": dtype}


def _int64(x, dtype):
    if dtype is None and not (x.dtype.is_floating_point or x.dtype.is_complex):
        return torch.int64
    return dtype


def _prod_local(nd, ctx, x, dim=None, keepdim=False, dtype=None):
    dtype = _int64(x, dtype)
    if x.dim() == nd:                 # a 0-d tensor: itself (cast)
        return x.clone() if dtype is None else x.to(dtype)
    if dim is None:                   # every dim (replicated): over the flattened tensor
        return x.reshape(tuple(x.shape[:nd]) + (-1,)).prod(nd, dtype=dtype)
    return x.prod(dim + nd, keepdim=keepdim, dtype=dtype)


def _cumprod_parse(x, dim, *, dtype=None):
    return (x,), {"dim": wrap_dim(dim, x.ndim), "dtype": dtype}


def cumprod_rule(x, dim, **_):
    """cumprod(dim): dim whole (a scan crosses shards); other dims pass; no Partial."""
    return combine(x.mesh.ndim, [along_dim_options(x, dim)] * x.mesh.ndim, 1)


def _cumprod_local(nd, ctx, x, dim, dtype=None):
    dtype = _int64(x, dtype)
    if x.dim() == nd:
        return x.clone() if dtype is None else x.to(dtype)
    return torch.cumprod(x, dim + nd, dtype=dtype)


register("prod", [torch.prod, T.prod], parse=_prod_parse, rule=prod_rule, local=_prod_local,
         cost=costs.reduction(1), op_class="reduction",              # one multiply each
         sample=lambda g: [Sample(torch.prod, (g.rn(5, 6), 1)), Sample(torch.prod, (g.rn(3, 4),)),
                           Sample(torch.prod, (g.rn(7, 3), 0), {"keepdim": True}),
                           Sample(torch.prod, (g.ints(7, 3, lo=-2, hi=3), 0))])
register("cumprod", [torch.cumprod, T.cumprod], parse=_cumprod_parse, rule=cumprod_rule,
         local=_cumprod_local, cost=costs.reduction(1), op_class="reduction",
         sample=lambda g: [Sample(torch.cumprod, (g.rn(5, 6), 1)),
                           Sample(torch.cumprod, (g.rn(7, 3, dtype=torch.float64), 0),
                                  {"dtype": torch.float32})])
