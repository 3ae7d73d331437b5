"""The training frameworks the planner prices, as their source code runs them.

A :class:`~workbench.plan.layout.Layout` names one (``framework=``); what differs between
them, and what the estimate and the memory model read from here:

- ``"megatron"`` (NVIDIA Megatron-LM; the default with ZeRO 0 or 1, its distributed
  optimizer being ZeRO-1): gradients accumulate in a contiguous ``main_grad`` buffer and
  are all-reduced (distributed optimizer: reduce-scattered) from it; with bf16 that buffer
  and the reduction are fp32: ``megatron/training/arguments.py`` ("bfloat16 requires
  gradient accumulation and all-reduce to be done in fp32": ``accumulate_allreduce_grads_
  in_fp32`` forced on unless ``--grad-reduce-in-bf16``; the same in the 2021-22 releases,
  ``megatron/arguments.py``), the buffer's dtype ``torch.float`` if so, else the
  parameters' (``megatron/model/distributed.py``, ``_get_buffer_type``).  fp16 runs keep
  a 16-bit buffer.  The DP sync runs after the pipeline flush unless
  ``overlap_grad_reduce`` (``--overlap-grad-reduce``); the TP collectives of sequence
  parallelism stand beside their GEMMs unless ``tp_comm_overlap`` (``--tp-comm-overlap``,
  Transformer Engine's userbuffers: ``plan.tp_overlap``).  ZeRO-2/3 are not Megatron's.
- ``"deepspeed"`` (Microsoft DeepSpeed; the default with ZeRO 2 or 3): gradients reduced
  in the model's 16-bit dtype (``communication_data_type`` defaults to it,
  ``deepspeed/runtime/config.py``), every micro-batch with ZeRO-2/3, overlapped with the
  backward (``overlap_comm``), ZeRO-3's gathers prefetched (``plan.zero_cost``).
  With pp > 1 (ZeRO 0/1 only), its 2021 pipeline engine as its source runs it:
  ``plan.deepspeed_pipe`` (TrainSchedule, blocking p2p) and ``plan.deepspeed_step``
  (partitioned p2p bookkeeping, ReduceTiedGrads / ReduceGrads, FP16_Optimizer).
- ``"deepspeed-0.3"`` (DeepSpeed v0.3.13-0.3.16, spring 2021, ZeRO-3 only, no model
  parallelism): ZeRO-3 as those releases ran it (``plan.zero3_2021``: one all-gather per
  parameter on a list of dp chunks, host-synchronous fetches, a reduce-scatter per
  parameter); for runs of that time, e.g. Narayanan et al. SC'21 Table 2.
- ``"workbench"``: this library's own Hybrid recipe (``plan.dry_run`` runs it):
  gradients reduced in the parameters' dtype after the flush (ZeRO 0/1), ZeRO-2/3 as
  ``parallel.strategies.zero3`` (DeepSpeed's schedule, one layer per gather).

- ``"fsdp"`` (PyTorch FSDP2, ``torch.distributed.fsdp.fully_shard``, applied per
  transformer block as torchtitan does; ``zero=3`` only): the unit of communication is
  one block (``FSDPParamGroup``: one all-gather for all its parameters, one
  reduce-scatter for all its gradients), all-gathered in ``MixedPrecisionPolicy.
  param_dtype`` (bf16: 2 bytes) before its forward and, as ``reshard_after_forward``
  (default True) freed it, again before its backward; gradients reduce-scattered every
  micro-batch (no ``set_requires_gradient_sync(False)``) in ``reduce_dtype``: fp32, 4
  bytes, torchtitan's default (``training.mixed_precision_reduce = "float32"``,
  ``mixed_precision_param = "bfloat16"``; FSDP2 with ``reduce_dtype=None`` reduces in
  the parameters' original dtype, fp32 too: ``_fsdp_api.py``); prefetch one unit ahead
  forward (the next block's all-gather is issued by its pre-forward hook while the
  current block computes, ``_fsdp_state.py``: implicit forward prefetch, the copy-in
  stream waiting on the previous all-gather's event) and backward (the previous block:
  ``_pre_backward`` calls ``pre_backward(default_prefetch)`` when no modules were set
  with ``set_modules_to_backward_prefetch``).  The sharded parameters are the fp32 master weights
  (no separate copy: ``MixedPrecisionPolicy``'s docstring), so the model states total
  ZeRO-3's 16 bytes per parameter / dp; the working buffers are two gathered 16-bit
  units, one unit's 16-bit gradient and its fp32 copy for the reduce-scatter
  (``memory.stage_memory``).  ASSUMPTION: FSDP2's all-gather and reduce-scatter streams
  share the rank's network as one stream (``zero_cost``); both CUDA streams exist, but
  they share one NIC and NCCL communicator.  The copies around each collective
  (copy-in, copy-out, the reduce-scatter's bf16 -> fp32 chunk-cat, the gradient
  accumulation) and the attention kernel SDPA picks (FlashAttention-2 on the H100 in
  the 2024-2025 releases) are ``plan.fsdp2_cost``'s, as is which units stay gathered
  from forward to backward (FSDP2's root: the embedding, final norm and output layer;
  torchtitan's last block), gathered once per micro-batch.  Not modeled: the root is
  one unit (one gather) where the estimate has two blocks, its embedding's and its
  head's, gathered apart.
"""
from __future__ import annotations

