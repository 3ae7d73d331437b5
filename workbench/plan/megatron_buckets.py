"""Megatron-core's data-parallel buckets: the unit of its overlapped reduce-scatters and
all-gathers (``--overlap-grad-reduce --overlap-param-gather`` with the distributed
optimizer), as its source code forms them.

Source (read, not copied): NVIDIA/Megatron-LM f2e5db402c (2024-07-15, the commit of the
README's H100 table):

- ``megatron/core/distributed/distributed_data_parallel.py:51-54``: without
  ``--ddp-bucket-size`` a bucket holds ``max(40000000, 1000000 x dp)`` parameters ("If
  using very large dp_sizes, make buckets larger to ensure that chunks used in NCCL
  ring-reduce implementations are large enough to remain bandwidth-bound"); ``:66-69``:
  no bucketing (one bucket for the whole buffer) on a pipeline stage after the first
  ("data-parallel communication on these stages is not on the critical path");
- ``megatron/core/distributed/param_and_grad_buffer.py`` (``ParamAndGradBuffer``): the
  parameters are walked in REVERSE order of ``named_parameters()`` ("to roughly follow
  backprop order"), each appended to the open bucket, which closes once it holds
  ``bucket_size`` elements or more; so a bucket ends on a parameter boundary and may
  span two layers.  ``Bucket.register_grad_ready`` issues a bucket's reduce-scatter
  once every parameter in it has its gradient (in the last micro-batch's backward);
- ``megatron/core/optimizer/distrib_optimizer.py`` (``_get_model_param_buffer_dp_views``,
  ``_finish_param_sync_helper``): the updated weights are all-gathered bucket by
  bucket in forward order, the next bucket's gather issued when the previous one is
  waited for (one ahead), the first from ``zero_grad`` before the forward.

The planner's stage model (``zero_cost.stage_blocks``) has one block per layer (and one
each for the embedding and the head), so it issued one collective per layer.  Each
collective over a group spanning nodes pays NCCL's ring latency once (its pipeline fill
over the ring's steps: ``sim_mesh.nccl_tuning``), so the number of calls matters where the
sync is communication-bound: the README's GPT 32B (tp 8, one rank per node) runs 74
buckets per step where the layer blocks were 50.

:func:`buckets` turns a stage's blocks into Megatron's buckets, in forward order: each
bucket a :class:`~workbench.plan.zero_cost.Block` with its parameters and the compute of
the parameters it holds.  ASSUMPTION (as ``stage_blocks``' per-module split): a layer's
forward and backward seconds are shared among its parameters in proportion to their
elements; the embedding's and the head's likewise.  A bucket's reduce-scatter is issued
when its backward share ends (its parameters' gradients are then complete), its gather
waited for before its forward share.  The per-parameter alignment padding (64 elements,
``_pad_start_of_param_if_needed``) and the bucket-end padding (to lcm(dp, 128)) are left
out (under 0.01% of a bucket).

Applies (:func:`applies`) to Megatron-LM's GPT layer (``arch="gpt"``, dense) with the
distributed optimizer (``zero=1``) and ``overlap_grad_reduce`` on the first pipeline stage;
not to ZeRO-0 layouts: Megatron-LM of 2021's overlapped reduction (pp = 1, ``--DDP-impl
torch``) is torch DDP's, ``plan.ddp_buckets``; other ZeRO-0 layouts are left at one
collective per layer.
"""
from __future__ import annotations

from .zero_cost import Block

__all__ = ["SOURCE", "bucket_numel", "layer_param_numels", "applies", "buckets"]

SOURCE = ("NVIDIA/Megatron-LM f2e5db402c megatron/core/distributed/"
          "distributed_data_parallel.py:51-54 (bucket_size = max(40M, 1M x dp)), "
          "param_and_grad_buffer.py (buckets formed in reverse parameter order)")

DEFAULT_MIN = 40_000_000       # distributed_data_parallel.py:52
PER_DP_RANK = 1_000_000        # distributed_data_parallel.py:53


