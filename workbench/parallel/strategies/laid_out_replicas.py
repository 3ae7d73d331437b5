"""DDP over tensor-parallel DistTensors: a user's reads of ``ddp.parameters()`` are the module's.

``wb.DistributedDataParallel(model, mesh, "dp")`` over a module that ``wb.parallelize`` /
``parallelize_module`` laid out on a 2-d mesh gives, as its ``parameters()``, each
parameter's replica storage (:mod:`.ddp_dist`): on simulated ranks a plain tensor led by
the mesh's dims, ``(dp, tp, *local)``.  Every read a user's loop takes of it read that
storage as the parameter: measured on ``Sequential(Linear(8, 40), ReLU, Linear(40, 8))``
colwise / rowwise on a 2 x 2 mesh, ``sum(p.numel())`` 1376 for 688 (every dp replica, and
the tensor-parallel shards of a replicated bias twice over), ``p.dim()`` 4 for 2, the norms
and sums of every replica.  torch's DDP keeps the module's parameters (and FSDP2, the 2-d
answer, DTensors of the global shape).

Here, on simulated ranks, the storage is a :class:`ReplicaStorage` (the same tensor, the
optimizer's leaf, its class changed in place): a user's own ``numel()`` / ``dim()`` /
``shape`` / ``size()`` / ``len()`` answer the module parameter's, and a reduction
(:data:`.laid_out_whole.WHOLE`) reads the global tensor, gathered from the replica's
tensor-parallel shards (``_wb_full``, no gradient: with autograd recording it raises, as a
penalty in the loss would get none), and so do those of a value computed from it
elementwise, or of its alias, copy or cast (``p.pow(2).sum()``, ``p.detach().norm()``); a
user's view of it (``p[0]``, ``p.T``) raises (the
module's tensor is a gathered copy, no view of the storage).  Everything else, and every
call from the wrappers' or DistTensor's own code (:func:`.laid_out_views.users_call`), runs
on the storage as before, a plain result.  Under torch.distributed each process's replica
is its tensor-parallel shard ``(1, 1, *local)``, read the same way (habits15: a user's reads
were that shard's, ``numel()`` 9 for 18, silently): the global tensor is gathered over tp,
a collective every process of the mesh joins, so every process takes the same reads (as
FSDP2's DTensor ``full_tensor()``).
"""
from __future__ import annotations

import math

import torch

from .laid_out_grad_reads import module_value_read
from .laid_out_hooks import HOOKS
from .laid_out_shape import VIEWS, _PROPS
from .laid_out_replica_init import (INIT_CALLS, from_init, one_draw, refuse_init_index,
                                    trunc_layout)
from .laid_out_views import users_call
from .laid_out_reads import _CASTS, LIKES, _is_pointwise
from .laid_out_whole import NUMEL, WHOLE, storage_shape

__all__ = ["ReplicaStorage", "as_replica_storage"]

_T = torch.Tensor
_DIMS = (_T.dim, _T.ndimension)
_NDIM = _T.ndim.__get__
_SHAPE = _T.shape.__get__
_DATA_SET = _T.data.__set__     # ``p.data = t`` (compared with ==)


def _is(func, fs) -> bool:
    return any(func == f for f in fs)


