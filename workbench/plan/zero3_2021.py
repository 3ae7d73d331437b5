"""DeepSpeed ZeRO-3 as its spring-2021 releases ran it (``framework="deepspeed-0.3"``).

The version: DeepSpeed v0.3.13 (2021-03-16, the first release with ZeRO-3) to v0.3.16
(2021-04-29); Narayanan et al. (SC'21, arXiv 2104.04473 v1 of 2021-04-09) compare PTD-P
with "ZeRO-3 without model parallelism" of that time.  What they do, per micro-batch,
read from ``deepspeed/runtime/zero/stage3.py`` and ``partition_parameters.py``
(microsoft/DeepSpeed, tag v0.3.13, 12a53b4383); the releases after it differ in two
places that change the step (``simulate``'s ``version``; everything else below reads
the same in v0.3.16, a12aaedc9e):

- **v0.3.14 on (2021-04-08, 0cd9abf204): the trace is off by one.**  Commit 7b46d11fa
  (PR #867, merged 2021-04-07) adds a forward pre-hook on the root module that resets
  the trace's step id (``_pre_forward_hook``, v0.3.14 ``stage3.py:1041-1052``; v0.3.16
  ``:1370-1382``), registered after ``_register_hooks_recursively`` gave the root its
  own pre-forward hook (``:1131``), so every forward runs the root's hook first (its
  ``increment_step``: step id 1) and then the reset (0): each later module meets the
  step id of the module before it in the recorded trace.  ``get_params_to_prefetch``
  then finds ``sub_module.id != sub_module_trace[step_id]`` ("Tracing failed.
  Prefetching is disabled", v0.3.14 ``:198-202``) and ``get_reuse_distance_in_numel``
  the same ("Tracing failed. Cannot tell if the sub_module ... is reused", ``:233-238``,
  returning 1e12): no module prefetches or keeps its parameters for a reuse but the
  root, whose own step id (0, taken before the reset) still matches
  ``sub_module_trace[0]``: its forward hook prefetches as before, and it keeps the
  tied embedding from its forward to its backward.  Two consecutive trace entries of
  one module with parameters would escape it too; Megatron's parent modules (the
  layer, the MLP) sit between a recomputed matrix and its backward, so none does.
  Diagnosed by a user in microsoft/DeepSpeed issue #1069 (2021-05-27: "this causes
  the rest of the step ids in the forward pass to be off by 1, which was causing the
  prefetches to be skipped"); the same hooks through v0.5.10, until PR #1453
  (4912e0ad7, 2022-01-20, v0.6.0) replaced the coordinator.
- **v0.3.15 on (2021-04-19, 2c2a7f31bc): a norm per fetched parameter.**  The
  ZeRO-Infinity commit 0d4a54a04 adds to ``fetch_sub_module``, for every parameter of
  the module (its own, the persistent ones too), ``print_rank_0(f"... norm
  {param.norm()}", force=False)`` (v0.3.16 ``stage3.py:441-445``): the f-string is
  built whether or not it prints, so each fetch runs a norm over the whole gathered
  parameter (16-bit, read once at the memory bandwidth) and formats the 0-dim result,
  which PyTorch's ``Tensor.__format__`` does through ``.item()``: a device-to-host copy
  the host waits for (priced as one ``torch.cuda.synchronize``, ``SYNC_S``, ASSUMED).
  Removed by microsoft/DeepSpeed PR #1188 (2021-06: "Removing the norm computation in
  debug printing").

The version priced (``VERSION``) is v0.3.13's behaviour, ASSUMED from the dates: the
paper names no version, and its first version (2021-04-09) already reports the runs,
while PR #867 was merged on 2021-04-07 and first released in v0.3.14 on 04-08.  With
v0.3.14-0.3.16's hooks the same rows are slower (``benchmarks/zero3_2021_breakdown.py``,
columns ``v0.3.14`` and ``v0.3.16``).  What v0.3.13 does, per micro-batch:

- **one collective per parameter**: ``PartitionedParameterCoordinator._all_gather``
  calls ``param.all_gather(param_list, async_op=True)``, which loops over the list and
  runs ``_allgather_param`` for each parameter (the coalesced ``_allgather_params`` is
  the synchronous path, not used by the coordinator).  ``_allgather_param`` allocates the
  gathered tensor with ``torch.zeros`` (a fill of the whole parameter), calls
  ``torch.cuda.synchronize()``, builds a Python list of ``world_size`` chunk views
  (``flat_tensor.narrow`` per rank) and calls ``torch.distributed.all_gather(partitions,
  ...)`` with that list; PyTorch's ProcessGroupNCCL (``allgather``, its post hook) gathers
  into a flat buffer of its own and then runs ``recordStream`` and ``copy_`` per chunk on
  the NCCL stream: ``world_size`` copies per parameter.
- **host-synchronous fetches**: ``fetch_sub_module`` (each module's pre-forward and
  pre-backward hook) gathers what is not there and, when it gathered or waits on a
  prefetch, ``_synchronize_communication``: ``handle.wait()``, ``comm_stream.
  synchronize()`` and ``torch.cuda.synchronize()``: the host waits for every stream.
- **prefetch** (``prefetch_next_sub_modules``): only when no gather is in flight and the
  gathered parameters number fewer than ``stage3_max_live_parameters``; then the next
  not-gathered parameters of the recorded trace, one collective each, until they reach
  ``stage3_prefetch_bucket_size`` elements.
- **the live-parameter counter** behind that check (``total_available_parameter_numel``)
  is raised when ``fetch_sub_module`` or the prefetch gathers a parameter (``:391``,
  ``:329``) and lowered when one is released (``:439``) or, at the end of each backward,
  by ``_partition_all_parameters`` -> ``release_and_reset_parameter`` for every parameter
  then gathered (``:461``), the persistent ones included; but ``_post_step`` gathers the
  persistent parameters through ``Init._all_gather`` (``:2344``; partition_parameters.py
  ``:473-495``), which never raises it.  So the counter starts step 2 (the first with a
  recorded trace, so the first that prefetches) at 0, not at the persistent parameters'
  elements P, and every later step 1 x P lower: step k at -(k - 2) P (micro-batches after
  the step's first: one P lower still).  The same lines in v0.3.16 (stage3.py ``:359``,
  ``:424``, ``:475``, ``:497``, ``:2726``) and to v0.5.x.  It opens the prefetch check
  as a run goes on (GPT 530B, P = 28 M a step, the tied embedding's 1.05e9 held: the
  check opens at the LayerNorms from step 4, at the projection, prefetching fc1, from
  step 19, before every matrix from step 80; tests/test_z3big.py).  Which step the
  published throughput was measured at is not known: the estimate prices step 2
  (``COUNTER_STEP``, ASSUMED; later steps prefetch more and are faster).
- **release** after a module's forward / backward unless the trace uses the module again
  within ``stage3_max_reuse_distance`` elements (``_keep_for_later``), or the parameter
  is persistent (fewer than ``stage3_param_persistence_threshold`` elements: biases,
  norms, never partitioned).
- **the tied word embedding**: Megatron-LM-v1.1.5-ZeRO3 (DeepSpeedExamples, commit
  7b5abd576e, ``megatron/model/gpt2_model.py``) registers it as an external parameter of
  the root module, so it is gathered by the root's pre-forward hook and stays gathered
  until the root's post-backward hook: for the whole micro-batch, counted against
  ``stage3_max_live_parameters`` (so with a vocabulary of 51,200 and h = 12,288, 629 M of
  the 1e9, prefetching stops whenever the module running holds 371 M more).
- **gradients** (``contiguous_gradients`` on): each parameter's gradient hook
  (``reduce_independent_p_g_buckets_and_remove_grads``) reduces the bucket before it
  once ``reduce_bucket_size`` would overflow (``reduce_ipg_grads``: first
  ``reduction_stream.synchronize()``, the host waiting for the previous reduction); a
  parameter above the bucket size is its own bucket; the reduction is
  ``_reduce_scatter_gradients``: per parameter a list of ``world_size`` chunk views
  (``narrow``) and ``torch.distributed.reduce_scatter`` on that list, which
  ProcessGroupNCCL flattens first (``reduce_scatter``'s pre hook: ``recordStream`` and
  ``copy_`` per chunk), in the model's 16 bits.  Every parameter with a gradient has
  its hook (``create_reduce_and_remove_grad_hooks``), the persistent ones too: a bias
  or a norm's weight of h elements is its own reduce-scatter of h / p per chunk (12 per
  GPT layer, 4 of them matrices).  Before a bucket's reduce-scatters ``average_tensor``
  divides by the world size on the reduction stream (``tensor.div_``), which c10d's NCCL
  stream then waits for: the whole ipg buffer (``reduce_bucket_size`` elements however
  full) and the extra-large gradient (``predivide_seconds``; hidden behind the NCCL
  stream on the published rows).  The epilogue reduces the last bucket and
  synchronizes the reduction stream.
- **the persistent parameters** are released after every backward too
  (``backward`` -> ``_partition_all_parameters``: every gathered parameter,
  ``release_and_reset_parameter``), so the next micro-batch gathers each of them again,
  one list collective each, at its module's first use; after the optimizer step
  ``_post_step`` gathers them all with the synchronous path (``_allgather_params``: one
  all-gather on a list of p chunks, then per parameter and per rank a ``narrow`` and a
  ``copy_`` into the parameter: with 770 biases and norms in GPT-3 175B, 1.2 million
  Python copies per step at 1,536 ranks).
- ProcessGroupNCCL runs every collective of one process group on one NCCL stream
  (``ncclStreams_[key]``), so the gathers and the reductions of the data-parallel group
  queue behind one another (PyTorch ``torch/lib/c10d/ProcessGroupNCCL.cpp``, 1.8 to
  1.10: ``allgather`` / ``reduce_scatter`` as described).

The configuration is DeepSpeed's own example for Megatron with ZeRO-3 (ASSUMPTION: the
paper does not print its configuration): DeepSpeedExamples ``Megatron-LM-v1.1.5-ZeRO3/
examples/ds_zero_stage_3_config.json`` (commit 44be774aad): max live 1e9, reuse distance
1e9, prefetch bucket 6.039798e7, reduce bucket 6.710886e7, contiguous gradients; its
persistence key is misspelt (``stage3_param_persitence_threshold``), so the default 1e5
(``constants.py``) holds; ``overlap_comm`` defaults to True for ZeRO-3.

The host costs are measured (``benchmarks/host_chunk_overhead.py``, on the H100
machines lent to this project, torch 2.11, 2026-11-26; figures in its docstring), per
rank: DeepSpeed's all-gather loop (``narrow``, ``get_rank(group)``, append) 6.9 us (6.6
and 7.1 at 1,536 and 384 ranks), its reduce-scatter loop 7.5 us (7.4, 7.6);
ProcessGroupNCCL's per-chunk ``recordStream`` + ``copy_(non_blocking=True)``, a C++ loop,
6.1 us: a TorchScript loop of ``copy_`` (no Python per call; median 5.65 us of 5.2-8.8)
plus ``record_stream`` (0.42 us); the same from Python took 6.4-13.9 us on two machines
(UNCERTAIN: the machines differ by up to 1.5x run to run).  ``_allgather_params``'
reassembly, per parameter and rank, two ``narrow`` (3.9 us each, median of 3.7-4.1), a
``view`` (0.48 x narrow: the ratio timed on CPU tensors here, ASSUMED to hold on the
GPU host) and a ``copy_`` from Python (6.1 us, median of 5.8-8.9 on one machine).  Per
release the blocking ``torch.ones(1).half().to(device)`` 21 us beyond the wait for the
compute stream; one ``torch.cuda.synchronize`` 9.6 us.  ASSUMPTION: the DGX A100 hosts
of 2021 (torch 1.8, an AMD EPYC 7742) cost the same.

Read for GPT 530B's shapes (h = 20,480: every matrix above ``reduce_bucket_size``, fc1
and fc2's 1.68e9 elements above ``stage3_max_live_parameters``) and left out as
negligible or already priced (v0.3.13 line numbers): a gradient above the bucket is kept
out of the ipg buffer (no copy, ``stage3.py:1452-1453``) and reduced alone by
``reduce_ipg_grads`` (``:1689-1716``: the pre-division, priced), its reduce-scatter a
``narrow`` per rank with a ``torch.zeros`` + copy only for the padded last chunk
(partition_parameters.py ``:733-771``); ``partition_previous_reduced_grads`` copies the
rank's partition of each gradient (``:1606-1687``) into ``grads_in_partition``, which
``_release_ipg_buffers`` drops every step (``:1182-1188``) so its ``torch.zeros`` of the
rank's partition (1.7 GB at 640 ranks, about 1 ms) recurs; ``fetch_sub_module`` gathers
a parameter whole whatever its size (``:357-411``) and ``get_params_to_prefetch`` adds
whole parameters until the bucket is reached (``:205-216``); no
``torch.cuda.empty_cache`` in the ZeRO-3 path (only 1-bit Adam's, v0.3.13 and v0.3.16);
``see_memory_usage`` and ``print_rank_0`` return at once unless forced
(runtime/utils.py ``:548-550``, ``stage3.py:42-44``); ``LinearFunctionForZeroStage3``
replaces ``F.linear`` only while the model is built (partition_parameters.py
``:192-194``, restored ``:213-214``).

Priced beside the hooks (found by ``benchmarks/zero3_audit.py``, each from its source
line, ``CKPT_*`` and ``step_host_seconds``' constants): activation checkpointing:
Megatron-LM-v1.1.5-ZeRO3 (7b5abd576e ``megatron/initialize.py:108-117``) runs
DeepSpeed's, and the example script (44be774aad ``ds_pretrain_gpt2-zero3.sh``) turns on
only ``partition_activations``, which with one model-parallel rank is a clone of each
checkpointed input (activation_checkpointing/checkpointing.py ``:446-455``) and, in
backward, a fill, a copy and a one-rank all-gather's two copies (``:284-309``), one
per checkpointed chunk: 0.09 s a step at 530B, micro-batch 4, chunks of 2, on the
compute stream (``partition_activation_seconds``, ``Entry.copies``); the optimizer
step's host waits per fp16 parameter tensor (the overflow check's ``float()``, the
norm's ``.item()``), the timers' synchronizes of ``wall_clock_breakdown`` and
Megatron's, the blocking one-element copies, the per-tensor narrow loops and the scalar
all-reduces (``step_host_seconds``): 0.03 s a step.  The
script's ``--checkpoint-num-layers 2`` (``chkp_layers=2``) is the layout's
``recompute_num_layers`` (``plan.recompute_chunks``): the trace recomputes a chunk of
two layers, then runs their backwards (``gpt_trace``'s ``chunk``), its checkpoint copies
one per chunk.  Chunks that do not divide the layers are refused (``check_chunks``):
Megatron-LM-v1.1.5 runs layer 0 again in the last chunk and v0.3.13-0.3.16 assert on its
second gradient in the backward ("Multiple gradient reduction is currently not
supported", ``stage3.py:1446-1449``), so GPT 530B's 105 layers run in chunks of one.

The layer itself is Megatron-LM-v1.1.5-ZeRO3's as the example script runs it: without
its fusion flags, so eager ``masked_fill_`` + softmax, bias add + GeLU and bias add +
dropout + residual add where the planner's Megatron layer prices fused kernels
(``unfused_bytes`` / ``unfused_seconds``, ``UNFUSED_SOURCE``; the estimate adds them to
the layer's forward and backward for this framework): 14 ms a layer at GPT 175B,
micro-batch 4, with full recompute (found by ``benchmarks/zero3_audit.py``'s re-audit).

Not modeled: the parent modules' hooks (no parameters of their own) and the host's
Python in the hooks (no measurement: to explain the 530B rows alone each of a step's
4,316 host waits would have to cost 11-16 ms more, ``benchmarks/zero3_audit.py``); the
caching allocator's retries near the memory limit (no figure for them; the 530B rows at
32 and 48 GB are as optimistic as the one at 78 GB).  The memory is v0.3.13's backward
peak as its source holds it (:func:`backward_peak_bytes`, which ``memory.stage_memory``
counts for this framework; ``benchmarks/zero3_audit.py`` reads it term by term: 78.3 GB
at 530B / 640 with chunks of two layers, 79.3 with the row's chunks of one, of the a100
profile's 80.1 GB usable, the capacity CUDA reports; c10d's
flat buffer of a list collective, a whole parameter, is live after that row's peak, at
the peak at 1,120 and 2,240 GPUs).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..sim_mesh.cost import finish_beside, overlap_rate, wire_bytes
from . import costs as C

__all__ = ["FRAMEWORK", "COUNTER_STEP", "VERSION", "VERSIONS", "Entry", "gpt_trace",
           "simulate", "dp_sync", "dp_sync_parts", "list_collective",
           "partition_activation_seconds", "step_host_seconds", "post_step_gather",
           "predivide_seconds", "counter_start", "behaviour", "backward_peak_bytes",
           "UNFUSED_SOURCE", "unfused_bytes", "unfused_seconds", "chunk_layers",
           "check_chunks"]

FRAMEWORK = "deepspeed-0.3"
# the release whose hooks the estimate prices, ASSUMED from the dates (module docstring)
VERSION = "0.3.13"
# release -> (trace off by one: no prefetch, no reuse keeping; a norm + .item() per
# fetched parameter), read from each tag's stage3.py (module docstring)
VERSIONS = {"0.3.13": (False, False), "0.3.14": (True, False),
            "0.3.15": (True, True), "0.3.16": (True, True)}

# DeepSpeedExamples Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config.json
# (44be774aad); persistence: deepspeed/runtime/zero/constants.py v0.3.13 (module docstring)
PREFETCH_NUMEL = 60_397_980
MAX_LIVE_NUMEL = 1_000_000_000
MAX_REUSE_NUMEL = 1_000_000_000
PERSISTENCE_NUMEL = 100_000
REDUCE_BUCKET_NUMEL = 67_108_860
# the step whose live-parameter counter the estimate prices (module docstring: it drifts
# down by the persistent parameters' elements each step): 2, the first that prefetches,
# ASSUMED (the published runs' measured step is not stated)
COUNTER_STEP = 2

# host seconds, measured by benchmarks/host_chunk_overhead.py (module docstring)
AG_LOOP_S = 6.9e-6         # _allgather_param's loop, per rank
RS_LOOP_S = 7.5e-6         # _reduce_scatter_gradient's loop, per rank
RECORD_COPY_S = 6.1e-6     # recordStream + copy_(non_blocking=True), per rank, c10d's loop
RELEASE_S = 2.1e-5         # torch.ones(1).half().to(device) (then waits for the stream)
SYNC_S = 9.6e-6            # torch.cuda.synchronize() on an idle device
# _allgather_params' reassembly, per parameter and rank: two narrow, a view, a copy_
# from Python; narrow 3.9 us and copy_ 6.1 us measured (medians), view 0.48 x narrow
# (the ratio measured on CPU tensors, the same dispatch without CUDA) (module docstring)
NARROW_S = 3.9e-6
REASSEMBLE_S = 2 * NARROW_S + 0.48 * NARROW_S + 6.1e-6


# DeepSpeed v0.3.13 activation_checkpointing/checkpointing.py with partition_activations
# and one model-parallel rank (Megatron-LM-v1.1.5-ZeRO3 passes its mpu, so mp_group is a
# one-rank group, not None): bytes per 16-bit element of a checkpointed layer's input.
# Forward, CheckpointFunction.forward (:446-455): ``item.detach().contiguous().view(-1)
# .narrow(0, start, size).clone()``, the whole input at mp 1 (read + write).  Backward,
# get_full_inputs (:284-309): ``torch.zeros`` of the input (write), ``part_i.copy_(item)``
# (read + write), ``dist.all_gather(partitions, ...)`` on the one-rank group: NCCL copies
# the input into c10d's flat output buffer (a one-rank all-gather out of place is a
# device copy: read + write) and c10d copies the buffer back out to the list's view
# (read + write).  The attention mask, the last argument, is not partitioned
# (``args[:-1]``).
CKPT_FORWARD_BYTES = 2 + 2
CKPT_BACKWARD_BYTES = 2 + (2 + 2) + (2 + 2) + (2 + 2)
CKPT_FORWARD_KERNELS, CKPT_BACKWARD_KERNELS = 1, 4

# Host waits of a step outside the hooks, each priced as one SYNC_S (the drain itself is
# the GPU work before it, priced where that work is), read at v0.3.13 and the example's
# Megatron (DeepSpeedExamples 7b5abd576e Megatron-LM-v1.1.5-ZeRO3) and configuration
# (44be774aad ds_zero_stage_3_config.json: "wall_clock_breakdown": true):
# - per fp16 parameter tensor, in the optimizer step: has_overflow_partitioned_grads_serial
#   -> _has_inf_or_nan's ``float(x.float().sum())`` (stage3.py:2461-2466, :2506) and
#   get_grad_norm_direct's ``param_norm.item()`` (:1976-1977): 2;
# - per step: overlap_comm's ``_has_inf_or_nan(self.gpu_sum)`` (:2471), the overflow flag's
#   and the norm's ``.item()`` after their all-reduces (:2496, :1988), the optimizer_step
#   timer's start and stop (:2366, :2386; deepspeed/utils/timer.py:29-39 synchronize), the
#   engine's step and step_microstep timers (engine.py:1089-1090, :1123-1124): 9;
# - per micro-batch: the engine's forward / forward_microstep timers (engine.py:899-900,
#   :912-913) and its six backward timers (:974-1016), each started and stopped: 16;
#   Megatron's timers batch generator (pretrain_gpt2.py:84-87), forward, backward,
#   backward-backward, optimizer (training.py:274-283, :321-342; megatron/global_vars.py
#   :167, :174 synchronize): 10; its f-string of the loss and the reduced loss
#   (training.py:323, two CUDA scalars read): 2; broadcast_data's ``sizes_cuda.cpu()``
#   (megatron/mpu/data.py:54): 1; 29 in all.
# Blocking host-to-device copies from pageable memory (priced as RELEASE_S, the measured
# ``torch.ones(1).half().to(device)``): per step ``torch.zeros(1).cuda()`` for gpu_sum
# (:2472), ``torch.cuda.ByteTensor([overflow])`` (:2477), ``torch.cuda.FloatTensor([norm])``
# (:1979): 3; per micro-batch broadcast_data's ``torch.cuda.LongTensor(sizes)`` and the
# batch's ``.cuda()`` (data.py:49, :97): 2.  Per parameter tensor, host loops at the
# measured NARROW_S:
# independent_gradient_partition_epilogue's ``param.grad.data.narrow`` (:1298-1304) and
# _unflatten_partitioned_parameters' narrow + view (torch's _unflatten_dense_tensors;
# :2299-2305).  Collectives: the overflow flag (1 byte, MAX) and the squared norm (4 bytes,
# SUM) all-reduced over the data-parallel group (:2478-2480, :1981-1983), Megatron's
# reduce_losses (4 bytes over the world, every micro-batch: pretrain_gpt2.py:94,
# megatron/utils.py:31-38); the model-parallel all-reduces (:2493-2494, :1985-1986) run
# on a one-rank group: not priced.
OPT_WAITS_PER_TENSOR = 2
STEP_WAITS = 9
MICRO_BATCH_WAITS = 29
STEP_H2D = 3
MICRO_BATCH_H2D = 2


# Megatron-LM-v1.1.5-ZeRO3 (DeepSpeedExamples 44be774aad) as the example script runs it
# (examples/ds_pretrain_gpt2-zero3.sh: its gpt_options pass none of the fusion flags):
# ``--scaled-upper-triang-masked-softmax-fusion``, ``--scaled-masked-softmax-fusion``,
# ``--bias-gelu-fusion`` and ``--bias-dropout-fusion`` are ``store_true`` (default off,
# megatron/arguments.py:249-260), so the layer runs PyTorch's eager kernels where the
# planner's layer (``layer_cost``: Korthikanti et al.'s Megatron-LM) prices the fused ones:
# - FusedScaleMaskSoftmax without fusion and without ``--apply-query-key-layer-scaling``
#   (scale None, fp16 in: megatron/model/fused_softmax.py:118-128) runs
#   ``gpt2_attention_mask_func``, an in-place ``masked_fill_`` of the b a s s scores
#   (gpt2_model.py:31-33: read + write, and the [1, 1, s, s] bool mask once), then
#   ``torch.nn.Softmax`` (the fused kernel's 2 bytes an element): + 2 e S + s^2 bytes, one
#   kernel; its backward adds ``masked_fill``'s gradient (``grad.masked_fill(mask, 0)``,
#   read + write) beside the softmax's (the fused kernel's 3 e S): + 2 e S + s^2, one
#   kernel;
# - ParallelMLP without ``--bias-gelu-fusion`` (transformer.py:127-132):
#   ``F.gelu(intermediate + bias)``: the add writes T f elements that GeLU reads back,
#   + 2 e T f bytes, one kernel, forward only (GeLU's backward reads its input as the
#   fused backward does; the bias gradient is the same sum);
# - ``bias_dropout_add`` unscripted (transformer.py:422-426, 519-528): ``x + bias``,
#   ``F.dropout``, ``residual + out``, three kernels where the scripted one is one: the
#   two intermediates of T h elements each written and read again, + 4 e T h bytes and
#   two kernels per call (at p = 0 ATen's dropout returns its input: + 2 e T h, one
#   kernel), two calls a layer, forward only (the gradient passes through the adds).
# Recomputed with the forward under full recompute.  Priced at the profile's elementwise
# rate with their launches (``unfused_seconds``).
UNFUSED_SOURCE = ("Megatron-LM-v1.1.5-ZeRO3 (DeepSpeedExamples 44be774aad) without its "
                  "fusion flags, as examples/ds_pretrain_gpt2-zero3.sh runs it "
                  "(arguments.py:249-260 store_true; fused_softmax.py:118-128, "
                  "transformer.py:127-132, :422-426): eager masked_fill_ + softmax, "
                  "add + gelu, add + dropout + add (zero3_2021.unfused_seconds)")


def chunk_layers(n_layer: int, k: int) -> list[list[int]]:
    """The layers each checkpointed chunk of Megatron-LM-v1.1.5-ZeRO3 runs with
    ``--checkpoint-num-layers k`` (DeepSpeedExamples 44be774aad ``megatron/model/
    transformer.py``:949-969): ``custom(l, l + k)`` for l = 0, k, 2k, ... < n_layer, each
    running ``self._get_layer(index)`` for index in range(l, l + k), whose index
    ``_get_layer_index`` takes modulo the unique layers (:938-947; ``--param-sharing-style``
    'grouped' and ``--num-unique-layers`` = the layers by default, arguments.py:160-166):
    where k does not divide the layers the last chunk runs layer 0, 1, ... again."""
    for name, v in (("n_layer", n_layer), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    return [[i % n_layer for i in range(l, l + k)] for l in range(0, n_layer, k)]


def check_chunks(cfg, lay) -> None:
    """Raise ValueError where DeepSpeed v0.3.13-0.3.16's ZeRO-3 stops the run at its first
    backward: with full recompute in chunks of k layers that do not divide the model's
    layers, Megatron-LM-v1.1.5 runs layer 0 again in the last chunk (:func:`chunk_layers`),
    whose backward is its own ``torch.autograd.backward`` call (DeepSpeed
    ``activation_checkpointing/checkpointing.py``:686), so layer 0's parameters reach
    their gradient hook twice in one backward, and ``reduce_independent_p_g_buckets_and_
    remove_grads`` asserts "Multiple gradient reduction is currently not supported"
    (v0.3.13 ``stage3.py``:1446-1449, the flag set at :1713 and cleared only in the
    epilogue, :1293-1294; v0.3.16 :1898-1901)."""
    k = getattr(lay, "recompute_num_layers", 1)
    if lay.recompute != "full" or k == 1:
        return
    runs = [i for c in chunk_layers(cfg.n_layer, k) for i in c]
    twice = sorted({i for i in runs if runs.count(i) > 1})
    if twice:
        raise ValueError(f"framework={FRAMEWORK!r}: recompute_num_layers={k} does not "
                         f"divide the {cfg.n_layer} layers, so Megatron-LM-v1.1.5 runs "
                         f"layer(s) {twice} again in the last chunk and DeepSpeed "
                         f"v0.3.13-0.3.16's ZeRO-3 asserts on their second gradient "
                         f"('Multiple gradient reduction is currently not supported', "
                         f"stage3.py:1446-1449): use a recompute_num_layers that divides "
                         f"{cfg.n_layer} (1: Megatron's default)")


def unfused_bytes(cfg, micro_batch: int) -> dict:
    """Bytes and kernel launches per layer and micro-batch that Megatron-LM-v1.1.5-ZeRO3's
    eager (unfused) softmax, bias-GeLU and bias-dropout-add move beyond the fused kernels
    the planner's layer prices (``UNFUSED_SOURCE``'s comment): ``forward`` and
    ``backward`` (the backward pass alone, without its recompute), each (bytes,
    launches), and ``core``: the attention core's part of ``forward`` (what selective
    recompute re-runs).  A GPT layer (``cfg.arch == "gpt"``) only: Megatron-LM-v1.1.5 has no
    other."""
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch={micro_batch!r}: sequences per micro-batch, an "
                         f"int >= 1")
    if cfg.arch != "gpt":
        raise ValueError(f"arch={cfg.arch!r}: the unfused kernels priced are "
                         f"Megatron-LM-v1.1.5's GPT layer; framework={FRAMEWORK!r} runs no "
                         f"other (give arch='gpt')")
    from .layer_cost import _ITEMSIZE
    e = _ITEMSIZE[cfg.dtype]
    s, b, h, a, f = cfg.seq_len, micro_batch, cfg.d_model, cfg.n_head, cfg.d_ff
    S, T = b * a * s * s, s * b
    mask = s * s                                  # the broadcast [1, 1, s, s] bool mask
    drop = cfg.dropout > 0
    bda = (4 if drop else 2) * e * T * h, (2 if drop else 1)
    fwd = (2 * e * S + mask + 2 * e * T * f + 2 * bda[0], 1 + 1 + 2 * bda[1])
    bwd = (2 * e * S + mask, 1)
    # ``core``: what selective recompute re-runs of it (the attention core's masked_fill_)
    return {"forward": fwd, "backward": bwd, "core": (2 * e * S + mask, 1)}


def unfused_seconds(cfg, micro_batch: int, prof, recompute: str) -> dict:
    """Seconds per layer and micro-batch :func:`unfused_bytes` adds on ``prof`` at its
    elementwise rate (``sim_mesh.kernel_cost.compute_time``): ``forward``, and
    ``backward`` with what the recompute re-runs (``"full"``: the forward's, ``"selective"``:
    the attention core's masked_fill_; the layer's backward seconds include its
    recompute, ``costs.LayerCost``); 0 for a model that is not a GPT (Megatron-LM-v1.1.5's
    layer only)."""
    from ..sim_mesh.kernel_cost import compute_time
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: 'none', 'selective' or 'full' (what "
                         f"Megatron-LM-v1.1.5 runs)")
    if cfg.arch != "gpt":
        return {"forward": 0.0, "backward": 0.0}
    x = unfused_bytes(cfg, micro_batch)
    fwd, bwd = (compute_time(0.0, float(nb), prof, cfg.dtype, "elementwise", launches=n)
                for nb, n in (x["forward"], x["backward"]))
    again = {"full": fwd, "selective": x["core"], "none": 0.0}[recompute]
    if recompute == "selective":    # the attention core re-run: its masked_fill_ again
        again = compute_time(0.0, float(again[0]), prof, cfg.dtype, "elementwise",
                             launches=again[1])
    return {"forward": fwd, "backward": bwd + again}


def partition_activation_seconds(cfg, micro_batch: int, prof) -> tuple[float, float]:
    """(forward, backward) seconds per layer and micro-batch of DeepSpeed's activation
    checkpointing with ``partition_activations`` at one model-parallel rank
    (``CKPT_FORWARD_BYTES`` / ``CKPT_BACKWARD_BYTES`` per element of the layer's input,
    b x s x h in 16 bits, at the profile's copy rate with their launches)."""
    from ..sim_mesh.kernel_cost import compute_time
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch={micro_batch!r}: sequences per micro-batch, an "
                         f"int >= 1")
    n = micro_batch * cfg.seq_len * cfg.d_model
    return (compute_time(0.0, CKPT_FORWARD_BYTES * n, prof, "float16",
                         launches=CKPT_FORWARD_KERNELS),
            compute_time(0.0, CKPT_BACKWARD_BYTES * n, prof, "float16",
                         launches=CKPT_BACKWARD_KERNELS))


