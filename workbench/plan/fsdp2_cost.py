"""What PyTorch FSDP2 (``fully_shard``, as torchtitan applies it) runs beyond its collectives:
the copy kernels around each all-gather and reduce-scatter, and the attention kernel that
``F.scaled_dot_product_attention`` picks on the device.

**Copies** (pytorch/pytorch ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``
at 010ae4a8; the 2024 releases, ``torch/distributed/_composable/fsdp/``, the same kernels).
Per unit (one ``FSDPParamGroup``: a transformer block, or the root's embedding, final norm
and output layer) of N parameters sharded over the dp x cp ranks (N / shards each), with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` over fp32 sharded
parameters (torchtitan's default, ``frameworks``):

- all-gather copy-in (``foreach_all_gather``: ``_get_param_all_gather_inputs`` casts
  the fp32 shard to bf16 with ``torch._foreach_copy_``, then ``all_gather_copy_in``
  copies it into this rank's slice of the all-gather buffer): read 4 + write 2, then
  read 2 + write 2 bytes per shard element.  Stream: ``all_gather_copy_in_stream``
  (``FSDPCommContext.get_all_gather_streams``: forward and pre-backward, i.e. the
  implicit prefetch this estimate models); the all-gather stream waits for it
  (``all_gather_stream.wait_stream``), so it is priced in series with its all-gather on
  the comm stream model (``zero_cost``), hidden where the gather is;
- all-gather copy-out (``foreach_all_gather_copy_out``: ``split_with_sizes_copy`` of
  the gathered flat buffer into each parameter): read 2 + write 2 bytes per unsharded
  element, on the **current (compute) stream**: ``wait_for_unshard`` runs it from the
  module's pre-forward / pre-backward hook after ``current_stream().wait_event`` on the
  all-gather: on the critical path;
- reduce-scatter copy-in (``foreach_reduce``: ``torch._chunk_cat`` of the bf16 unsharded
  gradients into the fp32 reduce-scatter input, the widening cast inside the kernel):
  read 2 + write 4 bytes per unsharded element, on the **current stream** ("Only after
  the copy-in finishes can we free the gradients", then ``reduce_scatter_stream.
  wait_stream(current_stream)``; pytorch/pytorch#129721, 2024-06, moved it there; before,
  it ran on the reduce-scatter stream and the current stream waited for it,
  ``current_stream.wait_stream(reduce_scatter_stream)``: on the critical path either way;
  ``_chunk_cat`` since pytorch/pytorch#122888, 2024-03-28, so in the April 2024 nightlies
  of the A100 rows too: before it, ``torch.cat`` of padded views; #120678, which added
  its CUDA path, measured bf16 in / fp32 out at 278 G elements/s on an H100, 1.67 TB/s
  read + written, where ``COPY_RATE``'s measurement reads 1.84: within 10%);
- after the reduce-scatter, on the reduce-scatter stream: no division (fp32 reduces with
  NCCL's AVG, ``_get_gradient_divide_factors``; since pytorch/pytorch#120919, 2024-02-29:
  before it, a pre- and a post-divide ``div_``, the first over the whole fp32 input on the
  critical path; neither in the rows' releases), no cast (``reduce_dtype`` = the fp32
  original dtype), the shard assigned as the gradient on the first micro-batch of a step
  and accumulated (``sharded_param.grad._local_tensor += new_sharded_grad``: read 4 + 4,
  write 4 bytes per shard element) on the later ones (torchtitan reduces every
  micro-batch; ``zero_grad`` sets the gradients to None): priced in series with the
  reduce-scatter on the comm stream model, (m - 1) / m of it per micro-batch.

Each is priced as memory traffic at the profile's memory rate (``compute_time(0, bytes,
..., op_class="data_movement")``, one launch) times the share of it the kernel reached
on an H100 (``COPY_RATE``, measured: the cast and the foreach copy of a shard 63-76% of a
plain copy's rate, the chunk-cat 61%, the copy-out 90%, the accumulation 98%).

Which units gather again for backward follows the code: FSDP2's root keeps its
parameters after forward (``FSDPState._lazy_init``: the root's ``post_forward_mesh_info
= None``) and torchtitan's "default" ``reshard_after_forward`` policy keeps the last
transformer block (``parallelize_llama.apply_fsdp``, pytorch/torchtitan 1cb1fa19,
2025-05: "FSDP would prefetch it immediately"); so backward copies out every block but
the last and not the root, and the comm stream model (``zero_cost.zero_exposed``'s
``stay``) gathers neither again.  Not modeled: padding to a multiple of the shard count,
the copy-in's wait on the previous copy-out (``wait_for_unshard``'s
``_wait_all_gather_streams_on_event``), the compute stream's wait on the previous
reduce-scatter before a copy-in (newer releases), and HBM contention of the side
streams' copies with compute beyond the comm stream model's ``overlap_rate``.

**Attention** (``sdpa_profile``): torchtitan's Llama calls
``F.scaled_dot_product_attention`` (``ScaledDotProductAttention``), which runs the first
backend of ``priority_order`` (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``)
whose checks pass.  On an H100 (sm90): FlashAttention-2 first in PyTorch 2.4 (cuDNN
made first on H100 by #125343 was reverted on the release branch, #128539) and from 2.5.1
(#138522, "Make CuDNN Attention Opt in", cherry-picked onto release/2.5 after 2.5.0 had
put cuDNN first on sm90) through 2.8 (default order flash, efficient, math, cudnn);
cuDNN first again from 2.9 (#162073, cuDNN >= 9.9 on sm90/sm100; later gated on
cuDNN > 9.15, #171627).  torchtitan forced ``[FLASH, EFFICIENT, MATH]`` on the H100
(``sdpa_kernel(..., set_priority=True)``, cuDNN first only on sm100) from #1196
(2025-05-14) until #1776 (2025-10-09) put cuDNN first.  So FSDP runs of 2024-2025 on H100
ran FlashAttention-2, except with PyTorch 2.5.0 or 2.9 and torchtitan from October 2025:
ASSUMPTION stated in the estimate.  A profile with measured attention (the H100's:
cuDNN) is re-priced at the file's measured FlashAttention-2 rates for ``framework=
"fsdp"``.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

from ..sim_mesh.cost import compute_time
from . import frameworks as F
from . import zero_cost as Z

__all__ = ["SDPA_BACKEND", "unit_copy_bytes", "copy_seconds", "stage_copies",
           "sdpa_profile", "assumptions"]

# torchtitan (config: training.mixed_precision_param "bfloat16", _reduce "float32") over
# fp32 parameters: bytes per element of each buffer the copies touch
MASTER_BYTES = 4            # the sharded parameters (the fp32 originals)
PARAM_BYTES = 2             # MixedPrecisionPolicy.param_dtype: bf16 gathers and gradients
REDUCE_BYTES = F.FSDP_REDUCE_BYTES      # reduce_dtype fp32: the reduce-scatter buffers

# MEASURED (benchmarks/fsdp2_copies.py on one H100 80GB HBM3, PyTorch 2.11.0+cu130,
# 2026-11-26, output in benchmarks/fsdp2_copies_h100.json): each kernel at a Llama 3 8B
# block's sizes (218M parameters, 8 shards), bytes read + written per second, over the
# same card's plain device copy, 2,998 GB/s (the profile's memory_efficiency is that
# measurement, 0.901 of 3.35 TB/s): the fp32 -> bf16 cast (_foreach_copy_) 2,271 GB/s,
# the copy into the gather buffer (_foreach_copy_) 1,880, split_with_sizes_copy 2,708,
# _chunk_cat bf16 -> fp32 1,836, the fp32 add_ 2,940.  ASSUMPTION: the same shares of
# the memory rate on other devices and other releases (the kernels of 2024-2025 were
# not timed); they are priced at share x memory_bandwidth x memory_efficiency
COPY_RATE = {"all_gather_cast": 2271 / 2998, "all_gather_copy_in": 1880 / 2998,
             "all_gather_copy_out": 2708 / 2998, "reduce_scatter_copy_in": 1836 / 2998,
             "grad_accumulate": 2940 / 2998}

# the backend F.scaled_dot_product_attention runs on an H100 in the 2024-2025 releases
# (module docstring): sim_mesh.measured's name for FlashAttention-2
SDPA_BACKEND = "flash"
# ``ranges.profile_at``'s ends keep the kernel they set: the range of an FSDP estimate
# spans FlashAttention-2 (the point, the slow end) .. cuDNN (PyTorch 2.5.0 and 2.9+)
RANGE_ENDS = (" (slow end)", " (fast end)")


def unit_copy_bytes(numel: float, shards: int) -> dict:
    """Bytes read + written by each copy kernel FSDP2 runs for one unit of ``numel``
    parameters sharded ``shards`` ways, once each (module docstring):
    ``all_gather_cast`` (the fp32 shard cast to bf16), ``all_gather_copy_in`` (copied
    into the gather buffer), ``all_gather_copy_out`` (the gathered buffer split into the
    parameters), ``reduce_scatter_copy_in`` (bf16 gradients chunk-cat into the fp32 input),
    ``grad_accumulate`` (the reduced fp32 shard added to the sharded gradient)."""
    if isinstance(numel, bool) or not isinstance(numel, (int, float)) or numel < 0:
        raise ValueError(f"unit_copy_bytes: numel={numel!r} must be a number of "
                         f"parameters >= 0")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"unit_copy_bytes: shards={shards!r} must be the ranks a unit "
                         f"is sharded over, an int >= 1")
    shard = numel / shards
    return {"all_gather_cast": shard * (MASTER_BYTES + PARAM_BYTES),
            "all_gather_copy_in": shard * (PARAM_BYTES + PARAM_BYTES),
            "all_gather_copy_out": numel * (PARAM_BYTES + PARAM_BYTES),
            "reduce_scatter_copy_in": numel * (PARAM_BYTES + REDUCE_BYTES),
            "grad_accumulate": shard * 3 * REDUCE_BYTES}


def copy_seconds(nbytes: float, prof, kernel: str) -> float:
    """One ``kernel`` (a key of ``unit_copy_bytes``) moving ``nbytes`` (read + written)
    at its measured share (``COPY_RATE``) of the profile's memory rate."""
    if kernel not in COPY_RATE:
        raise ValueError(f"copy_seconds: kernel={kernel!r}; use one of {list(COPY_RATE)}")
    if nbytes <= 0:
        return 0.0
    return compute_time(0.0, nbytes / COPY_RATE[kernel], prof, "bfloat16",
                        op_class="data_movement")


