"""Parameters whose storage is not the module's shape: in-place init refuses them.

On simulated ranks ``DistributedDataParallel`` stores each parameter as one row per rank
(shape ``(N, *shape)``) and ``FullyShardedDataParallel`` as flat padded chunks (``(N,
chunk)``, or ``(chunk,)`` per process).  ``torch.nn.init`` after wrapping would read that
storage as the parameter: each rank's replica filled from its own draw (the replicas no
longer equal), a fan-in (``kaiming_*``, ``xavier_*``, ``nn.Linear.reset_parameters``)
read from the rows' or the chunk's shape.  One device's result would need one draw of
the full parameter, which the wrappers do at construction (DDP broadcasts rank 0's
values; FSDP cuts the module's values), so these parameters are a subclass of
``nn.Parameter`` whose ``__torch_function__`` raises on a random fill (the ``Tensor``
methods every ``torch.nn.init`` random init ends in: ``uniform_``, ``normal_``...; the
``nn.init`` functions torch lets a subclass override; ``torch.eye(out=...)``) and passes
every other function through unchanged (plain results, as ``nn.Parameter``'s).
``fill_`` / ``zero_`` / ``nn.init.constant_`` are elementwise and stay allowed; a whole
parameter's random fill is one device's draw (below).  ``p.data``
and ``p.detach()`` keep these guards (:class:`_LaidOutData`: torch's are plain tensors,
which drew each rank's row or chunk on its own), and so does every view of the storage
(``p.view(-1)``, ``p[0]``, ``p.flatten()``, ``p.T``, ``p.narrow``, ``p.unbind()``...:
:class:`_LaidOutView`, random fills raise, elementwise writes write what it views).  A
reshape that must copy (a non-contiguous storage: fully_shard over DistTensors keeps its
chunks dp-minor) gives a copy, as torch's, which reads as one and refuses writes (on one
device the parameter is contiguous and the reshape a view that writes it:
:mod:`.laid_out_copies`).

Read into a plain tensor of the module's shape by an in-place op (an EMA's
``ema.copy_(p)``, ``_foreach_lerp_``), ``p`` is its module value, and so is it in an
out-of-place pointwise op beside a tensor of the module's shape (a custom
``AveragedModel(avg_fn=...)``'s ``0.1 * ema + 0.9 * p``: :mod:`.laid_out_reads`).

``nn.init.normal_(p, mean, std)`` (GPT-2's init), and every other random ``nn.init``
(``uniform_``, ``kaiming_*``, ``xavier_*``, ``trunc_normal_``, ``Linear.reset_parameters``)
and random fill of ``p`` or ``p.data`` (``p.data.normal_(0, 0.02)``, Hugging Face's) is one
device's: one draw of the module's shape written into every row or chunk
(:func:`_one_draw`), the fans read from the module's shape (habits12; before, only
``normal_`` was, the rest raised).

``torch.autograd.grad`` over DDP's rows raises (:func:`_check_autograd_grad`: each row
would be its own rank's gradient, never averaged; torch DDP does not support it).

``nn.init.eye_`` / ``orthogonal_`` / ``dirac_`` / ``sparse_`` (the storage's shape read
inside ``nn.init``, a write by index or through a view) raise at their first touch, before
any draw (:func:`.laid_out_replica_init.refuse_laid_out_init`): initialize before wrapping.

Where the wrapper says how (``full`` / ``store``: the module's tensor from the storage
and back), a value of the module's own shape goes in and out as on one device:
``p.copy_(t)`` with ``t`` of the module's shape writes it into every rank's row or chunk
(FSDP's chunks would otherwise raise a broadcasting error, or DDP's rows take it
already), another in-place op given such a tensor raises (its elements would not meet
the storage's), and the module's own ``state_dict()`` / ``load_state_dict`` give and take
tensors of the module's shapes (:func:`module_shaped_state_dict`), as ``ddp.module.
state_dict()`` does in torch; so does any ``torch.optim`` optimizer's ``state_dict()`` over
them (hooked at its first step), and one device's optimizer states loaded into it are laid
out before the next step (:func:`_lay_out_loaded_states`): a checkpoint moves between one
device and any rank count.  An optimizer whose update reads a parameter whole would read
the storage instead (``torch.optim.LBFGS`` over DDP's rows, ``Adafactor`` over FSDP's
chunks): it raises before its first step (:func:`_check_whole_parameter_optimizer`).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import init
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..dist_tensor import DistTensor
from ..load_back import mark
from .flat_shards import flat_padded, unflat
from .laid_out_copies import guard_copy, in_place, map_sharers
from .laid_out_grad_reads import grad_assignment
from .laid_out_hooks import HOOKS, register
from .laid_out_replica_init import LAID_OUT_DRAWS, laid_out_draw, refuse_laid_out_init
from .laid_out_reads import (LIKES, LaidOutValue, keep_layout, module_shaped_sources,
                             pointwise_reads)
from .laid_out_whole import check_view_as, module_dims, module_flat_view, whole_reads
from .laid_out_shape import module_shape_read, module_view
from .laid_out_views import (gradient_edges, mark_module_view, read_value, users_call,
                             refuse_storage_leaf, refuse_storage_read)
from .replaced_params import follow_successors
from .replica_writes import after_write, before_write, handed_out

__all__ = ["LaidOutParameter", "laid_out", "module_shaped", "module_shaped_state_dict", "Rows",
           "Chunks", "rank_row"]

_T = torch.Tensor
_DATA_SET = _T.data.__set__     # ``p.data = t`` (compared with ==: a fresh method-wrapper)
_DATA_GET = _T.data.__get__     # ``p.data``: an alias that keeps the guards (_data_alias)
_DETACH = (_T.detach, torch.detach)     # ``p.detach()``: the same alias as ``p.data``
_GUARDED = {_T.uniform_, _T.normal_, _T.bernoulli_, _T.exponential_, _T.cauchy_,
            _T.log_normal_, _T.geometric_, _T.random_, init.uniform_, init.normal_,
            init.kaiming_uniform_}


class LaidOutParameter(nn.Parameter):
    """An ``nn.Parameter`` laid out by a wrapper (module docstring); ``_wb_layout``
    says how, for the error."""

    def full_tensor(self) -> torch.Tensor:
        """DTensor's ``full_tensor()`` (what FSDP2's sharded parameters answer): the
        parameter's value in the module's shape, a copy (no gradient), where the wrapper
        holds every rank's storage here (simulated ranks)."""
        full = getattr(self, "_wb_full", None)
        if full is None:
            raise NotImplementedError(
                f"full_tensor() of this parameter: {self._wb_layout}, and this process does "
                "not hold every rank's part; read the module's full values from the "
                "wrapper's state_dict() (DistTensors: .full()) or full_state_dict()")
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            return full(self.detach()).clone()

    def __deepcopy__(self, memo):
        """``copy.deepcopy`` (of the wrapped module: ``copy.deepcopy(ddp.module)``,
        ``AveragedModel(ddp.module)``, an EMA's copy): a plain ``nn.Parameter`` of the
        module's shape holding its values, as torch DDP's module deep-copies into a plain
        module (torch's default raised "Creating a Parameter from an instance of type
        LaidOutValue requires that detach() returns an instance of the same type",
        habits7b).  The copy is no part of the wrapper: no rank's storage, hook or
        optimizer holds it.  Where this process does not hold every rank's part, raises."""
        if id(self) in memo:
            return memo[id(self)]
        if getattr(self, "_wb_full", None) is None or not getattr(self, "_wb_here", False):
            raise NotImplementedError(
                f"copy.deepcopy of a parameter after wrapping: {self._wb_layout}, and this "
                "process does not hold every rank's part.  Deepcopy the module before "
                "wrapping it, or load the wrapper's full_state_dict() into a plain copy")
        out = nn.Parameter(self.full_tensor(), self.requires_grad)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto):
        """``torch.save`` / pickle of the parameter itself (a ``state_dict(keep_vars=True)``
        value: LoRA's save of what trains): a plain ``nn.Parameter`` of the module's shape
        holding its values, as one device's and torch DDP's save it (habits10: it raised
        RecursionError, or a PicklingError naming the wrapper's module class).  Where this
        process does not hold every rank's part, raises as ``copy.deepcopy``."""
        if getattr(self, "_wb_gathers", None) == "users" and \
                getattr(self, "_wb_full", None) is not None:    # simulated, over tp
            return nn.Parameter(self.full_tensor(), self.requires_grad).__reduce_ex__(proto)
        return self.__deepcopy__({}).__reduce_ex__(proto)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], _LAID_OUT):
            # nn.init.eye_ / orthogonal_ / dirac_ / sparse_: raise at their first touch
            # (laid_out_replica_init)
            refuse_laid_out_init(args[0])
        if func is torch.autograd.grad:
            _check_autograd_grad(args, kwargs)
        if grad_assignment(func, args, LaidOutParameter):
            return None     # a user's p.grad = g of the module's shape (laid_out_grad_reads)
        if func in HOOKS and args and isinstance(args[0], LaidOutParameter) and users_call():
            # a user's p.register_hook(fn): fn sees one device's gradient (laid_out_hooks)
            return register(args[0], func, args[1] if len(args) > 1 else kwargs["hook"])
        # p.detach().requires_grad_(): a leaf of the storage (laid_out_views); p.T.sum(),
        # p[0].norm(): a view's reduction reads the storage (laid_out_views)
        refuse_storage_leaf(func, args, kwargs, (_LaidOutData, LaidOutValue), _LaidOutView)
        refuse_storage_read(func, args, kwargs, _LaidOutView)
        if func == _DATA_SET and len(args) > 1 and isinstance(args[0], LaidOutParameter) \
                and _module_shaped_data(args[0], args[1]):
            return None         # p.data = t of the module's shape: written as p.copy_(t)
        target = None
        if func in _GUARDED:            # nn.init's overrides pass the tensor by keyword
            target = args[0] if args else kwargs.get("tensor")
        elif func is torch.eye:
            target = kwargs.get("out")
        if func in LAID_OUT_DRAWS and isinstance(target, _PARAMS) and \
                _draw_store(target) is not None:
            # one device's draw of the module's shape (laid_out_replica_init.laid_out_draw)
            out = laid_out_draw(func, target, args, kwargs, _drawn)
            if out is not None:
                return out
        if isinstance(target, _LAID_OUT):
            raise RuntimeError(
                f"in-place init of a parameter after wrapping: {target._wb_layout}"
                f"{' (this tensor is a view of it)' if isinstance(target, _LaidOutView) else ''}, so "
                f"{getattr(func, '__name__', func)} would not give one device's values (each "
                "rank's copy its own draw, a fan-in read from that shape).  Initialize the "
                "module before wrapping it (the wrapper starts every rank from its values), "
                "or load full tensors with the wrapper's load_state_dict")
        done, whole = whole_reads(func, args, kwargs, _READS)
        if done:                # p.numel(), p.sum(), p.norm(): the module's (laid_out_whole)
            return whole
        check_view_as(func, args, _PARAMS)     # vector_to_parameters: raises naming the fix
        dims = module_dims(func, args, _PARAMS)
        if dims is not None:    # p.dim(), p.ndim: the module's (laid_out_whole)
            return dims
        flat = module_flat_view(func, args, _PARAMS)
        if flat is not None:    # p.view(-1): the module's flat parameter (parameters_to_vector)
            view = _guard_views(args[0], flat, func)
            if isinstance(view, _LaidOutView):
                mark_module_view(view)
            return view
        done, shape = module_shape_read(func, args, _WHOLE_READS)
        if done:                # a user's p.shape, p.size(), len(p): the module's (laid_out_shape)
            return shape
        done, out = module_view(func, args, kwargs, _WHOLE_READS)
        if done:                # a user's p[i], p.T: views of the module's value (laid_out_shape)
            return _guard_views(args[0], out, func, module=True)
        p = args[0] if args else kwargs.get("tensor")     # nn.init.constant_(tensor=p)
        if not isinstance(p, _LAID_OUT):   # an EMA's ema.copy_(p): p's module value
            args, kwargs = module_shaped_sources(func, args, kwargs, _READS)
        # an EMA's avg_fn: 0.1 * ema + 0.9 * p, one device's (laid_out_reads)
        args, kwargs, keep = pointwise_reads(func, args, kwargs, _READS)
        if keep is None and func in LIKES and args and isinstance(args[0], _WHOLE_READS) \
                and users_call(True, depth=-1):
            keep = args[0]      # a user's torch.zeros_like(p): p's layout (laid_out_reads)
        written = isinstance(p, _LAID_OUT) and in_place(func)
        view = isinstance(p, _LaidOutView)     # its writes: checked lazily, as torch's views
        if written and not view:
            before_write(_owner(p))     # a write through one row's handle first (DDP)
            args = _module_shaped_operands(func, args) if args else args
        if func in _AUTOGRAD_RUNS:
            # an autograd input as its gradient edge: the same node (a fresh alias of a
            # leaf got None, laid_out_views)
            args, kwargs = gradient_edges(func, args, kwargs, _READS)
            # backward / grad run user code (checkpoint's recomputed forward, hooks) that
            # needs torch-function dispatch of other subclasses (DistTensor): not under
            # DisableTorchFunctionSubclass; the views are read as plain tensors (the same
            # autograd graph: Tensor.as_subclass)
            plain = lambda t: t.as_subclass(torch.Tensor) if isinstance(  # noqa: E731
                t, (_LaidOutView, LaidOutValue)) else t
            args = tuple(tuple(plain(t) for t in a) if isinstance(a, (tuple, list)) else
                         plain(a) for a in args)
            kwargs = {k: tuple(plain(t) for t in v) if isinstance(v, (tuple, list)) else
                      plain(v) for k, v in kwargs.items()}
            if not any(isinstance(t, _LAID_OUT) for a in (*args, *kwargs.values())
                       for t in (a if isinstance(a, (tuple, list)) else (a,))):
                return func(*args, **kwargs)
        try:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
        except RuntimeError as e:
            note = getattr(args[0], "_wb_view_note", None) if args and func is _T.view \
                else None
            if note is None:
                raise
            raise RuntimeError(f"{e}  ({note})") from None
        if keep is not None:
            return keep_layout(out, keep)
        if written and not view:
            after_write(_owner(p))      # the rows now, written alike: what is seen (DDP)
        if func == _DATA_GET and args and isinstance(args[0], LaidOutParameter):
            return _data_alias(args[0], out)
        if func in _DETACH and args and isinstance(args[0], (LaidOutParameter, _LaidOutData)):
            return _data_alias(_owner(args[0]), out)    # p.detach(), p.data.detach()
        if func == _DATA_SET and args and isinstance(args[0], LaidOutParameter):
            after = getattr(args[0], "_wb_on_data_set", None)   # p.data = t: new storage
            if after is not None:       # (fsdp_dist_views: the module's view follows it)
                after()
            return out
        if args and isinstance(args[0], _LAID_OUT) and not written:
            guarded = _guard_views(args[0], out, func)
            if guarded is not out:
                return guarded
        return read_value(func, args, kwargs, out, _LaidOutView)   # p.T.abs(): a storage read


