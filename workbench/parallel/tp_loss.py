"""``loss_parallel()``: cross-entropy on vocabulary-sharded logits, as PyTorch's context.

    parallelize_module(model, mesh, {"output": ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
    with loss_parallel():
        pred = model(tokens)                                         # (B, S, V), S(2) on tp
        loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
        loss.backward()

Inside the context ``F.cross_entropy`` (and ``nn.CrossEntropyLoss``) on DistTensor logits
runs Megatron-LM's vocabulary-parallel cross-entropy (Shoeybi et al. 2019, sec. 3;
``vocab_parallel_cross_entropy`` in megatron/core/tensor_parallel/cross_entropy.py), the
op table's "vocabulary parallel" strategy (``ops_table/cross_entropy.py``): the logits stay
where they are and three all-reduces inside the op (max logit, sum of exp, target logit)
give the exact loss; backward needs no communication.  The same conditions as torch's
(``torch/distributed/tensor/parallel/loss.py``, torch 2.13), the same ValueErrors: exactly
one mesh dim shards the class dim (dim 1; dim 0 of 1-d logits), and every other mesh dim
is Shard or Replicate.  Beyond torch: ``reduction="mean"`` on an n-d mesh and
``label_smoothing`` are exact here (the global count and the sum of logits are
all-reduced too); backward may run inside or outside the context (it is local).
Outside the context the dispatcher picks the cheapest strategy, which may gather.
Plain-tensor logits are left to torch.  Other ops (``log_softmax`` alone) are unchanged.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..sim_mesh import backends as _B
from ..sim_mesh.trace import current_trace
from .dispatch import force_candidate
from .dist_tensor import DistTensor
from .ops_table.table import on_change

__all__ = ["loss_parallel"]


def _class_dim_mesh_dim(x: DistTensor) -> tuple[int, int]:
    """(class dim, the one mesh dim sharding it); torch's errors otherwise."""
    cdim = 1 if x.ndim >= 2 else 0
    ps = x.placements
    hits = [i for i, p in enumerate(ps) if p.is_shard(cdim)]
    if len(hits) != 1:
        raise ValueError(f"loss_parallel() requires exactly one mesh dim to shard tensor "
                         f"dimension {cdim}, but got placements {ps} with {len(hits)} such "
                         "mesh dim(s). Lay the logits out Shard(-1) on tp (ColwiseParallel("
                         "output_layouts=Shard(-1)) and flatten them to (tokens, vocab)")
    bad = [i for i, p in enumerate(ps) if i != hits[0] and not (p.is_shard() or p.is_replicate())]
    if bad:
        raise ValueError(f"loss_parallel() expects non-TP mesh dims to be Shard or Replicate, "
                         f"but got {ps[bad[0]]} on mesh dim {bad[0]} of {ps}; reshard first")
    return cdim, hits[0]


def _vocab_parallel(x: DistTensor, cdim: int, md: int, key):
    """The candidate that keeps the logits where they are (the vocabulary-parallel one).
    Where it is the dispatcher's own choice, ``key`` is remembered: the dispatcher's cache
    then gives it again without forcing (a forced op is prepared afresh on every call)."""
    def pick(dec):
        if dec.op != "cross_entropy":
            return None
        for c in dec.candidates:
            if tuple(c.strategy.inputs[0]) == tuple(x.placements):
                if c is dec.chosen and key is not None:
                    _CHOSEN.add(key)
                return c
        raise ValueError(f"loss_parallel(): no vocabulary-parallel cross_entropy for logits "
                         f"of shape {tuple(x.shape)} laid out {x.placements}: the class dim "
                         f"({x.shape[cdim]}) must split evenly over mesh dim {md} (size "
                         f"{x.mesh.shape[md]}) and the target's rows as the logits' rows; pad "
                         "the vocabulary to a multiple of the tp size (Megatron's "
                         "make_vocab_size_divisible_by)")
    return pick


_CHOSEN: set = set()       # calls whose cheapest strategy is the vocabulary-parallel one
on_change(_CHOSEN.clear)   # a rule changed: the dispatcher's cache is cleared, so is this
_B.on_register(_CHOSEN.clear)


def _key(args, kwargs):
    """The call's layout, attributes and profile (what the dispatcher's cache is keyed by);
    None where a weight tensor makes it hard to say."""
    if any(a is not None for a in args[2:]) or kwargs.get("weight") is not None:
        return None
    specs = tuple(a.spec if isinstance(a, DistTensor) else (tuple(a.shape), a.dtype)
                  for a in (*args[:2], kwargs.get("input"), kwargs.get("target"))
                  if isinstance(a, (DistTensor, torch.Tensor)))
    tr = current_trace()
    attrs = tuple(sorted((k, v) for k, v in kwargs.items()
                         if k not in ("input", "target", "weight")))
    return specs, attrs, tr.profile.name if tr is not None else None


class _LossParallelMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, DistTensor):
                cdim, md = _class_dim_mesh_dim(x)
                key = _key(args, kwargs)
                if key is not None and key in _CHOSEN:
                    return func(*args, **kwargs)
                with force_candidate(_vocab_parallel(x, cdim, md, key)):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def loss_parallel():
    """Cross-entropy on class-sharded DistTensor logits computed vocabulary-parallel
    (module docstring)."""
    with _LossParallelMode():
        yield
