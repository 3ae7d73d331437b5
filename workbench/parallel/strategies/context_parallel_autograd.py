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

__all__ = ["autograd_in_context"]


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
    if not all(type(t) is torch.Tensor for t in outs + ins) or \
            a.get("is_grads_batched") or (grad and isinstance(a.get("inputs"), dict)):
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


def _outside_the_ring(func, args, kwargs):
    """A torch without the private entry points used above: the public call, with the
    ring off.  Right unless a checkpointed block recomputes attention inside it, which
    then is not ring attention: torch's checkpoint notices (another number of saved
    tensors) and that error is given the cause and the fix."""
    from torch.utils.checkpoint import CheckpointError
    try:
        return func(*args, **kwargs)
    except CheckpointError as e:
        raise RuntimeError(
            f"{func.__name__}() inside context_parallel: a checkpointed block recomputed its "
            "attention outside the ring, as this torch (" + torch.__version__ + ") lacks "
            "torch.autograd.graph._engine_run_backward / torch.autograd._make_grads (torch "
            "2.13's) that run the backward with the ring active; call loss.backward() on a "
            "scalar DistTensor loss, or use recompute='none'") from e
