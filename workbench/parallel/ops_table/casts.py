"""dtype casts: ``to``, ``type_as``, ``float``, ``double``, ``half``, ``bfloat16``, ``int``,
``long``, ``bool``.

Per mesh dim: R and S pass; P(max) / P(min) pass between floating dtypes (rounding is
non-decreasing); P(sum) / P(avg) only through widening float casts (a cast to int
truncates each part: int(0.5) + int(0.5) != int(1.0); a narrowing float cast rounds
each part, with errors as large as the parts). A cast reads and writes every element
and computes nothing (``costs.movement``).
"""
from __future__ import annotations

import torch

from ..placement import Partial
from . import costs
from ._util import is_tensor
from .pointwise import pointwise_options
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["cast_rule"]

T = torch.Tensor


def _widening():
    f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    return {(f16, f32), (f16, f64), (bf16, f32), (bf16, f64), (f32, f64)}


_WIDENING = _widening()


def cast_rule(x, *, dtype, **_):
    """dtype casts: R and S pass; P(max/min) pass between floating dtypes, P(sum/avg)
    through widening float casts only; a cast to its own dtype (a copy) passes them all."""
    opts = pointwise_options([x], "none")
    if x.dtype == dtype:
        # a cast to its own dtype is a copy: every partial passes, as ``clone``'s (a
        # complex P(sum) was reduce-scattered first: capture records foreach's ``to``,
        # which eager returns as the tensor itself; wide probe seed 350)
        opts += [((Partial(op),), (Partial(op),), f"a cast of P({op}) to its own dtype "
                  "is a copy") for op in ("sum", "avg", "max", "min")]
    elif x.dtype.is_floating_point and dtype.is_floating_point:
        # rounding is non-decreasing: max_i round(a_i) = round(max_i a_i), exactly
        opts += [((Partial(op),), (Partial(op),), f"a float cast of P({op}) is P({op})")
                 for op in ("max", "min")]
        if (x.dtype, dtype) in _WIDENING:
            # every part is exact in the wider dtype: sum_i wide(a_i) = wide(sum_i a_i)
            # up to the narrow sum's own rounding (a narrowing cast of parts would round
            # each part, errors as large as the parts)
            opts += [((Partial(op),), (Partial(op),), f"a widening cast of P({op}) is P({op})")
                     for op in ("sum", "avg")]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


# ---- parse, local implementation, registration ------------------------------------------

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
    # a cast to x's own dtype reaches here only with copy=True (dispatch returns x itself
    # otherwise: _same_dtype), so it copies, as torch's x.to(x.dtype, copy=True)
    y = x.to(dtype)
    return y.clone() if y is x else y


def _fixed(dtype):
    return lambda x, memory_format=None: ((x,), {"dtype": dtype})


def _same_dtype(inputs, attrs, kwargs) -> bool:
    """A cast to the dtype the tensor has returns the tensor itself, as torch's
    (``x.to(x.dtype) is x``, ``x.float() is x`` on float32), unless ``copy=True``."""
    return attrs["dtype"] == inputs[0].dtype and not kwargs.get("copy", False)


_TO = register("to", [T.to], parse=_to_parse, rule=cast_rule, local=_cast_local,
               cost=costs.movement, op_class="elementwise", meta_check=False)
_TYPE_AS = register("type_as", [T.type_as], parse=lambda x, other: ((x,), {"dtype": other.dtype}),
                    rule=cast_rule, local=_cast_local, cost=costs.movement, op_class="elementwise")
for _e in (_TO, _TYPE_AS):
    _e.extra["returns_self"] = _same_dtype
# name -> (dtype, the validator's sample input)
_METHODS = {"float": (torch.float32, lambda g: g.rn(5, 6, dtype=torch.float64)),
            "double": (torch.float64, None), "half": (torch.float16, lambda g: g.rn(5, 6)),
            "bfloat16": (torch.bfloat16, lambda g: g.rn(5, 6)), "int": (torch.int32, None),
            "long": (torch.int64, None), "bool": (torch.bool, None)}
for _n, (_dt, _x) in _METHODS.items():
    register(_n, [getattr(T, _n)], parse=_fixed(_dt), rule=cast_rule, local=_cast_local,
             cost=costs.movement, op_class="elementwise",
             sample=_x and (lambda g, f=getattr(T, _n), x=_x: [Sample(f, (x(g),))])
             ).extra["returns_self"] = _same_dtype
