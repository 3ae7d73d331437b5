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

    ``eps=None`` means the machine epsilon of the compute dtype (float32 for a 16-bit
    x), as ``F.rms_norm`` does (:func:`default_eps`).
    """
    if has_torch_function((x, weight)):
        return handle_torch_function(rms_norm, (x, weight), x, weight, eps=eps)
    if weight is None:
        raise TypeError(f"{_OP}: weight=None; the weight's shape names the normalized dims, so "
                        "give one, e.g. torch.ones(x.shape[-1]) (or use F.rms_norm without it)")
    _checks.floating(_OP, "x", x)
    _checks.floating(_OP, "weight", weight)
    _checks.same_device(_OP, x=x, weight=weight)
    _check_shapes(x, weight)
    if eps is None and isinstance(x, torch.Tensor) and x.is_floating_point():
        eps = default_eps(x.dtype)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise TypeError(f"{_OP}: eps={eps!r} is a {type(eps).__name__}; give a Python float "
                        f"(e.g. 1e-6, or float(eps)), as F.rms_norm takes")
    if not eps >= 0:
        raise ValueError(f"{_OP}: eps={eps}; it must be >= 0 (e.g. 1e-6)")
    return dispatch(_OP, (x, weight))(x, weight, float(eps))


def _check_shapes(x, weight) -> None:
    """weight's shape is x's trailing dims (the op's check and its cost's)."""
    n = weight.dim()
    if n == 0 or x.dim() < n or tuple(x.shape[x.dim() - n:]) != tuple(weight.shape):
        raise ValueError(f"{_OP}: weight.shape={tuple(weight.shape)} must equal the trailing dims "
                         f"of x.shape={tuple(x.shape)} (e.g. weight of shape (x.shape[-1],))")


def _dims(weight: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(-weight.dim(), 0))


def default_eps(dtype: torch.dtype) -> float:
    """``eps=None``: the machine epsilon of the dtype the statistics are computed in
    (float32 for a 16-bit x), which is what ``F.rms_norm(eps=None)`` adds (measured on
    torch 2.13: a bfloat16 x gives the same output with eps=None as with
    ``finfo(float32).eps``, and a different one with ``finfo(bfloat16).eps``)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


class _RMSNorm(torch.autograd.Function):
    """The formula and its hand-written backward: what a fused kernel computes and keeps.

    Forward computes in float32 (at least), multiplies by the weight in the dtype the two
    promote to (``F.rms_norm``'s composite: ``(x_f32 * rstd) * weight``, then x's dtype;
    a float64 weight on a float32 x multiplies in float64) and saves only x (in its own dtype), the
    weight and ``rstd`` (float32, one per row), as PyTorch's CUDA ``_fused_rms_norm``
    and torch_npu's ``npu_rms_norm`` do; ``F.rms_norm``'s CPU composite keeps a float32
    copy of x and of x * rstd as well (6 bytes per element more for a 16-bit x).

    ``k`` is the number of normalized (trailing) dims; ``weight`` is None or broadcasts
    against x (a simulator's stacked tensor may hand each rank its own view of the
    weight: its gradient is summed to the weight's own shape, so per-rank views get
    per-rank sums).  Double backward: under ``create_graph`` the backward recomputes
    rstd from x, so that second derivatives see rstd depend on x."""

    @staticmethod
    def forward(ctx, x, weight, eps, k):
        dims = tuple(range(-k, 0))
        ct = torch.promote_types(x.dtype, torch.float32)            # compute in fp32
        xf = x.to(ct)
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)  # (..., 1)
        y = xf * rstd
        if weight is not None:
            y = y * weight                           # in promote_types(ct, weight.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps, ctx.k = eps, k
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        ct, dims = rstd.dtype, tuple(range(-ctx.k, 0))
        xf = x.to(ct)
        if torch.is_grad_enabled():         # create_graph: rstd as a function of x
            rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + ctx.eps)
        x_hat = xf * rstd
        pt = ct if weight is None else torch.promote_types(ct, weight.dtype)   # y's compute
        dyf = dy.to(pt)
        g = dyf if weight is None else (dyf * weight).to(ct)        # gradient w.r.t. x_hat
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (rstd * (g - x_hat * (g * x_hat).mean(dims, keepdim=True))).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            dw = (dyf * x_hat.to(pt)).sum_to_size(weight.shape).to(weight.dtype)
        return dx, dw, None, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   k: int) -> torch.Tensor:
    """RMSNorm over the trailing ``k`` dims of x that keeps for backward only what a fused
    kernel keeps (:class:`_RMSNorm`); ``weight`` None or broadcasting against x.  No
    argument checks: :func:`rms_norm` and the op table's norm check them."""
    return _RMSNorm.apply(x, weight, eps, k)


@register(_OP, "reference")
def _reference(x, weight, eps):
    return _RMSNorm.apply(x, weight, eps, weight.dim())


@register(_OP, "unfused")
def _unfused(x, weight, eps):
    """Five element-wise kernels, each through memory (a sixth casts back to x's dtype
    when the weight's dtype differs, as F.rms_norm returns x's dtype)."""
    ms = x.pow(2).mean(_dims(weight), keepdim=True)    # (..., 1)
    rstd = torch.rsqrt(ms + eps)
    y = x * rstd * weight
    return y if y.dtype == x.dtype else y.to(x.dtype)


# devices where F.rms_norm runs PyTorch's fused kernel, ``aten::_fused_rms_norm``
# (pytorch/pytorch#153666, CUDA; intel/torch-xpu-ops#1905, XPU); elsewhere (CPU, meta)
# it decomposes into element-wise ops that keep float32 copies (_RMSNorm's docstring)
FUSED_DEVICES = ("cuda", "xpu")


@register(_OP, "native")
def _native(x, weight, eps):
    """``torch.nn.functional.rms_norm`` where PyTorch fuses it (:data:`FUSED_DEVICES`);
    elsewhere the formula with the fused kernel's contract (same values, same saved
    tensors), as F.rms_norm's composite would keep 6 bytes per element more."""
    if x.device.type in FUSED_DEVICES:
        return F.rms_norm(x, tuple(weight.shape), weight, eps)
    return _RMSNorm.apply(x, weight, eps, weight.dim())


@register(_OP, "npu")
def _npu(x, weight, eps):
    """``torch_npu.npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``; no +1 offset on gamma.
    A weight of another dtype than x: the formula in torch ops (:class:`_RMSNorm`), since
    npu_rms_norm's contract for mixed dtypes is unconfirmed (shared/reference/torch_npu.md)."""
    npu = torch_npu_module()
    check_dtype(x, "wb.ops.rms_norm")
    if weight.dtype != x.dtype:
        return _RMSNorm.apply(x, weight, eps, weight.dim())
    return npu.npu_rms_norm(x, weight, eps)[0]


@register_cost(_OP)
def _cost(x, weight, eps=1e-6) -> OpCost:
    _check_shapes(x, weight)
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
    if weight.dtype != x.dtype:                          # * weight in the promoted dtype,
        P = x.numel() * torch.promote_types(x.dtype, weight.dtype).itemsize   # then back
        unfused[-1:] = [(X + W, P), (P, X)]              # to x's dtype (_unfused)
    return OpCost(_OP, flops=4 * x.numel(), backward_flops=8 * x.numel(),
                  bytes_fused=2 * X + W + rstd,           # read x, weight; write y, rstd
                  bytes_unfused=sum(r + w for r, w in unfused),
                  saved_bytes_fused=X + W + rstd,         # x, weight, rstd
                  saved_bytes_unfused=2 * X + W + rows * e)   # x, x*rstd, weight, rstd
