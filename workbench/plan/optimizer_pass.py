"""One pass of an optimizer step over parameter-sized memory (``plan.optimizer_step``)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Pass", "ADAM"]

ADAM = 16 + 12          # multi_tensor_adam: read p, g, m, v; write p, m, v (fp32)


@dataclass(frozen=True)
class Pass:
    """One pass over parameter-sized memory: ``nbytes`` read + written per element of
    every parameter of the rank (``over="psi"``) or of its partition (``"shard"``),
    ``kernels`` launches (that many per parameter tensor if ``per_tensor``: the source
    loops over tensors); ``source``: where the code runs it."""
    name: str
    nbytes: float
    over: str
    source: str
    per_tensor: bool = False
    kernels: int = 1
