"""Paged attention: ``paged_attention(q, k_pool, v_pool, block_table, seq_lens)``.

Attention whose keys and values live in a pool of fixed-size blocks and are read
through each sequence's block table (Kwon et al. 2023, "Efficient Memory Management
for Large Language Model Serving with PagedAttention", sec. 4.1; the bookkeeping is
``kv_blocks.py``):

    q            (B, Hq, Sq, D)          each sequence's LAST Sq positions (decode: Sq = 1)
    k/v_pool     (num_blocks, Hkv, block_size, D)   the shared pool
    block_table  (B, max_blocks) int     logical block i of sequence b is physical
                                         block block_table[b, i]
    seq_lens     (B,) int                tokens sequence b holds, its Sq new ones included

Query i of sequence b sits at position seq_lens[b] - Sq + i and attends to the keys at
positions <= it (causal, bottom-right aligned): for Sq = 1 every key held.  The result
equals ``flash_attention`` on the same keys laid out contiguously.

Backends:

* reference - vLLM's kernel loop, written for reading: per sequence, block by block
  through the table, an online softmax (running max, running sum; Milakov &
  Gimelshein 2018) so no (Sq, T) score matrix and no gathered copy exist;
* unfused / native - gather the sequence's blocks into a contiguous (Hkv, T, D) copy,
  then textbook / ``scaled_dot_product_attention`` (what a server without a paged
  kernel does: the copy costs T x Hkv x D x 2 elements per layer per step);
* npu - ``torch_npu.npu_fused_infer_attention_score`` with ``block_table``, decode
  only (Sq = 1; /work/shared/reference/torch_npu.md: "paged KV cache via block_table
  [B, max_blocks] int32 + block_size").  Its contract as the workbench reads the torch_npu
  docs (unconfirmed on hardware): keyword arguments; query "BSH" (B, Sq, Hq * D); the
  cache (num_blocks, block_size, Hkv * D); ``scale`` defaults to 1.0, so it is always
  passed; ``actual_seq_lengths_kv`` the per-sequence lengths; ``block_table`` int32.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from ..npu.device import torch_npu_module
from ..npu.guard import check_dtype
from . import _checks
from .cost import OpCost, nbytes
from .registry import dispatch, register, register_cost

__all__ = ["paged_attention"]

_OP = "paged_attention"


def paged_attention(q, k_pool, v_pool, block_table, seq_lens, *, scale: float | None = None):
    """Attention of q (B, Hq, Sq, D) over the keys/values each sequence holds in the pools,
    read through ``block_table`` (module docstring) -> (B, Hq, Sq, D)."""
    relevant = (q, k_pool, v_pool, block_table, seq_lens)
    if has_torch_function(relevant):
        return handle_torch_function(paged_attention, relevant, q, k_pool, v_pool, block_table,
                                     seq_lens, scale=scale)
    table, lens, scale = _check(q, k_pool, v_pool, block_table, seq_lens, scale)
    return dispatch(_OP, (q, k_pool, v_pool))(q, k_pool, v_pool, table, lens, scale)


def _check(q, k_pool, v_pool, block_table, seq_lens, scale):
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        _checks.floating(_OP, name, t)
        if t.dim() != 4:
            raise ValueError(f"{_OP}: {name}.shape={tuple(t.shape)}; expected 4-d: q (B, Hq, "
                             "Sq, D), pools (num_blocks, Hkv, block_size, D)")
    _checks.same_dtype(_OP, q=q, k_pool=k_pool, v_pool=v_pool)
    B, Hq, Sq, D = q.shape
    nb, Hkv, bs, Dk = k_pool.shape
    if v_pool.shape != k_pool.shape or Dk != D or Hq % Hkv:
        raise ValueError(f"{_OP}: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool "
                         f"{tuple(v_pool.shape)}: the pools must match, share D with q, and "
                         "q's heads must be a multiple of the pools' heads")
    table = torch.as_tensor(block_table)
    lens = torch.as_tensor(seq_lens)
    if table.dim() != 2 or table.shape[0] != B or not _integer(table):
        raise ValueError(f"{_OP}: block_table of shape {tuple(table.shape)} and dtype "
                         f"{table.dtype}; give (B={B}, max_blocks) integer block ids")
    if lens.shape != (B,) or not _integer(lens):
        raise ValueError(f"{_OP}: seq_lens of shape {tuple(lens.shape)} and dtype {lens.dtype}; "
                         f"give (B={B},) ints")
    if B == 0:                                           # no sequence: nothing to read
        return table.long(), lens.long(), _scale(scale, D)
    if bool((lens < Sq).any()) or bool((lens > table.shape[1] * bs).any()):
        raise ValueError(f"{_OP}: seq_lens {lens.tolist()} must be in [Sq={Sq}, max_blocks x "
                         f"block_size = {table.shape[1] * bs}]: each sequence holds its new "
                         "tokens, in the blocks its table lists")
    used = torch.cat([table[b, :-(-int(n) // bs)] for b, n in enumerate(lens)])
    if bool(((used < 0) | (used >= nb)).any()):
        raise IndexError(f"{_OP}: block_table names block {int(used[(used < 0) | (used >= nb)][0])}"
                         f"; the pool has blocks 0 .. {nb - 1}")
    return table.long(), lens.long(), _scale(scale, D)


def _scale(scale, D) -> float:
    return 1.0 / math.sqrt(D) if scale is None else _checks.scale(_OP, scale)


def _integer(t) -> bool:
    """An integer dtype; bool is not one (True would read as block 1)."""
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _gather(pool, row, n):
    """The first n token slots of one sequence's blocks, contiguous: (Hkv, n, D)."""
    bs = pool.shape[2]
    blocks = pool[row[:-(-n // bs)]]                     # (nblk, Hkv, bs, D)
    return blocks.transpose(0, 1).reshape(pool.shape[1], -1, pool.shape[3])[:, :n]


def _keep(Sq, n, device):
    """(Sq, n) True where query i (position n - Sq + i) may see key j."""
    return (torch.arange(n - Sq, n, device=device)[:, None]
            >= torch.arange(n, device=device)[None, :])


@register(_OP, "reference")
def _reference(q, k_pool, v_pool, table, lens, scale):
    """Block by block through the table with an online softmax (vLLM's kernel loop), in
    float32 (a kernel's accumulators), float64 for float64 inputs."""
    B, Hq, Sq, D = q.shape
    g, bs = Hq // k_pool.shape[1], k_pool.shape[2]
    ct = torch.promote_types(q.dtype, torch.float32)                        # compute dtype
    out = torch.empty_like(q)
    for b in range(B):
        n = int(lens[b])
        qb = q[b].to(ct) * scale                                            # (Hq, Sq, D)
        pos = torch.arange(n - Sq, n, device=q.device)                      # query positions
        m = torch.full((Hq, Sq, 1), float("-inf"), dtype=ct, device=q.device)   # running max
        l = torch.zeros(Hq, Sq, 1, dtype=ct, device=q.device)               # running sum
        acc = torch.zeros(Hq, Sq, D, dtype=ct, device=q.device)
        for i in range(-(-n // bs)):                                        # logical blocks
            phys = int(table[b, i])                                         # ... read through
            cols = torch.arange(i * bs, min((i + 1) * bs, n), device=q.device)
            kb = k_pool[phys, :, :len(cols)].to(ct).repeat_interleave(g, 0)    # (Hq, c, D)
            vb = v_pool[phys, :, :len(cols)].to(ct).repeat_interleave(g, 0)
            s = qb @ kb.transpose(-2, -1)                                   # (Hq, Sq, c)
            s = s.masked_fill(pos[:, None] < cols[None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            alive = torch.isfinite(m_new)                                   # a row saw a key
            p = torch.where(alive, torch.exp(s - m_new), 0.0)
            corr = torch.where(alive, torch.exp(m - m_new), 1.0)
            l = l * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ vb
            m = m_new
        out[b] = (acc / l).to(q.dtype)
    return out


def _contiguous(attend):
    def impl(q, k_pool, v_pool, table, lens, scale):
        if q.shape[0] == 0:
            return torch.empty_like(q)                          # (0, Hq, Sq, D): no sequence
        outs = []
        for b in range(q.shape[0]):
            n = int(lens[b])
            k, v = _gather(k_pool, table[b], n), _gather(v_pool, table[b], n)   # (Hkv, n, D)
            outs.append(attend(q[b:b + 1], k[None], v[None], _keep(q.shape[2], n, q.device),
                               scale))
        return torch.cat(outs)
    return impl


def _textbook(q, k, v, keep, scale):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-2, -1)) * scale                                   # (1, Hq, Sq, n)
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v


def _sdpa(q, k, v, keep, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


register(_OP, "unfused")(_contiguous(_textbook))
register(_OP, "native")(_contiguous(_sdpa))


@register(_OP, "npu")
def _npu(q, k_pool, v_pool, table, lens, scale):
    """``torch_npu.npu_fused_infer_attention_score`` on the paged cache (decode only)."""
    npu = torch_npu_module()
    for t in (q, k_pool, v_pool):
        check_dtype(t, "wb.ops.paged_attention")
    B, Hq, Sq, D = q.shape
    nb, Hkv, bs, _ = k_pool.shape
    if Sq != 1:
        raise NotImplementedError(f"{_OP} on the NPU: Sq={Sq} new tokens; the workbench calls "
                                  "the incremental (decode, Sq = 1) kernel only: run prefill "
                                  "with wb.ops.flash_attention")
    query = q.transpose(1, 2).reshape(B, Sq, Hq * D)                        # "BSH"
    key = k_pool.transpose(1, 2).reshape(nb, bs, Hkv * D)                   # (blocks, bs, H)
    value = v_pool.transpose(1, 2).reshape(nb, bs, Hkv * D)
    out = npu.npu_fused_infer_attention_score(
        query, key, value, block_table=table.to(torch.int32),
        actual_seq_lengths_kv=[int(n) for n in lens], num_heads=Hq,
        num_key_value_heads=Hkv, scale=scale,            # the default there is 1.0
        input_layout="BSH", block_size=bs)
    return out[0].reshape(B, Sq, Hq, D).transpose(1, 2)


@register_cost(_OP)
def _cost(q, k_pool, v_pool, block_table, seq_lens, **_) -> OpCost:
    """FLOPs of the (query, key) pairs attended; bytes: the paged kernel reads q, each
    sequence's blocks once (whole blocks: the last one's empty slots too) and writes the
    output; the gathered path also writes and reads the contiguous copy."""
    _check(q, k_pool, v_pool, block_table, seq_lens, None)     # the op's own checks
    Sq, D = q.shape[2], q.shape[3]
    Hq, Hkv, bs, e = q.shape[1], k_pool.shape[1], k_pool.shape[2], k_pool.element_size()
    lens = [int(n) for n in torch.as_tensor(seq_lens)]
    pairs = sum(Sq * n - Sq * (Sq - 1) // 2 for n in lens) * Hq             # causal rows
    blocks = sum(-(-n // bs) for n in lens) * 2 * Hkv * bs * D * e          # k and v blocks
    copy = sum(lens) * 2 * Hkv * D * e                                      # gathered k, v
    io = nbytes(q) * 2
    return OpCost(_OP, flops=4 * pairs * D, backward_flops=0, bytes_fused=io + blocks,
                  bytes_unfused=io + blocks + 2 * copy, saved_bytes_fused=0,
                  saved_bytes_unfused=0)
