"""Normalization layers: layer_norm and rms_norm (torch's and ``workbench.ops``').

LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019) normalize each
row over its trailing ``normalized_shape`` dims, then scale by ``weight`` (and
shift by ``bias``):

    layer_norm: y = (x - mean(x)) / sqrt(var(x) + eps) * w + b
    rms_norm:   y = x / sqrt(mean(x^2) + eps) * w

Per mesh dim (x, weight, bias -> y):

    R,    R, R -> R       every rank computes the same thing
    S(d), R, R -> S(d)    d a leading (not normalized) dim: the statistics of a row
                          use only that row, so each shard normalizes alone
                          (sequence parallelism's LayerNorm, Megatron-SP)
    S(d), R, R            d a normalized dim: not valid, mean(x) = sum_i(...) needs
                          every shard: the rule asks for the dim whole (all-gather)
    P(sum)                not valid: norm(a + b) != norm(a) + norm(b); the planner
                          reduces first (all-reduce, or reduce-scatter to S(d))
    weight, bias          kept Replicate: each rank's rows meet the whole weight.
                          Their gradient, summed over the rows of every shard, is
                          the all-reduce of sequence/data parallelism (traced by
                          the dispatcher's replicated-input views).

``workbench.ops.rms_norm(x, weight, eps)`` (the fused op, if that package is
importable) is registered under the same rule as ``F.rms_norm``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..placement import Replicate, Shard
from . import costs
from ._util import align as _align, check_number, broadcast_shapes
from .samples import Sample
from .strategy import combine
from .table import add_funcs, register

R = Replicate()


def norm_options(x, k: int, n_params: int) -> list[tuple]:
    """Per-mesh-dim options for a norm over the trailing ``k`` dims of ``x``, with
    ``n_params`` parameter inputs (None in the specs where absent)."""
    params = (R,) * n_params
    opts = [((R,) + params, (R,), "replicated")]
    for d in range(x.ndim - k):
        if x.shape[d] > 1:
            opts.append(((Shard(d),) + params, (Shard(d),),
                         f"dim {d} is not normalized: each shard normalizes its own rows"))
    return opts


def _with_none(opts, specs):
    """Put None where an input is not a tensor (weight=None, bias=None)."""
    out = []
    for ins, outs, note in opts:
        out.append((tuple(None if s is None else p for s, p in zip(specs, ins)), outs, note))
    return out


def _check_k(op, x, normalized_shape):
    if not isinstance(normalized_shape, (tuple, list, torch.Size)):     # as torch's F.{op}
        raise TypeError(f"{op}(): argument 'normalized_shape' must be tuple of ints, not "
                        f"{type(normalized_shape).__name__}: give e.g. normalized_shape="
                        f"({x.shape[-1] if x.ndim else 1},)")
    k = len(normalized_shape)
    if k == 0 or k > x.ndim or tuple(x.shape[x.ndim - k:]) != tuple(normalized_shape):
        raise ValueError(f"{op}: normalized_shape={tuple(normalized_shape)} must equal the "
                         f"trailing dims of the input's shape {tuple(x.shape)}")
    return k


def layer_norm_rule(x, weight=None, bias=None, *, normalized_shape, eps=1e-5, **_):
    """layer_norm: normalized dims whole on every rank, other dims may stay sharded;
    Partial inputs are reduced first; weight and bias replicated."""
    k = _check_k("layer_norm", x, normalized_shape)
    specs = (x, weight, bias)
    opts = _with_none(norm_options(x, k, 2), specs)
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 3)


def rms_norm_rule(x, weight=None, *, normalized_shape, eps=None, impl="torch", **_):
    """rms_norm: normalized dims whole on every rank, other dims may stay sharded;
    Partial inputs are reduced first; weight replicated."""
    k = _check_k("rms_norm", x, normalized_shape)
    specs = (x, weight)
    opts = _with_none(norm_options(x, k, 1), specs)
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 2)


# ---- local functions on stacked tensors -----------------------------------------------------

def _compact(p, nd, shape):
    """A replicated parameter stored once (lead dims all 1) -> its plain tensor, else None
    (it was given per-rank views because the output is sharded: keep them, so that the
    gradient sum over ranks stays a traced all-reduce)."""
    if p is None:
        return None
    if all(n == 1 for n in p.shape[:nd]):
        return p.reshape(tuple(shape))
    return None


def _scale_shift(nd, y, w, b):
    if w is not None:
        y, w = _align(nd, y, w)
        y = y * w
    if b is not None:
        y, b = _align(nd, y, b)
        y = y + b
    return y


class _PerRankAffine(torch.autograd.Function):
    """``F.layer_norm(x) * w + b`` with ``w``, ``b`` broadcasting against x (the weight's
    per-rank views, aligned to x's rows), keeping for backward what the fused kernel keeps
    on a device: x, the row mean and 1/std (torch's ``native_layer_norm``) and the weight.
    The composition ``F.layer_norm(x, ns) * w + b`` kept the normalized rows too, for w's
    gradient: one activation-sized tensor more per LayerNorm than a device keeps (gpt-tiny
    under ContextParallel(cp=2, dp=2), batch 4: 5 x 16,384 B a rank more than a torchrun
    run counts).  Backward: torch's ``native_layer_norm_backward`` of ``g * w`` for x (what
    autograd ran for the composition), ``sum(g * x_hat)`` and ``sum(g)`` to w's and b's
    shapes.

    A lower-precision x (bfloat16 / float16: under autocast, a linear's output) is
    computed as torch's CPU kernel computes it (aten/src/ATen/native/cpu/
    layer_norm_kernel.cpp, torch 2.13: float accumulation, the affine in float, one
    rounding to x's dtype; mean and 1/std kept in float32 where the weight is float32,
    the "mixed type" case, else in x's dtype).  The composition gave float32 out where
    a device gives x's dtype, and kept the normalized rows as well (fixlist14)."""

    @staticmethod
    def forward(ctx, x, w, b, ns, eps):
        low = x.dtype in _LOW
        y, mean, rstd = torch.native_layer_norm(x.float() if low else x, ns, None, None, eps)
        if low and not any(t is not None and t.dtype == torch.float32 for t in (w, b)):
            mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)      # (not the mixed type)
        ctx.ns = ns
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.shapes = (None if w is None else w.shape, None if b is None else b.shape)
        ctx.b_dtype = None if b is None else b.dtype
        if w is not None:
            y = y * (w.float() if low else w)
        if b is not None:
            y = y + (b.float() if low else b)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w, mean, rstd = ctx.saved_tensors       # (read once: checkpoint's unpack rule)
        wshape, bshape = ctx.shapes
        xdt = x.dtype
        low = xdt in _LOW
        gx = gw = gb = None
        if low:
            x, g, mean, rstd = x.float(), g.float(), mean.float(), rstd.float()
        wf = None if w is None else w.float() if low else w
        if ctx.needs_input_grad[0]:
            gx = torch.ops.aten.native_layer_norm_backward(
                g if w is None else g * wf, x, ctx.ns, mean, rstd, None, None,
                [True, False, False])[0].to(xdt)
        if w is not None and ctx.needs_input_grad[1]:
            gw = (g * ((x - mean) * rstd)).sum_to_size(wshape).to(w.dtype)
        if bshape is not None and ctx.needs_input_grad[2]:
            gb = g.sum_to_size(bshape).to(ctx.b_dtype)
        return gx, gw, gb, None, None


_LOW = (torch.bfloat16, torch.float16)


_DTYPES_OK: set = set()     # (dtypes, normalized shape, eps, device, autocast) accepted


def _autocast_state(kind: str):
    """torch.autocast's state for a device type (it casts layer_norm's inputs), or None
    where autocast knows no such type (meta)."""
    try:
        on = torch.is_autocast_enabled(kind)
    except RuntimeError:
        return None
    return on, torch.get_autocast_dtype(kind) if on else None


def _check_dtypes(x, w, b, ns, eps):
    """The per-rank views' path composes the norm from pieces that would accept any dtype
    mix; torch's kernel refuses some (CPU: a float32 x with bfloat16 weights, 'mixed dtype
    (CPU): expect parameter to have scalar type of Float'). Ask torch's own kernel on empty
    tensors of the same dtypes and device (no rows: no work) and raise as it does."""
    dev = x.device
    key = (x.dtype, None if w is None else w.dtype, None if b is None else b.dtype, ns, eps,
           dev, _autocast_state(dev.type))
    if key in _DTYPES_OK:                # torch's answer depends on these alone
        return

    def empty(t, shape):
        return None if t is None else torch.empty(shape, dtype=t.dtype, device=x.device)
    try:
        F.layer_norm(empty(x, (0, *ns)), ns, empty(w, ns), empty(b, ns), eps)
        if len(_DTYPES_OK) > 1024:
            _DTYPES_OK.clear()
        _DTYPES_OK.add(key)
    except RuntimeError as e:
        got = ", ".join(f"{n} {t.dtype}" for n, t in (("input", x), ("weight", w), ("bias", b))
                        if t is not None)
        raise RuntimeError(f"layer_norm: {e} (got {got}); torch's kernel refuses this dtype "
                           f"mix: cast the input or the weight and bias to one dtype (a "
                           f"bfloat16 / float16 input may keep float32 weight and bias)") from e


def _layer_norm_local(nd, ctx, x, w=None, b=None, *, normalized_shape, eps):
    ns = tuple(normalized_shape)
    wc, bc = _compact(w, nd, ns), _compact(b, nd, ns)
    if x.is_meta:       # a dry run: the fused kernel a device runs (saves x, mean, rstd)
        wc, bc = (None if t is None else t[(0,) * nd].reshape(ns) for t in (w, b))
    if (w is None or wc is not None) and (b is None or bc is not None):
        return F.layer_norm(x, ns, wc, bc, eps)                 # fused: one rank's view
    _check_dtypes(x, w, b, ns, eps)
    wa = None if w is None else _align(nd, x, w)[1]
    ba = None if b is None else _align(nd, x, b)[1]
    shape = broadcast_shapes(x.shape, *(t.shape for t in (wa, ba) if t is not None))
    dts = {t.dtype for t in (wa, ba) if t is not None}
    if tuple(shape) == tuple(x.shape) and \
            (dts <= {x.dtype} or x.dtype in _LOW and dts == {torch.float32}):
        # saves what the fused kernel does (also under autocast, and for a bfloat16 x with
        # float32 weights: torch's mixed type); other dtype mixes: the composition
        return _PerRankAffine.apply(x, wa, ba, ns, eps)
    return _scale_shift(nd, F.layer_norm(x, ns, None, None, eps), w, b)


def _rms_norm_local(nd, ctx, x, w=None, *, normalized_shape, eps, impl):
    """``wb.ops.rms_norm`` with the weight stored once: that op (its backend dispatch);
    ``F.rms_norm`` so where PyTorch fuses it (``ops.rms_norm.FUSED_DEVICES``); otherwise
    the formula with the fused kernel's contract (``ops.rms_norm.fused_rms_norm``: keeps
    x, the weight and a float32 rstd per row, as the planner counts; F.rms_norm's CPU
    composite would keep float32 copies of x and x * rstd too), the weight's per-rank
    views aligned to x's rows so that their gradient sum stays the traced all-reduce."""
    from ...ops.rms_norm import FUSED_DEVICES, default_eps, fused_rms_norm, rms_norm
    ns = tuple(normalized_shape)
    wc = _compact(w, nd, ns)
    if eps is None:                     # F.rms_norm's default (ops.rms_norm.default_eps)
        eps = default_eps(x.dtype)
    if impl == "workbench" and wc is not None:
        return rms_norm(x, wc, eps=eps)                              # the fused op
    if impl == "torch" and (w is None or wc is not None) and \
            x.device.type in FUSED_DEVICES:
        return F.rms_norm(x, ns, wc, eps)
    if wc is None and w is not None:
        _, w = _align(nd, x, w)                     # (*lead, 1, ..., *ns): per-rank rows
    return fused_rms_norm(x, w if wc is None else wc, eps, len(ns))


# ---- parsing and registration ---------------------------------------------------------------

def _ns(normalized_shape):
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(n) for n in normalized_shape)


