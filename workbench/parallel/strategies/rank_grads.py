"""Gradients that ``torch.nn.utils.clip_grad_norm_`` reads as one device would.

A user clips with torch's own function over the wrapper's parameters.  Two layouts of
the data-parallel wrappers would give it a wrong norm silently:

* simulated ``DistributedDataParallel``: a gradient holds one row per rank, all equal
  once averaged; the norm over the rows is ``sqrt(N)`` times one rank's;
* ``FullyShardedDataParallel`` on torch.distributed: a gradient is this rank's shard; its
  norm is the shard's, so every rank would clip by another number.

torch's functions take each gradient's norm with ``torch.linalg.vector_norm`` (or
``torch._foreach_norm`` with ``foreach=True``), ``torch.stack`` the norms and take the
norm of that (torch 2.13, ``torch/nn/utils/clip_grad.py``).  The wrappers hand out their
gradients as the tensor subclasses below, whose ``__torch_function__`` answers those
norms as the ranks of a torchrun job read them and passes every other function through
unchanged (the same storage, plain results; the optimizer's math is untouched):

* :class:`RankRows`: the norm of one row (the rows must be equal, i.e. averaged; inside
  ``no_sync()`` they differ and the norm raises, naming what to do);
* :class:`ChunkRows`: a simulated FSDP gradient (every rank's flat chunk, the last
  padded with zeros): its norm reads the parameter's elements only;
* :class:`ReplicaGrad`: a DistTensor replica's gradient (DDP's DistTensor mode,
  ``DataParallel(zero=0)``, ZeRO-1/2's replicas): the local storage of a DistTensor whose
  data-parallel dim (and any other replicated dim) holds one copy per rank; its norm reads
  one copy of each, once the copies are summed (``finish_gradient_synchronization``), and
  raises before that (each rank would clip by its own gradient);
* :class:`ShardGrad`: the shard's norm as a :class:`PartialNorm`, reduced over the ranks
  when torch takes the norm of the stacked norms (a scalar all-reduce of the p-th powers,
  as FSDP2's per-shard norms come back ``_NormPartial`` and are reduced on use: torch
  2.13, ``torch/distributed/tensor/_ops/_math_ops.py``).  A ``fully_shard`` gradient
  (``as_shard_grad(param=...)``) also answers ``numel()`` and the other reductions as the
  full gradient's, gathered (FSDP2's ``p.grad`` is a DTensor), as its parameter does
  (:mod:`.laid_out_whole`); ``FullyShardedDataParallel``'s stays this process's chunk
  (FSDP1's flat piece).

The classes live in :mod:`.normed_grads`, the norms' helpers in :mod:`.grad_norm_reads`
and :mod:`.partial_norm`, what an alias or copy keeps in :mod:`.kept_grads`; this module
makes them (``as_*``) and keeps every name's import path.
"""
from __future__ import annotations

import torch

from .grad_norm_reads import _norm_args, _refuse_held  # noqa: F401
from .kept_grads import _KEPT, StateReads, kept_as  # noqa: F401
from .normed_grads import (_MODULE_VALUED, _WHOLE_GRADS, ChunkRows, GatheredGrad,  # noqa: F401
                           RankRows, ReplicaGrad, ReplicaStorageGrad, ShardGrad, _NormedGrad,
                           _keep_grad)
from .partial_norm import PartialNorm, _full, _plain, _reduce  # noqa: F401

__all__ = ["kept_as", "states_read_as_grads", "StateReads",
           "RankRows", "ChunkRows", "ReplicaGrad", "ShardGrad", "PartialNorm",
           "ReplicaStorageGrad", "GatheredGrad", "as_gathered_grad", "as_rank_rows", "as_chunk_rows", "as_replica_grad",
           "as_shard_grad"]


