"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer", arXiv:2104.09864).

Each pair of features is rotated by an angle proportional to the position:

    out = x * cos + rotate(x) * sin

with ``cos``/``sin`` given over the full head dim (as torch_npu's
``npu_rotary_mul`` takes them).  Two conventions pair the features differently:

* ``"half"`` (GPT-NeoX, Llama): feature i pairs with i + D/2;
  rotate(x) = cat(-x2, x1), and cos = cat(c, c) with c of size D/2;
* ``"interleave"`` (GPT-J, the RoFormer paper): feature 2i pairs with 2i+1;
  rotate(x)[2i] = -x[2i+1], rotate(x)[2i+1] = x[2i], and cos repeats each
  angle twice: cos = c.repeat_interleave(2).

:func:`rope_cos_sin` builds cos/sin in either layout.  A rotation's transpose
is its inverse, rotate^T = -rotate, so the backward is
    dx = dy * cos - rotate(dy * sin).
"""
from __future__ import annotations

import math
import numbers
import operator

import torch
from torch.overrides import handle_torch_function, has_torch_function

from ..npu.device import torch_npu_module
from ..npu.guard import check_dtype
from . import _checks
from .cost import OpCost, nbytes
from .registry import dispatch, register, register_cost

__all__ = ["rotary_embedding", "rope_cos_sin", "MODES", "result_dtype"]

_OP = "rotary_embedding"
MODES = ("half", "interleave")


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     mode: str = "half") -> torch.Tensor:
    """Rotate ``x`` (..., S, D) by the angles in ``cos``/``sin`` (broadcastable to x)."""
    if has_torch_function((x, cos, sin)):
        return handle_torch_function(rotary_embedding, (x, cos, sin), x, cos, sin, mode=mode)
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        _checks.floating(_OP, name, t)
    _checks.same_device(_OP, x=x, cos=cos, sin=sin)
    if mode not in MODES:
        raise ValueError(f"{_OP}: mode={mode!r}; use 'half' (NeoX/Llama) or 'interleave' (GPT-J)")
    _check_shapes(x, cos, sin)
    x, cos, sin = promote(x, cos, sin)
    return dispatch(_OP, (x, cos, sin))(x, cos, sin, mode)


def _check_shapes(x, cos, sin) -> None:
    """An even head dim; cos and sin broadcast to x (the op's check and its cost's)."""
    if x.dim() == 0:
        raise ValueError(f"{_OP}: x is 0-d; give x of shape (..., head_dim)")
    if x.shape[-1] % 2:
        raise ValueError(f"{_OP}: x.shape[-1]={x.shape[-1]} is odd; rotary pairs need an even "
                         "head dim")
    for name, t in (("cos", cos), ("sin", sin)):
        if not _checks.broadcasts(tuple(t.shape), tuple(x.shape)):
            raise ValueError(f"{_OP}: {name}.shape={tuple(t.shape)} must broadcast to "
                             f"x.shape={tuple(x.shape)} over the full head dim "
                             f"(build them with wb.ops.rope_cos_sin)")


def result_dtype(x, cos, sin) -> torch.dtype:
    """The dtype of ``x * cos + rotate(x) * sin`` by torch's type promotion: bf16 ``q``
    under ``torch.autocast`` (its linear ran in bf16) with float32 cos/sin gives float32,
    as HF Llama's ``apply_rotary_pos_emb`` does there (its cos/sin take the dtype of the
    float32 hidden states, ``LlamaRotaryEmbedding.forward``; transformers 4.4x,
    models/llama/modeling_llama.py).  Mixed dtypes were refused before."""
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def promote(x, cos, sin):
    """``x``, ``cos``, ``sin`` cast to :func:`result_dtype` (differentiable casts: each
    gradient comes back in its input's dtype, as torch's promotion gives it)."""
    dt = result_dtype(x, cos, sin)
    return tuple(t if t.dtype == dt else t.to(dt) for t in (x, cos, sin))


def rope_cos_sin(seq_len: int, head_dim: int, *, base: float = 10000.0, mode: str = "half",
                 dtype=torch.float32, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq_len, head_dim): angle p * base^(-2i/D) for pair i at position p."""
    if mode not in MODES or head_dim % 2:
        raise ValueError(f"rope_cos_sin(head_dim={head_dim}, mode={mode!r}): head_dim must be "
                         "even and mode 'half' or 'interleave'")
    # each refused value gave numbers before: 2.5 positions -> 3 rows, base <= 0 -> NaN
    # angles, an integer dtype -> cos and sin truncated to 0 / +-1
    for name, v in (("seq_len", seq_len), ("head_dim", head_dim)):
        try:
            ok = not isinstance(v, bool) and operator.index(v) >= 0    # numpy ints are ints
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"rope_cos_sin({name}={v!r}): give an int >= 0")
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not 0 < base < math.inf:
        raise ValueError(f"rope_cos_sin(base={base!r}): give a finite number > 0 "
                         "(10000.0 in RoFormer and Llama 2, 500000.0 in Llama 3)")
    if not torch.empty((), dtype=dtype).is_floating_point():
        raise TypeError(f"rope_cos_sin(dtype={dtype}): cos and sin need a floating dtype, "
                        "e.g. torch.float32")
    pair = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device)
    inv_freq = base ** (-pair / head_dim)                           # (D/2,)
    angles = torch.arange(seq_len, dtype=torch.float64, device=device)[:, None] * inv_freq  # S, D/2
    angles = torch.cat((angles, angles), -1) if mode == "half" else angles.repeat_interleave(2, -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)         # (S, D) each


