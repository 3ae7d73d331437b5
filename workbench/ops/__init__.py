"""Fused operators: a readable reference, a fast path per backend, one dispatch table.

Each op has four implementations (see :mod:`workbench.ops.registry`):
``reference`` (the paper's algorithm, for reading), ``unfused`` (the textbook
composition), ``native`` (PyTorch's fused kernels) and ``npu`` (torch_npu's), a
cost count (:func:`cost`), and tests holding every path to the reference.

    import workbench as wb
    y = wb.ops.flash_attention(q, k, v, causal=True)        # (B, H, S, D)
    with wb.ops.use("reference"):
        y = wb.ops.flash_attention(q, k, v, mask=wb.ops.SlidingWindow(256))
    print(wb.ops.cost("flash_attention", q, k, v, causal=True))

Papers: FlashAttention-2 (Dao 2023), RMSNorm (Zhang & Sennrich 2019),
SwiGLU (Shazeer 2020), RoPE (Su et al. 2021), AdamW (Loshchilov & Hutter 2019).
Every public op honours ``__torch_function__``, so a tensor subclass (the SPMD
layer's DistTensor) can intercept it.
"""
from .adamw import AdamW, adamw
from .cost import OpCost, cost
from .flash_attention import TILE_K, TILE_Q, flash_attention
from .flash_reference import TileStats
from .kv_blocks import BlockAllocator, BlockTables, OutOfBlocks, PagedMemory, paged_memory
from .linear import linear
from .moe import attach_aux_loss, moe_combine, moe_dispatch, router_topk
from .masks import BlockDiagonal, Causal, MaskPattern, SlidingWindow, TilePlan, attention_tiles
from .paged_attention import paged_attention
from .registry import BACKENDS, backends, current_backend, implementation, op_names, use
from .rms_norm import rms_norm
from .rotary import rope_cos_sin, rotary_embedding
from .swiglu import swiglu

__all__ = [
    "flash_attention", "rms_norm", "swiglu", "rotary_embedding", "rope_cos_sin", "adamw",
    "AdamW", "linear", "cost", "OpCost", "use", "current_backend", "backends", "op_names",
    "implementation", "BACKENDS", "MaskPattern", "Causal", "SlidingWindow", "BlockDiagonal",
    "TilePlan", "attention_tiles", "TileStats", "TILE_Q", "TILE_K", "PUBLIC_OPS",
    "paged_attention", "BlockAllocator", "BlockTables", "OutOfBlocks", "PagedMemory",
    "paged_memory",
    "router_topk", "moe_dispatch", "moe_combine", "attach_aux_loss",
]

PUBLIC_OPS = (flash_attention, rms_norm, swiglu, rotary_embedding, adamw, linear,
              paged_attention)
