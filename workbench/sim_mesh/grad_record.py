"""Recording a gradient's communication as one redistribution, not collective by collective.

Each collective attaches its backward event to its output (``collectives._on_backward``):
the conjugate collective, recorded when the gradient passes.  Where several of them meet
on one tensor (a reshard's all-gather whose output the next op expands, or slices again)
their conjugates, recorded one by one, are not what the gradient's redistribution moves
(an all-reduce then a local slice, where one reduce-scatter does).  A caller that knows
the redistribution silences the per-collective events along some mesh dims while it builds
the forward (:class:`mute_backward`) and records the redistribution's steps itself, once
(:func:`on_backward_steps`).  See ``workbench.parallel.reshard_backward``.
"""
from __future__ import annotations

import torch

from .backward_pass import mark_recorded, recorded_by_b

__all__ = ["mute_backward", "muted", "on_backward_steps"]

MUTED: list = []            # (mesh, frozenset of mesh axes), innermost last


class mute_backward:
    """Inside, no backward event is attached along ``axes`` of ``mesh``."""

    def __init__(self, mesh, axes):
        self.item = (mesh, frozenset(axes))

    def __enter__(self):
        MUTED.append(self.item)
        return self

    def __exit__(self, *exc):
        MUTED.remove(self.item)


def muted(mesh, axis) -> bool:
    for m, axes in MUTED:
        if axis in axes and (m is mesh or m == mesh):
            return True
    return False


def _record(steps) -> None:
    """Each step ``(kind, mesh, axis, buffer bytes, label)``, or with a 6th element, the
    keyword arguments of :func:`.collectives.record_collective` (``groups``, ``sent``: one
    group's busiest rank where the pieces are uneven), recorded in order."""
    from .collectives import record_collective
    for st in steps:
        record_collective(*st[:5], **(st[5] if len(st) > 5 else {}))


class _BackwardSteps(torch.autograd.Function):
    """Identity whose backward records several collectives, in order (``steps``, or what
    ``steps()`` returns when the gradient passes)."""

    @staticmethod
    def forward(ctx, steps, x):
        ctx.steps = steps
        # no gradient (None) stays None, as through torch's own view (materialized as
        # zeros: a replicated b's grad after vector_norm(a @ b, 0) was zeros, torch's None)
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None            # nothing flows back: no collective runs
        if recorded_by_b(ctx):
            return None, g               # a split backward's W walking B's graph again
        mark_recorded(ctx)               # (per micro-batch: a way's node is shared)
        steps = ctx.steps() if callable(ctx.steps) else ctx.steps
        _record(steps)
        return None, g


class _BackwardStepsCells(torch.autograd.Function):
    """:class:`_BackwardSteps` over the cells of uneven shards: one node, so the steps are
    recorded once when the cells' gradients pass together (not once per cell)."""

    @staticmethod
    def forward(ctx, steps, *xs):
        ctx.steps = steps
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        if all(g is None for g in gs):
            return (None,) * (1 + len(gs))
        if not recorded_by_b(ctx):
            mark_recorded(ctx)
            steps = ctx.steps() if callable(ctx.steps) else ctx.steps
            _record(steps)
        return (None,) + gs


def on_backward_steps(x, steps):
    """``x`` (a stacked tensor, or the ``Cells`` of uneven shards) through an identity
    whose backward records ``steps``, each ``(kind, mesh, axis, buffer bytes, label)`` (and
    ``record_collective``'s keywords where uneven: :func:`_record`), or
    the steps a callable ``steps`` returns then (what the gradient's users asked for
    meanwhile); ``x`` itself where no gradient passes."""
    if not steps or not torch.is_grad_enabled():
        return x
    steps = steps if callable(steps) else tuple(steps)
    if not isinstance(x, torch.Tensor):                 # Cells: one node for them all
        from .grid import Cells
        idx = [i for i, t in enumerate(x.items) if t.requires_grad]
        if not idx:
            return x
        outs = _BackwardStepsCells.apply(steps, *[x.items[i] for i in idx])
        items = list(x.items)
        for i, o in zip(idx, outs):
            items[i] = o
        return Cells(x.lead, items)
    if not x.requires_grad:
        return x
    return _BackwardSteps.apply(steps, x)
