"""Accumulating into positions: ``scatter_add``, ``index_add`` and ``index_fill``
(``scatter`` and ``index_select``: ``indexing.py``).

Per mesh dim (x, index, src -> out):

    scatter_add(x, dim, index, src)
        R,    R,    R     -> R
        S(d), S(d), S(d)  -> S(d)   d != dim where x, index and src have the same size on
                                    d (each rank adds its own rows)
        P,    R,    P     -> P      linear in (x, src) jointly:
                                    sum_i x_i + scatter(sum_i s_i) = sum_i (x_i + scatter(s_i))
    index_add(x, dim, index, source, alpha)
        R,    R,    R     -> R
        S(d), R,    S(d)  -> S(d)   d != dim (torch makes x and source agree there)
        P,    R,    P     -> P      linear in (x, source) jointly, as above

    index_fill(x, dim, index, value)
        S(d), R -> S(d)   d != dim; P(max) / P(min) pass (max(v, ..., v) = v), and
                          P(sum) / P(avg) for value 0

The accumulated dim is whole (an index may point anywhere in it); the index is
replicated for index_add (every rank reads all of it).
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from . import costs
from ._util import is_tensor, wrap_dim, broadcast_shapes
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["scatter_add_rule", "index_add_rule"]

T = torch.Tensor
R = Replicate()
P = Partial("sum")


def scatter_add_rule(x, index, src, *, dim, **_):
    """scatter_add: dims other than ``dim`` pass where x, index and src agree; linear."""
    dim = wrap_dim(dim, x.ndim)           # infer hands the user's dim=-1 as given
    opts = [((R, R, R), (R,), "replicated")]
    for d in range(x.ndim):
        if d != dim and index.shape[d] > 1 and x.shape[d] == index.shape[d] == src.shape[d]:
            opts.append(((Shard(d),) * 3, (Shard(d),), f"dim {d} sharded in x, index, src"))
    opts.append(((P, R, P), (P,), "linear in (x, src): adds of sums are sums of adds"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 3)


def _scatter_add_parse(x, dim, index, src):
    if not is_tensor(src):
        raise TypeError(f"scatter_add(src={type(src).__name__}): src is a tensor")
    return (x, index, src), {"dim": wrap_dim(dim, x.ndim)}


def _lead(nd, *ts):
    lead = broadcast_shapes(*(t.shape[:nd] for t in ts))
    return [t.expand(lead + tuple(t.shape[nd:])) for t in ts]


def _scatter_add_local(nd, ctx, x, index, src, dim):
    x, index, src = _lead(nd, x, index, src)
    return torch.scatter_add(x, dim + nd, index, src)


register("scatter_add", [torch.scatter_add, T.scatter_add], parse=_scatter_add_parse,
         rule=scatter_add_rule, local=_scatter_add_local, cost=costs.elementwise(1),
         op_class="data_movement",                                      # one add per src
         sample=lambda g: [Sample(torch.scatter_add, (g.rn(5, 6), 1, g.ints(5, 4, lo=0, hi=6),
                                                      g.rn(5, 4)))])


def index_add_rule(x, index, source, *, dim, alpha, **_):
    """index_add: dims other than ``dim`` pass in x and source; index replicated; linear."""
    dim = wrap_dim(dim, x.ndim)
    opts = [((R, R, R), (R,), "replicated")]
    for d in range(x.ndim):
        if d != dim and x.shape[d] > 1:
            opts.append(((Shard(d), R, Shard(d)), (Shard(d),), f"dim {d} sharded in x, source"))
    opts.append(((P, R, P), (P,), "linear in (x, source): adds of sums are sums of adds"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 3)


def _index_add_parse(x, dim, index, source, *, alpha=1):
    if not is_tensor(source):
        raise TypeError(f"index_add(source={type(source).__name__}): source is a tensor")
    return (x, index, source), {"dim": wrap_dim(dim, x.ndim), "alpha": alpha}


def _index_add_local(nd, ctx, x, index, source, dim, alpha):
    idx = index[(0,) * nd] if nd else index       # replicated (the rule): every copy alike
    x, source = _lead(nd, x, source)
    if x.dim() == nd:                             # a 0-d x: index_add along its one element
        return torch.index_add(x.unsqueeze(-1), nd, idx.reshape(-1),
                               source.reshape(tuple(source.shape[:nd]) + (-1,)),
                               alpha=alpha).squeeze(-1)
    return torch.index_add(x, dim + nd, idx, source, alpha=alpha)


register("index_add", [torch.index_add, T.index_add], parse=_index_add_parse,
         rule=index_add_rule, local=_index_add_local, cost=costs.elementwise(2),
         op_class="data_movement",                          # alpha * source, then one add
         sample=lambda g: [Sample(torch.index_add, (g.rn(5, 6), 0, torch.tensor([0, 2, 2]),
                                                    g.rn(3, 6)), {"alpha": 0.5})])


def index_fill_rule(x, index, *, dim, value, **_):
    """index_fill: dims other than ``dim`` pass; P(max/min) pass, P(sum/avg) for 0."""
    dim = wrap_dim(dim, x.ndim)
    opts = [((R, R), (R,), "replicated")]
    opts += [((Shard(d), R), (Shard(d),), f"dim {d} sharded passes")
             for d in range(x.ndim) if d != dim and x.shape[d] > 1]
    ops = ("max", "min") + (("sum", "avg") if value == 0 else ())
    opts += [((Partial(op), R), (Partial(op),), f"filling with {value} keeps P({op})")
             for op in ops]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 2)


def _index_fill_parse(x, dim, index, value):
    if is_tensor(value):
        if value.ndim != 0:
            raise RuntimeError("index_fill_ only supports a 0-dimensional value tensor, but "
                               f"got tensor with {value.ndim} dimension(s).")   # torch's
        value = value.full().item() if hasattr(value, "placements") else value.item()
    return (x, index), {"dim": wrap_dim(dim, x.ndim), "value": value}


def _index_fill_local(nd, ctx, x, index, dim, value):
    idx = index[(0,) * nd] if nd else index
    if x.dim() == nd:
        return torch.index_fill(x.unsqueeze(-1), nd, idx.reshape(-1), value).squeeze(-1)
    return torch.index_fill(x, dim + nd, idx, value)


register("index_fill", [torch.index_fill, T.index_fill], parse=_index_fill_parse,
         rule=index_fill_rule, local=_index_fill_local, cost=costs.movement,
         op_class="data_movement",
         sample=lambda g: [Sample(torch.index_fill, (g.rn(5, 6), 1, torch.tensor([0, 4]), -1.5)),
                           Sample(torch.index_fill, (g.rn(5, 6), 0, torch.tensor([2]), 0.0))])
