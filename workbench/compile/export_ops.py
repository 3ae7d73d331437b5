"""workbench's fused ops (``wb.ops``) kept whole under ``torch.export``.

``torch.export`` traces through Python: a ``wb.ops.rms_norm`` call becomes its pieces
(pow, mean, rsqrt, casts), and ``wb.ops.flash_attention`` on the meta device becomes
the meta kernel of a plain, non-causal attention (``_MetaFused``): neither is the op the
op table prices and places.  PyTorch's answer for an op that export must not trace into
is a custom operator (``torch.library.custom_op``; the torch.export docs, "Custom
operators"): it stays one node of the graph, its fake (meta) implementation giving the
output's shape.  While capture exports a program, :func:`kept_whole` routes each call of
the ops below (they all honour ``__torch_function__``, as DistTensors need) to such an
operator, ``torch.ops.workbench.<name>``; :data:`ADAPT` maps the node back to the
``wb.ops`` call with the arguments the caller gave.  A call these operators cannot
express (a ``MaskPattern`` mask, tile sizes, ``return_lse``) raises :class:`Unmapped`
and capture traces instead, saying so.

The operators compute what the ``wb.ops`` function computes (their implementation calls
it), so a graph holding one runs as the program does.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch.overrides import TorchFunctionMode

from .. import ops as _ops
from ..ops.rotary import result_dtype

__all__ = ["kept_whole", "ADAPT", "Unmapped"]


class Unmapped(Exception):
    """An ATen op of the exported graph has no op-table entry (or a call cannot be kept)."""


T = torch.Tensor


@torch.library.custom_op("workbench::rms_norm", mutates_args=())
def _rms_norm(x: T, weight: T, eps: float | None) -> T:
    return _ops.rms_norm(x, weight, eps)


@_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)                      # (..., normalized dims)


@torch.library.custom_op("workbench::rotary_embedding", mutates_args=())
def _rotary(x: T, cos: T, sin: T, mode: str) -> T:
    return _ops.rotary_embedding(x, cos, sin, mode=mode)


@_rotary.register_fake
def _(x, cos, sin, mode):
    return x.new_empty(x.shape, dtype=result_dtype(x, cos, sin))   # (..., S, D)


@torch.library.custom_op("workbench::flash_attention", mutates_args=())
def _flash(q: T, k: T, v: T, causal: bool, mask: T | None, dropout_p: float,
           scale: float | None) -> T:
    return _ops.flash_attention(q, k, v, causal=causal, mask=mask, dropout_p=dropout_p,
                                scale=scale)


@_flash.register_fake
def _(q, k, v, causal, mask, dropout_p, scale):
    return q.new_empty((*q.shape[:3], v.shape[3]))  # (B, Hq, Sq, Dv)


@torch.library.custom_op("workbench::swiglu", mutates_args=())
def _swiglu(x: T, dim: int) -> T:
    return _ops.swiglu(x, dim=dim)


@_swiglu.register_fake
def _(x, dim):
    shape = list(x.shape)
    shape[dim] //= 2
    return x.new_empty(shape)                       # half of dim: silu(gate) * up


def _flash_call(q, k, v, causal, mask, dropout_p, scale, tile_q, tile_k, tile_stats,
                return_lse):
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise Unmapped(f"flash_attention with a {type(mask).__name__} mask cannot be kept "
                       "whole under export (a custom operator takes tensors)")
    if (tile_q, tile_k, tile_stats) != (None, None, None) or return_lse:
        raise Unmapped("flash_attention with tile_q / tile_k / tile_stats / return_lse "
                       "cannot be kept whole under export")
    return _flash(q, k, v, bool(causal), mask, float(dropout_p), scale)


# wb.ops function -> its custom operator's call, given every argument of the function
# (by name, defaults filled in from the function's own signature)
_ROUTE = {
    _ops.rms_norm: lambda x, weight, eps: _rms_norm(x, weight, eps),
    _ops.rotary_embedding: lambda x, cos, sin, mode: _rotary(x, cos, sin, mode),
    _ops.flash_attention: _flash_call,
    _ops.swiglu: lambda x, dim: _swiglu(x, dim),
}
_SIGNATURES = {f: inspect.signature(f) for f in _ROUTE}


class _KeptWhole(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        route = _ROUTE.get(func)
        if route is None:
            return func(*args, **(kwargs or {}))
        bound = _SIGNATURES[func].bind(*args, **(kwargs or {}))
        bound.apply_defaults()
        return route(**bound.arguments)


@contextlib.contextmanager
def kept_whole():
    """While export runs: each call of a ``wb.ops`` op above is one custom-operator node."""
    with _KeptWhole():
        yield


_wb = torch.ops.workbench
# custom operator -> (args, kwargs) -> (the wb.ops call, args, kwargs)
ADAPT = {
    _wb.rms_norm.default: lambda a, k: (_ops.rms_norm, a[:2], {"eps": a[2]}),
    _wb.rotary_embedding.default: lambda a, k: (_ops.rotary_embedding, a[:3], {"mode": a[3]}),
    _wb.flash_attention.default: lambda a, k: (_ops.flash_attention, a[:3], dict(
        causal=a[3], mask=a[4], dropout_p=a[5], scale=a[6])),
    _wb.swiglu.default: lambda a, k: (_ops.swiglu, a[:1], {"dim": a[1]}),
}
