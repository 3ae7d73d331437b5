"""DualPipe in the hybrid recipe: the second copy of every pipeline stage, and the gradient
all-reduce between the two copies.

DeepSeek-V3's DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, sec. 3.2.1,
Table 2: "Parameter 2x") feeds half the micro-batches from each end of the pipeline, so
every rank holds two copies of the model's stages: rank i holds stage i of the copy fed
from rank 0 and stage p - 1 - i of the copy fed from rank p - 1 (the "dualpipe" layout of
:class:`workbench.schedules.Schedule`).  Each copy sees half the micro-batches, so the
gradient of the batch is the sum of the two copies' gradients: ranks i and p - 1 - i
all-reduce them (one buffer per rank pair: the gradients of both stages the pair holds
twice), then each copy takes the same optimizer step and the copies stay equal.  (The
reference implementation's example, deepseek-ai/DualPipe ``examples/example_dualpipe.py``,
does the same before it compares with one device: each rank adds to its copy of a stage
the gradient of the other copy, gathered from rank p - 1 - i.)

Here the hybrid recipe (:class:`~.hybrid.Hybrid`, ``schedule="dualpipe"``) builds copy 0
as for any schedule (stage s on rank s) and copy 1 with a twin of itself whose stage
meshes run in the reverse order (stage s on rank p - 1 - s), from the same seed, so both
start equal.  The copies' gradients are summed before the data-parallel reduce (a sum
commutes with it); ZeRO-2 and -3 start that reduce during backward, before the copies
could be summed, so DualPipe takes zero=0 or 1.
"""
from __future__ import annotations

import copy

import torch

from ..parallel import schedules as S
from ..parallel import storage
from ..sim_mesh.collectives import record_collective
from .moe import scale_aux_losses, whole_batch_stats
from .pipeline_loss import token_weights, weighted_loss_fn

__all__ = ["check_args", "check", "build_twin", "twin_optimizers", "forward_backward",
           "all_reduce_copies", "sum_copies_once"]


def check_args(*, pp, zero, distributed) -> None:
    """DualPipe's constraints on Hybrid's arguments (before any mesh is built)."""
    if pp < 2 or pp % 2:
        raise ValueError(f"Hybrid(pp={pp}) with schedule='dualpipe': DualPipe pairs rank i "
                         f"with rank pp - 1 - i; use an even pp >= 2, e.g. pp={max(2, pp + 1)}")
    if zero not in (0, 1):
        raise ValueError(f"Hybrid(zero={zero}) with schedule='dualpipe': the two copies' "
                         "gradients are summed before the data-parallel reduce, which ZeRO-2 "
                         "and ZeRO-3 start during backward; use zero=0 or zero=1")
    if distributed:
        raise NotImplementedError("Hybrid(schedule='dualpipe', distributed=True): the "
                                  "'dualpipe' layout runs on the simulator only; use "
                                  "schedule='1f1b', 'interleaved' or 'zb-h1' on "
                                  "torch.distributed")


def check(h, batch_size: int) -> None:
    """The micro-batches DualPipe needs: an even number, at least 2 pp (the reference
    implementation asserts it; :func:`workbench.schedules.dualpipe`)."""
    m, pp, dp = h.m, h.pp, h.dp
    if (m % 2 or m < 2 * pp) and h._m is not None:
        # the count was given: the batch is not the cause (was: "use a batch_size that
        # divides by dp x 2 pp = 4 (got batch_size=8)" for Hybrid(microbatches=2), 8
        # dividing by 4)
        raise ValueError(f"Hybrid(microbatches={m}) with schedule='dualpipe': DualPipe feeds "
                         f"half of them from each end and needs an even number >= 2 pp = "
                         f"{2 * pp}; give Hybrid(microbatches={2 * pp}) (or None for the "
                         "default)")
    if m % 2 or m < 2 * pp:
        raise ValueError(f"schedule='dualpipe' with {m} micro-batches: DualPipe feeds half "
                         f"of them from each end and needs an even number >= 2 pp = {2 * pp}; "
                         f"use a batch_size that divides by dp x 2 pp = {dp * 2 * pp} (got "
                         f"batch_size={batch_size}), or Hybrid(microbatches={2 * pp})")


