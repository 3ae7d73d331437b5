"""The layout side of a custom ``torch.autograd.Function`` on DistTensors
(:mod:`.custom_function`): DistTensors to the local tensors autograd sees and back, and
each gradient laid out as autograd needs it.

* an output's local gradients become a DistTensor laid out as its ``.grad`` would be: a
  ``Partial("sum")`` output's parts all get the whole gradient (one copy kept,
  Replicate); other Partials' and per-rank replicas' gradients are shares (Partial sum);
* the gradient the user's backward returns for an input is resharded (traced) to the
  input's layout: Shard as the input, Replicate where the input is replicated or Partial
  (each part of a sum gets the whole gradient, of an average 1/n of it), Partial sum
  along per-rank replicas (their gradients are shares), then held in the input's form.
"""
from __future__ import annotations

import torch

from . import storage
from .dist_tensor import DistTensor, shard_tensor
from .placement import Partial, Replicate
from .reshard import reshard

__all__ = ["flatten", "unflatten", "output_grad", "input_grad"]

_SUM = Partial("sum")

def _tmpl(x: DistTensor):
    """What rebuilds ``x`` from its local tensors (no tensor is kept)."""
    loc = x._local
    lead = loc.lead if storage.is_cells(loc) else None
    ts = storage.tensors(loc)
    nd = x.mesh.ndim
    leads = lead if lead is not None else tuple(ts[0].shape[:nd])
    return (x.mesh, x.placements, x.shape, x.dtype, x.names, lead, leads,
            tuple(t.shape for t in ts), len(ts))


def _build(tm, ts) -> DistTensor:
    mesh, ps, shape, dtype, names, lead, _, _, _ = tm
    loc = storage.Cells(lead, list(ts)) if lead is not None else ts[0]
    return DistTensor(loc, mesh, ps, shape, dtype, names)


def flatten(items):
    """Tensors behind ``items`` (DistTensors' local tensors, plain tensors as they are)
    and the tree that rebuilds them."""
    flat, tree = [], []
    for x in items:
        if isinstance(x, DistTensor):
            ts = storage.tensors(x._local)
            tree.append(("d", _tmpl(x), len(flat), len(ts)))
            flat += ts
        elif isinstance(x, torch.Tensor):
            tree.append(("t", None, len(flat), 1))
            flat.append(x)
        else:
            tree.append(("o", x, None, 0))
    return flat, tree


def unflatten(tree, flat) -> tuple:
    out = []
    for kind, tm, k, n in tree:
        if kind == "d":
            out.append(_build(tm, flat[k:k + n]))
        elif kind == "t":
            out.append(flat[k])
        else:
            out.append(tm)
    return tuple(out)


def _first_along(loc, axes, nd):
    """``loc`` keeping the first copy along each of ``axes`` (size 1 there)."""
    for i in axes:
        if storage.is_cells(loc):
            if loc.lead[i] > 1:
                src = loc
                loc = src.with_axis(i, 1, lambda c: src[c])
        elif loc.shape[i] > 1:
            loc = loc.narrow(i, 0, 1)
    return loc


def _grow_along(loc, axes, ns):
    """``loc`` with its size-1 ``axes`` repeated to ``ns`` (every rank the same tensor)."""
    for i, n in zip(axes, ns):
        if storage.is_cells(loc):
            if loc.lead[i] != n:
                src = loc
                loc = src.with_axis(i, n, lambda c: src[c])
        elif loc.shape[i] != n:
            shape = list(loc.shape)
            shape[i] = n
            loc = loc.expand(shape)
    return loc


def output_grad(tm, gs, materialize):
    """The gradient of one DistTensor output, from the bridge's local gradients: laid out
    as ``.grad`` is (a Partial sum's parts all get the whole gradient: one copy kept,
    Replicate; other Partials' and per-rank replicas' gradients are shares: Partial sum)."""
    mesh, ps, shape, dtype, names, lead, leads, shapes, _ = tm
    if all(g is None for g in gs):
        if not materialize:
            return None
    gs = [torch.zeros(s, dtype=dtype, device=_device(gs)) if g is None else g
          for g, s in zip(gs, shapes)]
    loc = storage.Cells(lead, gs) if lead is not None else gs[0]
    gps, first = [], []
    for i, p in enumerate(ps):
        if p.is_partial():
            if p.reduce_op == "sum":
                gps.append(Replicate())
                first.append(i)
            else:
                gps.append(_SUM)
        elif p.is_replicate() and leads[i] > 1:
            gps.append(_SUM)
        else:
            gps.append(p)
    loc = _first_along(loc, first, mesh.ndim)
    return DistTensor(loc, mesh, gps, shape, dtype)


