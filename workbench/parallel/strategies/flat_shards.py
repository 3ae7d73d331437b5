"""The layout every sharded data-parallel scheme here shares, and where a parameter lives.

ZeRO-1/2 (:mod:`.zero_optimizer_dist`), ZeRO-3 (:mod:`.zero3`) and ``FullyShardedDataParallel``
(:mod:`.fsdp`) shard a tensor the same way (Rajbhandari et al. 2020, Sec. 5; PyTorch
FSDP's ``FlatParameter``): flatten it, pad it with zeros to a multiple of N and give
rank k the k-th of N equal chunks; gathering the chunks back and dropping the padding
gives the tensor again.  :func:`flat_padded` and :func:`unflat` are those two steps, on
tensors that may carry ``lead`` leading axes (one per mesh dim, for the strategies that
store every rank's copy along them).  :func:`pack` and :func:`unpack` put several
tensors in one flat buffer and take them out again: the gradient buckets of
``DistributedDataParallel`` and of ``DataParallel`` (PyTorch DDP's ``Reducer`` copies
gradients into one flat bucket the same way; Li et al. 2020, Sec. 3.2.3).

:func:`tensor_places` finds every place a module holds a tensor (a tied weight is one
tensor in two submodules), so a wrapper makes one shard per tensor and puts its gathered
copy back in each place: ``FullyShardedDataParallel`` (its ``nn.Parameter``s) and
``Zero3`` (the DistTensors ``wb.parallelize`` made) both use it.
"""
from __future__ import annotations

import math

import torch

__all__ = ["flat_padded", "unflat", "pack", "pack_rank_major", "unpack", "tensor_places"]


def flat_padded(t: torch.Tensor, n: int, lead: int = 0) -> torch.Tensor:
    """``t`` of shape ``(*lead axes, *shape)`` as ``(*lead axes, numel + pad)``, zero-padded
    so that the last axis splits into ``n`` equal chunks."""
    flat = t.reshape(tuple(t.shape[:lead]) + (-1,))
    pad = (-flat.shape[-1]) % n
    return torch.nn.functional.pad(flat, (0, pad)) if pad else flat


def unflat(flat: torch.Tensor, shape, lead: int = 0) -> torch.Tensor:
    """The inverse of :func:`flat_padded` on a gathered flat tensor: its first
    ``prod(shape)`` elements (the padding dropped) viewed as ``(*lead axes, *shape)``."""
    numel = math.prod(shape)
    return flat[..., :numel].reshape(tuple(flat.shape[:lead]) + tuple(shape))


def pack(tensors, lead: int = 0) -> torch.Tensor:
    """One buffer ``(*lead axes, sum of numels)``: the tensors flattened after their
    ``lead`` axes (which must agree), one after the other."""
    return torch.cat([t.reshape(tuple(t.shape[:lead]) + (-1,)) for t in tensors], dim=-1)


def pack_rank_major(tensors, n: int, lead: int = 0) -> torch.Tensor:
    """One buffer ``(*lead axes, sum of numels)`` holding chunk 0 of every tensor (of
    ``n`` equal chunks each, along its last axis), then chunk 1 of every tensor...: a
    reduce-scatter of it leaves rank k exactly its chunk k of each (Megatron-LM's
    distributed optimizer shards one contiguous gradient buffer the same way,
    ``megatron/core/distributed/param_and_grad_buffer.py``)."""
    return torch.cat([t.reshape(tuple(t.shape[:lead]) + (-1,)).unflatten(-1, (n, -1))
                      for t in tensors], dim=-1).flatten(-2)


def unpack(buf: torch.Tensor, shapes, lead: int = 0) -> list:
    """The inverse of :func:`pack`: views of ``buf`` shaped ``(*lead axes, *shape)``, one
    per shape, in order."""
    out, off, head = [], 0, tuple(buf.shape[:lead])
    for shape in shapes:
        n = math.prod(shape)
        out.append(buf[..., off:off + n].reshape(head + tuple(shape)))
        off += n
    return out


def tensor_places(module, tensors_of=lambda m: m._parameters):
    """``[(qualified name, tensor, [(submodule, attr), ...])]``: every distinct tensor
    ``tensors_of(submodule)`` (a dict attr -> tensor) yields under ``module``, once, named
    where ``module.named_modules()`` first meets it (as ``named_parameters`` names a tied
    weight), with every place that holds it."""
    out, seen = [], {}
    for mname, m in module.named_modules():
        for attr, t in list(tensors_of(m).items()):
            if t is None:
                continue
            if id(t) not in seen:
                seen[id(t)] = len(out)
                out.append((f"{mname}.{attr}" if mname else attr, t, []))
            out[seen[id(t)]][2].append((m, attr))
    return out

