"""Capture a program into a :class:`~.graph.Graph` of op-table calls, on meta tensors.

Two ways in, tried in this order (``method="auto"``):

* ``"export"``: ``torch.export.export`` (non-strict) of the function or module on meta
  inputs and meta parameters; its ATen graph is mapped onto the op table
  (:mod:`.export`; our fused ``wb.ops`` calls stay whole as custom operators,
  :mod:`.export_ops`).  Where an ATen op has no entry, capture goes on by tracing and
  says why in ``graph.notes``.
* ``"trace"``: run the program once on meta tensors under a ``TorchFunctionMode`` that
  records every call the op table answers to, at the level the table speaks (``F.linear``,
  ``wb.ops.rms_norm``), as ``torch.fx.symbolic_trace`` records torch calls, but with
  concrete shapes, so Python control flow on shapes works.

An in-place write into a value the program made (``v = x.clone(); v.mul_(2)``,
``v[0] = 1.5``) is recorded as the new value it gives (:mod:`.writes`, as torch's
functionalization does); a write a graph of values cannot hold (into an input, through a
view) is a break that says why.

No data moves: inputs and parameters are meta tensors of their global shapes.  Control
flow on tensor *values* (``if x.sum() > 0``) cannot be captured: it is a
:class:`~.graph.GraphBreak`, reported with its source line (export's own message, or the
frame that asked for the value); the caller then runs that program eagerly.

The parts live beside this module: the tracer (:mod:`.tracer`) and the calls it answers
itself (:mod:`.trace_calls`), meta stand-ins (:mod:`.capture_meta`), nested containers
(:mod:`.capture_trees`) and the errors (:mod:`.capture_errors`); their names used
elsewhere stay importable from here.
"""
from __future__ import annotations

import contextlib
import os
import traceback

import torch
from torch import nn

from ..parallel.dist_tensor import DistTensor
from ..parallel.ops_table import load as _load_ops
from .capture_errors import (Broken, CaptureError, _HERE, _TORCH, _user_frame,  # noqa: F401
                             break_from_export_error)
from .capture_meta import _meta_like, _meta_parameters, meta_buffers, meta_twins  # noqa: F401
from .capture_trees import _leaves, _swap, nested_tensors  # noqa: F401
from .graph import Graph, Ref
from .guards import state_writes
from .reads import autograd_reads, python_writes, rng_reseeds_refused
from .tracer import _Tracer

__all__ = ["capture", "CaptureError", "Broken", "break_from_export_error"]


def _registered(module):
    """``module`` and the modules registered under it (``_modules``), depth first."""
    yield module
    for child in module._modules.values():
        if child is not None:
            yield from _registered(child)

