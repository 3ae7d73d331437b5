"""Elementwise ops with broadcasting.

Which placements pass through an elementwise op, per mesh dim (the identity each
row relies on is the comment):

    R    -> R        every rank computes the same thing
    S(d) -> S(d)     elementwise ops act on each shard alone
    P(sum) -> P(sum) only for ops linear in that input:
        neg, mul/div by a replicated factor   # sum(a_i) * c = sum(a_i * c)
        add/sub of two partials               # sum(a_i) + sum(b_i) = sum(a_i + b_i)
    relu(P), exp(P), P + R, P * P            not linear: reduce first (all-reduce)
    P(max) -> P(max) for monotone increasing ops (relu, exp, ...)  # max(f(a_i)) = f(max a_i)
"""
from __future__ import annotations

from ..placement import Partial, Replicate, Shard
from .registry import combine, register_rule

R = Replicate()

UNARY_LINEAR = ("neg", "clone", "contiguous", "to", "positive", "float", "double", "half",
                "bfloat16", "type_as", "detach_copy", "scale")
UNARY_MONOTONE = ("relu", "exp", "sigmoid", "tanh", "silu_monotone", "sqrt", "log",
                  "gelu_monotone", "abs_pos")
UNARY = UNARY_LINEAR + ("relu", "gelu", "silu", "sigmoid", "tanh", "exp", "log", "sqrt",
                        "rsqrt", "abs", "square", "sin", "cos", "reciprocal", "erf", "pow",
                        "softplus", "leaky_relu", "elu", "mish", "hardtanh", "clamp",
                        "isnan", "isfinite", "logical_not", "sign", "floor", "ceil", "round")
BINARY_ADD = ("add", "sub")
BINARY_MUL = ("mul", "div")
BINARY_OTHER = ("maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "where_xy",
                "logical_and", "logical_or", "atan2", "remainder", "fmod", "pow_tensor")


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
            out[j] = max(out[j], n)
    return tuple(out)


def pointwise_options(specs, partial_inputs: str = "none", max_passes=False):
    """Per-mesh-dim options for an elementwise op.

    partial_inputs: "all" (linear in all inputs jointly: add/sub), "one" (linear in
    each input separately: mul/div by a replicated factor), "first" (linear in the
    first input only: div), "none"."""
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
    P = Partial("sum")
    if partial_inputs == "all":
        opts.append((tuple(None if s is None else P for s in specs), (P,),
                     "linear: P(sum) + P(sum) -> P(sum)"))
    elif partial_inputs in ("one", "first"):
        for k in range(n if partial_inputs == "one" else 1):
            if specs[k] is None:
                continue
            req = tuple(None if s is None else (P if j == k else R) for j, s in enumerate(specs))
            opts.append((req, (P,), f"linear in input {k}: P(sum) * R -> P(sum)"))
    if max_passes:
        for op in ("max",):
            opts.append((tuple(None if s is None else Partial(op) for s in specs),
                         (Partial(op),), "monotone: f(max a_i) = max f(a_i)"))
    return opts


def _rule(partial_inputs, max_passes=False):
    def rule(*specs, **attrs):
        real = [s for s in specs if s is not None]
        mesh = real[0].mesh
        return combine(mesh.ndim, [pointwise_options(specs, partial_inputs, max_passes)] * mesh.ndim,
                       len(specs))
    return rule


register_rule(*UNARY_LINEAR)(_rule("one"))
register_rule(*[u for u in UNARY if u not in UNARY_LINEAR and u in UNARY_MONOTONE])(
    _rule("none", max_passes=True))
register_rule(*[u for u in UNARY if u not in UNARY_LINEAR and u not in UNARY_MONOTONE])(
    _rule("none"))
register_rule(*BINARY_ADD)(_rule("all"))
register_rule("mul")(_rule("one"))
register_rule("div")(_rule("first"))
register_rule(*BINARY_OTHER, "where")(_rule("none"))