class ReplicaStorage(torch.Tensor):
    """DDP's replica storage of a DistTensor parameter (module docstring); ``_wb_shape``:
    the module parameter's shape, ``_wb_full``: its global tensor from the storage."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in INIT_CALLS:      # nn.init's draws: one device's (laid_out_replica_init)
            out = one_draw(func, args, kwargs, ReplicaStorage)
            if out is not None:
                return out
        t = args[0] if args else None
        if isinstance(t, ReplicaStorage):
            shape = torch.Size(t._wb_shape)
            if func in HOOKS and users_call():
                # the hook got the replicas' storage gradient (2, 2, 3, 3) for (6, 3): a
                # clamping hook 0.010 off one device's after two steps (habits9b)
                raise NotImplementedError(
                    f"{func.__name__} on DistributedDataParallel's parameter over "
                    "tensor-parallel DistTensors: the hook would see the replicas' storage "
                    f"gradient (shape {tuple(t.as_subclass(_T).shape)}, every replica's "
                    f"shards), not the module's {tuple(shape)}.  Read or change the "
                    "gradient after loss.backward() through p.grad, before optimizer.step()")
            refuse_init_index(t)            # sparse_, dirac_, orthogonal_ (laid_out_replica_init)
            if func in NUMEL and users_call(depth=-1):
                return math.prod(shape)
            if (func in _DIMS or func == _NDIM) and (users_call(True, depth=-1) or from_init()):
                return len(shape)
            if func == _SHAPE and (users_call(True, depth=-1) or from_init()):
                return shape
            if func is _T.size and (users_call(True, depth=-1) or from_init()):
                return shape[args[1]] if len(args) > 1 else shape
            if func is _T.__len__ and users_call(True, depth=-1):
                if not shape:
                    raise TypeError("len() of a 0-d tensor")
                return shape[0]
            if func == _DATA_SET and len(args) > 1 and _module_shaped_data(t, args[1], shape):
                return None     # p.data = t of the module's shape: written as p.copy_(t)
            if func is _T.copy_ and len(args) > 1 and users_call(True, depth=-1):
                args = (t, _module_shaped_source(t, args[1], shape)) + tuple(args[2:])
            if (func in VIEWS or _is(func, _PROPS)) and (
                    users_call(True, depth=-1) or
                    (_flat_view(func, args, shape) and users_call(depth=-1))):
                whole = _one_whole_replica(t, shape)
                if whole is not None:               # the module's tensor is this storage
                    with torch._C.DisableTorchFunctionSubclass():
                        return func(whole, *args[1:], **kwargs)
                raise NotImplementedError(view_refusal(
                    getattr(func, '__name__', 'a view'), tuple(t.as_subclass(_T).shape),
                    tuple(shape), getattr(t, "_wb_distributed", False)))
        if func is _T.view_as and len(args) == 2 and isinstance(args[1], ReplicaStorage) \
                and not isinstance(t, ReplicaStorage) and isinstance(t, torch.Tensor) and \
                t.numel() == math.prod(args[1]._wb_shape) and users_call(depth=-1):
            # t.view_as(p) (vector_to_parameters): torch's shape error named the storage's
            # shape ("shape '[2, 2, 3, 3]' is invalid for input of size 18", habits7b);
            # this names the fix, as over DDP's rows (laid_out_whole.check_view_as)
            shape = tuple(args[1]._wb_shape)
            raise RuntimeError(
                "t.view_as(p) of DistributedDataParallel's parameter over tensor-parallel "
                "DistTensors (torch.nn.utils.vector_to_parameters): its storage holds the "
                f"replicas' shards (shape {tuple(args[1].as_subclass(_T).shape)}), not the "
                f"module's shape {shape}.  Write the values in: with torch.no_grad(): "
                f"p.copy_(t.view({shape})) for each parameter (every replica's shards), or "
                "load them with ddp.load_state_dict")
        if not (func is _T.copy_ and isinstance(t, ReplicaStorage)):
            # a user's p - w, w.copy_(p.detach()): the module's value (laid_out_grad_reads)
            done, out = module_value_read(func, args, kwargs, (ReplicaStorage,),
                                          "DistributedDataParallel's parameter")
            if done:
                return out
        if func in WHOLE and func not in NUMEL and users_call(depth=-1):
            done, out = _whole(func, args, kwargs)
            if done:
                return out
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        # nn.init.trunc_normal_'s redraws: one device's too (laid_out_replica_init)
        return trunc_layout(args, kwargs, _keep(func, args, kwargs, out), ReplicaStorage)


def _deepcopy(self, memo):
    """``copy.deepcopy`` of a replica storage (of its DistTensor: ``copy.deepcopy(ddp.module)``,
    ``AveragedModel(ddp.module)``): a plain copy of the storage, the copied DistTensor's
    own (torch's default raised "The default implementation of __deepcopy__() for
    non-wrapper subclasses only works for subclass types that implement new_empty()",
    habits7b), so the copy reads and computes as the module, and no gradient hook or
    optimizer of this wrapper holds it."""
    if id(self) in memo:
        return memo[id(self)]
    with torch.no_grad():
        out = self.as_subclass(_T).clone().requires_grad_(self.requires_grad)
    memo[id(self)] = out
    return out


ReplicaStorage.__deepcopy__ = _deepcopy


def _reduce_ex(self, proto):
    """``torch.save`` / pickle of the replica storage itself (a ``ddp.state_dict(
    keep_vars=True)`` value, :mod:`..keep_vars`): a plain ``nn.Parameter`` of the module's
    shape holding its values, as torch DDP's parameter saves (it raised "Can't pickle
    local object", habits10).  Under torch.distributed (the module value is gathered, a
    collective every process joins) it raises naming the fix."""
    full = getattr(self, "_wb_full", None)
    if full is None or getattr(self, "_wb_distributed", False):
        raise NotImplementedError(
            "torch.save / pickle of DistributedDataParallel's parameter over tensor-parallel "
            "DistTensors under torch.distributed: its storage is this process's shards.  Save "
            "ddp.state_dict() (DistTensors, e.g. with wb.checkpoint.save) or the "
            "full_state_dict()")
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        value = full(self.detach()).clone()
    return torch.nn.Parameter(value, self.requires_grad).__reduce_ex__(proto)


ReplicaStorage.__reduce_ex__ = _reduce_ex


def _module_shaped_source(t, src, shape):
    """A user's ``p.copy_(src)`` (``p.data.copy_``: a manual weight load) with ``src`` of
    the module parameter's shape: ``src`` laid out as the storage (every replica's shards
    of it), as a write through the module's DistTensor gives (habits18: torch's broadcast
    error, "size of tensor a (3) must match the size of tensor b (6)"); else ``src``."""
    store = getattr(t, "_wb_store", None)
    if store is None or not isinstance(src, torch.Tensor) or isinstance(src, ReplicaStorage) \
            or tuple(src.shape) != tuple(shape) or tuple(t.as_subclass(_T).shape) == tuple(shape):
        return src
    return store(src)


def _module_shaped_data(t, value, shape) -> bool:
    """``p.data = value`` with ``value`` of the module parameter's ``shape`` (not the
    storage's): torch's assignment made it the storage, so every later read of the
    replicas failed (``state_dict()``: "all_gather: the input is the same on every rank",
    habits7b).  Written into every replica's shards as ``p.copy_(value)`` instead (of
    ``p``'s dtype and device; ``p`` keeps its storage, not ``value``'s alias): True.  A
    ``value`` of the storage's shape is torch's assignment (False); any other raises."""
    if not isinstance(value, torch.Tensor) or isinstance(value, ReplicaStorage):
        return False
    got, stored = tuple(value.shape), tuple(t.as_subclass(_T).shape)
    if got == stored:
        return False
    store = getattr(t, "_wb_store", None)
    if got == tuple(shape) and value.dtype == t.dtype and value.device == t.device and \
            store is not None:
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            t.copy_(store(value.detach()))
        return True
    raise RuntimeError(
        f"p.data = t with t of shape {got}, dtype {value.dtype} on "
        "DistributedDataParallel's parameter over tensor-parallel DistTensors: its storage "
        f"holds the replicas' shards (shape {stored}), so t cannot become it (the module's "
        f"parameter is {tuple(shape)}, {t.dtype}).  Write values of the module's shape and "
        "dtype with p.data.copy_(t) (or p.data = t of that shape and dtype), or load "
        "tensors with ddp.load_state_dict")


def _flat_view(func, args, shape) -> bool:
    """``p.view(-1)`` / ``p.view(numel)``: the module's flat parameter, which torch's
    ``parameters_to_vector`` takes inside torch's code (a user's call all the same: it
    read the storage, or raised torch's stride error, habits18)."""
    if func is not _T.view or len(args) != 2:
        return False
    size = args[1]
    size = tuple(size) if isinstance(size, (tuple, list, torch.Size)) else (size,)
    return size in ((-1,), (math.prod(shape),))


