"""``clip_grad_norm_`` and ``clip_grad_value_`` that also take DistTensor parameters.

    loss.backward()
    norm = wb.clip_grad_norm_(model.parameters(), 1.0)    # a parallelized model's DistTensors

``torch.nn.utils.clip_grad_norm_`` groups the gradients with a C++ function that takes
only ``torch.Tensor`` s, so by itself it cannot read a DistTensor; :mod:`.clip_grad_torch`
routes torch's functions here when given DistTensors.  These functions take the same arguments (plain tensors too) and follow
torch's algorithm (torch 2.13, ``torch/nn/utils/clip_grad.py``): the norm of each
gradient, the norm of those norms, the gradients scaled in place by
``min(max_norm / (total + 1e-6), 1)``.

The norm of a DistTensor gradient is taken where its shards live, as FSDP2 does with
DTensor gradients (``torch._foreach_norm`` of DTensors gives per-shard norms placed
``_NormPartial``; torchtitan then takes ``.full_tensor()`` of the total): each rank
reduces its own shard to ``sum |g|^p`` (``max |g|`` for ``p = inf``), the shards along
each mesh dim the gradient is sharded on are combined (a scalar all-reduce, recorded in
the trace), and a replicated dim counts once.  No gradient is gathered.
"""
from __future__ import annotations

import math

import torch

from ..sim_mesh import backends as _B
from ..sim_mesh import collectives as C
from . import storage
from .dist_tensor import DistTensor

__all__ = ["clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_"]


def _as_list(parameters, fn):
    if isinstance(parameters, (torch.Tensor, DistTensor)):
        return [parameters]
    out = list(parameters)
    for p in out:
        if isinstance(p, tuple):
            raise TypeError(f"{fn}(parameters=...): got a (name, parameter) pair; pass "
                            "parameters, e.g. model.parameters() or "
                            "[p for _, p in wb.dist_parameters(model)]")
        if not isinstance(p, (torch.Tensor, DistTensor)):
            raise TypeError(f"{fn}(parameters=...): got a {type(p).__name__}; pass tensors "
                            "or DistTensors (e.g. model.parameters())")
    return out


def _local_power(t: torch.Tensor, p: float) -> torch.Tensor:
    """This shard's part of the p-norm: sum |t|^p (count of nonzeros for p = 0), or
    max |t| / min |t| for p = +-inf; fp32 at least (as torch's norms of low precision)."""
    t = t.detach()
    if t.numel() == 0:
        return torch.tensor(math.inf if p == -math.inf else 0.0)
    n = torch.linalg.vector_norm(t, p, dtype=torch.promote_types(t.dtype, torch.float32))
    return n if p in (0.0, math.inf, -math.inf) else n.pow(p)


def _combine_op(p):
    return "max" if p == math.inf else "min" if p == -math.inf else "sum"


def _combine(xs: torch.Tensor, op: str, dim: int = 0) -> torch.Tensor:
    if op == "max":
        return xs.amax(dim)
    if op == "min":
        return xs.amin(dim)
    return xs.sum(dim)


def _dist_norm_power(g: DistTensor, p: float) -> torch.Tensor:
    """``sum |g|^p`` over the global tensor (or max/min |g|), from each rank's shard."""
    mesh, op = g.mesh, _combine_op(p)
    if any(pl.is_partial() for pl in g.placements):
        raise ValueError(f"a gradient placed {g.placements}: a Partial gradient has no "
                         "norm until it is reduced; reshard it to Replicate first")
    sharded = [a for a, pl in enumerate(g.placements) if pl.is_shard()]
    if storage.holds_own(mesh):             # torch.distributed: this process's shard
        x = _local_power(g.local(), p)
        for a in sharded:                   # a scalar all-reduce along each sharded dim
            C.record_collective("all_reduce", mesh, a, 4, "clip_grad norm",
                                groups=[_B.group(mesh, a)[1]])
            x = x.clone()
            _B.all_reduce_(x, op, _B.group(mesh, a)[0])    # NaN kept by max (sweep18)
        return x
    # simulated ranks: one rank per distinct shard (coordinate 0 along replicated dims)
    for a in sharded:
        C.record_collective("all_reduce", mesh, a, 4, "clip_grad norm")
    vals = [_local_power(g.local(r), p) for r in mesh.ranks
            if all(mesh.coordinate(r)[a] == 0 for a in range(mesh.ndim) if a not in sharded)]
    return _combine(torch.stack(vals), op)


def _norm_of(g, p: float) -> torch.Tensor:
    if isinstance(g, DistTensor):
        x = _dist_norm_power(g, p)
        return x if p in (0.0, math.inf, -math.inf) else x.pow(1.0 / p)
    return torch.linalg.vector_norm(g, p)


