"""Evaluation through a pipeline: the schedule's forward actions only.

    model.eval()                                        # dropout off, as on one device
    loss = strategy.evaluate(model, x, y)               # Hybrid(pp=2, ...): the mean loss
    logits = strategy.evaluate(model, x)                # (B, S, V), one tensor

``torch.distributed.pipelining``'s ``schedule.eval()`` runs a schedule forward only and
returns the last stage's outputs (its ``step()`` refuses ``torch.no_grad()``: "call eval()
instead"); Megatron-LM's ``forward_backward_func(..., forward_only=True)`` does the same
for its validation loss.  Here :func:`workbench.schedules.run_pipeline` runs the ``F``
actions of the recipe's schedule with ``forward_only=True``: under ``torch.no_grad()``,
nothing kept for a backward, no gradient touched.  A pipelined model's own ``model(x)``
would run every stage's layers on one mesh (each stage lives on its own ranks), so it
raises and names these calls.  Under torchrun each process runs its own stage's ``F``
actions (activations by point-to-point messages); the loss and the logits reach every
process (:mod:`workbench.recipes.pipeline_eval_dist`).
"""
from __future__ import annotations

import torch

from ..parallel import schedules as S
from .moe import whole_batch_stats
from .pipeline_loss import token_weights, weighted_loss_fn

__all__ = ["evaluate", "refuse_forward"]


def refuse_forward(module, args):
    """A forward pre-hook of a model split into pipeline stages."""
    raise RuntimeError(f"{type(module).__name__}(...) of a model split into pipeline stages: "
                       "its forward would run every stage's layers on one mesh, but each "
                       "stage lives on its own ranks; run the pipeline instead: "
                       "strategy.forward_backward(model, x, y) to train, "
                       "strategy.evaluate(model, x, y) for the loss or "
                       "strategy.evaluate(model, x) for the logits (forward only)")


def _eval_microbatches(h, batch_size: int):
    """Micro-batches for an evaluation batch (its size need not be the training one's):
    the training count when it fits, else the most up to it that divide the batch over dp
    (and that the schedule's layout takes); None when none does."""
    if batch_size % h.dp:
        return None
    per = batch_size // h.dp
    ks = [k for k in range(1, per + 1) if per % k == 0
          and (h.schedule_name != "interleaved" or k % h.pp == 0)
          and (h.schedule_name != "zb-v" or k >= h.pp)]
    if not ks:
        return None
    below = [k for k in ks if k <= h.m]
    return max(below) if below else min(ks)


def evaluate(h, model, inputs, targets=None) -> torch.Tensor:
    """The mean loss of ``inputs`` against ``targets`` under the hybrid recipe ``h``, or
    without ``targets`` the logits (B, S, V) as one tensor; forward only.  The batch may
    have any size the layout splits: forward only, the micro-batch count changes no value
    (:func:`_eval_microbatches`); the training count is left as it was."""
    saved = h._m, h.m, h.schedule_name
    if h.schedule_name == "dualpipe":   # copy 0 alone (stage s on rank s): 1F1B's layout
        h.schedule_name = "1f1b"
    # one stage runs the batch whole, but ``check`` still holds it to the training count
    k = _eval_microbatches(h, inputs.shape[0])
    if k is not None:
        h._m = h.m = k
    try:
        return _evaluate(h, model, inputs, targets)
    finally:
        h._m, h.m, h.schedule_name = saved


@torch.no_grad()
def _evaluate(h, model, inputs, targets):
    h.check(model.cfg, inputs.shape[0])
    n_stages = len(h.stage_layers)
    if n_stages == 1:
        mesh = h.meshes[0]
        logits = h._stage(model, 0, h._batch(inputs, mesh))
        if targets is None:
            return logits.full().detach()
        return h._loss(logits, h._batch(targets, mesh)).full().detach()
    stages = [lambda x, s=s: h._stage(model, s, x) for s in range(n_stages)]
    m = h.m
    first, last = h.meshes[0], h._mesh_of(n_stages - 1)
    # torch.distributed: the inputs on the first stage's processes, the targets on the
    # last's (each process runs its own stage: execute_dist.py)
    xs = [h._batch(c, first) if h._own(first) else None for c in inputs.chunk(m)]
    ts = None if targets is None else \
        [h._batch(c, last) if h._own(last) else None for c in targets.chunk(m)]
    sched = h._schedule(m)
    loss_fn = None if ts is None else weighted_loss_fn(lambda out, i: h._loss(out, ts[i]),
                                                       token_weights(targets, m))
    with whole_batch_stats(model):      # MoE last_stats: every micro-batch (recipes/moe.py)
        run = S.run_pipeline(sched, stages, h.meshes, xs, loss_fn, forward_only=True)
    if targets is None:
        if h.distributed:               # the last stage's logits, sent to every process
            from .pipeline_eval_dist import broadcast_outputs
            return broadcast_outputs(run.outputs, last)
        return torch.cat([o.full() for o in run.outputs])
    return torch.tensor(run.loss)
