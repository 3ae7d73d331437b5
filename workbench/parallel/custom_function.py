"""A user's ``torch.autograd.Function`` applied to DistTensors, as PyTorch DTensor runs it.

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x                    # runs on DistTensors, through the op table
        @staticmethod
        def backward(ctx, g):               # g: a DistTensor
            (x,) = ctx.saved_tensors
            return 2 * x * g
    y = Square.apply(d)                     # d: a DistTensor; y.sum().backward() fills d.grad

``Function.apply`` counts only ``torch.Tensor`` arguments as inputs.  A DistTensor is not
one (autograd records on its local tensors, :mod:`.dispatch`), so torch ran the forward
under no_grad with the DistTensor as a constant and the output silently lost its
gradient.  DTensor, a Tensor subclass, is an input: its Function's forward and backward
run on DTensors.  :func:`install` puts one check in front of ``Function.apply``: a call
with a DistTensor among its arguments goes through :class:`_Bridge`, a Function over
the DistTensors' local tensors (the tensors autograd sees):

* forward: the user's ``forward`` runs on the DistTensors themselves (under no_grad, as
  torch runs it); its DistTensor outputs' local tensors are the bridge's outputs;
* backward: each output's local gradients are wrapped as a DistTensor (laid out as its
  ``.grad`` would be), the user's ``backward`` runs on them, and each returned
  gradient is resharded to its input's layout (the redistribution is traced) and handed
  to autograd as the input's local gradients.

``ctx`` is a :class:`DistFunctionCtx`: ``save_for_backward`` / ``saved_tensors`` (kept
through the bridge's own saved tensors, so torch's in-place and second-backward checks
hold), ``needs_input_grad``, ``mark_non_differentiable``, ``set_materialize_grads``,
attributes.  ``mark_dirty`` (in-place on an input) and forward-mode AD raise.
``torch.amp.custom_fwd(cast_inputs=...)`` / ``custom_bwd`` work (:func:`_forward`).
``torch.utils.checkpoint(..., use_reentrant=True)`` on DistTensors runs the
non-reentrant checkpoint (:func:`_checkpoint`).  A
``Partial("max" | "min")`` input is reduced before the forward (its gradient would go to
the ranks holding the extremum).  Gradients pass through reshard and the ops the user's
backward calls, so ``create_graph=True`` (double backward) works as on one device.
"""
from __future__ import annotations

import inspect
import warnings

import torch
from torch.autograd.function import _is_setup_context_defined

from . import storage
from .custom_function_grads import (flatten as _flatten, input_grad as _input_grad,
                                    output_grad as _output_grad, unflatten as _unflatten)
from .dist_tensor import DistTensor
from .placement import Replicate
from .reshard import reshard

__all__ = ["install", "DistFunctionCtx"]

_BASE = torch.autograd.Function


class DistFunctionCtx:
    """The ``ctx`` a user's Function sees when it runs on DistTensors (torch's
    ``FunctionCtx`` surface)."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True
        self._to_save = None          # what save_for_backward was given
        self._nondiff = []
        self._bctx = None             # the bridge's ctx, while its backward runs
        self._saved_tree = None

    def save_for_backward(self, *tensors) -> None:
        for k, t in enumerate(tensors):
            if t is not None and not isinstance(t, (torch.Tensor, DistTensor)):
                raise TypeError(f"save_for_backward can only save variables, but argument {k}"
                                f" is of type {type(t).__name__}")
        self._to_save = tensors

    @property
    def saved_tensors(self) -> tuple:
        if self._bctx is None:
            if self._to_save is not None:
                return tuple(self._to_save)     # read in forward: what was given
            return ()
        flat = self._bctx.saved_tensors         # torch's checks (in-place, freed buffers)
        return _unflatten(self._saved_tree, flat)

    def mark_non_differentiable(self, *args) -> None:
        self._nondiff += list(args)

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = bool(value)

    def mark_dirty(self, *args) -> None:
        raise NotImplementedError(
            "ctx.mark_dirty on DistTensors: a custom Function that writes into its "
            "DistTensor inputs is not supported; return a new tensor instead (e.g. "
            "x.clone().mul_(2), or x * 2)")

    def save_for_forward(self, *tensors) -> None:
        raise NotImplementedError("ctx.save_for_forward (forward-mode AD) on DistTensors is "
                                  "not supported; use reverse mode (backward)")


# ---- the bridge -----------------------------------------------------------------------------

class _Call:
    """One application of a user's Function on DistTensors."""
    __slots__ = ("cls", "args", "kwargs", "in_tree", "ctx", "out_tree", "single", "setup")


