"""A wrapped parameter read into a plain tensor of the module's shape: its module's value.

An EMA of the weights keeps plain tensors of the module's shapes and folds the training
model into them in place: ``torch.optim.swa_utils.AveragedModel.update_parameters(model)``
(``p_ema.copy_(p)`` first, then ``torch._foreach_lerp_(ema, params, 1 - decay)``), timm's
``ModelEmaV2`` (``ema.mul_(d).add_(p, alpha=1 - d)``), a hand-written ``ema.lerp_(p, w)``.
On one device, and over torch's DDP (whose ``parameters()`` are the module's), ``p`` is
the module's parameter.  Here DDP's rows ``(N, *shape)`` and FSDP's chunks ``(N, chunk)``
met the EMA's ``shape`` and failed with torch's broadcasting error ("output with shape
[8, 6] doesn't match the broadcast shape [4, 8, 6]").  An in-place op on a tensor that is
not laid out (the EMA's), given a laid-out parameter (or its ``.data`` / ``detach()``) of
storage shape other than the module's whose module shape is the target's, reads it as the
module's value (``_wb_full``: DDP's rank ``broadcast_from`` row, FSDP's chunks gathered,
the padding dropped; on torch.distributed a gather every process joins, as the same
update runs on each).  Elementwise on the module's tensor, as on one device.
"""
from __future__ import annotations

import torch

__all__ = ["module_shaped_sources"]


def _source(a, like, laid_out):
    """``a`` as the module's value where it is a laid-out storage of ``like``'s shape."""
    full = getattr(a, "_wb_full", None)
    if not isinstance(a, laid_out) or full is None or not isinstance(like, torch.Tensor) or \
            isinstance(like, laid_out) or tuple(like.shape) != getattr(a, "_wb_shape", None):
        return a
    with torch._C.DisableTorchFunctionSubclass():
        if tuple(a.shape) == a._wb_shape:
            return a
        return full(a)


def module_shaped_sources(func, args, kwargs, laid_out):
    """``(args, kwargs)`` of ``func`` with each laid-out source read as the module's value
    where ``func`` writes a plain target in place (module docstring); else as given."""
    name = getattr(func, "__name__", "")
    if not args or not name.endswith("_"):
        return args, kwargs
    target = args[0]
    if name.startswith("_foreach_"):        # lists: element i of each list meets target[i]
        if not isinstance(target, (list, tuple)):
            return args, kwargs
        out = [target]
        for a in args[1:]:
            if isinstance(a, (list, tuple)) and len(a) == len(target):
                a = [_source(x, t, laid_out) for x, t in zip(a, target)]
            out.append(a)
        return tuple(out), kwargs
    if name.startswith("_") or not isinstance(target, torch.Tensor) or \
            isinstance(target, laid_out):
        return args, kwargs
    args = (target,) + tuple(_source(a, target, laid_out) for a in args[1:])
    kwargs = {k: _source(v, target, laid_out) for k, v in kwargs.items()}
    return args, kwargs
