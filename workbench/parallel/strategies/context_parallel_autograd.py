"""Autograd inside ``context_parallel``: ``torch.autograd.backward`` / ``grad`` run with the
ring active (``context_parallel.py``).

A checkpointed block (recompute "full" / "selective", ``torch.utils.checkpoint``) runs
its forward again inside backward; its attention must run as ring attention there as in
the forward.  Torch calls a ``TorchFunctionMode``'s ``__torch_function__`` with the mode
taken off its stack, so a backward started by ``torch.autograd.backward`` (every
``loss.backward()`` under torch.distributed, a non-scalar gradient) or
``torch.autograd.grad`` would recompute outside the ring.  The mode hands those two calls
here, which enter autograd's engine with the mode active again.
"""
from __future__ import annotations

import torch

from ..dist_tensor import DistTensor

__all__ = ["autograd_in_context", "tensor_backward_args"]


def autograd_in_context(mode, func, types, args, kwargs):
    """``func`` (``torch.autograd.backward`` or ``grad``) called with ``args``, ``kwargs``,
    run with ``mode`` (a ``context_parallel``) active: as torch enters autograd's engine
    once the arguments are checked (torch 2.13, ``torch/autograd/__init__.py``);
    DistTensor arguments go to their own handler (``parallel/autograd.py``), which comes
    back here with the local tensors."""
    try:
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward
    except ImportError:             # another torch: the public call, outside the ring
        return _outside_the_ring(func, args, kwargs)
    grad = func is torch.autograd.grad
    names = ("outputs", "inputs") if grad else ("tensors",)
    a = dict(zip(names, args))
    a.update(kwargs)
    outs = a[names[0]]
    outs = (outs,) if isinstance(outs, (torch.Tensor, DistTensor)) else tuple(outs)
    ins = a.get("inputs")
    ins = () if ins is None else (ins,) if isinstance(ins, (torch.Tensor, DistTensor)) \
        else tuple(ins)
    if any(isinstance(t, DistTensor) for t in outs + ins):
        with mode:
            return DistTensor.__torch_function__(func, types, args, kwargs)
    seeds = a.get("grad_outputs" if grad else "grad_tensors")
    seeds = () if seeds is None else (seeds,) if isinstance(seeds, torch.Tensor) \
        else tuple(seeds)
    subs = [t for t in outs + ins + seeds
            if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor]
    own = [t for t in subs if _own_handler(type(t))]
    if own and not getattr(mode, "_in_subclass", False):
        # a tensor subclass (ZeRO-3's laid-out shards and their views, which the loss of
        # a dry run on meta tensors is one of): its own handler, with the ring active, as
        # the DistTensor above; it comes back here with plain tensors.  Called with the
        # mode off, its backward recomputed attention outside the ring (a meta dry run
        # raised in the attention's row mask; torch.utils.checkpoint saw other tensors)
        mode._in_subclass = True
        try:
            with mode:
                return _subclass_handler(own, func, types, args, kwargs)
        finally:
            mode._in_subclass = False
    if subs:        # torch.Tensor's own handler (it would run autograd with every
        # subclass's dispatch off, DistTensor's too), or back from a handler that kept
        # them: the same graph read as plain tensors (Tensor.as_subclass), as laid_out's
        outs, ins = _plain(outs), _plain(ins)
        a = {k: _plain(v) if isinstance(v, (tuple, list)) else _plain((v,))[0]
             if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    if a.get("is_grads_batched") or (grad and isinstance(a.get("inputs"), dict)):
        return func(*args, **kwargs)
    gs = _tensor_or_tensors_to_tuple(a.get("grad_outputs" if grad else "grad_tensors"),
                                     len(outs))
    gs = _make_grads(outs, gs, is_grads_batched=False)
    create = bool(a.get("create_graph", False))
    retain = a.get("retain_graph")
    retain = create if retain is None else retain
    with mode:
        if not grad:
            _engine_run_backward(outs, gs, retain, create, ins, allow_unreachable=True,
                                 accumulate_grad=True)
            return None
        res = _engine_run_backward(outs, gs, retain, create, ins,
                                   bool(a.get("allow_unused", False)) or
                                   bool(a.get("materialize_grads", False)),
                                   accumulate_grad=False)
    if a.get("materialize_grads"):
        res = tuple(r if r is not None else torch.zeros_like(t, requires_grad=create)
                    for r, t in zip(res, ins))
    return res


def tensor_backward_args(args, kwargs) -> tuple:
    """``Tensor.backward(self, gradient, retain_graph, create_graph, inputs)``'s arguments
    as ``torch.autograd.backward``'s (args, kwargs), which it calls (torch 2.13
    ``torch/_tensor.py``): the mode sees ``Tensor.backward`` first, and handing it on with
    the mode off recomputed a checkpointed attention outside the ring (CheckpointError)."""
    names = ("tensor", "gradient", "retain_graph", "create_graph", "inputs")
    a = dict(zip(names, args))
    a.update(kwargs)
    return (a["tensor"],), {"grad_tensors": a.get("gradient"),
                            "retain_graph": a.get("retain_graph"),
                            "create_graph": a.get("create_graph", False),
                            "inputs": a.get("inputs")}


def _plain(ts) -> tuple:
    return tuple(t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) and
                 type(t) is not torch.Tensor else t for t in ts)


def _own_handler(c) -> bool:
    """Whether tensor class ``c`` has a ``__torch_function__`` of its own (not torch's
    default, nor the disabled one)."""
    f = getattr(c.__torch_function__, "__func__", c.__torch_function__)
    return f is not getattr(torch.Tensor.__torch_function__, "__func__", None) and \
        f is not torch._C._disabled_torch_function_impl


def _subclass_handler(subs, func, types, args, kwargs):
    """``func`` through the ``__torch_function__`` of the tensor subclasses in ``subs``,
    subclasses before their parents, as torch's ``handle_torch_function`` orders them;
    one that declines (NotImplemented) hands on to the next."""
    order = []
    for t in subs:
        c = type(t)
        if c in order:
            continue
        at = next((i for i, d in enumerate(order) if issubclass(c, d)), len(order))
        order.insert(at, c)
    for c in order:
        out = c.__torch_function__(func, types, args, kwargs)
        if out is not NotImplemented:
            return out
    raise TypeError(f"{func.__name__}() inside context_parallel: no handler of "
                    f"{[c.__name__ for c in order]} took the call")


def _outside_the_ring(func, args, kwargs):
    """A torch without the private entry points used above: the public call, with the
    ring off.  Right unless a checkpointed block recomputes attention inside it, which
    then is not ring attention: torch's checkpoint notices (another number of saved
    tensors), or the recomputed attention is refused on its ring-ordered inputs
    (seq_order.RingOrderError), and that error is given the cause and the fix."""
    from torch.utils.checkpoint import CheckpointError
    from ..seq_order import RingOrderError
    try:
        return func(*args, **kwargs)
    except (CheckpointError, RingOrderError) as e:   # (the recompute's attention refused)
        raise RuntimeError(
            f"{func.__name__}() inside context_parallel: a checkpointed block recomputed its "
            "attention outside the ring, as this torch (" + torch.__version__ + ") lacks "
            "torch.autograd.graph._engine_run_backward / torch.autograd._make_grads (torch "
            "2.13's) that run the backward with the ring active; call loss.backward() on a "
            "scalar DistTensor loss, or use recompute='none'") from e
