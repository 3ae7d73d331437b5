"""Gather-like ops and broadcasting copies: gather, scatter, index_select, expand, repeat.

Per mesh dim:

    gather(x, dim, index)          x and index whole along dim (an index points anywhere
                                   in it); another dim d passes sharded in both when x and
                                   index have the same size there (their shards line up);
                                   linear in x: P(x), R(index) -> P
    scatter(x, dim, index, src)    the same; linear in (x, src) jointly: P, R, P -> P
    index_select(x, dim, index)    dim whole in x, index replicated; other dims pass;
                                   linear in x
    expand(sizes)                  kept dims pass (shifted by the new leading dims); an
                                   expanded (size-1) dim is whole by definition; linear
    repeat(reps)                   a dim repeated more than once is whole (the copies tile
                                   the global dim, not each shard); others pass; linear
"""
from __future__ import annotations

from ..placement import Partial, Replicate, Shard
from .registry import combine

__all__ = ["gather_rule", "scatter_rule", "index_select_rule", "expand_rule", "repeat_rule"]

R = Replicate()
P = Partial("sum")


def _per_dim(mesh, opts, n_in):
    return combine(mesh.ndim, [opts] * mesh.ndim, n_in)


def gather_rule(x, index, *, dim, **_):
    """gather along an unsharded dim; other dims pass where x and index line up."""
    opts = [((R, R), (R,), "replicated")]
    for d in range(x.ndim):
        if d != dim and index.shape[d] > 1 and x.shape[d] == index.shape[d]:
            opts.append(((Shard(d), Shard(d)), (Shard(d),), f"dim {d} sharded in x and index"))
    opts.append(((P, R), (P,), "linear in x: a selection of a sum is the sum of selections"))
    return _per_dim(x.mesh, opts, 2)


def scatter_rule(x, index, src=None, *, dim, **_):
    """scatter along an unsharded dim; other dims pass where x, index, src line up."""
    opts = [((R, R, None if src is None else R), (R,), "replicated")]
    for d in range(x.ndim):
        same = x.shape[d] == index.shape[d] and (src is None or src.shape[d] == index.shape[d])
        if d != dim and index.shape[d] > 1 and same:
            opts.append(((Shard(d), Shard(d), None if src is None else Shard(d)), (Shard(d),),
                         f"dim {d} sharded in x, index and src"))
    if src is not None:
        opts.append(((P, R, P), (P,), "linear in (x, src): written and kept entries both sums"))
    return _per_dim(x.mesh, opts, 3)


def index_select_rule(x, index, *, dim, **_):
    """index_select: dim whole, index replicated; other dims pass; linear in x."""
    opts = [((R, R), (R,), "replicated")]
    for d in range(x.ndim):
        if d != dim and x.shape[d] > 1:
            opts.append(((Shard(d), R), (Shard(d),), f"dim {d} sharded passes"))
    opts.append(((P, R), (P,), "linear in x"))
    return _per_dim(x.mesh, opts, 2)


def expand_rule(x, *, shape, **_):
    """expand: kept dims pass, moved right by the new leading dims; linear."""
    new = len(shape) - x.ndim
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim):
        if x.shape[d] > 1:
            opts.append(((Shard(d),), (Shard(d + new),), f"kept dim {d} passes to {d + new}"))
    opts += [((Partial(op),), (Partial(op),), f"copies of P({op}) are P({op})")
             for op in ("sum", "avg", "max", "min")]
    return _per_dim(x.mesh, opts, 1)


def repeat_rule(x, *, reps, **_):
    """repeat: dims repeated once pass (moved right by new leading dims); linear."""
    new = len(reps) - x.ndim
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim):
        if x.shape[d] > 1 and reps[d + new] == 1:
            opts.append(((Shard(d),), (Shard(d + new),), f"dim {d} not repeated: passes"))
    opts += [((Partial(op),), (Partial(op),), f"copies of P({op}) are P({op})")
             for op in ("sum", "avg", "max", "min")]
    return _per_dim(x.mesh, opts, 1)
