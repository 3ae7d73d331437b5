"""Elementwise ops with broadcasting.

Which placements pass through an elementwise op, per mesh dim (the identity each
row relies on is the comment):

    R    -> R        every rank computes the same thing
    S(d) -> S(d)     elementwise ops act on each shard alone; an input whose dim d is
                     broadcast (size 1, or absent) meets every shard whole: R
    P(sum) -> P(sum) only for ops linear in that input:
        neg, mul/div by a replicated factor   # sum(a_i) * c = sum(a_i * c)
        add/sub of two TENSOR partials         # sum(a_i) + sum(b_i) = sum(a_i + b_i)
    P + 1, relu(P), exp(P), P * P            not linear: reduce first (a constant added
                                             on every rank would be added p times)
    P(max) -> P(max), P(min) -> P(min) for non-decreasing ops of one input (relu, exp,
                     clamp...)                 # max_i f(a_i) = f(max_i a_i)

A partial input broadcast to a bigger output (x (1, 32, 1) P * y (16, 32, 64)) gives a
partial output as big as y: valid, but the reduction it defers is that big. Such a
strategy carries the deferred reduce-scatter in its ranking (``Strategy.deferred``),
so reducing the small input first wins when it is cheaper.

Casts (``to``, ``float``, ...): R and S pass; P(max) / P(min) pass between floating
dtypes (rounding is non-decreasing); P(sum) / P(avg) only through widening float casts
(a cast to int truncates each part: int(0.5) + int(0.5) != int(1.0); a narrowing float
cast rounds each part, with errors as large as the parts).
"""
from __future__ import annotations

import math

from .. import layout
from ..placement import Partial, Replicate, Shard
from .registry import Strategy, combine

__all__ = ["pointwise_options", "pointwise_rule", "add_rule", "mul_rule", "div_rule",
           "nonlinear_rule", "monotone_rule", "cast_rule", "where_rule", "masked_fill_rule",
           "triangle_rule"]

R = Replicate()
P = Partial("sum")


def _aligned_dim(out_ndim: int, in_shape, d_out: int):
    """Which dim of an input (right-aligned broadcasting) meets output dim d_out, or None."""
    d = d_out - (out_ndim - len(in_shape))
    if d < 0 or in_shape[d] == 1:
        return None
    return d


def _broadcast_shape(specs):
    nd = max(len(s.shape) for s in specs if s is not None)
    out = [1] * nd
    for s in specs:
        if s is None:
            continue
        for i, n in enumerate(s.shape):
            j = nd - len(s.shape) + i
            out[j] = n if out[j] == 1 else out[j]
    return tuple(out)


def pointwise_options(specs, partial_inputs: str = "none", monotone=False):
    """Per-mesh-dim options for an elementwise op.

    partial_inputs: "all" (linear in all inputs jointly: add/sub; only when every input
    is a tensor), "one" (linear in each input separately: mul by a replicated factor),
    "first" (linear in the first input only: div), "none". ``monotone``: P(max) and
    P(min) of the first input pass (the others replicated)."""
    shape = _broadcast_shape(specs)
    n = len(specs)
    opts = [(tuple(None if s is None else R for s in specs), (R,), "replicated")]
    for d in range(len(shape)):
        if shape[d] <= 1:
            continue
        req = tuple(None if s is None else
                    (Shard(_aligned_dim(len(shape), s.shape, d))
                     if _aligned_dim(len(shape), s.shape, d) is not None else R)
                    for s in specs)
        opts.append((req, (Shard(d),), f"elementwise: dim {d} sharded passes through"))
    if partial_inputs == "all" and all(s is not None for s in specs):
        opts.append((tuple(P for _ in specs), (P,), "linear: P(sum) + P(sum) -> P(sum)"))
    elif partial_inputs in ("one", "first"):
        for k in range(n if partial_inputs == "one" else 1):
            if specs[k] is None:
                continue
            req = tuple(None if s is None else (P if j == k else R) for j, s in enumerate(specs))
            opts.append((req, (P,), f"linear in input {k}: P(sum) * R -> P(sum)"))
    if monotone and specs[0] is not None:
        for op in ("max", "min"):
            req = tuple(None if s is None else (Partial(op) if j == 0 else R)
                        for j, s in enumerate(specs))
            opts.append((req, (Partial(op),), f"non-decreasing: f(P({op})) = P({op}) of f"))
    return opts


