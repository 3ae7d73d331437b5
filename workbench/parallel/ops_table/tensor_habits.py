"""The rest of torch.Tensor's operator surface on DistTensors: ``//``, ``&``, ``|``,
``^``, ``~``, ``<<``, ``>>`` (and their reflected forms), ``==`` / ``!=`` and
``c % x``. All are elementwise: ``rules/pointwise.py``'s rules, FLOPs per element beside
each name (one operation per element, the convention of ``costs.py``).

None is linear, so Partial inputs are reduced first (``nonlinear_rule``):
``(a1 + a2) // c != a1 // c + a2 // c`` and bitwise ops act on the bits of the sum.
"""
from __future__ import annotations

import torch

from . import pointwise as rp
from . import reduction as rr
from .strategy import combine
from . import costs
from ._util import align, wrap_dims
from .pointwise import _parse, _swapped, _zero_dims
from .samples import Sample
from .table import add_funcs, register

T = torch.Tensor


def _local(fn, rev=None):
    """``fn`` on the local tensors; a plain number first (``2 // x``) goes to torch's
    reflected dunder ``rev`` (a number is not a tensor argument of ``fn``)."""
    def local(nd, ctx, a, b):
        if ctx is not None:
            a, b = _zero_dims(nd, ctx, (a, b))
        a, b = align(nd, a, b)
        if not isinstance(a, torch.Tensor) and rev is not None:
            return rev(b, a)
        return fn(a, b)
    return local


# name -> (callables, dunder, reflected dunder, FLOPs per element)
BINARY = {
    "floor_divide": ((torch.floor_divide, T.floor_divide), T.__floordiv__, T.__rfloordiv__, 1),
    "bitwise_and": ((torch.bitwise_and, T.bitwise_and), T.__and__, T.__rand__, 1),
    "bitwise_or": ((torch.bitwise_or, T.bitwise_or), T.__or__, T.__ror__, 1),
    "bitwise_xor": ((torch.bitwise_xor, T.bitwise_xor), T.__xor__, T.__rxor__, 1),
    "bitwise_left_shift": ((torch.bitwise_left_shift, T.bitwise_left_shift), T.__lshift__,
                           T.__rlshift__, 1),
    "bitwise_right_shift": ((torch.bitwise_right_shift, T.bitwise_right_shift), T.__rshift__,
                            T.__rrshift__, 1),
}


def _int_pair(fn):
    """Samples of a bitwise op: integers (negative ones too) and bools."""
    def sample(g):
        i1, i2 = g.ints(5, 6, lo=-20, hi=21), g.ints(5, 6)
        return [Sample(fn, (i1, i2)), Sample(fn, (i1 > 0, i2 > 0))]
    return sample


SAMPLES = {
    "floor_divide": lambda g: [Sample(torch.floor_divide, (g.rn(5, 6), g.pos(5, 6))),
                               Sample(T.__rfloordiv__, (g.pos(5, 6), 7.5))],
    "bitwise_and": _int_pair(torch.bitwise_and),
    "bitwise_or": _int_pair(torch.bitwise_or),
    "bitwise_xor": _int_pair(torch.bitwise_xor),
    "bitwise_left_shift": lambda g: [Sample(torch.bitwise_left_shift,
                                            (g.ints(5, 6, lo=-20, hi=21), g.ints(6, lo=0, hi=4)))],
    "bitwise_right_shift": lambda g: [Sample(torch.bitwise_right_shift,
                                             (g.ints(5, 6, lo=-20, hi=21), g.ints(6, lo=0, hi=4)))],
}
for _n, (_fs, _d, _rev, _fl) in BINARY.items():
    register(_n, list(_fs) + [_d, (_rev, _swapped)], parse=_parse, rule=rp.nonlinear_rule,
             local=_local(_d, _rev), cost=costs.elementwise(_fl), op_class="elementwise",
             sample=SAMPLES[_n])


def _not_local(nd, ctx, x):
    return torch.bitwise_not(x)


register("bitwise_not", [torch.bitwise_not, T.bitwise_not, T.__invert__], parse=_parse,
         rule=rp.nonlinear_rule, local=_not_local, cost=costs.elementwise(1),
         op_class="elementwise",
         sample=lambda g: [Sample(torch.bitwise_not, (g.ints(5, 6, lo=-20, hi=21),)),
                           Sample(torch.bitwise_not, (g.ints(5, 6) > 0,))])

