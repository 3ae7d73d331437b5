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


def _mesh_shape(objs):
    """The mesh shape of the first DistTensor among ``objs`` (None if there is none)."""
    for o in objs:
        mesh = getattr(o, "mesh", None)
        if mesh is not None and hasattr(o, "_local"):
            return tuple(mesh.shape)
    return None


def _varying_axes(t, mesh_shape):
    """The mesh axes along which ``t``, laid out as (*mesh, *local), really varies (a
    stride-0 or size-1 lead axis is a copy every rank holds whole); None if ``t`` has no
    such lead axes."""
    nd = len(mesh_shape)
    if t.dim() < nd or any(t.shape[i] not in (1, n) and t.stride(i) != 0
                           for i, n in enumerate(mesh_shape)):
        return None
    return frozenset(i for i, (n, s) in enumerate(zip(t.shape[:nd], t.stride()[:nd]))
                     if s != 0 and n > 1)


def _ranks_splitting(t, mesh_shape):
    """How many ranks split ``t``'s storage, if ``t`` is laid out as (*mesh, *local):
    the product of the lead axes that really vary (``_varying_axes``); None if ``t`` has
    no such lead axes."""
    axes = _varying_axes(t, mesh_shape)
    return None if axes is None else math.prod(mesh_shape[i] for i in axes)


def saved_activation_bytes(fn, *args, params=(), lead_dims: int = 0, mesh=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` and count what autograd saved for backward.

    Args:
        params: tensors (or DistTensors) whose storage is a model state, not an
            activation (the model's parameters).
        lead_dims: leading device axes of the stacked tensors (the mesh's ndim) when
            ``fn`` runs on DistTensors; 0 on one device.
        mesh: the mesh the DistTensors live on (default: the mesh of the first
            DistTensor among ``args`` and ``params``); with ``lead_dims`` it says which
            saved tensors are stacked (*mesh, *local) and which are one copy that every
            rank holds whole (a view without the lead axes, such as the column-parallel
            linear's shared input ``x.select(0, 0)``).

    A saved tensor is split over the lead axes of its own layout or, for a view, of its
    base's (the storage is the base's); one whose layout has no lead axes matching the
    mesh raises (its per-rank share cannot be told).

    Returns (fn's result, SavedReport)."""
    if lead_dims < 0:
        raise ValueError(f"saved_activation_bytes: lead_dims={lead_dims!r} must be >= 0 "
                         "(the mesh's ndim on the simulator, 0 on one device)")
    mesh_shape = None
    if lead_dims:
        mesh_shape = tuple(mesh.shape) if mesh is not None else \
            _mesh_shape([*args, *kwargs.values(), *params])
        if mesh_shape is None:
            raise ValueError("saved_activation_bytes: lead_dims=%d but no mesh: pass mesh= "
                             "(or a DistTensor among the arguments or params)" % lead_dims)
        if len(mesh_shape) != lead_dims:
            raise ValueError(f"saved_activation_bytes: lead_dims={lead_dims} but the mesh has "
                             f"shape {mesh_shape}: pass lead_dims={len(mesh_shape)}")
    skip = set()
    for p in params:
        loc = getattr(p, "_local", p)
        skip.add(loc.untyped_storage().data_ptr())
    seen = {}

    def per_rank(t, nbytes):
        if not lead_dims:
            return nbytes
        for cand in (t._base, t) if t._base is not None else (t,):
            ranks = _ranks_splitting(cand, mesh_shape)
            if ranks is not None:
                return nbytes // max(1, ranks)
        raise ValueError(
            f"saved_activation_bytes: a saved tensor of shape {tuple(t.shape)} (strides "
            f"{t.stride()}) has no lead axes matching the mesh {mesh_shape}, nor does its "
            "base: its bytes per rank cannot be told; count this function on one device "
            "(lead_dims=0) or one process per rank")

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in skip and ptr not in seen and st.nbytes() > 0:
                # the whole storage once (q, k, v views of one projection are one tensor);
                # per rank: split over the device axes that really vary (a stride-0 or
                # size-1 axis, or a view without the lead axes, is a copy every rank
                # holds whole)
                seen[ptr] = (per_rank(t, st.nbytes()), tuple(t.shape), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, SavedReport(list(seen.values()))
