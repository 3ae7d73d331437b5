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
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

__all__ = ["kept_as", "states_read_as_grads", "StateReads",
           "RankRows", "ChunkRows", "ReplicaGrad", "ShardGrad", "PartialNorm",
           "ReplicaStorageGrad", "GatheredGrad", "as_gathered_grad", "as_rank_rows", "as_chunk_rows", "as_replica_grad",
           "as_shard_grad"]

from .laid_out_reads import LIKES, _is_pointwise
from .laid_out_shape import module_ndim, module_shape_read, module_view
from .laid_out_whole import WHOLE, storage_shape, whole_reads
from .laid_out_views import users_call
from .laid_out_grad_reads import _MODELS, _TORCH, _WORKBENCH, module_value_read

_NORMS = (torch.linalg.vector_norm, torch._foreach_norm, torch.norm, torch.Tensor.norm)


def _plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


def _norm_args(func, args, kwargs):
    """(tensor or tensors, ord, dtype) of a whole-tensor norm call; None when the call
    names dims (a norm along dims reads the rows as the caller laid them out)."""
    kwargs = dict(kwargs or {})
    x = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.pop("ord", kwargs.pop("p", 2.0))
    if func is torch._foreach_norm:
        return x, ord_, kwargs.get("dtype")
    if len(args) > 2 or kwargs.get("dim") is not None or ord_ == "nuc":
        return None
    return x, (2.0 if ord_ in (None, "fro") else ord_), kwargs.get("dtype")


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


# what a gradient held by FullyShardedDataParallel.no_sync() still answers (fsdp_no_sync:
# its metadata, and the writes zero_grad makes)
_HELD_OK = frozenset({torch.Tensor.zero_, torch._foreach_zero_, torch.Tensor.size,
                      torch.Tensor.dim, torch.Tensor.requires_grad_, torch.Tensor.detach_})


def _refuse_held(func, first) -> None:
    """Raise the message a gradient of FSDP1's ``no_sync()`` carries (``_wb_held``: its unit
    holds each rank's unreduced gradients, so the shard's own reads 0 or the last step's)
    for any read of its values; attribute reads (``.shape``, ``._version``) pass."""
    items = first if isinstance(first, (list, tuple)) else (first,)
    for t in items:
        held = getattr(t, "_wb_held", None) if isinstance(t, torch.Tensor) else None
        # written since it was held (a zero_grad's zero_): the user's value, the held
        # gradients dropped at the next forward (fsdp_no_sync._drop_cleared)
        if held and getattr(func, "__name__", "") != "__get__" \
                and t._version == held[1]:
            raise RuntimeError(held[0])


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


_T = torch.Tensor
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


def kept_as(out, g):
    """``out`` (a tensor of ``g``'s storage shape) read as ``g`` is: ``g``'s subclass and
    read-back (:data:`_KEPT`), the same storage."""
    kept = out.as_subclass(type(g))
    for k in _KEPT:
        if k in g.__dict__:
            setattr(kept, k, g.__dict__[k])
    return kept


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


def _users_dict_read() -> bool:
    """Is the caller of a :class:`StateReads` method a user's own code (not torch's, not
    the wrappers'; one frame, read on every step of torch.optim)?"""
    name = sys._getframe(2).f_code.co_filename
    return not name.startswith(_TORCH) and (not name.startswith(_WORKBENCH) or
                                            name.startswith(_MODELS))


class StateReads(dict):
    """One parameter's ``torch.optim`` state (:func:`states_read_as_grads`): torch's and
    the wrappers' reads get the stored tensors, a user's own (:func:`_users_dict_read`)
    those of the storage's shape as its gradient's subclass (an alias read as the module's
    value, as ``p.grad`` is)."""

    def __init__(self, st, like):
        super().__init__(st)
        self._wb_like = like

    def _user(self, v):
        cls, kept, shape = self._wb_like
        if type(v) is not torch.Tensor or v.shape != shape:
            return v
        out = v.as_subclass(cls)
        for k, x in kept.items():
            setattr(out, k, x)
        return out

    def __getitem__(self, k):
        v = dict.__getitem__(self, k)
        return self._user(v) if _users_dict_read() else v

    def get(self, k, default=None):
        v = dict.get(self, k, default)
        return self._user(v) if _users_dict_read() else v

    def items(self):
        if not _users_dict_read():
            return dict.items(self)
        return [(k, self._user(v)) for k, v in dict.items(self)]

    def values(self):
        if not _users_dict_read():
            return dict.values(self)
        return [self._user(v) for v in dict.values(self)]

    def __reduce__(self):               # pickled / deep-copied as the plain dict it holds
        return dict, (dict(dict.items(self)),)


def _users_own_call() -> bool:
    """Is the function being served called by a user's own code (the first frame outside
    this module: :func:`.laid_out_views.users_call` with ``direct``), not torch.optim's
    (whose states stay plain storages)?"""
    f, i = sys._getframe(0), 0
    while f is not None and f.f_code.co_filename == __file__:
        f, i = f.f_back, i + 1
    return f is not None and users_call(True, depth=i - 2)


