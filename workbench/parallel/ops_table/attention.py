"""Attention: scaled_dot_product_attention and ``workbench.ops.flash_attention`` (the
fused ops around it, swiglu and rotary_embedding: ``fused.py``).

Attention ``out = softmax(q k^T * scale + mask) v`` on q (B, Hq, Sq, D),
k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv). Per mesh dim:

    q, k, v S(0)            -> S(0)   batch: every sequence is attended alone
    q, k, v S(1)            -> S(1)   heads: every head is attended alone (Megatron
                                      attention TP). GQA (Hq = g * Hkv): query head h
                                      reads K/V head h // g, so the two head splits
                                      line up only if Hq == Hkv, Hkv == 1 (K/V kept
                                      whole), or Hkv divides evenly over the ranks
    q S(2), k R, v R        -> S(2)   query rows are independent: each rank attends its
                                      rows to ALL keys (gather K/V, the first step of
                                      context parallelism); causal and positional masks
                                      are rebuilt from the rank's global row offset
    q R, k R, v S(3)        -> S(3)   each rank computes its columns of the output (no
                                      dropout: the column blocks would drop differently)
    q R, k R, v P(sum)      -> P(sum) linear in v: sum_r P v_r = P sum_r v_r (no dropout)
    S on Sk (keys) or on D of q/k: softmax needs every score of a row, and a score
    needs all of D: they must be whole (ring attention's online-softmax merge is
    another algorithm, not a placement of this one).

A mask tensor (broadcastable to (B, Hq, Sq, Sk)) follows q along the dim it aligns
with, and is otherwise replicated.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..dist_tensor import DistTensor
from ..placement import Replicate, Shard
from . import costs
from ._util import check_number, broadcast_shapes
from .attention_pricing import with_shape
from .samples import Sample
from .strategy import combine
from .table import register

try:
    from ... import ops as _ops
except ModuleNotFoundError as _e:          # workbench.ops absent: rules only
    if not (_e.name or "").endswith("workbench.ops"):
        raise
    _ops = None

__all__ = ["attention_options"]

R = Replicate()


def _mask_dim(mask, j):
    """The mask dim that meets attention dim j of (B, H, Sq, Sk), or None (broadcast)."""
    if mask is None:
        return None
    d = j - (4 - mask.ndim)
    return d if d >= 0 and mask.shape[d] > 1 else None


def _shard_or_r(d):
    return Shard(d) if d is not None else R


def attention_options(q, k, v, mask, placements_v, dropout_p) -> list[tuple]:
    """Per-mesh-dim options ((q, k, v, mask), (out,), note); ``placements_v`` is v's
    placement on this mesh dim (a Partial v may stay Partial)."""
    m = None if mask is None else R
    opts = [((R, R, R, m), (R,), "replicated")]
    if q.shape[0] > 1:
        mb = None if mask is None else _shard_or_r(_mask_dim(mask, 0))
        opts.append(((Shard(0), Shard(0), Shard(0), mb), (Shard(0),),
                     "batch sharded: every sequence attends alone"))
    if q.shape[1] > 1:
        kv = Shard(1) if k.shape[1] > 1 else R
        mh = None if mask is None else _shard_or_r(_mask_dim(mask, 1))
        opts.append(((Shard(1), kv, kv, mh), (Shard(1),),
                     "heads sharded: every head attends alone"))
    if q.shape[2] > 1:
        ms = None if mask is None else _shard_or_r(_mask_dim(mask, 2))
        opts.append(((Shard(2), R, R, ms), (Shard(2),),
                     "query rows sharded, keys/values whole: rows attend independently"))
    if v.shape[3] > 1 and dropout_p == 0:          # dropout: one mask for all columns
        opts.append(((R, R, Shard(3), m), (Shard(3),),
                     "value columns sharded: each rank computes its output columns"))
    if dropout_p == 0 and placements_v.is_partial() and placements_v.reduce_op in ("sum", "avg"):
        p = placements_v
        opts.append(((R, R, p, m), (p,), f"linear in v: {p} stays {p}"))
    return opts


def _heads_line_up(q, k, st) -> bool:
    """Every rank keeps at least one head (a rank with none has no attention to run), and
    under GQA q's and k's head shards pair query head h with K/V head h // g.  With no
    head at all (an empty q) there is no attention to run: whole heads are fine (the rule
    found no layout: seed 2006313 wide)."""
    hq, hkv = q.shape[1], k.shape[1]
    nq = math.prod(q.mesh.shape[i] for i, p in enumerate(st.inputs[0]) if p.is_shard(1))
    n = math.prod(q.mesh.shape[i] for i, p in enumerate(st.inputs[1]) if p.is_shard(1))
    if (nq > 1 and hq < nq) or (n > 1 and hkv < n):
        return False
    if hq == hkv or hkv == 1:
        return True
    return hkv % n == 0


def attention_rule(q, k, v, mask=None, *, dropout_p=0.0, **_):
    """Attention: batch, heads, query rows or value columns may be sharded; keys and
    the q/k head_dim must be whole; a Partial v stays Partial (linear, no dropout)."""
    per_dim = [attention_options(q, k, v, mask, v.placements[i], dropout_p)
               for i in range(q.mesh.ndim)]
    sts = combine(q.mesh.ndim, per_dim, 4)
    return [s for s in sts if _heads_line_up(q, k, s)]


def _causal_keep(rows, cols):
    return rows[:, None] >= cols[None, :]           # top-left aligned, as is_causal


def _row_keep(nd, ctx, q, lead, patterns, sq, sk):
    """(L, Sq_local, Sk) keep-masks of query-row-sharded ranks from their global rows."""
    off = ctx.offsets(ctx.in_specs[0], 2, q)
    offs = off.expand(tuple(lead) + off.shape[nd:]).reshape(-1).tolist()
    cols = torch.arange(sk, device=q.device)
    keeps = []
    for o in offs:
        rows = torch.arange(o, o + sq, device=q.device)
        keep = None
        for p in patterns:
            kp = p(rows, cols)
            keep = kp if keep is None else keep & kp
        keeps.append(keep)
    return torch.stack(keeps)


def _attention_local(nd, ctx, q, k, v, mask, *, kernel, causal=False, pattern=None,
                     dropout_p=0.0, scale=None, tile_q=None, tile_k=None):
    if ctx is None:                                      # global output shape only
        return torch.empty(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=q.dtype, device="meta")
    lead = broadcast_shapes(*(t.shape[:nd] for t in (q, k, v, mask) if t is not None))
    B, hq, sq, _ = q.shape[nd:]
    sk = k.shape[-2]
    lb = math.prod(lead) * B                              # device axes and batch, flattened
    q4, k4, v4 = (t.expand(tuple(lead) + tuple(t.shape[nd:]))
                  .reshape((lb,) + tuple(t.shape[nd + 1:])) for t in (q, k, v))   # (L*B, H, S, D)
    dense = None
    if mask is not None:
        m = mask.reshape(tuple(mask.shape[:nd]) + (1,) * (4 - (mask.dim() - nd)) +
                         tuple(mask.shape[nd:]))
        m = m.expand(tuple(lead) + (B,) + tuple(m.shape[nd + 1:]))
        dense = m.reshape((lb,) + tuple(m.shape[nd + 1:]))
    patterns = ([_causal_keep] if causal else []) + ([pattern.keep] if pattern is not None else [])
    if patterns and any(p.is_shard(2) for p in ctx.in_specs[0].placements):
        keep = _row_keep(nd, ctx, q, lead, patterns, sq, sk)          # (L, Sq, Sk)
        keep = keep[:, None, None].expand(-1, B, 1, sq, sk).reshape(lb, 1, sq, sk)
        if dense is None:
            dense = keep
        elif dense.dtype == torch.bool:
            dense = dense & keep
        else:                                            # an additive float mask
            dense = dense + torch.zeros_like(keep, dtype=dense.dtype).masked_fill(~keep, -math.inf)
        causal, pattern = False, None
    if kernel == "sdpa":
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=dense, dropout_p=dropout_p,
                                             is_causal=causal, scale=scale,
                                             enable_gqa=q4.shape[1] != k4.shape[1])
    else:
        out = _ops.flash_attention(q4, k4, v4, causal=causal,
                                   mask=dense if dense is not None else pattern,
                                   dropout_p=dropout_p, scale=scale, tile_q=tile_q, tile_k=tile_k)
    return out.reshape(tuple(lead) + (B, hq, sq, v.shape[-1]))


def _check_4d(op, **named):
    for name, t in named.items():
        if t.ndim != 4:
            fix = (f"{name}.unsqueeze(1) for one head" if t.ndim == 3 else
                   f"{name}.reshape(batch, heads, seq, head_dim)")
            raise ValueError(f"{op} on DistTensors: {name}.shape={tuple(t.shape)}; expected 4-d "
                             f"(batch, heads, seq, head_dim). Fix: {fix}")


def _check_aligned(op, q, k, v):
    """One batch size, and k and v with one head count: the layouts the rule shards (on one
    device torch and wb.ops broadcast a batch of 1 and take k, v of different head counts;
    here that raised "shape '[1, 2, 4, 8]' is invalid for input of size 0")."""
    if not q.shape[0] == k.shape[0] == v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"{op} on DistTensors: q.shape={tuple(q.shape)}, k.shape="
                         f"{tuple(k.shape)}, v.shape={tuple(v.shape)}; q, k and v must share "
                         "the batch size and k, v the head count here. Fix: expand them first, "
                         f"e.g. k.expand({q.shape[0]}, -1, -1, -1)")


def _sdpa_parse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    _check_4d("scaled_dot_product_attention", query=query, key=key, value=value)
    _check_aligned("scaled_dot_product_attention", query, key, value)
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(f"scaled_dot_product_attention: q has {query.shape[1]} heads and k "
                         f"{key.shape[1]}; pass enable_gqa=True for grouped-query attention")
    return (query, key, value, attn_mask), {
        "kernel": "sdpa", "causal": bool(is_causal),
        "dropout_p": check_number("scaled_dot_product_attention", "dropout_p", dropout_p, False),
        "scale": check_number("scaled_dot_product_attention", "scale", scale)}


def _attention_cost_args(ins, outs, causal=False, pattern=None, dropout_p=0.0, **_):
    """``workbench.ops.cost("flash_attention")`` on this rank's q, k, v: the (query, key)
    pairs attended (causal or a mask pattern counted exactly for a rank holding the first
    query rows; a tensor mask is read, every pair computed)."""
    q, k, v, mask = ins
    return (q, k, v), {"causal": causal, "mask": pattern, "dropout_p": dropout_p}


_ATTENTION_COST = costs.from_ops("flash_attention", _attention_cost_args)


def _busiest_pairs(layout_, q, sk, causal, pattern):
    """(query, key) pairs of the busiest rank when query rows are sharded under a causal
    mask or a pattern (the last rows see the most keys), and of a rank holding the
    first rows (what the local shapes alone count); None when rows are whole."""
    mesh, specs, st = layout_
    qspec, req = specs[0], st.inputs[0]
    if not any(p.is_shard(2) for p in req) or not (causal or pattern is not None):
        return None
    from .. import layout as L
    cols = torch.arange(sk)

    def pairs(start, n):
        rows = torch.arange(start, start + n)
        keep = torch.ones(n, sk, dtype=torch.bool)
        if causal:
            keep &= _causal_keep(rows, cols)
        if pattern is not None:
            keep &= pattern.keep(rows, cols)
        return int(keep.sum())
    ranges = {L.shard_bounds(qspec.shape, mesh, req, r)[2] for r in mesh.ranks}
    n = max(m for _, m in ranges)
    return max(pairs(s0, m) for s0, m in ranges), pairs(0, n)


def _attention_cost(ins, outs, layout=None, **attrs):
    """``workbench.ops.cost("flash_attention")`` on this rank's q, k, v; FLOPs are linear
    in the pairs attended, so a row-sharded causal (or patterned) rank is scaled to the
    busiest rank's pairs."""
    c = _ATTENTION_COST(ins, outs, **attrs)
    m = costs.nbytes(ins[3])                          # a tensor mask, read once
    flops, bflops = c.flops, c.backward_flops
    busy = None if layout is None else _busiest_pairs(layout, ins[0], ins[1].shape[2],
                                                      attrs.get("causal"), attrs.get("pattern"))
    if busy is not None and busy[1]:
        flops, bflops = flops * busy[0] // busy[1], bflops * busy[0] // busy[1]
    out = costs.Cost(flops, c.bytes + m, bflops, c.backward_bytes + m)
    if ins[3] is not None or attrs.get("pattern") is not None:
        return out                  # a mask: not the fused kernel a profile prices by shape
    return with_shape(out, ins[0], bool(attrs.get("causal")))      # attention_pricing.py


