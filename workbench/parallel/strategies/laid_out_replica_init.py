"""``torch.nn.init`` on ``ddp.parameters()`` of DDP over tensor-parallel DistTensors: one
device's draw.

The parameters a :class:`~.ddp_dist.DistTensorDDP` hands out are replica storages
(:class:`.laid_out_replicas.ReplicaStorage`: on simulated ranks ``(dp, tp, *local)``, one
copy of each tensor-parallel shard per data-parallel rank).  A random fill of that storage
(``p.normal_()``, the ``Tensor`` method every ``nn.init`` random init ends in) drew every
replica's shards on their own: the replicas differed, which the next forward refused
(:func:`.ddp_dist_habits.check_written_replicas`), and a fan-in init (``kaiming_*``,
``xavier_*``) read its fan from the storage's shape.  torch's DDP does not re-broadcast
after construction: its replicas diverge silently on real ranks.

Here, on simulated ranks, a random fill draws once in the module parameter's shape (the
numbers one device draws with the same seed, its generator advanced as far) and writes
that value into every replica's shards (``_wb_store``); a shape read from inside
``torch.nn.init`` (its fan) answers the module's shape, so ``kaiming_uniform_``,
``xavier_normal_``, ``trunc_normal_`` (a draw, then elementwise ops on every replica alike)
give one device's values.  Under torch.distributed each process holds one replica, drawn
from its own generator: it raises at once, naming the fixes (initialize before wrapping,
or through the module's DistTensor parameters).
"""
from __future__ import annotations

import os
import sys

import torch
from torch.nn import init

from .laid_out_views import users_call

__all__ = ["INIT_CALLS", "LAID_OUT_DRAWS", "one_draw", "from_init", "laid_out_draw",
           "refuse_init_index", "refuse_laid_out_init", "trunc_layout"]

_T = torch.Tensor
RANDOM_FILLS = (_T.uniform_, _T.normal_, _T.bernoulli_, _T.exponential_, _T.cauchy_,
                _T.log_normal_, _T.geometric_, _T.random_)
# the nn.init functions torch lets a subclass override (they reach __torch_function__
# whole: run here on a tensor of the module's shape), and torch.eye(out=) (nn.init.eye_)
INIT_CALLS = frozenset(RANDOM_FILLS + (init.uniform_, init.normal_, init.kaiming_uniform_,
                                       torch.eye))
_INIT = os.path.abspath(init.__file__)


def _init_frame(depth: int = 0):
    """The ``torch/nn/init.py`` function that makes the call being served itself (its fan
    reads, its first touch), or None (a call from deeper down, e.g. workbench's own code
    under ``nn.init.zeros_`` of a DistTensor, reads the storage).  ``depth``: frames
    between the caller's ``__torch_function__`` and the one asking, beyond one."""
    f = sys._getframe(3 + depth)
    return f.f_code.co_name if f is not None and f.f_code.co_filename == _INIT else None


def from_init(depth: int = 0) -> bool:
    """Is the call being served made by ``torch/nn/init.py`` itself (a fan read)?"""
    return _init_frame(depth) is not None


def _target(func, args, kwargs):
    if func is torch.eye:
        return kwargs.get("out")
    return args[0] if args else kwargs.get("tensor")


