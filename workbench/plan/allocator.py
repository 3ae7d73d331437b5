"""What PyTorch's caching allocator holds beyond the live tensors: the memory ``nvidia-smi``
reads (``reserved``) against the planner's live peak (``memory["total"]``).

Source: pytorch/pytorch v1.11.0 (BLOOM-176B's torch, bigscience-workshop/bigscience
train/tr11-176B-ml/README.md: "PyTorch-1.11 w/ CUDA-11.5"), ``c10/cuda/
CUDACachingAllocator.cpp`` (by function: the v1.11.0 tree was not at hand, too large to
fetch here; the malloc order below was read in that era's copies, e.g. torch_npu's port
of it, and is unchanged in pytorch's later ones):

- sizes: ``round_size`` rounds a request up to a multiple of ``kMinBlockSize`` = 512 B;
  ``get_allocation_size`` asks cudaMalloc for a new segment of ``kSmallBuffer`` = 2 MiB
  for requests up to ``kSmallSize`` = 1 MiB, ``kLargeBuffer`` = 20 MiB below
  ``kMinLargeAlloc`` = 10 MiB, else the request rounded up to ``kRoundLarge`` = 2 MiB
  (:func:`segment_bytes`).
- ``DeviceCachingAllocator::malloc``: ``get_free_block`` takes the smallest cached free
  block of the pool (same stream) that is at least the request and splits it; free
  blocks merge only with their neighbours in the same segment (``free_block``,
  ``try_merge_blocks``), so a request larger than every cached block is not served from
  the cache however much of it is free: ``alloc_block`` cudaMallocs a new segment, and
  only when that fails are whole cached segments released (``release_available_cached_
  blocks``, then ``release_cached_blocks``) and the call retried.  A freed block stays
  cached (reserved, what nvidia-smi shows) until ``empty_cache``, which neither DeepSpeed
  56c522386's pipeline engine and BF16_Optimizer nor bigscience-workshop/Megatron-
  DeepSpeed b1359ee0 call (``git grep empty_cache``: no hit).

So a transient that is larger than every block freed before it grows the reserved memory
by its own segment while the device has room, and keeps it: the reserved peak is the live
peak of the phase before it (whose segments stay cached) plus that segment
(:func:`reserved_bytes`).  Where the transient itself sets the live peak (a stage with few
activations in flight: ``memory.stage_memory`` counts the copy in its ``workspace``), the
live peak already holds the copy, which lives in that segment: it is not counted twice.
It does not make a layout run out of memory (the allocator releases whole cached
segments and retries first), so ``fits`` stays on the live peak.

The one such transient read from a source here (:func:`cached_bytes`): DeepSpeed's
BF16_Optimizer (``plan.bf16_optimizer``, DeepSpeed 56c522386) all-reduces its fp32
gradients after the pipeline has drained: ``PipelineEngine._exec_reduce_grads`` ->
``_bf16_reduce_grads`` -> ``buffered_allreduce_fallback(grads=optimizer.
get_grads_for_reduction())``: the flat fp32 buffer of each parameter group, one tensor
each (``allreduce_no_retain`` buckets of at least 5e8 elements; ``allreduce_bucket``'s
``self.flatten`` of one tensor is a view, torch/csrc/utils/tensor_flatten.h), cast
``tensor.to(communication_data_type)``: a bf16 copy of the weight-decay group in ONE
block, 2 bytes per parameter (Megatron's groups, bigscience-workshop/Megatron-DeepSpeed
b1359ee0 megatron/optimizer/__init__.py lines 26-47: all but the biases and LayerNorm
weights, under 0.1% of a BLOOM stage's parameters: taken as all of them).  Before it,
the largest blocks freed on the rank are each parameter's fp32 gradient cast in
``update_hp_grads`` (4 bytes x the largest parameter), the per-tensor bf16 weights
BF16_Optimizer frees when it flattens them (2 bytes x each), and a layer's activations
(bounded by the whole layer's without recompute; the last stage's fp32 logits): for
BLOOM's stages 8 GB against at most 3.6 GB, so the copy is a segment of its own.

Modelled only there: for every other framework (Megatron-LM, FSDP2 / torchtitan,
DeepSpeed without a bf16 pipeline, this library's recipe) no source read here says which
transients outgrow the cached blocks, so :func:`cached_bytes` and :func:`reserved_bytes`
return None (``Estimate.details["reserved_memory"]`` is None: not modelled), never the
live peak presented as what nvidia-smi reads.

Not counted (no measurement): the fragmentation of the segments the pipeline phase
leaves partly used (``Profile.runtime_memory["fragmentation"]``, an ASSUMPTION kept back
from the usable memory).
"""
from __future__ import annotations

from . import bf16_optimizer as _bf16

__all__ = ["SOURCE", "modelled", "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER",
           "MIN_LARGE_ALLOC", "ROUND_LARGE", "round_size", "segment_bytes",
           "new_segment_bytes", "largest_freed_bytes", "cached_bytes", "reserved_bytes",
           "assumption"]

SOURCE = ("pytorch/pytorch v1.11.0 c10/cuda/CUDACachingAllocator.cpp "
          "(DeviceCachingAllocator::malloc: get_free_block, alloc_block, "
          "release_cached_blocks)")
MiB = 1 << 20
MIN_BLOCK = 512              # kMinBlockSize
SMALL_SIZE = 1 * MiB         # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * MiB       # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 * MiB      # kLargeBuffer: a segment for requests below kMinLargeAlloc
MIN_LARGE_ALLOC = 10 * MiB   # kMinLargeAlloc
ROUND_LARGE = 2 * MiB        # kRoundLarge


