"""A view or a detached copy of a wrapped parameter: one device's reads, or an error.

A wrapped parameter's storage is not the module's tensor on simulated ranks
(``DistributedDataParallel``: one row per rank, ``(N, *shape)``; ``FullyShardedDataParallel``
/ ``fully_shard``: flat padded chunks, ``(N, chunk)``, :mod:`.laid_out`), and its views are
views of that storage (:class:`.laid_out._LaidOutView`).  The parameter's own reductions
read the module's value (:mod:`.laid_out_whole`); a view's read the storage's elements,
silently (habits13, measured on ``Sequential(Linear(4, 8), ReLU, Linear(8, 2))`` over 4 DDP
ranks: ``p.T.sum()`` -3.1153 for -0.7788, ``p[0].norm()`` 1.5614 for 0.6138; over FSDP's
chunks ``p[0].norm()`` 0.7675, chunk 0's).  A user's own views are now taken of the
module's value (:mod:`.laid_out_shape`); a view of the storage (the wrappers' own, e.g.
DDP's per-rank rows, or one taken inside torch's code) is no view of the module's tensor
(``p[0]`` of the storage is rank 0's row or chunk), so, where a user's code reads one:

* a reduction (:data:`.laid_out_whole.WHOLE`: ``sum``, ``norm``, ``max``, ``numel``...) of
  such a view, or of a value computed from it alone elementwise (``p.transpose(0, 1)
  .abs().max()``: :class:`StorageRead`), raises naming the fix (reduce ``p`` itself, or
  take the view of ``p.full_tensor()``, a copy in the module's shape).  The one view that
  is the module's, ``p.view(-1)`` (:func:`.laid_out_whole.module_flat_view`), and its
  views read as on one device (``_wb_module_view``);
* ``requires_grad_()`` of a detached alias, copy or storage view of such a parameter
  (``p.detach().requires_grad_()``, a hand-made "functional copy" for ``torch.func`` or an
  EMA) raises: on one device it is a leaf of the module's shape with its own gradient,
  here a leaf of the storage's whose gradient reads the storage's (a DDP row per rank, or
  the padded chunks), and ``torch.autograd.grad`` over such a leaf, or
  ``loss.backward(inputs=[leaf])``, gave None: the leaf was handed to autograd as a
  fresh alias (``Tensor.as_subclass``) no loss went through.  Now an autograd input keeps
  its identity (:func:`gradient_edges`: ``torch.autograd.graph.get_gradient_edge``, the
  same node), so a view that is an autograd input (``torch.autograd.grad(loss, p[0])``)
  gets its gradient, as torch's.
"""
from __future__ import annotations

import os
import sys

import torch
from torch.autograd.graph import get_gradient_edge

from .laid_out_reads import _is_pointwise, _CASTS
from .laid_out_whole import WHOLE, storage_shape

__all__ = ["StorageRead", "storage_view", "refuse_storage_read", "refuse_storage_leaf",
           "read_value", "gradient_edges", "mark_module_view"]

_T = torch.Tensor
_TORCH = os.path.dirname(torch.__file__) + os.sep
_WORKBENCH = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_OVERRIDES = _TORCH + "overrides.py"
# torch's helpers a user calls to read a tensor (torch.nn.utils.parameters_to_vector's
# p.view(-1) of a user's p.grad, torch.testing.assert_close's shape): the user's reads
_USERS_TORCH = (_TORCH + os.path.join("nn", "utils", "convert_parameters.py"),
                _TORCH + "testing" + os.sep)
_MODELS = _WORKBENCH + "models" + os.sep      # the course's models: a user's code
# workbench's thin wrappers in torch's place (torch.nn.utils.get_total_norm /
# clip_grad_norm_...: torch's own function for plain tensors), read as torch's frames
_PASS = (_WORKBENCH + os.path.join("parallel", "clip_grad_torch.py"),)
_REQUIRES_GRAD = {_T.requires_grad_, _T.requires_grad.__set__}


def _laid_out(p) -> bool:
    """Is ``p`` (a parameter, or its alias) stored otherwise than its module's shape, its
    module value readable (held here, or gathered)?"""
    return getattr(p, "_wb_full", None) is not None and \
        (getattr(p, "_wb_here", False) or getattr(p, "_wb_gathers", False)) and \
        storage_shape(p) != getattr(p, "_wb_shape", None)