def _check_autograd_grad(args, kwargs) -> None:
    """``torch.autograd.grad(loss, ddp.parameters())`` on simulated ranks: each rank's row
    would be its own gradient (a loss the wrapper joins as the ranks' mean: / N), never
    all-reduced (DDP reduces in the hooks ``.grad`` accumulation fires), so not the
    average DDP trains with.  torch DDP does not support it either (torch 2.13
    ``torch/nn/parallel/distributed.py:648-651``, the class docstring's warning: "This module
    doesn't work with torch.autograd.grad() (i.e. it will only work if gradients are to
    be accumulated in .grad attributes of parameters)"), so it raises, nothing run."""
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs", ())
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    rows = [p for p in inputs if isinstance(p, _LAID_OUT) and getattr(p, "_wb_rows", None)]
    if rows:
        raise RuntimeError(
            "torch.autograd.grad over DistributedDataParallel's parameters: "
            f"{rows[0]._wb_layout}, and each row would get its own rank's gradient, not "
            "all-reduced (DDP averages the gradients in the hooks that .grad accumulation "
            "fires); torch DDP does not support torch.autograd.grad either (it works only "
            "when gradients accumulate in .grad).  Call loss.backward() and read p.grad "
            "(every row the ranks' average)")


class _LaidOutData(torch.Tensor):
    """``p.data`` of a :class:`LaidOutParameter`: the same storage (a plain tensor's
    class, as torch's ``.data``), under the same guards.  torch's ``.data`` escaped them:
    ``p.data.normal_(0, 0.02)`` (Hugging Face's ``_init_weights``) drew each rank's row
    or chunk on its own, silently (FSDP: not one device's values), and ``p.data.copy_(t)``
    of the module's shape failed with a broadcasting error naming the storage's shape.
    Here they do what ``p``'s own do: ``normal_`` raises naming the fix, ``t`` is laid
    out as ``p``, ``nn.init.normal_(p.data)`` is one device's draw.  ``p.detach()`` is
    the same alias (torch's a plain tensor too: ``p.detach().normal_()`` and
    ``nn.init.*_(p.detach())`` drew each rank's row or chunk on its own, silently)."""

    __torch_function__ = LaidOutParameter.__torch_function__