class _Bridge(torch.autograd.Function):
    """A Function over the local tensors of a user's Function's DistTensor inputs and
    outputs (module docstring)."""

    @staticmethod
    def forward(bctx, call, *flat):
        needs = bctx.needs_input_grad[1:]
        ins = []
        for kind, tm, k, n in call.in_tree:
            ins.append(kind != "o" and any(needs[k:k + n]))
        ctx = call.ctx = DistFunctionCtx(tuple(ins))
        args, call.args = call.args, None          # the inputs are not kept
        if call.setup:
            out = call.cls.forward(*args, **call.kwargs)
            call.cls.setup_context(ctx, args, out)
        else:
            out = _forward(call.cls.forward, ctx, args, call.kwargs)
        call.kwargs = None
        call.single = not isinstance(out, tuple)
        outs = (out,) if call.single else out
        flat_out, call.out_tree = _flatten(outs)
        if ctx._to_save is not None:
            saved, ctx._saved_tree = _flatten(ctx._to_save)
            bctx.save_for_backward(*saved)
            ctx._to_save = None
        nondiff = [t for x in ctx._nondiff for t in (
            storage.tensors(x._local) if isinstance(x, DistTensor) else [x])]
        if nondiff:
            bctx.mark_non_differentiable(*nondiff)
        bctx.set_materialize_grads(ctx.materialize_grads)
        bctx.call = call
        return tuple(flat_out)

    @staticmethod
    def backward(bctx, *gflat):
        call = bctx.call
        cls, ctx = call.cls, call.ctx
        grads = []
        for kind, tm, k, n in call.out_tree:
            if kind == "d":
                grads.append(_output_grad(tm, gflat[k:k + n], ctx.materialize_grads))
            elif kind == "t":
                grads.append(gflat[k])
            else:                       # a non-tensor output: None, as torch passes
                grads.append(None)
        user = cls.vjp if cls.vjp is not _BASE.vjp else cls.backward
        ctx._bctx = bctx
        try:
            res = user(ctx, *grads)
        finally:
            ctx._bctx = None
        res = res if isinstance(res, tuple) else (res,)
        n_in = len(call.in_tree)
        if len(res) < n_in or any(r is not None for r in res[n_in:]):
            raise RuntimeError(f"function {cls.__name__}Backward returned an incorrect number "
                               f"of gradients (expected {n_in}, got {len(res)})")
        out = [None]
        for j, ((kind, tm, k, n), g) in enumerate(zip(call.in_tree, res)):
            if kind == "o":
                if g is not None:
                    raise RuntimeError(f"function {cls.__name__}Backward returned a gradient "
                                       f"different than None at position {j + 1}, but the "
                                       "corresponding forward input was not a Variable")
            elif kind == "t":
                if isinstance(g, DistTensor):    # a plain tensor meets DistTensors as
                    # Replicate: its gradient is the global one (not gathered if unused)
                    g = g.full() if ctx.needs_input_grad[j] else None
                out.append(g)
            else:
                out += _input_grad(cls, j, tm, g)
        if _once_differentiable(user) and torch.is_grad_enabled() and any(
                g is not None and g.requires_grad for g in gflat):
            out = [None] + _delayed_error(out[1:])
        return tuple(out)


def _once_differentiable(fn) -> bool:
    """True for a backward decorated by ``torch.autograd.function.once_differentiable``
    (its own check counts only torch.Tensor arguments, so it does not see DistTensors)."""
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_name == "wrapper" and \
        code.co_filename.replace("\\", "/").endswith("autograd/function.py")


def _delayed_error(ts):
    """As once_differentiable: gradients whose own backward raises (double backward)."""
    err = torch._C._functions.DelayedError(
        b"trying to differentiate twice a function that was marked with "
        b"@once_differentiable", len(ts))
    fake = [None if t is None else t.detach().requires_grad_() for t in ts]
    res = err(*fake)
    return list(res) if isinstance(res, tuple) else [res]


def _forward(fwd, ctx, args, kwargs):
    """``fwd(ctx, *args, **kwargs)``; a forward under ``torch.amp.custom_fwd(cast_inputs=)``
    is run as that decorator runs it (its own cast would iterate a DistTensor): the
    floating, non-float64 inputs cast to ``cast_inputs`` and autocast off, when autocast
    is on for its device type."""
    cf = _custom_fwd_args(fwd)
    if cf is None:
        return fwd(ctx, *args, **kwargs)
    device_type, cast_inputs = cf
    if not torch.is_autocast_enabled(device_type):
        return fwd(ctx, *args, **kwargs)
    ctx._dtype = torch.get_autocast_dtype(device_type)
    ctx._fwd_used_autocast = False

    def cast(x):
        if isinstance(x, (DistTensor, torch.Tensor)) and x.dtype.is_floating_point and \
                x.dtype != torch.float64:
            return x.to(cast_inputs)
        return x
    with torch.autocast(device_type=device_type, enabled=False):
        return fwd.__wrapped__(ctx, *[cast(a) for a in args],
                               **{k: cast(v) for k, v in kwargs.items()})


