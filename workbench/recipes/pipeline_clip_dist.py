"""``Hybrid.clip_grad_norm_`` / ``clip_grad_value_`` over a pipeline on torch.distributed.

Also without a pipeline, wherever a process holds a part of the gradients (``tp > 1``,
or ZeRO's dp chunks): :func:`~workbench.recipes.pipeline_clip._per_process`.

The same clip as :mod:`workbench.recipes.pipeline_clip` (one total norm over every
stage, every gradient scaled by one coefficient), when each process is one rank of one
stage and holds only its stage's gradients (its tensor-parallel shard of them).
Megatron-LM's ``get_grad_norm_fp32`` (``megatron/core/optimizer/clip_grads.py``):

* each rank sums ``|g|^p`` over its own gradients, a parameter replicated over tp
  counted on tp rank 0 only (``param_is_not_tensor_parallel_duplicate``), a sharded one
  on every rank (its shard);
* one scalar all-reduce over the model-parallel group (the ranks of every stage and tp
  coordinate at this process's dp coordinate; the gradients are already summed over
  dp, so each dp coordinate holds the whole model once): ``SUM`` of the p-th powers,
  ``MAX`` for the inf-norm (``MIN`` for -inf).  Under ZeRO each dp rank holds its own
  chunk of the summed gradients (Megatron-LM's distributed optimizer), so the
  all-reduce spans the dp ranks too (every rank);
* the total ``(sum)^(1/p)`` is the same on every rank, and so is the coefficient
  ``min(max_norm / (total + 1e-6), 1)`` that every rank scales its gradients by.

Built for the stage optimizers of every ZeRO stage (``Hybrid(zero=0|1|2|3)``), read as
the simulated path's :func:`~workbench.recipes.pipeline_clip.stage_grad_norm` reads them
(summed over dp first); expert parallelism raises.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..parallel.clip_grad import _local_power
from ..sim_mesh import backends as _B
from ..sim_mesh.collectives import record_collective
from ..sim_mesh.mesh import Mesh
from .pipeline_clip import clip_coef, model_parallel_grid

__all__ = ["clip_norm_dist", "clip_value_dist", "model_parallel_mesh"]


def model_parallel_mesh(meshes) -> Mesh:
    """The (dp, mp) mesh over every stage's ranks: row d holds the ranks at dp coordinate
    d of every stage and tp coordinate (stage-major), Megatron-LM's model-parallel group
    (pipeline x tensor).  Registered on torch.distributed (collective: every process calls
    it, in the same order, as the clip does)."""
    return _B.register(model_parallel_grid(meshes))


def _check_kinds(h, optimizers, fn: str) -> list:
    from ..parallel.strategies.data_parallel import DataParallel
    from ..parallel.strategies.zero3 import Zero3
    opts = list(optimizers)
    for o in opts:
        if not isinstance(o, (DataParallel, Zero3)) or o.mesh not in h.meshes:
            what = f"a {type(o).__name__} on {o.mesh}" if hasattr(o, "mesh") else \
                f"a {type(o).__name__}"
            raise NotImplementedError(
                f"Hybrid.{fn} under torch.distributed: built for the stage "
                "optimizers Hybrid.build_optimizer gives (DataParallel or Zero3 on the "
                f"stage meshes, no expert parallelism); got {what}; clip on simulated "
                "ranks")
    return opts


def _stage_grads(o) -> list:
    """(parameter, this rank's gradient of it) of stage optimizer ``o``, summed over dp
    now (what its step would do first): plain DP's replicas (every dp rank the same
    sum), ZeRO-1/2's reduce-scattered chunks and ZeRO-3's shards (each dp rank its own
    flat chunk, zero-padded)."""
    if not hasattr(o, "zero"):                      # Zero3: the shards hold the sums
        o.finish_gradient_synchronization()
        return [(tmpl, shard.grad) for _, _, tmpl, shard in o.entries
                if shard.grad is not None]
    if o.zero:
        shards = o.optimizer.reduce_grads_()        # kept for the optimizer's step
        return [(o.optimizer.params[i], g) for i, g in shards.items()]
    o.finish_gradient_synchronization()
    return [(q, q._local.grad) for q in o.params if q._local.grad is not None]


def _stage_parts(o, p: float, op: str):
    """This rank's part of ``sum |g|^p`` (or max / min |g|) over stage optimizer ``o``'s
    gradients, summed over dp first; and those gradients (to scale)."""
    mesh, dp_axis = o.mesh, o.mesh.dim("dp")
    coord = _B.coordinate(mesh)
    parts, grads = [], []
    for q, g in _stage_grads(o):
        if any(pl.is_partial() for pl in q.placements):
            raise ValueError(f"Hybrid.clip_grad_norm_: a parameter placed {q.placements}; a "
                             "Partial parameter's gradient has no norm until it is reduced")
        grads.append(g)
        # replicated over a model-parallel dim: counted once, on coordinate 0 there
        dup = any(a != dp_axis and pl.is_replicate() and coord[a] != 0
                  for a, pl in enumerate(q.placements))
        if dup and op == "sum":
            continue
        with torch._C.DisableTorchFunctionSubclass():       # the shard's own norm
            parts.append(_local_power(g, p))
    return parts, grads


@torch.no_grad()
def clip_norm_dist(h, optimizers, max_norm: float, p: float, error_if_nonfinite: bool):
    """The total norm of every stage's gradients on every rank; each rank's gradients
    scaled by the one coefficient (module docstring)."""
    opts = _check_kinds(h, optimizers, "clip_grad_norm_")
    op = "max" if p == math.inf else "min" if p == -math.inf else "sum"
    if h.zero and op == "min":
        raise ValueError("clip_grad_norm_(norm_type=-inf) under ZeRO: the padded chunks hold "
                         "zeros that this norm would count; use a p-norm p > 0 or inf")
    parts, grads = [], []
    for o in opts:
        ps, gs = _stage_parts(o, p, op)
        parts += ps
        grads += gs
    empty = {"sum": 0.0, "max": 0.0, "min": math.inf}[op]
    if not parts:
        x = torch.tensor(empty, dtype=torch.float64)
    else:
        # one scalar in float64 on every rank (the all-reduce needs one dtype everywhere)
        st = torch.stack([t.double() for t in parts])
        x = st.sum() if op == "sum" else st.amax() if op == "max" else st.amin()
    x = x.clone()
    mp = model_parallel_mesh(h.meshes)
    if h.zero:      # ZeRO: each dp rank holds its own chunk; the parts of every rank
        record_collective("all_reduce", mp, None, 4, label="clip_grad norm over dp x tp x pp",
                          groups=[mp.ranks])
        _B.all_reduce_(x, op)           # max / min keep a NaN, as one device (sweep18)
    else:           # the dp ranks hold the same sums: the model-parallel group's
        record_collective("all_reduce", mp, 1, 4, label="clip_grad norm over tp x pp")
        _B.all_reduce_(x, op, _B.group(mp, 1)[0])
    total = x if op != "sum" else x.pow(1.0 / p)
    # in the gradients' dtype, as torch's total: stage 0's first gradient's (the
    # simulated total's), sent to every rank so that all return the same
    total = total.to(_grad_dtype(h, grads))
    coef = clip_coef(total, max_norm, p, error_if_nonfinite)
    for g in grads:                 # (ZeRO: the chunks its step takes)
        g.mul_(coef.to(g.device))
    return total


def _grad_dtype(h, grads) -> torch.dtype:
    """The gradients' dtype, agreed over the ranks (the simulated total takes the first
    stage's first gradient's; every rank must return the same)."""
    dt = grads[0].dtype if grads else torch.float32
    codes = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    code = torch.tensor(codes.index(dt) if dt in codes else 0)
    dist.broadcast(code, src=h.meshes[0].ranks[0])
    return codes[int(code)]


@torch.no_grad()
def clip_value_dist(h, optimizers, clip_value: float) -> None:
    """Each rank's gradients (summed over dp first) clamped in place: elementwise, so
    every shard on its own gives one device's clip."""
    v = float(clip_value)
    for o in _check_kinds(h, optimizers, "clip_grad_value_"):
        for _, g in _stage_grads(o):
            g.clamp_(min=-v, max=v)
