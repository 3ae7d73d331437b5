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
    conj, conj_physical,   every placement passes, P(sum) / P(avg) too: conj, re and im
    real, imag             are linear over the reals (conj(a + b) = conj(a) + conj(b));
                           of a real tensor conj / real are the tensor itself (torch returns
                           ``self``), so there P(max) / P(min) pass as well
    angle                  elementwise, not linear (atan2(im, re)): a Partial is reduced
                           first (as abs in pointwise.py)

torch's conj is lazy: ``z.conj()`` is a view with the conjugate bit set (``is_conj()``),
real / imag are views into z (a write into ``z.real`` changes z); the locals here are
torch's own views of each rank's local, so the bit and the aliasing are torch's.
(torch 2.13, torch/distributed/tensor/_ops/_pointwise_ops.py ``_extra_pointwise_ops``
lists ``aten._conj`` as pointwise; ``_UNARY_LINEAR_RULES`` are P(sum) -> P(sum) and
P(avg) -> P(avg); torch's real / imag decompose into view_as_real and a select.)
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from . import costs
from .pointwise import nonlinear_rule, pointwise_local, pointwise_rule
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["view_as_complex_rule", "view_as_real_rule", "conj_rule"]

R = Replicate()
T = torch.Tensor


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
def _as_real_parse(z):
    """torch's refusal of a conjugate view (``view_as_real(z.conj())``: the conjugate bit
    cannot be viewed as (re, im) without a copy); the resolved tensor is viewed."""
    if not isinstance(z, torch.Tensor) and z.dtype.is_complex and _bit(z, "is_conj"):
        raise RuntimeError("view_as_real doesn't work on unresolved conjugated tensors.  To "
                           "resolve the conjugate tensor so you can view it as real, use "
                           "self.resolve_conj(); however, be warned that the resulting tensor "
                           "will NOT alias the original.")
    return (z,), {}


register("view_as_real", [torch.view_as_real], parse=_as_real_parse,
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


# ---- conj / real / imag / angle -----------------------------------------------------------

def conj_rule(z, **_):
    """conj / conj_physical / resolve_conj / resolve_neg / real / imag: R and every S(d)
    pass; P(sum) and P(avg) pass (linear over the reals); of a real tensor (the op is the
    identity there) P(max) and P(min) pass too."""
    opts = [((R,), (R,), "replicated")]
    opts += [((Shard(d),), (Shard(d),), f"dim {d} passes")
             for d in range(z.ndim) if z.shape[d] > 1]
    ops = ("sum", "avg") if z.dtype.is_complex else ("sum", "avg", "max", "min")
    opts += [((Partial(op),), (Partial(op),),
              f"linear over the reals: P({op}) passes" if op in ("sum", "avg") else
              f"the identity on a real tensor: P({op}) passes") for op in ops]
    return combine(z.mesh.ndim, [opts] * z.mesh.ndim, 1)


def _one(parse_name):
    def parse(input):
        return (input,), {}
    parse.__name__ = parse_name
    return parse


def _self_if(test):
    """``returns_self``: torch returns the tensor itself (``x.conj() is x`` for a real x,
    ``z.resolve_conj() is z`` without the conjugate bit)."""
    return lambda inputs, attrs, kwargs: test(inputs[0])


def _bit(d, which):
    from .. import storage
    ts = storage.tensors(d._local)
    return bool(ts) and getattr(ts[0], which)()


def _complex(g):
    return torch.complex(g.rn(5, 3, dtype=torch.float64), g.rn(5, 3, dtype=torch.float64))


# conj: a view with the conjugate bit (no kernel); conj_physical: a kernel negating the
# imaginary part (1 FLOP an element); resolve_conj / resolve_neg: a copy where the bit is
# set; real / imag: views (strided by 2)
_VIEWS = {
    "conj": ([torch.conj, T.conj], torch.conj, costs.view, "view",
             lambda d: not d.dtype.is_complex),
    "conj_physical": ([torch.conj_physical, T.conj_physical], torch.conj_physical,
                      costs.elementwise(1), "elementwise", None),
    "resolve_conj": ([torch.resolve_conj, T.resolve_conj], torch.resolve_conj, costs.movement,
                     "data_movement", lambda d: not _bit(d, "is_conj")),
    "resolve_neg": ([torch.resolve_neg, T.resolve_neg], torch.resolve_neg, costs.movement,
                    "data_movement", lambda d: not _bit(d, "is_neg")),
    "real": ([torch.real], torch.real, costs.view, "view", lambda d: not d.dtype.is_complex),
    "imag": ([torch.imag], torch.imag, costs.view, "view", None),
}
for _n, (_fs, _fn, _cost, _cls, _same) in _VIEWS.items():
    _e = register(_n, _fs, parse=_one(_n), rule=conj_rule, local=pointwise_local(_fn),
                  cost=_cost, op_class=_cls,
                  sample=lambda g, f=_fn: [Sample(f, (_complex(g),))] + (
                      [Sample(f, (g.rn(5, 3),))] if f is not torch.imag else []))
    if _same is not None:
        _e.extra["returns_self"] = _self_if(_same)

# angle: atan2(im, re) of a complex (one transcendental an element, costs.py's convention),
# 0 or pi of a real (nan kept); not linear
register("angle", [torch.angle, T.angle], parse=_one("angle"), rule=nonlinear_rule,
         local=pointwise_local(torch.angle), cost=costs.elementwise(1), op_class="elementwise",
         sample=lambda g: [Sample(torch.angle, (_complex(g),)),
                           Sample(torch.angle, (g.rn(5, 6),))])
