"""Fused ops of ``workbench.ops`` beside attention: swiglu and rotary_embedding.

swiglu(x, dim) = silu(a) * b with a, b = x.chunk(2, dim): S(d) passes for d != dim;
S(dim) must be whole, since a torch.chunk shard of dim holds gate rows OR up rows,
not a matching pair (Megatron reorders the fused weight so each rank holds both;
that is a different layout, not S(dim)). Not linear: no Partial.

rotary_embedding(x, cos, sin) = x * cos + rotate(x) * sin, elementwise along every
dim but the last (rotate pairs features of D): S(d) passes for d < last when
cos/sin are split the same way along their aligned dim (or replicated where they
broadcast); D whole; linear in x: P(sum) x with replicated cos, sin -> P(sum).
"""
from __future__ import annotations

import torch

from ..placement import Replicate, Shard
from . import costs
from ._util import align as _align, shift as _shift, wrap_dim
from .pointwise import pointwise_options, reduced_in_place
from .samples import Sample
from .strategy import combine
from .table import register

try:
    from ... import ops as _ops
except ModuleNotFoundError as _e:          # workbench.ops absent: rules only
    if not (_e.name or "").endswith("workbench.ops"):
        raise
    _ops = None

__all__ = ["swiglu_rule", "rotary_rule"]

R = Replicate()


def swiglu_rule(x, dim, **_):
    """swiglu(dim): other dims pass; dim (gate | up halves) must be whole."""
    dim = wrap_dim(dim, x.ndim)           # infer hands the user's dim=-1 as given
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim):
        if d != dim and x.shape[d] > 1:
            opts.append(((Shard(d),), (Shard(d),), f"dim {d} sharded passes (halves on {dim})"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


def _swiglu_local(nd, ctx, x, dim):
    if ctx is None:
        shape = list(x.shape)
        shape[dim] //= 2
        return torch.empty(shape, dtype=x.dtype, device="meta")
    return _ops.swiglu(x, dim=_shift(dim, x.dim() - nd, nd))


def rotary_rule(x, cos, sin, **_):
    """rotary: elementwise on every dim but the last (D whole); linear in x."""
    last = x.ndim - 1
    opts = [o for o in pointwise_options([x, cos, sin], "first", rounds=True)
            if not (o[1][0].is_shard() and o[1][0].dim == last)]
    per_dim = reduced_in_place([x, cos, sin], opts, x.mesh.ndim, "first", True)
    return combine(x.mesh.ndim, per_dim, 3)


def _rotary_local(nd, ctx, x, cos, sin, mode):
    if ctx is None:
        from ...ops.rotary import result_dtype      # torch's promotion (bf16 q, fp32 cos)
        return torch.empty(x.shape, dtype=result_dtype(x, cos, sin), device="meta")
    return _ops.rotary_embedding(*_align(nd, x, cos, sin), mode=mode)


if _ops is not None:
    register("swiglu", [_ops.swiglu], parse=lambda x, dim=-1: ((x,), {"dim": wrap_dim(dim, x.ndim)}),
             rule=swiglu_rule, local=_swiglu_local,
             cost=costs.from_ops("swiglu", lambda ins, outs, dim: (ins, {"dim": dim})),
             op_class="elementwise", meta_check=False,
             sample=lambda g: [Sample(_ops.swiglu, (g.rn(5, 3, 6),))])
    register("rotary_embedding", [_ops.rotary_embedding],
             parse=lambda x, cos, sin, mode="half": ((x, cos, sin), {"mode": mode}),
             rule=rotary_rule, local=_rotary_local,
             cost=costs.from_ops("rotary_embedding", lambda ins, outs, mode: (ins, {"mode": mode})),
             op_class="elementwise", meta_check=False,
             sample=lambda g: [Sample(_ops.rotary_embedding, (g.rn(2, 5, 4),
                                                              *_ops.rope_cos_sin(5, 4)))])