def bucket_numel(dp: int) -> int:
    """Megatron-core's default bucket size in parameters for ``dp`` data-parallel ranks:
    max(40,000,000, 1,000,000 x dp) (``distributed_data_parallel.py:51-54``)."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"bucket_numel: dp={dp!r} must be the data-parallel size, an int >= 1")
    return max(DEFAULT_MIN, PER_DP_RANK * dp)


def layer_param_numels(cfg, tp: int) -> list:
    """The elements of each parameter of one Megatron GPT layer on a tensor-parallel rank,
    in ``named_parameters()`` order of its Transformer Engine spec (f2e5db402c
    ``megatron/core/models/gpt/gpt_layer_specs.py``): ``linear_qkv`` (TE's
    LayerNormLinear: the norm's weight and bias, then the weight and bias of the fused
    q, k, v), ``linear_proj`` (weight, bias: a row-parallel bias is whole),
    ``linear_fc1`` (norm weight and bias, weight, bias), ``linear_fc2`` (weight, bias).
    They sum to ``memory.layer_params``."""
    h, f = cfg.d_model, cfg.d_ff
    return [h, h, 3 * h * h / tp, 3 * h / tp, h * h / tp, h,
            h, h, f * h / tp, f / tp, h * f / tp, h]


def applies(cfg, lay, stage: int, overlap_grad_reduce: bool) -> bool:
    """Whether the stage's DP sync runs in Megatron-core's buckets here (module docstring)."""
    return (overlap_grad_reduce and lay.engine == "megatron" and lay.zero == 1
            and stage == 0 and cfg.arch == "gpt" and not getattr(cfg, "moe_experts", 0))


def _items(cfg, lay, stage: int, blocks) -> list:
    """(block index, elements) of every parameter of the stage, forward order."""
    h, V, s, tp, pp = cfg.d_model, cfg.vocab_size, cfg.seq_len, lay.tp, lay.pp
    n_layers = lay.stage_layers(cfg.n_layer)[stage]
    first, last = stage == 0, stage == pp - 1
    want = int(first) + n_layers + int(last)
    if len(blocks) != want:
        raise ValueError(f"megatron_buckets: {len(blocks)} blocks for stage {stage} of "
                         f"{lay.short()}; expected {want} (stage_blocks' one per layer, the "
                         f"embedding and the head)")
    out, k = [], 0
    if first:      # VocabParallelEmbedding, the learned positions (BLOOM's norm after)
        parts = [V * h / tp, s * h] + ([h, h] if getattr(cfg, "embed_norm", False) else [])
        out += [(k, n) for n in parts]
        k += 1
    layer = layer_param_numels(cfg, tp)
    for _ in range(n_layers):
        out += [(k, n) for n in layer]
        k += 1
    if last:       # the final norm, then the output layer's own weight (untied or pp > 1)
        own = blocks[k].numel - 2 * h
        out += [(k, h), (k, h)] + ([(k, own)] if own > 0 else [])
    for i, b in enumerate(blocks):
        got = sum(n for j, n in out if j == i)
        if abs(got - b.numel) > 1e-6 * max(b.numel, 1):
            raise ValueError(f"megatron_buckets: block {i} of stage {stage} holds {b.numel} "
                             f"parameters, Megatron's parameter list {got}: the GPT layer "
                             f"was expected (layer_param_numels)")
    return out


def buckets(cfg, lay, stage: int, blocks) -> list:
    """Megatron-core's buckets of the stage's parameters as :class:`Block` s, forward
    order (module docstring): formed walking the parameters in reverse, each bucket
    closed once it holds ``bucket_numel(lay.dp)`` elements or more; each with the share
    of its blocks' forward and backward seconds its parameters hold."""
    size = bucket_numel(lay.dp)
    items = _items(cfg, lay, stage, blocks)
    formed, cur, held = [], [], 0.0
    for i, n in reversed(items):
        cur.append((i, n))
        held += n
        if held >= size:
            formed.append(cur)
            cur, held = [], 0.0
    if cur:
        formed.append(cur)
    out = []
    for bk in reversed(formed):         # forward order
        share = [(blocks[i], n / blocks[i].numel) for i, n in bk]
        out.append(Block(sum(n for _, n in bk), sum(b.fwd * w for b, w in share),
                         sum(b.bwd * w for b, w in share)))
    return out