def users_call(direct: bool = False, depth: int = 0) -> bool:
    """Is the call being served a user's (the first frame outside torch and this package's
    ``laid_out*`` modules is not the wrappers' own code; ``direct``: the caller of the torch
    function itself is neither torch's code nor the wrappers')?  The
    wrappers read their storage's views on purpose (a rank's chunk gathered, a row's bytes
    counted); a user's read of one is what the rules here are for.  ``depth``: frames
    between the caller's ``__torch_function__`` and this one, beyond the one reader."""
    if direct:      # users_call <- laid_out_shape's reader <- __torch_function__ <- caller
        f = sys._getframe(3 + depth)
        # len(p), for row in p: torch's Tensor.__len__ (through handle_torch_function) /
        # __iter__ stand between the user and the call
        while f is not None and (f.f_code.co_filename == _OVERRIDES or
                                 f.f_code.co_filename.startswith(_USERS_TORCH) or (
                f.f_code.co_name in ("__iter__", "__len__") and
                f.f_code.co_filename.startswith(_TORCH))):
            f = f.f_back
        if f is None:
            return False
        name = f.f_code.co_filename
        return not name.startswith(_TORCH) and (
            not name.startswith(_WORKBENCH) or name.startswith(_MODELS))
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not os.path.basename(name).startswith("laid_out") and \
                not name.startswith(_TORCH) and name not in _PASS:
            return not name.startswith(_WORKBENCH) or name.startswith(_MODELS)
        f = f.f_back
    return True


def storage_view(t, views) -> bool:
    """Is ``t`` a view (of class ``views``) of such a parameter's storage, not the module's
    flat view (``p.view(-1)``) or a view of it?"""
    return isinstance(t, views) and not getattr(t, "_wb_module_view", False) and \
        _laid_out(getattr(t, "_wb_param", None))


def mark_module_view(view) -> None:
    """``view`` is the module's flat view of its parameter (``p.view(-1)``)."""
    view._wb_module_view = True