__all__ = ["FRAMEWORKS", "resolve", "grad_reduce_bytes", "grad_buffer_extra_bytes",
           "loss_extra_bytes", "assumptions"]

FRAMEWORKS = ("megatron", "deepspeed", "workbench", "fsdp", "deepspeed-0.3")

# torchtitan (pytorch/torchtitan, torchtitan/config: Training.mixed_precision_reduce
# "float32", mixed_precision_param "bfloat16"): the FSDP2 recipe priced here
FSDP_REDUCE_BYTES = 4
FSDP_PREFETCH_UNITS = 1


def resolve(framework, zero: int) -> str:
    """The framework a layout runs: ``framework`` checked, or the default for its ZeRO
    stage (Megatron-LM for 0 and 1, DeepSpeed for 2 and 3)."""
    if framework is None:
        return "megatron" if zero <= 1 else "deepspeed"
    if framework not in FRAMEWORKS:
        raise ValueError(f"Layout: framework={framework!r}; use one of {list(FRAMEWORKS)} "
                         f"(or None: Megatron-LM for zero<=1, DeepSpeed for zero>=2)")
    if framework == "megatron" and zero >= 2:
        raise ValueError(f"Layout: framework='megatron' with zero={zero}: Megatron-LM's "
                         f"distributed optimizer shards the optimizer states only (ZeRO-1); "
                         f"use zero<=1, or framework='deepspeed' for ZeRO-{zero}")
    if framework == "deepspeed-0.3" and zero != 3:
        raise ValueError(f"Layout: framework='deepspeed-0.3' with zero={zero}: it prices "
                         f"the ZeRO-3 of DeepSpeed's spring-2021 releases (plan.zero3_2021); "
                         f"use zero=3, or framework='deepspeed' for ZeRO-{zero}")
    if framework == "fsdp" and zero != 3:
        raise ValueError(f"Layout: framework='fsdp' with zero={zero}: FSDP2's fully_shard "
                         f"(reshard_after_forward=True) shards parameters, gradients and "
                         f"optimizer states, ZeRO-3; use zero=3, or framework='megatron' "
                         f"for zero<=1 / 'deepspeed' for zero=2")
    return framework


def grad_reduce_bytes(framework: str, dtype: str) -> int:
    """Bytes per gradient element the data-parallel reduction moves (module docstring)."""
    if framework == "megatron" and dtype == "bfloat16":
        return 4
    if framework == "fsdp":
        return FSDP_REDUCE_BYTES
    return 2


