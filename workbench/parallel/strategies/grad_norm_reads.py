"""How a wrapper gradient's norm is read: which calls are whole-tensor norms and their
arguments, one row's norm of DDP's rows (equal once averaged), one copy's of a replica's
storage, a user's read of the module's value, and the refusal a gradient held by
FSDP1's ``no_sync()`` carries."""
from __future__ import annotations

import torch


_NORMS = (torch.linalg.vector_norm, torch._foreach_norm, torch.norm, torch.Tensor.norm)


def _norm_args(func, args, kwargs):
    """(tensor or tensors, ord, dtype) of a whole-tensor norm call; None when the call
    names dims (a norm along dims reads the rows as the caller laid them out)."""
    kwargs = dict(kwargs or {})
    x = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.pop("ord", kwargs.pop("p", 2.0))
    if func is torch._foreach_norm:
        return x, ord_, kwargs.get("dtype")
    if len(args) > 2 or kwargs.get("dim") is not None or ord_ == "nuc":
        return None
    return x, (2.0 if ord_ in (None, "fro") else ord_), kwargs.get("dtype")


# what a gradient held by FullyShardedDataParallel.no_sync() still answers (fsdp_no_sync:
# its metadata, and the writes zero_grad makes)
_HELD_OK = frozenset({torch.Tensor.zero_, torch._foreach_zero_, torch.Tensor.size,
                      torch.Tensor.dim, torch.Tensor.requires_grad_, torch.Tensor.detach_})


def _refuse_held(func, first) -> None:
    """Raise the message a gradient of FSDP1's ``no_sync()`` carries (``_wb_held``: its unit
    holds each rank's unreduced gradients, so the shard's own reads 0 or the last step's)
    for any read of its values; attribute reads (``.shape``, ``._version``) pass."""
    items = first if isinstance(first, (list, tuple)) else (first,)
    for t in items:
        held = getattr(t, "_wb_held", None) if isinstance(t, torch.Tensor) else None
        # written since it was held (a zero_grad's zero_): the user's value, the held
        # gradients dropped at the next forward (fsdp_no_sync._drop_cleared)
        if held and getattr(func, "__name__", "") != "__get__" \
                and t._version == held[1]:
            raise RuntimeError(held[0])


_T = torch.Tensor


def _same_rows(t, what="a norm") -> None:
    with torch._C.DisableTorchFunctionSubclass():
        first = t[:1]
        same = (t == first) | (t.isnan() & first.isnan())     # a NaN is a NaN on every rank
        if not bool(same.all()):
            raise RuntimeError(
                f"{what} of a simulated DistributedDataParallel gradient whose ranks' rows "
                "differ (not averaged yet, e.g. inside no_sync()): on torch.distributed each "
                "rank would read its own gradient.  Read it after the backward that "
                "synchronizes (ddp.finish_gradient_synchronization() has run)")


def _row_norm(t, ord_, dtype):
    _same_rows(t)
    with torch._C.DisableTorchFunctionSubclass():
        return torch.linalg.vector_norm(t[0], ord_, dtype=dtype)


def _replica_norm(t, ord_, dtype):
    if getattr(t, "_wb_refuse", None):
        raise RuntimeError(t._wb_refuse)
    if not getattr(t, "_wb_synced", False):
        raise RuntimeError(getattr(t, "_wb_hint", None) or
                           "a norm of a replica's gradient before the replicas' gradients "
                           "are summed: call finish_gradient_synchronization() first")
    with torch._C.DisableTorchFunctionSubclass():
        for a in getattr(t, "_wb_axes", ()):
            t = t.narrow(a, 0, 1)
        return torch.linalg.vector_norm(t, ord_, dtype=dtype)


def _users_module_read(t, func, args, what: str):
    """``(True, answer)`` for a user's ``g.shape`` / ``g.size()`` / ``len(g)`` / ``g.dim()``
    of ``t`` (a gradient whose module value is gathered, a copy: ``_wb_shape``): the
    module's; a user's view of it raises naming ``g.full_tensor()``; else ``(False, None)``.
    Called from a subclass's ``__torch_function__`` (the user two frames up)."""
    from .laid_out_shape import VIEWS, _PROPS
    from .laid_out_views import users_call
    shape = torch.Size(t._wb_shape)
    if (func in (_T.dim, _T.ndimension) or func == _T.ndim.__get__) and users_call(True):
        return True, len(shape)
    if func == _T.shape.__get__ and users_call(True):
        return True, shape
    if func is _T.size and users_call(True):
        return True, (shape[args[1]] if len(args) > 1 else shape)
    if func is _T.__len__ and users_call(True):
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return True, shape[0]
    if (func in VIEWS or any(func == f for f in _PROPS)) and users_call(True):
        from .laid_out_replicas import _one_whole_replica
        whole = _one_whole_replica(t, shape)
        if whole is not None:                   # one whole replica: torch DDP's view
            with torch._C.DisableTorchFunctionSubclass():
                return True, func(whole, *args[1:])
        raise NotImplementedError(
            f"{getattr(func, '__name__', 'a view')} of the gradient of {what}: its storage "
            f"(shape {tuple(t.as_subclass(torch.Tensor).shape)}) holds shards, and the "
            f"module's {tuple(shape)} gradient is gathered from them, a copy, so no view of "
            "it exists here.  Take the view of the gathered copy, p.grad.full_tensor()")
    return False, None
