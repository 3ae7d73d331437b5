"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

    y = x / sqrt(mean(x^2) + eps) * weight

over the trailing ``weight.dim()`` dims: LayerNorm without re-centring and
without a bias, as in Llama.  The fused kernel reads x once, writes y once, and
keeps only x and the per-row ``rstd = 1/sqrt(mean(x^2) + eps)`` (float32) for
backward; the unfused composition writes four intermediates and keeps two.

Backward, with x_hat = x * rstd and g = dy * weight (n = normalized size):
    dweight = sum over rows of dy * x_hat
    dx      = rstd * (g - x_hat * mean(g * x_hat))
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.overrides import handle_torch_function, has_torch_function

from ..npu.device import torch_npu_module
from ..npu.guard import check_dtype
from . import _checks
from .cost import OpCost, nbytes
from .registry import dispatch, register, register_cost

__all__ = ["rms_norm"]

_OP = "rms_norm"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None = 1e-6) -> torch.Tensor:
    """RMS-normalize ``x`` over its trailing ``weight.shape`` dims and scale by ``weight``.

    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in ``F.rms_norm``.
    """
    if has_torch_function((x, weight)):
        return handle_torch_function(rms_norm, (x, weight), x, weight, eps=eps)
    if weight is None:
        raise TypeError(f"{_OP}: weight=None; the weight's shape names the normalized dims, so "
                        "give one, e.g. torch.ones(x.shape[-1]) (or use F.rms_norm without it)")
    _checks.floating(_OP, "x", x)
    _checks.floating(_OP, "weight", weight)
    _checks.same_dtype(_OP, x=x, weight=weight)
    _checks.same_device(_OP, x=x, weight=weight)
    n = weight.dim()
    if n == 0 or x.dim() < n or tuple(x.shape[x.dim() - n:]) != tuple(weight.shape):
        raise ValueError(f"{_OP}: weight.shape={tuple(weight.shape)} must equal the trailing dims "
                         f"of x.shape={tuple(x.shape)} (e.g. weight of shape (x.shape[-1],))")
    if eps is None and isinstance(x, torch.Tensor) and x.is_floating_point():
        eps = torch.finfo(x.dtype).eps
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"{_OP}: eps={eps}; it must be >= 0 (e.g. 1e-6)")
    return dispatch(_OP, (x, weight))(x, weight, float(eps))


def _dims(weight: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(-weight.dim(), 0))


class _RMSNorm(torch.autograd.Function):
    """The formula and its hand-written backward; saves x, weight and rstd only."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ct = torch.promote_types(x.dtype, torch.float32)            # compute in fp32
        xf = x.to(ct)
        rstd = torch.rsqrt(xf.pow(2).mean(_dims(weight), keepdim=True) + eps)  # (..., 1)
        y = (xf * rstd * weight.to(ct)).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        ct, dims = rstd.dtype, _dims(weight)
        x_hat = x.to(ct) * rstd
        dyf = dy.to(ct)
        g = dyf * weight.to(ct)                                      # gradient w.r.t. x_hat
        dx = rstd * (g - x_hat * (g * x_hat).mean(dims, keepdim=True))
        lead = tuple(range(x.dim() - weight.dim()))
        dweight = (dyf * x_hat).sum(lead) if lead else dyf * x_hat
        return dx.to(x.dtype), dweight.to(weight.dtype), None


@register(_OP, "reference")
def _reference(x, weight, eps):
    return _RMSNorm.apply(x, weight, eps)


@register(_OP, "unfused")
def _unfused(x, weight, eps):
    """Five element-wise kernels, each through memory."""
    ms = x.pow(2).mean(_dims(weight), keepdim=True)    # (..., 1)
    rstd = torch.rsqrt(ms + eps)
    return x * rstd * weight


@register(_OP, "native")
def _native(x, weight, eps):
    """``torch.nn.functional.rms_norm`` (fused on CUDA; composite with fp32 math on CPU)."""
    return F.rms_norm(x, tuple(weight.shape), weight, eps)


@register(_OP, "npu")
def _npu(x, weight, eps):
    """``torch_npu.npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``; no +1 offset on gamma."""
    npu = torch_npu_module()
    check_dtype(x, "wb.ops.rms_norm")
    return npu.npu_rms_norm(x, weight, eps)[0]


@register_cost(_OP)
def _cost(x, weight, eps=1e-6) -> OpCost:
    rows, e = x.numel() // max(weight.numel(), 1), x.element_size()
    X, W = nbytes(x), nbytes(weight)
    rstd = rows * max(4, e)                              # float32 per row
    unfused = [                                          # (read, write) per kernel
        (X, X),                                          # x^2
        (X, rows * e),                                   # mean
        (rows * e, rows * e), (rows * e, rows * e),      # + eps, rsqrt
        (X + rows * e, X),                               # x * rstd
        (X + W, X),                                      # * weight
    ]
    return OpCost(_OP, flops=4 * x.numel(), backward_flops=8 * x.numel(),
                  bytes_fused=2 * X + W + rstd,           # read x, weight; write y, rstd
                  bytes_unfused=sum(r + w for r, w in unfused),
                  saved_bytes_fused=X + W + rstd,         # x, weight, rstd
                  saved_bytes_unfused=2 * X + W + rows * e)   # x, x*rstd, weight, rstd