def build_twin(h, model, cfg, seed: int) -> None:
    """Copy 1 of every stage of ``model`` (copy 0): built from the same seed (so both start
    equal) by a twin of the recipe whose stage s runs on rank pp - 1 - s.  Kept, with
    copy 0, as ``h._twin``."""
    twin = copy.copy(h)
    twin.meshes = list(reversed(h.meshes))
    twin.schedule_name = "1f1b"         # one stage per rank: stage s on twin.meshes[s]
    twin.v = 1
    h._twin = (twin, twin.build_model(cfg, seed))
    h._copy0 = model
    # model.zero_grad() clears copy 1's gradients too (module_state's hook), and
    # model.load_state_dict(...) loads copy 1 too (left as it was, the copies would differ)
    model.__dict__.setdefault("_wb_zero_grad_hooks", []).append(h._twin[1].zero_grad)
    # model.to(dtype) / .double() / .half() converts copy 1 too (module_state's hook)
    model.__dict__.setdefault("_wb_apply_hooks", []).append(h._twin[1]._apply)
    model.register_load_state_dict_post_hook(_load_twin(h._twin[1]))
    # and a load in place into model.state_dict() (wb.checkpoint.load) reaches copy 1 too
    model.register_state_dict_post_hook(_mark_twin(h._twin[1]))


def _mark_twin(model1):
    """A ``state_dict`` post-hook of copy 0: each value, once a checkpoint load fills it
    in place, is copied into copy 1's parameter of the same name
    (:mod:`workbench.parallel.load_back`)."""
    from ..parallel.load_back import mark

    def hook(model, state_dict, prefix, local_metadata):
        for key, v in state_dict.items():
            if key.startswith(prefix):
                mark(v, lambda val, k=key[len(prefix):]: _copy_into(model1, k, val),
                     tag="dualpipe copy 1")
    return hook


@torch.no_grad()
def _copy_into(model1, key, value) -> None:
    from ..parallel.dist_tensor import DistTensor
    from ..sim_mesh.trace import suspend
    with suspend():                     # a copy between the model's copies: no step traffic
        full = value.full() if isinstance(value, DistTensor) else value
        model1.load_state_dict({key: full}, strict=False)


def _load_twin(model1):
    """A ``load_state_dict`` post-hook of copy 0: copy 0's new values into copy 1."""
    @torch.no_grad()
    def hook(model, incompatible_keys):
        from ..parallel.dist_tensor import DistTensor
        from ..sim_mesh.trace import suspend
        with suspend():                 # a copy between the model's copies: no step traffic
            sd = {k: v.full() if isinstance(v, DistTensor) else v
                  for k, v in model.state_dict().items()}
            model1.load_state_dict(sd)
    return hook


def twin_optimizers(h, lr: float, weight_decay: float) -> list:
    """The optimizers of copy 1 (its own states: Table 2's 2x parameters, and their
    gradients and optimizer states with them)."""
    twin, model1 = h._twin
    return twin.build_optimizer(model1, lr, weight_decay)


def forward_backward(h, model, inputs, targets):
    """One step of :func:`workbench.schedules.dualpipe` over the two copies: micro-batch
    i < m/2 enters at rank 0 (copy 0), the others at rank pp - 1 (copy 1)."""
    h.check(model.cfg, inputs.shape[0])
    _begin_backward(h)
    _follow_copy0(h)
    twin, model1 = h._twin
    p, m = h.pp, h.m
    sched = S.dualpipe(p, m)
    stages = ([lambda x, s=s: h._stage(model, s, x) for s in range(p)]
              + [lambda x, s=s: twin._stage(model1, s, x) for s in range(p)])
    params = ([h._stage_params(model, s) for s in range(p)]
              + [twin._stage_params(model1, s) for s in range(p)])
    mesh_of = lambda stage, i: h.meshes[sched.placement(stage, i)[0]]   # noqa: E731
    xs = [h._batch(c, mesh_of(0, i)) for i, c in enumerate(inputs.chunk(m))]
    ts = [h._batch(c, mesh_of(p - 1, i)) for i, c in enumerate(targets.chunk(m))]
    loss_fn = weighted_loss_fn(lambda out, i: h._loss(out, ts[i]), token_weights(targets, m))
    for copy_ in (model, model1):       # MoE: the load-balancing loss averaged as the loss
        scale_aux_losses(copy_, m)
    with whole_batch_stats(model, model1):     # MoE last_stats: both copies' micro-batches
        run = S.run_pipeline(sched, stages, h.meshes, xs, loss_fn, params=params)
    return torch.tensor(run.loss)