class _LaidOutView(torch.Tensor):
    """A view of a :class:`LaidOutParameter`'s storage (``p.view(-1)``, ``p[0]``,
    ``p.flatten()``, ``p.T``, ``p.narrow(...)``, ``p.unbind()``..., of ``p`` itself or of
    its ``.data`` / ``detach()`` alias, or of another such view): torch's are plain
    tensors, so ``p.view(-1).normal_()`` or ``nn.init.normal_(p[0])`` drew each rank's
    row or chunk on its own, silently.  Here a random fill through it raises as through
    ``p`` (nothing written; ``nn.init.normal_`` too: a view is not the module's shape,
    so there is no one device's draw to give it), and an elementwise write
    (``zero_``, ``fill_``, ``mul_``, ``copy_``) writes the elements it views, as
    torch's; on DDP's rows a write into rank ``broadcast_from``'s row is copied into
    every row before anything reads them as replicas, a write into another row alone
    raises there (:func:`.replica_writes.sync_rows`, as for a plain view).  A user's own
    ``p[0]`` / ``p.T`` are views of the module's value (:mod:`.laid_out_shape`: DDP's
    row ``broadcast_from``, FSDP's chunks before the padding; ``_wb_module_view``), the
    wrappers' own of the storage.  It carries no ``_wb_store``: a tensor of the
    module's shape is not laid out for it (torch's broadcasting applies).  A new tensor
    computed from it (``p.view(-1) * 2``, ``.clone()``) is plain; it stays attached to
    autograd as torch's view (``Tensor.as_subclass``)."""

    __torch_function__ = LaidOutParameter.__torch_function__


