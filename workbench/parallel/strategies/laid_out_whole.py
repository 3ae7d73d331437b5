"""A reduction over a wrapped parameter (or its gradient) reads the module's value.

On simulated ranks ``DistributedDataParallel`` stores a parameter as one row per rank
(``(N, *shape)``) and ``FullyShardedDataParallel`` / ``fully_shard`` as flat chunks padded
with zeros (``(N, chunk)``), :mod:`.laid_out`.  Every reduction a user's loop takes of a
parameter read that storage as the parameter, silently: measured on
``Sequential(Linear(4, 8), ReLU, Linear(8, 2))`` over 4 ranks, ``sum(p.numel())`` (nanoGPT's
``get_num_params``, Hugging Face's ``num_parameters``, every "model has X params") gave 232
for 58 (DDP) and 60 (FSDP: the 2-element bias padded to 4), ``get_total_norm`` 4.0265 for
2.0133 (DDP), ``p.norm()`` 2x, ``p.sum()`` 4x (DDP), the bias's ``p.mean()`` half (FSDP's
padding), and an L2 penalty ``sum(p.pow(2).sum())`` added to the loss was 4x the
penalty with 4x its gradient (DDP).  torch's own wrappers answer as one device: torch DDP's
parameters are the module's (torch 2.13 ``torch/nn/parallel/distributed.py``: it
broadcasts and keeps ``module``'s parameters), FSDP2's are DTensors whose ``numel()`` and
reductions are the full tensor's (``torch/distributed/tensor/_api.py``, its ``numel`` is the
global shape's; a reduction's ``Partial`` result is reduced on use).

Here the functions of :data:`WHOLE` (``numel`` / ``nelement``, and the reductions:
``sum``, ``mean``, ``norm``, ``linalg.vector_norm``, ``max``, ``std``, ``all``,
``count_nonzero``...; with or without ``dim``, whose dims are the module's) given such a
storage run on its module value (``_wb_full``: DDP's rank ``broadcast_from`` row, FSDP's
chunks joined and the padding dropped; differentiable, so a penalty in the loss gets one
device's gradient), and the storage's ``shape`` stays the storage's for the wrappers' own
code and torch's (a user's own ``p.shape`` is the module's: :mod:`.laid_out_shape`).  A
unary pointwise op (``p.abs()``, ``p.square()``) keeps the layout (:mod:`.laid_out_reads`),
so ``p.abs().mean()`` reads the module's values too.
``p.dim()`` / ``p.ndim`` are the module's too (nanoGPT's weight-decay groups,
:func:`module_dims`) and ``p.view(-1)`` is the view of the module's flat parameter
(``parameters_to_vector``, :func:`module_flat_view`); a user's ``p.shape`` / ``len(p)`` /
``p[i]`` / ``p.T`` are the module's too (:mod:`.laid_out_shape`, habits13).

Where this process holds every rank's storage (``_wb_here``: simulated ranks), and for
``fully_shard`` under torch.distributed (``_wb_gathers``: FSDP2's parameters are DTensors,
measured on gloo: numel 58, dims ``[2, 1, 2, 1]``, the full norms on every process), whose
reductions gather the chunks (an all-gather every process joins, as reading FSDP2's
``Partial`` result does) and raise with autograd recording (the gather has no gradient)
or for ``p.view(-1)`` (no view of the whole exists there); so do their gradients
(:func:`.rank_grads.as_shard_grad`'s ``param``: FSDP2's ``p.grad`` is a DTensor too).
``FullyShardedDataParallel`` under torch.distributed keeps this process's chunk, as
torch FSDP1's ``use_orig_params`` parameter is this rank's flat piece.
"""
from __future__ import annotations

import math

import torch

__all__ = ["WHOLE", "NUMEL", "whole_reads", "module_dims", "module_flat_view", "check_view_as",
           "storage", "storage_shape", "storage_numel"]