@torch.no_grad()
def _follow_copy0(h) -> None:
    """Copy 1 made equal to copy 0 (the model the user holds) before a step: an in-place
    change of the model's parameters (``p.mul_(0.5)``, ``nn.init.*_``, ``p.requires_grad_(
    False)``) reached copy 0 only, and the micro-batches fed from rank pp - 1 ran on the old
    weights (a silently different loss).  The optimizer steps keep the copies equal, so
    after the first step this compares and copies nothing."""
    from ..sim_mesh.trace import suspend
    twin, model1 = h._twin
    with suspend():                     # a copy between the model's copies: no step traffic
        for s in range(h.pp):
            a = _grad_leaves(h._stage_params(h._copy0, s))
            b = _grad_leaves(twin._stage_params(model1, s))
            if len(a) != len(b):
                raise RuntimeError(f"dualpipe: stage {s}'s copies hold {len(a)} and {len(b)} "
                                   "tensors; they were built differently")
            for x, y in zip(a, b):
                if x.dtype != y.dtype or x.shape != y.shape:
                    raise RuntimeError(
                        f"dualpipe: stage {s}'s copy 1 holds a {y.dtype} {tuple(y.shape)} "
                        f"tensor where the model holds {x.dtype} {tuple(x.shape)}: the model "
                        "was changed around Hybrid (e.g. a parameter replaced); convert it "
                        "with model.to(dtype), which converts copy 1 too")
                if y.is_leaf and y.requires_grad != x.requires_grad:
                    y.requires_grad_(x.requires_grad)
                if not torch.equal(x, y):
                    y.copy_(x)


def sum_copies_once(h) -> None:
    """The two copies' gradients summed (:func:`all_reduce_copies`) once per step: by the
    first of clipping, ``finish_gradient_synchronization`` or the optimizer step."""
    if not getattr(h, "_copies_summed", False):
        all_reduce_copies(h)
        h._copies_summed = True


def _begin_backward(h) -> None:
    """A backward after the copies were summed: a new step once the gradients were cleared
    (a torch.optim optimizer's step and zero_grad), else refused (summing again would
    count the first sum twice)."""
    if not getattr(h, "_copies_summed", False):
        return
    twin, model1 = h._twin
    leaves = [t for s in range(h.pp) for t in _grad_leaves(h._stage_params(h._copy0, s))
              + _grad_leaves(twin._stage_params(model1, s))]
    if any(t.grad is not None and bool(t.grad.ne(0).any()) for t in leaves):
        raise RuntimeError("dualpipe: the two copies' gradients were summed for this step "
                           "(clip_grad_norm_ / finish_gradient_synchronization); step and "
                           "zero the gradients before the next forward_backward, or clip "
                           "after the last one")
    h._copies_summed = False


def _grad_leaves(params) -> list:
    """The tensors holding the parameters' data (one stack, or one per cell)."""
    return [t for q in params for t in storage.tensors(q._local)]


@torch.no_grad()
def all_reduce_copies(h) -> None:
    """Sum the gradients of each stage's two copies into both (ranks i and pp - 1 - i
    all-reduce one buffer: both stages they share), and record those all-reduces."""
    twin, model1 = h._twin
    model, p = h._copy0, h.pp
    nbytes = [0] * p                     # per rank of the pair (i, p-1-i), i < p/2
    for s in range(p):
        a, b = _grad_leaves(h._stage_params(model, s)), _grad_leaves(twin._stage_params(model1, s))
        if len(a) != len(b):
            raise RuntimeError(f"dualpipe: stage {s}'s copies hold {len(a)} and {len(b)} "
                               "tensors; they were built differently")
        for x, y in zip(a, b):
            if x.grad is None and y.grad is None:
                continue
            if x.grad is None or y.grad is None or x.grad.shape != y.grad.shape:
                raise RuntimeError(f"dualpipe: stage {s}'s copies hold gradients of "
                                   f"different shapes or only one of them; cannot sum them")
            total = x.grad + y.grad
            x.grad, y.grad = total, total.clone()
            nbytes[min(s, p - 1 - s)] += storage.rank_bytes(total, h.meshes[s].ndim)
    for i in range(p // 2):
        pairs = list(zip(h.meshes[i].ranks, h.meshes[p - 1 - i].ranks))
        record_collective("all_reduce", h.meshes[i], None, nbytes[i],
                          label=f"dualpipe copies: ranks of stages {i} and {p - 1 - i}",
                          groups=pairs)