def step_host_seconds(trace, m: int, dp_all_reduce, world_all_reduce) -> dict:
    """Seconds of a step's host waits, blocking copies, per-tensor loops and scalar
    all-reduces outside the module hooks (the constants' comment): ``m`` micro-batches;
    ``dp_all_reduce(nbytes)`` / ``world_all_reduce(nbytes)``: NCCL's seconds over the
    data-parallel group / all ranks.  Returns each part and their ``total``."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m={m!r}: micro-batches per step, an int >= 1")
    tensors = len({pid for e in trace for pid, _ in e.params})
    out = {"waits": (OPT_WAITS_PER_TENSOR * tensors + STEP_WAITS + MICRO_BATCH_WAITS * m)
           * SYNC_S,
           "h2d": (STEP_H2D + MICRO_BATCH_H2D * m) * RELEASE_S,
           "loops": tensors * (NARROW_S + (1 + 0.48) * NARROW_S),
           "all_reduces": dp_all_reduce(1) + dp_all_reduce(4) + m * world_all_reduce(4)}
    out["total"] = sum(out.values())
    return out


@dataclass(frozen=True)
class Entry:
    """One module's turn in the recorded trace: its id, the partitioned parameters it
    uses ((id, elements), persistent ones left out), its compute seconds, and its phase
    ("f" forward, "r" recomputed forward inside the backward, "b" backward); ``copies``:
    seconds of DeepSpeed's own copies on the compute stream before it (activation
    checkpointing's partitioned input, :func:`partition_activation_seconds`), not
    counted as compute."""
    module: str
    params: tuple
    compute: float
    phase: str
    copies: float = 0.0


def _layer_modules(cfg) -> list[tuple[str, tuple]]:
    """A layer's modules with parameters, forward order, unsplit (tp = 1): each a name
    and its (parameter, elements); GPT: LayerNorm, fused QKV, projection, LayerNorm,
    fc1, fc2, each with its bias; Llama: RMSNorm, q, k, v, o, RMSNorm, w1, w3, w2."""
    h, f = cfg.d_model, cfg.d_ff
    if cfg.arch == "llama":
        from .llama_layer import weight_matrices
        q, k, v, o, w1, w3, w2 = weight_matrices(cfg, 1)
        return [("norm1", (("norm1.w", h),)), ("q", (("q.w", q),)), ("k", (("k.w", k),)),
                ("v", (("v.w", v),)), ("o", (("o.w", o),)), ("norm2", (("norm2.w", h),)),
                ("w1", (("w1.w", w1),)), ("w3", (("w3.w", w3),)), ("w2", (("w2.w", w2),))]
    return [("ln1", (("ln1.w", h), ("ln1.b", h))),
            ("qkv", (("qkv.w", 3 * h * h), ("qkv.b", 3 * h))),
            ("proj", (("proj.w", h * h), ("proj.b", h))),
            ("ln2", (("ln2.w", h), ("ln2.b", h))),
            ("fc1", (("fc1.w", h * f), ("fc1.b", f))),
            ("fc2", (("fc2.w", f * h), ("fc2.b", h)))]


def gpt_trace(cfg, layer, head, edge, recompute: str,
              checkpoint_copies: tuple = (0.0, 0.0), chunk: int = 1) -> list[Entry]:
    """One micro-batch's trace as DeepSpeed records it (module docstring), tp = pp = 1:
    the root (holding the tied word embedding), the embeddings, each layer's modules
    with parameters (``_layer_modules``; the persistent ones, biases and norms, are
    never gathered but their gradients are reduce-scattered like any other), the
    final norm, the head; the backward from the head down, each layer's modules
    recomputed first when ``recompute == "full"``.  A module's share of the layer's
    compute is its share of the layer's partitioned weights (as ``zero_cost.
    stage_blocks``); the norms' is left in the matrices'.  ``checkpoint_copies``:
    (forward, backward) seconds a layer's checkpointed input costs DeepSpeed's
    activation checkpointing (:func:`partition_activation_seconds`), charged before the
    layer's first module in the forward and before its recomputation (full recompute
    only).  ``chunk``: ``--checkpoint-num-layers`` (``plan.recompute_chunks``): the layers
    are checkpointed in chunks of ``chunk``, so the backward recomputes a chunk's layers
    in forward order (each module gathered as the recompute re-runs it) and then runs
    their backwards, last layer first; the checkpoint copies are one per chunk (its
    input), charged before its first layer."""
    h, V, s = cfg.d_model, cfg.vocab_size, cfg.seq_len
    mods = _layer_modules(cfg)
    big = {m: sum(n for _, n in ps if n >= PERSISTENCE_NUMEL) for m, ps in mods}
    tot = sum(big.values())
    full = recompute == "full"
    fwd_l = layer.fwd_compute
    bwd_l = layer.bwd_compute - (fwd_l if full else 0.0)
    tied = cfg.tie_embeddings
    wte = (("wte", V * h),)

    if not full:
        checkpoint_copies = (0.0, 0.0)

    from .recompute_chunks import chunk_sizes
    starts, k0 = set(), 0           # each chunk's first layer: its input is checkpointed
    spans = []
    for n in chunk_sizes(cfg.n_layer, chunk if full else 1):
        starts.add(k0)
        spans.append(range(k0, k0 + n))
        k0 += n

    def layer_entries(k, phase, share, order):
        first = {"f": checkpoint_copies[0], "r": checkpoint_copies[1]}.get(phase, 0.0)
        first = first if k in starts else 0.0
        return [Entry(f"{k}.{m}", tuple((f"{k}.{pid}", n) for pid, n in ps),
                      share * big[m] / tot, phase, first if j == 0 else 0.0)
                for j, (m, ps) in enumerate(order)]

    out = [Entry("root", wte if tied else (), 0.0, "f"),
           Entry("wte", wte, edge["first"][0], "f")]
    pos = cfg.arch != "llama"
    emb_ln = (("emb_ln.w", h), ("emb_ln.b", h)) if cfg.embed_norm else ()   # BLOOM's
    if pos:
        out.append(Entry("wpe", (("wpe", s * h),), 0.0, "f"))
    if emb_ln:
        out.append(Entry("emb_ln", emb_ln, 0.0, "f"))
    for k in range(cfg.n_layer):
        out += layer_entries(k, "f", fwd_l, mods)
    final = (("lnf.w", h),) if cfg.arch == "llama" else (("lnf.w", h), ("lnf.b", h))
    head_p = () if tied else (("head", V * h),)
    out += [Entry("lnf", final, 0.0, "f"),
            Entry("head", head_p, head.fwd_compute + edge["last"][0], "f"),
            Entry("root", wte if tied else (), 0.0, "b"),
            Entry("head", head_p, head.bwd_compute + edge["last"][1], "b"),
            Entry("lnf", final, 0.0, "b")]
    for span in reversed(spans):
        if full:                    # CheckpointFunction.backward: the chunk re-run, then
            for k in span:          # torch.autograd.backward through it
                out += layer_entries(k, "r", fwd_l, mods)
        for k in reversed(span):
            out += layer_entries(k, "b", bwd_l, mods[::-1])
    if emb_ln:
        out.append(Entry("emb_ln", emb_ln, 0.0, "b"))
    if pos:
        out.append(Entry("wpe", (("wpe", s * h),), 0.0, "b"))
    out.append(Entry("wte", wte, edge["first"][1], "b"))
    return out


def _keep(trace) -> list[bool]:
    """Whether each entry's module keeps its parameters after it ran: the trace uses the
    module again within MAX_REUSE_NUMEL elements (``_keep_for_later``: the elements of
    the modules between, from the next step on)."""
    nxt, keep = {}, [False] * len(trace)
    acc, suffix = 0.0, [0.0] * (len(trace) + 1)
    for i in range(len(trace) - 1, -1, -1):
        acc += sum(n for _, n in trace[i].params)
        suffix[i] = acc
    for i in range(len(trace) - 1, -1, -1):
        j = nxt.get(trace[i].module)
        if j is not None:
            keep[i] = suffix[i + 1] - suffix[j] < MAX_REUSE_NUMEL
        nxt[trace[i].module] = i
    return keep


def list_collective(kind: str, numel: float, p: int, price: float, t: float,
                    ready: float, stream_free: float, mem_bw: float) -> tuple:
    """One collective on a list of ``p`` chunks (module docstring): the host issues it
    at ``t``, the NCCL stream is free at ``stream_free``, the data is ready at
    ``ready``; ``price``: NCCL's seconds.  Returns (host free, NCCL start, stream free).
    all_gather: the narrow loop, NCCL, the per-chunk copies out of the flat buffer
    (issued by the host one by one as NCCL runs, each after it); reduce_scatter: the
    narrow loop, the per-chunk copies into the flat buffer, then NCCL."""
    copy_gpu = 2 * 2 * numel / mem_bw             # read + write of the 16-bit values
    t = t + p * (AG_LOOP_S if kind == "all_gather" else RS_LOOP_S)
    if kind == "all_gather":
        start = max(t, stream_free)
        host = t + p * RECORD_COPY_S
        return host, start, max(start + price + copy_gpu, host)
    host = t + p * RECORD_COPY_S
    copied = max(host, max(t, stream_free, ready) + copy_gpu)
    return host, copied, copied + price


def predivide_seconds(numels, mem_bw: float) -> float:
    """GPU seconds of ``average_tensor``'s pre-division before one bucket's
    reduce-scatters (DeepSpeed v0.3.13 ``stage3.py``: ``reduce_ipg_grads`` passes
    ``[self.ipg_buffer[self.ipg_index]]`` plus the extra-large parameter's gradient,
    and ``average_tensor`` runs ``tensor.div_(world_size)`` on each, on the reduction
    stream): the whole ipg buffer (``reduce_bucket_size`` elements, however full) and
    every gradient of the bucket above that size (the one ``reduce_independent_p_g_
    buckets_and_remove_grads`` kept out of the buffer), each 16-bit element read and
    written at ``mem_bw``."""
    large = sum(n for n in numels if n > REDUCE_BUCKET_NUMEL)
    return 2 * 2 * (REDUCE_BUCKET_NUMEL + large) / mem_bw


def behaviour(version: str) -> tuple:
    """(trace off by one, norm per fetched parameter) of DeepSpeed ``version`` (module
    docstring: v0.3.14's root reset hook, v0.3.15's debug-print norm)."""
    if version not in VERSIONS:
        raise ValueError(f"version={version!r}: the DeepSpeed release whose ZeRO-3 hooks "
                         f"are priced; use one of {sorted(VERSIONS)}")
    return VERSIONS[version]


def counter_start(trace, step: int, first: bool) -> float:
    """DeepSpeed v0.3's live-parameter counter when a micro-batch of optimizer step
    ``step`` (>= 2) starts (module docstring): -(step - 2) x the persistent parameters'
    elements for the step's first micro-batch (``_post_step``'s gather of them is not
    counted), one more of those lower for the others."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 2:
        raise ValueError(f"step={step!r}: the optimizer step priced, an int >= 2 (step 1 "
                         f"records the trace and prefetches nothing)")
    size = {pid: n for e in trace for pid, n in e.params}
    persistent = sum(n for n in size.values() if n < PERSISTENCE_NUMEL)
    return -float((step - 2 + (0 if first else 1)) * persistent)