def _layer_norm_parse(x, normalized_shape, weight=None, bias=None, eps=1e-5, *_, **__):
    return (x, weight, bias), {"normalized_shape": _ns(normalized_shape),
                               "eps": check_number("layer_norm", "eps", eps, False)}


def _rms_norm_parse(x, normalized_shape, weight=None, eps=None):
    return (x, weight), {"normalized_shape": _ns(normalized_shape),
                         "eps": check_number("rms_norm", "eps", eps), "impl": "torch"}


def _ops_rms_norm_parse(x, weight, eps=1e-6):
    # eps=None: F.rms_norm's default, as wb.ops.rms_norm on one device (_rms_norm_local)
    return (x, weight), {"normalized_shape": tuple(weight.shape),
                         "eps": check_number("rms_norm", "eps", eps), "impl": "workbench"}


def _layer_norm_cost(ins, outs, normalized_shape, **_):
    """mean (1), subtract (1), square (1), mean (1), multiply by the row's rstd (1), * w (1),
    + b (1): 7 FLOPs per element (the per-row eps and rsqrt not counted); backward keeps
    x, w and the per-row mean and rstd (float32)."""
    x = ins[0]
    rows = x.numel() // max(1, math.prod(normalized_shape))
    saved = sum(costs.nbytes(t) for t in ins if t is not None) + 2 * rows * 4
    n = x.numel()
    return costs.TermsCost(7 * n, sum(costs.nbytes(t) for t in ins if t is not None) +
                           costs.nbytes(outs[0]), 14 * n,
                           costs.backward_bytes(ins, outs, saved),
                           terms=costs.norm_terms(ins, 14 * n, {1: 2 * n, 2: n}))


