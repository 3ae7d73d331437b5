"""Linear: ``y = x @ weight.T + bias`` (x (..., in), weight (out, in), bias (out,)).

As ``F.linear`` (torch 2.13, measured): a 1-d weight (in,) gives y (...) and takes no
bias; a bias broadcasts against y (..., out), e.g. of shape (1,) or ().

The fused form adds the bias in the matmul's epilogue (one GEMM, ``addmm``);
unfused, the matmul writes y to memory and a second kernel reads it back to add
the bias.  Backward (the two GEMMs of every linear layer):
    dx = dy @ weight,   dweight = dy^T x (over all leading dims),   dbias = sum dy.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from ..npu.guard import check_dtype
from . import _checks
from .cost import OpCost, nbytes
from .registry import dispatch, register, register_cost

__all__ = ["linear"]

_OP = "linear"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with x (..., in), weight (out, in) or (in,), bias None or
    broadcasting against the result (..., out), as ``F.linear``."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if has_torch_function(tensors):
        return handle_torch_function(linear, tensors, x, weight, bias)
    _checks.floating(_OP, "x", x)
    _checks.floating(_OP, "weight", weight)
    if bias is not None:
        _checks.floating(_OP, "bias", bias)
    _checks.same_dtype(_OP, x=x, weight=weight, bias=bias)
    _checks.same_device(_OP, x=x, weight=weight, bias=bias)
    _check_shapes(x, weight, bias)
    if weight.dim() == 1:                               # (in,): one output, its dim dropped
        return dispatch(_OP, tensors)(x, weight.unsqueeze(0), None).squeeze(-1)
    return dispatch(_OP, tensors)(x, weight, bias)


def _check_shapes(x, weight, bias) -> None:
    """weight (out, in) or (in,) with in == x.shape[-1], bias broadcasting against the
    result (the op's check and its cost's)."""
    if weight.dim() not in (1, 2) or x.dim() < 1 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"{_OP}: x.shape={tuple(x.shape)}, weight.shape={tuple(weight.shape)}; "
                         "need weight (out, in) with in == x.shape[-1]")
    if bias is not None and weight.dim() == 1:
        raise ValueError(f"{_OP}: weight.shape={tuple(weight.shape)} is 1-d, which takes no "
                         "bias (F.linear refuses it too); give weight.unsqueeze(0) for one "
                         "output with a bias of shape (1,)")
    out = tuple(x.shape[:-1]) + (weight.shape[0],)
    if bias is not None and x.dim() >= 3 and bias.dim() >= 2 and bias.shape[-1] == 1 \
            and weight.shape[0] != 1 and math.prod(bias.shape[:-1]) > 1:
        # torch 2.13 flattens a contiguous 3-d x into one GEMM whose bias (rows, out)
        # this does not broadcast to: F.linear raises, or not, by x's memory layout
        raise ValueError(f"{_OP}: bias.shape={tuple(bias.shape)} on x.shape={tuple(x.shape)}: "
                         "F.linear takes it or raises depending on x's memory layout; "
                         f"give bias.expand(*bias.shape[:-1], {weight.shape[0]})")
    if bias is not None and not _checks.broadcasts(tuple(bias.shape), out):
        raise ValueError(f"{_OP}: bias.shape={tuple(bias.shape)} does not broadcast to the "
                         f"result's shape {out}; expected ({weight.shape[0]},)")


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.bias_shape = None if bias is None else bias.shape
        y = x @ weight.transpose(0, 1)                  # (..., out)
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        # only the gradients autograd asks for, as aten's linear / addmm backward (each
        # GEMM guarded by its input's mask): no dgrad for data, no wgrad for a frozen weight
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        dx = dy @ weight if need_x else None            # (..., in)
        rows = math.prod(x.shape[:-1])                  # (not reshape(-1, n): n may be 0)
        dy2, x2 = dy.reshape(rows, dy.shape[-1]), x.reshape(rows, x.shape[-1])
        dweight = dy2.transpose(0, 1) @ x2 if need_w else None  # (out, in): every row's sum
        dbias = None
        if ctx.has_bias and need_b:                     # summed to the bias's own shape
            dbias = dy2.sum(0) if ctx.bias_shape == dy.shape[-1:] else \
                dy.sum_to_size(ctx.bias_shape)
        return dx, dweight, dbias


@register(_OP, "reference")
def _reference(x, weight, bias):
    return _Linear.apply(x, weight, bias)


@register(_OP, "unfused")
def _unfused(x, weight, bias):
    y = x @ weight.T                                    # the GEMM writes y ...
    return y + bias if bias is not None else y         # ... and the add reads it back


@register(_OP, "native")
def _native(x, weight, bias):
    """``F.linear``: addmm, the bias fused into the GEMM."""
    return F.linear(x, weight, bias)


@register(_OP, "npu")
def _npu(x, weight, bias):
    """``F.linear`` on NPU tensors runs torch_npu's MatMul kernel with the bias fused."""
    check_dtype(x, "wb.ops.linear")
    return F.linear(x, weight, bias)


@register_cost(_OP)
def _cost(x, weight, bias=None) -> OpCost:
    _check_shapes(x, weight, bias)
    rows = math.prod(x.shape[:-1])
    out, inp = weight.shape if weight.dim() == 2 else (1, weight.shape[0])
    e = x.element_size()
    Y = rows * out * e
    B = 0 if bias is None else nbytes(bias)
    io = nbytes(x) + nbytes(weight)
    return OpCost(_OP, flops=2 * rows * inp * out + (rows * out if bias is not None else 0),
                  backward_flops=4 * rows * inp * out + (rows * out if bias is not None else 0),
                  bytes_fused=io + B + Y,
                  bytes_unfused=io + Y + ((Y + B + Y) if bias is not None else 0),
                  saved_bytes_fused=io,
                  saved_bytes_unfused=io)
