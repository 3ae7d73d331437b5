"""``clip_grad_norm_`` over a pipeline: one total norm for the gradients of every stage.

    loss = strategy.forward_backward(model, x, y)          # Hybrid(pp=2, ...)
    norm = strategy.clip_grad_norm_(optimizers, 1.0)       # one device's total norm
    strategy.optimizer_step(optimizers)

Under pipeline parallelism each stage's gradients live on that stage's ranks, and the
hybrid recipe keeps one optimizer per stage.  Clipping each stage by its own norm (each
stage optimizer's ``clip_grad_norm_``) scales every stage by a different factor: not one
device's step.  Megatron-LM takes the norm of the whole model instead
(``megatron/core/optimizer/clip_grads.py``, ``get_grad_norm_fp32``: each rank's
``sum |g|^p`` all-reduced over the model-parallel group, tensor and pipeline ranks
together; ``max`` for the inf-norm) and scales every gradient by the one coefficient
``min(max_norm / (total + 1e-6), 1)``, as ``torch.nn.utils.clip_grad_norm_`` does on one
device.  Here each stage's optimizer gives its stage's norm (its gradients summed over
dp first, as its own ``clip_grad_norm_`` does), the stage norms combine into the total
(a scalar all-reduce over the model-parallel group, tensor and pipeline ranks, recorded
in the trace: :func:`_record_norm_all_reduce`), and every stage's
gradients are scaled by the same coefficient.  Under torchrun (each process one rank of
one stage) the same clip is :mod:`workbench.recipes.pipeline_clip_dist`'s.
"""
from __future__ import annotations

import math

import torch

from ..sim_mesh.collectives import record_collective

__all__ = ["clip_grad_norm_", "clip_grad_value_", "clip_hybrid_norm_", "clip_hybrid_value_",
           "stage_grad_norm", "mark_stage_optimizers", "PIPELINE_CLIP_HINT"]

PIPELINE_CLIP_HINT = (
    "clip_grad_norm_ of one pipeline stage's optimizer clips that stage by its own norm, "
    "not the model's (the other stages' gradients live on other ranks); clip every stage "
    "together: strategy.clip_grad_norm_(optimizers, max_norm) "
    "(workbench.recipes.pipeline_clip)")

_UNREDUCED_HINT = (
    "a pipeline's gradients are each stage optimizer's (summed over the stage's "
    "data-parallel ranks inside it; under ZeRO held in its shards): clip every stage "
    "together with strategy.clip_grad_norm_(optimizers, max_norm) (one total norm) or "
    "strategy.clip_grad_value_(optimizers, clip_value)")


def mark_stage_optimizers(opts) -> None:
    """The stage optimizers of a pipeline refuse to clip alone (:data:`PIPELINE_CLIP_HINT`),
    and ``wb.clip_grad_norm_(model.parameters())`` before their reduce names the pipeline's
    clip (the per-stage advice of the wrappers' own messages would clip one stage)."""
    from ..parallel import storage
    for o in opts:
        o._wb_clip_refuse = PIPELINE_CLIP_HINT
        kind = _kind(o)
        if kind in ("dp", "zero"):
            o.replicas.unsynced_hint = _UNREDUCED_HINT
        if kind == "zero":
            for p in o.params:
                p._local._wb_clip_refuse = _UNREDUCED_HINT
        if kind == "zero3":
            for _, _, tmpl, _ in o.entries:
                for t in storage.tensors(tmpl._local):
                    t._wb_clip_refuse = _UNREDUCED_HINT
                    # not read as the stage's shard (clip_grad._to_shards): one stage's
                    # clip alone is the per-stage clip the hint refuses
                    t.__dict__.pop("_wb_clip_shard", None)


def _kind(o) -> str:
    from ..parallel.strategies.data_parallel import DataParallel
    from ..parallel.strategies.zero3 import Zero3
    if isinstance(o, DataParallel):
        return "zero" if o.zero else "dp"
    if isinstance(o, Zero3):
        return "zero3"
    raise TypeError(f"clip_grad_norm_(optimizers=...): got a {type(o).__name__}; give the "
                    "list build_optimizer returned (DataParallel or Zero3, one per stage)")


def _stage_grads(o) -> list:
    """One stage optimizer's gradients, summed over its data-parallel ranks now (what its
    step would do first): the replicas' (plain DP), the shards' (ZeRO-1/2: reduce-scattered
    into the optimizer's, Zero3: the wrapper's)."""
    if _kind(o) == "zero":
        return list(o.optimizer.reduce_grads_().values())
    o.finish_gradient_synchronization()
    return [q.grad for q in o.parameters() if q.grad is not None]


