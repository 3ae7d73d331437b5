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

The parts live beside this module, which keeps :func:`simulate` (it reads
:func:`predivide_seconds` here, where tests patch it), :func:`dp_sync` and
:func:`dp_sync_parts`, and their import path: the release and its settings
(:mod:`.zero3_2021_release`), the host's loops and the list collectives
(:mod:`.zero3_2021_host`), Megatron-LM-v1.1.5's layer (:mod:`.zero3_2021_megatron`), the
trace (:mod:`.zero3_2021_trace`) and the backward's memory (:mod:`.zero3_2021_memory`).
"""
from __future__ import annotations

from ..sim_mesh.cost import finish_beside, overlap_rate
from . import costs as C
from .zero3_2021_release import (COUNTER_STEP, FRAMEWORK, MAX_LIVE_NUMEL,  # noqa: F401
                                 MAX_REUSE_NUMEL, PERSISTENCE_NUMEL, PREFETCH_NUMEL,
                                 REDUCE_BUCKET_NUMEL, VERSION, VERSIONS, behaviour, counter_start)
from .zero3_2021_host import (AG_LOOP_S, MICRO_BATCH_H2D, MICRO_BATCH_WAITS, NARROW_S,  # noqa: F401
                              OPT_WAITS_PER_TENSOR, REASSEMBLE_S, RECORD_COPY_S, RELEASE_S,
                              RS_LOOP_S, STEP_H2D, STEP_WAITS, SYNC_S, list_collective,
                              post_step_gather, predivide_seconds, step_host_seconds)
from .zero3_2021_megatron import (CKPT_BACKWARD_BYTES, CKPT_BACKWARD_KERNELS,  # noqa: F401
                                  CKPT_FORWARD_BYTES, CKPT_FORWARD_KERNELS, UNFUSED_SOURCE,
                                  check_chunks, chunk_layers, partition_activation_seconds,
                                  unfused_bytes, unfused_seconds)
from .zero3_2021_trace import Entry, gpt_trace, _keep, _layer_modules  # noqa: F401
from .zero3_2021_memory import backward_peak_bytes  # noqa: F401


__all__ = ["FRAMEWORK", "COUNTER_STEP", "VERSION", "VERSIONS", "Entry", "gpt_trace",
           "simulate", "dp_sync", "dp_sync_parts", "list_collective",
           "partition_activation_seconds", "step_host_seconds", "post_step_gather",
           "predivide_seconds", "counter_start", "behaviour", "backward_peak_bytes",
           "UNFUSED_SOURCE", "unfused_bytes", "unfused_seconds", "chunk_layers",
           "check_chunks"]


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
        # the parameter padded to a multiple of p: the zeros, the p partitions gathered
        # and copied, what a rank sends (C.padded_flat: DeepSpeed's _aligned_size)
        buf, out = C.padded_flat(size[pid], p, 2)
        fill = 2 * buf / mem_bw                       # torch.zeros of the whole parameter
        t = max(t, gpu, nccl) + fill + SYNC_S         # then torch.cuda.synchronize()
        price = ag_price(buf)
        t, start, nccl = list_collective("all_gather", buf, p, price, t, t, nccl, mem_bw)
        work["fill"] += fill
        work["sync"] += SYNC_S
        work["ag_loop"] += p * AG_LOOP_S
        work["record_copy"] += p * RECORD_COPY_S
        work["chunk_copy"] += 2 * 2 * buf / mem_bw
        work["nccl"] += price
        work["nccl_ag"] += price
        busy.append((start, nccl))
        inflight[pid] = nccl
        live += size[pid]
        gathers += 1
        sent += out

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
            # p inputs of the padded partition (the last zero-padded: C.padded_flat)
            buf, out = C.padded_flat(numel, p, 2)
            price = rs_price(buf)
            t, start, nccl = list_collective("reduce_scatter", buf, p, price, t, ready,
                                             nccl, mem_bw)
            work["rs_loop"] += p * RS_LOOP_S
            work["record_copy"] += p * RECORD_COPY_S
            work["chunk_copy"] += 2 * 2 * buf / mem_bw
            work["nccl"] += price
            work["nccl_rs"] += price
            busy.append((start, nccl))
            rs_count += 1
            sent += out
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
