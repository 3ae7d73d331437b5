"""Reductions (sum, mean, amax, amin) and softmax / log_softmax.

Per mesh dim:

    S(d), d kept      -> S(d')      each shard reduces its own rows
    S(d), d reduced   -> P(sum)     sum, mean: partial sums   # sum(x) = sum_i sum(x_i)
                      -> P(max)     amax                      # max(x) = max_i max(x_i)
    P(sum)            -> P(sum)     sum, mean are linear
    softmax(dim): the normalized dim must be whole on every rank (S(dim) -> R first);
    other dims pass; partial inputs are reduced first (softmax is not linear).
"""
from __future__ import annotations

from ..placement import Partial, Replicate, Shard
from .registry import combine, register_rule

R = Replicate()


def _norm_dims(dim, ndim):
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(sorted(d % ndim for d in dim)) if ndim else ()


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


for _k in ("sum", "mean", "amax", "amin"):
    register_rule(_k)(_reduction_rule(_k))


@register_rule("softmax", "log_softmax")
def softmax_rule(x, dim, **_):
    """softmax(dim): dim whole on every rank; other dims may stay sharded."""
    dim = dim % x.ndim
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim):
        if d != dim and x.shape[d] > 1:
            opts.append(((Shard(d),), (Shard(d),), f"dim {d} sharded passes (softmax over {dim})"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)