def one_draw(func, args, kwargs, cls):
    """``func`` (:data:`INIT_CALLS`) of a replica storage (of class ``cls``) by a user or
    ``nn.init``: run on a tensor of the module's shape (one device's draw), the value
    written into every replica's shards; None where it is not such a call (the wrappers'
    own fills run on the storage)."""
    t = _target(func, args, kwargs)
    if not isinstance(t, cls) or not users_call(depth=0):
        return None
    name = getattr(func, "__name__", "a random fill")
    store = getattr(t, "_wb_store", None)
    if getattr(t, "_wb_distributed", False) or store is None:
        raise RuntimeError(
            f"{name} of DistributedDataParallel's parameter over tensor-parallel DistTensors "
            "under torch.distributed: each process holds one replica and would draw it from "
            "its own generator, so the data-parallel replicas would differ (torch's DDP "
            "does not re-broadcast after construction).  Initialize the module before "
            "wrapping it (DDP starts every replica from rank 0's values), or write through "
            "its DistTensor parameters (nn.init.normal_(ddp.module.<name>.weight))")
    if torch.is_grad_enabled() and t.requires_grad and func in RANDOM_FILLS and t.is_leaf:
        # torch's own refusal (the draw below runs under no_grad: it would pass silently)
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                           "operation.")
    fresh = torch.empty(tuple(t._wb_shape), dtype=t.dtype, device=t.device)
    if func is torch.eye:
        kwargs = {**kwargs, "out": fresh}
    elif args:
        args = (fresh,) + tuple(args[1:])
    else:
        kwargs = {**kwargs, "tensor": fresh}
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        func(*args, **kwargs)
        t.copy_(store(fresh))
    return t


# on DDP's rows and FSDP's / fully_shard's / Zero3's flat chunks (.laid_out): the random
# fills and the nn.init functions torch lets a subclass override, one draw of the module's
# shape written into every row or chunk (habits12: only nn.init.normal_ did; uniform_,
# kaiming_*, xavier_*, trunc_normal_, reset_parameters and p.data.normal_ raised)
LAID_OUT_DRAWS = frozenset(RANDOM_FILLS + (init.uniform_, init.normal_, init.kaiming_uniform_))


def laid_out_draw(func, t, args, kwargs, draw):
    """``func`` (:data:`LAID_OUT_DRAWS`) of a whole laid-out parameter ``t`` (or its
    ``.data``): ``draw(func, t, args, kwargs)`` runs it on a tensor of the module's shape
    and lays the value out (``laid_out._one_draw``); the fans ``nn.init`` computes
    before its fill read the module's shape (``laid_out_shape.module_shape_read``), so
    ``kaiming_normal_`` / ``xavier_*`` / ``Linear.reset_parameters``' bias bound are one
    device's.  ``trunc_normal_``: its first fill runs the whole of it on the fresh tensor
    (after it the storage holds no rejected element, so torch's loop draws nothing more);
    its narrow-interval branch (mass <= 0.3: more draws after the first) and, on padded
    chunks, an interval without 0 (the padding would be rejected and redrawn in the
    storage's shape) raise, nothing drawn.  None where it is not such a call (a fill with
    a tensor argument: ``bernoulli_(p)`` of a tensor ``p``)."""
    name = _init_frame()
    if name == _TRUNC:
        loc = sys._getframe(2).f_locals
        a, b = loc["a"], loc["b"]
        if loc["p"] <= 0.3 or not (a <= 0 <= b or getattr(t, "_wb_rows", None)):
            raise RuntimeError(
                f"nn.init.trunc_normal_(mean={loc['mean']}, std={loc['std']}, a={a}, b={b}) "
                f"of a parameter after wrapping: {t._wb_layout}, and "
                + ("this interval holds little of the distribution, so torch draws again "
                   "in the storage's shape" if loc["p"] <= 0.3 else
                   "the chunks' padding (0) lies outside [a, b], so torch would redraw it")
                + ".  Initialize the module before wrapping it, or load full tensors with "
                "the wrapper's load_state_dict")
        return draw(init.trunc_normal_, t, (t, loc["mean"], loc["std"], a, b),
                    {"generator": loc["generator"]})
    if func in RANDOM_FILLS and any(isinstance(v, torch.Tensor) for v in
                                    (*args[1:], *kwargs.values())):
        return None
    if func in RANDOM_FILLS and torch.is_grad_enabled() and t.requires_grad and t.is_leaf:
        # torch's own refusal (the draw runs under no_grad: it would pass silently)
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                           "operation.")
    return draw(func, t, args, kwargs)


