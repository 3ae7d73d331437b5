"""Attention: ``flash_attention(q, k, v, *, causal, mask, dropout_p, scale)``.

softmax(Q K^T * scale) V on (batch, heads, seq, head_dim) tensors, with the
signature of PyTorch's ``scaled_dot_product_attention``.  Backends:

* reference - FlashAttention-2 (Dao 2023) tile by tile: flash_reference.py;
* unfused   - the textbook formula (Vaswani et al. 2017): S x S scores in memory;
* native    - ``torch.nn.functional.scaled_dot_product_attention``;
* npu       - ``torch_npu.npu_fusion_attention`` (contracts in
  /work/shared/reference/torch_npu.md: scale always passed, mask inverted,
  keep_prob = 1 - dropout_p, called positionally).

k and v may have fewer heads than q (grouped-query attention: Hq % Hkv == 0,
query head h uses K/V head h // (Hq // Hkv), as ``repeat_interleave``): always on, as
``scaled_dot_product_attention(..., enable_gqa=True)``, which takes k and v of different
head counts too (each dividing Hq).  The batch sizes of q, k and v broadcast (each 1 or
the same B), as sdpa's do (measured on torch 2.13, CPU).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from ..npu.device import torch_npu_module
from ..npu.guard import check_dtype
from . import _checks
from .cost import OpCost, nbytes
from .flash_reference import FlashAttention2, TileStats
from .masks import AttentionMask, build_mask
from .registry import dispatch, register, register_cost

__all__ = ["flash_attention", "TILE_Q", "TILE_K"]

TILE_Q, TILE_K = 128, 128   # reference tiles, as FA2 at head_dim 64: few, large matmuls
_OP = "flash_attention"


@dataclass(frozen=True)
class AttentionCall:
    """The checked arguments every backend receives."""
    mask: AttentionMask | None   # causal + mask, combined; None = attend everywhere
                                 # (built for (B, Hkv) of :func:`_aligned`'s k and v)
    dropout_p: float
    scale: float
    tile_q: int
    tile_k: int
    stats: TileStats | None


def _autocast(q, k, v):
    """q, k, v as torch's autocast gives them to ``scaled_dot_product_attention``, which
    is on its lower-precision list (torch 2.13, ``aten/src/ATen/autocast_mode.cpp``,
    ``KERNEL_CPU(scaled_dot_product_attention, lower_precision_fp)``): floating tensors
    other than float64 cast to the autocast dtype when autocast is on for their device
    (e.g. float32 q, k after RoPE with float32 cos/sin, bf16 v from a bf16 linear)."""
    dev = q.device.type
    if q.is_meta or not torch.is_autocast_enabled(dev):
        return q, k, v
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if torch.is_tensor(t) and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in (q, k, v))


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    mask=None, dropout_p: float = 0.0, scale: float | None = None,
                    tile_q: int | None = None, tile_k: int | None = None,
                    tile_stats: TileStats | None = None, return_lse: bool = False):
    """Attention over q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv) -> (B, Hq, Sq, Dv).

    causal: query i sees keys j <= i (top-left aligned, as PyTorch's ``is_causal``).
    mask: None, a bool tensor broadcastable to (B, Hq, Sq, Sk) with True = may attend
        (PyTorch's convention), or a :class:`~workbench.ops.masks.MaskPattern`
        (``SlidingWindow``, ``BlockDiagonal``) whose empty tiles the reference skips.
        ANDed with ``causal``.  A query row with no key gets output 0.
    dropout_p: probability of dropping an attention weight (applied whenever > 0,
        as in ``scaled_dot_product_attention``); the kernels keep with 1 - dropout_p.
        1.0 drops every weight: the output is zeros and so are the gradients, as sdpa's
        (torch's dropout multiplies by 0 rather than dividing by keep_prob = 0).
    scale: default 1/sqrt(D).
    tile_q, tile_k, tile_stats: the reference backend's tile sizes and a
        :class:`TileStats` it fills with the tiles it computed and skipped.
    return_lse: also return the log-sum-exp of each query row's scaled, masked scores,
        (B, Hq, Sq) in float32 (float64 for float64 inputs, as torch's math attention
        keeps its accumulator), -inf for a row with no key (what FlashAttention keeps
        for backward, and what ring / context-parallel attention needs to merge the
        partial outputs of key blocks).  It is recomputed here with differentiable
        torch ops (one extra Sq x Sk pass), whatever the backend, before dropout.
    """
    relevant = (q, k, v, mask)      # any of them may be a tensor-like (a DistTensor) or mask
    if return_lse and has_torch_function(relevant):
        raise NotImplementedError("flash_attention(return_lse=True) on DistTensors: not "
                                  "supported by the SPMD rule; call it on local tensors")
    if has_torch_function(relevant):
        return handle_torch_function(
            flash_attention, relevant, q, k, v, causal=causal, mask=mask, dropout_p=dropout_p,
            scale=scale, tile_q=tile_q, tile_k=tile_k, tile_stats=tile_stats)
    q, k, v = _autocast(q, k, v)
    call = _check(q, k, v, causal, mask, dropout_p, scale, tile_q, tile_k, tile_stats)
    if q.is_meta and not return_lse:    # a dry run: shapes, and what a fused kernel keeps
        return _MetaFused.apply(*_aligned(q, k, v))
    impl = dispatch(_OP, (q, k, v)) if q.shape[1] else _no_heads
    if tile_stats is not None and impl is not _reference:
        raise ValueError("flash_attention(tile_stats=...): only the reference backend counts "
                         "tiles (fused kernels do not report them); wrap the call in "
                         "`with wb.ops.use('reference'):`")
    out = impl(q, k, v, call)
    return (out, _lse(q, k, v, call)) if return_lse else out


class _MetaFused(torch.autograd.Function):
    """Attention on the meta device (``workbench.plan.dryrun``): the output's shape, and
    for backward exactly what FlashAttention-2 keeps (Dao 2023, Algorithm 1: Q, K, V, O
    and the row log-sum-exp L in fp32), so the dry run counts a fused kernel's memory."""

    @staticmethod
    def forward(ctx, q, k, v):
        if v.shape[3] == q.shape[3]:
            # PyTorch's fused kernel on meta (its meta function: shapes only), so that a
            # dispatch mode sees the kernel a CPU run calls (selective checkpointing saves
            # its outputs: models.op_sac)
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False)[:2]                                # (B, Hq, Sq, D), (B, Hq, Sq)
        else:
            o = q.new_empty(q.shape[:3] + (v.shape[3],))               # (B, Hq, Sq, Dv)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _lse(q, k, v, c: AttentionCall) -> torch.Tensor:
    """logsumexp_j(scale * q_i . k_j) over the keys row i may attend: (B, Hq, Sq), fp32
    (fp64 for fp64 inputs: a float64 caller, e.g. ring attention's merge, keeps its
    precision)."""
    q, k, _ = _aligned(q, k, v)                                  # v's batch may be q's
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, 1)
    acc = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * c.scale      # (B, Hq, Sq, Sk)
    if c.mask is not None:
        s = s.masked_fill(~c.mask.dense4(q.shape[2], k.shape[2], q.device), float("-inf"))
    return torch.logsumexp(s, dim=-1)


def _check(q, k, v, causal, mask, dropout_p, scale, tile_q, tile_k, stats) -> AttentionCall:
    _check_shapes(q, k, v, dropout_p)
    _checks.same_device(_OP, q=q, k=k, v=v)     # the op's only: a cost takes meta tensors
    if not isinstance(causal, bool):            # "yes" or None read as bool() before
        raise TypeError(f"{_OP}: causal={causal!r}; give True or False (sdpa's is_causal "
                        "takes a bool only)")
    for name, size in (("tile_q", tile_q), ("tile_k", tile_k)):
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"{_OP}: {name}={size!r}; give a positive int (e.g. 128)")
    D = q.shape[3]
    # 1/sqrt(D); a head_dim of 0 makes every score 0 whatever the scale (torch's kernels
    # then return the mean of v; 1/sqrt(0) would raise ZeroDivisionError here)
    scale = (1.0 / math.sqrt(D) if D else 1.0) if scale is None else _checks.scale(_OP, scale)
    B, Hkv = _batch(q, k, v), _kv_heads(k, v)
    built = build_mask(q.shape[2], k.shape[2], q.shape[1], Hkv, B, bool(causal), mask, q.device)
    return AttentionCall(built, float(dropout_p), scale, tile_q or TILE_Q, tile_k or TILE_K, stats)