def _same_grad_layout(a, g) -> bool:
    """Is ``a`` a gradient (or a state kept as one) of ``g``'s class, storage shape and
    read-back (:data:`_KEPT`)?"""
    if type(a) is not type(g) or storage_shape(a) != storage_shape(g):
        return False
    for k in _KEPT:
        x, y = a.__dict__.get(k), g.__dict__.get(k)
        if x is not y and not (isinstance(x, (tuple, int, str)) and x == y):
            return False
    return True


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


def _same_rows(t, what="a norm") -> None:
    with torch._C.DisableTorchFunctionSubclass():
        first = t[:1]
        same = (t == first) | (t.isnan() & first.isnan())     # a NaN is a NaN on every rank
        if not bool(same.all()):
            raise RuntimeError(
                f"{what} of a simulated DistributedDataParallel gradient whose ranks' rows "
                "differ (not averaged yet, e.g. inside no_sync()): on torch.distributed each "
                "rank would read its own gradient.  Read it after the backward that "
                "synchronizes (ddp.finish_gradient_synchronization() has run)")


def _row_norm(t, ord_, dtype):
    _same_rows(t)
    with torch._C.DisableTorchFunctionSubclass():
        return torch.linalg.vector_norm(t[0], ord_, dtype=dtype)


def as_rank_rows(t):
    return t if t is None or isinstance(t, RankRows) else t.as_subclass(RankRows)


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


def as_chunk_rows(t, numel: int, shape=None):
    """``t`` as a :class:`ChunkRows` of a parameter of ``numel`` elements (``shape``: the
    parameter's; None: read as flat)."""
    if t is None:
        return None
    out = t if isinstance(t, ChunkRows) else t.as_subclass(ChunkRows)
    out._wb_numel = numel
    out._wb_shape = (numel,) if shape is None else tuple(shape)
    return out


# the attributes a kept alias / copy carries (ShardGrad's: its group, how it gathers)
_KEPT = ("_wb_numel", "_wb_shape", "_wb_pg", "_wb_norm_skip", "_wb_full", "_wb_gathers",
         "_wb_layout", "_wb_param_full", "_wb_pshape", "_wb_axes", "_wb_synced", "_wb_hint",
         "_wb_refuse", "_wb_unsummed")


class ReplicaGrad(_NormedGrad):
    """The gradient of a DistTensor replica's local storage (lead mesh axes, then the
    local shape).  ``_wb_axes``: the replicated axes holding one copy per rank (one copy
    is read); ``_wb_synced``: the copies were summed over the data-parallel ranks;
    ``_wb_hint``: what to do when they were not; ``_wb_refuse``: why no norm is built
    (torch.distributed with a sharded dim: the local norm is a shard's)."""

    @staticmethod
    def _norm(t, ord_, dtype):
        return _replica_norm(t, ord_, dtype)


def _replica_norm(t, ord_, dtype):
    if getattr(t, "_wb_refuse", None):
        raise RuntimeError(t._wb_refuse)
    if not getattr(t, "_wb_synced", False):
        raise RuntimeError(getattr(t, "_wb_hint", None) or
                           "a norm of a replica's gradient before the replicas' gradients "
                           "are summed: call finish_gradient_synchronization() first")
    with torch._C.DisableTorchFunctionSubclass():
        for a in getattr(t, "_wb_axes", ()):
            t = t.narrow(a, 0, 1)
        return torch.linalg.vector_norm(t, ord_, dtype=dtype)


def _users_module_read(t, func, args, what: str):
    """``(True, answer)`` for a user's ``g.shape`` / ``g.size()`` / ``len(g)`` / ``g.dim()``
    of ``t`` (a gradient whose module value is gathered, a copy: ``_wb_shape``): the
    module's; a user's view of it raises naming ``g.full_tensor()``; else ``(False, None)``.
    Called from a subclass's ``__torch_function__`` (the user two frames up)."""
    from .laid_out_shape import VIEWS, _PROPS
    from .laid_out_views import users_call
    shape = torch.Size(t._wb_shape)
    if (func in (_T.dim, _T.ndimension) or func == _T.ndim.__get__) and users_call(True):
        return True, len(shape)
    if func == _T.shape.__get__ and users_call(True):
        return True, shape
    if func is _T.size and users_call(True):
        return True, (shape[args[1]] if len(args) > 1 else shape)
    if func is _T.__len__ and users_call(True):
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return True, shape[0]
    if (func in VIEWS or any(func == f for f in _PROPS)) and users_call(True):
        from .laid_out_replicas import _one_whole_replica
        whole = _one_whole_replica(t, shape)
        if whole is not None:                   # one whole replica: torch DDP's view
            with torch._C.DisableTorchFunctionSubclass():
                return True, func(whole, *args[1:])
        raise NotImplementedError(
            f"{getattr(func, '__name__', 'a view')} of the gradient of {what}: its storage "
            f"(shape {tuple(t.as_subclass(torch.Tensor).shape)}) holds shards, and the "
            f"module's {tuple(shape)} gradient is gathered from them, a copy, so no view of "
            "it exists here.  Take the view of the gathered copy, p.grad.full_tensor()")
    return False, None


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


