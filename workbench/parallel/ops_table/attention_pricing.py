"""Fused attention on the clock: priced at the rate a profile gives for its shape.

A profile may price a fused attention kernel by its shape (``sim_mesh.kernel_cost.
AttentionShape``: batch x heads, sequence, head dimension, causal, forward or backward):
from the rates measured on the device (``sim_mesh.measured``, the H100) or from a
published per-shape table (``sim_mesh.fa2_a100``: FlashAttention-2 on the A100, Dao 2023
Fig. 4).  The planner prices its attention kernels so (``plan.layer_cost``,
``plan.llama_layer``, ``plan.context_cost``); so that the training clock and the dry run
price the same kernel alike, the op table's ``scaled_dot_product_attention``,
``flash_attention`` and ``ring_attention_step`` on 16-bit tensors carry an
:class:`AttentionCost`, which the clock (``pricing.record_forward`` and the backward
event) prices with :meth:`AttentionCost.measured` instead of the one efficiency of the
profile's op class ``attention`` (as ``loss_pricing.LossCost`` does for the loss).  A
profile that prices no shapes (no ``measured`` file, no ``attention_table``) gets None:
the roofline prices it as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...sim_mesh import cost as _cost
from ...sim_mesh.profiles import get_profile
from .costs import Cost

__all__ = ["AttentionCost", "with_shape"]

_SIXTEEN_BITS = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class AttentionCost(Cost):
    """A fused attention kernel's :class:`Cost` with its shape on the rank: ``bh`` batch x
    query heads, ``seq`` query rows, ``head_dim``, ``causal`` (the mask inside the
    kernel), ``dtype`` its 16-bit dtype's name."""
    bh: int = 0
    seq: int = 0
    head_dim: int = 0
    causal: bool = False
    dtype: str = "bfloat16"

    def measured(self, profile) -> "tuple[float, float] | None":
        """(forward, backward) seconds at the rate the profile gives this shape (one
        launch each), or None where the profile prices no attention shapes."""
        prof = get_profile(profile)
        if not (prof.measured or prof.attention_table):
            return None
        out = []
        for flops, nbytes, backward in ((self.flops, self.bytes, False),
                                        (self.backward_flops, self.backward_bytes, True)):
            shape = _cost.AttentionShape(self.bh, self.seq, self.head_dim, self.causal,
                                         backward)
            out.append(_cost.compute_time(flops, nbytes, prof, self.dtype, "attention",
                                          gemm=shape))
        return out[0], out[1]


def with_shape(c: Cost, q, causal: bool) -> Cost:
    """``c`` as an :class:`AttentionCost` of query ``q`` (..., heads, rows, head_dim) when
    ``q`` is 16-bit with rows (the kernels a profile prices by shape), else ``c``."""
    if not isinstance(q, torch.Tensor) or q.dtype not in _SIXTEEN_BITS or q.dim() < 3 \
            or q.numel() == 0:
        return c
    bh = q.numel() // (q.shape[-2] * q.shape[-1])
    return AttentionCost(c.flops, c.bytes, c.backward_flops, c.backward_bytes, bh,
                         q.shape[-2], q.shape[-1], bool(causal),
                         str(q.dtype).split(".")[1])
