"""Where each rank's shard lies in the global tensor (the runtime's offset function).

Shards follow ``torch.chunk`` sizes, as in PyTorch DTensor: 10 rows on 4 ranks
are 3, 3, 3, 1 (and 5 rows on 4 ranks are 2, 2, 1, 0).  A tensor dimension
sharded by several mesh dimensions is split left to right: first by the
leftmost mesh dimension, then each piece by the next one.

Everything here is computed from (shape, mesh, placements) alone, so the
visualizers can draw what has not been computed.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

from ..sim_mesh import grid as _grid
from ..sim_mesh.grid import chunk_bounds
from .placement import Placement, Shard

__all__ = ["chunk_bounds", "shard_bounds", "local_shape", "is_even", "stacked_shape",
           "max_local_shape", "local_numel_max", "all_to_all_sent"]


@lru_cache(maxsize=4096)
def _bounds(shape: tuple, mesh_shape: tuple, placements: tuple, coord: tuple):
    start = [0] * len(shape)
    size = list(shape)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim
            s, n = chunk_bounds(size[d], mesh_shape[i], coord[i])
            start[d] += s
            size[d] = n
    return tuple(zip(start, size))


def _placements(placements, mesh, ndim: int) -> tuple:
    """Placements as a tuple of Placement (short strings such as "S(0)" are parsed)."""
    if type(placements) is tuple:
        for p in placements:
            if not isinstance(p, Placement):
                break
        else:
            return placements
    if not isinstance(placements, str) and hasattr(placements, "__iter__"):
        ps = tuple(placements)
        if all(isinstance(p, Placement) for p in ps):
            return ps
    from .placement import normalize_placements
    return normalize_placements(placements, mesh, ndim)


def shard_bounds(shape: Sequence[int], mesh, placements: Sequence[Placement],
                 rank: int) -> tuple[tuple[int, int], ...]:
    """Per tensor dim, (start, size) of ``rank``'s shard in the global tensor."""
    placements = _placements(placements, mesh, len(shape))
    return _bounds(tuple(shape), mesh.shape, placements, mesh.coordinate(rank))


def local_shape(shape, mesh, placements, rank) -> tuple[int, ...]:
    return tuple(n for _, n in shard_bounds(shape, mesh, placements, rank))


@lru_cache(maxsize=4096)
def _is_even(shape: tuple, mesh_shape: tuple, placements: tuple) -> bool:
    split = [1] * len(shape)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            split[p.dim] *= mesh_shape[i]
    return all(n % s == 0 for n, s in zip(shape, split))


def is_even(shape, mesh, placements) -> bool:
    """True when every rank's shard has the same shape (the fast stacked layout)."""
    return _is_even(tuple(shape), mesh.shape, _placements(placements, mesh, len(shape)))


def max_local_shape(shape, mesh, placements) -> tuple[int, ...]:
    """The largest shard (rank 0's, since torch.chunk gives the first chunks the most)."""
    out = list(shape)
    for i, p in enumerate(_placements(placements, mesh, len(out))):
        if isinstance(p, Shard):
            out[p.dim] = -(-out[p.dim] // mesh.shape[i]) if out[p.dim] else 0
    return tuple(out)


def local_numel_max(shape, mesh, placements) -> int:
    return math.prod(max_local_shape(shape, mesh, placements))


@lru_cache(maxsize=4096)
def all_to_all_sent(shape: tuple, mesh_shape: tuple, src: tuple, axis: int, split_dim: int,
                    elem: int) -> tuple[int, int]:
    """(fewest, most) bytes one rank sends in the all-to-all on mesh dim ``axis`` that
    splits tensor dim ``split_dim`` of layout ``src`` (S(a) -> S(split_dim)): each rank
    cuts its shard along ``split_dim`` in as many torch.chunk pieces as the group has
    ranks, keeps its own and sends the others (``sim_mesh.grid.CellGrid.all_to_all``).
    Even layouts: both are (p-1)/p of the shard; uneven ones differ per rank (a shard
    of 4 rows on 3 ranks is cut 2, 2, 0: the third rank keeps none and sends all 4)."""
    p = mesh_shape[axis]
    sent = [_grid.rank_sent(tuple(n for _, n in _bounds(shape, mesh_shape, src, coord)),
                            split_dim, p, coord[axis], elem)
            for coord in _coords(mesh_shape)]
    return min(sent), max(sent)


def gather_sent(shape: tuple, mesh, pieces, axis: int, elem: int) -> int:
    """Bytes the busiest rank sends in the all-gather (or reduce-scatter) on mesh dim
    ``axis`` whose members' pieces are laid out by ``pieces`` (the all-gather's source
    layout, the reduce-scatter's target): (p-1) times the largest piece, padded as DTensor
    pads it (``sim_mesh.grid.gather_sent``, the rule the simulator and torch.distributed
    record).  75 rows of 64 f32 on 2 ranks: 38 x 256 = 9,728 B."""
    return _grid.gather_sent([0] * (mesh.shape[axis] - 1)
                             + [local_numel_max(shape, mesh, pieces)], elem)


def _coords(mesh_shape: tuple):
    out = [()]
    for n in mesh_shape:
        out = [c + (k,) for c in out for k in range(n)]
    return out


def stacked_shape(shape, mesh, placements) -> tuple[int, ...]:
    """Shape of the stacked local tensor of an even layout: one leading axis per
    mesh dim (size 1 where the tensor is replicated: copies are not stored),
    then the local shard's shape."""
    placements = _placements(placements, mesh, len(shape))
    lead = tuple(1 if p.is_replicate() else n for p, n in zip(placements, mesh.shape))
    return lead + max_local_shape(shape, mesh, placements)