def _check_value(clip_value) -> None:
    if isinstance(clip_value, bool) or not isinstance(clip_value, (int, float)) or \
            math.isnan(clip_value):
        raise ValueError(f"clip_grad_value_(clip_value={clip_value!r}): give a number, "
                         "e.g. 1.0")


@torch.no_grad()
def clip_grad_value_(optimizers, clip_value: float, foreach=None) -> None:
    """``torch.nn.utils.clip_grad_value_`` over every stage: each gradient element (summed
    over dp first) clamped to ``[-clip_value, clip_value]`` in place."""
    _check_value(clip_value)
    v = float(clip_value)
    for o in optimizers:
        for g in _stage_grads(o):
            g.clamp_(min=-v, max=v)


@torch.no_grad()
def stage_grad_norm(o, norm_type: float, foreach=None):
    """One stage optimizer's gradients, summed over its data-parallel ranks now (what its
    step would do first), and their total norm: ``(norm, scale)``, ``scale(coef)``
    multiplying them all in place."""
    kind = _kind(o)
    if kind == "zero":                  # ZeRO-1/2: reduce-scattered into the shards (the
        # parts' all-reduce: one over every stage's ranks, _record_norm_all_reduce)
        return o.optimizer.grad_norm(norm_type, record=False), o.optimizer.scale_grads_
    # plain DP: the replicas' gradients summed over dp now (ReplicaGrads: torch's norm
    # reads one copy); Zero3: the shards already hold the reduced gradients
    grads = _stage_grads(o)
    norm = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach) if grads else \
        torch.tensor(0.0)

    def scale(coef):
        for g in grads:
            g.mul_(coef.to(g.device))
    return norm, scale


def _norm_args(max_norm, norm_type):
    """``(max_norm, p)`` as floats, or a clear error."""
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1:
        max_norm = max_norm.item()          # torch takes a one-element tensor too
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or \
            math.isnan(max_norm):
        raise ValueError(f"clip_grad_norm_(max_norm={max_norm!r}): give a number, e.g. 1.0")
    p = float(norm_type)
    if p == 0.0:
        # torch's "0-norm" of the gradients counts the tensors with a nonzero element,
        # which the stages' counts cannot give; a p-norm composes over the stages
        raise ValueError("clip_grad_norm_(norm_type=0) over a pipeline: the stages' counts "
                         "do not combine into torch's; use a p-norm (p > 0) or inf")
    return float(max_norm), p


@torch.no_grad()
def clip_grad_norm_(optimizers, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach=None, *, counted=None,
                    meshes=None) -> torch.Tensor:
    """Clip the gradients of every stage in ``optimizers`` by their total norm (one device's
    ``torch.nn.utils.clip_grad_norm_`` over the whole model); returns that norm.

    ``counted``: how many of ``optimizers`` (the first ones) hold distinct parameters
    (DualPipe's second copy of the stages is scaled, not counted twice); ``meshes``: the
    stage meshes, to record the scalar all-reduce over the pipeline ranks."""
    opts = list(optimizers)
    max_norm, p = _norm_args(max_norm, norm_type)
    if not opts:
        return torch.tensor(0.0)
    counted = len(opts) if counted is None else counted
    parts = [stage_grad_norm(o, p, foreach) for o in opts]
    norms = [n for n, _ in parts[:counted]]
    # the p-norm of the stages' p-norms is the p-norm of all the gradients; in the
    # gradients' dtype, as torch's total
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0]) for n in norms]), p) \
        if norms else torch.tensor(0.0)
    if meshes is not None:
        _record_norm_all_reduce(opts, meshes)
    coef = clip_coef(total, max_norm, p, error_if_nonfinite)
    for _, scale in parts:
        scale(coef)
    return total


def model_parallel_grid(meshes):
    """The (dp, mp) mesh over every stage's ranks (stage meshes of dims ("dp", "tp")): row
    d holds the ranks at dp coordinate d of every stage and tp coordinate (stage-major),
    Megatron-LM's model-parallel group (pipeline x tensor).  Not registered on
    torch.distributed (:func:`.pipeline_clip_dist.model_parallel_mesh` registers it)."""
    from ..sim_mesh.mesh import Mesh
    dp, tp = meshes[0].shape
    rows = [[m.rank_at((d, t)) for m in meshes for t in range(tp)] for d in range(dp)]
    return Mesh(rows, ["dp", "mp"])