def _device(gs):
    for g in gs:
        if g is not None:
            return g.device
    return None


def _expandable(shape, to) -> bool:
    """Whether ``shape`` broadcasts to ``to`` (torch's ``is_expandable_to``)."""
    if len(shape) > len(to):
        return False
    return all(s == t or s == 1 for s, t in zip(shape[::-1], to[::-1]))


def _sum_to(g, shape):
    """A gradient of the shape its input broadcasts to, summed to the input's shape, as
    torch's engine does (``validate_outputs``: ``sum_to``): leading dims away, size-1 dims
    kept."""
    lead = g.dim() - len(shape)
    if lead:
        g = g.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, (s, t) in enumerate(zip(shape, g.shape)) if s == 1 and t != 1)
    return g.sum(dim=dims, keepdim=True) if dims else g


def input_grad(cls, k, tm, g):
    """The local gradients of one DistTensor input from the gradient ``g`` the user's
    backward returned for it (a DistTensor or a tensor of the global shape)."""
    mesh, ps, shape, dtype, names, lead, leads, shapes, n = tm
    if g is None:
        return [None] * n
    if not isinstance(g, (DistTensor, torch.Tensor)):
        raise TypeError(f"function {cls.__name__}Backward returned a {type(g).__name__} as "
                        f"the gradient at index {k}; expected a DistTensor, a tensor or None")
    if tuple(g.shape) != tuple(shape):
        if not _expandable(tuple(shape), tuple(g.shape)):
            raise RuntimeError(f"Function {cls.__name__}Backward returned an invalid gradient "
                               f"at index {k} - got {list(g.shape)} but expected shape "
                               f"compatible with {list(shape)}")
        g = _sum_to(g, tuple(shape))
    holds_own = storage.holds_own(mesh)
    target = []
    for i, p in enumerate(ps):
        if p.is_shard():
            target.append(p)
        elif p.is_replicate() and leads[i] > 1 and not holds_own:
            target.append(_SUM)          # per-rank replicas: their gradients are shares
        else:
            target.append(Replicate())   # a Partial's parts each get the whole gradient
    target = tuple(target)
    if isinstance(g, DistTensor):
        if g.mesh != mesh:
            raise ValueError(f"function {cls.__name__}Backward returned a gradient at index "
                             f"{k} on {g.mesh}, but the input lives on {mesh}; reshard it "
                             "onto the input's mesh")
        if g.dtype != dtype:
            g = g.to(dtype)
        if tuple(g.placements) != target:
            g = reshard(g, mesh, list(target))
    else:
        g = shard_tensor(g.to(dtype), mesh, list(target))
    loc = g._local
    partial = [i for i, p in enumerate(ps) if p.is_partial()]
    loc = _first_along(loc, [i for i, p in enumerate(target) if p.is_replicate()
                             and i not in partial], mesh.ndim)
    if partial and not holds_own:
        loc = _grow_along(loc, partial, [leads[i] for i in partial])
    if lead is not None and not storage.is_cells(loc):
        loc = storage.to_cells(loc, mesh.ndim)
    elif lead is None and storage.is_cells(loc):
        loc = storage.to_stacked(loc)
    ts = storage.tensors(loc)
    for i, p in enumerate(ps):
        if p.is_partial() and p.reduce_op == "avg":       # each part is 1/n of the value
            ts = [t / mesh.shape[i] for t in ts]
    got = tuple(t.shape for t in ts)
    if got != shapes:       # pragma: no cover - a layout this module does not map
        raise NotImplementedError(
            f"{cls.__name__}.backward on DistTensors: the gradient at index {k} "
            f"({g.placements}) could not be laid out as its input's local tensors "
            f"({list(ps)}); reshard the input to Replicate before applying the Function")
    return ts
