"""Sample calls per op for :mod:`validate`: shapes that broadcast, split unevenly on 2,
3 and 4 ranks (5 and 7 rows), and several dtypes.  ``samples()`` builds them from a
fixed seed; an op without a sample is reported as such, never silently passed."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F

from .. import ops as _ops

T = torch.Tensor

# ops whose result cannot be compared with one device's
SKIP = {"dropout": "random (the validator compares deterministic ops)"}


@dataclass(frozen=True)
class Sample:
    """One call ``fn(*args, **kwargs)``; every tensor in it (lists included) is laid out."""
    fn: Callable
    args: tuple
    kwargs: dict = field(default_factory=dict)

    def __str__(self) -> str:
        def s(a):
            if isinstance(a, torch.Tensor):
                return f"{str(a.dtype).replace('torch.', '')}{list(a.shape)}"
            if isinstance(a, (list, tuple)):
                return "[" + ", ".join(s(b) for b in a) + "]"
            return repr(a)
        parts = [s(a) for a in self.args] + [f"{k}={s(v)}" for k, v in self.kwargs.items()]
        name = getattr(self.fn, "__name__", str(self.fn))
        return f"{name}({', '.join(parts)})"


def _s(fn, *args, **kwargs) -> Sample:
    return Sample(fn, args, kwargs)


@lru_cache(maxsize=1)
def _tables():
    g = torch.Generator().manual_seed(0)

    def rn(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

    def pos(*shape, dtype=torch.float32):          # away from 0: log, sqrt, 1/x
        return (rn(*shape).abs() + 0.5).to(dtype)

    def ints(*shape, lo=-5, hi=6):
        return torch.randint(lo, hi, shape, generator=g)

    x, y, v = rn(5, 6), rn(5, 6), rn(6)
    # comparisons: values on a 1/16 grid with ties, so that partial parts sum exactly
    xq, yq = (rn(5, 6) * 16).round() / 16, (rn(5, 6) * 16).round() / 16
    near = torch.where(ints(5, 6, lo=0, hi=2).bool(), xq, yq)
    tab: dict[str, list[Sample]] = {}
    for name, fn, arg in (("relu", torch.relu, x), ("gelu", F.gelu, x), ("silu", F.silu, x),
                          ("sigmoid", torch.sigmoid, x), ("tanh", torch.tanh, x),
                          ("exp", torch.exp, x), ("log", torch.log, pos(5, 6)),
                          ("sqrt", torch.sqrt, pos(5, 6)), ("rsqrt", torch.rsqrt, pos(5, 6)),
                          ("abs", torch.abs, x), ("square", torch.square, x),
                          ("sin", torch.sin, x), ("cos", torch.cos, x), ("erf", torch.erf, x),
                          ("reciprocal", torch.reciprocal, pos(5, 6)),
                          ("clone", torch.clone, rn(7, 3, dtype=torch.float64)),
                          ("contiguous", T.contiguous, x), ("float", T.float, rn(5, 6, dtype=torch.float64)),
                          ("half", T.half, x), ("bfloat16", T.bfloat16, x)):
        tab[name] = [_s(fn, arg)]
    tab["neg"] = [_s(torch.neg, x), _s(torch.neg, ints(7, 2))]
    tab["pow"] = [_s(torch.pow, x, 2), _s(torch.pow, pos(5, 6), 0.5)]
    tab["add"] = [_s(torch.add, x, y), _s(torch.add, x, v), _s(torch.add, ints(7, 3), ints(3))]
    tab["sub"] = [_s(torch.sub, x, rn(1, 6)), _s(torch.sub, v, x)]
    scalar = {"add": [_s(T.__add__, x, 1.5), _s(T.__radd__, v, 2)],
              "sub": [_s(T.__sub__, x, 0.5), _s(T.__rsub__, x, 1.0)]}
    tab["mul"] = [_s(torch.mul, x, y), _s(torch.mul, rn(5, 1), v), _s(T.__mul__, x, 2.5)]
    tab["div"] = [_s(torch.div, x, pos(5, 6)), _s(torch.div, x, pos(6))]
    tab["maximum"] = [_s(torch.maximum, xq, near)]
    tab["minimum"] = [_s(torch.minimum, x, v)]
    for n in ("eq", "ne", "lt", "le", "gt", "ge"):
        tab[n] = [_s(getattr(torch, n), xq, near)]
    tab["where"] = [_s(torch.where, x > 0, x, y)]
    # ops_table/tensor_habits.py: //, bitwise ops, lerp, any / all
    tab["floor_divide"] = [_s(torch.floor_divide, x, pos(5, 6)), _s(T.__rfloordiv__, pos(5, 6), 7.5)]
    i1, i2, sh = ints(5, 6, lo=-20, hi=21), ints(5, 6), ints(6, lo=0, hi=4)
    for n in ("bitwise_and", "bitwise_or", "bitwise_xor"):
        tab[n] = [_s(getattr(torch, n), i1, i2), _s(getattr(torch, n), i1 > 0, i2 > 0)]
    tab["bitwise_not"] = [_s(torch.bitwise_not, i1), _s(torch.bitwise_not, i1 > 0)]
    tab["bitwise_left_shift"] = [_s(torch.bitwise_left_shift, i1, sh)]
    tab["bitwise_right_shift"] = [_s(torch.bitwise_right_shift, i1, sh)]
    tab["lerp"] = [_s(torch.lerp, x, y, 0.25), _s(torch.lerp, x, v, pos(5, 6))]
    tab["any"] = [_s(torch.any, i1 > 3, 1), _s(torch.any, x)]
    tab["all"] = [_s(torch.all, i1 > -15, 0), _s(torch.all, i1)]
    tab["matmul"] = [_s(torch.matmul, x, rn(6, 3)), _s(torch.matmul, rn(2, 5, 3), rn(3, 4)),
                     _s(torch.matmul, x, v), _s(torch.matmul, rn(5), rn(5, 3))]
    tab["mm"] = [_s(torch.mm, x, rn(6, 3))]
    tab["bmm"] = [_s(torch.bmm, rn(2, 5, 3), rn(2, 3, 4))]
    tab["linear"] = [_s(F.linear, rn(3, 5, 6), rn(4, 6), rn(4)), _s(F.linear, x, rn(3, 6))]
    tab["einsum"] = [_s(torch.einsum, "bij,bjk->bik", rn(2, 3, 5), rn(2, 5, 3)),
                     _s(torch.einsum, "ij->ji", x), _s(torch.einsum, "ii->i", rn(5, 5)),
                     _s(torch.einsum, "bij->b", rn(3, 5, 2))]
    tab["sum"] = [_s(torch.sum, x, 1), _s(torch.sum, x), _s(torch.sum, x, 0, keepdim=True),
                  _s(torch.sum, ints(7, 3), 0)]
    tab["mean"] = [_s(torch.mean, x, 0), _s(torch.mean, rn(5, 3, 2), (0, 2))]
    tab["amax"] = [_s(torch.amax, x, 1), _s(torch.amax, x, (0, 1))]
    tab["amin"] = [_s(torch.amin, x, 0), _s(torch.amin, ints(7, 3), 1)]
    tab["softmax"] = [_s(torch.softmax, x, -1)]
    tab["log_softmax"] = [_s(F.log_softmax, x, 0)]
    x3 = rn(5, 3, 4)
    tab["permute"] = [_s(torch.permute, x3, (2, 0, 1)), _s(torch.movedim, x3, 0, -1)]
    tab["transpose"] = [_s(torch.transpose, x3, 0, 1), _s(torch.t, x)]
    tab["reshape"] = [_s(torch.reshape, x, (30,)), _s(torch.reshape, rn(4, 6), (4, 2, 3)),
                      _s(torch.reshape, x3, (5, 12))]
    tab["view"] = [_s(T.view, rn(4, 6), 2, 12)]
    tab["flatten"] = [_s(torch.flatten, x3, 1)]
    tab["unflatten"] = [_s(torch.unflatten, rn(5, 6), 1, (2, 3))]
    tab["unsqueeze"] = [_s(torch.unsqueeze, x, 1)]
    tab["squeeze"] = [_s(torch.squeeze, rn(5, 1, 6), 1)]
    tab["cat"] = [_s(torch.cat, [x, y], 0), _s(torch.cat, [x, rn(5, 2)], 1)]
    tab["stack"] = [_s(torch.stack, [x, y], 1)]
    tab["split"] = [_s(torch.split, rn(7, 4), 3, 0), _s(torch.split, x, [2, 4], 1)]
    tab["chunk"] = [_s(torch.chunk, x, 2, 1)]
    tab["unbind"] = [_s(torch.unbind, rn(3, 5), 0)]
    tab["getitem"] = [_s(T.__getitem__, x, (slice(1, 4),)), _s(T.__getitem__, x, (slice(None), 2)),
                      _s(T.__getitem__, x3, (None, Ellipsis, slice(0, 4, 2)))]
    tab["layer_norm"] = [_s(F.layer_norm, rn(3, 5, 6), (6,), rn(6), rn(6))]
    tab["rms_norm"] = [_s(F.rms_norm, rn(3, 5, 6), (6,), rn(6), 1e-6)]
    q, k, vv = rn(2, 2, 5, 4), rn(2, 2, 7, 4), rn(2, 2, 7, 4)
    tab["scaled_dot_product_attention"] = [_s(F.scaled_dot_product_attention, q, k, vv),
                                           _s(F.scaled_dot_product_attention, q, q, q, is_causal=True)]
    tab["flash_attention"] = [_s(_ops.flash_attention, q, k, vv)]
    tab["swiglu"] = [_s(_ops.swiglu, rn(5, 3, 6))]
    cos, sin = _ops.rope_cos_sin(5, 4)
    tab["rotary_embedding"] = [_s(_ops.rotary_embedding, rn(2, 5, 4), cos, sin)]
    tab["embedding"] = [_s(F.embedding, ints(5, 3, lo=0, hi=7), rn(7, 4))]
    tab["cross_entropy"] = [_s(F.cross_entropy, rn(5, 7), ints(5, lo=0, hi=7)),
                            _s(F.cross_entropy, rn(4, 5, 3), ints(4, 3, lo=0, hi=5), reduction="sum")]
    return tab, scalar


def samples(known_bugs: bool = True) -> dict[str, list[Sample]]:
    """{op name: [Sample]} (built once, fixed seed).  ``known_bugs=False`` leaves out the
    calls that hit a bug already filed in issue 10 (``P(sum) + scalar`` adds the scalar
    on every rank), for a test suite that must pass until it is fixed."""
    tab, scalar = _tables()
    if not known_bugs:
        return tab
    out = dict(tab)
    for k, v in scalar.items():
        out[k] = tab[k] + v
    return out
