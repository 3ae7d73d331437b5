"""FlashAttention-2 written for reading (Dao 2023, "FlashAttention-2: Faster
Attention with Better Parallelism and Work Partitioning", arXiv:2307.08691).

Forward (the paper's Algorithm 1).  For each query tile Q_i, stream over the
key/value tiles K_j, V_j and keep three running quantities per query row:

    m    the largest score seen so far               (B, Hkv, G, Tq, 1)
    l    the sum of exp(score - m) so far            (B, Hkv, G, Tq, 1)
    acc  the unnormalised output sum_j exp(S_ij - m) V_j   (B, Hkv, G, Tq, Dv)

When a tile raises the max, what came before is rescaled by exp(m_old - m_new):
the online softmax (Milakov & Gimelshein 2018).  FlashAttention-2's tweak is to
divide acc by l only once, at the end.  The log-sum-exp L = m + log(l) is all
that is saved for backward: (B, H, S) numbers instead of the (B, H, S, S)
probabilities.

Backward (Algorithm 2).  With D = rowsum(dO * O), loop over key/value tiles
(outer) and query tiles (inner), recompute P_ij = exp(Q_i K_j^T * scale - L_i)
from the saved L, and accumulate dV_j += P^T dO_i, dP = dO_i V_j^T,
dS = P * (dP - D_i), dQ_i += dS K_j * scale, dK_j += dS^T Q_i * scale.

Grouped-query attention (Ainslie et al. 2023): query heads are viewed as
(Hkv, G) so that G query heads share one K/V head without copying it; dK and dV
sum over the G heads.  Dropout keeps each probability with ``keep_prob`` and
scales by 1/keep_prob (keep_prob 0 keeps none: zeros, as torch's dropout(p=1));
the mask of tile (i, j) is regenerated from (seed, i, j) in backward, as
FlashAttention does with its Philox counter, so it is never stored either.
Empty tiles (see masks.py) are skipped in both passes.  Work is done in float32
(float64 for float64 inputs), as the kernels accumulate in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import PARTIAL, SKIP, AttentionMask, plan_tiles

__all__ = ["TileStats", "FlashAttention2", "tile_dropout_keep", "dense_dropout_keep"]

_NEG_INF = float("-inf")


@dataclass
class TileStats:
    """Tiles the reference kernel actually ran; pass one as ``tile_stats=`` to count."""
    computed: int = 0            # forward tiles whose scores were computed
    partial: int = 0             # of those, tiles that needed the element-wise mask
    skipped: int = 0             # forward tiles skipped whole: the mask is empty there
    backward_computed: int = 0   # the same two counts for the backward pass
    backward_skipped: int = 0


def tile_dropout_keep(seed: int, i: int, j: int, shape, keep_prob: float, device) -> torch.Tensor:
    """Dropout keep-mask of tile (i, j): a pure function of (seed, i, j), so backward
    regenerates exactly what forward used (hash() of an int tuple is deterministic)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(hash((seed, i, j)) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.rand(shape, generator=gen, device=device) < keep_prob


def dense_dropout_keep(seed: int, batch: int, q_heads: int, kv_heads: int, q_len: int,
                       k_len: int, tile_q: int, tile_k: int, keep_prob: float,
                       device=None) -> torch.Tensor:
    """The whole (B, Hq, Sq, Sk) dropout mask the kernel uses for ``seed``: for tests."""
    groups = q_heads // kv_heads
    plan = plan_tiles(None, q_len, k_len, tile_q, tile_k)
    out = torch.empty(batch, kv_heads, groups, q_len, k_len, dtype=torch.bool, device=device)
    for i, (r0, r1) in enumerate(plan.rows):
        for j, (c0, c1) in enumerate(plan.cols):
            out[..., r0:r1, c0:c1] = tile_dropout_keep(
                seed, i, j, (batch, kv_heads, groups, r1 - r0, c1 - c0), keep_prob, device)
    return out.flatten(1, 2)


class FlashAttention2(torch.autograd.Function):
    """Tiled attention that saves (q, k, v, o, log-sum-exp) and nothing S x S."""

    @staticmethod
    def forward(ctx, q, k, v, mask: AttentionMask | None, scale: float, keep_prob: float,
                seed: int, tile_q: int, tile_k: int, stats: TileStats | None):
        B, Hq, Sq, _ = q.shape
        Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
        G = Hq // Hkv
        ct = torch.promote_types(q.dtype, torch.float32)    # accumulate in fp32
        q5 = q.unflatten(1, (Hkv, G))                       # (B, Hkv, G, Sq, D)
        k5, v5 = k.unsqueeze(2), v.unsqueeze(2)             # (B, Hkv, 1, Sk, D|Dv)
        plan = plan_tiles(mask, Sq, Sk, tile_q, tile_k, q.device)
        o = q.new_empty(B, Hq, Sq, Dv)                      # (B, Hq, Sq, Dv)
        o5 = o.unflatten(1, (Hkv, G))                       # a view to write tiles into
        lse = torch.empty(B, Hkv, G, Sq, dtype=ct, device=q.device)

        for i, (r0, r1) in enumerate(plan.rows):            # one query tile Q_i at a time
            qi = q5[..., r0:r1, :].to(ct) * scale           # (B, Hkv, G, Tq, D), scale folded in
            m = torch.full((B, Hkv, G, r1 - r0, 1), _NEG_INF, dtype=ct, device=q.device)
            l = torch.zeros_like(m)
            acc = torch.zeros(B, Hkv, G, r1 - r0, Dv, dtype=ct, device=q.device)
            for j, (c0, c1) in enumerate(plan.cols):        # stream over K_j, V_j
                kind = plan.kinds[i][j]
                if kind == SKIP:                            # empty tile: no work at all
                    _count(stats, "skipped")
                    continue
                _count(stats, "computed", partial=kind == PARTIAL)
                s = qi @ k5[..., c0:c1, :].to(ct).transpose(-1, -2)    # (B, Hkv, G, Tq, Tk)
                if kind == PARTIAL:
                    s = s.masked_fill(~mask.tile(r0, r1, c0, c1, q.device), _NEG_INF)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                m_use = m_new.masked_fill(m_new == _NEG_INF, 0.0)      # rows with no key yet
                p = (s - m_use).exp_()                                 # (B, Hkv, G, Tq, Tk)
                alpha = (m - m_use).exp_()                  # rescales the earlier tiles
                l = alpha * l + p.sum(-1, keepdim=True)     # softmax denominator: no dropout
                if keep_prob < 1.0:                         # keep_prob 0: p * 0, as torch
                    p = p * tile_dropout_keep(seed, i, j, p.shape, keep_prob, q.device)
                    p = p / keep_prob if keep_prob > 0 else p
                acc = alpha * acc + p @ v5[..., c0:c1, :].to(ct)       # (B, Hkv, G, Tq, Dv)
                m = m_new
            o5[..., r0:r1, :] = acc / l.masked_fill(l == 0, 1.0)       # a row with no key -> 0
            lse[..., r0:r1] = (m + torch.log(l)).squeeze(-1)           # ... and L = -inf

        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.mask, ctx.scale, ctx.keep_prob, ctx.seed = plan, mask, scale, keep_prob, seed
        ctx.stats = stats
        return o

    @staticmethod
    def backward(ctx, grad_o):
        with torch.no_grad():
            dq, dk, dv = FlashAttention2._grads(ctx, grad_o)
        if torch.is_grad_enabled():         # create_graph=True: differentiating these raises
            dq, dk, dv = _NotTwice.apply(dq, dk, dv, *ctx.saved_tensors[:3], grad_o)
        return dq, dk, dv, None, None, None, None, None, None, None

    @staticmethod
    def _grads(ctx, grad_o):
        q, k, v, o, lse = ctx.saved_tensors
        plan, mask, scale, keep_prob = ctx.plan, ctx.mask, ctx.scale, ctx.keep_prob
        B, Hq, Sq, D = q.shape
        Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
        G = Hq // Hkv
        ct = lse.dtype
        q5 = q.unflatten(1, (Hkv, G))                       # (B, Hkv, G, Sq, D)
        k5, v5 = k.unsqueeze(2), v.unsqueeze(2)             # (B, Hkv, 1, Sk, D|Dv)
        do5 = grad_o.unflatten(1, (Hkv, G)).to(ct)          # (B, Hkv, G, Sq, Dv)
        delta = (do5 * o.unflatten(1, (Hkv, G)).to(ct)).sum(-1, keepdim=True)  # D_i, (.., Sq, 1)
        lse_use = lse.masked_fill(lse == _NEG_INF, float("inf")).unsqueeze(-1)  # no key: P = 0
        dq = torch.zeros(B, Hkv, G, Sq, D, dtype=ct, device=q.device)
        dk = torch.zeros(B, Hkv, Sk, D, dtype=ct, device=q.device)
        dv = torch.zeros(B, Hkv, Sk, Dv, dtype=ct, device=q.device)

        for j, (c0, c1) in enumerate(plan.cols):            # outer loop: K_j, V_j stay put
            kj = k5[..., c0:c1, :].to(ct)                   # (B, Hkv, 1, Tk, D)
            vj = v5[..., c0:c1, :].to(ct)                   # (B, Hkv, 1, Tk, Dv)
            for i, (r0, r1) in enumerate(plan.rows):
                kind = plan.kinds[i][j]
                if kind == SKIP:
                    _count(ctx.stats, "backward_skipped")
                    continue
                _count(ctx.stats, "backward_computed")
                qi = q5[..., r0:r1, :].to(ct)               # (B, Hkv, G, Tq, D)
                s = (qi * scale) @ kj.transpose(-1, -2)     # (B, Hkv, G, Tq, Tk), recomputed
                if kind == PARTIAL:
                    s = s.masked_fill(~mask.tile(r0, r1, c0, c1, q.device), _NEG_INF)
                p = torch.exp(s - lse_use[..., r0:r1, :])  # softmax rows, from the saved L
                doi = do5[..., r0:r1, :]                    # (B, Hkv, G, Tq, Dv)
                dp = doi @ vj.transpose(-1, -2)             # (B, Hkv, G, Tq, Tk)
                p_kept = p
                if keep_prob < 1.0:
                    z = tile_dropout_keep(ctx.seed, i, j, p.shape, keep_prob, q.device)
                    z = z.to(ct) / keep_prob if keep_prob > 0 else z.to(ct)   # forward's scaling
                    p_kept, dp = p * z, dp * z
                dv[..., c0:c1, :] += (p_kept.transpose(-1, -2) @ doi).sum(2)  # sum G heads
                ds = p * (dp - delta[..., r0:r1, :])        # softmax backward
                dq[..., r0:r1, :] += (ds @ kj) * scale
                dk[..., c0:c1, :] += (ds.transpose(-1, -2) @ qi).sum(2) * scale
        return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _NotTwice(torch.autograd.Function):
    """The first-order gradients (dq, dk, dv), tied to q, k, v and dO in the graph so that
    differentiating them again raises.  The backward above uses the saved L as a constant,
    so its own derivative would be wrong; ``@once_differentiable`` raises only when dO
    requires grad, and otherwise leaves the gradients unconnected, which autograd reads as
    zero second derivatives (``torch.autograd.functional.hessian`` returned zeros)."""

    @staticmethod
    def forward(ctx, dq, dk, dv, *inputs):
        return dq.view_as(dq), dk.view_as(dk), dv.view_as(dv)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("wb.ops.flash_attention's reference backward is not differentiable "
                           "(no double backward, as torch's fused attention kernels); for "
                           "second derivatives use wb.ops.use('unfused')")


def _count(stats: TileStats | None, field: str, partial: bool = False) -> None:
    if stats is None:
        return
    setattr(stats, field, getattr(stats, field) + 1)
    if partial:
        stats.partial += 1
