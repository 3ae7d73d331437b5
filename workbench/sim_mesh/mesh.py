"""The device mesh: an n-d array of device ranks with a name per dimension.

A mesh is the rank grid of picotron (``arange(world).view(dp, pp, tp)``) with
names: a process group is a slice of it along one dimension.

    >>> mesh = Mesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    >>> mesh.groups("tp")           # ranks that talk along "tp"
    [(0, 1), (2, 3)]
    >>> mesh["dp"]                  # the 1-d sub-mesh along "dp" holding rank 0
    Mesh([0, 2], dim_names=('dp',))

Meshes may be disjoint (pipeline stages live on different meshes); a mesh
knows nothing of tensors or placements.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Sequence

from .device_mesh_api import MeshSize, check_names, install, slice_by_names

__all__ = ["Mesh", "MAX_RANKS", "MAX_DIMS"]

MAX_DIMS = 64
"""The most dims :meth:`Mesh.grid` builds: its nested rank lists recurse once per dim
(5000 dims overflowed Python's stack), and past 17 dims of size >= 2 a mesh is over
:data:`MAX_RANKS` anyway, so only size-1 dims could add more."""

MAX_RANKS = 2 ** 17
"""The most ranks :meth:`Mesh.grid` builds: 131,072, eight times the 16,384 H100s of
Llama 3 405B's training (Meta, "The Llama 3 Herd of Models", 2024, sec. 3.3, Table 4)."""


def _flatten(nested) -> tuple[list[int], tuple[int, ...]]:
    """Flatten a nested list of ints into (flat list, shape); raise if ragged."""
    if isinstance(nested, int) and not isinstance(nested, bool):
        return [nested], ()
    if hasattr(nested, "tolist"):  # a tensor or numpy array
        nested = nested.tolist()
        if isinstance(nested, int):
            return [nested], ()
    if not isinstance(nested, (list, tuple)) or len(nested) == 0:
        raise ValueError(
            f"ranks={nested!r}: expected a non-empty nested list of ints, "
            "e.g. [[0, 1], [2, 3]]")
    parts = [_flatten(x) for x in nested]
    shapes = {s for _, s in parts}
    if len(shapes) != 1:
        raise ValueError(
            f"ranks={nested!r} is not rectangular: rows have shapes "
            f"{sorted(shapes)}; give every row the same length")
    flat = [r for f, _ in parts for r in f]
    return flat, (len(nested),) + parts[0][1]


class Mesh:
    """An n-d array of device ranks with dimension names.

    Args:
        ranks: a nested list (or tensor) of distinct non-negative ints.
        dim_names: one name per dimension; defaults to ``("d0", "d1", ...)``.
    """

    __slots__ = ("_ranks", "_shape", "_names", "_strides", "_index", "_hash", "_groups")

    def __init__(self, ranks, dim_names: Sequence[str] | None = None):
        flat, shape = _flatten(ranks)
        if shape == ():
            raise ValueError(f"ranks={ranks!r}: a mesh needs at least one dimension, "
                             f"e.g. [{ranks!r}]")
        for r in flat:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise ValueError(f"ranks contains {r!r}: ranks must be non-negative ints")
        if len(set(flat)) != len(flat):
            dup = sorted(r for r, n in Counter(flat).items() if n > 1)    # O(n), not O(n^2)
            raise ValueError(f"ranks repeat {dup}: each device may appear once in a mesh")
        if dim_names is None:
            dim_names = tuple(f"d{i}" for i in range(len(shape)))
        if isinstance(dim_names, str):
            dim_names = (dim_names,)
        if not isinstance(dim_names, (list, tuple)):
            raise TypeError(f"dim_names={dim_names!r}: expected a list of names, "
                            "e.g. ['dp', 'tp']")
        dim_names = tuple(dim_names)
        if len(dim_names) != len(shape):
            raise ValueError(
                f"dim_names={list(dim_names)} has {len(dim_names)} names for a "
                f"{len(shape)}-d mesh of shape {shape}; give one name per dimension")
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"dim_names={list(dim_names)} repeats a name; names must be distinct")
        for n in dim_names:
            if not isinstance(n, str) or not n:
                raise ValueError(f"dim_names contains {n!r}: names must be non-empty strings")
        self._ranks = tuple(flat)
        self._shape = shape
        self._names = dim_names
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= s
        self._strides = tuple(reversed(strides))
        self._index = {r: i for i, r in enumerate(flat)}
        self._hash = hash((self._ranks, self._shape, self._names))
        self._groups = {}           # dim -> its process groups (a mesh never changes)

    # ---- construction ----------------------------------------------------
    @classmethod
    def grid(cls, shape: Sequence[int] | int, dim_names: Sequence[str] | None = None,
             start: int = 0) -> "Mesh":
        """A mesh over ranks ``start .. start+prod(shape)-1`` in row-major order."""
        if isinstance(shape, int):
            shape = (shape,)
        if not isinstance(shape, (list, tuple)):
            raise TypeError(f"shape={shape!r}: expected an int or a list of ints, e.g. (2, 4)")
        shape = tuple(shape)
        if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s < 1
                            for s in shape):
            raise ValueError(f"shape={shape}: every mesh dimension must be a positive int")
        if len(shape) > MAX_DIMS:
            raise ValueError(f"Mesh.grid(shape=<{len(shape)} dims>): at most {MAX_DIMS} mesh "
                             "dims (the nested rank lists recurse once per dim: 5000 dims "
                             "overflowed Python's stack; 4-D parallelism uses dp, pp, cp, tp)")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"Mesh.grid(start={start!r}): the first rank must be an int >= 0")
        n = math.prod(shape)
        if n > MAX_RANKS:
            raise ValueError(
                f"Mesh.grid(shape={shape}): {n:,} ranks, over the limit of {MAX_RANKS:,}: a mesh "
                "keeps every rank in Python tables in this one process (2**20 ranks took 0.9 s "
                "and 0.4 GB to build here), and the largest published training runs use about "
                "16,384 devices (Llama 3 405B); give a smaller shape")
        flat = list(range(start, start + n))
        return cls(_nest(flat, shape), dim_names)

    # ---- basic facts -------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        """The number of ranks; also callable as DeviceMesh's ``size(mesh_dim=None)``."""
        return MeshSize(self)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank, in row-major (mesh) order."""
        return self._ranks

    @property
    def dim_names(self) -> tuple[str, ...]:
        return self._names

    def tolist(self):
        return _nest(list(self._ranks), self._shape)

    def dim(self, d: int | str) -> int:
        """The index of mesh dimension ``d`` given by name or (negative) index."""
        if isinstance(d, str):
            if d not in self._names:
                raise ValueError(f"mesh dim {d!r} not in dim_names {list(self._names)}")
            return self._names.index(d)
        if not isinstance(d, int) or isinstance(d, bool) or not -self.ndim <= d < self.ndim:
            raise ValueError(f"mesh dim {d!r} out of range for a {self.ndim}-d mesh: "
                             f"use an int in [{-self.ndim}, {self.ndim - 1}] or a name "
                             f"in {list(self._names)}")
        return d % self.ndim

    def index(self, rank: int) -> int:
        """Position of ``rank`` in row-major mesh order."""
        try:
            return self._index[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is not in this mesh (ranks {list(self._ranks)})") from None

    def __contains__(self, rank) -> bool:
        return rank in self._index

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of ``rank``, e.g. rank 3 of a 2x2 mesh is (1, 1)."""
        i = self.index(rank)
        return tuple((i // st) % s for st, s in zip(self._strides, self._shape))

    def rank_at(self, coord: Sequence[int]) -> int:
        coord = tuple(coord)
        if len(coord) != self.ndim or any(not isinstance(c, int) or isinstance(c, bool) or
                                          not 0 <= c < s for c, s in zip(coord, self._shape)):
            raise ValueError(f"coordinate {coord} out of range for mesh shape {self._shape}")
        return self._ranks[sum(c * st for c, st in zip(coord, self._strides))]

    # ---- process groups and sub-meshes ----------------------------------------
    def groups(self, d: int | str) -> list[tuple[int, ...]]:
        """All process groups along mesh dimension ``d`` (each a tuple of ranks)."""
        d = self.dim(d)
        try:
            known = self._groups.get(d)
        except AttributeError:          # a mesh unpickled from before the memo
            self._groups, known = {}, None
        if known is not None:
            return list(known)          # a new list each call: the caller may change it
        out = []
        for i, r in enumerate(self._ranks):
            if (i // self._strides[d]) % self._shape[d] == 0:
                out.append(tuple(self._ranks[i + k * self._strides[d]]
                                 for k in range(self._shape[d])))
        self._groups[d] = tuple(out)
        return out

    def group_of(self, rank: int, d: int | str) -> tuple[int, ...]:
        """The group along ``d`` that contains ``rank``."""
        for g in self.groups(d):
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is not in this mesh (ranks {list(self._ranks)})")

    def submesh(self, d: int | str, rank: int | None = None) -> "Mesh":
        """The 1-d mesh along ``d`` through ``rank`` (default: the first rank)."""
        d = self.dim(d)
        g = self.group_of(self._ranks[0] if rank is None else rank, d)
        return Mesh(list(g), dim_names=[self._names[d]])

    def __getitem__(self, key) -> "Mesh":
        """``mesh["tp"]``: 1-d sub-mesh along a named dim through the first rank (under
        torchrun: through this process's rank, as DeviceMesh's); ``mesh[0]`` /
        ``mesh[1:]``: index the first dimension like a nested list."""
        if isinstance(key, str):
            return slice_by_names(self, (key,))
        if isinstance(key, tuple):              # DeviceMesh's mesh["dp", "tp"]
            return slice_by_names(self, key)
        if isinstance(key, bool) or not isinstance(key, (int, slice)):
            raise TypeError(f"mesh[{key!r}]: index with a dim name, an int or a slice")
        if isinstance(key, int) and not -self._shape[0] <= key < self._shape[0]:
            # an IndexError (the indexing contract), with the range
            raise IndexError(f"mesh[{key}]: the first mesh dim "
                             f"{self._names[0]!r} has size {self._shape[0]}; use an index "
                             f"in [{-self._shape[0]}, {self._shape[0] - 1}]")
        nested = self.tolist()
        sub = nested[key]
        if isinstance(key, int):
            if self.ndim == 1:
                return Mesh([sub], dim_names=self._names)
            return Mesh(sub, dim_names=self._names[1:])
        if isinstance(key, slice):
            if not sub:
                raise ValueError(f"mesh[{key}] selects no ranks")
            return Mesh(sub, dim_names=self._names)
        raise TypeError(f"mesh[{key!r}]: index with a dim name, an int or a slice")

    # ---- identity -------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return (isinstance(other, Mesh) and self._ranks == other._ranks
                and self._shape == other._shape and self._names == other._names)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Mesh({self.tolist()}, dim_names={self._names})"

    def __str__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self._names, self._shape))
        return f"Mesh({dims}; ranks {list(self._ranks)})"

    def overlaps(self, other: "Mesh") -> bool:
        return bool(set(self._ranks) & set(other._ranks))


install(Mesh)           # DeviceMesh's names: mesh_dim_names, mesh, get_local_rank, ...


def _nest(flat: list, shape: Iterable[int]):
    shape = tuple(shape)
    if len(shape) == 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
