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

An out-of-place pointwise op (aten's ``pointwise`` tag, torch 2.13
``aten/src/ATen/native/tags.yaml``: each output element reads only the same element of
each input) does the same with a result the user's own code computes: a custom
``AveragedModel(model, avg_fn=...)`` copies ``avg_fn(p_ema, p, n)`` into ``p_ema``, e.g.
torch's own ``get_ema_avg_fn``: ``decay * p_ema + (1 - decay) * p``, or ``get_swa_avg_fn``:
``p_ema + (p - p_ema) / (n + 1)`` (torch 2.13 ``torch/optim/swa_utils.py``).  Given a
plain tensor of the module's shape, a laid-out operand is read as its module value (the result is
one device's, of the module's shape); with a number (or a 0-d tensor) and otherwise only
the same storage, the result keeps the storage's layout (:class:`LaidOutValue`: every
rank's row or chunk of the value, read as the module's value by the next such op or
in-place read), so ``0.1 * p`` met with ``0.9 * p_ema`` is one device's sum.  Before,
``0.1 * p`` was a plain tensor of the storage's shape and the sum failed with torch's
broadcasting error (FSDP's chunks) or was the rows' shape, which ``copy_`` refused (DDP).
A unary op (``p.abs()``), a copy or a cast (``p.detach().clone()``, ``p.double()``) and an
op over storages of that one layout (``p - p0`` of such a copy) keep it too, so their
reductions read the module's values (:mod:`.laid_out_whole`; habits11: they were plain
storages, ``(p - p0).norm()`` and ``p.detach().clone().norm()`` 2x on 4 DDP ranks).
"""
from __future__ import annotations

import torch

__all__ = ["module_shaped_sources", "pointwise_reads", "LaidOutValue", "LIKES"]


class LaidOutValue(torch.Tensor):
    """A value computed pointwise from a laid-out parameter and numbers only (``0.9 * p``):
    stored as the parameter is (``_wb_full`` reads its module value), plain otherwise.
    Its ``__torch_function__`` is the parameters' (set by :mod:`.laid_out`)."""


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


_T = torch.Tensor
_CASTS = {_T.clone, torch.clone, _T.to, _T.float, _T.double, _T.half, _T.bfloat16}
# a user's own ``torch.zeros_like(p)`` (a hand-written optimizer's state: LAMB's moments,
# whose norms give its trust ratio): a tensor of p's storage, so its reductions read the
# storage (DDP: every rank's row, 2x the norm on 4 ranks, a LAMB step 0.036 off one
# device's, silently, habits7b): kept in p's layout as a copy is (the caller checks the
# call is the user's own, not torch.optim's states)
LIKES = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like}
_ATEN_NAMES = {"truediv": "div", "radd": "add", "rmul": "mul", "rtruediv": "div",
               "rpow": "pow"}
_POINTWISE: dict = {}


def _is_pointwise(func) -> bool:
    """Is ``func`` (``torch.mul``, ``Tensor.__rmul__``...) an out-of-place op whose aten op
    carries the ``pointwise`` tag?  In-place ones (``mul_``) are the other path's."""
    hit = _POINTWISE.get(func)
    if hit is None:
        name = getattr(func, "__name__", "")
        if name.startswith("__") and name.endswith("__"):
            name = name[2:-2]
            name = _ATEN_NAMES.get(name, name)
        op = None if name.startswith("_") or name.endswith("_") else \
            getattr(torch.ops.aten, name, None)
        hit = _POINTWISE[func] = op is not None and any(
            torch.Tag.pointwise in getattr(op, o).tags for o in op.overloads())
    return hit


def _layout_of(t, reads):
    """``t``'s read-back (``_wb_full``) where it is stored otherwise than its module shape."""
    full = getattr(t, "_wb_full", None)
    if not isinstance(t, reads) or full is None:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        return full if tuple(t.shape) != getattr(t, "_wb_shape", None) else None


def pointwise_reads(func, args, kwargs, reads):
    """``(args, kwargs, keep)`` for an out-of-place pointwise ``func`` (module docstring):
    laid-out operands read as module values where a plain operand has their module shape;
    ``keep`` the operand whose layout the result keeps where the others are numbers, 0-d
    tensors or of its very layout; else ``(args, kwargs, None)`` unchanged."""
    if not (_is_pointwise(func) or func in _CASTS):
        return args, kwargs, None
    flat = list(args) + list(kwargs.values())
    lays = [t for t in flat if isinstance(t, torch.Tensor) and _layout_of(t, reads)]
    if not lays:
        return args, kwargs, None
    like = next((t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, reads)
                 and t.dim() > 0 and any(tuple(t.shape) == a._wb_shape for a in lays)), None)
    if like is not None:        # a plain tensor of the module's shape: one device's op
        return (tuple(_source(a, like, reads) for a in args),
                {k: _source(v, like, reads) for k, v in kwargs.items()}, None)
    full = _layout_of(lays[0], reads)
    # numbers, 0-d tensors and storages of this very layout (a unary op: p.abs(); a copy or
    # cast: p.detach().clone(), p.double(); p - p0 of such a copy): the layout kept, so a
    # reduction of the result reads the module's values (laid_out_whole)
    same = all(not isinstance(t, torch.Tensor) or t.dim() == 0 or
               _layout_of(t, reads) == full and t.shape == lays[0].shape for t in flat)
    return args, kwargs, lays[0] if same else None


def keep_layout(out, src):
    """``out`` (a pointwise result of ``src``'s storage shape) as a :class:`LaidOutValue`
    read back as ``src`` is."""
    if not isinstance(out, torch.Tensor) or out is src or out.shape != src.shape:
        return out
    with torch._C.DisableTorchFunctionSubclass():
        v = out.as_subclass(LaidOutValue)
    v._wb_shape, v._wb_full = src._wb_shape, src._wb_full
    v._wb_layout = getattr(src, "_wb_layout", "laid out")
    v._wb_here = getattr(src, "_wb_here", False)
    v._wb_gathers = getattr(src, "_wb_gathers", False)
    return v