def stage_copies(blocks, n_layers: int, first: bool, last: bool, shards: int,
                 micro_batches: int, prof) -> dict:
    """FSDP2's copies for one micro-batch of a stage whose units are ``blocks`` (forward
    order, ``zero_cost.stage_blocks``: the embedding if ``first``, ``n_layers`` blocks,
    the final norm and head if ``last``), sharded ``shards`` ways, ``micro_batches`` per
    step.  Returns ``blocks`` with the compute-stream copies added to their forward
    (copy-out) and backward (copy-out when gathered again, reduce-scatter copy-in)
    seconds, those seconds summed (``forward``, ``backward``), the side streams' price
    per unit of n elements (``gather_extra(n)``: the copy-in before each all-gather;
    ``reduce_extra(n)``: the gradient accumulation after each reduce-scatter, averaged
    over the step's micro-batches), the indices of the blocks kept gathered from forward
    to backward (``stay``: the root's and the last block; ``zero_cost.zero_exposed``
    gathers no other time for them), and the bytes of each kernel per micro-batch."""
    if len(blocks) != n_layers + first + last:
        raise ValueError(f"stage_copies: {len(blocks)} blocks for {n_layers} layers "
                         f"(first={first}, last={last}); give zero_cost.stage_blocks' "
                         f"per-block list (not per_module)")
    out, fwd, bwd = [], 0.0, 0.0
    totals = dict.fromkeys(COPY_RATE, 0.0)
    last_layer = int(first) + n_layers - 1
    for i, b in enumerate(blocks):
        by = unit_copy_bytes(b.numel, shards)
        root = (first and i == 0) or (last and i == len(blocks) - 1)
        regather = not root and i != last_layer     # resharded after forward
        f = copy_seconds(by["all_gather_copy_out"], prof, "all_gather_copy_out")
        g = (f if regather else 0.0) + copy_seconds(by["reduce_scatter_copy_in"], prof,
                                                    "reduce_scatter_copy_in")
        out.append(Z.Block(b.numel, b.fwd + f, b.bwd + g))
        fwd, bwd = fwd + f, bwd + g
        for k in totals:
            n = 1 + regather if k.startswith("all_gather") else 1
            totals[k] += n * by[k]
    acc = (micro_batches - 1) / micro_batches
    totals["grad_accumulate"] *= acc

    def gather_extra(n):
        by = unit_copy_bytes(n, shards)
        return sum(copy_seconds(by[k], prof, k)
                   for k in ("all_gather_cast", "all_gather_copy_in"))

    def reduce_extra(n):
        return acc * copy_seconds(unit_copy_bytes(n, shards)["grad_accumulate"], prof,
                                  "grad_accumulate")

    stay = tuple(i for i in range(len(blocks)) if (first and i == 0) or i == last_layer
                 or (last and i == len(blocks) - 1))
    return {"blocks": out, "forward": fwd, "backward": bwd, "gather_extra": gather_extra,
            "reduce_extra": reduce_extra, "stay": stay, "bytes": totals}