_LAID_OUT = (LaidOutParameter, _LaidOutData, _LaidOutView)
_PARAMS = (LaidOutParameter, _LaidOutData)
LaidOutValue.__torch_function__ = LaidOutParameter.__torch_function__
_READS = _LAID_OUT + (LaidOutValue,)     # read as their module values (laid_out_reads)
_WHOLE_READS = _PARAMS + (LaidOutValue,)  # shaped as their modules' (laid_out_shape)
_AUTOGRAD_RUNS = (torch.autograd.backward, _T.backward, torch.autograd.grad)


def _guard_views(src, out, func=None, module=False):
    """``out`` (``func``'s result on ``src``) with each tensor that shares ``src``'s
    storage made a :class:`_LaidOutView` (also in a tuple or list: ``p.unbind()``,
    ``p.chunk(n)``, ``p.split(k)``), a reshape that had to copy a non-contiguous storage a
    :class:`.laid_out_copies.LaidOutCopy` (writes into it raise); anything else as it is."""
    def wrap(t, shares):
        if not shares:
            copy = guard_copy(src, _owner(src), func, t)
            return t if copy is None else copy
        with torch._C.DisableTorchFunctionSubclass():
            view = t.as_subclass(_LaidOutView)
        view._wb_layout = src._wb_layout
        view._wb_param = _owner(src)
        if module or getattr(src, "_wb_module_view", False):
            mark_module_view(view)      # a view of the module's value (laid_out_views)
        return view
    return map_sharers(src, out, _LAID_OUT, wrap)


