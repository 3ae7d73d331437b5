"""PyTorch as the judge of shapes, dtypes and errors: the first call of an op on a new
layout runs the real torch callable on meta tensors of the GLOBAL shapes. Its errors are
PyTorch's own (a bad dim, mismatched shapes, an integer mean...) and its output shapes
and dtypes (type promotion included) must be the ones the op table's local
implementation gives, or the table has a bug (raised, never a silent wrong result)."""
from __future__ import annotations

import torch

__all__ = ["torch_meta_outputs", "check_outputs"]


def _to_meta(x):
    from ..dist_tensor import DistTensor
    if isinstance(x, (DistTensor, torch.Tensor)):
        return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        return type(x)(_to_meta(y) for y in x)
    return x


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    return []


def torch_meta_outputs(func, args, kwargs):
    """(shape, dtype) of every tensor ``func`` returns on meta inputs (torch's errors
    propagate unchanged)."""
    out = func(*_to_meta(tuple(args)), **{k: _to_meta(v) for k, v in kwargs.items()})
    return [(tuple(t.shape), t.dtype) for t in _flat(out)]


def check_outputs(name, ours, theirs):
    """Our (shape, dtype) per output against torch's."""
    if [tuple(s) for s, _ in ours] != [s for s, _ in theirs] or \
            [d for _, d in ours] != [d for _, d in theirs]:
        raise AssertionError(
            f"op table bug in {name!r}: the local implementation gives "
            f"{[(tuple(s), str(d)) for s, d in ours]} where torch gives "
            f"{[(s, str(d)) for s, d in theirs]}; please report it")