_T = torch.Tensor
_NAMES = ("sum", "nansum", "mean", "nanmean", "norm", "max", "min", "amax", "amin",
          "aminmax", "prod", "std", "var", "std_mean", "var_mean", "all", "any",
          "count_nonzero", "median", "nanmedian", "logsumexp", "argmax", "argmin",
          "quantile", "nanquantile", "histc", "kthvalue", "topk", "sort", "argsort",
          "msort", "unique", "cumsum", "cumprod", "cummax", "cummin", "dist", "equal",
          "allclose", "numel", "nelement")
NUMEL = {f for f in (_T.numel, torch.numel, _T.nelement)}
WHOLE = {getattr(o, n) for n in _NAMES for o in (torch, _T) if hasattr(o, n)} | {
    torch.linalg.vector_norm, torch.linalg.norm, torch.linalg.matrix_norm,
    torch._foreach_norm}


_COMPARE = {torch.equal, torch.allclose, _T.equal, _T.allclose, torch.dist, _T.dist}


def storage_shape(t) -> tuple:
    with torch._C.DisableTorchFunctionSubclass():
        return tuple(t.shape)


def storage(t) -> torch.Tensor:
    """``t``'s whole storage as a plain tensor (every rank's row or chunk, the padding
    too): the wrappers' own view of it, which a user's ``p[k]`` / ``p.shape`` no longer is
    (:mod:`.laid_out_shape`); a write through it writes the storage as it is."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.view(t.shape)


def storage_numel(t) -> int:
    """The elements ``t``'s storage holds (every rank's row or chunk, padding too), which
    the wrappers' byte counts read; ``t.numel()`` is the module's."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.numel()


def _here(t, reads) -> bool:
    """Is ``t`` a storage laid out otherwise than its module shape whose reads are the
    module's: held whole here (``_wb_here``), or gathered (``_wb_gathers``)?"""
    gathers = getattr(t, "_wb_gathers", False)
    if gathers == "users":      # fully_shard over tp, simulated: a user's reads only
        from .laid_out_views import users_call
        gathers = users_call()
    return isinstance(t, reads) and getattr(t, "_wb_full", None) is not None and \
        (getattr(t, "_wb_here", False) or gathers) and \
        storage_shape(t) != getattr(t, "_wb_shape", None)


def _module_value(t, reads):
    """``t``'s module value where :func:`_here`; else None.  Gathered (``fully_shard``
    under torch.distributed: an all-gather every process of the group joins, as FSDP2's
    DTensor reduces its ``Partial`` result on use), it carries no gradient, so a
    reduction that autograd would record raises (a penalty in the loss would get none)."""
    if not _here(t, reads):
        return None
    if not getattr(t, "_wb_here", False) and torch.is_grad_enabled() and t.requires_grad:
        raise NotImplementedError(
            "a reduction of a fully_shard parameter (under torch.distributed, or over tensor "
            f"parallelism) with autograd recording ({t._wb_layout}): its module value is "
            "gathered from every rank's shard, "
            "and the gather carries no gradient, so a penalty built from it would get none. "
            "Read it under torch.no_grad() (or of p.detach()) for logging; for a penalty in "
            "the loss use the optimizer's weight_decay")
    with torch._C.DisableTorchFunctionSubclass():
        return t._wb_full(t)


_DIMS = (_T.dim, _T.ndimension)
_NDIM = _T.ndim.__get__         # compared with ==: a fresh method-wrapper each time


def module_dims(func, args, params) -> int | None:
    """``p.dim()`` / ``p.ndim`` of a laid-out parameter (or its ``.data``: ``params``) held
    here: the module's number of dims, as torch DDP's parameter and FSDP2's DTensor
    answer (nanoGPT's ``configure_optimizers`` decays the ``p.dim() >= 2`` parameters:
    DDP's rows made every bias 2-d, FSDP's chunks every parameter).  None otherwise."""
    if not args or not (func in _DIMS or func == _NDIM) or not isinstance(args[0], params) \
            or not _here(args[0], params):
        return None
    return len(args[0]._wb_shape)