def _one_whole_replica(t, shape):
    """The storage ``t`` viewed in the module's ``shape`` where it holds exactly one whole
    replica (leading mesh dims of size 1, nothing split over tp: a process's own replica
    of a parameter replicated over its mesh, as torch's DDP holds it), so a view of it is
    the view torch's DDP gives; else None (the view is refused)."""
    stored = tuple(t.as_subclass(_T).shape)
    lead = len(stored) - len(shape)
    if lead < 0 or stored[lead:] != tuple(shape) or any(d != 1 for d in stored[:lead]):
        return None
    return t.as_subclass(_T).view(tuple(shape))


def view_refusal(what: str, stored: tuple, shape: tuple, distributed: bool) -> str:
    """Why a user's view (``what``) of a :class:`ReplicaStorage` raises: on simulated ranks
    the storage holds every replica's shards; under torch.distributed (``distributed``)
    this process's own tensor-parallel shard, the rest on the other processes (it said
    "every replica's shards" there too, habits16)."""
    held = (f"this process's tensor-parallel shard (shape {stored}), and the module's "
            f"{shape} tensor is gathered from every tensor-parallel process's shard"
            if distributed else
            f"every replica's shards (shape {stored}), and the module's {shape} tensor is "
            "gathered from them")
    return (f"{what} of DistributedDataParallel's parameter over tensor-parallel "
            f"DistTensors: its storage holds {held}, so no view of it exists here.  Read "
            "the module's parameter (model.<name>.full(), or ddp.state_dict()) and take "
            "the view of that copy")