def _rms_norm_cost(ins, outs, **attrs):
    c = _RMS_OPS_COST(ins, outs, **attrs)
    return costs.TermsCost(c.flops, c.bytes, c.backward_flops, c.backward_bytes,
                           terms=costs.norm_terms(ins, c.backward_flops,
                                                  {1: 2 * ins[0].numel()}))


def _rms_cost_args(ins, outs, normalized_shape, eps=None, **_):
    x, w = ins
    if w is None:                      # ops.cost counts the weight: an all-ones stand-in
        w = torch.empty(normalized_shape, dtype=x.dtype, device="meta")
    return (x, w), {}


_RMS_OPS_COST = costs.from_ops("rms_norm", _rms_cost_args)
register("layer_norm", [F.layer_norm, torch.layer_norm], parse=_layer_norm_parse,
         rule=layer_norm_rule, local=_layer_norm_local, cost=_layer_norm_cost, op_class="norm",
         sample=lambda g: [Sample(F.layer_norm, (g.rn(3, 5, 6), (6,), g.rn(6), g.rn(6)))])
register("rms_norm", [getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None)],
         parse=_rms_norm_parse, rule=rms_norm_rule, local=_rms_norm_local,
         cost=_rms_norm_cost, op_class="norm",
         sample=lambda g: [Sample(F.rms_norm, (g.rn(3, 5, 6), (6,), g.rn(6), 1e-6))])

try:                                   # the fused op lives in workbench.ops (optional here)
    from ...ops import rms_norm as _ops_rms_norm
except ImportError:                    # pragma: no cover - ops not built yet
    _ops_rms_norm = None
if _ops_rms_norm is not None:
    add_funcs("rms_norm", [_ops_rms_norm], _ops_rms_norm_parse)
