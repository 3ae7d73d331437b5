"""Helpers every local implementation and parser shares."""
from __future__ import annotations

import torch

__all__ = ["wrap_dim", "wrap_dims", "shift", "align", "is_tensor", "check_number"]


def is_tensor(x) -> bool:
    """A torch tensor or a DistTensor."""
    from ..dist_tensor import DistTensor
    return isinstance(x, (torch.Tensor, DistTensor))


def wrap_dim(d, ndim: int) -> int:
    """``d`` in [-ndim, ndim) (a 0-d tensor takes -1 and 0) as a non-negative dim; an
    IndexError worded as PyTorch's otherwise (a dim never wraps silently)."""
    if isinstance(d, bool) or not isinstance(d, int):
        if isinstance(d, torch.Tensor) and d.dim() == 0 and not d.is_floating_point():
            d = int(d)
        else:
            raise TypeError(f"dim={d!r}: a dimension is an int")
    n = max(ndim, 1)
    if not -n <= d < n:
        raise IndexError(f"Dimension out of range (expected to be in range of "
                         f"[{-n}, {n - 1}], but got {d})")
    return d % n


def wrap_dims(dims, ndim: int) -> tuple:
    """A dim or a sequence of dims, wrapped; a dim given twice is an error (as torch)."""
    if isinstance(dims, (int, torch.Tensor)) and not isinstance(dims, bool):
        return (wrap_dim(dims, ndim),)
    out = tuple(wrap_dim(d, ndim) for d in dims)
    if len(set(out)) != len(out):
        raise RuntimeError(f"dim {sorted(d for d in out if out.count(d) > 1)[0]} appears "
                           "multiple times in the list of dims")
    return out


def check_number(op: str, name: str, value, allow_none=True):
    """A float-like argument (scale, eps...): a clear TypeError otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name}={value!r} must be a number"
                        + (" or None" if allow_none else "") + f", e.g. {name}=0.125")
    return float(value)


def shift(d, ndim_local, nd):
    """A non-negative user dim of a local tensor -> its dim in the stacked tensor."""
    if d is None:
        return None
    if isinstance(d, (tuple, list)):
        return tuple(shift(x, ndim_local, nd) for x in d)
    return (d % ndim_local) + nd if ndim_local else nd


def align(nd, *xs):
    """Insert size-1 dims after the lead so all local tensors have the same rank
    (broadcasting then lines up the local dims, not the device axes)."""
    if nd == 0:                    # plain tensors: broadcasting aligns them already
        return xs
    ts = [x for x in xs if isinstance(x, torch.Tensor)]
    if not ts:
        return xs
    target = max(t.dim() for t in ts)
    out = []
    for x in xs:                   # (a true 0-d tensor broadcasts as it is)
        if isinstance(x, torch.Tensor) and 0 < x.dim() < target:
            x = x.reshape(tuple(x.shape[:nd]) + (1,) * (target - x.dim()) + tuple(x.shape[nd:]))
        out.append(x)
    return out
