"""Compute events on the trace: every op the dispatcher runs is priced from its entry's
cost on the local (per-rank) shapes of the busiest rank, forward when it runs and
backward when its gradient passes (an identity autograd node on its outputs, as the
backward collectives are recorded in ``sim_mesh/collectives.py``).

The roofline time is ``workbench.sim_mesh.cost.compute_time(flops, bytes, profile,
dtype, op_class=...)``. The dtype priced is the op's floating-point dtype (its first
floating input, else output). An op with no floating tensor at all (integer compares,
index arithmetic) has no peak of its own in the profiles: it is priced at the float32
peak, with its bytes at their real element size.
"""
from __future__ import annotations

import torch

from ...sim_mesh import cost as _cost
from ...sim_mesh.trace import current_trace
from .. import layout, storage
from .costs import Cost

__all__ = ["local_cost", "record_forward", "on_backward", "pricing_dtype"]


def _meta(shape, dtype):
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def local_cost(entry, mesh, specs, inputs, cand, out_shapes, out_dtypes, attrs) -> Cost:
    """``entry.cost`` on the busiest rank's local meta tensors (inputs as the strategy
    requires them, outputs as announced)."""
    ins = []
    for x, spec, req in zip(inputs, specs, cand.strategy.inputs):
        if spec is None:
            ins.append(x if not isinstance(x, torch.Tensor) else _meta(x.shape, x.dtype))
        else:
            ins.append(_meta(layout.max_local_shape(spec.shape, mesh, req), spec.dtype))
    outs = [_meta(layout.max_local_shape(s, mesh, ps), dt)
            for s, ps, dt in zip(out_shapes, cand.strategy.outputs, out_dtypes)]
    if getattr(entry.cost, "wants_layout", False):      # e.g. attention's busiest rank
        return entry.cost(ins, outs, layout=(mesh, specs, cand.strategy), **attrs)
    return entry.cost(ins, outs, **attrs)


def pricing_dtype(specs, out_dtypes):
    for dt in [s.dtype for s in specs if s is not None] + list(out_dtypes):
        if dt.is_floating_point:
            return dt
    return torch.float32


# The table's classes that the clock prices as one of its own kernel classes
# (``profiles.OP_CLASSES``): a cross-entropy is a softmax-like reduction over the vocabulary,
# an embedding lookup is a gather (bandwidth bound), a view runs no kernel (never priced).
_CLOCK_CLASS = {"loss": "reduction", "embedding": "data_movement", "view": "data_movement"}


def _time(flops, nbytes, profile, dtype, op_class):
    return _cost.compute_time(flops, nbytes, profile, dtype,
                              op_class=_CLOCK_CLASS.get(op_class, op_class))


def record_forward(tr, entry, mesh, cost: Cost, dtype) -> None:
    if cost.flops == 0 and cost.bytes == 0:          # a view: no kernel runs
        return
    dur = _time(cost.flops, cost.bytes, tr.profile, dtype, entry.op_class)
    tr.record_compute(mesh.ranks, entry.name, dur, flops=cost.flops, bytes=cost.bytes,
                      label="forward", args={"op_class": entry.op_class, "phase": "forward"})


class _BackwardCompute(torch.autograd.Function):
    """Identity on its tensors; ``when_backward()`` runs when their gradient passes."""

    @staticmethod
    def forward(ctx, when_backward, *xs):
        ctx.when_backward = when_backward
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.when_backward()
        return (None,) + grads


def _record_backward(name, op_class, ranks, cost, dtype):
    def record():
        tr = current_trace()
        if tr is not None and (cost.backward_flops or cost.backward_bytes):
            dur = _time(cost.backward_flops, cost.backward_bytes, tr.profile, dtype, op_class)
            tr.record_compute(ranks, name, dur, flops=cost.backward_flops,
                              bytes=cost.backward_bytes, label="backward",
                              args={"op_class": op_class, "phase": "backward"})
    return record


def on_backward(outs, entry, mesh, cost: Cost, dtype):
    """Attach the backward event to the outputs that take part in autograd (one node for
    all of them, so it is recorded once); ``outs`` is a tuple of local data (any form
    :mod:`..storage` holds)."""
    held = [storage.tensors(o) for o in outs]
    slots = [(j, k, t) for j, ts in enumerate(held) for k, t in enumerate(ts)
             if isinstance(t, torch.Tensor) and t.requires_grad]
    if not slots:
        return outs
    record = _record_backward(entry.name, entry.op_class, mesh.ranks, cost, dtype)
    res = _BackwardCompute.apply(record, *[t for _, _, t in slots])
    for (j, k, _), r in zip(slots, res):
        held[j][k] = r
    return tuple(storage.with_tensors(o, ts) for o, ts in zip(outs, held))