def module_flat_view(func, args, params):
    """``p.view(-1)`` of a laid-out parameter (or its ``.data``) held here, as the view of
    the module's flat parameter (DDP: rank ``broadcast_from``'s row; FSDP: the chunks'
    elements before the padding), which ``torch.nn.utils.parameters_to_vector`` joins
    (it gave every row, or the padding: 232 or 60 elements for 58).  None otherwise (a
    storage that is not contiguous: torch's view error)."""
    if func is not _T.view or len(args) != 2 or not isinstance(args[0], params) or \
            not _here(args[0], params):
        return None
    p, size = args
    size = tuple(size) if isinstance(size, (tuple, list, torch.Size)) else (size,)
    if size not in ((-1,), (math.prod(p._wb_shape),)):
        return None
    if not getattr(p, "_wb_here", False):
        raise NotImplementedError(
            "p.view(-1) of a fully_shard parameter (under torch.distributed, or over tensor "
            "parallelism; FullyShardedDataParallel's and Zero3's over tensor parallelism "
            f"too): {p._wb_layout}, its storage a chunk, so it is no view of the whole "
            "parameter (FSDP2's DTensor gives one; parameters_to_vector over the chunks would "
            "join the chunks, not the parameter).  Read the whole parameter with "
            "p.full_tensor() (a copy, gathered: every process calls it)")
    with torch._C.DisableTorchFunctionSubclass():
        if not p.is_contiguous():
            return None
        flat = p._wb_full(p).reshape(-1)
        return flat if flat.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() \
            else None


def check_view_as(func, args, params) -> None:
    """``t.view_as(p)`` of a plain ``t`` of ``p``'s module numel, ``p`` a laid-out parameter
    held here: what ``torch.nn.utils.vector_to_parameters`` does before ``p.data = ...``
    (which would swap the storage for the module's shape).  torch raised its shape error
    naming the storage's shape; this names the fix (``p.copy_``: every rank's copy)."""
    if func is not _T.view_as or len(args) != 2 or isinstance(args[0], params) or \
            not isinstance(args[1], params) or not _here(args[1], params):
        return
    p = args[1]
    if args[0].numel() == math.prod(p._wb_shape):
        raise RuntimeError(
            f"t.view_as(p) of a wrapped parameter (torch.nn.utils.vector_to_parameters): "
            f"{p._wb_layout}, not the module's shape {p._wb_shape}, and p.data = t would "
            "replace that storage.  Write the values in: with torch.no_grad(): "
            f"p.copy_(t.view({p._wb_shape})) for each parameter (every rank's copy), or "
            "load them with the wrapper's load_state_dict")


def whole_reads(func, args, kwargs, reads):
    """``(True, result)`` of ``func`` (one of :data:`WHOLE`) with every laid-out operand
    (also in a list: ``torch._foreach_norm``) read as its module value; ``(False, None)``
    where ``func`` is not such a reduction or no operand is laid out."""
    if func not in WHOLE:
        return False, None
    if func in NUMEL:
        t = args[0] if args else kwargs.get("input")
        if not _here(t, reads):
            return False, None
        return True, math.prod(t._wb_shape)
    if func in _COMPARE:
        # two storages of one layout compare as they are; a laid-out operand meets a
        # plain tensor of its module shape as its module value (torch.equal(p, ref_w))
        flat = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        lays = [a for a in flat if _here(a, reads)]
        if not any(not isinstance(a, reads) and tuple(a.shape) == t._wb_shape
                   for a in flat for t in lays):
            return False, None
    hit = False

    def one(a):
        nonlocal hit
        v = _module_value(a, reads) if isinstance(a, torch.Tensor) else None
        if v is None:
            return a
        hit = True
        return v
    new = tuple([one(x) for x in a] if isinstance(a, (list, tuple)) else one(a)
                for a in args)
    kw = {k: one(v) for k, v in kwargs.items()}
    if not hit:
        return False, None
    with torch._C.DisableTorchFunctionSubclass():
        return True, func(*new, **kw)
