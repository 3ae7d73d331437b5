"""The values a compiled program is called with and gives back: the mesh a call's tensors
live on, what an argument must share with the example's (its signature), the module's
parameters by name and the mesh dims each is replicated along, and a result's
DistTensors as global tensors."""
from __future__ import annotations

import torch

from ..parallel.dist_tensor import DistTensor
from .graph import same_tuple
from .guards import snapshot


def _mesh_of(args, module):
    from .capture import nested_tensors
    for a in nested_tensors(list(args)):
        if isinstance(a, DistTensor):
            return a.mesh
    if module is not None:
        for m in module.modules():
            for p in m._parameters.values():
                if isinstance(p, DistTensor):
                    return p.mesh
    return None


def _signature(a):
    """What a call's argument must share with the example's: a tensor's shape, dtype,
    placements and mesh; a Python value, a container or an object by its
    :func:`~.guards.snapshot` (the graph holds what capture read from it: 2, not 2.0;
    ``cfg.scale``; a tensor inside one by its identity, a constant of the graph)."""
    if isinstance(a, (torch.Tensor, DistTensor)):
        mesh = getattr(a, "mesh", None)
        return (tuple(a.shape), a.dtype, tuple(getattr(a, "placements", ())),
                None if mesh is None else (tuple(mesh.dim_names), tuple(mesh.shape),
                                           tuple(mesh.ranks)))
    return snapshot(a)


def _named_parameters(module) -> dict:
    """{name: parameter} of the module's parameters now (a tied one under its first name;
    ``None`` entries, a ``bias=False`` linear's, left out)."""
    named = {}
    for mname, mod in module.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None:
                named.setdefault(f"{mname}.{pname}" if mname else pname, p)
    return named


def replica_dims(module, graph, mesh) -> dict:
    """{param vid: the mesh dims it is replicated along and held once per rank} (a
    data-parallel optimizer's replicas, ``DataParallel``; a sequence-parallel norm's
    copies, ``sequence_parallel_norms``; on torch.distributed ``_wb_replica_axes``): each
    rank's gradient stays its own there, and the optimizer reduces it once per step."""
    named = _named_parameters(module)
    out = {}
    for name, vid in graph.params.items():
        p = named.get(name)
        if not isinstance(p, DistTensor) or p.mesh != mesh:
            continue
        loc = p._local
        dims = set(getattr(loc, "_wb_replica_axes", ()))
        if isinstance(loc, torch.Tensor) and loc.dim() >= mesh.ndim:
            dims |= {i for i, n in enumerate(mesh.shape)
                     if n > 1 and loc.shape[i] == n and p.placements[i].is_replicate()}
        if dims:
            out[vid] = tuple(sorted(dims))
    return out


def _fulls(tree):
    """``tree`` with each DistTensor as its global tensor (``.full()``: autograd flows)."""
    if isinstance(tree, DistTensor):
        return tree.full()
    if isinstance(tree, tuple):
        return same_tuple(tree, [_fulls(x) for x in tree])
    if isinstance(tree, list):
        return [_fulls(x) for x in tree]
    if isinstance(tree, dict):
        return {k: _fulls(x) for k, x in tree.items()}
    return tree