def states_read_as_grads(optimizer, params) -> None:
    """After a ``torch.optim`` step over wrapped parameters: each parameter's state dict
    becomes a :class:`StateReads`, whose tensors of the storage's shape (Adam's
    ``exp_avg``, Adagrad's ``sum``... made by ``torch.zeros_like(p)``) a user reads as the
    parameter's gradient is, the module's value.  ``opt.state[p]["exp_avg"]`` (a user
    logging Adam's moments) was the storage: DDP's rows ``(4, 6, 3)`` for ``(6, 3)``, its
    norm 2x, FSDP's padded chunks ``(4, 5)`` (habits13b).  The stored states stay the
    plain storages torch.optim steps in place (habits7b): its math runs untouched."""
    for p in params:
        st = optimizer.state.get(p)
        g = p.grad if st else None
        if not isinstance(g, _MODULE_VALUED):
            continue
        with torch._C.DisableTorchFunctionSubclass():
            shape = g.shape
        like = (type(g), {k: g.__dict__[k] for k in _KEPT if k in g.__dict__}, shape)
        if type(st) is StateReads:
            st._wb_like = like
        elif type(st) is dict:
            optimizer.state[p] = StateReads(st, like)


def as_rank_rows(t):
    return t if t is None or isinstance(t, RankRows) else t.as_subclass(RankRows)


def as_chunk_rows(t, numel: int, shape=None):
    """``t`` as a :class:`ChunkRows` of a parameter of ``numel`` elements (``shape``: the
    parameter's; None: read as flat)."""
    if t is None:
        return None
    out = t if isinstance(t, ChunkRows) else t.as_subclass(ChunkRows)
    out._wb_numel = numel
    out._wb_shape = (numel,) if shape is None else tuple(shape)
    return out


def as_replica_grad(t, axes, synced: bool, hint: str, refuse: str | None = None,
                    param=None):
    """``t`` (a replica's gradient) as a :class:`ReplicaGrad` (the same storage); ``param``:
    the replica storage it is the gradient of, where that one reads as the module's
    (:class:`.laid_out_replicas.ReplicaStorage`): then a :class:`ReplicaStorageGrad`."""
    if t is None:
        return None
    cls = ReplicaGrad
    if param is not None and getattr(param, "_wb_full", None) is not None and \
            type(param).__name__ == "ReplicaStorage":
        cls = ReplicaStorageGrad
    out = t if type(t) is cls else t.as_subclass(cls)
    out._wb_axes, out._wb_synced, out._wb_hint, out._wb_refuse = axes, synced, hint, refuse
    if cls is ReplicaStorageGrad:
        out.__dict__["_wb_param_full"] = param._wb_full
        out.__dict__["_wb_pshape"] = tuple(param._wb_shape)
    return out


def as_gathered_grad(t, param):
    """``t`` (the gradient of ``param``, a ``fully_shard`` shard over tensor parallelism on
    simulated ranks whose reads gather) as a :class:`GatheredGrad` (the same storage)."""
    if t is None or getattr(param, "_wb_full", None) is None:
        return t
    out = t if isinstance(t, GatheredGrad) else t.as_subclass(GatheredGrad)
    out._wb_full, out._wb_shape = param._wb_full, param._wb_shape
    out._wb_gathers, out._wb_layout = True, f"the gradient of {param._wb_layout}"
    return out


def as_shard_grad(t, pg, skip: bool = False, param=None):
    """``t`` as a :class:`ShardGrad` whose partial norm is reduced over ``pg`` (a process
    group, or a tuple of them, one after the other: the groups of several mesh dims);
    ``skip``: this rank's copy is counted by another rank's (its norm part is zero);
    ``param``: the shard ``t`` is the gradient of, where that shard's reads gather
    (``fully_shard``'s, ``_wb_gathers``): then ``numel()`` is the module parameter's and
    the other reductions of :data:`.laid_out_whole.WHOLE` read the chunks gathered (an
    all-gather every process joins), as FSDP2's ``p.grad``, a DTensor, answers its full
    tensor's (torch 2.13 ``torch/distributed/tensor/_api.py``); before, this process's
    chunk (numel 29 for 58 on 2 processes)."""
    if t is None:
        return None
    out = t if isinstance(t, ShardGrad) else t.as_subclass(ShardGrad)
    out._wb_pg = pg
    if skip:
        out._wb_norm_skip = True
    if param is not None and getattr(param, "_wb_gathers", False):
        out._wb_full, out._wb_shape = param._wb_full, param._wb_shape
        out._wb_gathers, out._wb_layout = True, f"the gradient of {param._wb_layout}"
    return out
