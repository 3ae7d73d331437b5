"""PyTorch as the judge of shapes, dtypes and errors: the first call of an op on a new
layout runs the real torch callable on meta tensors of the GLOBAL shapes. Its errors are
PyTorch's own (a bad dim, mismatched shapes, an integer mean...) and its output shapes
and dtypes (type promotion included) must be the ones the op table's local
implementation gives, or the table has a bug (raised, never a silent wrong result).

A meta kernel is a decomposition (``torch._refs``) and may raise where the eager kernel
does otherwise: ``log_softmax`` of a bool tensor raises "Subtraction ... with two bool
tensors" on meta, where eager returns an empty bool tensor for an empty input and raises
``NotImplementedError: "log_softmax_lastdim_kernel_impl" not implemented for 'Bool'``
otherwise.  Eager is what the user's program runs, so a meta error is checked again on
eager zeros of the same shapes (stride-0 views: no memory), and eager's answer stands."""
from __future__ import annotations

import torch

__all__ = ["torch_meta_outputs", "check_outputs", "on_meta"]


def _to_meta(x):
    from ..dist_tensor import DistTensor, TensorSpec
    if isinstance(x, (DistTensor, TensorSpec, torch.Tensor)):
        return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        return type(x)(_to_meta(y) for y in x)
    return x


def _to_zeros(x):
    """``x`` as eager zeros of its global shape, one stored element expanded (a fresh
    tensor: an in-place op writes no input of the user's)."""
    from ..dist_tensor import DistTensor, TensorSpec
    if isinstance(x, (DistTensor, TensorSpec, torch.Tensor)):
        dev = getattr(x, "device", None) if not isinstance(x, TensorSpec) else None
        return torch.zeros((), dtype=x.dtype, device=dev or "cpu").expand(tuple(x.shape))
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        return type(x)(_to_zeros(y) for y in x)
    return x


def on_meta(fn, args, kwargs=None):
    """``fn(*args, **kwargs)`` with every tensor (DistTensor, TensorSpec) as a meta tensor
    of its global shape.  A meta error is judged again by eager (module docstring):
    eager's error is raised, or eager's result returned where it succeeds; an eager error
    that only the expanded zeros cause (an in-place write into a stride-0 view) leaves
    the meta error standing."""
    kwargs = kwargs or {}
    try:
        return fn(*_to_meta(tuple(args)), **{k: _to_meta(v) for k, v in kwargs.items()})
    except Exception as meta_error:
        try:
            return fn(*_to_zeros(tuple(args)), **{k: _to_zeros(v) for k, v in kwargs.items()})
        except Exception as eager_error:
            if "single memory location" in str(eager_error):
                raise meta_error from None
            raise eager_error.with_traceback(None) from None


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    return []


def torch_meta_outputs(func, args, kwargs):
    """(shape, dtype) of every tensor ``func`` returns on meta inputs (torch's errors
    propagate unchanged; a meta error judged again by eager: :func:`on_meta`)."""
    out = on_meta(func, args, kwargs)
    return [(tuple(t.shape), t.dtype) for t in _flat(out)]


def check_outputs(name, ours, theirs):
    """Our (shape, dtype) per output against torch's."""
    if [tuple(s) for s, _ in ours] != [s for s, _ in theirs] or \
            [d for _, d in ours] != [d for _, d in theirs]:
        raise AssertionError(
            f"op table bug in {name!r}: the local implementation gives "
            f"{[(tuple(s), str(d)) for s, d in ours]} where torch gives "
            f"{[(s, str(d)) for s, d in theirs]}; please report it")
