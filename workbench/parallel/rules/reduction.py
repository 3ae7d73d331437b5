"""Reductions (sum, mean, amax, amin, argmax, argmin), scans (cumsum), topk, and
softmax / log_softmax.

Per mesh dim:

    S(d), d kept      -> S(d')      each shard reduces its own rows
    S(d), d reduced   -> P(sum)     sum, mean: partial sums   # sum(x) = sum_i sum(x_i)
                      -> P(max)     amax                      # max(x) = max_i max(x_i)
    P(sum)            -> P(sum)     sum, mean are linear
    softmax, cumsum, argmax, topk over dim: dim whole on every rank (S(dim) -> R first);
    other dims pass; P(sum) passes cumsum (linear), not softmax/argmax/topk.

Dims reach the rules wrapped (non-negative) by the op table's parsers.
"""
from __future__ import annotations

from ..placement import Partial, Replicate, Shard
from .registry import combine

R = Replicate()


def _norm_dims(dim, ndim):
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(sorted(dim))


def reduction_options(x, dim, keepdim, kind):
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
    if kind in ("sum", "mean"):
        opts.append(((Partial("sum"),), (Partial("sum"),), "linear: P(sum) stays P(sum)"))
    elif kind in ("amax", "amin"):
        p = "max" if kind == "amax" else "min"
        opts.append(((Partial(p),), (Partial(p),), f"P({p}) of a {kind} stays P({p})"))
    return opts


def _reduction_rule(kind):
    def rule(x, dim=None, keepdim=False, **_):
        return combine(x.mesh.ndim, [reduction_options(x, dim, keepdim, kind)] * x.mesh.ndim, 1)
    rule.__doc__ = f"{kind} over dims: sharded reduced dims give partial results."
    return rule


sum_rule, mean_rule, amax_rule, amin_rule = (_reduction_rule(k)
                                             for k in ("sum", "mean", "amax", "amin"))


def along_dim_options(x, dim, keepdim=True, linear=False):
    """dim whole; other dims pass (shifted when dim is dropped); P(sum) if linear."""
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


def cumsum_rule(x, dim, **_):
    """cumsum(dim): dim whole (a scan crosses shards); other dims pass; linear."""
    return combine(x.mesh.ndim, [along_dim_options(x, dim, linear=True)] * x.mesh.ndim, 1)


def arg_rule(x, dim=None, keepdim=False, **_):
    """argmax / argmin(dim): dim whole (indices are global); other dims pass; dim=None
    (over the flattened tensor): replicated."""
    if dim is None:
        return combine(x.mesh.ndim, [[((R,), (R,), "replicated")]] * x.mesh.ndim, 1)
    return combine(x.mesh.ndim, [along_dim_options(x, dim, keepdim)] * x.mesh.ndim, 1)


def topk_rule(x, k, dim, **_):
    """topk(k, dim): dim whole; other dims pass to both outputs (values, indices)."""
    opts = [(ins, outs * 2, note) for ins, outs, note in along_dim_options(x, dim)]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1, n_outputs=2)
