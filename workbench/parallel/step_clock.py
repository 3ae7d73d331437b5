"""The optimizer step on the modeled clock.

A simulated optimizer steps every rank's parameters at once on local tensors (a stack
with one leading axis per mesh dim, or each rank's ZeRO / FSDP shard): plain torch, so
nothing of it would reach the trace.  On the device each rank runs its update's
memory-bound kernels; this module records them, one compute event per optimizer step on
the ranks of the mesh, priced by :mod:`workbench.sim_mesh.optimizer_cost` (the bytes of
torch's fused / foreach kernels per parameter element, the planner's source too).

The data-parallel wrappers mark the tensors their optimizers step with :func:`hold`
(the replicas of ``DistributedDataParallel`` / ``DataParallel``, the chunks of
``ZeroRedundancyOptimizer(partition="chunks")``, the shards of ``Zero3`` /
``FullyShardedDataParallel`` over DistTensors).  torch's global optimizer step hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``) see every
``torch.optim`` optimizer's step, the wrappers' own (``wb.ops.AdamW``) and a user's
(``torch.optim.AdamW(ddp.parameters())``) alike.  SGD, Adam, AdamW and ``wb.ops.AdamW``
are priced; another optimizer stepping marked tensors records nothing and leaves a note
in ``trace.notes`` (never a silent wrong number).  Outside ``workbench.trace()`` the hooks
do nothing.
"""
from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ..ops.adamw import AdamW as _WbAdamW
from ..sim_mesh import optimizer_cost as OC
from ..sim_mesh.trace import current_trace

__all__ = ["hold", "unpriced", "PRICED"]

_TAG = "_wb_step_mesh"
_OFF: ContextVar[bool] = ContextVar("wb_step_clock_off", default=False)
_PENDING: dict = {}        # id(optimizer) -> [(ranks, bytes per rank, launches, dtype, name)]

# the optimizers priced (exact types: a subclass may run other kernels)
PRICED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, _WbAdamW)


def hold(tensors, ranks, lead: int) -> None:
    """Mark ``tensors`` as stepped on each of ``ranks``, every rank holding the part past
    their ``lead`` leading axes (a DistTensor's stack: ``mesh.ndim``; a wrapper's rows,
    one per rank: 1): an optimizer's step over them goes on those ranks' clock."""
    for t in tensors:
        setattr(t, _TAG, (tuple(ranks), lead))


@contextlib.contextmanager
def unpriced():
    """Optimizer steps inside are not recorded (a caller that prices the update itself,
    as ``plan.dryrun`` does with the planner's mixed-precision AdamW)."""
    tok = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(tok)


def _delegates(opt) -> bool:
    """A wrapper stepping inner optimizers (ZeRO's: over its chunks, or each rank's over
    the parameters it owns): the inner ones' steps are the ones priced."""
    inner = getattr(opt, "optimizers", None)
    if isinstance(inner, dict):
        return True
    inner = getattr(opt, "optimizer", None)
    return isinstance(inner, torch.optim.Optimizer) and inner is not opt


def _kernels(opt, group, p) -> "OC.StepKernels | None":
    kind = type(opt)
    if kind is _WbAdamW:            # wb.ops.adamw's native path: torch._fused_adamw_
        return OC.adam_kernels(decoupled=True, weight_decay=group["weight_decay"],
                               fused=True, foreach=True)
    if group.get("capturable") or group.get("differentiable"):
        return None
    fused = bool(group.get("fused"))
    foreach = group.get("foreach") is not False        # None: torch's accelerator default
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        decoupled = kind is torch.optim.AdamW or bool(group.get("decoupled_weight_decay"))
        return OC.adam_kernels(decoupled=decoupled, weight_decay=group["weight_decay"],
                               fused=fused, foreach=foreach, amsgrad=group["amsgrad"],
                               maximize=group["maximize"])
    if kind is torch.optim.SGD:
        first = opt.state.get(p, {}).get("momentum_buffer") is None
        return OC.sgd_kernels(momentum=group["momentum"], weight_decay=group["weight_decay"],
                              nesterov=group["nesterov"], fused=fused, foreach=foreach,
                              first_step=first, maximize=group["maximize"])
    return None


def _pre(opt, args, kwargs) -> None:
    """Before the step (the state tells a first step): what each mesh's ranks will run."""
    _PENDING.pop(id(opt), None)
    tr = current_trace()
    if tr is None or _OFF.get() or _delegates(opt):
        return
    work: dict = {}             # (mesh ranks, kernel name, dtype) -> [bytes, launches]
    unknown = False
    for group in opt.param_groups:
        for p in group["params"]:
            held = getattr(p, _TAG, None)
            if held is None or p.grad is None:      # not simulated ranks' / not stepped
                continue
            ranks, lead = held
            k = _kernels(opt, group, p)
            if k is None:
                unknown = True
                continue
            local = math.prod(p.shape[lead:])               # what each rank holds
            w = work.setdefault((ranks, k.name, p.dtype), [0, 0, set()])
            w[0] += k.accesses * local * p.element_size()
            # torch runs the foreach / fused kernels once per param group and (device,
            # dtype) (_group_tensors_by_device_and_dtype), a for-loop's per parameter
            if k.per_tensor or id(group) not in w[2]:
                w[1] += k.launches
                w[2].add(id(group))
            w[1] += k.launches_each
    if unknown:
        tr.note(f"{type(opt).__name__}.step() not on the modeled clock: the bytes of "
                        f"its kernels are not modeled (priced: "
                        f"{', '.join(c.__name__ for c in PRICED[:3])}, wb.ops.AdamW)")
    _PENDING[id(opt)] = [(ranks, b, n, dt, name)
                         for (ranks, name, dt), (b, n, _) in work.items()]


def _post(opt, args, kwargs) -> None:
    work = _PENDING.pop(id(opt), None)
    tr = current_trace()
    if not work or tr is None:
        return
    for ranks, nbytes, launches, dtype, name in work:
        t = OC.step_seconds(nbytes, launches, tr.profile, dtype)
        tr.record_compute(ranks, "optimizer_step", t, bytes=nbytes,
                          label=f"{name} step", args={"phase": "optimizer",
                                                     "op_class": "elementwise"})


register_optimizer_step_pre_hook(_pre)
register_optimizer_step_post_hook(_post)
