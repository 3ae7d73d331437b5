"""DeepSpeed's ``BF16_Optimizer``: what a bf16 run of DeepSpeed's pipeline engine holds and
moves beyond the layers, read from its source.

Source: microsoft/DeepSpeed 56c522386 (2022-04-19, "bf16+pipeline parallelism", PR #1801,
first released in v0.6.2), ``deepspeed/runtime/bf16_optimizer.py`` with
``runtime/pipe/engine.py`` and ``runtime/engine.py`` of the same commit: the
``olruwase/bf16-updates`` branch BigScience trained BLOOM-176B with
(bigscience-workshop/bigscience, train/tr11-176B-ml/README.md, "Deepspeed config": "The
new BF16_Optimizer implements its own ZeRO Stage 1 ... It doesn't shard the static fp32
buffer it reuses, which consumes 4 bytes * params of additional memory").

When it runs: DeepSpeed with bf16 and ZeRO stage 0 in its config (``engine.py``
``_configure_optimizer``: ZeRO optimizers for stage > 0, else ``BF16_Optimizer`` for bf16);
the pipeline engine refuses bf16 with ZeRO stage 1 (``_exec_reduce_grads``: "only bf16 + z1
are supported" then ``NotImplementedError``), so every bf16 pipeline (``framework=
"deepspeed"``, pp > 1) runs it, and its states are the planner's ``zero=1``.  Without a
pipeline (pp = 1) a bf16 ``zero=1`` layout is either this optimizer (config stage 0) or
DeepSpeed's ZeRO-1 optimizer (config stage 1), which a Layout does not tell apart: left to
the planner's ZeRO accounting there.

What it holds (``__init__``), per parameter psi of the rank: the bf16 weights made one
flat buffer (2), the fp32 master weights of this rank's 1/dp partition (4 / dp) and Adam's
two fp32 moments on it (8 / dp), and ``fp32_groups_gradients_flat``: an fp32 gradient
buffer of the WHOLE flat group, not partitioned (4, :data:`FP32_GRAD_BYTES`); autograd's
bf16 gradients (2) live beside it (``clear_lp_grads`` frees them only before the next
micro-batch's backward).  ZeRO-1's accounting (``memory.model_state_bytes``: 2 + 2 + 12 /
dp) holds all but the fp32 buffer.

What it moves:

- per micro-batch, after every backward on every stage (``pipe/engine.py``
  ``_exec_backward_pass`` calls ``update_hp_grads``; the last stage through
  ``BF16_Optimizer.backward``): ``hp_grad.add_(lp.grad.to(fp32))`` for each parameter:
  read 2, write the fp32 temporary 4, read it and the accumulator 4 + 4, write 4:
  :data:`HP_GRAD_BYTES` = 18, two kernels per parameter tensor.  The temporary is one
  parameter's, live while the other micro-batches' activations are held:
  :func:`transient_bytes`.
- after the last backward, ``ReduceTiedGrads`` all-reduces the tied embedding's fp32
  ``_hp_grad`` (4 bytes per element, no cast) and ``ReduceGrads``
  (``_bf16_reduce_grads`` -> ``buffered_allreduce_fallback`` on
  ``get_grads_for_reduction()``, the flat fp32 buffers, one tensor per parameter group,
  a bucket of their own above 5e8 elements) runs ``allreduce_bucket``:
  ``communication_data_type`` is bf16 for bf16 with ZeRO stage 0 (``engine.py``), so the
  fp32 buffer is cast to a bf16 copy (read 4, write 2: a temporary of 2 bytes per
  parameter, :func:`transient_bytes`), all-reduced in bf16 (2 bytes per element on the
  wire), scaled by 1 / dp (``mul_``, 2 + 2) and copied back (read 2, write 4):
  :data:`REDUCE_COPY_BYTES` = 16; the unflatten copy is a copy onto itself, which
  ``copy_`` skips.
- ``step``: the global norm reads the fp32 gradients (4); clipping multiplies them only
  when the norm exceeds the limit (not priced: ASSUMPTION, BLOOM's logged norms sit below
  its limit of 1); Adam on the partition (the planner's 28 bytes per parameter / dp);
  ``update_lp_params`` copies the fp32 partition into the bf16 weights (4 + 2 per
  parameter / dp); ``all_gather_dp_groups`` all-gathers the bf16 partitions over the dp
  group (2 bytes per element); ``clear_hp_grads`` zeroes the fp32 buffer (4):
  :data:`STEP_BYTES`, :data:`PARTITION_BYTES`.
- ``all_gather_dp_groups`` (``runtime/utils.py:981-1019``) cuts the partition into
  ``max(1, partition x dp // allgather_bucket_size)`` shards (the engine passes
  ``zero_allgather_bucket_size()``, default 5e8 elements: ``runtime/zero/constants.py:71``;
  ASSUMED for MT-NLG, whose config is not public; BLOOM's sets none) and calls
  ``dist.all_gather(shard_list, ...)`` with a LIST of dp output views per shard: PyTorch's
  ``ProcessGroupNCCL::allgather`` gathers into a flat temporary
  (``flatten_for_scatter_gather``) and then copies each of the dp chunks out to its view on
  the NCCL stream ("Copy the flattened output tensors to the outputs", pytorch/pytorch
  cf1380dfb6 ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``; the same flat buffer
  and copy-out ASSUMED in the torch 1.x releases these runs used, not read at them):
  read 2 + write 2 bytes per parameter, :data:`ALLGATHER_COPY_BYTES`, dp copy kernels
  per shard, on the step's tail (the next forward waits for the NCCL stream).
- the gradient norm (``step`` -> ``get_global_norm_of_tensors(..., mpu=self.mpu)``,
  ``bf16_optimizer.py:341-344``, ``runtime/utils.py:923-930``) sums each gradient's
  ``t.float().norm().item()`` on the host (a host sync per tensor, not priced) and
  all-reduces the 4-byte sum over the model-parallel group, every tp x pp rank of one
  replica (``plan.deepspeed_step.step_collectives``).
"""
from __future__ import annotations

