"""Torch DDP's gradient buckets as Megatron-LM of 2021 runs them with ``--DDP-impl torch``.

Narayanan et al. 2021's pp = 1 rows (NGC 20.12: torch 1.8) wrap the fp16 model in
``torch.nn.parallel.DistributedDataParallel`` with its defaults, and accumulate the
micro-batches under ``no_sync`` (``plan.megatron_2021``): the gradients are all-reduced
bucket by bucket during the last micro-batch's backward.  What torch 1.8 does:

- ``bucket_cap_mb=25``: ``bucket_bytes_cap = int(bucket_cap_mb * 1024 * 1024)``, and one
  first bucket of ``dist._DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB (distributed.py's
  ``_ddp_init_helper``: "a single small bucket for parameters that are defined first, such
  that their gradients don't spill into a much larger bucket");
- ``compute_bucket_assignment_by_size`` (reducer.cpp) walks the parameters and closes a
  bucket once its bytes reach the current limit (1 MiB for the first, then 25 MiB; a
  tensor is never split), one dtype here (fp16);
- after the first iteration the reducer rebuilds its buckets in the order the gradients
  became ready in backward (``Reducer::rebuild_buckets``: ``rebuilt_params_`` with the same
  limits ``kDefaultFirstBucketBytes``, ``bucket_bytes_cap_``), and all-reduces them in
  that order, one bucket after the other (``mark_bucket_ready``), each once all its
  gradients are ready.  So in the steady state the 1 MiB bucket is the first gradients of
  the backward (the final LayerNorm's and the last layer's fc2), and the word embedding
  (tied to the head at pp = 1: its gradient is complete only after the embedding's own
  backward) closes the last bucket with the position table and what is left of layer 0.

:func:`buckets` turns the stage's blocks into those buckets (as ``megatron_buckets`` does
for Megatron-core's: each a :class:`~workbench.plan.zero_cost.Block` holding the share of
its blocks' compute that its parameters hold, ASSUMPTION as there), in forward order, so
that ``zero_cost.zero_exposed`` issues each all-reduce when its earliest parameter's
backward share ends.  ASSUMPTION: the gradients become ready in reverse definition order
(Megatron's layers run in order; a layer's parameters by their GEMMs' backward).  The
all-reduce count: :func:`count`.  Before (one all-reduce per layer, the embedding and the
final norm), the pp = 1 Narayanan rows' exposed tail was the embedding's and layer 0's;
tests/test_nccl12.py holds the bucket formation to the rules above.
"""
from __future__ import annotations

from . import megatron_buckets as MB
from .zero_cost import Block

__all__ = ["CAP_BYTES", "FIRST_BYTES", "SOURCE", "assign", "applies", "buckets", "count"]

CAP_BYTES = 25 * 1024 * 1024    # DistributedDataParallel(bucket_cap_mb=25) x 1024 x 1024
FIRST_BYTES = 1024 * 1024       # dist._DEFAULT_FIRST_BUCKET_BYTES (kDefaultFirstBucketBytes)
SOURCE = ("pytorch/pytorch v1.8: torch/nn/parallel/distributed.py (bucket_cap_mb=25, "
          "_DEFAULT_FIRST_BUCKET_BYTES, buckets reversed for the reducer), "
          "torch/csrc/distributed/c10d/reducer.cpp (compute_bucket_assignment_by_size, "
          "rebuild_buckets in gradient-ready order)")


def assign(sizes, limits=(FIRST_BYTES, CAP_BYTES)) -> list:
    """Torch's ``compute_bucket_assignment_by_size`` for tensors of one dtype: ``sizes``
    (bytes, in the order walked) -> lists of their indices; a bucket closes once its bytes
    reach the current limit, the limits taken in turn, the last repeated."""
    if not limits or any(not lim > 0 for lim in limits):
        raise ValueError(f"limits={limits!r} must be positive byte counts")
    out, cur, held, k = [], [], 0.0, 0
    for i, n in enumerate(sizes):
        if n < 0:
            raise ValueError(f"sizes[{i}]={n!r} must be >= 0 bytes")
        cur.append(i)
        held += n
        if held >= limits[min(k, len(limits) - 1)]:
            out.append(cur)
            cur, held, k = [], 0.0, k + 1
    if cur:
        out.append(cur)
    return out


def applies(cfg, lay, stage: int, overlap_grad_reduce: bool, async_tp: bool,
            fusion: bool) -> bool:
    """Whether the stage's DP sync is torch DDP's (module docstring): Megatron-LM of 2021
    (neither the async TP all-reduce nor gradient-accumulation fusion), ZeRO-0, pp = 1,
    the reduction overlapped, the dense GPT layer."""
    return (overlap_grad_reduce and lay.engine == "megatron" and lay.zero == 0
            and lay.pp == 1 and not async_tp and not fusion and cfg.arch == "gpt"
            and not getattr(cfg, "moe_experts", 0))


def _groups(cfg, lay, stage, blocks, elem_bytes):
    items = MB._items(cfg, lay, stage, blocks)          # forward (definition) order
    ready = items[::-1]                                 # the backward's order
    return [[ready[j] for j in g] for g in assign([n * elem_bytes for _, n in ready])]


def count(cfg, lay, stage: int, blocks, elem_bytes: int = 2) -> int:
    """The all-reduces torch DDP issues per step for the stage (its rebuilt buckets)."""
    return len(_groups(cfg, lay, stage, blocks, elem_bytes))


def buckets(cfg, lay, stage: int, blocks, elem_bytes: int = 2) -> list:
    """Torch DDP's buckets of the stage's parameters as :class:`Block` s, forward order,
    each with the share of its blocks' forward and backward seconds its parameters hold."""
    out = []
    for bk in reversed(_groups(cfg, lay, stage, blocks, elem_bytes)):
        share = [(blocks[i], n / blocks[i].numel) for i, n in bk]
        out.append(Block(sum(n for _, n in bk), sum(b.fwd * w for b, w in share),
                         sum(b.bwd * w for b, w in share)))
    return out
