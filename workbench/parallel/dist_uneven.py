"""Uneven shards on torch.distributed: each group member's piece, from the layout.

A process holds only its own shard, so it cannot see how long the other members' shards
are; the layout says (``torch.chunk`` sizes, nested left to right as DTensor nests them:
``layout._bounds``).  The padded collectives (:mod:`workbench.sim_mesh.padded`) take
these lengths.  None where every member's piece has the same length (the even
collectives run, nothing to pad).
"""
from __future__ import annotations

import torch

from . import layout
from .placement import Replicate

__all__ = ["pieces", "step_sizes", "step_kwargs"]


def pieces(shape, mesh, placements, axis: int, dim: int, coord) -> tuple:
    """The lengths along tensor ``dim`` of the shards of the group through ``coord``
    along mesh dim ``axis`` (laid out by ``placements``), in group order.  Raises where
    they are not consecutive pieces of the block the group shares (a later mesh dim
    sharding the same tensor dim), which the padded collectives cannot cut."""
    shape, ps, coord = tuple(shape), tuple(placements), tuple(coord)
    whole = ps[:axis] + (Replicate(),) + ps[axis + 1:]
    start, size = layout._bounds(shape, mesh.shape, whole, coord)[dim]
    out = []
    for k in range(mesh.shape[axis]):
        c = coord[:axis] + (k,) + coord[axis + 1:]
        s, n = layout._bounds(shape, mesh.shape, ps, c)[dim]
        if s != start + sum(out):
            raise NotImplementedError(
                f"uneven shards of dim {dim} (shape {shape}, {[str(p) for p in ps]}) over "
                f"torch.distributed: the pieces along mesh dim {mesh.dim_names[axis]!r} are "
                "not consecutive; pad the tensor so every mesh dim divides it")
        out.append(n)
    if sum(out) != size:
        raise NotImplementedError(f"uneven shards of dim {dim} (shape {shape}): the pieces "
                                  "along one mesh dim do not cover the group's block; pad "
                                  "the tensor so every mesh dim divides it")
    return tuple(out)


def step_sizes(kind: str, shape, mesh, src, dst, axis: int, coord):
    """The ``sizes`` argument of collective ``kind`` from layout ``src`` to ``dst`` on mesh
    dim ``axis`` (None where the pieces are even)."""
    old, new = src[axis], dst[axis]
    if kind == "all_gather":
        s = pieces(shape, mesh, src, axis, old.dim, coord)
    elif kind == "reduce_scatter":
        s = pieces(shape, mesh, dst, axis, new.dim, coord)
    elif kind == "all_to_all":
        split = pieces(shape, mesh, dst, axis, new.dim, coord)
        concat = pieces(shape, mesh, src, axis, old.dim, coord)
        return None if len(set(split)) <= 1 and len(set(concat)) <= 1 else (split, concat)
    else:
        return None
    return None if len(set(s)) <= 1 else s


def step_kwargs(kind: str, shape, dtype, mesh, src, dst, axis: int, coord) -> dict:
    """The keyword arguments of collective ``kind`` (``collectives.all_gather`` ...) from
    layout ``src`` to ``dst`` on mesh dim ``axis``: ``sizes`` (the members' pieces, not
    for an all-reduce) and ``nbytes``, the buffer the simulator records, the largest
    rank's anywhere on the mesh (the gathered output for an all-gather, else the input;
    ``grid`` rank_bytes of cells), and for an all-to-all ``grad_nbytes``, its backward's
    (the output's).  Given ``nbytes``, an all-to-all records its group's busiest rank
    (``collectives.all_to_all``), as the simulator does on cells."""
    buf = dst if kind == "all_gather" else src
    elem = torch.empty((), dtype=dtype).element_size()
    out = {"nbytes": layout.local_numel_max(tuple(shape), mesh, buf) * elem}
    if kind == "all_to_all":
        out["grad_nbytes"] = layout.local_numel_max(tuple(shape), mesh, dst) * elem
    if kind != "all_reduce":
        out["sizes"] = step_sizes(kind, shape, mesh, src, dst, axis, coord)
    return out
