"""``overwrite(value, old)``: ``value`` written over ``old``, as one op of the table, for a
captured program (``wb.compile``'s in-place writes: compile/writes.py).

Eager writes ``x.zero_()`` / ``x.fill_(v)`` / ``x.copy_(y)`` into a DistTensor ``x`` with
history by giving ``x`` the value's history through ``parallel.inplace._Overwrite``: the
result is the value, and ``x``'s old value gets a zero gradient (torch's CopyBackwards),
with no communication: ``old``'s layout is never read.  Captured, the write is this op: its
rule keeps ``value`` and ``old`` as they come and gives the output ``value``'s layout (a
``where`` over an all-true mask, the other way to say it, reduces a partial ``old`` first:
a collective eager does not make).  The compiled program calls the function itself on the
DistTensors (``extra["runs_itself"]``, as ``keep_layout``)."""
from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function

from ..dist_tensor import DistTensor
from . import costs
from .strategy import combine
from .table import TABLE, register

__all__ = ["overwrite", "overwrite_rule"]


def overwrite(value, old):
    """``value`` with ``old``'s zero gradient (``parallel.inplace._Overwrite``); both of one
    shape and dtype, DistTensors on one mesh (or plain tensors)."""
    from ..inplace import _Overwrite, over_old
    if isinstance(value, DistTensor) and isinstance(old, DistTensor):
        if tuple(value.shape) != tuple(old.shape) or value.dtype != old.dtype or \
                value.mesh != old.mesh:
            raise ValueError(f"overwrite: value {tuple(value.shape)} {value.dtype} over old "
                             f"{tuple(old.shape)} {old.dtype}; give one shape, dtype and mesh")
        return over_old(value, old)
    if has_torch_function((value, old)):
        return handle_torch_function(overwrite, (value, old), value, old)
    if type(value) is torch.Tensor and type(old) is torch.Tensor:
        return _Overwrite.apply(value, old)
    raise TypeError(f"overwrite: value is a {type(value).__name__}, old a "
                    f"{type(old).__name__}; give two DistTensors (or two plain tensors)")


def overwrite_rule(value, old, **_):
    """``value`` and ``old`` as they are; the output in ``value``'s placements."""
    nd = value.mesh.ndim
    return combine(nd, [[((p, q), (p,), "old's values unread")]
                        for p, q in zip(value.placements, old.placements)], 2)


def _local(nd, ctx, value, *_, **__):
    if ctx is None:
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    raise RuntimeError("overwrite runs as itself on DistTensors, not as a local op")


register("overwrite", [overwrite], parse=lambda value, old: ((value, old), {}),
         rule=overwrite_rule, local=_local, cost=costs.view, op_class="view",
         meta_check=False,
         sample="an in-place write captured by wb.compile: held to eager by "
                "tests/test_compile13.py")
TABLE["overwrite"].extra["runs_itself"] = True