_ATTRS = ("_wb_layout", "_wb_shape", "_wb_full", "_wb_store", "_wb_draw_store",
          "_wb_same_draw", "_wb_rows",
          "_wb_src", "_wb_view_note", "_wb_here", "_wb_gathers")


def rank_row(p, k):
    """``p[k]``: rank ``k``'s row of DDP's rows, the module's tensor on that rank (its
    forward's reads of it are one device's: not a storage view, :mod:`.laid_out_views`)."""
    row = p[k]
    if isinstance(row, _LaidOutView):
        mark_module_view(row)
    return row


def _data_alias(p, plain):
    """``p.data`` (``plain``, torch's) as a :class:`_LaidOutData` carrying ``p``'s layout
    (read now: a later ``p.data = t`` gives the next alias the new one)."""
    alias = torch.Tensor._make_subclass(_LaidOutData, plain, False)
    for k in _ATTRS:
        if hasattr(p, k):
            setattr(alias, k, getattr(p, k))
    alias._wb_param = p
    return alias


def _owner(t):
    """The parameter a write through ``t`` (it, or its ``.data`` alias) is a write into:
    the replicas' checks (:mod:`.replica_writes`) keep their records by parameter."""
    return getattr(t, "_wb_param", t)


def _drawn(func, p, args, kwargs):
    before_write(_owner(p))
    out = _one_draw(func, p, args, kwargs)
    after_write(_owner(p))     # every row the draw (DDP): what is seen now
    return out


def _one_draw(func, p, args, kwargs):
    """``nn.init.normal_(p, mean, std)`` (or another of
    :data:`.laid_out_replica_init.LAID_OUT_DRAWS`) after wrapping: one draw of the
    module's shape (the random numbers one device draws, its generator advanced as far),
    written into every rank's row or chunk.  The bounds and fans ``nn.init`` computes
    first read the module's shape (:func:`.laid_out_shape.module_shape_read`)."""
    kw = {k: v for k, v in kwargs.items() if k != "tensor"}
    fresh = torch.empty(p._wb_shape, dtype=p.dtype, device=p.device)
    with torch._C.DisableTorchFunctionSubclass():
        func(fresh, *args[1:], **kw)
        if getattr(p, "_wb_same_draw", None) is not None:
            p._wb_same_draw(fresh)      # torch.distributed: rank 0's draw on every process
        with torch.no_grad():
            p.copy_(_draw_store(p)(fresh))
    return p


def _module_shaped_data(p, value) -> bool:
    """A user's ``p.data = value`` on a laid-out parameter.  torch's assignment swaps
    ``p``'s storage for ``value``'s, so a ``value`` of the module's shape (a manual weight
    load, ``p.data = w.clone()``) became the storage: DDP's ``state_dict()`` then read
    row 0 of it as the parameter (a ``(3,)`` tensor for a ``(6, 3)`` weight, saved as
    such by ``torch.save``), FSDP's forward raised torch's "shape '[4, -1]' is invalid"
    (habits7b).  Here such a ``value`` of ``p``'s dtype and device is written into every
    rank's row or chunk, as ``p.copy_(value)`` (one device's values; ``p`` keeps its own
    storage, so a later in-place write into ``value`` does not reach it, unlike torch's
    alias): True.  A ``value`` of the storage's shape (the wrappers' own swaps,
    ``Module._apply``'s casts) is torch's assignment: False.  Any other raises naming
    the fix, nothing assigned."""
    if not isinstance(value, torch.Tensor):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        stored = tuple(p.shape)
    got, shape = tuple(value.shape), getattr(p, "_wb_shape", None)
    if got == stored or shape is None:
        return False
    if got == tuple(shape) and value.dtype == p.dtype and value.device == p.device and \
            _draw_store(p) is not None:
        with torch.no_grad():
            p.copy_(value.detach())     # laid out as p is (_module_shaped_operands)
        return True
    raise RuntimeError(
        f"p.data = t with t of shape {got}, dtype {value.dtype} on a parameter after "
        f"wrapping: {p._wb_layout}, so t cannot become its storage (the module's "
        f"parameter is {tuple(shape)}, {p.dtype}).  Write values of the module's shape and "
        "dtype with p.data.copy_(t) (or p.data = t of that shape and dtype), change the "
        "dtype with model.to(dtype), or load tensors with the wrapper's load_state_dict")


