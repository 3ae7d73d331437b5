"""Integer partial sums (or averages) that meet an op whose output has another dtype.

The dispatcher reduces every partial sum of such an op's inputs before it decides: the
parts of an integer sum widened part by part are not the sum's (uint8 parts 255 + 2 hold
1), ``dispatch._int_summed`` / ``_partials_reduced``.  It looks at the inputs as they
reach it.  The compiled program hands them laid out beforehand (``lower.py``), so:

* greedy (O0, eager's own choice) reduces them first too, and decides on the reduced
  layouts (:func:`reduced_first`; lowered as a reshard of its own);
* an integer input an op's strategy takes partial (eager lays it out inside the op) is
  handed to the op as it is (:func:`laid_inside`): laid out before, it would reach the
  dispatcher partial and be reduced first;
* the whole-graph search passes over candidates that take an integer input partial into
  such an op (:func:`int_safe`): the dispatcher does not offer them at run time.
"""
from __future__ import annotations

import torch

from ..parallel.dispatch import _int_summed, unsafe_number
from ..parallel.placement import Replicate

__all__ = ["reduced_first", "laid_inside", "int_safe", "scaled_first"]


def reduced_first(pr, n, in_ps):
    """``in_ps`` with every Partial sum / avg reduced, where the dispatcher would reduce
    them before ``n`` (an integer partial sum meets an output of another dtype:
    ``dispatch._int_summed``); None where it would not."""
    if not any(ps is not None and any(p.is_partial() for p in ps) for ps in in_ps):
        return None
    specs = [None if vid is None else pr.spec(vid, ps) for vid, ps in zip(n.inputs, in_ps)]
    if not _int_summed(specs, [pr.run_dtype(o) for o in n.outs]) and \
            not scaled_first(pr, n, in_ps):
        return None
    return tuple(None if ps is None else tuple(
        Replicate() if p.is_partial() and p.reduce_op in ("sum", "avg") else p for p in ps)
        for ps in in_ps)


def int_safe(n, dec, per_op, pr) -> list:
    """The first ``per_op`` candidates that take no integer partial sum (or average)
    partial into an op whose output has another dtype: the dispatcher reduces such an
    input before it decides (``dispatch._int_summed``: the parts of an integer sum
    widened part by part are not the sum's), so a candidate that keeps it is not among
    those it offers at run time (wide probe seed 173: an int64 P(sum) stacked with a
    float64 at O1 raised in ``lower._pick``).  Such a candidate is passed over; where none
    is left, the candidates as they are (the run then says so)."""
    outs = [pr.run_dtype(o) for o in n.outs]
    head = dec.candidates[:per_op]
    ints = any(vid is not None and not pr.g.values[vid].dtype.is_floating_point
               for vid in n.inputs)
    scaled = _unsafe_numbers(n)
    if not ints and not scaled:
        return head

    def safe(c):
        if scaled and scaled_first(pr, n, c.strategy.inputs):
            return False
        return not ints or not _int_summed([None if vid is None or req is None else
                                            pr.spec(vid, tuple(req))
                                            for vid, req in zip(n.inputs, c.strategy.inputs)],
                                           outs)
    ok = [c for c in head if safe(c)]
    if len(ok) == len(head):
        return head
    return (ok + [c for c in dec.candidates[per_op:] if safe(c)])[:per_op] or head


def laid_inside(graph, n, vid, req) -> bool:
    """An integer input the op's strategy takes as a partial sum (or average) into an
    output of another dtype: laid out so by the dispatcher inside the op, as eager's call
    does it (a partial integer handed to it is reduced first, ``dispatch._int_summed``,
    which eager's call, given it replicated, never does: wide probe seed 189, two
    all-reduces more at O0)."""
    v = graph.values[vid]
    if v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool or \
            not any(p.is_partial() and p.reduce_op in ("sum", "avg") for p in req):
        return False
    return any(graph.values[o].dtype != v.dtype for o in n.outs)


def _unsafe_numbers(n) -> list:
    """The positions of ``n``'s Python numbers (constants of the graph: the same at every
    call) by which a partial sum may not be scaled part by part (``dispatch.unsafe_number``:
    inf or nan, a divisor 0, a factor 0 beside a floating partial sum)."""
    if n.op not in ("mul", "div") or not n.in_consts:
        return []
    return [k for k, c in enumerate(n.in_consts) if c is not None and
            not isinstance(c, torch.Tensor) and unsafe_number(n.op, k, c, [True])]


def scaled_first(pr, n, in_ps) -> bool:
    """``n`` is a mul / div of a partial sum (or average) in ``in_ps`` by a Python number
    the dispatcher does not scale it by part by part (``dispatch._unsafe_scale``: it
    reduces the partial sum first, then decides).  A number of the graph is known when the
    program is compiled, so the plan reduces it first too (:func:`reduced_first`; the search
    passes over candidates that keep it, :func:`int_safe`) and the step prices that
    all-reduce, where it was left to the values at run time (``x * 0.0`` of a P(sum) x:
    the run's all-reduce, not in ``prog.step()``, compile18).  A number read from a tensor
    (a 0-d tensor input or constant) is not known: ``prog.data_dependent`` names it."""
    ks = _unsafe_numbers(n)
    if not ks:
        return False
    summed = [vid for vid, ps in zip(n.inputs, in_ps) if vid is not None and ps is not None
              and any(p.is_partial() and p.reduce_op in ("sum", "avg") for p in ps)]
    if not summed:
        return False
    floating = [any(pr.run_dtype(v).is_floating_point or pr.run_dtype(v).is_complex
                    for v in summed)]
    return any(unsafe_number(n.op, k, n.in_consts[k], floating) for k in ks)
