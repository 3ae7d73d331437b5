"""SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer").

    swiglu(x, dim) = silu(a) * b,   a, b = x.chunk(2, dim),   silu(a) = a * sigmoid(a)

the gate of Llama's MLP, applied to the concatenated output of the gate and up
projections.  The fused kernel reads x, writes the half-size result, and keeps
only x for backward:

    da = dy * b * sigmoid(a) * (1 + a * (1 - sigmoid(a)))     (d silu / da)
    db = dy * silu(a)

PyTorch has no fused SwiGLU kernel: its ``native`` path is ``F.silu(a) * b``
(two kernels, the silu one fused).  torch_npu has ``npu_swiglu``.
"""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from ..npu.device import torch_npu_module
from ..npu.guard import check_dtype
from . import _checks
from .cost import OpCost, nbytes
from .registry import dispatch, register, register_cost

__all__ = ["swiglu"]

_OP = "swiglu"


def swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """silu of the first half of ``x`` along ``dim`` times the second half."""
    if has_torch_function((x,)):
        return handle_torch_function(swiglu, (x,), x, dim=dim)
    _checks.floating(_OP, "x", x)
    _check_shapes(x, dim)
    return dispatch(_OP, (x,))(x, dim)


def _check_shapes(x, dim) -> None:
    """dim in range and x.shape[dim] even (the op's check and its cost's)."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{_OP}: dim={dim!r}; give an int (e.g. -1, the last dim)")
    if x.dim() == 0:
        raise ValueError(f"{_OP}: x is 0-d; it needs a dim holding the two halves (gate, up)")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{_OP}: dim={dim} is out of range for x.shape={tuple(x.shape)}; "
                         f"use a dim in [{-x.dim()}, {x.dim() - 1}]")
    if x.shape[dim] % 2:
        raise ValueError(f"{_OP}: x.shape[{dim}]={x.shape[dim]} is odd; it must hold the two "
                         "halves (gate, up) of equal size")


class _SwiGLU(torch.autograd.Function):
    """The formula with its hand-written backward; saves x only."""

    @staticmethod
    def forward(ctx, x, dim):
        ct = torch.promote_types(x.dtype, torch.float32)
        a, b = x.to(ct).chunk(2, dim)                   # gate, up: (..., n/2, ...)
        ctx.save_for_backward(x)
        ctx.dim = dim
        return (a * torch.sigmoid(a) * b).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        ct = torch.promote_types(x.dtype, torch.float32)
        a, b = x.to(ct).chunk(2, ctx.dim)
        dyf = dy.to(ct)
        sig = torch.sigmoid(a)
        da = dyf * b * sig * (1 + a * (1 - sig))        # d silu(a) / da = s (1 + a (1 - s))
        db = dyf * a * sig
        return torch.cat((da, db), ctx.dim).to(x.dtype), None


@register(_OP, "reference")
def _reference(x, dim):
    return _SwiGLU.apply(x, dim)


@register(_OP, "unfused")
def _unfused(x, dim):
    """silu written out: sigmoid, multiply, multiply: three kernels through memory."""
    a, b = x.chunk(2, dim)
    return a * torch.sigmoid(a) * b


@register(_OP, "native")
def _native(x, dim):
    a, b = x.chunk(2, dim)
    return F.silu(a) * b


@register(_OP, "npu")
def _npu(x, dim):
    """``torch_npu.npu_swiglu(x, dim)``: the same half split, silu(A) * B."""
    npu = torch_npu_module()
    check_dtype(x, "wb.ops.swiglu")
    return npu.npu_swiglu(x, dim)


@register_cost(_OP)
def _cost(x, dim=-1) -> OpCost:
    _check_shapes(x, dim)
    X, half = nbytes(x), nbytes(x) // 2
    n = x.numel() // 2                                   # output elements
    unfused = [(half, half), (2 * half, half), (2 * half, half)]   # sigmoid, a*s, *b
    return OpCost(_OP, flops=5 * n, backward_flops=10 * n,   # silu ~4 + the product
                  bytes_fused=X + half,
                  bytes_unfused=sum(r + w for r, w in unfused),
                  saved_bytes_fused=X,                   # x (a and b are its halves)
                  saved_bytes_unfused=X + 2 * half)      # a, b (x); sigmoid(a); a*sigmoid(a)
