"""FLOPs and bytes moved, fused and unfused: the numbers the cost model and course use.

Conventions (stated once, used by every op):

* FLOPs: a multiply-add is 2 FLOPs (a matmul of (M, K) by (K, N) is 2MNK);
  element-wise work counts the arithmetic the formula does (silu = 4, ...);
  ``backward_flops`` is the backward of the fused path (FlashAttention-2
  recomputes the scores: 5 matmuls where the unfused backward has 4).
* bytes_fused: one kernel reads each input once and writes each output once
  (the ideal the fused kernel approaches; FlashAttention's K/V re-reads across
  query tiles hit on-chip cache / L2 and are not counted).
* bytes_unfused: the textbook composition (backend ``"unfused"``) kernel by
  kernel: each step reads its inputs from memory and writes its result back.
* saved_bytes_*: what autograd keeps for backward, counted the way
  ``torch.autograd.graph.saved_tensors_hooks`` sees it (each storage once);
  tests hold these numbers against that measurement.

    >>> wb.ops.cost("flash_attention", q, k, v, causal=True)
    OpCost(op='flash_attention', flops=..., bytes_fused=..., bytes_unfused=..., ...)

Inputs may be meta tensors (``torch.empty(shape, device="meta")``): only shapes
and dtypes are read, so a planner can cost what it never runs.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from . import registry
from ..text_width import WIDTH

__all__ = ["OpCost", "cost"]


def _si(n: float, unit: str) -> str:
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or prefix == "T":
            return f"{n:.3g} {prefix}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class OpCost:
    """The work of one op call; plain data, addable (``sum(costs, OpCost.zero())``)."""
    op: str
    flops: int                 # forward FLOPs
    backward_flops: int        # backward FLOPs (fused path)
    bytes_fused: int           # forward bytes read + written, one fused kernel
    bytes_unfused: int         # forward bytes read + written, textbook composition
    saved_bytes_fused: int     # kept for backward by the fused path
    saved_bytes_unfused: int   # kept for backward by the textbook composition

    @classmethod
    def zero(cls, op: str = "") -> "OpCost":
        return cls(op, 0, 0, 0, 0, 0, 0)

    @property
    def intensity_fused(self) -> float:
        """FLOPs per byte moved by the fused kernel (compare with the roofline's ridge)."""
        return self.flops / self.bytes_fused if self.bytes_fused else float("inf")

    @property
    def intensity_unfused(self) -> float:
        return self.flops / self.bytes_unfused if self.bytes_unfused else float("inf")

    @property
    def traffic_ratio(self) -> float:
        """How many times more bytes the unfused composition moves."""
        return self.bytes_unfused / self.bytes_fused if self.bytes_fused else float("inf")

    def __add__(self, other: "OpCost") -> "OpCost":
        if not isinstance(other, OpCost):
            return NotImplemented
        op = "+".join(o for o in (self.op, other.op) if o)
        return OpCost(op, *(getattr(self, f.name) + getattr(other, f.name)
                            for f in fields(self) if f.name != "op"))

    def __str__(self) -> str:
        """One line; where it would pass ``text_width.WIDTH`` characters, the memory kept
        for backward goes on a second, indented line."""
        work = (f"{self.op}: {_si(self.flops, 'FLOP')} forward, "
                f"moves {_si(self.bytes_fused, 'B')} fused vs {_si(self.bytes_unfused, 'B')} "
                f"unfused ({self.traffic_ratio:.1f}x),")
        kept = (f"keeps {_si(self.saved_bytes_fused, 'B')} vs "
                f"{_si(self.saved_bytes_unfused, 'B')} for backward")
        one = f"{work} {kept}"
        return one if len(one) <= WIDTH else f"{work}\n    {kept}"


def cost(op: str | Callable, *args, **kwargs) -> OpCost:
    """Count the work of ``op(*args, **kwargs)`` without running it.

    ``op`` is a name (``"rms_norm"``) or the public function (``wb.ops.rms_norm``);
    the arguments are the op's own.
    """
    name = op if isinstance(op, str) else getattr(op, "__name__", repr(op))
    try:
        counter = registry._COSTS[name]
    except KeyError:
        raise KeyError(f"cost({name!r}): no cost model for this op; ops with one: "
                       f"{', '.join(sorted(registry._COSTS))}") from None
    return counter(*args, **kwargs)


def nbytes(t) -> int:
    """Bytes of a tensor's elements (works on meta tensors)."""
    return t.numel() * t.element_size()
