"""The gradient subclasses the data-parallel wrappers hand out (:mod:`.rank_grads`'s
docstring): their shared ``__torch_function__`` (:class:`_NormedGrad`: norms answered as
one device's, every other function passed through), and one class per layout: DDP's rows,
FSDP's chunks, a DistTensor replica's storage, a shard, a gathered gradient."""
from __future__ import annotations

import math
import sys

import torch

from .grad_norm_reads import (_HELD_OK, _NORMS, _T, _norm_args, _refuse_held, _replica_norm,
                              _row_norm, _same_rows, _users_module_read)
from .kept_grads import _same_grad_layout, kept_as
from .laid_out_grad_reads import module_value_read
from .laid_out_reads import LIKES, _is_pointwise
from .laid_out_shape import module_ndim, module_shape_read, module_view
from .laid_out_views import users_call
from .laid_out_whole import WHOLE, storage_shape, whole_reads
from .partial_norm import PartialNorm, _mixed, _plain


class _NormedGrad(torch.Tensor):
    """A gradient whose norms (``_NORMS``: what torch's clip and get_total_norm call) are
    the subclass's ``_norm``; where the subclass says how (``_wb_full``: :class:`RankRows`,
    :class:`ChunkRows`), ``numel()`` and the other reductions read the gradient one device
    holds (:mod:`.laid_out_whole`), and a unary op or one with numbers only
    (``g.abs()``, ``g.pow(2)``) keeps the subclass, so ``g.abs().mean()`` does too;
    every other op runs on the plain tensor (plain results)."""
    MIXED_OK = True     # may a _foreach_norm list hold plain tensors beside these?

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and func not in _HELD_OK:
            _refuse_held(func, args[0])
        # ShardGrad: per gradient, where it gathers (fully_shard's: _wb_gathers)
        whole = getattr(cls, "_wb_here", False) or cls is ShardGrad or \
            getattr(cls, "_wb_whole", False)
        if whole:   # a user's g.shape / g.dim() / g[0]: the module's (laid_out_shape)
            done, out = module_shape_read(func, args, _WHOLE_GRADS)
            if done:
                return out
            dims = module_ndim(func, args, _WHOLE_GRADS)
            if dims is not None:
                return dims
            done, out = module_view(func, args, kwargs, _WHOLE_GRADS)
            if done:
                return out
            # a user's p.grad - g, p.grad.numpy(): the module's gradient (laid_out_grad_reads)
            done, out = module_value_read(func, args, kwargs, _MODULE_VALUED)
            if done:
                return out
        parsed = _norm_args(func, args, kwargs) if func in _NORMS else None
        if func in WHOLE and whole and (func not in _NORMS or (
                cls is ShardGrad and _gathered_norm(func, args, parsed))):
            done, out = whole_reads(func, args, kwargs, _WHOLE_GRADS)
            if done:
                return out
        if func in _NORMS:
            if parsed is not None:
                x, ord_, dtype = parsed
                if func is not torch._foreach_norm:
                    return cls._norm(x, ord_, dtype)
                if not cls.MIXED_OK and not all(isinstance(t, cls) for t in x):
                    raise _mixed()
                return tuple(cls._norm(t, ord_, dtype) if isinstance(t, cls) else
                             _plain(torch.linalg.vector_norm, (t, ord_), {"dtype": dtype})
                             for t in x)      # torch._foreach_norm returns a tuple
        out = _plain(func, args, kwargs)
        if whole:
            out = _keep_grad(func, args, kwargs, out)
        return out


def _gathers(t) -> bool:
    """Is ``t`` a ``fully_shard`` gradient under torch.distributed whose reads gather
    (:func:`as_shard_grad`'s ``param``), as FSDP2's DTensor gradient reads its full tensor?"""
    return isinstance(t, ShardGrad) and getattr(t, "_wb_gathers", False)


