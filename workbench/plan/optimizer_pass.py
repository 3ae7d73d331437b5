"""One pass of an optimizer step over parameter-sized memory (``plan.optimizer_step``)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Pass", "ADAM", "ADAM_KERNEL"]

ADAM = 16 + 12          # multi_tensor_adam: read p, g, m, v; write p, m, v (fp32)
# the name a profile's ``kernel_bandwidth`` gives the Adam update's measured rate
# (benchmarks/gpu_components.py's row of the same name: ``torch.optim.AdamW(fused=True)``,
# a multi_tensor_apply kernel, bytes counted as ADAM counts them)
ADAM_KERNEL = "adamw_fused_fp32"


@dataclass(frozen=True)
class Pass:
    """One pass over parameter-sized memory: ``nbytes`` read + written per element of
    every parameter of the rank (``over="psi"``) or of its partition (``"shard"``),
    ``kernels`` launches (that many per parameter tensor if ``per_tensor``: the source
    loops over tensors); ``source``: where the code runs it; ``kernel``: the name of
    the kernel whose measured rate prices it where the profile has one
    (``profile.kernel_bandwidth[kernel]``; None, or a profile without it: the
    profile's memory rate)."""
    name: str
    nbytes: float
    over: str
    source: str
    per_tensor: bool = False
    kernels: int = 1
    kernel: "str | None" = None