_attention_cost.wants_layout = True


def _sdpa_sample(g):
    q, k, v = g.rn(2, 2, 5, 4), g.rn(2, 2, 7, 4), g.rn(2, 2, 7, 4)
    return [Sample(F.scaled_dot_product_attention, (q, k, v)),
            Sample(F.scaled_dot_product_attention, (q, q, q), {"is_causal": True})]


_SDPA = register("scaled_dot_product_attention", [F.scaled_dot_product_attention],
                 parse=_sdpa_parse, rule=attention_rule, local=_attention_local,
                 cost=_attention_cost, op_class="attention", sample=_sdpa_sample)


def _sdpa_3d(args, kwargs):
    """torch's scaled_dot_product_attention of 3-d (batch, seq, head_dim) q, k and v: one
    head, the 4-d op on ``unsqueeze(1)`` (a 3-d mask (batch, Sq, Sk) unsqueezed the same
    way; a mask of fewer dims broadcasts as it is), the head dim squeezed out of the result
    (torch computes it; here it was refused as not 4-d: seeds 2004113 / 2004164 of the wide
    random sweep).  Other forms: NotImplemented (the op's own checks)."""
    names = ("query", "key", "value", "attn_mask")
    got = dict(zip(names, args))
    qkv = [got.get(n, kwargs.get(n)) for n in names[:3]]
    if not all(isinstance(t, (torch.Tensor, DistTensor)) and t.ndim == 3 for t in qkv):
        return NotImplemented
    rest = {k: v for k, v in kwargs.items() if k not in names}
    mask = got.get("attn_mask", kwargs.get("attn_mask"))
    if isinstance(mask, (torch.Tensor, DistTensor)) and mask.ndim == 3:
        mask = mask.unsqueeze(1)
    q, k, v = (t.unsqueeze(1) for t in qkv)
    extra = args[4:]                      # dropout_p, is_causal, scale given by position
    return F.scaled_dot_product_attention(q, k, v, mask, *extra, **rest).squeeze(1)