def _gathered_norm(func, args, parsed) -> bool:
    """A norm of a gathering gradient read from the gathered whole: along dims (a partial
    norm is the whole tensor's only), or of order 0 / -inf (the padding zeros' count or
    smallest |g| would enter a per-shard part).  Other norms stay partial
    (:func:`_shard_norm`), reduced on use, as FSDP2's ``_NormPartial``."""
    if func is torch._foreach_norm:
        return False
    if not args or not _gathers(args[0]):
        return False
    return parsed is None or float(parsed[1]) in (0.0, -math.inf)


# a gradient's alias, copy or cast: Lightning's grad_norm reads p.grad.data.norm(), fairseq's
# clip torch.norm(p.grad.detach()), torch.optim's SGD keeps torch.clone(grad) (2x on DDP)
_COPIES = {_T.detach, torch.detach, _T.clone, torch.clone, _T.to, _T.float, _T.double,
           _T.half, _T.bfloat16, _T.type_as, _T.contiguous, _T.cpu}
_DATA_GET = _T.data.__get__     # compared with ==: a fresh method-wrapper each time


def _keep_grad(func, args, kwargs, out):
    """``out`` as the gradient's subclass where ``func`` is pointwise over that one
    gradient and numbers (``g.abs()``, ``g * 2``, ``g * g``), or its alias, copy or cast
    (``g.data``, ``g.detach()``, ``g.clone()``, ``g.float()``: :data:`_COPIES`), or a
    user's own ``torch.zeros_like(g)`` (a hand-written optimizer's state); also where the
    other operands are gradients of ``g``'s very layout (``m / (v.sqrt() + eps)`` of two
    such states: it was a plain storage, its norm 2x one device's on 4 DDP ranks, a LAMB
    trust ratio 0.036 off, silently, habits7b)."""
    if not isinstance(out, torch.Tensor):
        return out
    flat = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    g = flat[0] if flat else None
    if not isinstance(g, _WHOLE_GRADS) or (isinstance(g, ShardGrad) and not _gathers(g)) or \
            any(a is not g and not _same_grad_layout(a, g) for a in flat) or \
            out.shape != g.shape or \
            not (func in _COPIES or func == _DATA_GET or _is_pointwise(func) or
                 func in LIKES and _users_own_call()):
        return out
    return kept_as(out, g)


def _users_own_call() -> bool:
    """Is the function being served called by a user's own code (the first frame outside
    this module: :func:`.laid_out_views.users_call` with ``direct``), not torch.optim's
    (whose states stay plain storages)?"""
    f, i = sys._getframe(0), 0
    while f is not None and f.f_code.co_filename == __file__:
        f, i = f.f_back, i + 1
    return f is not None and users_call(True, depth=i - 2)


class RankRows(_NormedGrad):
    """A simulated DDP gradient: row k is rank k's (equal after averaging)."""
    _wb_here = True

    @staticmethod
    def _norm(t, ord_, dtype):
        return _row_norm(t, ord_, dtype)

    @property
    def _wb_shape(self):
        return storage_shape(self)[1:]

    @staticmethod
    def _wb_full(t):
        """One row (they must be equal: :func:`_row_norm`'s check)."""
        _same_rows(t, "a reduction")
        return t[0]


class ChunkRows(_NormedGrad):
    """A simulated ``FullyShardedDataParallel`` gradient: every rank's flat chunk, one row
    each, the last padded with zeros (``_wb_numel``: the parameter's elements); its norm
    is the unpadded elements' (the padding would be the smallest |g| of order -inf)."""

    _wb_here = True

    @staticmethod
    def _norm(t, ord_, dtype):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.linalg.vector_norm(t.reshape(-1)[:t._wb_numel], ord_, dtype=dtype)

    @staticmethod
    def _wb_full(t):
        """The parameter's elements (the padding dropped), in its shape."""
        return t.reshape(-1)[:t._wb_numel].view(t._wb_shape)


