"""Meta stand-ins: a tensor's (its shape and dtype, no data), and a module's parameters and
buffers swapped for meta twins while capture runs it, put back after."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..parallel.dist_tensor import DistTensor


def _meta_like(x, requires_grad=None):
    rg = x.requires_grad if requires_grad is None else requires_grad
    t = torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    return t.requires_grad_(bool(rg) and x.dtype.is_floating_point)


@contextlib.contextmanager
def meta_twins(module):
    """Swap every parameter of ``module`` for a meta twin (tied ones share one twin);
    yields [(full name, original, twin, first name of this twin?)]; puts the originals
    back after, whatever happens inside."""
    saved, twins, rows, back = [], {}, [], {}
    try:
        for mname, mod in module.named_modules(remove_duplicate=False):
            for pname, p in list(mod._parameters.items()):
                if p is None:
                    continue
                # (a module met twice, registered under two names: its slot already
                # holds the twin; it is recorded and put back once, with the original)
                p = back.get(id(p), p)
                if mod._parameters[pname] is p:
                    saved.append((mod, pname, p))
                tw = twins.get(id(p))
                first = tw is None
                if first:
                    tw = twins[id(p)] = nn.Parameter(
                        _meta_like(p, p.requires_grad),
                        requires_grad=bool(p.requires_grad) and p.dtype.is_floating_point)
                    back[id(tw)] = p
                rows.append((f"{mname}.{pname}" if mname else pname, p, tw, first))
                mod._parameters[pname] = tw
        yield rows
    finally:
        for mod, pname, p in saved:
            mod._parameters[pname] = p


@contextlib.contextmanager
def meta_buffers(module):
    """Swap every buffer of ``module`` for a meta twin (a buffer registered twice shares
    one twin), as :func:`meta_twins` does the parameters: ``torch.export`` runs the program
    on fake tensors of the twins' device, and a CPU buffer beside meta parameters fails it
    (FakeTensorDeviceMismatchError).  A plain tensor attribute (``self.scale = t``, not
    registered) is swapped too: export lifts it as a constant of the graph, as it does a
    buffer (torch.export's ``InputKind.CONSTANT_TENSOR``).  Yields {full name: original}
    (every name); puts the originals back after, whatever happens inside."""
    saved, twins, back, originals = [], {}, {}, {}

    def swap(where, name, full):
        t = back.get(id(where[name]), where[name])   # (a module met twice: twinned once)
        tw = twins.get(id(t))
        if tw is None:
            tw = twins[id(t)] = _meta_like(t, False)
            back[id(tw)] = t
        if where[name] is t:
            saved.append((where, name, t))
            where[name] = tw
        originals[full] = t
    try:
        for mname, mod in module.named_modules(remove_duplicate=False):
            for bname, b in list(mod._buffers.items()):
                if b is not None:
                    swap(mod._buffers, bname, f"{mname}.{bname}" if mname else bname)
            for aname, t in list(vars(mod).items()):
                if type(t) is torch.Tensor and (not t.is_meta or id(t) in back):
                    swap(mod.__dict__, aname, f"{mname}.{aname}" if mname else aname)
        yield originals
    finally:
        for where, name, t in saved:
            where[name] = t


@contextlib.contextmanager
def _meta_parameters(module, graph, tracer, placements):
    """:func:`meta_twins`, each twin registered as a parameter value of ``graph`` and
    tracked by ``tracer``."""
    with meta_twins(module) as rows:
        for full, p, tw, first in rows:
            if not first:
                continue
            vid = graph.value(p.shape, p.dtype, "param", full, requires_grad=tw.requires_grad)
            graph.params[full] = vid
            tracer.track(tw, vid)
            if isinstance(p, DistTensor):
                placements[vid] = (p.mesh, tuple(p.placements))
            else:
                placements[vid] = p      # a plain parameter: replicated
        yield