def _draw_store(p):
    """How a module-shaped value goes into ``p``'s storage for :func:`_one_draw`: its
    ``_wb_store``, or (Zero3 over DistTensors, whose shards keep the storage's optimizer
    states, so carry no ``_wb_store``) ``_wb_draw_store``; None: no draw here."""
    store = getattr(p, "_wb_store", None)
    return store if store is not None else getattr(p, "_wb_draw_store", None)


def _module_shaped_operands(func, args):
    """``p.copy_(t)`` with ``t`` of the module's shape: ``t`` laid out as ``p`` is; any
    other in-place op given such a tensor: a clear error (see the module docstring)."""
    p = args[0]
    shape = getattr(p, "_wb_shape", None)
    if shape is None:
        return args
    with torch._C.DisableTorchFunctionSubclass():
        storage = tuple(p.shape)
    if shape == storage or getattr(p, "_wb_rows", None):
        return args                 # DDP's rows: a tensor of the module's shape broadcasts
    out = list(args)
    for i, a in enumerate(args[1:], 1):
        if not isinstance(a, torch.Tensor) or tuple(a.shape) != shape:
            continue
        store = _draw_store(p)      # (Zero3's shards: their _wb_draw_store, habits18)
        if getattr(func, "__name__", "") == "copy_" and i == 1 and store is not None:
            out[i] = store(a)
            continue
        raise RuntimeError(
            f"{func.__name__} of a parameter after wrapping with a tensor of the module's "
            f"shape {shape}: {p._wb_layout}, so the elements would not meet; compute the "
            "new value and write it with p.copy_(value) (or before wrapping, or with the "
            "wrapper's load_state_dict)")
    return out


class Rows:
    """DDP's layout on N simulated ranks: ``(N, *shape)``, one copy per rank; the
    module's tensor is rank ``src``'s row."""

    def __init__(self, n: int, src: int):
        self.n, self.src = n, src

    def full(self, t):
        return t[self.src]

    def store(self, v):
        return v.unsqueeze(0).expand((self.n,) + tuple(v.shape))


class Chunks:
    """FSDP's layout on N simulated ranks: ``(N, chunk)``, the flattened tensor padded
    and cut in N chunks (:mod:`.flat_shards`)."""

    def __init__(self, n: int, shape):
        self.n, self.shape = n, tuple(shape)

    def full(self, t):
        return unflat(t.reshape(-1), self.shape)

    def store(self, v):
        return flat_padded(v, self.n).view(self.n, -1)


class ProcessChunks:
    """FSDP's layout on torch.distributed: this process's ``(chunk,)`` of the flattened
    padded tensor (``group``: the wrapper's :class:`~.ranks.RankGroup`).  The module's
    tensor is every process's chunk all-gathered, a collective: every process of the
    group asks for it in the same order, as for FSDP's own ``state_dict()`` (an
    optimizer's ``state_dict()`` over the shards gives one device's states on every
    process, so ``wb.checkpoint.save`` writes the whole of each, not rank 0's chunk)."""

    def __init__(self, group, shape):
        self.group, self.shape = group, tuple(shape)

    def full(self, t):
        from ...sim_mesh.agreed_reads import agree
        from .fsdp_units import all_gather
        # each process of the group makes the same read, or the reader gets an error
        # naming the fix (a read on one process hung: fixlist16)
        g = self.group
        agree(list(g.ranks),
              f"a sharded parameter (or its gradient or state) of shape {self.shape}")
        return unflat(all_gather([t.detach().reshape(-1)], self.group)[0], self.shape)

    def store(self, v):
        return flat_padded(v, self.group.n).view(self.group.n, -1)[self.group.k]

    @torch.no_grad()
    def same_draw(self, fresh) -> None:
        """``nn.init.normal_``'s draw, rank 0's on every process (their generators may
        differ), so the chunks are cut from one device's draw."""
        import torch.distributed as dist
        dist.broadcast(fresh, src=self.group.global_rank(0), group=self.group.pg)


def laid_out(t: torch.Tensor, requires_grad: bool, layout: str, shape=None,
             how=None) -> LaidOutParameter:
    """``t`` as a :class:`LaidOutParameter` (``layout``: how it is stored, for errors;
    ``shape``: the module's shape; ``how``: a :class:`Rows` or :class:`Chunks` giving the
    module's tensor from the storage and back, or None where it is not all here)."""
    p = LaidOutParameter(t, requires_grad=requires_grad)
    p._wb_layout = layout
    if how is not None:
        p._wb_shape, p._wb_full, p._wb_store = tuple(shape), how.full, how.store
        p._wb_same_draw = getattr(how, "same_draw", None)
        p._wb_here = isinstance(how, (Rows, Chunks))     # every rank's storage in this process
    return p