def simulate(trace, p: int, ag_price, rs_price, mem_bw: float, rate: float = 1.0,
             keep=None, persistent_gathered: bool = True,
             step: int = COUNTER_STEP, version: str = VERSION) -> dict:
    """One micro-batch of ``trace`` on a rank of ``p`` (module docstring): its seconds,
    its compute seconds, the gathers (``prefetches`` of them issued by the prefetch) and
    reduce-scatters it ran and their wire bytes.
    ``ag_price(numel)`` / ``rs_price(numel)``: NCCL's seconds on that many 16-bit
    elements; ``rate``: compute's speed beside a collective; ``persistent_gathered``:
    the persistent parameters are there when it starts (the step's first micro-batch,
    after ``_post_step``), else each is gathered at its first use; ``step``: the
    optimizer step, whose live-parameter counter starts at :func:`counter_start`;
    ``version``: the DeepSpeed release (:func:`behaviour`): from v0.3.14 the trace is off
    by one, so no module but the root (the first entry) prefetches or keeps its
    parameters for a reuse; from v0.3.15 each fetch runs, per parameter of the module,
    a norm over it on the compute stream and waits for it (``.item()``, priced as
    ``SYNC_S``)."""
    shifted, norms = behaviour(version)
    if shifted:
        keep = [False] * len(trace)
    keep = _keep(trace) if keep is None else keep
    t = gpu = nccl = 0.0            # host, compute stream, NCCL stream: free at
    busy, inflight = [], {}
    size = {pid: n for e in trace for pid, n in e.params}
    gathers, rs_count, sent = 0, 0, 0.0
    bucket, ready = [], 0.0         # the gradients not yet reduced, ready at
    rs_end = 0.0
    # seconds of work by kind, not exposed: the host's loops and waits, the GPU's fills,
    # copies and NCCL kernels ("nccl" = "nccl_ag" + "nccl_rs"; benchmarks/zero3_audit.py)
    work = dict.fromkeys(("ag_loop", "rs_loop", "record_copy", "release", "nccl",
                          "nccl_ag", "nccl_rs", "fill", "chunk_copy", "sync",
                          "predivide", "norm", "checkpoint_copies"), 0.0)

    def gather(pid):
        nonlocal t, nccl, gathers, sent, live
        fill = 2 * size[pid] / mem_bw                 # torch.zeros of the whole parameter
        t = max(t, gpu, nccl) + fill + SYNC_S         # then torch.cuda.synchronize()
        price = ag_price(size[pid])
        t, start, nccl = list_collective("all_gather", size[pid], p, price, t, t, nccl,
                                         mem_bw)
        work["fill"] += fill
        work["sync"] += SYNC_S
        work["ag_loop"] += p * AG_LOOP_S
        work["record_copy"] += p * RECORD_COPY_S
        work["chunk_copy"] += 2 * 2 * size[pid] / mem_bw
        work["nccl"] += price
        work["nccl_ag"] += price
        busy.append((start, nccl))
        inflight[pid] = nccl
        live += size[pid]
        gathers += 1
        sent += wire_bytes("all_gather", 2 * size[pid], p)

    def reduce(numels, ready):
        """reduce_ipg_grads: one list reduce-scatter per parameter of the bucket, after
        ``average_tensor``'s pre-division (:func:`predivide_seconds`) on the reduction
        stream, which c10d's NCCL stream waits for."""
        nonlocal t, nccl, rs_count, sent, rs_end
        t = max(t, rs_end)                            # reduction_stream.synchronize()
        div = predivide_seconds(numels, mem_bw)
        work["predivide"] += div
        ready = max(ready, t + div)
        for numel in numels:
            price = rs_price(numel)
            t, start, nccl = list_collective("reduce_scatter", numel, p, price, t, ready,
                                             nccl, mem_bw)
            work["rs_loop"] += p * RS_LOOP_S
            work["record_copy"] += p * RECORD_COPY_S
            work["chunk_copy"] += 2 * 2 * numel / mem_bw
            work["nccl"] += price
            work["nccl_rs"] += price
            busy.append((start, nccl))
            rs_count += 1
            sent += wire_bytes("reduce_scatter", 2 * numel, p)
        rs_end = nccl

    held = {pid for e in trace if e.module == "root" for pid, _ in e.params}
    persistent = {pid for pid, n in size.items() if n < PERSISTENCE_NUMEL}   # ds_persist
    avail = set(persistent) if persistent_gathered else set()
    # total_available_parameter_numel: _post_step's gather of the persistent ones is not
    # counted, and each step starts lower (counter_start)
    live = counter_start(trace, step, persistent_gathered)
    prefetches = 0
    last_b = {pid: i for i, e in enumerate(trace) if e.phase == "b" for pid, _ in e.params}
    compute = 0.0
    for i, e in enumerate(trace):
        mine = [pid for pid, _ in e.params]
        need = [pid for pid in mine if pid not in avail and pid not in inflight]
        waits = any(pid in inflight for pid in mine)
        for pid in need:
            gather(pid)
        if need or waits:                             # _synchronize_communication
            t = max(t, gpu, nccl) + SYNC_S
            work["sync"] += SYNC_S
            avail.update(inflight)
            inflight.clear()
        if norms and e.module != "root":   # the root's parameter is external, not its own
            for pid in mine:                          # param.norm() in the debug f-string
                norm = 2 * size[pid] / mem_bw
                gpu = max(t, gpu) + norm
                t = gpu + SYNC_S
                work["norm"] += norm + SYNC_S
        # prefetch_next_sub_modules; off by one (v0.3.14 on), only the root's entry finds
        # itself in the trace (its step id 0 is taken before the reset)
        if (not shifted or i == 0) and not inflight and live < MAX_LIVE_NUMEL:
            ahead, chosen = 0.0, []
            for later in trace[i:]:
                for pid, n in later.params:
                    if ahead >= PREFETCH_NUMEL:
                        break
                    if pid not in avail and pid not in chosen:
                        chosen.append(pid)
                        ahead += n
                if ahead >= PREFETCH_NUMEL:
                    break
            for pid in chosen:
                gather(pid)
            prefetches += len(chosen)
        busy = [iv for iv in busy if iv[1] > min(t, gpu)]
        gpu = finish_beside(max(t, gpu), e.copies + e.compute, rate, busy)
        compute += e.compute
        work["checkpoint_copies"] += e.copies
        if e.phase == "b":      # the gradient hooks: once, when the gradient is whole
            for pid, n in e.params:
                if last_b[pid] != i:
                    continue
                if bucket and sum(bucket) + n > REDUCE_BUCKET_NUMEL:
                    reduce(bucket, ready)
                    bucket = []
                bucket.append(n)
                ready = gpu
        for pid in mine:        # the root's (ds_active_sub_modules) are held to the end
            if pid not in held and not keep[i] and pid in avail \
                    and size[pid] >= PERSISTENCE_NUMEL:
                t = max(t, gpu) + RELEASE_S           # _partition_param's blocking copy
                work["release"] += RELEASE_S
                avail.discard(pid)
                live -= size[pid]
    if bucket:                                        # the epilogue
        reduce(bucket, ready)
    # _partition_all_parameters: each parameter still gathered released (a blocking copy)
    end = max(t, gpu, nccl, rs_end) + len(avail) * RELEASE_S
    work["release"] += len(avail) * RELEASE_S
    return {"seconds": end, "compute": compute, "gathers": gathers,
            "prefetches": prefetches, "reduce_scatters": rs_count, "sent": sent,
            "work": work}


