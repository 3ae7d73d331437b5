"""How close every path is held to the reference, per dtype (used by the tests and
the course's checks).

Two implementations in a low-precision dtype each round differently, so the
bound is absolute + relative, with the absolute part scaled by the size of the
reference values (a gradient of size 50 in bfloat16 is only good to ~0.2).
"""
from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "assert_close"]

TOLERANCES = {              # dtype: (atol per unit of max |reference|, rtol)
    torch.float64: (1e-9, 1e-7),
    torch.float32: (2e-5, 1e-4),
    torch.bfloat16: (4e-2, 4e-2),
    torch.float16: (5e-3, 5e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """``torch.testing.assert_close`` with the tolerance of ``expected.dtype``."""
    atol, rtol = TOLERANCES[expected.dtype]
    scale = max(1.0, float(expected.detach().abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach(), expected.detach(), atol=atol * scale, rtol=rtol,
                               msg=lambda m: f"{what}: {m}" if what else m)
