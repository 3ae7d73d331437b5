"""Element-wise ops: unary, binary, comparisons, casts, clamp, where, masked_fill,
triu / tril. Rules: ``rules/pointwise.py``; FLOPs per element beside each name (the
formula as PyTorch documents it, see ``costs.py`` for the convention)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rules import pointwise as rp
from . import costs
from ._util import align, is_tensor
from .table import register

T = torch.Tensor


def _parse(*args, **kwargs):
    if kwargs.pop("inplace", False):
        raise NotImplementedError("inplace=True on a DistTensor: in-place ops are not "
                                  "supported; use the out-of-place form (inplace=False)")
    for k, v in kwargs.items():
        if is_tensor(v):
            raise TypeError(f"{k}= given a tensor: pass tensor arguments positionally")
    return tuple(args), kwargs


def _swapped(*args, **kwargs):           # Tensor.__rsub__(x, c) is sub(c, x)
    return _parse(args[1], args[0], *args[2:], **kwargs)


def _zero_dims(nd, ctx, xs):
    """Type promotion: a 0-d tensor does not promote a dimensioned one of the same
    category (bf16 tensor * f32 0-d tensor is bf16), but stacked, every local tensor has
    device axes. A 0-d input that is the same on every rank is given to torch as the 0-d
    tensor it is, so the op promotes (and rounds) exactly as on one device. A 0-d input
    that differs per rank (a partial) is cast to the common dtype torch computes in."""
    if not any(s is not None and s.ndim > 0 for s in ctx.in_specs):
        return xs                  # only 0-d tensors: nothing to promote differently
    out = None
    for k, s in enumerate(ctx.in_specs):
        x = xs[k]
        if s is None or s.ndim != 0 or not isinstance(x, torch.Tensor) or x.dim() == 0:
            continue
        out = out or list(xs)
        if all(x.shape[i] == 1 or x.stride(i) == 0 for i in range(nd)):
            out[k] = x[(0,) * nd]
        else:
            wide = [t.dtype for t in ctx.in_specs if t is not None and t.ndim > 0]
            if wide:
                dim_dtype = wide[0]
                for d in wide[1:]:
                    dim_dtype = torch.promote_types(dim_dtype, d)
                out[k] = x.to(torch.result_type(
                    torch.empty(1, dtype=dim_dtype, device="meta"),
                    torch.empty((), dtype=s.dtype, device="meta")))
    return out or xs


def _local(fn):
    def local(nd, ctx, *xs, **kw):
        if ctx is not None and len(xs) > 1:
            xs = _zero_dims(nd, ctx, xs)
        return fn(*align(nd, *xs), **kw)
    return local


def _register(name, funcs, rule, flops, op_class="elementwise", swapped=(), **kw):
    cost = costs.elementwise(flops) if flops is not None else costs.movement
    register(name, list(funcs) + [(f, _swapped) for f in swapped if f is not None],
             parse=_parse, rule=rule, local=_local(funcs[0]), cost=cost, op_class=op_class, **kw)


# ---- unary: name -> (callables, FLOPs per element, rule) ------------------------------------
# non-decreasing (P(max), P(min) pass): relu, exp, sigmoid, tanh, erf, softplus, hardtanh,
# floor, ceil, round, sign; log/sqrt are not over parts that may be negative (nan).
UNARY = {
    "relu": ((torch.relu, F.relu, T.relu), 1, rp.monotone_rule),              # max(x, 0)
    "gelu": ((F.gelu,), 5, rp.nonlinear_rule),          # x/2 (1 + erf(x/sqrt2)); tanh form 9
    "silu": ((F.silu,), 4, rp.nonlinear_rule),          # x / (1 + exp(-x))
    "sigmoid": ((torch.sigmoid, T.sigmoid, F.sigmoid), 3, rp.monotone_rule),  # 1/(1+exp(-x))
    "tanh": ((torch.tanh, T.tanh, F.tanh), 1, rp.monotone_rule),
    "exp": ((torch.exp, T.exp), 1, rp.monotone_rule),
    "log": ((torch.log, T.log), 1, rp.nonlinear_rule),
    "sqrt": ((torch.sqrt, T.sqrt), 1, rp.nonlinear_rule),
    "rsqrt": ((torch.rsqrt, T.rsqrt), 1, rp.nonlinear_rule),
    "abs": ((torch.abs, T.abs, T.__abs__), 1, rp.nonlinear_rule),
    "neg": ((torch.neg, T.neg, T.__neg__), 1, rp.mul_rule),                    # linear
    "square": ((torch.square, T.square), 1, rp.nonlinear_rule),
    "sin": ((torch.sin, T.sin), 1, rp.nonlinear_rule),
    "cos": ((torch.cos, T.cos), 1, rp.nonlinear_rule),
    "erf": ((torch.erf, T.erf), 1, rp.monotone_rule),
    "reciprocal": ((torch.reciprocal, T.reciprocal), 1, rp.nonlinear_rule),
    "softplus": ((F.softplus,), 6, rp.monotone_rule),   # log(1 + exp(b x)) / b; x b > threshold
    "leaky_relu": ((F.leaky_relu,), 2, rp.nonlinear_rule),    # compare, multiply
    "elu": ((F.elu,), 4, rp.nonlinear_rule),                  # x > 0 ? x : a (exp(x) - 1)
    "mish": ((F.mish,), 5, rp.nonlinear_rule),                # x tanh(log(1 + exp(x)))
    "hardtanh": ((F.hardtanh,), 2, rp.monotone_rule),         # clamp(x, lo, hi)
    "floor": ((torch.floor, T.floor), 1, rp.monotone_rule),
    "ceil": ((torch.ceil, T.ceil), 1, rp.monotone_rule),
    "round": ((torch.round, T.round), 1, rp.monotone_rule),
    "sign": ((torch.sign, T.sign), 1, rp.monotone_rule),
    "isnan": ((torch.isnan, T.isnan), 1, rp.nonlinear_rule),
    "isfinite": ((torch.isfinite, T.isfinite), 1, rp.nonlinear_rule),
    "logical_not": ((torch.logical_not, T.logical_not), 1, rp.nonlinear_rule),
    "clone": ((torch.clone, T.clone), None, rp.mul_rule),                      # a copy
    "contiguous": ((T.contiguous,), None, rp.mul_rule),
}
for _n, (_fs, _fl, _rule) in UNARY.items():
    _register(_n, _fs, _rule, _fl, op_class="data_movement" if _fl is None else "elementwise")

register("positive", [torch.positive, T.positive], parse=_parse, rule=rp.mul_rule,
         local=_local(torch.positive), cost=costs.view, op_class="view")

# ---- binary: name -> (callables, reversed dunder, FLOPs per element, rule) ------------------
BINARY = {
    "add": ((torch.add, T.add, T.__add__), T.__radd__, 1, rp.add_rule),
    "sub": ((torch.sub, T.sub, T.__sub__), T.__rsub__, 1, rp.add_rule),
    "mul": ((torch.mul, T.mul, T.__mul__), T.__rmul__, 1, rp.mul_rule),
    "div": ((torch.div, T.div, T.__truediv__), T.__rtruediv__, 1, rp.div_rule),
    "pow": ((torch.pow, T.pow, T.__pow__), T.__rpow__, 1, rp.nonlinear_rule),
    "maximum": ((torch.maximum, T.maximum), None, 1, rp.nonlinear_rule),
    "minimum": ((torch.minimum, T.minimum), None, 1, rp.nonlinear_rule),
    "atan2": ((torch.atan2, T.atan2), None, 1, rp.nonlinear_rule),
    "remainder": ((torch.remainder, T.remainder, T.__mod__), None, 4, rp.nonlinear_rule),
    "fmod": ((torch.fmod, T.fmod), None, 4, rp.nonlinear_rule),   # x - trunc(x / y) y
    "logical_and": ((torch.logical_and, T.logical_and), None, 1, rp.nonlinear_rule),
    "logical_or": ((torch.logical_or, T.logical_or), None, 1, rp.nonlinear_rule),
}
for _c in ("eq", "ne", "lt", "le", "gt", "ge"):
    # (__eq__ / __ne__ are added in tensor_habits.py; a DistTensor hashes by id)
    _d = getattr(T, f"__{_c}__") if _c not in ("eq", "ne") else None
    BINARY[_c] = ((getattr(torch, _c), getattr(T, _c), _d), None, 1, rp.nonlinear_rule)
for _n, (_fs, _rev, _fl, _rule) in BINARY.items():
    _register(_n, [f for f in _fs if f is not None], _rule, _fl, swapped=(_rev,))


# ---- casts ---------------------------------------------------------------------------------

def _to_parse(x, *args, **kwargs):
    dtype = kwargs.pop("dtype", None)
    device = kwargs.pop("device", None)
    kwargs.pop("non_blocking", None)
    kwargs.pop("copy", None)
    if kwargs:
        raise TypeError(f"to(): arguments {sorted(kwargs)} are not supported on a DistTensor")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif is_tensor(a):
            dtype = a.dtype
        elif isinstance(a, (str, torch.device)):
            device = a
        else:
            raise TypeError(f"to({a!r}): give a dtype, a device or a tensor")
    if device is not None and torch.device(device).type != x.device.type:
        raise NotImplementedError(
            f"to(device={device!r}) on a DistTensor on {x.device}: every simulated rank "
            "lives on one device; build the DistTensor from tensors on that device")
    return (x,), {"dtype": x.dtype if dtype is None else dtype}


def _cast_local(nd, ctx, x, dtype):
    return x.to(dtype)


def _fixed(dtype):
    return lambda x, memory_format=None: ((x,), {"dtype": dtype})


register("to", [T.to], parse=_to_parse, rule=rp.cast_rule, local=_cast_local,
         cost=costs.movement, op_class="elementwise", meta_check=False)
register("type_as", [T.type_as], parse=lambda x, other: ((x,), {"dtype": other.dtype}),
         rule=rp.cast_rule, local=_cast_local, cost=costs.movement, op_class="elementwise")
for _n, _dt in (("float", torch.float32), ("double", torch.float64), ("half", torch.float16),
                ("bfloat16", torch.bfloat16), ("int", torch.int32), ("long", torch.int64),
                ("bool", torch.bool)):
    register(_n, [getattr(T, _n)], parse=_fixed(_dt), rule=rp.cast_rule, local=_cast_local,
             cost=costs.movement, op_class="elementwise")


# ---- clamp, where, masked_fill, triu / tril -----------------------------------------------

def _clamp_parse(x, min=None, max=None):
    return (x, min, max), {}


def _clamp_local(nd, ctx, x, lo, hi):
    x, lo, hi = align(nd, x, lo, hi)
    return torch.clamp(x, lo, hi)


register("clamp", [torch.clamp, T.clamp, torch.clip, T.clip], parse=_clamp_parse,
         rule=rp.monotone_rule, local=_clamp_local, cost=costs.elementwise(2),
         op_class="elementwise")                                    # min(max(x, lo), hi)

register("where", [torch.where, T.where], parse=lambda c, x, y: ((c, x, y), {}),
         rule=rp.where_rule, local=_local(torch.where), cost=costs.elementwise(1),
         op_class="elementwise")


def _masked_fill_parse(x, mask, value):
    if is_tensor(value):
        return (x, mask, value), {"fill": None}
    return (x, mask, None), {"fill": value}


def _masked_fill_local(nd, ctx, x, mask, value, fill):
    x, mask, value = align(nd, x, mask, value)
    if value is None:
        return x.masked_fill(mask, fill)
    return torch.where(mask, value.to(x.dtype), x)       # a 0-d value, one per rank


register("masked_fill", [torch.masked_fill, T.masked_fill], parse=_masked_fill_parse,
         rule=rp.masked_fill_rule, local=_masked_fill_local, cost=costs.elementwise(1),
         op_class="elementwise")


def _triangle(fn):
    def local(nd, ctx, x, diagonal=0):
        return fn(x, diagonal)
    return local


for _n, _fn in (("triu", torch.triu), ("tril", torch.tril)):
    register(_n, [_fn, getattr(T, _n)],
             parse=lambda x, diagonal=0: ((x,), {"diagonal": int(diagonal)}),
             rule=rp.triangle_rule, local=_triangle(_fn), cost=costs.elementwise(1),
             op_class="elementwise")
