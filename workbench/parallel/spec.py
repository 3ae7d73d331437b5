"""TensorSpec: shape, mesh, placements and dtype of a distributed tensor (what SPMD
rules and reshard plans look at), and its notation in "How to Scale Your Model":
``f32[I_dp, J_tp]{U_pp}`` is a matrix whose rows are split over dp, whose columns are
split over tp, and that is unreduced (Partial) over pp.
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch

from ..sim_mesh.mesh import Mesh
from . import layout
from .placement import Partial, Shard, normalize_placements

__all__ = ["TensorSpec", "notation"]

_SHORT_DTYPE = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
                torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32",
                torch.bool: "bool", torch.int8: "i8", torch.uint8: "u8"}
_LETTERS = "IJKLMNOPQRST"


class TensorSpec:
    """Shape, mesh and placements of a tensor: what SPMD rules and plans look at."""
    __slots__ = ("shape", "mesh", "placements", "dtype", "_hash")

    def __init__(self, shape: Sequence[int], mesh: Mesh, placements, dtype=torch.float32,
                 _trusted: bool = False):
        if not _trusted:
            shape = _check_shape(shape)
            if not isinstance(mesh, Mesh):
                raise TypeError(f"TensorSpec(mesh={mesh!r:.60}): expected a workbench Mesh")
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"TensorSpec(dtype={dtype!r}): expected a torch.dtype, "
                                "e.g. torch.float32")
        self.shape = torch.Size(shape)
        self.mesh = mesh
        self.placements = tuple(placements) if _trusted else \
            normalize_placements(placements, mesh, len(self.shape))
        self.dtype = dtype
        self._hash = hash((tuple(self.shape), self.mesh, self.placements, self.dtype))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return layout.local_shape(self.shape, self.mesh, self.placements, rank)

    def notation(self, names: str | None = None) -> str:
        return notation(self.shape, self.mesh, self.placements, self.dtype, names)

    def __repr__(self) -> str:
        return (f"TensorSpec({tuple(self.shape)}, {notation(self.shape, self.mesh, self.placements, self.dtype)})")

    def __eq__(self, other):
        return (isinstance(other, TensorSpec) and self._hash == other._hash and
                self.shape == other.shape and self.mesh == other.mesh and
                self.placements == other.placements and self.dtype == other.dtype)

    def __hash__(self):
        return self._hash


def _check_shape(shape) -> tuple:
    """A shape as a tuple of non-negative ints, or an error naming the bad size."""
    if isinstance(shape, int):
        shape = (shape,)
    try:
        sizes = tuple(shape)
    except TypeError:
        raise TypeError(f"shape={shape!r}: expected a sequence of ints, e.g. (8, 4)") from None
    out = []
    for n in sizes:
        try:
            k = -1 if isinstance(n, bool) else operator.index(n)
        except TypeError:
            k = -1
        if k < 0:
            raise ValueError(f"shape={sizes}: size {n!r} is not a non-negative int; "
                             "every size must be an int >= 0")
        out.append(k)
    return tuple(out)


def notation(shape, mesh, placements, dtype=torch.float32, names: str | None = None) -> str:
    """``f32[I_dp, J_tp]{U_pp}``: dims subscripted by the mesh dims that shard them,
    ``{U_x}`` for unreduced (Partial) over x."""
    names = names or _LETTERS
    subs: list[list[str]] = [[] for _ in shape]
    unreduced = []
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            subs[p.dim].append(mesh.dim_names[i])
        elif isinstance(p, Partial):
            op = "" if p.reduce_op == "sum" else f"({p.reduce_op})"
            unreduced.append(mesh.dim_names[i] + op)
    dims = []
    for d in range(len(shape)):
        n = names[d] if d < len(names) else f"D{d}"
        dims.append(n + ("_" + (subs[d][0] if len(subs[d]) == 1 else "{" + ",".join(subs[d]) + "}")
                         if subs[d] else ""))
    s = f"{_SHORT_DTYPE.get(dtype, str(dtype).replace('torch.', ''))}[{', '.join(dims)}]"
    if unreduced:
        s += "{U_" + ",".join(unreduced) + "}"
    return s
