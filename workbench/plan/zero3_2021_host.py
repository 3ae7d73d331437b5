"""DeepSpeed v0.3 ZeRO-3's host loops and waits and its collectives on lists of chunks:
the measured host seconds, one list collective (:func:`list_collective`), the
reduction's pre-division (:func:`predivide_seconds`), ``_post_step``'s gather
(:func:`post_step_gather`) and a step's waits outside the hooks
(:func:`step_host_seconds`).  "Module docstring" below: :mod:`.zero3_2021`'s."""
from __future__ import annotations

from .costs import padded_flat
from .zero3_2021_release import PERSISTENCE_NUMEL, REDUCE_BUCKET_NUMEL


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
    return seconds, padded_flat(part * p, p, 2)[1]     # p partitions of part, padded