def modelled(cfg, lay) -> bool:
    """Whether the caching allocator's reserved memory is modelled for ``lay``: DeepSpeed's
    BF16_Optimizer pipelines only (module docstring)."""
    return _bf16.applies(cfg, lay)


def _bytes(fn: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not n >= 0 \
            or n == float("inf"):
        raise ValueError(f"{fn}: nbytes={n!r} must be a finite number of bytes >= 0")
    return int(-(-n // 1))


def round_size(nbytes) -> int:
    """The block size the allocator gives a request of ``nbytes`` (``round_size``)."""
    n = _bytes("round_size", nbytes)
    return MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK


def segment_bytes(nbytes) -> int:
    """Bytes cudaMalloc'd for a new segment serving a request of ``nbytes``
    (``get_allocation_size`` of the rounded size)."""
    n = round_size(nbytes)
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-n // ROUND_LARGE) * ROUND_LARGE


def new_segment_bytes(nbytes, largest_cached) -> int:
    """Bytes the reserved memory grows by for a request of ``nbytes`` when the largest
    cached free block is ``largest_cached`` bytes: 0 when that block can serve it, else
    the new segment (module docstring)."""
    if round_size(nbytes) <= _bytes("new_segment_bytes", largest_cached):
        return 0
    return segment_bytes(nbytes)


def largest_freed_bytes(cfg, lay, stage: int, layers: int) -> float:
    """An upper bound on the largest block freed on a rank of ``stage`` before the DP
    sync of a BF16_Optimizer pipeline (module docstring)."""
    from .memory import layer_activation_bytes
    largest = _bf16.largest_numel(cfg, lay.tp, lay.pp, stage, layers)
    out = max(4 * largest,                                   # update_hp_grads' fp32 cast
              layer_activation_bytes(cfg, lay.micro_batch, lay.tp, lay.sp, "none")
              if layers else 0.0)
    if stage == lay.pp - 1:                                  # the loss's fp32 logits
        out = max(out, 4.0 * cfg.seq_len * lay.micro_batch * cfg.vocab_size / lay.tp)
    return out


def cached_bytes(cfg, lay, stage: int, psi: float, layers: int) -> float:
    """Bytes the caching allocator keeps reserved beyond the live peak on a rank of
    ``stage`` (``psi`` parameters in ``layers`` layers) for the transients a source
    names: BF16_Optimizer's bf16 copy of its fp32 gradients at the DP sync, a segment of
    its own when it exceeds every block freed before it; None where not modelled
    (other frameworks: no transient read, :func:`modelled`; module docstring)."""
    if isinstance(psi, bool) or not isinstance(psi, (int, float)) or not psi >= 0:
        raise ValueError(f"cached_bytes: psi={psi!r} must be the stage's parameters, a "
                         f"number >= 0")
    if not modelled(cfg, lay):
        return None
    _, sync = _bf16.transient_bytes(psi, 0.0)
    return float(new_segment_bytes(sync, largest_freed_bytes(cfg, lay, stage, layers)))


def reserved_bytes(cfg, lay, stage: int, psi: float, layers: int, memory: dict,
                   attention: str = "materialized") -> "float | None":
    """The reserved peak of a rank of ``stage`` whose live memory is ``memory``
    (``memory.stage_memory``): the live peak of the pipeline phase, whose segments stay
    cached, plus the segment :func:`cached_bytes` adds at the DP sync; at least the live
    peak.  ``memory["workspace"]`` holds the sync's bf16 copy where the copy sets the
    peak (``sync + after - activations``, ``after`` what the pipeline engine's buffers
    keep, ``deepspeed_pipe_memory.after_pipeline_bytes``): that share is the copy itself,
    inside the new segment,
    so the pipeline phase's peak takes the workspace without it (the loss's, a
    recompute's, ``update_hp_grads``' fp32 cast; ``memory.workspace_bytes``).  None where
    the allocator is not modelled (:func:`modelled`)."""
    cache = cached_bytes(cfg, lay, stage, psi, layers)
    if cache is None:
        return None
    if not cache:
        return memory["total"]
    from .ep_cp import token_cfg
    from .memory import workspace_bytes
    from .deepspeed_pipe_memory import backward_held_bytes
    tcfg = token_cfg(cfg, lay)
    during, _ = _bf16.transient_bytes(psi, _bf16.largest_numel(cfg, lay.tp, lay.pp, stage,
                                                               layers))
    during += backward_held_bytes(tcfg, lay, stage)["update"]    # as memory.stage_memory
    pipe_ws = min(max(workspace_bytes(tcfg, lay, stage, attention), during),
                  memory["workspace"])
    pipeline = memory["total"] - memory["workspace"] + pipe_ws
    return max(memory["total"], pipeline + cache)


def assumption(cache: float) -> str:
    """The line ``Estimate.assumptions`` gives for the allocator's cached segment."""
    return (f"reserved memory (what nvidia-smi reads, less the CUDA context): the "
            f"pipeline phase's live peak + {cache / 1e9:.2f} GB that PyTorch's caching "
            f"allocator keeps cached for BF16_Optimizer's bf16 gradient copy at the DP "
            f"sync, larger than every block freed before it ({SOURCE}); fragmentation "
            f"not counted (ASSUMED in the usable memory); fits is judged on the live "
            f"peak (cached segments are released before an out-of-memory error)")