def _lay_out_loaded_states(optimizer, args, kwargs) -> None:
    """Before any ``torch.optim`` step: a state tensor of a :class:`LaidOutParameter`'s
    module shape (a one-device optimizer's ``state_dict()`` loaded into the optimizer over
    a wrapper's parameters) laid out as the parameter is (every rank's row or chunk), so
    training goes on as on one device; torch would otherwise broadcast it against the
    rows or fail on the chunks' shape.  ``step`` (and, for a 0-d parameter, the other
    scalar states: ``_SCALAR_STATES``) are left as they are.  A global step pre-hook
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``); it first refuses an
    optimizer whose update reads a parameter whole where the storage would mislead it
    (:func:`_check_whole_parameter_optimizer`).  Before all, an optimizer built before
    wrapping follows the parameters the wrapper replaced (:mod:`.replaced_params`)."""
    follow_successors(optimizer)
    _check_whole_parameter_optimizer(optimizer)
    for p in _laid_out_params(optimizer):
        if p not in optimizer.state:
            continue
        st = optimizer.state[p]
        skip = _SCALAR_STATES if not p._wb_shape else ("step",)
        for key, v in list(st.items()):
            if key not in skip and isinstance(v, torch.Tensor) and \
                    tuple(v.shape) == p._wb_shape:
                st[key] = p._wb_store(v.detach()).contiguous().clone()
    if not getattr(optimizer, "_wb_sd_hook", False) and \
            any(True for _ in _laid_out_params(optimizer)):
        optimizer._wb_sd_hook = True
        optimizer.register_state_dict_post_hook(_module_shaped_states)
        # its states read as the gradients are, the module's (rank_grads), once made
        optimizer.register_step_post_hook(_states_read_as_grads)


def _states_read_as_grads(optimizer, args, kwargs) -> None:
    from .rank_grads import states_read_as_grads
    states_read_as_grads(optimizer, list(_laid_out_params(optimizer)))


# torch.optim's optimizers whose update of an element reads more than that element (torch
# 2.13 torch/optim/lbfgs.py: one flat gradient of every parameter, its dot products and
# 1 / |g|_1 for the first step; adafactor.py: a parameter of 2 or more dims gets its second
# moment factored over its last two dims, a 1-d one does not).  On DDP's rows (N, *shape)
# LBFGS counts every replica (Adafactor factors each row as one device: exact); on FSDP's
# chunks ((N, chunk), or (chunk,) per process) Adafactor factors the chunks' shape, not the
# parameter's, and LBFGS (whose flat update was exact on the chunks while ``p.numel()`` was
# the storage's) now cuts its flat vector by ``p.numel()``, the module's (laid_out_whole),
# and views each piece as the storage: misaligned wherever a chunk is padded, so refused
_WHOLE = {"LBFGS": ("any", "its flat gradient, dot products and |g|_1 run over the "
                    "parameters' storage (each replica counted once more on DDP's rows) "
                    "while its flat vector is cut by p.numel(), the module's"),
          "Adafactor": ("chunks", "it factors a parameter's second moment by its shape, and "
                        "here the storage's shape is the flat chunks'"),
          # torch 2.13 torch/optim/_muon.py: each 2-d parameter's update orthogonalized
          # (Newton-Schulz) and its lr scaled by the matrix's shape; FSDP's (N, chunk) and
          # DDP's (N, d) rows of a 1-d parameter are 2-d storages it takes as the matrix
          "Muon": ("any", "it orthogonalizes each parameter's update as a matrix of its "
                   "shape, and here the storage's shape is the wrapper's layout")}


_REPLICAS = "its storage holds every replica's tensor-parallel shards"


def _check_whole_parameter_optimizer(optimizer) -> None:
    """Raise, before the step changes anything, for an optimizer of :data:`_WHOLE` over a
    storage it would read as the parameter."""
    what = _WHOLE.get(type(optimizer).__name__)
    if what is None or type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        return
    kind, why = what
    # every storage of another shape than its module's: Zero3's (no _wb_store) and DDP's
    # replica storage over tensor parallelism too (habits10: torch's stride error, and an
    # AttributeError for the message's _wb_layout)
    for p in (p for g in optimizer.param_groups for p in g["params"]
              if getattr(p, "_wb_shape", None) is not None):
        with torch._C.DisableTorchFunctionSubclass():
            if tuple(p.shape) == tuple(p._wb_shape):
                continue
        rows = getattr(p, "_wb_rows", None)
        if (kind == "rows" and rows and rows > 1) or (kind == "chunks" and not rows) or \
                kind == "any":
            raise NotImplementedError(
                f"torch.optim.{type(optimizer).__name__} over a wrapped parameter of shape "
                f"{tuple(p._wb_shape)} ({getattr(p, '_wb_layout', _REPLICAS)}): "
                f"{why}, which is not one device's update. "
                "Use an optimizer whose update is elementwise (SGD, Adam, AdamW, RMSprop...)"
                + (", or DDP under torchrun (one replica per process)" if kind == "rows"
                   else ", or DDP under torchrun (one whole replica per process)"
                   if kind == "any" else ", or DistributedDataParallel (whole parameters)"))


# torch.optim's per-parameter states that are 0-d whatever the parameter's shape (Adam's
# step, ASGD's eta and mu, NAdam's mu_product): for a 0-d parameter they cannot be told
# from its 0-d states by shape, so they are never laid out
_SCALAR_STATES = ("step", "eta", "mu", "mu_product")