def grad_buffer_extra_bytes(framework: str, dtype: str) -> int:
    """Bytes per parameter the framework's gradient buffer holds beyond the 16-bit
    gradients ZeRO's accounting counts (Megatron with bf16: an fp32 ``main_grad``, 4
    bytes where ZeRO counts 2).  FSDP: none beyond the states (its fp32 gradient
    shards stand where ZeRO counts 16-bit ones and its fp32 parameter shards are the
    master copy: the same 16 bytes per parameter / dp); its unit buffers are counted
    by ``memory.stage_memory``."""
    if framework == "fsdp":
        return 0
    return grad_reduce_bytes(framework, dtype) - 2


def loss_extra_bytes(framework: str, tp: int = 1) -> int:
    """Bytes per logit element (of the last stage's s b V / t) live at the loss's peak
    beyond the 4 of the fp32 (log-)softmax it saves for backward, which
    ``memory.stage_memory`` counts with the activations.

    Megatron-LM (and DeepSpeed, whose GPT recipes call Megatron's loss):
    ``_VocabParallelCrossEntropy`` (``megatron/core/tensor_parallel/cross_entropy.py``,
    f2e5db402c; ``mpu/cross_entropy.py`` of 2021 the same, the caller upcasting) makes
    ONE fp32 copy of the 16-bit logits and works on it in place (``sub_``, ``torch.exp(...,
    out=)``, ``div_``; its backward turns the saved softmax into the gradient in place,
    ``mul_``), so beside the 4 bytes are only the 16-bit logits (forward) or the 16-bit
    cast of the gradient autograd makes for the 16-bit input (backward): 2.
    PyTorch's ``F.cross_entropy`` on ``logits.float()`` (torchtitan's ``loss_fn``,
    9dec370ad2, and this library's models, ``models/gpt.py`` / ``llama.py``): log_softmax
    saves its fp32 output; in the backward nll_loss's gradient (fp32, dense) and
    log_softmax's input gradient (fp32) are allocated while it lives: 8 (measured on
    the CPU with ``torch.distributed._tools.mem_tracker``, tests/test_plan_memory_peak.py:
    3.0 x the 4 bytes at the peak).  torchtitan with tensor parallelism (tp > 1) runs
    the loss under ``loss_parallel`` (``torch/distributed/tensor/parallel/loss.py``): its
    log-softmax keeps the fp32 input, the shifted logits and their exp at once, and its
    fused nll / log-softmax backward allocates a zeros tensor, exp, their sum and the
    product: 16 bytes per logit at the peak (measured the same way on a one-rank gloo
    mesh), 12 beyond.  This library's vocabulary-parallel path (tp > 1,
    ``parallel/ops_table/cross_entropy``: Megatron's algorithm written with torch ops,
    not in place) holds the 16-bit logits, their fp32 copy, the shifted logits and their
    exp (saved) at once in the forward: 14 bytes per logit per rank at the peak, measured
    on simulated ranks with MemTracker (tp 2 and 4, tests/test_plan_dryrun_agree.py),
    10 beyond; on one rank it runs PyTorch's kernel: 8.  The dry run and the estimate of
    ``framework="workbench"`` both read these figures (``memory.workspace_bytes``)."""
    if framework in ("megatron", "deepspeed", "deepspeed-0.3"):
        return 2
    if framework == "fsdp" and tp > 1:
        return 12
    if framework == "workbench" and tp > 1:
        return 10
    if framework in ("fsdp", "workbench"):
        return 8
    raise ValueError(f"loss_extra_bytes: framework={framework!r}; use one of {list(FRAMEWORKS)}")