def _check_shapes(q, k, v, dropout_p) -> None:
    """The checks the op and its cost share: a cost of shapes the op refuses would be a
    number for a call that cannot run."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.floating(_OP, name, t)
        if t.dim() != 4:
            raise ValueError(f"{_OP}: {name}.shape={tuple(t.shape)}; expected 4-d (batch, heads, "
                             f"seq, head_dim). Fix: add a heads dim with {name}.unsqueeze(1)")
    _checks.same_dtype(_OP, q=q, k=k, v=v)
    (_, Hq, Sq, D), (_, Hk, Sk, Dk), (_, Hv, Sv, _) = q.shape, k.shape, v.shape
    shapes = f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
    if len({n for n in (q.shape[0], k.shape[0], v.shape[0]) if n != 1}) > 1:
        raise ValueError(f"{_OP}: batch sizes do not broadcast ({shapes}); each must be 1 or "
                         "the same B, as scaled_dot_product_attention takes")
    if Sk != Sv:
        # (torch 2.13's CPU flash kernel returns a number for this; its math kernel raises)
        raise ValueError(f"{_OP}: k has {Sk} keys and v {Sv} values ({shapes}); give one "
                         "value per key")
    if Dk != D:
        raise ValueError(f"{_OP}: q head_dim {D} != k head_dim {Dk} (q.shape={tuple(q.shape)}, "
                         f"k.shape={tuple(k.shape)})")
    if (Hq or (Hk == 0) != (Hv == 0)) and (Hk < 1 or Hv < 1 or Hq % Hk or Hq % Hv):
        # (no query head: an empty output, as sdpa's, unless one of k, v has heads and the
        # other none, which crashes torch 2.13's CPU sdpa; k or v without heads for q heads
        # gives sdpa uninitialised numbers)
        raise ValueError(f"{_OP}: q has {Hq} heads, k {Hk} and v {Hv} ({shapes}); "
                         "grouped-query attention needs q heads to be a multiple of k heads and "
                         "of v heads (each at least 1), as scaled_dot_product_attention("
                         "enable_gqa=True) asks")
    if not (isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, torch.Tensor) and
            dropout_p.dim() == 0 and not dropout_p.is_complex()) or \
            isinstance(dropout_p, bool) or getattr(dropout_p, "dtype", None) == torch.bool:
        # (sdpa takes a 0-d tensor too, and a bool as 0.0 / 1.0: refused here)
        raise TypeError(f"{_OP}: dropout_p={dropout_p!r}; give a float in [0, 1]")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{_OP}: dropout_p={dropout_p}; it must be in [0, 1], as "
                         "scaled_dot_product_attention takes")


def _batch(q, k, v) -> int:
    """The broadcast batch size (checked by :func:`_check_shapes`)."""
    return max(q.shape[0], k.shape[0], v.shape[0]) if min(
        q.shape[0], k.shape[0], v.shape[0]) else 0


def _kv_heads(k, v) -> int:
    """K/V heads the kernels see: k's and v's when equal, else their lcm (which divides Hq);
    1 for k and v without heads (q has none then either)."""
    return max(1, k.shape[1] if k.shape[1] == v.shape[1] else math.lcm(k.shape[1], v.shape[1]))


def _aligned(q, k, v):
    """q, k, v with one batch size (broadcast views: no copy) and k, v with one head count
    (repeat_interleave to their lcm, only when they differ): the layout the tiled and NPU
    kernels take.  Autograd sums the gradients of broadcast copies back."""
    B, H = _batch(q, k, v), _kv_heads(k, v)
    q, k, v = (t if t.shape[0] == B else t.expand(B, *t.shape[1:]) for t in (q, k, v))
    k, v = (t if t.shape[1] == H else t.repeat_interleave(H // t.shape[1], 1) for t in (k, v))
    return q, k, v


def _no_heads(q, k, v, c: AttentionCall):
    """q without heads: the empty (B, 0, Sq, Dv) output sdpa gives, on the autograd graph
    (every backend: there is no work to do)."""
    return _unfused(q, k[:, :0], v[:, :0], c)


@register(_OP, "reference")
def _reference(q, k, v, c: AttentionCall):
    q, k, v = _aligned(q, k, v)
    seed = int(torch.randint(0, 2**62, ())) if c.dropout_p > 0 else 0   # from torch's RNG
    return FlashAttention2.apply(q, k, v, c.mask, c.scale, 1.0 - c.dropout_p, seed,
                                 c.tile_q, c.tile_k, c.stats)


@register(_OP, "native")
def _native(q, k, v, c: AttentionCall):
    """PyTorch's fused attention kernels (flash / memory-efficient / math, its choice)."""
    causal_only = c.mask is not None and c.mask.causal_only
    dense = (None if c.mask is None or causal_only
             else c.mask.dense4(q.shape[2], k.shape[2], q.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, dropout_p=c.dropout_p,
                                          is_causal=causal_only, scale=c.scale,
                                          enable_gqa=q.shape[1] != k.shape[1]
                                          or q.shape[1] != v.shape[1])


@register(_OP, "unfused")
def _unfused(q, k, v, c: AttentionCall):
    """Textbook attention: every S x S intermediate goes to memory; P is kept for backward.
    Batch sizes broadcast in the matmuls."""
    gk, gv = (q.shape[1] // t.shape[1] if t.shape[1] else 1 for t in (k, v))
    if gk > 1:                                       # GQA by copying K/V to every query head
        k = k.repeat_interleave(gk, 1)
    if gv > 1:
        v = v.repeat_interleave(gv, 1)
    s = (q @ k.transpose(-2, -1)) * c.scale          # (B, Hq, Sq, Sk) scores
    if c.mask is not None:
        keep = c.mask.dense4(q.shape[2], k.shape[2], q.device)
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)                     # (B, Hq, Sq, Sk) probabilities
    if c.mask is not None:
        has_key = keep.any(-1, keepdim=True)         # softmax of an all -inf row is NaN
        if not bool(has_key.all()):
            p = p.masked_fill(~has_key, 0.0)         # ... the fused kernels output 0 there
    if c.dropout_p > 0:                              # dropout: an S x S bool mask in memory
        kept = torch.rand_like(p) >= c.dropout_p
        p = p * kept / (1.0 - c.dropout_p) if c.dropout_p < 1 else p * kept   # p=1: times 0
    return p @ v                                     # (B, Hq, Sq, Dv)


_NPU_FULL_BAND = 2147483647      # pre_tockens / next_tockens: "no band limit"
_NPU_CAUSAL_SIDE = 2048          # sparse_mode 2 takes a compressed 2048 x 2048 causal mask


@register(_OP, "npu")
def _npu(q, k, v, c: AttentionCall):
    """``torch_npu.npu_fusion_attention`` in the BNSD layout, every argument positional."""
    npu = torch_npu_module()
    for t in (q, k, v):
        check_dtype(t, "wb.ops.flash_attention")
    q, k, v = _aligned(q, k, v)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{_OP} on the NPU: q.dtype is {q.dtype}; npu_fusion_attention takes "
                        "float16, bfloat16 or float32 (q.float())")
    B, Hq, Sq, _ = q.shape
    # dropout_p=1 drops everything (sdpa: zeros, zero gradients); keep_prob=0 is outside
    # what npu_fusion_attention documents, so run it without dropout and multiply by 0
    keep_prob = 1.0 - c.dropout_p if c.dropout_p < 1 else 1.0
    if c.mask is None:
        atten_mask, sparse_mode = None, 0
    elif c.mask.causal_only:                         # left-up causal == PyTorch's is_causal
        atten_mask = torch.ones(_NPU_CAUSAL_SIDE, _NPU_CAUSAL_SIDE, dtype=torch.bool,
                                device=q.device).triu_(1)
        sparse_mode = 2
    else:                                            # full mask; torch_npu: True = masked OUT
        keep = c.mask.dense4(Sq, k.shape[2], q.device)      # (b, h, Sq, Sk)
        if keep.shape[0] == 1 and keep.shape[1] > 1:        # 1NSS is not a layout it takes
            keep = keep.expand(B, -1, -1, -1)
        atten_mask, sparse_mode = (~keep).contiguous(), 0
    out = npu.npu_fusion_attention(
        q, k, v, Hq, "BNSD",
        None, None, atten_mask,                      # pse, padding_mask, atten_mask
        c.scale, keep_prob,                          # scale (default there is 1.0!), keep_prob
        _NPU_FULL_BAND, _NPU_FULL_BAND,              # pre_tockens, next_tockens
        0, None, None, None,                         # inner_precise, prefix, actual_seq_q/kvlen
        sparse_mode)
    return out[0] if c.dropout_p < 1 else out[0] * 0     # every weight dropped: zeros