def _laid_out_params(optimizer):
    """The optimizer's parameters whose storage is not the module's shape (the wrapper
    says how to convert: ``_wb_store``)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "_wb_store", None) is None:
                continue
            with torch._C.DisableTorchFunctionSubclass():
                if tuple(p.shape) != p._wb_shape:
                    yield p


def _module_shaped_states(optimizer, state_dict):
    """``optimizer.state_dict()`` over a wrapper's parameters: each state tensor of the
    storage's shape given in the module's shape (DDP: rank ``broadcast_from``'s row;
    FSDP: the chunks gathered, the padding dropped; under torch.distributed each
    process's part gathered, a collective: every process takes the same ``state_dict()``,
    as torch's full optimizer state dict), as one device's optimizer holds it,
    so the checkpoint loads into a plain optimizer, another rank count, or this one
    (:func:`_lay_out_loaded_states` lays it out again).  New dicts: the optimizer's own
    states are untouched."""
    order = [p for group in optimizer.param_groups for p in group["params"]]
    mine = {id(p) for p in _laid_out_params(optimizer)}
    for i, st in list(state_dict["state"].items()):
        p = order[i] if isinstance(i, int) and i < len(order) else None
        if p is None or id(p) not in mine:
            continue
        with torch._C.DisableTorchFunctionSubclass():
            storage = tuple(p.shape)
        state_dict["state"][i] = {
            k: _shaped_state(p, v) if k != "step" and isinstance(v, torch.Tensor) and
            tuple(v.shape) == storage else v for k, v in st.items()}
    if any(getattr(p, "_wb_rows", None) for p in order):
        handed_out(optimizer, state_dict)   # a write into DDP's rows: every row (.replica_writes)
    return state_dict


def _shaped_state(p, v):
    """The state ``v`` (laid out as ``p``) in the module's shape; a load in place
    (``wb.checkpoint.load``) writes it back into every row or chunk (:mod:`..load_back`:
    DDP's is one row's view)."""
    return mark(p._wb_full(v.detach()), lambda val, v=v, p=p: v.copy_(p._wb_store(val.clone())))


register_optimizer_step_pre_hook(_lay_out_loaded_states)


def module_shaped_state_dict(module: nn.Module) -> None:
    """Hooks on every submodule of ``module`` holding a :class:`LaidOutParameter` that
    says how: its ``state_dict()`` gives that parameter in the module's shape (a view,
    as torch's; ``keep_vars=True`` the parameter itself, which the wrappers read) and
    ``load_state_dict`` takes a tensor of that shape (into every rank's copy or chunk)."""
    for m in module.modules():
        if getattr(m, "_wb_sd_hooks", False) or not any(
                getattr(p, "_wb_full", None) for p in m._parameters.values()):
            continue
        m._wb_sd_hooks = True
        m.register_state_dict_post_hook(_state_dict_hook)
        m.register_load_state_dict_pre_hook(_load_hook)


def _laid_out_items(m, prefix):
    for name, p in m._parameters.items():
        if getattr(p, "_wb_full", None) is not None:
            yield prefix + name, p


def module_shaped(v):
    """A state-dict value as a checkpoint holds it: a :class:`LaidOutParameter` (what
    ``ddp.state_dict(keep_vars=True)`` gives, as torch's: the parameter itself) as its
    module-shaped value, marked so that a load in place writes every row or chunk
    (``wb.checkpoint``: the same values as ``state_dict()``'s); any other value as is."""
    if not isinstance(v, _LAID_OUT) or getattr(v, "_wb_full", None) is None:
        return v
    p = _owner(v)
    with torch._C.DisableTorchFunctionSubclass():
        full = p._wb_full(p.detach())
    return mark(full, lambda val, p=p: p.copy_(val.clone()))


def _state_dict_hook(m, state_dict, prefix, local_metadata) -> None:
    for key, p in _laid_out_items(m, prefix):
        v = state_dict.get(key)
        if v is not None and v is not p:       # keep_vars=False: p.detach()
            # DDP's: one replica's row; a load in place writes every row (..load_back);
            # a plain tensor as torch's (not a guarded view: a write through one row's
            # handle is the replicas' checks' business, .replica_writes)
            with torch._C.DisableTorchFunctionSubclass():
                full = p._wb_full(v)
            state_dict[key] = mark(full, lambda val, p=p: p.copy_(val.clone()))


def _load_hook(m, state_dict, prefix, local_metadata, strict, missing_keys,
               unexpected_keys, error_msgs) -> None:
    for key, p in _laid_out_items(m, prefix):
        v = state_dict.get(key)
        if isinstance(v, DistTensor) and tuple(v.shape) == p._wb_shape:
            v = v.full()                # e.g. FSDP's Shard(0) state dict: gathered
        if isinstance(v, torch.Tensor) and tuple(v.shape) == p._wb_shape:
            with torch.no_grad():
                state_dict[key] = p._wb_store(v.detach())
