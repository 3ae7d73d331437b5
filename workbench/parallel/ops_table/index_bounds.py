"""The bounds of an index whose values are not known before it runs, checked where they are.

Eager ``x[i]`` with a plain index checks it before anything runs (torch's own indexing on
a stand-in of x's shape, ``indexing.py``).  An index a program computes inside
``wb.compile`` (a meta tensor at capture: no values) or a DistTensor index is checked
here when it runs, as torch's index kernel checks it (``index_kernel`` /
``cpu_index_kernel`` in aten/src/ATen/native/cpu/IndexKernel.cpp, 2.13)::

    for each element, in order:  for each index tensor j:
        TORCH_CHECK_INDEX(idx >= -size && idx < size,
                          "index ", idx, " is out of bounds for dimension ", j, " with size ", size)

(``j`` counts the index tensors, not x's dims: ``x[:, i]`` names "dimension 0"), then
wraps a negative index as ``idx + size``.  One op, :func:`wrap_indices`, takes the index
tensors broadcast together and stacked on a last dim, so that the first element out of
bounds is the one torch names.

    wrap_indices(s, sizes)     s replicated (checked in torch's order on every rank) -> R
"""
from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function

from ..placement import Replicate
from . import costs
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["wrap_indices", "first_out_of_bounds"]


def first_out_of_bounds(s: torch.Tensor, sizes) -> str | None:
    """torch's IndexError message for the first element of ``s`` (..., k) out of bounds
    (row-major, then the k index tensors), or None when every one is in bounds."""
    if s.numel() == 0:
        return None
    n = torch.tensor(tuple(sizes), dtype=torch.long)
    bad = (s < -n) | (s >= n)
    if not bool(bad.any()):
        return None
    flat = bad.reshape(-1)
    at = int(flat.nonzero()[0])
    j = at % len(sizes)
    v = int(s.reshape(-1)[at])
    return f"index {v} is out of bounds for dimension {j} with size {sizes[j]}"


def wrap_indices(s, sizes):
    """``s`` (..., k): k integer index tensors broadcast together and stacked on the last
    dim, for dims of ``sizes`` (k ints); returns them as int64 with a negative index
    wrapped (``i + size``); raises torch's IndexError for the first one out of bounds
    (module docstring).  On a meta tensor (no values) nothing is checked."""
    if has_torch_function((s,)):
        return handle_torch_function(wrap_indices, (s,), s, sizes)
    sizes = tuple(int(n) for n in sizes)
    if s.device.type != "meta":
        msg = first_out_of_bounds(s, sizes)
        if msg is not None:
            raise IndexError(msg)
    n = torch.tensor(sizes, dtype=torch.long, device=s.device)
    return torch.where(s < 0, s + n, s).long()


def _parse(s, sizes):
    if s.dtype.is_floating_point or s.dtype.is_complex or s.dtype == torch.bool:
        raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    if s.ndim < 1 or s.shape[-1] != len(sizes):
        raise ValueError(f"wrap_indices(s of shape {tuple(s.shape)}, sizes={sizes!r}): "
                         "give the index tensors stacked on the last dim, one size each")
    return (s,), {"sizes": tuple(int(n) for n in sizes)}


def _rule(s, *, sizes, **_):
    """Replicated: every rank checks the whole index in torch's order (an index is small;
    the op that reads it, index_select, wants it replicated anyway)."""
    R = Replicate()
    return combine(s.mesh.ndim, [[((R,), (R,), "replicated: checked in torch's order")]]
                   * s.mesh.ndim, 1)


def _local(nd, ctx, s, sizes):
    msg = first_out_of_bounds(s[(0,) * nd], sizes)      # replicated: one copy checked
    if msg is not None:
        raise IndexError(msg)
    n = torch.tensor(sizes, dtype=torch.long)
    return torch.where(s < 0, s + n, s).long()


register("wrap_indices", [wrap_indices], parse=_parse, rule=_rule, local=_local,
         cost=costs.elementwise(2), op_class="elementwise",      # a compare and an add
         sample=lambda g: [Sample(wrap_indices, (torch.tensor([[0, -1], [2, 1], [-3, 0]]),
                                                 (3, 2)))])
