"""Parameters whose storage is not the module's shape: in-place init refuses them.

On simulated ranks ``DistributedDataParallel`` stores each parameter as one row per rank
(shape ``(N, *shape)``) and ``FullyShardedDataParallel`` as flat padded chunks (``(N,
chunk)``, or ``(chunk,)`` per process).  ``torch.nn.init`` after wrapping would read that
storage as the parameter: each rank's replica filled from its own draw (the replicas no
longer equal), a fan-in (``kaiming_*``, ``xavier_*``, ``nn.Linear.reset_parameters``)
read from the rows' or the chunk's shape.  One device's result would need one draw of
the full parameter, which the wrappers do at construction (DDP broadcasts rank 0's
values; FSDP cuts the module's values), so these parameters are a subclass of
``nn.Parameter`` whose ``__torch_function__`` raises on a random fill (the ``Tensor``
methods every ``torch.nn.init`` random init ends in: ``uniform_``, ``normal_``...; the
``nn.init`` functions torch lets a subclass override; ``torch.eye(out=...)``) and passes
every other function through unchanged (plain results, as ``nn.Parameter``'s).
``fill_`` / ``zero_`` / ``nn.init.constant_`` are elementwise and stay allowed.

Not caught: ``nn.init.orthogonal_`` (it draws into a fresh tensor and copies it in) and
``nn.init.dirac_`` (indexing): initialize before wrapping.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import init

__all__ = ["LaidOutParameter", "laid_out"]

_T = torch.Tensor
_GUARDED = {_T.uniform_, _T.normal_, _T.bernoulli_, _T.exponential_, _T.cauchy_,
            _T.log_normal_, _T.geometric_, _T.random_, init.uniform_, init.normal_,
            init.kaiming_uniform_}


class LaidOutParameter(nn.Parameter):
    """An ``nn.Parameter`` laid out by a wrapper (module docstring); ``_wb_layout``
    says how, for the error."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = None
        if func in _GUARDED:            # nn.init's overrides pass the tensor by keyword
            target = args[0] if args else kwargs.get("tensor")
        elif func is torch.eye:
            target = kwargs.get("out")
        if isinstance(target, LaidOutParameter):
            raise RuntimeError(
                f"in-place init of a parameter after wrapping: {target._wb_layout}, so "
                f"{getattr(func, '__name__', func)} would not give one device's values (each "
                "rank's copy its own draw, a fan-in read from that shape).  Initialize the "
                "module before wrapping it (the wrapper starts every rank from its values), "
                "or load full tensors with the wrapper's load_state_dict")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def laid_out(t: torch.Tensor, requires_grad: bool, layout: str) -> LaidOutParameter:
    """``t`` as a :class:`LaidOutParameter` (``layout``: how it is stored, for errors)."""
    p = LaidOutParameter(t, requires_grad=requires_grad)
    p._wb_layout = layout
    return p
