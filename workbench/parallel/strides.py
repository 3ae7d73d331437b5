"""A DistTensor's strides: ``d.stride()`` and ``d.is_contiguous()`` of the global tensor,
as ``torch.distributed.tensor.DTensor`` gives them (its strides are a property of the spec:
the global tensor's, those one device's tensor would have, not a shard's).

Here the shards are held in the storage's own forms (:mod:`.storage`: one stacked tensor,
each rank's shard a view of it, or one tensor per rank), so a shard's strides tell the
global tensor's dim order (a transpose shows as swapped strides) but not its spacing.
The global strides are the dense strides of the global shape in that order: a contiguous
tensor's for a contiguous layout, a transposed tensor's for a transposed one.  (A view
that skips elements, ``x[:, ::2]``, is dense here where one device's view is not: every
op here makes new shards.)  A dim a shard holds one element of is ambiguous in that order
(its stride says nothing): it is put inside the dims of equal stride, which gives the
contiguous and transposed layouts right where some shard holds more; a layout whose
shards all hold at most one element of a dim (of more than one) has lost that dim's place: torch's ops give a
size-1 dim any stride (``exp`` of a transposed (2, 1) shard reads (1, 1), a contiguous
one's), so that case raises rather than guess (:func:`_refuse_ambiguous`).
"""
from __future__ import annotations

import torch

from . import storage

__all__ = ["global_stride", "is_contiguous", "canonical_contiguous"]


def _shard(d) -> torch.Tensor | None:
    """A non-empty local shard of ``d`` (this process's on torch.distributed)."""
    if storage.holds_own(d.mesh):
        return d.local()
    return next((t for t in d.locals() if t.numel()), None)


def global_stride(d) -> tuple[int, ...]:
    """The global tensor's strides (module docstring)."""
    shape = list(d.shape)
    t = _shard(d)
    order = list(range(len(shape)))
    if t is not None:                   # outermost first; a tie: a size-1 dim inside
        order.sort(key=lambda i: (-t.stride(i), t.size(i) == 1, i))     # size 1: inner
        _refuse_ambiguous(d, t, shape)
    out, acc = [0] * len(shape), 1
    for i in reversed(order):
        out[i] = acc
        acc *= max(shape[i], 1)
    return tuple(out)


def _refuse_ambiguous(d, t, shape) -> None:
    """Raise where the shards cannot tell the order: every shard holds at most one element
    of a dim of more than one (its stride in a shard is arbitrary: torch's own ops give a
    size-1 dim any stride) while another dim of more than one element exists, so that the
    dim could sit anywhere among them (a transpose then reads as contiguous)."""
    big = [i for i, n in enumerate(shape) if n > 1]
    if len(big) < 2:
        return
    most = [max(s.size(i) for s in _shards(d)) for i in range(len(shape))]
    lost = [i for i in big if most[i] <= 1]
    if lost:
        i = lost[0]
        raise NotImplementedError(
            f"stride()/is_contiguous() of a DistTensor of shape {tuple(shape)} with "
            f"placements {tuple(d.placements)}: every shard holds at most one element of dim "
            f"{i} (size {shape[i]}), so the shards cannot tell that dim's place in the "
            f"layout; ask the global tensor instead (d.full_tensor().stride()), or "
            f"redistribute so that dim {i} is split into pieces of more than one element")


def _shards(d) -> list:
    """Every shard this process can see (its own on torch.distributed)."""
    if storage.holds_own(d.mesh):
        return [d.local()]
    return [s for s in d.locals() if s.numel()]


def is_contiguous(d, memory_format=torch.contiguous_format) -> bool:
    """torch's ``is_contiguous`` of a tensor of the global shape and strides."""
    meta = torch.empty_strided(tuple(d.shape), global_stride(d), device="meta")
    return meta.is_contiguous(memory_format=memory_format)


def canonical_contiguous(t, memory_format=torch.contiguous_format) -> torch.Tensor:
    """``t.contiguous()`` whose size-1 dims carry a contiguous tensor's strides too: torch
    counts a (6, 1) view of strides (1, 6) (a transposed shard) contiguous and returns it
    as it is, and the shard's strides would then still read as a transpose."""
    out = t.contiguous(memory_format=memory_format)
    if memory_format is not torch.contiguous_format:
        return out
    want = torch.empty(out.shape, device="meta").stride()
    if out.stride() == want:
        return out
    return out.as_strided(out.shape, want, out.storage_offset())