from ..sim_mesh.cost import compute_time
from . import costs as C

__all__ = ["SOURCE", "FP32_GRAD_BYTES", "HP_GRAD_BYTES", "REDUCE_COPY_BYTES", "STEP_BYTES",
           "PARTITION_BYTES", "ALLGATHER_COPY_BYTES", "ALLGATHER_BUCKET", "applies",
           "state_bytes", "largest_numel", "transient_bytes", "micro_batch_seconds",
           "allgather_shards", "dp_sync", "step_seconds", "tied_bytes", "ASSUMPTION"]

SOURCE = "microsoft/DeepSpeed 56c522386 (2022-04-19, PR #1801, v0.6.2) BF16_Optimizer"
FP32_GRAD_BYTES = 4          # fp32_groups_gradients_flat: the whole group, not partitioned
HP_GRAD_BYTES = 2 + 4 + 4 + 4 + 4          # update_hp_grads, per parameter per micro-batch
REDUCE_COPY_BYTES = (4 + 2) + (2 + 2) + (2 + 4)   # cast to bf16, mul_(1/dp), copy back
STEP_BYTES = 4 + 4           # the norm reads the fp32 gradients; clear_hp_grads zeroes them
PARTITION_BYTES = 4 + 2      # update_lp_params: fp32 partition -> bf16 weights (per psi/dp)
KERNELS_PER_LAYER = 2 * 12   # update_hp_grads: .to() and add_() on each of a GPT layer's 12
ALLGATHER_COPY_BYTES = 2 + 2  # ProcessGroupNCCL::allgather's copy-out of its flat buffer
ALLGATHER_BUCKET = 500_000_000   # zero_allgather_bucket_size() default (elements)
ASSUMPTION = (f"DeepSpeed bf16 pipeline: {SOURCE} (fp32 gradient buffer of 4 bytes per "
              f"parameter unpartitioned, fp32 accumulation every micro-batch, bf16 "
              f"all-reduce of it, bf16 all-gather of the updated weights in shards of "
              f"zero_allgather_bucket_size's default 5e8 elements, copied out of "
              f"PyTorch's flat buffer as its ProcessGroupNCCL does at cf1380dfb6: both "
              f"ASSUMED for the run); gradient clipping not priced (runs only when the "
              f"norm exceeds the limit)")