def _rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The 90-degree rotation of every feature pair."""
    if mode == "half":
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)
    pairs = x.unflatten(-1, (-1, 2))                                # (..., D/2, 2)
    return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, mode):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] or ctx.needs_input_grad[2] else None,
                              cos, sin)
        ctx.mode = mode
        return x * cos + _rotate(x, mode) * sin

    @staticmethod
    def backward(ctx, dy):
        x, cos, sin = ctx.saved_tensors
        dx = dy * cos - _rotate(dy * sin, ctx.mode)                 # rotate^T = -rotate
        dcos = dsin = None
        if ctx.needs_input_grad[1]:
            dcos = (dy * x).sum_to_size(cos.shape)
        if ctx.needs_input_grad[2]:
            dsin = (dy * _rotate(x, ctx.mode)).sum_to_size(sin.shape)
        return dx, dcos, dsin, None


@register(_OP, "reference")
def _reference(x, cos, sin, mode):
    return _Rotary.apply(x, cos, sin, mode)


@register(_OP, "unfused", "native")
def _composed(x, cos, sin, mode):
    """PyTorch has no fused RoPE kernel: native and unfused are the same four kernels."""
    return x * cos + _rotate(x, mode) * sin


@register(_OP, "npu")
def _npu(x, cos, sin, mode):
    """``torch_npu.npu_rotary_mul(x, r1=cos, r2=sin[, rotary_mode])`` on 4-d x.

    'half' is the default there and is called with three arguments, which every
    torch_npu version accepts; 'interleave' is passed as the fourth.
    """
    npu = torch_npu_module()
    check_dtype(x, "wb.ops.rotary_embedding")
    if x.dim() > 4:
        raise ValueError(f"{_OP} on the NPU: x.shape={tuple(x.shape)}; npu_rotary_mul takes "
                         "4-d x such as (batch, heads, seq, head_dim)")
    lead = (1,) * (4 - x.dim())
    x4 = x.reshape(lead + tuple(x.shape))
    cos4, sin4 = (t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) for t in (cos, sin))
    args = (x4, cos4, sin4) if mode == "half" else (x4, cos4, sin4, mode)
    return npu.npu_rotary_mul(*args).reshape(x.shape)


@register_cost(_OP)
def _cost(x, cos, sin, mode="half") -> OpCost:
    _check_shapes(x, cos, sin)
    X, C = nbytes(x), nbytes(cos) + nbytes(sin)
    unfused = [(X, X), (X, X),                           # the rotation: negate half, concatenate
               (X + nbytes(cos), X), (X + nbytes(sin), X), (2 * X, X)]   # x*cos, r*sin, add
    return OpCost(_OP, flops=3 * x.numel(), backward_flops=3 * x.numel(),
                  bytes_fused=2 * X + C,
                  bytes_unfused=sum(r + w for r, w in unfused),
                  saved_bytes_fused=C,                   # cos and sin only (x: not needed)
                  saved_bytes_unfused=C)