def dp_sync(cfg, lay, prof, layer, head, edge) -> tuple[float, float]:
    """(exposed seconds, bytes sent) per step of DeepSpeed v0.3 ZeRO-3's data-parallel
    collectives for ``lay`` (zero 3, pp 1, tp 1): each micro-batch simulated
    (:func:`simulate`) less its compute, times the micro-batches."""
    d = dp_sync_parts(cfg, lay, prof, layer, head, edge)
    return d["exposed"], d["sent"]


def dp_sync_parts(cfg, lay, prof, layer, head, edge) -> dict:
    """:func:`dp_sync`'s pieces (``benchmarks/zero3_audit.py`` prints them): the step's
    first micro-batch simulated (``first``), the others' (``rest``, the same dict when
    m = 1), ``_post_step``'s gather (``post`` seconds), the step's ``seconds``, its
    ``exposed`` part (less the micro-batches' compute) and the bytes ``sent``."""
    if lay.zero != 3 or lay.pp != 1 or lay.tp != 1 or getattr(lay, "cp", 1) != 1:
        raise ValueError(f"framework={FRAMEWORK!r}: layout {lay.short()}; DeepSpeed v0.3's "
                         f"ZeRO-3 is priced without model parallelism (zero=3, tp=pp=cp=1)")
    check_chunks(cfg, lay)
    if lay.dp == 1:
        return {"first": None, "rest": None, "post": 0.0, "host": None, "seconds": 0.0,
                "exposed": 0.0, "sent": 0.0}
    ranks = tuple(lay.grad_ranks(0, 0))

    def ag(n):
        return C.group_price("all_gather", 2 * n, ranks, prof)

    def rs(n):
        return C.group_price("reduce_scatter", 2 * n, ranks, prof)

    trace = gpt_trace(cfg, layer, head, edge, lay.recompute,
                      partition_activation_seconds(cfg, lay.micro_batch, prof),
                      lay.recompute_num_layers)
    p, bw, rate = len(ranks), prof.memory_bandwidth, overlap_rate(prof, ranks)
    first = simulate(trace, p, ag, rs, bw, rate)
    rest = simulate(trace, p, ag, rs, bw, rate, persistent_gathered=False) \
        if lay.m > 1 else first
    post, post_sent = post_step_gather(trace, p, ag)
    world = tuple(range(lay.world))
    host = step_host_seconds(trace, lay.m,
                             lambda b: C.group_price("all_reduce", b, ranks, prof),
                             lambda b: C.group_price("all_reduce", b, world, prof))
    seconds = first["seconds"] + (lay.m - 1) * rest["seconds"] + post + host["total"]
    sent = first["sent"] + (lay.m - 1) * rest["sent"] + post_sent
    return {"first": first, "rest": rest, "post": post, "host": host, "seconds": seconds,
            "exposed": seconds - lay.m * first["compute"], "sent": sent}