def applies(cfg, lay) -> bool:
    """Whether ``lay`` runs ``BF16_Optimizer``: DeepSpeed's pipeline engine with bf16."""
    return lay.engine == "deepspeed" and lay.pp > 1 and cfg.dtype == "bfloat16"


def state_bytes(psi: float) -> float:
    """Bytes beyond ZeRO-1's accounting: the unpartitioned fp32 gradient buffer."""
    return FP32_GRAD_BYTES * psi


def largest_numel(cfg, tp: int, pp: int, stage: int, layers: int) -> float:
    """Elements of the largest parameter tensor on a rank of ``stage``: the (tied)
    word embedding's V h / t on the first and last stage, else a layer's largest matrix
    (the MLP's h f / t, or the fused QKV's 3 h h / t)."""
    out = max(cfg.d_model * cfg.d_ff, 3 * cfg.d_model * cfg.d_model) / tp if layers else 0.0
    if stage == 0 or stage == pp - 1:
        out = max(out, cfg.vocab_size * cfg.d_model / tp)
    return out


def transient_bytes(psi: float, largest: float) -> tuple[float, float]:
    """(during the pipeline, at the DP sync) transient bytes: the fp32 cast of the largest
    parameter (``largest`` elements) in ``update_hp_grads``, beside the activations held;
    the bf16 copy of the whole fp32 buffer in ``allreduce_bucket``, once the pipeline has
    drained (no activations held)."""
    return 4 * largest, 2 * psi


def micro_batch_seconds(psi: float, layers: int, prof) -> float:
    """Seconds of ``update_hp_grads`` after one micro-batch's backward on a stage of
    ``psi`` parameters in ``layers`` layers."""
    return compute_time(0.0, HP_GRAD_BYTES * psi, prof, "float32",
                        launches=KERNELS_PER_LAYER * max(layers, 1))


def allgather_shards(psi: float) -> int:
    """``all_gather_dp_groups``' shard count for a rank of ``psi`` parameters: its
    partition (psi / dp) x dp // the bucket, at least 1 (module docstring)."""
    return max(1, int(psi // ALLGATHER_BUCKET))


def dp_sync(psi: float, lay, prof, stage: int) -> float:
    """Seconds of ``ReduceGrads`` and the step's weight all-gather on a rank of ``stage``:
    the bf16 all-reduce of the fp32 buffer with its copies, then the all-gather of the
    updated bf16 partitions, shard by shard, each copied out of PyTorch's flat buffer
    (module docstring)."""
    if lay.dp == 1:
        return 0.0
    ranks = tuple(lay.dp_ranks(0, stage))
    shards = allgather_shards(psi)
    return (C.group_price("all_reduce", 2 * psi, ranks, prof)
            + compute_time(0.0, REDUCE_COPY_BYTES * psi, prof, "float32", launches=3)
            + shards * C.group_price("all_gather", 2 * psi / shards, ranks, prof)
            + compute_time(0.0, ALLGATHER_COPY_BYTES * psi, prof, "bfloat16",
                           launches=shards * lay.dp))


def step_seconds(psi: float, dp: int, adam: float, prof) -> float:
    """Seconds of ``BF16_Optimizer.step``'s memory passes beside its communication:
    ``adam`` (the planner's Adam on the partition) plus the norm, the bf16 copy of the
    partition and the zeroing of the fp32 buffer."""
    return adam + compute_time(0.0, STEP_BYTES * psi + PARTITION_BYTES * psi / dp, prof,
                               "float32", launches=3)


def tied_bytes(cfg, tp: int) -> float:
    """Bytes of ``ReduceTiedGrads``' all-reduce: the tied embedding's fp32 gradient."""
    return 4 * cfg.vocab_size * cfg.d_model / tp
