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


# The mixture of experts (models/moe.py): export splits the router into softmax / topk /
# one_hot / cumsum (and stops at its fp32 ``torch.promote_types``), dispatch and combine
# into index arithmetic and scatters, and runs attach_aux_loss's autograd Function inline
# (its backward lost); kept whole they are the op table's router_topk, moe_dispatch,
# moe_combine and attach_aux_loss, whose shapes depend on no data (capacity C is given)
@torch.library.custom_op("workbench::router_topk", mutates_args=())
def _router(logits: T, k: int, gating: str, capacity: int | None,
            normalize: bool) -> tuple[T, T, T, T]:
    return tuple(t.clone() for t in _ops.router_topk(logits, k, gating, capacity, normalize))


@_router.register_fake
def _(logits, k, gating, capacity, normalize):
    G, S, _E = logits.shape
    idx = logits.new_empty((G, S, k), dtype=torch.int64)
    return (logits.new_empty((G, S, k)), idx, torch.empty_like(idx),
            logits.new_empty((G,)))              # weights, experts, slots, aux (G,)


@torch.library.custom_op("workbench::moe_dispatch", mutates_args=())
def _dispatch(x: T, experts: T, slots: T, num_experts: int, capacity: int) -> T:
    return _ops.moe_dispatch(x, experts, slots, num_experts, capacity)


@_dispatch.register_fake
def _(x, experts, slots, num_experts, capacity):
    return x.new_empty((x.shape[0], num_experts, capacity, x.shape[2]))   # (G, E, C, h)


@torch.library.custom_op("workbench::moe_combine", mutates_args=())
def _combine(y: T, weights: T, experts: T, slots: T) -> T:
    return _ops.moe_combine(y, weights, experts, slots)


@_combine.register_fake
def _(y, weights, experts, slots):
    return y.new_empty((y.shape[0], weights.shape[1], y.shape[3]))       # (G, S, h)


@torch.library.custom_op("workbench::attach_aux_loss", mutates_args=())
def _attach(y: T, aux: T, scale: float) -> T:
    return _ops.attach_aux_loss(y, aux, scale).clone()


@_attach.register_fake
def _(y, aux, scale):
    return torch.empty_like(y)


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
    _ops.router_topk: lambda logits, k, gating, capacity, normalize: _router(
        logits, k, gating, capacity, normalize),
    _ops.moe_dispatch: lambda x, experts, slots, num_experts, capacity: _dispatch(
        x, experts, slots, num_experts, capacity),
    _ops.moe_combine: lambda y, weights, experts, slots: _combine(y, weights, experts, slots),
    _ops.attach_aux_loss: lambda y, aux, scale: _attach(y, aux, float(scale)),
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
    _wb.router_topk.default: lambda a, k: (_ops.router_topk, a[:2], dict(
        gating=a[2], capacity=a[3], normalize=a[4])),
    _wb.moe_dispatch.default: lambda a, k: (_ops.moe_dispatch, a[:5], {}),
    _wb.moe_combine.default: lambda a, k: (_ops.moe_combine, a[:4], {}),
    _wb.attach_aux_loss.default: lambda a, k: (_ops.attach_aux_loss, a[:3], {}),
}