@lru_cache(maxsize=None)
def sdpa_profile(prof):
    """``prof`` with its measured attention at ``SDPA_BACKEND``'s rates (FlashAttention-2,
    module docstring), or ``prof`` itself where it has no measured attention, already
    prices that kernel, or is an end of ``ranges.profile_at`` (``RANGE_ENDS``); raises
    where its measurement file has no such rows."""
    ms = dict(prof.measured)
    if not ms or ms["attention_backend"] == SDPA_BACKEND or prof.name.endswith(RANGE_ENDS):
        return prof
    from ..sim_mesh import measured as M
    have = sorted({b for b, _ in M.load(ms["file"]).attention})
    if SDPA_BACKEND not in have:
        raise ValueError(f"framework='fsdp' on profile {prof.name!r}: its measurements "
                         f"({ms['file']}) have attention rows for {have}, not "
                         f"{SDPA_BACKEND!r} (FlashAttention-2, which PyTorch's SDPA runs "
                         f"on the H100 in 2024-2025); measure it with "
                         f"benchmarks/gpu_components.py")
    cites = dict(prof.citations)
    cites["measured.attention_backend"] = (
        f"framework='fsdp': F.scaled_dot_product_attention's backend priority "
        f"(plan/fsdp2_cost.py) runs FlashAttention-2 on the H100 in PyTorch 2.4 and "
        f"2.5.1-2.8 (ASSUMPTION: the run used one of them); its measured rates; was: "
        f"{prof.citations.get('measured.attention_backend', ms['attention_backend'])}")
    return dataclasses.replace(prof, measured={**ms, "attention_backend": SDPA_BACKEND},
                               citations=cites)


def assumptions(copies: dict, micro_batches: int, changed_attention: bool) -> tuple:
    """The lines ``Estimate.assumptions`` adds for an FSDP2 layout."""
    ms = 1e3 * (copies["forward"] + copies["backward"])
    out = [f"FSDP2's copy kernels (plan/fsdp2_cost.py): all-gather copy-out and the "
           f"reduce-scatter's bf16->fp32 chunk-cat on the compute stream, "
           f"{ms:.1f} ms per micro-batch x {micro_batches}; the copy-in before each "
           f"all-gather and the gradient accumulation after each reduce-scatter in series "
           f"with them on the comm stream; priced as memory traffic at the shares of "
           f"the memory rate each reached on an H100 (shares ASSUMED on other devices)"]
    if changed_attention:
        out.append("attention: F.scaled_dot_product_attention runs FlashAttention-2 on "
                   "the H100 (priority_order in PyTorch 2.4 and 2.5.1-2.8; torchtitan "
                   "forced it May-Oct 2025): ASSUMPTION the run used such a release "
                   "(PyTorch 2.5.0 and 2.9+ run cuDNN's kernel first)")
    return tuple(out)
