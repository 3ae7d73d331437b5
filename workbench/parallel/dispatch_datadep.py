"""Running an op whose output size depends on the values (``ops_table/datadep.py``).

Such an op has no output shape before it runs, so it skips the meta-tensor check and
the prepared-call cache of :mod:`.dispatch`; otherwise it runs as every op does: the
rule's decision (every input Replicate), each input's reshard plan executed (its
collectives traced, their backward the gradient's way back to the shards), the local op
once on the global values, its cost recorded forward (and backward when the gradient
passes), the ``explain`` hooks called, the outputs wrapped Replicate.
"""
from __future__ import annotations

import torch

from ..sim_mesh.trace import current_trace
from . import storage
from .dist_tensor import DistTensor, TensorSpec
from .dispatch_local import as_dist
from .ops_table import pricing
from .placement import Replicate
from .reshard import execute
from .seq_order import check_op, orders_of

__all__ = ["run_data_dependent"]


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) \
        else t


def run_data_dependent(entry, inputs, attrs, hooks=(), force=None):
    """Run ``entry`` (a data-dependent op) on ``inputs`` (DistTensors, plain tensors and
    constants, as its parse returned them); the result has torch's structure (a tensor or
    a tuple of tensors), every tensor a replicated DistTensor."""
    from .dispatch import common_mesh
    from .ops_table.strategy import infer
    mesh = common_mesh(entry.name, inputs)
    specs = tuple(x.spec if isinstance(x, DistTensor) else
                  TensorSpec(x.shape, mesh, [Replicate()] * mesh.ndim, x.dtype)
                  if isinstance(x, torch.Tensor) else None for x in inputs)
    dec = infer(entry.name, *specs, **attrs)
    cand = (force(dec) if force is not None else None) or dec.chosen
    for x in inputs:         # elements listed in a ring order's positions: refused
        if type(x) is DistTensor and orders_of(x):        # (seq_order.py)
            check_op(entry, inputs, specs, cand.plans, attrs)
            break
    whole = []
    for x, plan in zip(inputs, cand.plans):
        if isinstance(x, DistTensor):
            t = execute(plan, x) if plan is not None and plan.steps else x
            x = t.local(None if storage.holds_own(mesh) else mesh.ranks[0])
        whole.append(x)
    out = entry.local(0, None, *whole, **attrs)        # torch itself: its values, errors
    many = isinstance(out, tuple)
    outs = tuple(out) if many else (out,)
    tr = current_trace()
    cost = None
    if tr is not None or hooks:
        cost = entry.cost([_meta(t) for t in whole], [_meta(o) for o in outs], **attrs)
    if tr is not None:
        dtype = pricing.pricing_dtype(specs, [o.dtype for o in outs])
        pricing.record_forward(tr, entry, mesh, cost, dtype)
        if torch.is_grad_enabled():
            outs = pricing.on_backward(outs, entry, mesh, cost, dtype,
                                       pricing.needs_grad(whole), inputs=whole)
    wrapped = tuple(as_dist(o, mesh) for o in outs)
    for h in hooks:
        h(dec, specs, wrapped, cost)
    if not many:
        return wrapped[0]
    return type(out)(wrapped) if type(out) is not tuple else wrapped