class ReplicaGrad(_NormedGrad):
    """The gradient of a DistTensor replica's local storage (lead mesh axes, then the
    local shape).  ``_wb_axes``: the replicated axes holding one copy per rank (one copy
    is read); ``_wb_synced``: the copies were summed over the data-parallel ranks;
    ``_wb_hint``: what to do when they were not; ``_wb_refuse``: why no norm is built
    (torch.distributed with a sharded dim: the local norm is a shard's)."""

    @staticmethod
    def _norm(t, ord_, dtype):
        return _replica_norm(t, ord_, dtype)


class ReplicaStorageGrad(ReplicaGrad):
    """The gradient of DDP's replica storage of a tensor-parallel DistTensor on simulated
    ranks (:class:`.laid_out_replicas.ReplicaStorage`, ``(dp, tp, *local)``): a user's
    ``numel()`` / ``dim()`` / ``shape`` / reductions read the module parameter's gradient,
    as the parameter's do (habits13) and as torch DDP's ``p.grad`` is the parameter's shape.
    Before (habits14, measured on ``Linear(8, 40), ReLU, Linear(40, 8)`` over a 2 x 2
    mesh): ``p.grad.numel()`` 640 for 320, ``p.grad.dim()`` 4, ``p.grad.sum()`` twice one
    device's (every dp copy of the summed gradient).  ``_wb_param_full``: the parameter's
    storage-to-global gather; the gradient's module value is read from the summed copies
    only (``_wb_synced``), else it raises naming the fix.  A view (``p.grad[0]``) raises:
    the global gradient is gathered from the tensor-parallel shards, a copy
    (``p.grad.full_tensor()``, DTensor's name, gives it).  The wrappers' own reads of it
    stay the storage's (:func:`.laid_out_views.users_call`)."""
    _wb_here = True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from .laid_out_views import users_call
        t = args[0] if args else None
        if isinstance(t, ReplicaStorageGrad) and t.__dict__.get("_wb_param_full") is not None:
            done, out = _users_module_read(
                t, func, args, "DistributedDataParallel's parameter over tensor-parallel "
                "DistTensors")
            if done:
                return out
            if func in WHOLE and func not in _NORMS and not users_call():
                return _plain(func, args, kwargs)       # the wrappers' reads: the storage's
            return super().__torch_function__(func, types, args, kwargs)
        # a user's t - p.grad, ema.copy_(p.grad): the module's gradient (laid_out_grad_reads)
        done, out = module_value_read(func, args, kwargs, _MODULE_VALUED)
        if done:
            return out
        return ReplicaGrad.__torch_function__.__func__(ReplicaGrad, func, types, args, kwargs)

    @property
    def _wb_shape(self):
        return self.__dict__.get("_wb_pshape")

    @staticmethod
    def _norm(t, ord_, dtype):
        """Under torch.distributed (each process's replica its tensor-parallel shard, whose
        norm is no parameter's: ``_wb_refuse``) the norm of the gathered gradient, the same
        on every process (each takes it, as each clips); it raised naming
        ``wb.clip_grad_norm_`` (habits15: ``p.grad.norm()`` too).  Simulated ranks: one
        copy's norm, as :class:`ReplicaGrad`'s."""
        if getattr(t, "_wb_refuse", None) and t.__dict__.get("_wb_param_full") is not None:
            full = ReplicaStorageGrad._wb_full(t)
            with torch._C.DisableTorchFunctionSubclass():
                return torch.linalg.vector_norm(full, ord_, dtype=dtype)
        return _replica_norm(t, ord_, dtype)

    @staticmethod
    def _wb_full(t):
        """The module parameter's gradient, gathered from the summed copies."""
        if not getattr(t, "_wb_synced", False):
            raise RuntimeError(
                "a read of the gradient of DistributedDataParallel's parameter over "
                "tensor-parallel DistTensors before its data-parallel copies are summed "
                "(inside no_sync(), or before the backward's synchronization): each rank's "
                "gradient is its own.  " + (getattr(t, "_wb_hint", None) or
                                            "Call finish_gradient_synchronization() first"))
        with torch._C.DisableTorchFunctionSubclass():
            return t.__dict__["_wb_param_full"](t.as_subclass(torch.Tensor),
                                                of="the gradient of ")

    def full_tensor(self):
        """The module parameter's gradient, a copy (DTensor's ``full_tensor()``)."""
        return self._wb_full(self)


