"""A user's ``p.shape``, ``p.size()``, ``len(p)`` and views of a wrapped parameter: the module's.

``p.numel()``, ``p.dim()`` and the reductions of a wrapped parameter read the module's
value (:mod:`.laid_out_whole`), while ``p.shape`` / ``p.size()`` / ``len(p)`` / ``p[i]`` /
``p.T`` were the storage's (simulated DDP's rows ``(N, *shape)``, FSDP's padded chunks
``(N, chunk)``): ``p.dim() != len(p.shape)``, a fan-in read as ``p.shape[1]`` was the rows'
(8 for 4), ``p[0]`` was rank 0's row or chunk and ``p.T.sum()`` summed every rank's row
(habits13, measured on ``Linear(4, 8)`` over 4 DDP ranks: -3.1153 for -0.7788).  torch's
DDP keeps the module's parameter; FSDP2's is a DTensor whose ``shape`` is the global one
and whose views are views of the whole (torch 2.13 ``torch/distributed/tensor/_api.py``).

Here a user's own call (:func:`.laid_out_views.users_call` with ``direct``: the caller is
neither torch's code nor the wrappers', whose storage reads stay the storage's: their
optimizers, hooks and collectives read that shape) on a parameter stored otherwise than its
module's shape (or on its ``.data`` / ``detach()`` alias, or a copy that keeps its layout)
answers the module's:

* ``p.shape`` / ``p.size()`` / ``p.size(d)`` / ``len(p)``: the module's shape; so is a
  simulated DDP / FSDP gradient's (``p.grad.shape``, ``p.grad.dim()``, ``p.grad[0]``:
  :mod:`.rank_grads`), as torch DDP's and FSDP2's ``p.grad`` are the parameter's shape;
* a view (:data:`VIEWS`: ``p[i]``, ``p.T``, ``p.transpose``, ``p.narrow``, ``p.unbind()``,
  ``p.view(8, 4)``...) and ``p.tolist()``: taken of the module's value, itself a view of
  the storage on simulated ranks (DDP: rank ``broadcast_from``'s row, whose writes reach
  every row as for ``p.view(-1)``; FSDP: the chunks' elements before the padding), so it
  reads and writes as one device's view.  Where that value is no view of the storage
  (``fully_shard`` under torch.distributed, whose whole is gathered; a storage that is not
  contiguous) the view raises naming ``p.full_tensor()`` (a copy).
"""
from __future__ import annotations

import torch

from .laid_out_replica_init import from_init
from .laid_out_views import users_call
from .laid_out_whole import storage_shape

__all__ = ["VIEWS", "module_shape_read", "module_view", "module_ndim"]

_T = torch.Tensor
_SHAPE = _T.shape.__get__       # compared with ==: a fresh method-wrapper each time
_PROPS = tuple(getattr(_T, n).__get__ for n in ("T", "mT", "H", "mH"))
_NAMES = ("__getitem__", "transpose", "permute", "narrow", "select", "unbind", "split",
          "chunk", "tensor_split", "t", "view", "reshape", "flatten", "unflatten",
          "squeeze", "unsqueeze", "expand", "movedim", "moveaxis", "swapaxes", "swapdims",
          "diagonal", "unfold", "view_as", "expand_as", "ravel", "reshape_as", "tolist",
          "split_with_sizes", "hsplit", "vsplit", "adjoint")
VIEWS = {getattr(o, n) for n in _NAMES for o in (torch, _T) if hasattr(o, n)}


def _laid_out(t, classes) -> bool:
    return isinstance(t, classes) and getattr(t, "_wb_shape", None) is not None and \
        getattr(t, "_wb_full", None) is not None and \
        (getattr(t, "_wb_here", False) or getattr(t, "_wb_gathers", False)) and \
        storage_shape(t) != t._wb_shape


def _is(func, props) -> bool:
    return any(func == f for f in props)


def module_shape_read(func, args, classes):
    """``(True, answer)`` for a user's ``p.shape`` / ``p.size(...)`` / ``len(p)`` of a
    laid-out ``p`` (of ``classes``): the module's; else ``(False, None)``."""
    if not args or not (func == _SHAPE or func is _T.size or func is _T.__len__) or \
            not _laid_out(args[0], classes) or not (users_call(direct=True) or from_init(1)):
        return False, None     # (nn.init's fan reads: the module's too, habits12)
    shape = torch.Size(args[0]._wb_shape)
    if func is _T.__len__:
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return True, shape[0]
    if func is _T.size and (len(args) > 1):
        return True, shape[args[1]]
    return True, shape


_DIMS = (_T.dim, _T.ndimension)
_NDIM = _T.ndim.__get__


def module_ndim(func, args, classes):
    """A user's ``g.dim()`` / ``g.ndim`` of a laid-out ``g`` (of ``classes``: the simulated
    wrappers' gradients, whose ``numel()`` is already the module's): the module's, or
    None.  (The parameters' answer to every caller: :func:`.laid_out_whole.module_dims`.)"""
    if not args or not (func in _DIMS or func == _NDIM) or not _laid_out(args[0], classes) \
            or not users_call(direct=True):
        return None
    return len(args[0]._wb_shape)


def module_view(func, args, kwargs, classes):
    """``(True, out)``: a user's view (:data:`VIEWS`) of a laid-out ``p`` (of ``classes``)
    taken of its module value (a view of the storage; ``out``'s tensors the caller guards
    as views of ``p``), or an error where there is no such view; else ``(False, None)``."""
    if not args or not (func in VIEWS or _is(func, _PROPS)) or \
            not _laid_out(args[0], classes) or not users_call(direct=True):
        return False, None
    p = args[0]
    name = getattr(func, "__name__", None) or "a view"
    if not getattr(p, "_wb_here", False):
        raise NotImplementedError(
            f"{name} of a fully_shard parameter (under torch.distributed, or over tensor "
            "parallelism; FullyShardedDataParallel's and Zero3's over tensor parallelism too): "
            f"{p._wb_layout}, its storage a chunk, so it is no view of the whole "
            "parameter (FSDP2's DTensor gives "
            "one).  Take it of p.full_tensor() (the whole parameter, a copy, gathered: every "
            "process calls it)")
    with torch._C.DisableTorchFunctionSubclass():
        full = p._wb_full(p)
        if full.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
            raise RuntimeError(
                f"{name} of a wrapped parameter whose storage is not contiguous "
                f"({p._wb_layout}): the module's tensor is a copy of it here, so this would "
                "be no view of the parameter.  Take it of p.full_tensor() (a copy), or "
                "write through p itself (p.copy_(t))")
        return True, func(full, *args[1:], **kwargs)
