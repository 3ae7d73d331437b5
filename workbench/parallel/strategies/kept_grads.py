"""What a wrapper gradient's alias or copy keeps (:data:`_KEPT`, :func:`kept_as`), and an
optimizer's states read as the gradients are (:class:`StateReads`): the module's values
where the user reads them."""
from __future__ import annotations

import sys

import torch

from .laid_out_grad_reads import _MODELS, _TORCH, _WORKBENCH
from .laid_out_whole import storage_shape


# the attributes a kept alias / copy carries (ShardGrad's: its group, how it gathers)
_KEPT = ("_wb_numel", "_wb_shape", "_wb_pg", "_wb_norm_skip", "_wb_full", "_wb_gathers",
         "_wb_layout", "_wb_param_full", "_wb_pshape", "_wb_axes", "_wb_synced", "_wb_hint",
         "_wb_refuse", "_wb_unsummed")


def kept_as(out, g):
    """``out`` (a tensor of ``g``'s storage shape) read as ``g`` is: ``g``'s subclass and
    read-back (:data:`_KEPT`), the same storage."""
    kept = out.as_subclass(type(g))
    for k in _KEPT:
        if k in g.__dict__:
            setattr(kept, k, g.__dict__[k])
    return kept


def _users_dict_read() -> bool:
    """Is the caller of a :class:`StateReads` method a user's own code (not torch's, not
    the wrappers'; one frame, read on every step of torch.optim)?"""
    name = sys._getframe(2).f_code.co_filename
    return not name.startswith(_TORCH) and (not name.startswith(_WORKBENCH) or
                                            name.startswith(_MODELS))


class StateReads(dict):
    """One parameter's ``torch.optim`` state (:func:`states_read_as_grads`): torch's and
    the wrappers' reads get the stored tensors, a user's own (:func:`_users_dict_read`)
    those of the storage's shape as its gradient's subclass (an alias read as the module's
    value, as ``p.grad`` is)."""

    def __init__(self, st, like):
        super().__init__(st)
        self._wb_like = like

    def _user(self, v):
        cls, kept, shape = self._wb_like
        if type(v) is not torch.Tensor or v.shape != shape:
            return v
        out = v.as_subclass(cls)
        for k, x in kept.items():
            setattr(out, k, x)
        return out

    def __getitem__(self, k):
        v = dict.__getitem__(self, k)
        return self._user(v) if _users_dict_read() else v

    def get(self, k, default=None):
        v = dict.get(self, k, default)
        return self._user(v) if _users_dict_read() else v

    def items(self):
        if not _users_dict_read():
            return dict.items(self)
        return [(k, self._user(v)) for k, v in dict.items(self)]

    def values(self):
        if not _users_dict_read():
            return dict.values(self)
        return [self._user(v) for v in dict.values(self)]

    def __reduce__(self):               # pickled / deep-copied as the plain dict it holds
        return dict, (dict(dict.items(self)),)


def _same_grad_layout(a, g) -> bool:
    """Is ``a`` a gradient (or a state kept as one) of ``g``'s class, storage shape and
    read-back (:data:`_KEPT`)?"""
    if type(a) is not type(g) or storage_shape(a) != storage_shape(g):
        return False
    for k in _KEPT:
        x, y = a.__dict__.get(k), g.__dict__.get(k)
        if x is not y and not (isinstance(x, (tuple, int, str)) and x == y):
            return False
    return True