def _to_shards(params):
    """``params`` with each DistTensor that stands for a ZeRO-3 shard (the module's own
    parameter under ``FullyShardedDataParallel`` / ``Zero3`` over DistTensors, or the
    copy a forward gathered: its storage carries ``_wb_clip_shard``) replaced by that
    shard.  FSDP2's ``model.parameters()`` are the sharded parameters with their
    gradients, so torch's ``clip_grad_norm_`` over them is the clip over the shards; here
    it raised (the shards were where to clip).  One entry for one (a parameter given
    twice counts twice, as torch counts a tensor given twice); under torch.distributed
    the shards' partial norms are reduced over the ranks
    (:func:`.strategies.fsdp_dist_habits._shard_norm_grad`)."""
    out = []
    for p in params:
        if isinstance(p, DistTensor):
            shard = next((getattr(t, "_wb_clip_shard", None) for t in
                          storage.tensors(p._local)
                          if getattr(t, "_wb_clip_shard", None) is not None), None)
            if shard is not None:
                out.append(shard)
                continue
        out.append(p)
    return out


def _check_readable(params, fn: str) -> None:
    """Raise where a DistTensor's gradient is not the model's: its storage marked by a
    wrapper (``_wb_clip_refuse``: Zero3's templates, ZeRO-1/2's replicas), or a replica's
    gradient not yet summed over the data-parallel ranks (``_wb_synced`` False)."""
    for p in params:
        if not isinstance(p, DistTensor):
            continue
        for t in storage.tensors(p._local):
            msg = getattr(t, "_wb_clip_refuse", None)
            if msg:
                raise RuntimeError(f"wb.{fn}: {msg}")
            if t.grad is not None and getattr(t.grad, "_wb_synced", True) is False:
                raise RuntimeError(f"wb.{fn}: {t.grad._wb_hint}")


def _grads(params):
    return [p.grad for p in params if p.grad is not None]


@torch.no_grad()
def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach=None) -> torch.Tensor:
    """The norm of ``tensors`` (tensors or DistTensors) as one vector
    (``torch.nn.utils.get_total_norm``); on every rank the same plain tensor."""
    ts = _as_list(tensors, "get_total_norm")
    p = float(norm_type)
    if not ts:
        return torch.tensor(0.0)
    if not any(isinstance(t, DistTensor) for t in ts):
        return torch.nn.utils.get_total_norm(ts, p, error_if_nonfinite, foreach)
    # each tensor's norm in its own dtype (computed in fp32 at least), as torch's
    # get_total_norm returns a bf16 total for bf16 gradients
    norms = [_norm_of(t, p).to(t.dtype) for t in ts]
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), p)
    if error_if_nonfinite and (total.isnan() or total.isinf()):
        raise RuntimeError(f"The total norm of order {p} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and "
                           "scale the gradients by the non-finite norm anyway, set "
                           "`error_if_nonfinite=False`")
    return total


def _leaf_grads(params):
    """Each distinct gradient tensor behind ``params`` (a DistTensor's local shards')."""
    seen, out = set(), []
    for p in params:
        ts = storage.tensors(p._local) if isinstance(p, DistTensor) else [p]
        for t in ts:
            if t.grad is not None and id(t.grad) not in seen:
                seen.add(id(t.grad))
                out.append(t.grad)
    return out


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over tensors and DistTensors: returns the total
    norm of the gradients, which are scaled in place so it is at most ``max_norm``."""
    params = _to_shards(_as_list(parameters, "clip_grad_norm_"))
    _check_readable(params, "clip_grad_norm_")
    if not any(isinstance(p, DistTensor) for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite,
                                              foreach)
    total = get_total_norm(_grads(params), norm_type, error_if_nonfinite, foreach)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in _leaf_grads(params):
        g.mul_(coef.to(g.device))
    return total


@torch.no_grad()
def clip_grad_value_(parameters, clip_value: float, foreach=None) -> None:
    """``torch.nn.utils.clip_grad_value_`` over tensors and DistTensors: every gradient
    element clamped to ``[-clip_value, clip_value]`` in place."""
    params = _to_shards(_as_list(parameters, "clip_grad_value_"))
    _check_readable(params, "clip_grad_value_")
    if not any(isinstance(p, DistTensor) for p in params):
        return torch.nn.utils.clip_grad_value_(params, clip_value, foreach)
    v = float(clip_value)
    for g in _leaf_grads(params):
        g.clamp_(min=-v, max=v)
    return None


@torch.no_grad()
def clip_grads_with_norm_(parameters, max_norm: float, total_norm, foreach=None) -> None:
    """``torch.nn.utils.clip_grads_with_norm_`` over tensors and DistTensors: every
    gradient scaled in place by ``min(max_norm / (total_norm + 1e-6), 1)``."""
    params = _to_shards(_as_list(parameters, "clip_grads_with_norm_"))
    _check_readable(params, "clip_grads_with_norm_")
    if not any(isinstance(p, DistTensor) for p in params):
        return torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach)
    if isinstance(total_norm, DistTensor):
        total_norm = total_norm.full()
    coef = torch.clamp(float(max_norm) / (torch.as_tensor(total_norm) + 1e-6), max=1.0)
    for g in _leaf_grads(params):
        g.mul_(coef.to(g.device))
    return None
