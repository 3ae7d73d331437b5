"""A reshape of a wrapped parameter that had to copy: reads as torch's copy, refuses writes.

``fully_shard`` over tensor-parallel DistTensors keeps each parameter's flat chunks
dp-minor (:mod:`.fully_shard_tp`: storage ``(dp, tp, chunk)`` with strides ``(chunk,
dp * chunk, 1)``), a storage that is not contiguous.  There ``p.flatten()``,
``p.reshape(-1)``, ``p.ravel()``, ``p.contiguous()`` copy, as torch's do for any
non-contiguous tensor (torch 2.13: ``w.t().flatten().normal_()`` leaves ``w`` as it was),
so ``p.flatten().normal_(0, 0.02)`` or ``p.reshape(-1).zero_()`` wrote a copy and left the
parameter as it was, silently.  On one device the module's parameter is contiguous and
the same calls are views that write it, so the copy differs from one device where torch's
own rule does not: the user did not make ``p`` non-contiguous, the wrapper did.  Such a
copy is a :class:`LaidOutCopy`: it reads as the copy it is (every out-of-place result a
plain tensor, autograd attached as torch's), and an in-place write into it or into a view
of it (``normal_``, ``zero_``, ``mul_``, ``copy_``, ``nn.init.*_``, ``t[i] = v``...)
raises naming the fix: write through ``p`` itself (``p.zero_()``, ``p.copy_(t)``,
``nn.init.normal_(p)``: one device's draw) or initialize the module before wrapping.
A copy of a contiguous storage's view (``p.T.flatten()`` over FSDP's contiguous chunks)
copies on one device too and stays a plain tensor.
"""
from __future__ import annotations

import torch

__all__ = ["LaidOutCopy", "guard_copy", "in_place"]

_T = torch.Tensor
# the functions that give a view of a contiguous tensor and a copy of a non-contiguous one
RESHAPES = {_T.reshape, torch.reshape, _T.flatten, torch.flatten, _T.ravel, torch.ravel,
            _T.contiguous, _T.reshape_as}

_IOPS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__ipow__",
         "__imod__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}


def in_place(func) -> bool:
    """Does ``func`` write its first argument (torch's trailing-underscore rule, ``+=``)?"""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("_")) or name in _IOPS


class LaidOutCopy(torch.Tensor):
    """The copy a reshape of a non-contiguous wrapped parameter gave (module docstring);
    ``_wb_layout``: the parameter's layout and ``_wb_call``: the call that copied, for the
    error."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _AUTOGRAD_RUNS:      # backward / grad: plain tensors, the same graph
            plain = lambda t: t.as_subclass(torch.Tensor) if isinstance(t, LaidOutCopy) \
                else t      # noqa: E731
            args = tuple(tuple(plain(t) for t in a) if isinstance(a, (tuple, list)) else
                         plain(a) for a in args)
            kwargs = {k: plain(v) for k, v in kwargs.items()}
            return func(*args, **kwargs)
        target = args[0] if args else kwargs.get("tensor")
        if isinstance(target, LaidOutCopy) and (in_place(func) or func is _T.__setitem__):
            raise RuntimeError(
                f"{getattr(func, '__name__', func)} into a copy of a wrapped parameter: "
                f"{target._wb_layout}, a storage that is not contiguous, so {target._wb_call} "
                "copied it (on one device the parameter is contiguous and this is a view "
                "that writes it) and the write would not reach the parameter.  Write "
                "through the parameter itself (p.zero_(), p.mul_(s), p.copy_(t), "
                "nn.init.normal_(p): one device's draw) or initialize the module before "
                "wrapping it")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        src = args[0] if args and isinstance(args[0], LaidOutCopy) else None
        return out if src is None else _keep(src, out)


_AUTOGRAD_RUNS = (torch.autograd.backward, _T.backward, torch.autograd.grad)


def map_sharers(src, out, skip, wrap):
    """``out`` (an op's result on ``src``; also a tuple or list of tensors: ``p.unbind()``,
    ``p.chunk(n)``, ``p.split(k)``) with ``wrap(t, shares)`` applied to each tensor that is
    not ``src``, not empty and not already a ``skip`` class; ``shares``: whether ``t`` is a
    view of ``src``'s storage.  Anything else as it is."""
    if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        got = [map_sharers(src, o, skip, wrap) for o in out]
        return type(out)(got) if type(out) in (tuple, list) else out
    if not isinstance(out, torch.Tensor) or out is src or isinstance(out, skip):
        return out
    with torch._C.DisableTorchFunctionSubclass():
        # the storage's numel: a subclass's numel() would be a user's read (laid_out_whole)
        if out.numel() == 0:
            return out
        shares = out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
    return wrap(out, shares)


def _keep(src, out):
    """``out`` with each tensor sharing ``src``'s storage (a view of the copy) a
    :class:`LaidOutCopy` too; anything else as it is."""
    def wrap(t, shares):
        if not shares:
            return t
        with torch._C.DisableTorchFunctionSubclass():
            view = t.as_subclass(LaidOutCopy)
        view._wb_layout, view._wb_call = src._wb_layout, src._wb_call
        return view
    return map_sharers(src, out, LaidOutCopy, wrap)


def guard_copy(src, owner, func, out):
    """``out``, the result of ``func`` (a reshape) on ``src`` (a wrapped parameter, its
    ``.data`` alias or a view of it) that does not share its storage: a
    :class:`LaidOutCopy` where the parameter ``owner``'s storage is not contiguous, else
    ``out`` as it is (None: not such a copy)."""
    if func not in RESHAPES or not isinstance(out, torch.Tensor) or out.numel() == 0:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        if owner.is_contiguous():
            return None
        copy = out.as_subclass(LaidOutCopy)
    copy._wb_layout = src._wb_layout
    copy._wb_call = f"{getattr(func, '__name__', func)}()"
    return copy