def _deferred(specs, strategies):
    """Attach to each strategy the reductions its partial output defers beyond those of
    its partial inputs: a partial input broadcast to a bigger output (see the module
    docstring). Bytes: the output's local size on the busiest rank."""
    real = [s for s in specs if s is not None]
    mesh = real[0].mesh
    shape = _broadcast_shape(specs)
    numel = math.prod(shape)
    esize = max(_esize(s.dtype) for s in real)
    out = []
    for st in strategies:
        o = st.outputs[0]
        dims = []
        for i, p in enumerate(o):
            if not p.is_partial():
                continue
            grown = [s for s, req in zip(specs, st.inputs)
                     if s is not None and req is not None and req[i].is_partial()
                     and math.prod(s.shape) < numel]
            if grown:
                local = layout.local_numel_max(shape, mesh, tuple(
                    R if q.is_partial() else q for q in o))
                dims.append((i, local * esize))
        out.append(Strategy(st.inputs, st.outputs, st.note, tuple(dims)) if dims else st)
    return out


def _esize(dtype) -> int:
    import torch
    return torch.empty((), dtype=dtype).element_size()


def pointwise_rule(partial_inputs="none", monotone=False):
    def rule(*specs, **attrs):
        real = [s for s in specs if s is not None]
        mesh = real[0].mesh
        opts = pointwise_options(specs, partial_inputs, monotone)
        sts = combine(mesh.ndim, [opts] * mesh.ndim, len(specs))
        return _deferred(specs, sts) if partial_inputs != "none" else sts
    rule.__doc__ = (f"elementwise: S passes; P(sum) passes {partial_inputs!s} linear inputs"
                    + ("; P(max/min) pass (non-decreasing)" if monotone else ""))
    return rule


add_rule = pointwise_rule("all")
mul_rule = pointwise_rule("one")
nonlinear_rule = pointwise_rule("none")
monotone_rule = pointwise_rule("none", monotone=True)
_div_first = pointwise_rule("first")


def div_rule(*specs, rounding_mode=None, **attrs):
    """div: linear in the dividend (P(sum) / R -> P(sum)) unless it rounds."""
    return (_div_first if rounding_mode is None else nonlinear_rule)(*specs)


def _widening():
    import torch
    f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    return {(f16, f32), (f16, f64), (bf16, f32), (bf16, f64), (f32, f64)}


_WIDENING = _widening()


def cast_rule(x, *, dtype, **_):
    """dtype casts: R and S pass; P(max/min) pass between floating dtypes, P(sum/avg)
    through widening float casts only."""
    opts = pointwise_options([x], "none")
    if x.dtype.is_floating_point and dtype.is_floating_point:
        # rounding is non-decreasing: max_i round(a_i) = round(max_i a_i), exactly
        opts += [((Partial(op),), (Partial(op),), f"a float cast of P({op}) is P({op})")
                 for op in ("max", "min")]
        if (x.dtype, dtype) in _WIDENING or x.dtype == dtype:
            # every part is exact in the wider dtype: sum_i wide(a_i) = wide(sum_i a_i)
            # up to the narrow sum's own rounding (a narrowing cast of parts would round
            # each part, errors as large as the parts)
            opts += [((Partial(op),), (Partial(op),), f"a widening cast of P({op}) is P({op})")
                     for op in ("sum", "avg")]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


def where_rule(cond, x, y, **_):
    """where(cond, x, y): elementwise; linear in (x, y) jointly for a replicated cond."""
    specs = (cond, x, y)
    opts = pointwise_options(specs, "none")
    if x is not None and y is not None and cond is not None:
        opts.append(((R, P, P), (P,), "linear in (x, y): where(c, sum a_i, sum b_i) = "
                     "sum where(c, a_i, b_i)"))
    real = [s for s in specs if s is not None]
    return _deferred(specs, combine(real[0].mesh.ndim, [opts] * real[0].mesh.ndim, 3))


def masked_fill_rule(x, mask, value=None, *, fill=None, **_):
    """masked_fill: elementwise; a zero fill is linear in x (P(sum) with mask R)."""
    specs = (x, mask, value)
    opts = pointwise_options(specs, "none")
    if value is None and fill == 0:
        opts.append(((P, R, None), (P,), "filling zeros is linear in x"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 3)


def triangle_rule(x, *, diagonal=0, **_):
    """triu / tril: the last two dims whole (which entries are kept depends on their
    global row and column); leading dims pass; linear, and P(max/min) pass (every rank
    zeroes the same entries)."""
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim - 2):
        if x.shape[d] > 1:
            opts.append(((Shard(d),), (Shard(d),), f"batch dim {d} sharded passes"))
    opts += [((Partial(op),), (Partial(op),), f"zeroing entries keeps P({op})")
             for op in ("sum", "avg", "max", "min")]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)