_FRAMEWORK_WORDS = {
    "megatron": "Megatron-LM: gradients in a {g} buffer, reduced {when}",
    "deepspeed": "DeepSpeed: gradients reduced in 16 bits{z3}",
    "fsdp": "PyTorch FSDP2 (fully_shard per block, torchtitan's policy): bf16 all-gather "
            "of one block, prefetched one block ahead, re-gathered for backward, gradients "
            "reduce-scattered in fp32 every micro-batch; all-gather and reduce-scatter "
            "share the network as one stream (ASSUMPTION)",
    "deepspeed-0.3": "DeepSpeed v0.3.13-0.3.16 (spring 2021) ZeRO-3, v0.3.13's hooks ASSUMED "
                     "from the dates (v0.3.14-0.3.16's trace is off by one: no prefetch, no "
                     "reuse keeping, slower): one all-gather per "
                     "parameter on a list of dp chunks (dp copies each, host-synchronous "
                     "fetches), per-parameter reduce-scatter, DeepSpeedExamples' Megatron "
                     "ZeRO-3 config ASSUMED; host cost per chunk measured on the H100 "
                     "machine's host; the prefetch's live-parameter counter as at step 2 "
                     "ASSUMED (it drifts lower every step, opening the prefetch: later "
                     "steps are faster) (plan.zero3_2021)",
    "workbench": "this library's recipe: gradients reduced in 16 bits {when}{zw}"}


def assumptions(cfg, lay, prof, attention, overlap, overlap_grad_reduce) -> tuple:
    """What ``Estimate.assumptions`` lists: the framework behaviour, the attention kernel,
    the profile's figures cited as ASSUMPTION or UNCERTAIN."""
    when = ("module by module in the last backward (overlap_grad_reduce)"
            if overlap_grad_reduce else "after the pipeline flush")
    g = "fp32" if grad_reduce_bytes(lay.engine, cfg.dtype) == 4 else "16-bit"
    z3 = (", ZeRO-3 gathers module by module (1e5-element persistence, 5e7 prefetch, "
          "5e8 reduce buckets)" if lay.zero == 3 else f", ZeRO-{lay.zero}" if lay.zero else
          ", no ZeRO")
    zw = (", ZeRO-3 one gather per layer" if lay.zero == 3 else f", ZeRO-{lay.zero}"
          if lay.zero else ", no ZeRO")
    out = [_FRAMEWORK_WORDS[lay.engine].format(g=g, when=when, z3=z3, zw=zw)]
    if attention == "flash" and prof.measured:   # the kernel measured on the device
        kernel = {"cudnn": "cuDNN's fused attention", "flash": "FlashAttention-2"}.get(
            prof.measured["attention_backend"], prof.measured["attention_backend"])
        out.append(f"attention: {kernel} at the rates measured on the device "
                   f"({prof.measured['file']}); GEMMs at their measured rates")
    elif attention == "flash" and prof.attention_table:   # a published per-shape table
        out.append(f"attention: FlashAttention-2 at the rates its author published for "
                   f"each shape on the A100 ({prof.attention_table}: Dao 2023 Fig. 4, "
                   f"sim_mesh.fa2_a100); forward and backward split at one ratio ASSUMED")
    elif attention == "flash":     # name the kernel whose rate the profile took
        src = prof.citations.get("efficiency.attention", "no source cited").split(":")[0]
        out.append(f"attention: a fused FlashAttention kernel at "
                   f"{prof.efficiency.get('attention', 1.0):.0%} of peak ({src})")
    else:
        out.append("attention: Megatron's unfused core (Korthikanti Table 2)")
    if lay.zero >= 2 and not overlap:
        out.append("ZeRO collectives not overlapped (overlap=False)")
    marked = sorted(k for k, v in prof.citations.items()
                    if "ASSUMPTION" in v or "UNCERTAIN" in v)
    if marked:
        out.append(f"profile {prof.name}'s figures marked ASSUMPTION or UNCERTAIN: "
                   f"{', '.join(marked)}")
    return tuple(out)
