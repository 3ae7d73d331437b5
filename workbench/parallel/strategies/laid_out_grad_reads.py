"""A user's own tensor met with a wrapped parameter's gradient: the gradient of the module's shape.

On simulated ranks ``p.grad`` of ``DistributedDataParallel`` is one row per rank (``(N,
*shape)``), of ``FullyShardedDataParallel`` / ``fully_shard`` every rank's flat chunk,
padded (``(N, chunk)``), over tensor parallelism the shards of every coordinate
(:mod:`.rank_grads`).  Its ``shape``, views and reductions already answer the module's
(habits11-15), but an op that met a tensor of the user's own ran on the storage (habits10,
measured on ``Linear(3, 6), GELU, Linear(6, 3)`` over 4 ranks against one device's
gradients): on DDP ``p.grad - g`` was ``(4, 6, 3)`` (torch broadcast ``g`` over the rows,
silently), so were ``p.grad == g``, ``torch.where(...)``, ``p.grad @ w`` and
``p.grad.numpy()``; ``parameters_to_vector([p.grad ...])`` held 180 elements for 45 (52 on
FSDP: the padding); on FSDP the same ops raised torch's "The size of tensor a (5) must
match the size of tensor b (3)", ``torch.zeros(6, 3).copy_(p.grad)`` too.  torch DDP's
``p.grad`` is the parameter's shape, FSDP2's a DTensor of it.

Here a user's own call (the caller is neither torch's code nor the wrappers', except
torch's helpers a user calls for such reads: ``torch/_tensor.py``'s Python methods,
``torch.testing``, ``nn.utils.parameters_to_vector``) reads each such gradient as its
module value (``_wb_full``: DDP's row, FSDP's chunks before the padding, over tensor
parallelism the shards gathered, a copy) where:

* the call meets another tensor that is plain (``torch.Tensor`` / ``nn.Parameter``, not
  0-d): arithmetic, comparisons, ``torch.where``, ``@``, ``torch.cat`` / ``stack``, an
  in-place op into the user's tensor (``ema.copy_(p.grad)``, ``acc.add_(p.grad)``);
* ``p.grad.numpy()`` / ``numpy.asarray(p.grad)``;
* ``p.grad.data = t`` of the module's shape (``vector_to_parameters(v, grads)``): written
  in as ``p.grad.copy_(t)`` below (it set nothing, or the storage's rows only, silently).

An in-place op *into* the gradient with such a tensor (``p.grad.add_(noise)``) is one
device's op written into every rank's row (DDP) or into the chunks' elements (FSDP, whose
module value is a view of them); over tensor parallelism (the module value a gathered
copy) it raises naming the fix, nothing written.  The optimizers', hooks' and wrappers'
own reads keep reading the storage.
"""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

from .laid_out_whole import storage_shape

__all__ = ["users_read", "module_value_read"]

_T = torch.Tensor
_TORCH = os.path.dirname(torch.__file__) + os.sep
_WORKBENCH = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_MODELS = _WORKBENCH + "models" + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# rank_grads and the modules split from it (its gradients' __torch_function__ and helpers)
_OWN = tuple(_HERE + f for f in ("rank_grads.py", "normed_grads.py", "kept_grads.py",
                                 "grad_norm_reads.py", "partial_norm.py"))
# torch's helpers that a user calls to read a tensor, read as the user's own call
_USERS_TORCH = (_TORCH + "overrides.py", _TORCH + "_tensor.py",
                _TORCH + os.path.join("nn", "utils", "convert_parameters.py"),
                _TORCH + "testing" + os.sep)
_ARRAYS = {_T.numpy, _T.__array__}
_DATA_SET = _T.data.__set__     # compared with ==: a fresh method-wrapper each time
_AUTOGRAD = {torch.autograd.backward, torch.autograd.grad, _T.backward}


def users_read() -> bool:
    """Is the torch function being served (from a gradient's ``__torch_function__``)
    called by a user's own code (module docstring)?"""
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename in _OWN or
                             os.path.basename(f.f_code.co_filename).startswith("laid_out")):
        f = f.f_back
    while f is not None and f.f_code.co_filename.startswith(_USERS_TORCH):
        f = f.f_back
    if f is None:
        return False
    name = f.f_code.co_filename
    return not name.startswith(_TORCH) and (not name.startswith(_WORKBENCH) or
                                            name.startswith(_MODELS))


def _laid_out(t, classes) -> bool:
    return isinstance(t, classes) and getattr(t, "_wb_full", None) is not None and \
        getattr(t, "_wb_shape", None) is not None and \
        storage_shape(t) != tuple(t._wb_shape)


def _plain(t) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and t.dim() > 0


