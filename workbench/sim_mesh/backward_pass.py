"""The two passes of a split backward, as the modeled clock sees them.

A zero-bubble pipeline schedule (ZB-H1, ZB-V, DualPipe: Qi et al. 2023, "Zero Bubble
Pipeline Parallelism", arXiv 2401.10241) splits a stage's backward into ``B`` (the
input gradient, which the previous stage waits for) and ``W`` (the weight gradients,
deferred to fill bubbles).  The simulator's ``W`` walks the stage's autograd graph a
second time (``torch.autograd.backward(..., inputs=weights)``), so every backward event
node on the way (an op's backward kernels, a backward collective) runs again.  The
work it really adds is only the weight-gradient GEMMs that ``B`` left out (Qi et al.
sec. 2: B + W is one backward), so inside :func:`weight_pass` an event node that was
already recorded (by ``B``) records nothing more; each recorder keeps its own "done"
mark (``ops_table.pricing``'s op kernels, ``collectives``' backward communication).
"""
from __future__ import annotations

import contextlib

__all__ = ["weight_pass", "in_weight_pass", "micro_batch", "recorded_by_b", "mark_recorded"]

_W: list = [False]
_MB: list = [None]          # the micro-batch whose B or W runs (pipeline executors)


@contextlib.contextmanager
def weight_pass():
    """The ``W`` of a split backward runs inside: backward events ``B`` recorded
    already are not recorded again (module docstring)."""
    _W.append(True)
    try:
        yield
    finally:
        _W.pop()


def in_weight_pass() -> bool:
    """True inside :func:`weight_pass`."""
    return _W[-1]


@contextlib.contextmanager
def micro_batch(key):
    """The ``B`` or ``W`` of micro-batch ``key`` runs inside (the pipeline executors'
    ``backward_action``): a node several micro-batches share (an input's gradient way,
    made in the first forward that reads it: ``reshard_backward._source``) is recorded
    once per micro-batch, as it runs (:func:`recorded_by_b`)."""
    _MB.append(key)
    try:
        yield
    finally:
        _MB.pop()


def mark_recorded(ctx) -> None:
    """Note on a backward node's ``ctx`` that it recorded its events in this pass."""
    ctx.recorded = True
    ctx.recorded_in = _MB[-1]


def recorded_by_b(ctx) -> bool:
    """True inside :func:`weight_pass` where this micro-batch's ``B`` recorded the node
    already (:func:`mark_recorded`): ``W`` walking ``B``'s graph again.  A node made in
    an earlier micro-batch's forward and recorded there records again: its gradient
    passes (and is reduced, on torch.distributed) in every micro-batch's backward."""
    return in_weight_pass() and getattr(ctx, "recorded", False) and \
        getattr(ctx, "recorded_in", None) == _MB[-1]
