"""DistTensor's tensor surface: operators (``+``, ``==``, ``//``, ``x[i]`` ...) and tensor
methods go to the dispatcher, which runs them through the op table (``ops_table/``)."""
from __future__ import annotations

import torch

T = torch.Tensor

_DUNDERS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
            "__truediv__", "__rtruediv__", "__matmul__", "__rmatmul__", "__neg__", "__pow__",
            "__rpow__", "__mod__", "__rmod__", "__abs__", "__pos__", "__gt__", "__lt__", "__ge__",
            "__le__", "__eq__", "__ne__", "__getitem__", "__floordiv__", "__rfloordiv__",
            "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__invert__",
            "__lshift__", "__rlshift__", "__rshift__", "__rrshift__")
_NUMBERS = (int, float, complex, bool)
# name -> hook(self, args, kwargs): a method that a context handles while it is active
# (loss_parallel's log_softmax, tp_loss.py; torch's TorchFunctionMode sees Tensor methods,
# but DistTensor is no Tensor, so other modes must not be handed it); NotImplemented:
# the dispatcher's
METHOD_HOOKS: dict = {}


def install(cls):
    """Give ``cls`` (DistTensor) torch-function dispatch, operators and tensor methods."""
    from . import habits, inplace
    from .dispatch import dispatch
    from .dist_tensor import DistTensor

    @classmethod
    def __torch_function__(c, func, types, args=(), kwargs=None):
        if func is T.__getitem__ and len(args) == 2 and not isinstance(args[0], DistTensor):
            from .ops_table.datadep import bool_mask_index
            picked = bool_mask_index(*args)       # plain_x[dist_mask]
            if picked is not None:
                return picked
        return dispatch(func, args, kwargs)
    cls.__torch_function__ = __torch_function__

    def make(f, name):
        def op(self, *args, **kwargs):
            if args and not isinstance(args[0], (T, DistTensor, *_NUMBERS)) and \
                    name != "__getitem__":
                return NotImplemented       # as torch: `d == None` is False, `d + "a"` raises
            return dispatch(f, (self,) + args, kwargs)
        op.__name__ = name
        return op
    for name in _DUNDERS:
        setattr(cls, name, make(getattr(T, name), name))

    def make_inplace(op):
        def iop(self, other):
            return inplace.method(self, op, (other,))
        iop.__name__ = op
        return iop
    for name, op in inplace.IDUNDERS.items():       # x += y is x.add_(y), in place
        setattr(cls, name, make_inplace(op))
    cls.__setitem__ = lambda self, index, value: inplace.setitem(self, index, value)

    basic = (int, slice, type(None), type(Ellipsis))

    def __getitem__(self, index):
        # x[i] with an index tensor (advanced indexing) is index_select; basic indices
        # (ints, slices, None, ...) are the getitem op
        if type(index) in basic or type(index) is tuple and all(type(i) in basic
                                                                 for i in index):
            return dispatch(T.__getitem__, (self, index), None)
        from .ops_table.indexing import sequence_as_tuple
        if sequence_as_tuple(index):            # x[[[0, 1], [1, 2]]]: torch's tuple
            return self[tuple(index)]
        from .ops_table.datadep import bool_mask_index
        picked = bool_mask_index(self, index)     # x[mask]: the output's size from the mask
        if picked is not None:
            return picked
        from .ops_table.indexing import advanced_index, index_with, mixed_index
        mixed = mixed_index(self, index)        # x[i, :, j], x[1:, i]: several, or beside
        if mixed is not None:                   # ints / slices / None
            return mixed
        adv = advanced_index(self, index)
        if adv is not None:
            return index_with(self, *adv)
        if isinstance(index, tuple) and any(isinstance(i, T) for i in index) or \
                isinstance(index, T):        # 0-d integer tensors: ints, as torch reads them
            index = tuple(int(i) if isinstance(i, T) else i for i in
                          (index if isinstance(index, tuple) else (index,)))
        return dispatch(T.__getitem__, (self, index), None)
    cls.__getitem__ = __getitem__
    habits.install(cls)

    def method_of(name):
        """torch.Tensor's method ``name`` on DistTensors (None: no such method)."""
        f = getattr(T, name, None)
        if f is None or name.startswith("_") or not callable(f):
            return None
        if name.endswith("_"):                      # in place: written into self
            def method(self, *args, **kwargs):
                return inplace.method(self, name, args, kwargs)
        else:
            def method(self, *args, **kwargs):
                hook = METHOD_HOOKS.get(name)
                if hook is not None:
                    out = hook(self, args, kwargs)
                    if out is not NotImplemented:
                        return out
                return dispatch(f, (self,) + args, kwargs)
        method.__name__ = method.__qualname__ = name
        return method

    def __getattr__(self, name):
        m = method_of(name)
        if m is None:
            raise AttributeError(f"'DistTensor' object has no attribute {name!r}")
        # kept on the class: the next ``d.name`` finds it there, without this lookup and
        # a new closure per call (the method reads METHOD_HOOKS at each call, as before)
        setattr(cls, name, m)
        return m.__get__(self, cls)
    cls.__getattr__ = __getattr__
    cls.T = property(lambda self: dispatch(T.permute, (self, tuple(reversed(range(self.ndim)))),
                                           None))
    cls.mT = property(lambda self: dispatch(T.transpose, (self, -2, -1), None))
    cls.H = property(lambda self: _adjoint(self, "H"))
    # torch's ``z.real`` / ``z.imag``: views (ops_table/complex.py); ``z.real = v`` writes v
    # into them, as torch's setter copies into its view
    cls.real = property(lambda self: dispatch(torch.real, (self,), None),
                        lambda self, v: _write_part(self, "real", v))
    cls.imag = property(lambda self: dispatch(torch.imag, (self,), None),
                        lambda self, v: _write_part(self, "imag", v))
    cls.mH = property(lambda self: _adjoint(self, "mH"))


def _adjoint(d, name):
    """``d.H`` / ``d.mH`` (the conjugate transpose; ``parametrizations.spectral_norm``'s
    power iteration reads ``W.H``: habits12, an AttributeError on a tensor-parallel
    weight): torch's own checks and warnings on a meta tensor of the global shape (H: 0-d
    or 2-d only; mH: 0-d or >= 2-d), then the transpose of the last two dims, conjugated
    where complex."""
    getattr(torch.empty(tuple(d.shape), dtype=d.dtype, device="meta"), name)
    out = d if d.ndim == 0 else d.transpose(-2, -1)
    return out.conj() if d.dtype.is_complex else out


def _write_part(d, name, value):
    """``d.real = value`` / ``d.imag = value``: torch's setter, ``copy_`` into the view."""
    getattr(d, name).copy_(value)