_KEEP = {_T.detach, torch.detach, _T.data.__get__}


def _keep(func, args, kwargs, out):
    """``out`` as a :class:`ReplicaStorage` of the same layout where a user's ``func`` is
    elementwise over one replica storage and numbers (``p.pow(2)``, ``p.abs()``,
    ``2 * p``), or its alias, copy or cast (``p.detach()``, ``p.data``, ``p.clone()``,
    ``p.double()``), or a user's own ``torch.zeros_like(p)`` (a hand-written optimizer's
    state, :data:`.laid_out_reads.LIKES`): so its reductions read the module's values
    too; else ``out``."""
    if not isinstance(out, torch.Tensor) or isinstance(out, ReplicaStorage):
        return out
    flat = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    src = next((a for a in flat if isinstance(a, ReplicaStorage)), None)
    if src is None or not all(a is src or a.dim() == 0 or _same_layout(a, src) for a in flat) or \
            storage_shape(out) != storage_shape(src) or \
            not (_is_pointwise(func) or func in _CASTS or _is(func, _KEEP) or
                 func in LIKES and users_call(True)) or \
            not users_call(depth=-1):
        return out
    with torch._C.DisableTorchFunctionSubclass():
        v = out.as_subclass(ReplicaStorage)
    v._wb_shape, v._wb_full = src._wb_shape, src._wb_full
    v._wb_distributed = getattr(src, "_wb_distributed", False)
    if getattr(src, "_wb_store", None) is not None and func is not _T.clone:
        v._wb_store = src._wb_store     # p.data.copy_(w): laid out into p's storage
    return v


def _same_layout(a, src) -> bool:
    """Is ``a`` another :class:`ReplicaStorage` of ``src``'s parameter and storage shape
    (``p - p0`` of a copy ``p0``, ``m / (m.abs() + eps)`` of a state ``m``)?  Their
    pointwise result keeps that layout (it was a plain storage: its norm read every
    replica's shards, 2x a LAMB step's trust ratio on 2 x 2, habits7b)."""
    return isinstance(a, ReplicaStorage) and a._wb_full is src._wb_full and \
        storage_shape(a) == storage_shape(src)


def _whole(func, args, kwargs):
    """``func`` with every :class:`ReplicaStorage` operand (also in a list) read as its
    module's global tensor."""
    hit = []

    def one(a):
        if not isinstance(a, ReplicaStorage):
            return a
        hit.append(a)
        if torch.is_grad_enabled() and a.requires_grad:
            raise NotImplementedError(
                f"{getattr(func, '__name__', func)}() of DistributedDataParallel's parameter "
                "over tensor-parallel DistTensors with autograd recording: its module value "
                "is gathered from the replica's shards and the gather carries no gradient, "
                "so a penalty built from it would get none.  Read it under torch.no_grad() "
                "(or of p.detach()) for logging; for a penalty in the loss use the "
                "optimizer's weight_decay")
        with torch._C.DisableTorchFunctionSubclass():
            return a._wb_full(a)
    new = tuple([one(x) for x in a] if isinstance(a, (list, tuple)) else one(a) for a in args)
    kw = {k: one(v) for k, v in kwargs.items()}
    if not hit:
        return False, None
    with torch._C.DisableTorchFunctionSubclass():
        return True, func(*new, **kw)


def as_replica_storage(loc) -> None:
    """``loc`` (a replica storage carrying ``_wb_shape`` / ``_wb_full``) a
    :class:`ReplicaStorage`, in place (the same tensor: the optimizer's leaf, its hooks)."""
    if type(loc) is torch.Tensor:
        loc.__class__ = ReplicaStorage