# x == y, x != y: a DistTensor of bools, as torch (DistTensor hashes by id, as a tensor)
add_funcs("eq", [T.__eq__])
add_funcs("ne", [T.__ne__])
# c % x is remainder(c, x)
add_funcs("remainder", [(T.__rmod__, _swapped)])

# x.clamp_min(lo), x.clamp_max(hi): clamp with one bound
add_funcs("clamp", [(torch.clamp_min, lambda x, min: ((x, min, None), {})),
                    (T.clamp_min, lambda x, min: ((x, min, None), {})),
                    (torch.clamp_max, lambda x, max: ((x, None, max), {})),
                    (T.clamp_max, lambda x, max: ((x, None, max), {}))])


# ---- lerp: an exponential moving average's step (ema.lerp_(p, 1 - decay)) ----------------

def _lerp_local(nd, ctx, x, end, weight):
    if ctx is not None:
        x, end, weight = _zero_dims(nd, ctx, (x, end, weight))
    return torch.lerp(*align(nd, x, end, weight))


register("lerp", [torch.lerp, T.lerp], parse=lambda x, end, weight: ((x, end, weight), {}),
         rule=rp.nonlinear_rule, local=_lerp_local,
         cost=costs.elementwise(3), op_class="elementwise",
         sample=lambda g: [Sample(torch.lerp, (g.rn(5, 6), g.rn(5, 6), 0.25)),
                           Sample(torch.lerp, (g.rn(5, 6), g.rn(6), g.pos(5, 6)))])   # start + weight (end - start)


# ---- any, all: or / and over dims ---------------------------------------------------------
# S(d) with d reduced -> P(max) (any) / P(min) (all) of bools: or / and of each shard's;
# P(max) / P(min) pass for bool inputs only (any(x1 or x2) = any(x1) or any(x2)); a
# number's parts do not (-1 and 0 are each nonzero or not, their max is not).

def _logical_rule(kind):
    def rule(x, dim=None, keepdim=False, **_):
        opts = rr.reduction_options(x, dim, keepdim, kind)
        if x.dtype != torch.bool:
            opts = [o for o in opts if not o[0][0].is_partial()]
        return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)
    return rule


def _logical_parse(x, dim=None, keepdim=False):
    # dim=() reduces nothing (torch: an elementwise test), unlike dim=None
    dims = None if dim is None else tuple(sorted(wrap_dims(dim, x.ndim)))
    return (x,), {"dim": dims, "keepdim": bool(keepdim)}


def _logical_local(fn):
    def local(nd, ctx, x, dim=None, keepdim=False):
        if x.dim() == nd:             # a 0-d tensor's dim 0: the elementwise test (torch)
            dims = ()
        else:
            dims = tuple(range(nd, x.dim())) if dim is None else tuple(d + nd for d in dim)
        return fn(x, dims, keepdim=keepdim)
    return local


def _logical_sample(fn):
    """any / all over a dim of bools and over all of a float tensor (nonzero or not)."""
    def sample(g):
        i1 = g.ints(5, 6, lo=-20, hi=21)
        return [Sample(fn, (i1 > 3 if fn is torch.any else i1 > -15, 1)), Sample(fn, (g.rn(5, 6),)),
                Sample(fn, (i1,))]
    return sample


for _n, _fn, _kind in (("any", torch.any, "amax"), ("all", torch.all, "amin")):
    register(_n, [_fn, getattr(T, _n)], parse=_logical_parse, rule=_logical_rule(_kind),
             local=_logical_local(_fn), cost=costs.reduction(1), op_class="reduction",
             sample=_logical_sample(_fn))


# ---- isclose: |x - y| <= atol + rtol |y| elementwise (torch.allclose is its all()) ----------
# not linear in either input: Partial inputs are reduced first

def _isclose_parse(x, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return (x, other), {"rtol": float(rtol), "atol": float(atol), "equal_nan": bool(equal_nan)}


def _isclose_local(nd, ctx, x, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    if ctx is not None:
        x, other = _zero_dims(nd, ctx, (x, other))
    x, other = align(nd, x, other)
    return torch.isclose(x, other, rtol=rtol, atol=atol, equal_nan=equal_nan)


register("isclose", [torch.isclose, T.isclose], parse=_isclose_parse, rule=rp.nonlinear_rule,
         local=_isclose_local, cost=costs.elementwise(4), op_class="elementwise",
         sample=lambda g: [Sample(torch.isclose, (g.rn(5, 6), g.rn(6))),
                           Sample(torch.isclose, (g.rn(5, 6), g.rn(5, 6)),
                                  {"rtol": 0.5, "atol": 0.5})])