def _custom_fwd_args(fwd):
    """(device_type, cast_inputs) of a forward decorated by ``custom_fwd`` with
    ``cast_inputs``; None otherwise."""
    if getattr(fwd, "__wrapped__", None) is None or fwd.__code__.co_name != "decorate_fwd" \
            or not fwd.__code__.co_filename.endswith("autocast_mode.py"):
        return None
    cells = dict(zip(fwd.__code__.co_freevars, (c.cell_contents for c in fwd.__closure__)))
    if cells.get("cast_inputs") is None or "device_type" not in cells:
        return None
    return cells["device_type"], cells["cast_inputs"]


def _bind(cls, args, kwargs, setup):
    """``args`` and ``kwargs`` as the positional inputs of the user's forward (torch
    counts a tensor passed by keyword as an input too)."""
    if not kwargs:
        return args
    sig = inspect.signature(cls.forward)
    bound = sig.bind(*args, **kwargs) if setup else sig.bind(None, *args, **kwargs)
    bound.apply_defaults()
    if bound.kwargs:
        raise TypeError(f"{cls.__name__}.apply on DistTensors: keyword-only arguments "
                        f"{sorted(bound.kwargs)} of forward are not supported; pass them "
                        "positionally")
    return bound.args if setup else bound.args[1:]


def apply_dist(cls, args, kwargs):
    """``cls.apply(*args, **kwargs)`` with DistTensors among the arguments."""
    if cls.__name__ == "CheckpointFunction" and cls.__module__ == "torch.utils.checkpoint":
        return _checkpoint(args, kwargs)
    setup = _is_setup_context_defined(cls.setup_context)
    args = _bind(cls, args, kwargs, setup)
    args = tuple(_reduce_extremum(x) for x in args)
    flat, tree = _flatten(args)
    call = _Call()
    call.cls, call.args, call.kwargs, call.in_tree, call.setup = cls, args, {}, tree, setup
    fouts = _Bridge.apply(call, *flat)
    outs = _unflatten(call.out_tree, fouts)
    return outs[0] if call.single else outs


def _checkpoint(args, kwargs):
    """``torch.utils.checkpoint(fn, *args, use_reentrant=True)``: its Function keeps the
    inputs that are not tensors (DistTensors) as they are and recomputes with them still
    attached to the graph, then finds no tensor output to backpropagate from.  The
    non-reentrant checkpoint gives the same values and gradients (saved-tensor hooks on
    the local tensors): it runs instead.  Where no input requires grad, torch's Function
    runs ``fn`` under no_grad and its outputs require none (``CheckpointFunction.forward``,
    with ``check_backward_validity``'s warning): the parameters inside get no gradient, and
    so here (the non-reentrant one gave them theirs)."""
    import torch.utils.checkpoint as cp
    fn, preserve, *inputs = _bind(cp.CheckpointFunction, args, kwargs, False)
    if not any(isinstance(a, (torch.Tensor, DistTensor)) and a.requires_grad for a in inputs):
        warnings.warn("None of the inputs have requires_grad=True. Gradients will be None",
                      stacklevel=4)
        with torch.no_grad():
            return fn(*inputs)
    return cp.checkpoint(fn, *inputs, use_reentrant=False, preserve_rng_state=preserve)


def _reduce_extremum(x):
    if isinstance(x, DistTensor) and any(p.is_partial() and p.reduce_op in ("max", "min")
                                         for p in x.placements):
        return reshard(x, x.mesh, [Replicate() if p.is_partial() and p.reduce_op in
                                   ("max", "min") else p for p in x.placements])
    return x


def _has_dist(args, kwargs) -> bool:
    for a in args:
        if type(a) is DistTensor:
            return True
    if kwargs:
        for a in kwargs.values():
            if type(a) is DistTensor:
                return True
    return False


_ORIG = _BASE.__dict__["apply"]


def _apply(cls, *args, **kwargs):
    if _has_dist(args, kwargs):
        return apply_dist(cls, args, kwargs)
    return _ORIG.__func__(cls, *args, **kwargs)


# named as torch's: TorchDynamo recognises an aliased ``Fn.apply`` bound method by its
# ``__name__`` (torch/_dynamo/variables/builder.py, "handle aliased autograd function
# `apply` calls") and then traces the Function itself, not this check
_apply.__name__ = "apply"
_apply.__qualname__ = "Function.apply"


def install() -> None:
    """Route ``torch.autograd.Function.apply`` calls with DistTensor arguments here (once;
    calls without a DistTensor run torch's own apply unchanged)."""
    if getattr(_BASE.__dict__["apply"], "__func__", None) is not _apply:
        _BASE.apply = classmethod(_apply)
