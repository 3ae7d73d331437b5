"""The laid-out parameter itself (:class:`LaidOutParameter`), its ``p.data`` / ``detach()``
alias and the views of its storage, whose ``__torch_function__`` guards a storage that
is not the module's shape (:mod:`.laid_out`'s docstring says what it refuses and what it
does as one device does), and :func:`laid_out`, which makes one."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import init

from .laid_out_copies import guard_copy, in_place, map_sharers
from .laid_out_draws import (_draw_store, _drawn, _module_shaped_data, _module_shaped_operands,
                             _owner)
from .laid_out_grad_reads import grad_assignment
from .laid_out_hooks import HOOKS, register
from .laid_out_layouts import Chunks, Rows
from .laid_out_replica_init import LAID_OUT_DRAWS, laid_out_draw, refuse_laid_out_init
from .laid_out_reads import (LIKES, LaidOutValue, keep_layout, module_shaped_sources,
                             pointwise_reads)
from .laid_out_whole import check_view_as, module_dims, module_flat_view, whole_reads
from .laid_out_shape import module_shape_read, module_view
from .laid_out_views import (gradient_edges, mark_module_view, read_value, users_call,
                             refuse_storage_leaf, refuse_storage_read)
from .replica_writes import after_write, before_write
from ..versions import param_written


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
        if written:                     # a backward's version error names it (versions)
            param_written(_owner(p), p._wb_layout)
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
