"""What a torch.Tensor user expects of a DistTensor beyond its ops: ``x in d``,
``bool(d)``, ``float(d)``, ``d.item()``, ``d.tolist()``, ``f"{d:.3f}"``, iteration,
``numpy.asarray(d)``, ``d.data`` and ``d.requires_grad = ...``. Each gives PyTorch's
answer for the full tensor (a value read out of a DistTensor is gathered first: a
traced all-gather / all-reduce), or PyTorch's error.

``==`` / ``!=`` are ops (``ops_table/tensor_habits.py``): a DistTensor of bools, so a
DistTensor hashes by identity, as a torch.Tensor does.
"""
from __future__ import annotations

import numbers

import torch

from . import storage
from .dist_tensor import DistTensor

__all__ = ["install"]

T = torch.Tensor


def _contains(self, element) -> bool:
    """``element in d``: torch's ``(element == t).any()`` on the full tensor."""
    if not isinstance(element, (torch.Tensor, DistTensor, numbers.Number, torch.SymInt,
                                torch.SymFloat, torch.SymBool)):
        raise RuntimeError(f"Tensor.__contains__ only supports Tensor or scalar, but you "
                           f"passed in a {type(element)}.")
    from .dispatch import dispatch
    eq = dispatch(T.eq, (self, element), None)
    return bool(eq.full().any().item())


def _one(self, what: str) -> torch.Tensor:
    if self.numel() != 1:
        raise RuntimeError(f"{what} of a DistTensor with {self.numel()} elements is ambiguous "
                           "(as for a tensor: only one element converts); use .full() or a "
                           "reduction such as .any() / .all()")
    return self.full()


def _item(self):
    if self.numel() != 1:
        raise RuntimeError(f"a Tensor with {self.numel()} elements cannot be converted to "
                           "Scalar (item() of a DistTensor reads one element; use .full())")
    return self.full().item()


def _format(self, spec: str) -> str:
    if self.ndim == 0:
        return self.full().item().__format__(spec)
    return object.__format__(self, spec)


def _iter(self):
    if self.ndim == 0:
        raise TypeError("iteration over a 0-d tensor")
    return (self[i] for i in range(self.shape[0]))


def _array(self, dtype=None, copy=None):
    a = self.full().detach().cpu().numpy()
    return a if dtype is None else a.astype(dtype, copy=False)


def _get_data(self) -> DistTensor:
    """A detached alias (as ``Tensor.data``): writes into it reach ``self``."""
    from .inplace import _writable
    if not _writable(self._local):
        # several elements share one memory location (a stride-0 copy): give self its
        # own memory first, so that the alias can be written
        keep_leaf = self.requires_grad and self.is_leaf
        loc = storage.map_tensors(self._local, lambda t: t.clone())
        if keep_leaf:
            loc = storage.map_tensors(loc, lambda t: t.detach().requires_grad_())
        self._local = loc
    loc = storage.map_tensors(self._local, lambda t: t.detach())
    return DistTensor(loc, self.mesh, self.placements, self.shape, self.dtype, self.names)


def _set_data(self, value) -> None:
    """``d.data = other``: ``d`` takes ``other``'s data (its mesh, layout, shape and
    dtype; an alias, as torch), keeping its own ``requires_grad``."""
    if not isinstance(value, DistTensor):
        raise TypeError(f"DistTensor.data = {type(value).__name__}: give a DistTensor (its data "
                        "is laid out over ranks), e.g. d.data = wb.shard_tensor(t, d.mesh, "
                        "d.placements), or write values with d.copy_(t)")
    keep = self.requires_grad
    loc = storage.map_tensors(value._local, lambda t: t.detach())
    if keep:
        loc = storage.map_tensors(loc, lambda t: t.requires_grad_())
    self._local, self.mesh, self.placements = loc, value.mesh, value.placements
    self.shape, self.dtype, self.names, self._spec = value.shape, value.dtype, value.names, None


def _set_requires_grad(self, flag) -> None:
    if not self.is_leaf:
        raise RuntimeError("you can only change requires_grad flags of leaf variables. If you "
                           "want to use a computed variable in a subgraph that doesn't require "
                           "differentiation use var_no_grad = var.detach().")
    self.requires_grad_(bool(flag))


def install(cls) -> None:
    cls.__contains__ = _contains
    cls.__bool__ = lambda self: bool(_one(self, "bool()").item())
    cls.__float__ = lambda self: float(_one(self, "float()").item())
    cls.__int__ = lambda self: int(_one(self, "int()").item())
    cls.__complex__ = lambda self: complex(_one(self, "complex()").item())
    cls.__index__ = lambda self: _one(self, "index").__index__()
    cls.__format__ = _format
    cls.__iter__ = _iter
    cls.__array__ = _array
    cls.item = _item
    cls.tolist = lambda self: self.full().tolist()
    cls.data = property(_get_data, _set_data)
    cls.requires_grad = property(cls.requires_grad.fget, _set_requires_grad)
