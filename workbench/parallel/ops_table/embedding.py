"""Embedding lookup, including Megatron's vocabulary parallelism (the loss:
``cross_entropy.py``).

embedding(ids, W), W of shape (V, H), per mesh dim (ids, W -> out):

    R,    R      -> R          every rank looks up everything
    S(d), R      -> S(d)       each rank looks up its own ids (batch / sequence parallel)
    R,    S(1)   -> S(-1)      hidden split: each rank holds H/n columns of every row
    R,    S(0)   -> P(sum)     vocabulary parallel (Megatron's VocabParallelEmbedding):
                               rank k holds rows [o_k, o_k + V_k) and looks up
                               ids - o_k, masked to zero outside its range; exactly one
                               rank holds each row, so the sum over ranks is W[ids]
    R,    P(sum) -> P(sum)     linear in the table: sum_i(W_i)[ids] = sum_i(W_i[ids])
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..placement import Partial, Replicate, Shard
from . import costs
from .samples import Sample
from .strategy import combine
from .table import register
from ._util import broadcast_shapes

R = Replicate()
P = Partial("sum")


def embedding_rule(ids, weight, **_):
    """embedding: ids sharded -> out sharded; W S(1) -> out S(-1); W S(0) -> P(sum)."""
    opts = [((R, R), (R,), "replicated")]
    for d in range(ids.ndim):
        if ids.shape[d] > 1:
            opts.append(((Shard(d), R), (Shard(d),), f"ids dim {d} sharded: each rank "
                         "looks up its own ids"))
    if weight.shape[1] > 1:
        opts.append(((R, Shard(1)), (Shard(ids.ndim),), "hidden dim of the table split"))
    if weight.shape[0] > 1:
        opts.append(((R, Shard(0)), (P,), "vocabulary parallel: each rank looks up the ids "
                     "in its row range, zeros elsewhere"))
    opts.append(((R, P), (P,), "linear in the table: a partial table gives partial rows"))
    return combine(ids.mesh.ndim, [opts] * ids.mesh.ndim, 2)


def _lookup(nd, w, idx):
    """out[lead..., *ids] = w[lead..., idx] on stacked tensors (no copy of the table)."""
    k = idx.dim() - nd
    lead_idx = [torch.arange(w.shape[a]).view((1,) * a + (-1,) + (1,) * (nd - 1 - a + k))
                for a in range(nd)]
    return w[tuple(lead_idx) + (idx,)]                                 # (lead, *ids, H)


def _embedding_local(nd, ctx, ids, w, *, padding_idx=None):
    if ctx is None:                                                     # output shapes only
        return F.embedding(ids, w)
    wspec = ctx.in_specs[1]
    v = wspec.shape[0]
    if ids.numel() and not ids.is_meta and bool(((ids < 0) | (ids >= v)).any()):
        raise IndexError(f"embedding: index out of range in self: ids must be in [0, {v}) "
                         f"for a table of {v} rows; got {int(ids[(ids < 0) | (ids >= v)][0])}")
    out_lead = broadcast_shapes(ids.shape[:nd], w.shape[:nd])
    if any(p.is_shard(0) for p in wspec.placements):                   # vocabulary parallel
        v_loc = w.shape[nd]
        if v_loc == 0:                                                  # an empty shard
            return w.new_zeros(out_lead + tuple(ids.shape[nd:]) + (w.shape[-1],))
        off = ctx.offsets(wspec, 0, like=w).reshape(tuple(w.shape[:nd]) + (1,) * (ids.dim() - nd))
        loc = ids - off                                                 # (lead, *ids)
        mine = (loc >= 0) & (loc < v_loc)
        out = _lookup(nd, w, torch.where(mine, loc, 0))
        out = torch.where(mine.unsqueeze(-1), out, out.new_zeros(()))
    else:
        out = _lookup(nd, w, ids)
    if padding_idx is not None:                                         # no gradient to the pad row
        pad = (ids == padding_idx).unsqueeze(-1)
        out = torch.where(pad, out.detach(), out)
    return out


def _embedding_parse(ids, weight, padding_idx=None, max_norm=None, norm_type=2.0,
                     scale_grad_by_freq=False, sparse=False):
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise NotImplementedError(
            "embedding on DistTensors: max_norm (renormalizes the table in place), "
            "scale_grad_by_freq (needs the global id counts) and sparse=True are not "
            "supported; leave them at their defaults")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"embedding: ids of dtype {ids.dtype}; they must be int64 or int32")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return (ids, weight), {"padding_idx": padding_idx}


def _embedding_cost(ins, outs, **_):
    """A lookup: read the ids and the rows they select, write the output; backward adds
    each output-gradient row into the table gradient (one add per element, Megatron's
    embedding backward is an index_add)."""
    ids, w = ins
    n = outs[0].numel()
    return costs.Cost(0, costs.nbytes(ids) + 2 * costs.nbytes(outs[0]), n,
                      costs.nbytes(ids) + costs.nbytes(outs[0]) + costs.nbytes(w))


register("embedding", [F.embedding], parse=_embedding_parse, rule=embedding_rule,
         local=_embedding_local, cost=_embedding_cost, op_class="embedding",
         sample=lambda g: [Sample(F.embedding, (g.ints(5, 3, lo=0, hi=7), g.rn(7, 4)))])


# ---- one_hot: a lookup in the identity matrix ------------------------------------------
# ids dims pass (S(d) -> S(d)); the class dim is new and whole on every rank. num_classes=-1
# takes the largest id + 1, as torch: a global max (a traced reduction, read out).

def one_hot_rule(ids, *, num_classes, **_):
    """one_hot: ids dims pass; the new class dim is replicated."""
    opts = [((R,), (R,), "replicated")]
    opts += [((Shard(d),), (Shard(d),), f"ids dim {d} sharded: each rank encodes its own")
             for d in range(ids.ndim) if ids.shape[d] > 1]
    return combine(ids.mesh.ndim, [opts] * ids.mesh.ndim, 1)


def _one_hot_parse(tensor, num_classes=-1):
    if tensor.dtype != torch.int64:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if num_classes == -1:                 # the largest class present + 1 (a global max)
        if tensor.numel() == 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        num_classes = int(tensor.amax()) + 1
    torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")     # shape only
    return (tensor,), {"num_classes": int(num_classes)}


def _one_hot_local(nd, ctx, ids, num_classes):
    if ids.device.type == "meta":
        return torch.empty(tuple(ids.shape) + (num_classes,), dtype=torch.int64, device="meta")
    return F.one_hot(ids, num_classes)          # torch's checks: ids in [0, num_classes)


register("one_hot", [F.one_hot], parse=_one_hot_parse, rule=one_hot_rule,
         local=_one_hot_local, cost=costs.movement, op_class="data_movement",
         meta_check=False,
         sample=lambda g: [Sample(F.one_hot, (g.ints(5, 3, lo=0, hi=4), 6))])