def post_step_gather(trace, p: int, ag_price) -> tuple[float, float]:
    """(seconds, bytes sent) of ``_post_step``'s gather of the persistent parameters
    (module docstring): DeepSpeed's loop of p ``narrow``, one all-gather of their
    partitions on a list of p chunks (c10d's p copies), then, per parameter, a
    ``narrow`` + ``copy_`` for each rank whose chunk holds some of it (the padding of
    the last ranks' chunks is not copied), all on the host, synchronously."""
    sizes = {pid: n for e in trace for pid, n in e.params if n < PERSISTENCE_NUMEL}
    if not sizes:
        return 0.0, 0.0
    part = sum(-(-n // p) for n in sizes.values())
    chunks = sum(-(-n // -(-n // p)) for n in sizes.values())
    copies = p * RECORD_COPY_S + chunks * REASSEMBLE_S   # issued as NCCL runs, after it
    seconds = SYNC_S + p * NARROW_S + max(copies, ag_price(part * p))
    return seconds, wire_bytes("all_gather", 2 * part * p, p)


def backward_peak_bytes(cfg, lay, remat: float, head: float, loss: float) -> dict:
    """Bytes a rank of DeepSpeed v0.3.13's ZeRO-3 (tp = pp = 1) holds beyond its
    partitioned model states, the checkpointed inputs and NCCL's buffers, read from the
    source (``benchmarks/zero3_audit.py``'s memory section; s3 = deepspeed/runtime/zero/
    stage3.py, pp = partition_parameters.py, v0.3.13): ``buffers`` (held all backward)
    and ``workspace`` (the transient peak), given ``remat``: the recomputed chunk's
    activations less its kept input, ``head``: the head's saved tensors (final-LN and
    head inputs, fp32 logits) and ``loss``: the loss's working copies.
    - two reduce buckets: ``ipg_buffer`` is two buffers of ``reduce_bucket_size`` when
      ``overlap_comm`` (s3:2535-2546), True by default at stage 3 (zero/config.py:89-94,
      constants.py:55);
    - gathered parameters: the tied word embedding, the root's external parameter, held
      the whole micro-batch (Megatron-LM-v1.1.5-ZeRO3 gpt2_model.py), and the module
      running, the largest (fc2, kept from its recompute for its backward); nothing
      prefetched when the held embedding alone reaches ``stage3_max_live_parameters``
      (the check, s3:293-297, :312-334); below it, ASSUMPTION: the module after it too
      (an upper bound: ``memory.zero3_gathered_numel`` with the 2021 prefetch bucket);
    - the largest parameter's gradient, whole: above the bucket, reduced as its own
      (s3:1452-1453);
    - at that gradient's allocation (fc2's weight gradient, a chunk's first backward op,
      the whole chunk's recomputed activations live: ``remat`` in full, no unreduced
      gradient subtracted) also the previous extra-large gradient (the layer above's
      qkv, reduced at the next hook and freed at the one after: s3:1433-1436, :1693-1694,
      pp:848) and, tied, the head's gradient of the embedding that autograd holds in the
      leaf's input buffer until the embedding's backward adds its own (one leaf, two
      uses; measured, tests/test_i21mem.py); at fc2's bias hook instead the previous
      gradient is freed, c10d flattens fc2's gradient (a whole copy, ProcessGroupNCCL's
      list reduce-scatter) and fc2's saved input (2 s b f) is released: the larger of
      the two;
    - the head's saved tensors are freed by the head's backward, before the layers':
      they and the loss's copies are the other peak, not added to the layers'."""
    h, V, s, b, f = cfg.d_model, cfg.vocab_size, cfg.seq_len, lay.micro_batch, cfg.d_ff
    big = [n for _, ps in _layer_modules(cfg) for _, n in ps if n >= PERSISTENCE_NUMEL]
    largest = max(big)
    extra_large = [n for n in big if n > REDUCE_BUCKET_NUMEL]
    previous = extra_large[0] if len(extra_large) > 1 and cfg.n_layer > 1 else 0.0
    held = V * h if cfg.tie_embeddings else 0.0
    if held >= MAX_LIVE_NUMEL:
        gathered = held + largest
    else:
        from .memory import zero3_gathered_numel
        gathered = held + zero3_gathered_numel(big * cfg.n_layer, PREFETCH_NUMEL)
    tied_grad = 2 * V * h if cfg.tie_embeddings else 0.0
    wgrad = remat + 2 * previous + tied_grad
    bias_hook = remat + 2 * largest - 2 * s * b * f + tied_grad if cfg.arch != "llama" \
        else wgrad
    buffers = 2 * 2 * REDUCE_BUCKET_NUMEL + 2 * gathered + 2 * largest
    return {"buffers": float(buffers),
            "workspace": float(max(wgrad, bias_hook, head + loss)),
            "terms": {"reduce buckets": 2 * 2 * REDUCE_BUCKET_NUMEL,
                      "gathered": 2 * gathered, "largest gradient": 2 * largest,
                      "previous gradient": 2 * previous, "tied head gradient": tied_grad,
                      "at fc2's weight gradient": wgrad, "at fc2's bias hook": bias_hook,
                      "head + loss": head + loss}}