_BY_INDEX = ("sparse_", "dirac_", "orthogonal_")
# torch 2.13 ``nn.init.trunc_normal_`` (``_no_grad_trunc_normal_``, rejection sampling):
# after the first draw (one device's, :func:`one_draw`) it draws again for the rejected
# elements, ``torch.where(mask, torch.empty_like(result).normal_(), result)``: a tensor of
# the storage's shape, which drew each replica's shards on their own, the generator
# advanced past one device's (habits11: std=1, 0.weight 1.23 off one device's draw, read
# back before the next forward refused the unequal replicas).  :func:`trunc_layout` keeps
# the storage's layout on those tensors, so the redraw is one device's too.
_TRUNC = "_no_grad_trunc_normal_"


def trunc_layout(args, kwargs, out, cls):
    """``out`` (a result computed over a storage of class ``cls`` inside
    ``nn.init.trunc_normal_``: its rejection mask, ``torch.empty_like(result)``,
    ``torch.where``) as a ``cls`` of the storage's layout (``_wb_shape``, ``_wb_store``),
    so its ``normal_`` is one device's draw (:func:`one_draw`) and the loop runs over every
    replica alike; else ``out``."""
    if not isinstance(out, torch.Tensor) or _init_frame() != _TRUNC:
        return out
    src = next((a for a in (*args, *kwargs.values()) if isinstance(a, cls) and
                getattr(a, "_wb_store", None) is not None), None)
    if src is None or out.as_subclass(_T).shape != src.as_subclass(_T).shape or \
            getattr(out, "_wb_store", None) is not None:
        return out
    with torch._C.DisableTorchFunctionSubclass():
        v = out.as_subclass(cls)
    v._wb_shape, v._wb_full, v._wb_store = src._wb_shape, src._wb_full, src._wb_store
    v._wb_distributed = getattr(src, "_wb_distributed", False)
    return v


def refuse_init_index(t) -> None:
    """``nn.init`` functions that write by index or through a view (``sparse_``,
    ``dirac_``, ``orthogonal_``): their indices are the module's, the storage's dims are
    not; raise at their first touch (a shape read), before anything is written."""
    name = _init_frame()
    if name in _BY_INDEX:
        raise RuntimeError(
            f"nn.init.{name} on DistributedDataParallel's parameter over tensor-parallel "
            f"DistTensors: it writes by index or through a view, and the storage (shape "
            f"{tuple(t.as_subclass(_T).shape)}) holds every replica's shards, not the "
            f"module's {tuple(t._wb_shape)} tensor.  Initialize the module before wrapping "
            "it, or write through its DistTensor parameters (ddp.module.<name>.weight)")


# on a row or chunk storage (.laid_out): by index or through a view, or the identity of
# the storage's shape (eye_: ``torch.eye(*tensor.shape, out=tensor)``, the shape read
# inside nn.init being the storage's)
_LAID_OUT_REFUSED = _BY_INDEX + ("eye_",)


def refuse_laid_out_init(t) -> None:
    """``nn.init.eye_`` / ``orthogonal_`` / ``dirac_`` / ``sparse_`` of a row or chunk
    storage (:class:`.laid_out.LaidOutParameter`, its ``.data`` and views): raise at the
    first touch, naming the fix, before any draw or write.  Before (habits11): torch's own
    errors from the storage's shape ("shape '[4, 4]' is invalid for input of size 72",
    "eye() received an invalid combination of arguments"), after orthogonal_ had drawn."""
    name = _init_frame()
    if name in _LAID_OUT_REFUSED:
        raise RuntimeError(
            f"in-place init of a parameter after wrapping: {t._wb_layout}, so "
            f"nn.init.{name} would not give one device's values (it reads the storage's "
            f"shape {tuple(t.as_subclass(_T).shape)}, not the module's).  Initialize the "
            "module before wrapping it (the wrapper starts every rank from its values), or "
            "load full tensors with the wrapper's load_state_dict")
