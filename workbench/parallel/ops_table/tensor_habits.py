"""The rest of torch.Tensor's operator surface on DistTensors: ``//``, ``&``, ``|``,
``^``, ``~``, ``<<``, ``>>`` (and their reflected forms), ``==`` / ``!=`` and
``c % x``. All are elementwise: ``rules/pointwise.py``'s rules, FLOPs per element beside
each name (one operation per element, the convention of ``costs.py``).

None is linear, so Partial inputs are reduced first (``nonlinear_rule``):
``(a1 + a2) // c != a1 // c + a2 // c`` and bitwise ops act on the bits of the sum.
"""
from __future__ import annotations

import torch

from ..rules import pointwise as rp
from . import costs
from ._util import align
from .pointwise import _parse, _swapped, _zero_dims
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
for _n, (_fs, _d, _rev, _fl) in BINARY.items():
    register(_n, list(_fs) + [_d, (_rev, _swapped)], parse=_parse, rule=rp.nonlinear_rule,
             local=_local(_d, _rev), cost=costs.elementwise(_fl), op_class="elementwise")


def _not_local(nd, ctx, x):
    return torch.bitwise_not(x)


register("bitwise_not", [torch.bitwise_not, T.bitwise_not, T.__invert__], parse=_parse,
         rule=rp.nonlinear_rule, local=_not_local, cost=costs.elementwise(1),
         op_class="elementwise")

# x == y, x != y: a DistTensor of bools, as torch (DistTensor hashes by id, as a tensor)
add_funcs("eq", [T.__eq__])
add_funcs("ne", [T.__ne__])
# c % x is remainder(c, x)
add_funcs("remainder", [(T.__rmod__, _swapped)])
