"""Complex views and constructors, as Llama's reference rotary embedding uses them::

    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)

Per mesh dim:

    view_as_complex(x)     S(d), d < last -> S(d)   the last dim (re, im: size 2) whole
    view_as_real(z)        S(d)           -> S(d)   the new last dim (re, im) replicated
    complex(re, im)        elementwise; linear in (re, im) jointly
    polar(abs, angle)      elementwise; not linear
    view_as_*: P(sum), P(avg) pass (re + i im is linear in the parts; complex numbers
    have no order, so P(max) / P(min) do not)
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from . import costs
from .pointwise import nonlinear_rule, pointwise_local, pointwise_rule
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["view_as_complex_rule", "view_as_real_rule"]

R = Replicate()


def _linear_partials():
    return [((Partial(op),), (Partial(op),), f"re + i im is linear: P({op}) passes")
            for op in ("sum", "avg")]


def view_as_complex_rule(x, **_):
    """view_as_complex: every dim but the last (re, im) passes; P(sum / avg) pass."""
    opts = [((R,), (R,), "replicated")]
    opts += [((Shard(d),), (Shard(d),), f"dim {d} passes")
             for d in range(x.ndim - 1) if x.shape[d] > 1]
    return combine(x.mesh.ndim, [opts + _linear_partials()] * x.mesh.ndim, 1)


def view_as_real_rule(z, **_):
    """view_as_real: every dim passes, the new last dim (re, im) is whole; P(sum / avg)."""
    opts = [((R,), (R,), "replicated")]
    opts += [((Shard(d),), (Shard(d),), f"dim {d} passes")
             for d in range(z.ndim) if z.shape[d] > 1]
    return combine(z.mesh.ndim, [opts + _linear_partials()] * z.mesh.ndim, 1)


def _as_complex_local(nd, ctx, x):
    if x.stride(-1) != 1 or any(s % 2 for s in x.stride()[:-1]):
        x = x.contiguous()            # a stride-0 replica or an odd stride: a copy first
    return torch.view_as_complex(x)


def _as_real_local(nd, ctx, z):
    return torch.view_as_real(z.resolve_conj())


register("view_as_complex", [torch.view_as_complex], parse=lambda x: ((x,), {}),
         rule=view_as_complex_rule, local=_as_complex_local, cost=costs.view,
         op_class="view", sample=lambda g: [Sample(torch.view_as_complex, (g.rn(5, 3, 2),))])
register("view_as_real", [torch.view_as_real], parse=lambda z: ((z,), {}),
         rule=view_as_real_rule, local=_as_real_local, cost=costs.view, op_class="view",
         sample=lambda g: [Sample(torch.view_as_real,
                                  (torch.complex(g.rn(5, 3), g.rn(5, 3)),))])
# complex(re, im): one write per element, exact (P(sum) passes in any dtype); polar(r,
# theta): r cos, r sin (4 FLOPs)
register("complex", [torch.complex], parse=lambda re, im: ((re, im), {}),
         rule=pointwise_rule("all"),
         local=pointwise_local(torch.complex), cost=costs.movement, op_class="elementwise",
         sample=lambda g: [Sample(torch.complex, (g.rn(5, 6), g.rn(5, 6)))])
register("polar", [torch.polar], parse=lambda a, theta: ((a, theta), {}), rule=nonlinear_rule,
         local=pointwise_local(torch.polar), cost=costs.elementwise(4), op_class="elementwise",
         sample=lambda g: [Sample(torch.polar, (g.pos(5, 6), g.rn(5, 6)))])