_SDPA.extra["other_form"] = _sdpa_3d


def _flash_parse(q, k, v, *, causal=False, mask=None, dropout_p=0.0, scale=None, tile_q=None,
                 tile_k=None, tile_stats=None):
    _check_4d("flash_attention", q=q, k=k, v=v)
    _check_aligned("flash_attention", q, k, v)
    scale = check_number("flash_attention", "scale", scale)
    dropout_p = check_number("flash_attention", "dropout_p", dropout_p, False)
    if tile_stats is not None:
        raise ValueError("flash_attention(tile_stats=...) on DistTensors: every rank runs its "
                         "own tiles; count them on a single-device call")
    tensor_mask = mask if isinstance(mask, (torch.Tensor, DistTensor)) else None
    pattern = None if tensor_mask is not None else mask
    return (q, k, v, tensor_mask), {
        "kernel": "flash", "causal": bool(causal), "pattern": pattern,
        "dropout_p": float(dropout_p), "scale": scale, "tile_q": tile_q, "tile_k": tile_k}


if _ops is not None:
    register("flash_attention", [_ops.flash_attention], parse=_flash_parse, rule=attention_rule,
             local=_attention_local, cost=_attention_cost, op_class="attention",
             meta_check=False, sample=lambda g: [Sample(_ops.flash_attention, (
                 g.rn(2, 2, 5, 4), g.rn(2, 2, 7, 4), g.rn(2, 2, 7, 4)))])
