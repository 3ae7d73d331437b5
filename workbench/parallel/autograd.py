"""``torch.autograd.backward`` and ``torch.autograd.grad`` with DistTensors among the
outputs or inputs, as ``DistTensor.backward`` does it: a Partial sum or avg output seeds each
rank's partial with its share (no all-reduce), a max or min one is reduced first,
a one-element output's implicit gradient is 1, a replicated value's gradient goes to its
one stored copy; the gradient of a DistTensor input comes back as a DistTensor laid out
as its ``.grad`` would be."""
from __future__ import annotations

import torch

from . import storage
from .dist_tensor import DistTensor
from .versions import explained

__all__ = ["AUTOGRAD"]


def _many(x) -> list:
    return [x] if isinstance(x, (torch.Tensor, DistTensor)) else list(x)


def _seeds(outputs, grads, fn: str):
    outs, gos = _many(outputs), grads
    gos = [None] * len(outs) if gos is None else _many(gos) if not isinstance(
        gos, (list, tuple)) else list(gos)
    if len(gos) != len(outs):
        raise RuntimeError(f"{fn}: grad_outputs has {len(gos)} entries for {len(outs)} outputs")
    t_outs, t_gos = [], []
    for o, g in zip(outs, gos):
        if isinstance(o, DistTensor):
            if g is None and o.numel() != 1:
                raise RuntimeError(f"{fn}: grad can be implicitly created only for scalar "
                                   f"outputs; give the gradient of the {tuple(o.shape)} output")
            a, b = o._seed(g, fn)
            t_outs += a
            t_gos += b
        else:
            if isinstance(g, DistTensor):
                raise TypeError(f"{fn}: a DistTensor gradient for a plain tensor output; "
                                "give a plain tensor")
            t_outs.append(o)
            t_gos.append(g)
    return t_outs, t_gos


def _inputs(inputs):
    ins = _many(inputs)
    flat, spans = [], []
    for x in ins:
        ts = storage.tensors(x._local) if isinstance(x, DistTensor) else [x]
        spans.append(len(ts))
        flat += ts
    return ins, flat, spans


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
             grad_variables=None, inputs=None):
    """``torch.autograd.backward`` with DistTensors."""
    if grad_variables is not None:
        raise TypeError("backward(grad_variables=...): use grad_tensors=")
    outs, gos = _seeds(tensors, grad_tensors, "backward")
    kw = {}
    if inputs is not None:
        kw["inputs"] = _inputs(inputs)[1]
    with explained():
        torch.autograd.backward(outs, gos, retain_graph=retain_graph,
                                create_graph=create_graph, **kw)


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         only_inputs=True, allow_unused=None, is_grads_batched=False, materialize_grads=False):
    """``torch.autograd.grad`` with DistTensors: a DistTensor input's gradient is a
    DistTensor of its layout (its ``.grad`` placements)."""
    if is_grads_batched:
        raise NotImplementedError("grad(is_grads_batched=True) with DistTensors: loop over "
                                  "the batch of gradients instead")
    outs, gos = _seeds(outputs, grad_outputs, "grad")
    ins, flat, spans = _inputs(inputs)
    _check_replicas(flat)
    with explained():
        gs = torch.autograd.grad(outs, flat, gos, retain_graph=retain_graph,
                                 create_graph=create_graph, allow_unused=allow_unused,
                                 materialize_grads=materialize_grads)
    res, k = [], 0
    for x, n in zip(ins, spans):
        part, k = list(gs[k:k + n]), k + n
        if not isinstance(x, DistTensor):
            res.append(part[0])
        elif all(g is None for g in part):
            res.append(None)
        else:
            it = iter(part)
            loc = storage.map_tensors(x._local, lambda t: _or_zeros(next(it), t))
            res.append(DistTensor(loc, x.mesh, x._grad_placements(), x.shape))
    return tuple(res)


def _check_replicas(flat) -> None:
    """``torch.autograd.grad(loss, ddp.parameters())`` (or the module's DistTensor
    parameters) under DDP over DistTensors on simulated ranks: each data-parallel replica
    would get its own rank's gradient (its share of the joined loss), never summed (the
    sum runs in the hooks that ``.grad`` accumulation fires), so not the average DDP
    trains with (0.034 off one device's in habits9's MLP).  torch DDP does not support
    ``torch.autograd.grad`` either (torch 2.13 ``torch/nn/parallel/distributed.py``, the
    class docstring: "This module doesn't work with torch.autograd.grad()"): raise before
    anything runs, as over plain DDP's rows (``strategies/laid_out.py``).  A replica
    storage carries ``_wb_replicas`` = (the parameter's name, the dp axes)."""
    for t in flat:
        rep = getattr(t, "_wb_replicas", None)
        if rep is not None:
            raise RuntimeError(
                f"torch.autograd.grad over DistributedDataParallel's replicas of {rep[0]!r}: "
                "each data-parallel replica would get its own rank's gradient, not the "
                "average (DDP sums them in the hooks that .grad accumulation fires); torch "
                "DDP does not support torch.autograd.grad either (it works only when "
                "gradients accumulate in .grad).  Call loss.backward() and read p.grad")


def _or_zeros(g, like):
    return torch.zeros_like(like) if g is None else g


AUTOGRAD = {torch.autograd.backward: backward, torch.autograd.grad: grad}
