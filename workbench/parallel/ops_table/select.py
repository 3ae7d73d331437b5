"""Selections and masks, elementwise: clamp, where, masked_fill, triu / tril.

Per mesh dim (with :func:`pointwise.pointwise_options` for the elementwise part):

    clamp(x, lo, hi)        non-decreasing in x: P(max) / P(min) pass
    where(c, x, y)          linear in (x, y) jointly for a replicated c:
                            where(c, sum a_i, sum b_i) = sum where(c, a_i, b_i)
    masked_fill(x, m, 0)    filling zeros is linear in x (P(sum) with m replicated)
    triu / tril             the last two dims whole (which entries are kept depends on
                            their global row and column); leading dims pass; every
                            Partial passes (every rank zeroes the same entries)
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from . import costs
from ._util import align, is_tensor
from .pointwise import monotone_rule, pointwise_local, pointwise_options, with_deferred
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["where_rule", "masked_fill_rule", "triangle_rule"]

T = torch.Tensor
R = Replicate()
P = Partial("sum")


# ---- clamp ---------------------------------------------------------------------------

def _clamp_parse(x, min=None, max=None):
    return (x, min, max), {}


# a 0-d bound promotes as on one device (a float64 0-d min of a float32 x: float32; stacked
# with its device axes it made a float64 result: seed 2007193 wide)
_clamp_local = pointwise_local(torch.clamp)


register("clamp", [torch.clamp, T.clamp, torch.clip, T.clip], parse=_clamp_parse,
         rule=monotone_rule, local=_clamp_local, cost=costs.elementwise(2),
         op_class="elementwise")                                    # min(max(x, lo), hi)


# ---- where ---------------------------------------------------------------------------

def where_rule(cond, x, y, **_):
    """where(cond, x, y): elementwise; linear in (x, y) jointly for a replicated cond."""
    specs = (cond, x, y)
    opts = pointwise_options(specs, "none")
    if x is not None and y is not None and cond is not None:
        opts.append(((R, P, P), (P,), "linear in (x, y): where(c, sum a_i, sum b_i) = "
                     "sum where(c, a_i, b_i)"))
    real = [s for s in specs if s is not None]
    return with_deferred(specs, combine(real[0].mesh.ndim, [opts] * real[0].mesh.ndim, 3))


def _where_sample(g):
    x = g.rn(5, 6)
    return [Sample(torch.where, (x > 0, x, g.rn(5, 6)))]


def _where_parse(condition, *xy):
    if len(xy) != 2:
        raise NotImplementedError(
            "torch.where(condition) (nonzero's form) on a DistTensor: the result's length "
            "depends on the values; use condition.full().nonzero(as_tuple=True), or give "
            "both branches: torch.where(condition, x, y)" if not xy else
            f"where() takes 3 arguments (condition, input, other), got {1 + len(xy)}")
    return (condition, *xy), {}


register("where", [torch.where, T.where], parse=_where_parse,
         rule=where_rule, local=pointwise_local(torch.where), cost=costs.elementwise(1),
         op_class="elementwise", sample=_where_sample)


# ---- masked_fill ---------------------------------------------------------------------

def masked_fill_rule(x, mask, value=None, *, fill=None, **_):
    """masked_fill: elementwise; a zero fill is linear in x (P(sum) with mask R)."""
    specs = (x, mask, value)
    opts = pointwise_options(specs, "none")
    if value is None and fill == 0:
        opts.append(((P, R, None), (P,), "filling zeros is linear in x"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 3)


def _masked_fill_parse(x, mask, value):
    if is_tensor(value):
        return (x, mask, value), {"fill": None}
    return (x, mask, None), {"fill": value}


def _masked_fill_local(nd, ctx, x, mask, value, fill):
    x, mask, value = align(nd, x, mask, value)
    if value is None:
        return x.masked_fill(mask, fill)
    return torch.where(mask, value.to(x.dtype), x)       # a 0-d value, one per rank


register("masked_fill", [torch.masked_fill, T.masked_fill], parse=_masked_fill_parse,
         rule=masked_fill_rule, local=_masked_fill_local, cost=costs.elementwise(1),
         op_class="elementwise")


# ---- triu / tril ---------------------------------------------------------------------

def triangle_rule(x, *, diagonal=0, **_):
    """triu / tril: the last two dims whole (which entries are kept depends on their
    global row and column); leading dims pass; linear, and P(max/min) pass (every rank
    zeroes the same entries)."""
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim - 2):
        if x.shape[d] > 1:
            opts.append(((Shard(d),), (Shard(d),), f"batch dim {d} sharded passes"))
    opts += [((Partial(op),), (Partial(op),), f"zeroing entries keeps P({op})")
             for op in ("sum", "avg", "max", "min")]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


def _triangle(fn):
    def local(nd, ctx, x, diagonal=0):
        return fn(x, diagonal)
    return local


for _n, _fn in (("triu", torch.triu), ("tril", torch.tril)):
    register(_n, [_fn, getattr(T, _n)],
             parse=lambda x, diagonal=0: ((x,), {"diagonal": int(diagonal)}),
             rule=triangle_rule, local=_triangle(_fn), cost=costs.elementwise(1),
             op_class="elementwise")
