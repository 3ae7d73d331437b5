"""Megatron-LM's data-parallel sync on pipeline stages after the first: what the
pipeline's own timing hides.

Every stage reduces its gradients over its data-parallel group once its own last
backward is done, and the step ends when every stage has (the optimizer's gradient-norm
all-reduce spans the whole model-parallel group).  In 1F1B (and GPipe) stage s finishes
its last backward s backward-times before stage 0 does, and starts its first forward s
forward-times after it, so stage s's sync shows only past that slack:

- ``megatron/training.py`` and ``megatron/model/distributed.py`` of the 2021 releases
  (de7dc40f88, Narayanan et al.'s runs): ``train_step`` runs the schedule, then
  ``allreduce_gradients``, one all-reduce of the whole contiguous gradient buffer, then
  the optimizer step: exposed max(0, all-reduce - slack_b(s)) on stage s.
- Megatron-core (f2e5db402c, the 2024 H100 table's ``--overlap-grad-reduce
  --overlap-param-gather``), ``core/distributed/distributed_data_parallel.py``: "Turn
  off bucketing if we are on a pipeline stage that is not the first (since
  data-parallel communication on these stages is not on the critical path)": one bucket,
  reduce-scattered once the stage's last backward is done (exposed max(0, RS -
  slack_b)); its updated weights are all-gathered from the step's start (``zero_grad``
  dispatches the first bucket, ``core/optimizer/distrib_optimizer.py``) and waited for
  before the stage's first forward: exposed max(0, AG - slack_f).

- DeepSpeed's pipeline engine (``runtime/pipe/engine.py``, 2021: ``ReduceGrads`` is the
  last instruction of each stage's ``TrainSchedule``, then ``OptimizerStep``): the same
  rule, in the model's 16-bit dtype (``frameworks``), but not priced here:
  ``plan.deepspeed_step`` starts each stage's reduction at that stage's end in the
  simulated schedule (``plan.deepspeed_pipe``).

slack_b(s) = sum over stages k < s of their backward time per micro-batch (recompute
and p2p included), slack_f(s) the same of their forward.  Interleaved schedules keep the
stage-by-stage model of ``estimate`` (Megatron-core also drops bucketing for model chunks
after the first there; not modeled).
"""
from __future__ import annotations

from . import costs as C

__all__ = ["slacks", "after_flush"]


def slacks(stage: int, forward, backward) -> tuple[float, float]:
    """(slack_f, slack_b) of ``stage``: the forward and backward times per micro-batch
    of the stages before it (``forward[k]``, ``backward[k]`` for stage k)."""
    return float(sum(forward[:stage])), float(sum(backward[:stage]))


def after_flush(psi: float, lay, prof, stage: int, grad_bytes: int, slack_f: float,
                slack_b: float, overlapped: bool) -> float:
    """Exposed seconds of stage ``stage``'s (> 0) data-parallel sync, ``psi`` parameters
    (module docstring); ``overlapped``: Megatron-core's ``--overlap-grad-reduce``
    (ZeRO-1: with ``--overlap-param-gather``), else the 2021 sync after the flush."""
    if stage < 1:
        raise ValueError(f"after_flush: stage={stage}: stage 0's sync has no slack")
    ranks = tuple(lay.grad_ranks(0, stage))       # dp (x cp: ``plan.ep_cp``) ranks
    g = grad_bytes * psi
    if lay.zero == 0:
        return max(0.0, C.group_price("all_reduce", g, ranks, prof) - slack_b)
    rs = C.group_price("reduce_scatter", g, ranks, prof)
    ag = C.group_price("all_gather", 2 * psi, ranks, prof)
    if overlapped:
        return max(0.0, rs - slack_b) + max(0.0, ag - slack_f)
    return max(0.0, rs + ag - slack_b)