def capture(fn, args, method: str = "auto"):
    """(graph, placements of the inputs and parameters) of ``fn(*args)``.

    ``placements``: vid -> (mesh, placements) for DistTensor inputs and parameters, or
    the plain tensor for plain ones (replicated on the program's mesh).  Raises
    :class:`Broken` at a graph break, :class:`CaptureError` for an op without entry."""
    if method not in ("auto", "export", "trace"):
        raise ValueError(f"capture(method={method!r}): use 'auto', 'export' or 'trace'")
    _load_ops()
    if any(isinstance(a, (list, tuple, dict)) and nested_tensors(a) for a in args):
        raise CaptureError("a tensor inside a list, tuple or dict argument would be frozen "
                           "into the graph as a constant; pass each tensor as an argument of "
                           "its own (the program runs eagerly)")
    if isinstance(fn, nn.Module):
        # the registered tree itself (``_modules``), not ``modules()``: the data-parallel
        # wrappers answer ``modules()`` with the module they wrap, kept apart from them
        walked = {id(p) for m in _registered(fn) for p in m._parameters.values()
                  if p is not None}
        if any(id(p) not in walked for p in fn.parameters()):
            raise CaptureError(f"{type(fn).__name__}'s parameters are not registered on its "
                               "submodules (a wrapper such as DistributedDataParallel keeps "
                               "the module apart): capture would freeze them as constants "
                               "and no gradient would reach them; the program runs eagerly")
    # capture runs with gradients on, whatever the caller's mode (compile under no_grad
    # captures the program, not the mode): a no_grad block inside the program is then
    # its nodes' ``grad=False``, and the run calls them so (as eager does)
    from ..ops.moe import stats_sink
    with state_writes(fn) as writes, python_writes(fn) as globals_written, \
            autograd_reads() as (asked, watch), rng_reseeds_refused(_reseed_error), \
            torch.enable_grad(), _custom_functions_refused(), stats_sink() as layers:
        try:
            out = _capture(fn, args, method, watch)
        except Broken:
            if writes:                     # the write came first: name it
                raise _state_error(writes) from None
            raise
    if writes:
        raise _state_error(writes)
    if globals_written:
        raise CaptureError(f"the program writes Python state ({', '.join(globals_written[:3])}"
                           "): a captured graph would not repeat the write on each call; "
                           "it runs eagerly (the values are as they were before the "
                           "capture; return the new value instead, or keep such state "
                           "outside the compiled function)")
    out[0].autograd_reads |= set(asked)
    if layers:
        # a mixture-of-experts layer keeps its last routing (MoE.last_stats): the program
        # hands it its router_topk node's outputs on each call, one node per layer call
        routers = [n for n in out[0].nodes if n.op == "router_topk"]
        if len(routers) != len(layers):
            raise CaptureError(f"the program calls router_topk {len(routers)} times and "
                               f"MoE layers {len(layers)} times: which routing each layer "
                               "reports (last_stats) is not known; the program runs eagerly")
        out[0].stats_layers = list(layers)
    return out


@contextlib.contextmanager
def _custom_functions_refused():
    """While capture runs: a custom ``torch.autograd.Function`` applied to a traced tensor
    is refused (its ``backward`` is code capture cannot see: export inlines its forward and
    the graph's gradient is the forward's, 8 where the Function says 40; tracing records its
    forward under no_grad, so no gradient at all).  ``torch.utils.checkpoint``'s reentrant
    Function is one.  workbench's own Functions (``wb.ops``: the exact gradient, held to a
    reference by their tests) are the op table's business and pass, as does the autograd
    Function PyTorch generates for their custom operators under export (export_ops.py)."""
    base = torch.autograd.Function
    orig = base.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        ours = cls.__module__.startswith("workbench.") or \
            cls.__name__.startswith("GeneratedBackwardFor_workbench_")
        if not ours and any(
                isinstance(t, torch.Tensor) and t.device.type == "meta"
                for t in _leaves((args, kwargs), [])):
            f, line, code = _user_frame()
            raise CaptureError(f"the autograd.Function {cls.__qualname__} at {f}:{line} "
                               f"({code}) has its own backward, which a captured graph "
                               "cannot hold; the program runs eagerly (compile the code "
                               "around it, or register it in the op table)",
                               where=(f, line, code))
        if ours and torch.is_grad_enabled() and torch.overrides._is_torch_function_mode_enabled() \
                and any(isinstance(m, _Tracer)
                        for m in torch.overrides._get_current_function_mode_stack()) \
                and any(isinstance(t, torch.Tensor) and t.requires_grad
                        for t in _leaves((args, kwargs), [])):
            # workbench's own Function applied inside a composition the tracer follows
            # (var's _NoDof: no degrees of freedom): its forward would be recorded as
            # untracked ops and its backward lost (the output did not require grad where
            # eager's does: narrow probe seed 78); a table op records it whole instead
            f, line, code = _user_frame()
            raise CaptureError(f"the autograd.Function {cls.__qualname__} (workbench's own) at "
                               f"{f}:{line} ({code}) runs on the traced tensors outside an op "
                               "of the table: its backward would not be captured; the "
                               "program runs eagerly", where=(f, line, code))
        return orig.__func__(cls, *args, **kwargs)
    base.apply = classmethod(apply)
    try:
        yield
    finally:
        base.apply = orig