class ShardGrad(_NormedGrad):
    """An FSDP gradient on torch.distributed: this rank's shard (``_wb_pg``: the group)."""
    MIXED_OK = False

    @staticmethod
    def _norm(t, ord_, dtype):
        return _shard_norm(t, ord_, dtype)


def _shard_norm(t, ord_, dtype):
    if float(ord_) in (0.0, -math.inf) and _gathers(t):
        # fully_shard's: the norm of the gathered whole, the same on every process
        # (FSDP2's _NormPartial of the unpadded local shards gives that value)
        with torch._C.DisableTorchFunctionSubclass():
            return torch.linalg.vector_norm(t._wb_full(t), ord_, dtype=dtype)
    if float(ord_) in (0.0, -math.inf):
        # a flat shard holds padding zeros and pieces of several parameters: its count of
        # nonzeros or its smallest |g| is no part of any parameter's norm
        raise NotImplementedError(
            f"a norm of order {float(ord_)} over FullyShardedDataParallel's gradient shards "
            "on torch.distributed: the shards' padding and flat layout make it wrong; use "
            "norm_type 2, 1 or inf, or gather the gradients (full_state_dict) first")
    with torch._C.DisableTorchFunctionSubclass():
        n = torch.linalg.vector_norm(t, ord_, dtype=dtype)
        if getattr(t, "_wb_norm_skip", False):
            # a copy another rank also holds (ZeRO-3 over DistTensors: a parameter
            # replicated on a tensor-parallel dim): counted once, on that dim's rank 0
            n = torch.zeros_like(n)
    out = n.as_subclass(PartialNorm)
    out._wb_pg, out._wb_ord = t._wb_pg, float(ord_)
    return out


class GatheredGrad(_NormedGrad):
    """``fully_shard``'s gradient over tensor parallelism on simulated ranks: the shard's
    storage (each tensor-parallel coordinate's dp chunks side by side, padded), whose
    reads follow the rule :func:`as_shard_grad` gives torch.distributed's (habits13): a
    user's ``numel()`` / ``dim()`` / ``shape`` / reductions are the module parameter's
    gradient, gathered (``_wb_full``, a copy), as FSDP2's DTensor gradient answers its full
    tensor's; a view raises naming ``p.grad.full_tensor()``.  Before (habits14, measured on
    ``Linear(3, 6), GELU, Linear(6, 3)`` over 2 x 2): a plain tensor, ``p.grad.numel()``
    [20, 8, 20, 4] for [18, 6, 18, 3], ``shape`` (2, 2, 5), ``abs().min()`` 0 (padding)."""
    _wb_whole = True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from .laid_out_views import users_call
        t = args[0] if args else None
        if isinstance(t, GatheredGrad) and getattr(t, "_wb_full", None) is not None:
            done, out = _users_module_read(
                t, func, args, "a fully_shard parameter over tensor parallelism")
            if done:
                return out
        if func in WHOLE and not users_call():
            return _plain(func, args, kwargs)       # the wrappers' reads: the storage's
        return super().__torch_function__(func, types, args, kwargs)

    @staticmethod
    def _norm(t, ord_, dtype):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.linalg.vector_norm(t._wb_full(t), ord_, dtype=dtype)

    def full_tensor(self):
        """The module parameter's gradient, a copy (DTensor's ``full_tensor()``)."""
        with torch._C.DisableTorchFunctionSubclass():
            return self._wb_full(self)


_WHOLE_GRADS = (RankRows, ChunkRows, ShardGrad, ReplicaStorageGrad, GatheredGrad)
# read as module values where a user's tensor meets them (laid_out_grad_reads); not
# torch.distributed's shards (a gather every process would have to join)
_MODULE_VALUED = (RankRows, ChunkRows, ReplicaStorageGrad, GatheredGrad)
# ShardGrad: where _gathers