def as_gathered_grad(t, param):
    """``t`` (the gradient of ``param``, a ``fully_shard`` shard over tensor parallelism on
    simulated ranks whose reads gather) as a :class:`GatheredGrad` (the same storage)."""
    if t is None or getattr(param, "_wb_full", None) is None:
        return t
    out = t if isinstance(t, GatheredGrad) else t.as_subclass(GatheredGrad)
    out._wb_full, out._wb_shape = param._wb_full, param._wb_shape
    out._wb_gathers, out._wb_layout = True, f"the gradient of {param._wb_layout}"
    return out


_WHOLE_GRADS = (RankRows, ChunkRows, ShardGrad, ReplicaStorageGrad, GatheredGrad)
# read as module values where a user's tensor meets them (laid_out_grad_reads); not
# torch.distributed's shards (a gather every process would have to join)
_MODULE_VALUED = (RankRows, ChunkRows, ReplicaStorageGrad, GatheredGrad)
# ShardGrad: where _gathers


def _mixed():
    return RuntimeError(
        "clip_grad_norm_ over FullyShardedDataParallel's shards together with other "
        "tensors: a shard's norm is a partial norm, the others' are whole; clip the "
        "wrapper's parameters on their own (fsdp.parameters())")


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


_READ = "a norm of a wrapper's gradient shards (p.grad.norm(), clip_grad_norm_)"


def _groups(pg):
    return pg if isinstance(pg, tuple) else (pg,)


class PartialNorm(torch.Tensor):
    """This rank's part of a norm (of its shards): ``.to`` and ``torch.stack`` keep it
    partial; ``torch.linalg.vector_norm`` of it combines the ranks' parts (the p-th
    powers summed, or the max / min for p = +-inf; one all-reduce) into the true norm, a
    plain tensor equal on every rank.  Any other use reduces it first."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:         # torch moves each norm to the first's device
            return _keep(_plain(func, args, kwargs), args[0])
        if func is torch.stack:
            ts = args[0]
            if not all(isinstance(t, PartialNorm) for t in ts):
                raise _mixed()
            return _keep(_plain(func, args, kwargs), ts[0])
        if func is torch.linalg.vector_norm and len(args) >= 1 and \
                isinstance(args[0], PartialNorm) and kwargs.get("dim") is None:
            x = args[0]
            ord_ = float(args[1] if len(args) > 1 else kwargs.get("ord", 2.0))
            if ord_ != x._wb_ord:
                raise ValueError(f"the norm of order {ord_} of partial norms of order "
                                 f"{x._wb_ord}: take both of the same order")
            return _reduce(x.as_subclass(torch.Tensor), ord_, x._wb_pg)
        # any other use: the full norms first (each element reduced on its own)
        args = [_full(a) if isinstance(a, PartialNorm) else a for a in args]
        return _plain(func, args, kwargs)


def _keep(out, like):
    out = out.as_subclass(PartialNorm)
    out._wb_pg, out._wb_ord = like._wb_pg, like._wb_ord
    return out


def _reduce(x, ord_, pg):
    """The norm of order ``ord_`` of the vector whose pieces' norms on the ranks are ``x``
    (a read one process makes alone waits for its peers, as torch's ``_NormPartial``
    does: it ends in an error naming the fix, agreed_reads.reading)."""
    from ...sim_mesh.agreed_reads import reading
    with torch._C.DisableTorchFunctionSubclass(), reading(_READ):
        x = x.detach().reshape(-1)
        if ord_ == math.inf:
            v = x.amax() if x.numel() else torch.tensor(0.0)
            for g in _groups(pg):
                dist.all_reduce(v, op=dist.ReduceOp.MAX, group=g)
            return v
        if ord_ == -math.inf:
            v = x.amin() if x.numel() else torch.tensor(math.inf)
            for g in _groups(pg):
                dist.all_reduce(v, op=dist.ReduceOp.MIN, group=g)
            return v
        v = x.sum() if ord_ == 0 else x.pow(ord_).sum()
        for g in _groups(pg):        # the groups of each dim in turn: the whole mesh's sum
            dist.all_reduce(v, op=dist.ReduceOp.SUM, group=g)
        return v if ord_ == 0 else v.pow(1.0 / ord_)


def _full(x):
    """Each element of the partial norms ``x`` reduced over the ranks (one all-reduce)."""
    from ...sim_mesh.agreed_reads import reading
    with torch._C.DisableTorchFunctionSubclass(), reading(_READ):
        ord_, pg = x._wb_ord, x._wb_pg
        v = x.detach().clone()
        if ord_ in (math.inf, -math.inf):
            for g in _groups(pg):
                dist.all_reduce(v, op=dist.ReduceOp.MAX if ord_ > 0 else dist.ReduceOp.MIN,
                                group=g)
            return v
        if ord_ != 0:
            v = v.pow(ord_)
        for g in _groups(pg):
            dist.all_reduce(v, op=dist.ReduceOp.SUM, group=g)
        return v if ord_ == 0 else v.pow(1.0 / ord_)