def _record_norm_all_reduce(opts, meshes) -> None:
    """The scalar all-reduce that combines the ranks' parts of the norm.  Megatron-LM's
    ``get_grad_norm_fp32`` (``megatron/core/optimizer/clip_grads.py``) all-reduces each
    rank's ``sum |g|^p`` over the model-parallel group, tensor and pipeline ranks
    together, whenever that group has more than one rank (tp > 1 without a pipeline
    too); the torchrun clip records that one (:mod:`.pipeline_clip_dist`), so plain data
    parallelism on ("dp", "tp") stage meshes records it here too (before, a pipeline's
    pp-only groups, and nothing at pp = 1: tiny dp 2 x tp 2 sp, a 4.54 us all-reduce
    over tp that torchrun's step had and the simulator's did not).  ZeRO's and others'
    shard norms record their own dims (``ChunkedZeroOptimizer.grad_norm``): those keep
    the pipeline's scalar all-reduce over pp only, as before.  ZeRO-1/2 (Megatron-LM's
    distributed optimizer, :meth:`~workbench.parallel.strategies.zero_optimizer_dist.
    ChunkedZeroOptimizer.grad_norm`): one all-reduce over every rank of every stage, dp
    included, as the torchrun clip records it (was: one per stage mesh dim, then one
    over pp).  ZeRO-3 the same (each dp rank holds its chunk of the reduced gradients):
    FSDP's ``clip_grad_norm_`` all-reduces ``sum |g|^p`` over its sharding group once
    (torch 2.13, ``torch/distributed/fsdp/fully_sharded_data_parallel.py:1188-1189``),
    Megatron-LM's over its gradient-statistics group (``clip_grads.py:132-133``,
    NVIDIA/Megatron-LM d98e8a6), and so does the torchrun clip (was: none at pp = 1,
    one over pp only with a pipeline)."""
    grid = all(tuple(m.dim_names) == ("dp", "tp") for m in meshes)
    plain = all(_kind(o) == "dp" for o in opts) and grid
    if grid and opts and all(_kind(o) in ("zero", "zero3") for o in opts):
        mp = model_parallel_grid(meshes)
        record_collective("all_reduce", mp, None, 4, label="clip_grad norm over dp x tp x pp",
                          groups=[mp.ranks])
    elif plain:
        mp = model_parallel_grid(meshes)
        if mp.shape[1] > 1:
            record_collective("all_reduce", mp, 1, 4, label="clip_grad norm over tp x pp")
    elif len(meshes) > 1:                   # each rank's part over the pipeline
        record_collective("all_reduce", meshes[0], None, 4, label="clip_grad norm over pp",
                          groups=[list(g) for g in zip(*(m.ranks for m in meshes))])


# ---- the hybrid recipe's (Hybrid.clip_grad_norm_ / clip_grad_value_) ---------------------
def _prepare(h) -> int:
    """Before clipping under ``h``: how many of its optimizers count (DualPipe: copy 0's;
    the two copies' gradients summed first, once, so ``optimizer_step`` does not again)."""
    if h.schedule_name != "dualpipe":
        return -1
    from . import dualpipe
    dualpipe.sum_copies_once(h)             # copy 1 then holds the same sum: scaled, not
    return h._copy0_optimizers              # counted twice


def _per_process(h) -> bool:
    """Under torch.distributed, does a process hold only a part of the model's gradients
    (one stage's, its tensor-parallel shard, or under ZeRO its dp chunk)?  Then the clip
    is :mod:`.pipeline_clip_dist`'s scalar all-reduce; torch's norm over the process's own
    gradients (the simulated path) would be a part's, and raises."""
    return h.distributed and (h.pp > 1 or h.tp > 1 or bool(h.zero))


def clip_hybrid_norm_(h, optimizers, max_norm, norm_type=2.0, error_if_nonfinite=False,
                      foreach=None) -> torch.Tensor:
    if _per_process(h):                     # each process holds its part of the gradients
        from .pipeline_clip_dist import clip_norm_dist
        max_norm, p = _norm_args(max_norm, norm_type)
        return clip_norm_dist(h, optimizers, max_norm, p, error_if_nonfinite)
    counted = _prepare(h)
    return clip_grad_norm_(optimizers, max_norm, norm_type, error_if_nonfinite, foreach,
                           counted=None if counted < 0 else counted, meshes=h.meshes)


def clip_hybrid_value_(h, optimizers, clip_value, foreach=None) -> None:
    _check_value(clip_value)
    if _per_process(h):
        from .pipeline_clip_dist import clip_value_dist
        return clip_value_dist(h, optimizers, clip_value)
    _prepare(h)
    clip_grad_value_(optimizers, clip_value, foreach)


def clip_coef(total: torch.Tensor, max_norm, p, error_if_nonfinite: bool) -> torch.Tensor:
    """The factor ``torch.nn.utils.clip_grad_norm_`` scales every gradient by, from the
    total norm: ``min(1, max_norm / (total + 1e-6))``; its error (word for word) for a
    non-finite total when ``error_if_nonfinite``."""
    if error_if_nonfinite and (total.isnan() or total.isinf()):
        raise RuntimeError(f"The total norm of order {p} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and "
                           "scale the gradients by the non-finite norm anyway, set "
                           "`error_if_nonfinite=False`")
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