def _flat(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _module_value(g):
    with torch._C.DisableTorchFunctionSubclass():
        return g._wb_full(g)


def _map(x, classes):
    if isinstance(x, (list, tuple)):
        return type(x)(_module_value(t) if _laid_out(t, classes) else t for t in x)
    return _module_value(x) if _laid_out(x, classes) else x


def module_value_read(func, args, kwargs, classes, what="the gradient"):
    """``(True, out)`` for a user's call (:func:`users_read`, checked first) that
    reads a laid-out gradient (of ``classes``; ``what``: the gradient, or DDP's parameter
    over tensor parallelism, whose storage is laid out alike) as its module value (module
    docstring); else ``(False, None)``."""
    if not args or not users_read():       # the wrappers' and torch.optim's: the storage
        return False, None
    kwargs = kwargs or {}
    if func == _DATA_SET and len(args) > 1 and _laid_out(args[0], classes) and \
            isinstance(args[1], torch.Tensor) and not _laid_out(args[1], classes) and \
            tuple(args[1].shape) == tuple(args[0]._wb_shape):
        # p.grad.data = t (vector_to_parameters over the gradients): written as copy_
        _write_into(_T.copy_, args[0], args, {}, classes, what)
        return True, None
    if getattr(func, "__name__", "") == "__set__" or func in _AUTOGRAD:
        return False, None     # p.grad = g, backward / autograd.grad: not reads of values
    flat = list(_flat(args, kwargs))
    if not any(_laid_out(t, classes) for t in flat):
        return False, None
    array = func in _ARRAYS and _laid_out(args[0], classes)
    if not array and not any(_plain(t) for t in flat):
        return False, None
    name = getattr(func, "__name__", "")
    target = args[0]
    if name.endswith("_") and not name.startswith("_") and _laid_out(target, classes):
        return True, _write_into(func, target, args, kwargs, classes, what)
    args = tuple(_map(a, classes) for a in args)
    kwargs = {k: _map(v, classes) for k, v in kwargs.items()}
    with torch._C.DisableTorchFunctionSubclass():
        return True, func(*args, **kwargs)


def _write_into(func, g, args, kwargs, classes, what):
    """``g.<op>_(t, ...)`` with ``t`` a user's tensor: one device's op on the module
    value, written where that value lives (module docstring)."""
    rest = tuple(_map(a, classes) for a in args[1:])
    kwargs = {k: _map(v, classes) for k, v in kwargs.items()}
    with torch._C.DisableTorchFunctionSubclass():
        value = g._wb_full(g)
        if type(g).__name__ == "RankRows":      # every row the one device's result
            out = func(value.clone(), *rest, **kwargs)
            g.copy_(out)
            return g
        if value.untyped_storage().data_ptr() == g.untyped_storage().data_ptr() and \
                type(g).__name__ == "ChunkRows":
            func(value, *rest, **kwargs)        # the chunks' elements, padding untouched
            return g
    if what != "the gradient":
        fix = "Write the new value whole with p.copy_(t) (t of the module's shape)"
    else:
        fix = ("Write with numbers (p.grad.mul_(c), p.grad.clamp_(-c, c)), or change the "
               "loss (its gradient follows), or compute a new tensor from "
               "p.grad.full_tensor()")
    raise RuntimeError(
        f"{getattr(func, '__name__', 'an in-place op')} into {what} of a parameter laid out "
        "over tensor parallelism with a tensor of the module's shape: its storage holds "
        f"shards, and the module's {tuple(g._wb_shape)} value is gathered from them (a "
        f"copy), so the write would not reach the storage the optimizer steps.  {fix}")


_GRAD_SET = _T.grad.__set__     # compared with ==


def grad_assignment(func, args, laid_out) -> bool:
    """A user's ``p.grad = g`` with ``g`` of the module's shape on a parameter of
    ``laid_out`` stored otherwise (a gradient set by hand: federated averaging, a
    gradient computed elsewhere).  torch refused it naming the storage's size ("attempting
    to assign a gradient of size '[6, 3]' to a tensor of size '[4, 6, 3]'", habits10).
    Here ``g`` is laid out as the parameter (``_wb_store``: every rank's row, or the
    chunks) and set as the wrapper's own gradient would be (DDP's rows, FSDP's chunks,
    over tensor parallelism the gathered-read gradient): True.  A parameter without a
    way to lay it out raises naming the fix; anything else is torch's (False)."""
    if not (func == _GRAD_SET) or len(args) < 2 or not isinstance(args[0], laid_out):
        return False
    p, g = args[0], args[1]
    if not isinstance(g, torch.Tensor) or isinstance(g, laid_out) or \
            type(g) not in (torch.Tensor, nn.Parameter) or not _laid_out(p, laid_out) or \
            tuple(g.shape) != tuple(p._wb_shape) or not users_read():
        return False
    store = getattr(p, "_wb_store", None)
    if store is None or not (getattr(p, "_wb_here", False) or
                             getattr(p, "_wb_gathers", None) == "users"):
        raise RuntimeError(
            f"p.grad = g with g of the module's shape {tuple(g.shape)} on a parameter "
            f"stored otherwise ({getattr(p, '_wb_layout', 'laid out by its wrapper')}), "
            "which this wrapper cannot lay g out into.  Compute the gradient through "
            "loss.backward() and change it in place (p.grad.mul_(c)), or set it before "
            "wrapping")
    from .rank_grads import as_chunk_rows, as_gathered_grad, as_rank_rows
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        laid = store(g.detach().to(p.dtype)).contiguous().clone()
    if getattr(p, "_wb_rows", None):
        laid = as_rank_rows(laid)
    elif getattr(p, "_wb_gathers", None) == "users":
        laid = as_gathered_grad(laid, p)
    else:
        laid = as_chunk_rows(laid, g.numel(), tuple(p._wb_shape))
    with torch._C.DisableTorchFunctionSubclass():
        _GRAD_SET(p, laid)
    return True