def _reseed_error(name):
    f, line, code = _user_frame()
    return CaptureError(f"torch.{name} at {f}:{line} ({code}) reseeds the random generator "
                        "inside the program: each eager call restarts its draws there, a "
                        "captured graph would draw on; the program runs eagerly (seed "
                        "outside the compiled function)", where=(f, line, code))


def _state_error(writes):
    return CaptureError(f"the forward sets module state ({', '.join(writes[:3])}): a "
                        "captured graph would not repeat the write on each call; the module "
                        "runs eagerly (keep such state outside forward, or return it)")


def _capture(fn, args, method, watch):
    notes = []
    if method in ("auto", "export"):
        from .export import capture_export, Unmapped
        try:
            return capture_export(fn, args, watch)
        except Unmapped as e:
            if method == "export":
                raise CaptureError(str(e)) from None
            notes.append(f"export: {e}; captured by tracing torch functions instead")
        from ..ops.moe import stats_layers
        if stats_layers() is not None:
            stats_layers().clear()         # (the export run's layer calls)
    graph, placements = _capture_trace(fn, args)
    graph.notes = notes + graph.notes
    return graph, placements


def _capture_trace(fn, args):
    g = Graph(method="trace")
    tracer = _Tracer(g)
    placements = {}
    margs = []
    for i, a in enumerate(args):
        if isinstance(a, (DistTensor, torch.Tensor)):
            rg = bool(getattr(a, "requires_grad", False))
            m = _meta_like(a, rg)
            vid = g.value(a.shape, a.dtype, "input", f"arg{i}", requires_grad=m.requires_grad)
            g.inputs.append(vid)
            tracer.track(m, vid)
            placements[vid] = (a.mesh, tuple(a.placements)) if isinstance(a, DistTensor) else a
            margs.append(m)
        else:
            margs.append(a)
    module = fn if isinstance(fn, nn.Module) else None
    ctx = _meta_parameters(module, g, tracer, placements) if module is not None \
        else contextlib.nullcontext()
    with ctx, tracer:
        try:
            out = fn(*margs)
        except (Broken, CaptureError):
            raise
        except Exception as e:    # noqa: BLE001 (code that needs real DistTensors or data)
            where = _user_frame(e.__traceback__)     # the user's line that raised
            if where[0] == "?":
                # workbench's own code raised (a model's or a recipe's hook reading a
                # DistTensor's placements): name its line rather than "?:0"
                inner = [fr for fr in traceback.extract_tb(e.__traceback__)
                         if not os.path.abspath(fr.filename).startswith(_TORCH)
                         and not os.path.abspath(fr.filename).startswith(_HERE)]
                if inner:
                    fr = inner[-1]
                    where = (fr.filename, fr.lineno or 0, (fr.line or "").strip())
            raise CaptureError(
                "capture runs the program on meta tensors of the global shapes (plain "
                f"tensors, no data) and it raised {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}",
                where=where if where[0] != "?" else None) from None
    # (a redistribute to another mesh: compile's mesh_trips, which knows the program's)
    missing = [t for t in _leaves(out, []) if id(t) not in tracer.ids]
    if missing:
        raise CaptureError("the program returns a tensor it did not compute from its inputs "
                           "(a constant); return it outside the compiled function")
    g.output = _swap(out, lambda t: Ref(tracer.ids[id(t)]))
    if any(n.op == "expert_parallel" for n in g.nodes):
        g.notes.append("expert_parallel: its all-to-alls and expert GEMMs depend on the "
                       "routing, so they are priced on the trace as they run, not in the "
                       "modeled step (ASSUMPTION: the plan's placements ignore them)")
    return g, placements
