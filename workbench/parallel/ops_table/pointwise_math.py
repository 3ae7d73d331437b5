"""More elementwise math (the rest of PyTorch's common pointwise ops), with the rules of
``pointwise.py``: S passes, P(sum) only through linear ops (deg2rad, rad2deg), P(max) /
P(min) through non-decreasing ops defined everywhere (an op that is nan outside a
domain, as asin or log, is not: max_i f(a_i) is nan where f(max_i a_i) may not be).

Also the aliases torch gives its ops (``absolute`` is ``abs``, ``multiply`` is ``mul``...):
callables added to the op they name, so each op keeps one registration.
FLOPs per element beside each name (``costs.py`` states the convention).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..placement import Replicate
from . import costs
from .pointwise import (X, mul_rule, monotone_rule, nonlinear_rule, pointwise_local,
                        pointwise_options, _parse, _ties)
from .samples import Sample
from .strategy import combine
from .table import BY_FUNC, add_funcs, register

__all__ = ["UNARY_MORE", "BINARY_MORE"]

T = torch.Tensor
R = Replicate()
POS = lambda g: [(g.pos(5, 6),)]                                         # noqa: E731
UNIT = lambda g: [(g.rn(5, 6).tanh() * 0.9,)]        # in (-1, 1): asin, erfinv  # noqa: E731
PROB = lambda g: [(g.rn(5, 6).sigmoid(),)]           # in (0, 1): logit       # noqa: E731
# +-inf (a nan would not be equal to its own replica when the validator lays it out)
SPECIAL = lambda g: [(torch.tensor([[1.5, float("inf")], [-float("inf"), 2.0],  # noqa: E731
                                    [0.0, -2.0]]),)]

# name -> (callables, FLOPs per element, rule, sample inputs)
UNARY_MORE = {
    "exp2": ((torch.exp2, T.exp2), 1, monotone_rule, X),                    # 2^x
    "log2": ((torch.log2, T.log2), 1, nonlinear_rule, POS),
    "log10": ((torch.log10, T.log10), 1, nonlinear_rule, POS),
    "tan": ((torch.tan, T.tan), 1, nonlinear_rule, X),
    "sinh": ((torch.sinh, T.sinh), 1, monotone_rule, X),
    "cosh": ((torch.cosh, T.cosh), 1, nonlinear_rule, X),
    "asin": ((torch.asin, T.asin, torch.arcsin, T.arcsin), 1, nonlinear_rule, UNIT),
    "acos": ((torch.acos, T.acos, torch.arccos, T.arccos), 1, nonlinear_rule, UNIT),
    "atan": ((torch.atan, T.atan, torch.arctan, T.arctan), 1, monotone_rule, X),
    "asinh": ((torch.asinh, T.asinh, torch.arcsinh, T.arcsinh), 1, monotone_rule, X),
    "trunc": ((torch.trunc, T.trunc, torch.fix, T.fix), 1, monotone_rule, X),
    "frac": ((torch.frac, T.frac), 1, nonlinear_rule, X),                   # x - trunc(x)
    "sgn": ((torch.sgn, T.sgn), 1, monotone_rule, X),
    "signbit": ((torch.signbit, T.signbit), 1, nonlinear_rule, X),
    "isinf": ((torch.isinf, T.isinf), 1, nonlinear_rule, SPECIAL),
    "isposinf": ((torch.isposinf, T.isposinf), 1, nonlinear_rule, SPECIAL),
    "isneginf": ((torch.isneginf, T.isneginf), 1, nonlinear_rule, SPECIAL),
    "nan_to_num": ((torch.nan_to_num, T.nan_to_num), 1, nonlinear_rule, SPECIAL),
    "logit": ((torch.logit, T.logit), 3, nonlinear_rule, PROB),             # log(p / (1 - p))
    "erfc": ((torch.erfc, T.erfc), 1, nonlinear_rule, X),
    "erfinv": ((torch.erfinv, T.erfinv), 1, nonlinear_rule, UNIT),
    "lgamma": ((torch.lgamma, T.lgamma), 1, nonlinear_rule, POS),
    "digamma": ((torch.digamma, T.digamma), 1, nonlinear_rule, POS),
    "sinc": ((torch.sinc, T.sinc), 3, nonlinear_rule, X),                   # sin(pi x) / (pi x)
    "deg2rad": ((torch.deg2rad, T.deg2rad), 1, mul_rule, X),                # linear: x pi / 180
    "rad2deg": ((torch.rad2deg, T.rad2deg), 1, mul_rule, X),                # linear: x 180 / pi
    "relu6": ((F.relu6,), 2, monotone_rule, X),                             # min(max(x, 0), 6)
    "hardswish": ((F.hardswish,), 4, nonlinear_rule, X),                    # x relu6(x + 3) / 6
    "hardsigmoid": ((F.hardsigmoid,), 3, monotone_rule, X),                 # relu6(x + 3) / 6
    "selu": ((F.selu,), 5, monotone_rule, X),           # scale (max(0, x) + min(0, a (e^x - 1)))
    "celu": ((F.celu,), 5, nonlinear_rule, X),          # max(0, x) + min(0, a (e^(x/a) - 1))
    "softsign": ((F.softsign,), 3, monotone_rule, X),                       # x / (1 + |x|)
    "logsigmoid": ((F.logsigmoid,), 4, monotone_rule, X),                   # -softplus(-x)
    "tanhshrink": ((F.tanhshrink,), 2, monotone_rule, X),                   # x - tanh(x)
    "softshrink": ((F.softshrink,), 2, monotone_rule, X),                   # x -+ l beyond +-l
    "hardshrink": ((F.hardshrink,), 2, nonlinear_rule, X),                  # x beyond +-l, else 0
    "isreal": ((torch.isreal, T.isreal), 1, nonlinear_rule, X),             # imag == 0
    "threshold": ((F.threshold,), 1, nonlinear_rule,                        # x > t ? x : v
                  lambda g: [(g.rn(5, 6), 0.1, 20.0)]),
}

# name -> (callables, FLOPs per element, rule, sample)
BINARY_MORE = {
    "logical_xor": ((torch.logical_xor, T.logical_xor), 1, nonlinear_rule,
                    lambda g: [Sample(torch.logical_xor, (g.rn(5, 6) > 0, g.rn(6) > 0))]),
    "fmax": ((torch.fmax, T.fmax), 1, nonlinear_rule, _ties(torch.fmax)),
    "fmin": ((torch.fmin, T.fmin), 1, nonlinear_rule, _ties(torch.fmin)),
    "hypot": ((torch.hypot, T.hypot), 4, nonlinear_rule,                    # sqrt(x^2 + y^2)
              lambda g: [Sample(torch.hypot, (g.rn(5, 6), g.rn(5, 6)))]),
    "xlogy": ((torch.xlogy, T.xlogy), 2, nonlinear_rule,                    # x log(y), 0 at x = 0
              lambda g: [Sample(torch.xlogy, (g.rn(5, 6), g.pos(5, 6)))]),
    "copysign": ((torch.copysign, T.copysign), 1, nonlinear_rule,
                 lambda g: [Sample(torch.copysign, (g.rn(5, 6), g.rn(6)))]),
    "heaviside": ((torch.heaviside, T.heaviside), 1, nonlinear_rule,
                  lambda g: [Sample(torch.heaviside, (g.grid(5, 6).round(), g.rn(6)))]),
    "float_power": ((torch.float_power, T.float_power), 1, nonlinear_rule,  # in float64
                    lambda g: [Sample(torch.float_power, (g.pos(5, 6, dtype=torch.float64),
                                                           g.rn(5, 6, dtype=torch.float64)))]),
    # log(e^x + e^y): max, subtract, exp, log1p (4); base 2 the same with exp2 / log2.
    # Non-decreasing in each input, but P(max) of one input is not taken: a part's +-inf
    # (the other parts' -inf) is met as a value, and the rule stays the safe one
    "logaddexp": ((torch.logaddexp, T.logaddexp), 4, nonlinear_rule,
                  lambda g: [Sample(torch.logaddexp, (g.rn(5, 6), g.rn(6)))]),
    "logaddexp2": ((torch.logaddexp2, T.logaddexp2), 4, nonlinear_rule,
                   lambda g: [Sample(torch.logaddexp2, (g.rn(5, 6), g.rn(5, 6)))]),
    # the next float after x towards y (torch's NextafterBackward0: grad to x, none to y)
    "nextafter": ((torch.nextafter, T.nextafter), 1, nonlinear_rule,
                  lambda g: [Sample(torch.nextafter, (g.rn(5, 6), g.rn(5, 6)))]),
    "xlog1py": ((torch.special.xlog1py,), 2, nonlinear_rule,         # x log1p(y), 0 at x = 0
                lambda g: [Sample(torch.special.xlog1py, (g.rn(5, 6), g.pos(5, 6)))]),
    # Hurwitz zeta(x, q) = sum_k (k + q)^-x: a series; FLOPs as Cephes' zeta.c (the kernel
    # torch ports, aten/src/ATen/native/Math.h zeta): up to 9 terms and 12 Euler-Maclaurin
    # corrections, ~4 FLOPs each (ASSUMPTION: 21 x 4 = 84)
    "zeta": ((torch.special.zeta,), 84, nonlinear_rule,
             lambda g: [Sample(torch.special.zeta, (g.pos(5, 6) + 1.5, g.pos(5, 6)))]),
    # regularized incomplete gamma P(a, x) / Q(a, x): Cephes' igam.c series or continued
    # fraction (torch's calc_igamma, Math.h), up to 2000 iterations, ~8 FLOPs each, cut at
    # machine epsilon; ASSUMPTION: 50 iterations typical (50 x 8 = 400)
    "igamma": ((torch.igamma, T.igamma, torch.special.gammainc), 400, nonlinear_rule,
               lambda g: [Sample(torch.igamma, (g.pos(5, 6), g.pos(5, 6)))]),
    "igammac": ((torch.igammac, T.igammac, torch.special.gammaincc), 400, nonlinear_rule,
                lambda g: [Sample(torch.igammac, (g.pos(5, 6), g.pos(6)))]),
    # integers (Euclid's algorithm: ~log2 steps of a remainder; ASSUMPTION: 8 for
    # small ints); lcm = |a b| / gcd: 2 more
    "gcd": ((torch.gcd, T.gcd), 8, nonlinear_rule,
            lambda g: [Sample(torch.gcd, (g.ints(5, 6), g.ints(5, 6)))]),
    # x 2^e: torch's kernel locally (its backward, LdexpBackward0, is grad * pow(2, e) in
    # e's dtype: 0 for a negative integer e, as torch's); linear in x, but a P(sum) is
    # reduced first (2^e overflows to inf for a large e: the parts' sum would be nan)
    "ldexp": ((torch.ldexp, T.ldexp), 2, nonlinear_rule,
              lambda g: [Sample(torch.ldexp, (g.rn(5, 6), g.ints(6)))]),
    "lcm": ((torch.lcm, T.lcm), 10, nonlinear_rule,
            lambda g: [Sample(torch.lcm, (g.ints(5, 6), g.ints(6)))]),
}

for _n, (_fs, _fl, _rule, _args) in UNARY_MORE.items():
    register(_n, list(_fs), parse=_parse, rule=_rule, local=pointwise_local(_fs[0]),
             cost=costs.elementwise(_fl), op_class="elementwise",
             sample=_args and (lambda g, f=_fs[0], a=_args: [Sample(f, x) for x in a(g)]))
for _n, (_fs, _fl, _rule, _sample) in BINARY_MORE.items():
    register(_n, list(_fs), parse=_parse, rule=_rule, local=pointwise_local(_fs[0]),
             cost=costs.elementwise(_fl), op_class="elementwise", sample=_sample)

# torch's aliases: more callables of the op they name
ALIASES = {
    "abs": (torch.absolute, T.absolute), "neg": (torch.negative, T.negative),
    "mul": (torch.multiply, T.multiply), "sub": (torch.subtract, T.subtract),
    "div": (torch.divide, T.divide, torch.true_divide, T.true_divide),
    "gt": (torch.greater, T.greater), "ge": (torch.greater_equal, T.greater_equal),
    "lt": (torch.less, T.less), "le": (torch.less_equal, T.less_equal),
    "ne": (torch.not_equal, T.not_equal),
    "xlogy": (torch.special.xlogy,), "sigmoid": (torch.special.expit,),
    "exp2": (torch.special.exp2,), "expm1": (torch.special.expm1,),
    "log1p": (torch.special.log1p,), "erf": (torch.special.erf,),
    "erfc": (torch.special.erfc,), "erfinv": (torch.special.erfinv,),
    "logit": (torch.special.logit,), "digamma": (torch.special.digamma, torch.special.psi),
    "sinc": (torch.special.sinc,), "round": (torch.special.round,),
}


# bucketize(input, boundaries): elementwise in input; the boundaries (1-d, sorted) are
# read whole by every rank (a binary search per element: ceil(log2(n + 1)) compares)
def _bucketize_rule(x, boundaries, **_):
    opts = pointwise_options([x], "none")
    opts = [((ins[0], R), outs, note) for ins, outs, note in opts]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 2)


def _bucketize_parse(input, boundaries, *, out_int32=False, right=False, out=None):
    if out is not None:
        raise TypeError("bucketize(out=...) on a DistTensor: assign the result")
    if isinstance(input, (int, float)) and not isinstance(input, bool):
        # one value: torch wraps it as a number (searchsorted_scalar_tensor), compared in
        # the promoted dtype; a 0-d tensor of that dtype is compared the same way
        input = torch.tensor(input, dtype=torch.result_type(
            torch.empty((), dtype=boundaries.dtype), input))
    return (input, boundaries), {"out_int32": bool(out_int32), "right": bool(right)}


def _bucketize_local(nd, ctx, x, boundaries, out_int32, right):
    b = boundaries[(0,) * nd] if nd and boundaries.dim() > 1 else boundaries   # replicated
    return torch.bucketize(x.contiguous(), b, out_int32=out_int32, right=right)


def _bucketize_cost(ins, outs, **_):
    """A binary search per element over the n boundaries: ceil(log2(n + 1)) compares."""
    n = max(1, ins[1].numel())
    return costs.Cost(ins[0].numel() * max(1, math.ceil(math.log2(n + 1))),
                      costs.nbytes(ins[0]) + costs.nbytes(ins[1]) + costs.nbytes(outs[0]), 0, 0)


register("bucketize", [torch.bucketize], parse=_bucketize_parse, rule=_bucketize_rule,
         local=_bucketize_local, cost=_bucketize_cost, op_class="elementwise",
         sample=lambda g: [Sample(torch.bucketize, (g.rn(5, 6), torch.tensor([-1.0, 0.0, 0.5])),
                                  {"right": True})])

for _n, _fs in ALIASES.items():
    add_funcs(_n, [f for f in _fs if f not in BY_FUNC])

