"""gather, scatter, index_select, expand, repeat. Rules: ``rules/indexing.py``."""
from __future__ import annotations

import torch

from ..rules import indexing as ri
from . import costs
from ._util import align, is_tensor, wrap_dim
from .table import register

T = torch.Tensor


def _gather_parse(x, dim, index, *, sparse_grad=False):
    return (x, index), {"dim": wrap_dim(dim, x.ndim)}


def _gather_local(nd, ctx, x, index, dim):
    x, index = align(nd, x, index)
    lead = torch.broadcast_shapes(x.shape[:nd], index.shape[:nd])
    x = x.expand(lead + tuple(x.shape[nd:]))
    index = index.expand(lead + tuple(index.shape[nd:]))
    return torch.gather(x, dim + nd, index)


register("gather", [torch.gather, T.gather], parse=_gather_parse, rule=ri.gather_rule,
         local=_gather_local, cost=costs.movement, op_class="data_movement")


def _scatter_parse(x, dim, index, src=None, *, value=None, reduce=None):
    if reduce is not None:
        raise NotImplementedError("scatter(reduce=...) on DistTensors: use scatter_reduce "
                                  "on gathered tensors, or reduce=None")
    if src is None and value is None:
        raise TypeError("scatter(x, dim, index): give src (a tensor) or value (a number)")
    if src is not None and not is_tensor(src):
        src, value = None, src
    return (x, index, src), {"dim": wrap_dim(dim, x.ndim), "value": value}


def _scatter_local(nd, ctx, x, index, src, dim, value):
    ts = [t for t in (x, index, src) if t is not None]
    lead = torch.broadcast_shapes(*(t.shape[:nd] for t in ts))
    x, index = (t.expand(lead + tuple(t.shape[nd:])) for t in (x, index))
    if src is None:
        return torch.scatter(x, dim + nd, index, value)
    return torch.scatter(x, dim + nd, index, src.expand(lead + tuple(src.shape[nd:])))


register("scatter", [torch.scatter, T.scatter], parse=_scatter_parse, rule=ri.scatter_rule,
         local=_scatter_local, cost=costs.movement, op_class="data_movement")


def _index_select_parse(x, dim, index):
    return (x, index), {"dim": wrap_dim(dim, x.ndim)}


def _index_select_local(nd, ctx, x, index, dim):
    idx = index[(0,) * nd].reshape(-1)        # replicated (the rule): every copy is the same
    return torch.index_select(x, dim + nd, idx)


register("index_select", [torch.index_select, T.index_select], parse=_index_select_parse,
         rule=ri.index_select_rule, local=_index_select_local, cost=costs.movement,
         op_class="data_movement")


def _expand_parse(x, *sizes):
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    meta = torch.empty(tuple(x.shape), dtype=x.dtype, device="meta").expand(*sizes)
    return (x,), {"shape": tuple(meta.shape)}


def _expand_local(nd, ctx, x, shape):
    glob = tuple(ctx.in_specs[0].shape) if ctx is not None else tuple(x.shape[nd:])
    new = len(shape) - len(glob)
    x = x.reshape(tuple(x.shape[:nd]) + (1,) * new + tuple(x.shape[nd:]))
    # dims of global size 1 expanded to shape take their size; the others stay local
    target = [-1] * nd + [s if n == 1 else -1 for n, s in zip((1,) * new + glob, shape)]
    return x.expand(target)


register("expand", [T.expand], parse=_expand_parse, rule=ri.expand_rule, local=_expand_local,
         cost=costs.view, op_class="view")
register("expand_as", [T.expand_as], parse=lambda x, other: _expand_parse(x, tuple(other.shape)),
         rule=ri.expand_rule, local=_expand_local, cost=costs.view, op_class="view")


def _repeat_parse(x, *reps):
    if len(reps) == 1 and isinstance(reps[0], (tuple, list, torch.Size)):
        reps = tuple(reps[0])
    torch.empty(tuple(x.shape), device="meta").repeat(*reps)        # torch's own checks
    return (x,), {"reps": tuple(int(r) for r in reps)}


def _repeat_local(nd, ctx, x, reps):
    new = len(reps) - (x.dim() - nd)
    x = x.reshape(tuple(x.shape[:nd]) + (1,) * new + tuple(x.shape[nd:]))
    return x.repeat((1,) * nd + tuple(reps))


register("repeat", [T.repeat], parse=_repeat_parse, rule=ri.repeat_rule, local=_repeat_local,
         cost=costs.movement, op_class="data_movement")