@register_cost(_OP)
def _cost(q, k, v, *, causal=False, mask=None, dropout_p=0.0, scale=None, **_tiles) -> OpCost:
    """FLOPs count the matmuls over the (query, key) pairs actually attended; the unfused
    bytes follow ``_unfused`` kernel by kernel.  Inputs broadcast along batch are read
    as their own bytes (as a broadcast mask is); outputs and scores have the batch B."""
    _check_shapes(q, k, v, dropout_p)
    _, Hq, Sq, D = q.shape
    B, Sk, Dv = _batch(q, k, v), k.shape[2], v.shape[3]
    e, S = q.element_size(), B * Hq * Sq * Sk              # S: elements of one score matrix
    built = build_mask(Sq, Sk, Hq, _kv_heads(k, v), B, bool(causal), mask)
    keep = None if built is None else built.dense4(Sq, Sk, "cpu")      # (b, h, Sq, Sk)
    pairs = S if keep is None else int(keep.sum()) * (B * Hq // (keep.shape[0] * keep.shape[1]))
    m = 0 if keep is None else keep.numel()                # bytes of the bool mask, built
    # ... or given: the bool tensor's own bytes, read once (a (B, 1, 1, Sk) key-padding
    # mask is B * Sk bytes, not the B * Sq * Sk of its broadcast view)
    m_read = nbytes(mask) if isinstance(mask, torch.Tensor) else 0
    empty_rows = keep is not None and not bool(keep.any(-1).all())
    L = _kv_heads(k, v)       # k and v of different head counts: copied to L heads (_aligned)
    inputs = nbytes(q) + sum(nbytes(t) * (L // t.shape[1] if t.shape[1] else 1) for t in (k, v))
    out = B * Hq * Sq * Dv * e
    lse = B * Hq * Sq * max(4, e)                          # float32 log-sum-exp per row
    # copies the unfused matmuls make: K/V repeated per query head (GQA), and an input of
    # batch 1 expanded to B (a broadcast batched matmul materialises it, and saves that)
    fq, fk, fv = (B // t.shape[0] if t.shape[0] and B else 1 for t in (q, k, v))
    fk, fv = (f * (Hq // t.shape[1] if t.shape[1] else 1) for f, t in ((fk, k), (fv, v)))
    kv = nbytes(k) * fk + nbytes(v) * fv                   # K/V as the unfused matmuls read them

    unfused = [                                            # (bytes read, bytes written)
        (nbytes(k), nbytes(k) * fk) if fk > 1 else (0, 0),     # repeat_interleave for GQA,
        (nbytes(v), nbytes(v) * fv) if fv > 1 else (0, 0),     # broadcast batch copies
        (nbytes(q), nbytes(q) * fq) if fq > 1 else (0, 0),
        (nbytes(q) * fq + nbytes(k) * fk, S * e),          # S = Q K^T
        (S * e, S * e),                                    # * scale
        (m + S * e, m + S * e) if keep is not None else (0, 0),  # ~keep, masked_fill
        (m, 0) if keep is not None else (0, 0),            # keep.any(-1): rows with a key
        (S * e, S * e),                                    # softmax
        (S * e, S * e) if empty_rows else (0, 0),          # zero the rows with no key
        *([(0, S * e), (S * e, S), (S * e + S, S * e)] if dropout_p > 0
          else []),                                        # rand, >=, * kept,
        (S * e, S * e) if 0 < dropout_p < 1 else (0, 0),   # / keep_prob (not for p = 1)
        (S * e + nbytes(v) * fv, out),                     # O = P V
    ]
    saved_unfused = (nbytes(q) * fq + kv + S * e + m       # q, k, v; P; the mask
                     + (S * e + m // Sk if empty_rows else 0)
                     + (S + S * e if dropout_p > 0 else 0))   # the kept mask, P after it
    return OpCost(_OP, flops=2 * pairs * (D + Dv), backward_flops=2 * pairs * (3 * D + 2 * Dv),
                  bytes_fused=inputs + out + lse + m_read,   # patterns: from positions
                  bytes_unfused=sum(r + w for r, w in unfused),
                  saved_bytes_fused=inputs + out + lse,
                  saved_bytes_unfused=saved_unfused)
