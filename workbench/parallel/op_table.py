"""Wiring DistTensor to the op table (``ops_table/``): operators and tensor methods go
to the dispatcher. (``_align`` and ``_shift`` are kept here for modules that import
them from this older location.)"""
from __future__ import annotations

import torch

from .ops_table._util import align as _align, shift as _shift  # noqa: F401

T = torch.Tensor

_DUNDERS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
            "__truediv__", "__rtruediv__", "__matmul__", "__rmatmul__", "__neg__", "__pow__",
            "__rpow__", "__mod__", "__abs__", "__gt__", "__lt__", "__ge__", "__le__",
            "__getitem__")


def install(cls):
    """Give ``cls`` (DistTensor) torch-function dispatch, operators and tensor methods."""
    from .dispatch import dispatch

    @classmethod
    def __torch_function__(c, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs)
    cls.__torch_function__ = __torch_function__

    def make(f):
        def op(self, *args, **kwargs):
            return dispatch(f, (self,) + args, kwargs)
        op.__name__ = f.__name__
        return op
    for name in _DUNDERS:
        setattr(cls, name, make(getattr(T, name)))

    def __getattr__(self, name):
        f = getattr(T, name, None)
        if f is None or name.startswith("_") or not callable(f):
            raise AttributeError(f"'DistTensor' object has no attribute {name!r}")

        def method(*args, **kwargs):
            return dispatch(f, (self,) + args, kwargs)
        return method
    cls.__getattr__ = __getattr__
    cls.T = property(lambda self: dispatch(T.permute, (self, tuple(reversed(range(self.ndim)))),
                                           None))
    cls.mT = property(lambda self: dispatch(T.transpose, (self, -2, -1), None))
