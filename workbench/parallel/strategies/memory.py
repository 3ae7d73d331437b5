"""Counting activation memory: what autograd really saves for backward, per rank.

:func:`saved_activation_bytes` runs a forward under
``torch.autograd.graph.saved_tensors_hooks`` and adds up every tensor autograd
keeps for backward, the way a device would hold it: each storage once (views of
one tensor are not counted twice), parameters left out (they are model states),
and for the simulator's stacked tensors the bytes ONE rank holds (a stacked
tensor of shape (*mesh, *local) is ``numel(local)`` elements per rank; a
replicated copy, stored once, is still held whole by every rank).

This is what the course holds against Korthikanti et al. 2022, Table 2
(``workbench.sim_mesh.estimates.activation_bytes_per_layer``).
"""
from __future__ import annotations

import math

import torch

__all__ = ["saved_activation_bytes", "SavedReport"]


class SavedReport:
    """Per-rank bytes autograd saved, and the tensors behind them (plain data)."""

    def __init__(self, items):
        self.items = items            # (bytes per rank, shape, dtype) per distinct storage

    @property
    def bytes(self) -> int:
        return sum(b for b, _, _ in self.items)

    def by_dtype(self) -> dict:
        out: dict = {}
        for b, _, dt in self.items:
            out[str(dt)] = out.get(str(dt), 0) + b
        return out

    def __repr__(self) -> str:
        return f"SavedReport({self.bytes:,d} bytes per rank in {len(self.items)} tensors)"


def saved_activation_bytes(fn, *args, params=(), lead_dims: int = 0, **kwargs):
    """Run ``fn(*args, **kwargs)`` and count what autograd saved for backward.

    Args:
        params: tensors (or DistTensors) whose storage is a model state, not an
            activation (the model's parameters).
        lead_dims: leading device axes of the stacked tensors (the mesh's ndim) when
            ``fn`` runs on DistTensors; 0 on one device.

    Returns (fn's result, SavedReport)."""
    skip = set()
    for p in params:
        loc = getattr(p, "_local", p)
        skip.add(loc.untyped_storage().data_ptr())
    seen = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in skip and ptr not in seen and st.nbytes() > 0:
                # the whole storage once (q, k, v views of one projection are one tensor);
                # per rank: split over the device axes that really vary (a stride-0 or
                # size-1 axis is a replicated copy every rank holds whole)
                k = min(lead_dims, t.dim())
                ranks = math.prod(n for n, s in zip(t.shape[:k], t.stride()[:k]) if s != 0)
                seen[ptr] = (st.nbytes() // max(1, ranks), tuple(t.shape), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, SavedReport(list(seen.values()))