class StorageRead(torch.Tensor):
    """A value computed elementwise from a storage view of a wrapped parameter alone
    (``p.T.abs()``, ``p[0] * 2``): its reductions raise as the view's (module docstring);
    every other result is a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        refuse_storage_read(func, args, kwargs, ())
        if func in _AUTOGRAD_RUNS:
            args, kwargs = gradient_edges(func, args, kwargs, (StorageRead,))
            plain = lambda t: t.as_subclass(_T) if isinstance(t, StorageRead) else t  # noqa
            args = tuple(tuple(plain(t) for t in a) if isinstance(a, (tuple, list)) else
                         plain(a) for a in args)
            kwargs = {k: plain(v) for k, v in kwargs.items()}
            return func(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return read_value(func, args, kwargs, out, ())


def _reads_storage(t, views) -> bool:
    return isinstance(t, StorageRead) or storage_view(t, views)


def refuse_storage_read(func, args, kwargs, views) -> None:
    """Raise for a reduction (:data:`WHOLE`) of a storage view or a :class:`StorageRead`."""
    if func not in WHOLE:
        return
    flat = [x for a in (*args, *kwargs.values())
            for x in (a if isinstance(a, (list, tuple)) else (a,))]
    hit = next((t for t in flat if _reads_storage(t, views)), None)
    if hit is None or not users_call():
        return
    layout = getattr(hit, "_wb_layout", "the wrapper's layout")
    raise RuntimeError(
        f"{getattr(func, '__name__', func)}() of a view of a wrapped parameter (p[i], p.T, "
        f"p.transpose(...), p.narrow(...), or a value computed from one): the wrapper "
        f"stores the parameter otherwise than the module's shape ({layout}), so the view "
        "holds the storage's elements (a rank's row or chunk), not the module parameter's, "
        "and this read would not be one device's.  "
        "Reduce the parameter itself (p.sum(), p.norm(), p.amax(dim): the module's), or "
        "take the view of p.full_tensor() (the module's tensor, a copy)")


def read_value(func, args, kwargs, out, views):
    """``out`` (``func``'s result) as a :class:`StorageRead` where ``func`` is elementwise
    and its tensor operands are storage reads or 0-d; else as it is."""
    if not isinstance(out, torch.Tensor) or isinstance(out, StorageRead) or \
            not (_is_pointwise(func) or func in _CASTS):
        return out
    flat = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    src = next((t for t in flat if _reads_storage(t, views)), None)
    if src is None or not all(_reads_storage(t, views) or t.dim() == 0 for t in flat) or \
            not users_call():
        return out
    with torch._C.DisableTorchFunctionSubclass():
        v = out.as_subclass(StorageRead)
    v._wb_layout = getattr(src, "_wb_layout", "laid out")
    return v


def refuse_storage_leaf(func, args, kwargs, aliases, views) -> None:
    """Raise for ``requires_grad_()`` (or ``requires_grad = True``) of a detached alias or
    copy (``aliases``) or a storage view of a laid-out parameter (module docstring)."""
    if func not in _REQUIRES_GRAD or not args:
        return
    t = args[0]
    flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    if not flag or t.requires_grad:
        return
    if not (isinstance(t, aliases) and _laid_out(t)) and not storage_view(t, views) or \
            not users_call():
        return
    if _from_parametrize():
        # weight_norm(wrapped_layer) raised the message below (habits9b), naming a copy
        raise RuntimeError(
            "a parametrization (torch.nn.utils.parametrizations.weight_norm / spectral_norm, "
            "register_parametrization) of a wrapped parameter: the wrapper stores it "
            f"otherwise than the module's shape ({getattr(t, '_wb_layout', 'laid out')}) "
            "and would not follow it.  Register the parametrization before wrapping (the "
            "wrapper then lays out its original and trains it as one device)")
    raise RuntimeError(
        "requires_grad_() of a detached alias, copy or view of a wrapped parameter "
        "(p.detach(), p.data, p.detach().clone(), p[i]): the wrapper stores the parameter "
        f"otherwise than the module's shape ({getattr(t, '_wb_layout', 'laid out')}), so "
        "this would be a leaf of that storage "
        "(every rank's row or the padded chunks) whose gradient reads the storage, not "
        "the module parameter's leaf one device gives.  For a leaf of the module's shape "
        "with its own gradient take p.full_tensor().requires_grad_() (a copy); to train "
        "the parameter itself use p (its gradient in p.grad)")


_PARAMETRIZE = os.path.join(_TORCH, "nn", "utils", "parametrize.py")


def _from_parametrize() -> bool:
    """Is ``torch.nn.utils.parametrize`` on the call stack (read only to word an error)?"""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename == _PARAMETRIZE:
            return True
        f = f.f_back
    return False


_AUTOGRAD_RUNS = (torch.autograd.backward, _T.backward, torch.autograd.grad)


def gradient_edges(func, args, kwargs, classes):
    """``(args, kwargs)`` of ``torch.autograd.grad`` / ``backward`` with each ``inputs``
    tensor of ``classes`` given as its gradient edge (the same autograd node: a fresh
    alias of a leaf, which the caller makes of its tensors, gets no gradient)."""
    def edges(v):
        if isinstance(v, torch.Tensor):
            if not isinstance(v, classes) or not v.requires_grad:
                return v
            with torch._C.DisableTorchFunctionSubclass():   # its view_as: no subclass alias
                return get_gradient_edge(v)
        if isinstance(v, (list, tuple)):
            return type(v)(edges(x) for x in v)
        return v
    if func is torch.autograd.grad:
        if len(args) > 1:
            args = (args[0], edges(args[1])) + tuple(args[2:])
        elif "inputs" in kwargs:
            kwargs = {**kwargs, "inputs": edges(kwargs["inputs"])}
        return args, kwargs
    # Tensor.backward(self, gradient, retain_graph, create_graph, inputs);
    # torch.autograd.backward(tensors, grad_tensors, retain_graph, create_graph,
    #                         grad_variables, inputs)
    pos = 4 if func is _T.backward else 5
    if kwargs.get("inputs") is not None:
        kwargs = {**kwargs, "inputs": edges(kwargs["inputs"])}
    elif len(args) > pos:
        args = tuple(args[:pos]) + (edges(args[pos]),) + tuple(args[pos + 1:])
    return args, kwargs
