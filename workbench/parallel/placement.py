"""Placements: how a tensor lies along one mesh dimension.

One placement per mesh dimension, as in PaddlePaddle 3 auto parallel and
PyTorch DTensor:

* ``Replicate()``  every rank of the group holds the whole tensor;
* ``Shard(dim)``   tensor dimension ``dim`` is split over the group
  (``torch.chunk`` sizes: 10 rows on 4 ranks are 3, 3, 3, 1);
* ``Partial(op)``  every rank holds a part; the value is ``op`` over the group
  ("sum", "avg", "max" or "min"), e.g. after a matmul whose contraction
  dimension was sharded.

Long repr ``Shard(dim=0)``, short str ``S(0)``; ``parse("S(0)")`` reads both.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence, Union

import torch

__all__ = ["Placement", "Replicate", "Shard", "Partial", "parse_placements",
           "normalize_placements", "check_partial_dtype", "PARTIAL_OPS"]

PARTIAL_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base class of Replicate, Shard and Partial."""

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)


@dataclass(frozen=True, repr=True)
class Replicate(Placement):
    """Every rank holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, repr=True)
class Shard(Placement):
    """Tensor dimension ``dim`` is split over the ranks (``torch.chunk`` sizes)."""
    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim={self.dim!r}): dim must be an int")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, repr=True)
class Partial(Placement):
    """Every rank holds a part; the value is ``reduce_op`` over the ranks."""
    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op not in PARTIAL_OPS:
            raise ValueError(f"Partial(reduce_op={self.reduce_op!r}): unknown op; "
                             f"use one of {list(PARTIAL_OPS)}")

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


PlacementLike = Union[Placement, str]
_PAT = re.compile(r"^\s*(?:(R|Replicate)\(?\)?|(?:S|Shard)\((?:dim=)?(-?\d+)\)|"
                  r"(?:P|Partial)(?:\((?:reduce_op=)?['\"]?(\w*)['\"]?\))?)\s*$")


def _from_torch(p) -> Placement | None:
    """torch.distributed.tensor's Replicate / Shard / Partial as ours (a DTensor user's
    placements work as they are); None for anything else."""
    if not type(p).__module__.startswith("torch.distributed.tensor"):
        return None
    from torch.distributed import tensor as dt
    if type(p) is dt.Replicate:
        return Replicate()
    if type(p) is dt.Shard:
        return Shard(p.dim)
    if type(p) is dt.Partial and p.reduce_op in PARTIAL_OPS:
        return Partial(p.reduce_op)
    return None


def _parse_one(p: PlacementLike) -> Placement:
    if isinstance(p, Placement):
        return p
    ours = _from_torch(p)
    if ours is not None:
        return ours
    if isinstance(p, str):
        m = _PAT.match(p)
        if m:
            if m.group(1):
                return Replicate()
            if m.group(2) is not None:
                return Shard(int(m.group(2)))
            return Partial(m.group(3) or "sum")
    raise ValueError(f"placement {p!r} not understood: use Replicate(), Shard(dim), "
                     f"Partial(op) or the short strings 'R', 'S(0)', 'P(sum)'")


def parse_placements(placements) -> tuple[Placement, ...]:
    """Accept a sequence of placements or short strings (``["S(0)", "R"]``)."""
    if isinstance(placements, (Placement, str)):
        placements = [placements]
    if isinstance(placements, (dict, set, bytes)) or not hasattr(placements, "__iter__"):
        raise TypeError(f"placements={placements!r:.60}: expected a list with one placement "
                        "per mesh dim, e.g. [Shard(0), Replicate()]")
    return tuple(_parse_one(p) for p in placements)


def normalize_placements(placements, mesh, ndim: int, arg: str = "placements") -> tuple[Placement, ...]:
    """Validate placements for a tensor of ``ndim`` dims on ``mesh``.

    Negative shard dims become non-negative; errors name the argument, the
    value and the fix."""
    ps = parse_placements(placements)
    if len(ps) != mesh.ndim:
        raise ValueError(
            f"{arg}={[str(p) for p in ps]} has {len(ps)} {'entry' if len(ps) == 1 else 'entries'} for a {mesh.ndim}-d mesh "
            f"{mesh.dim_names}: give exactly one placement per mesh dimension")
    out = []
    op = None
    mixed = False
    for p in ps:
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim or ndim == 0:
                raise ValueError(
                    f"Shard({p.dim}) on a {ndim}-d tensor: dim must be in "
                    f"[{-ndim}, {ndim - 1}]" if ndim else
                    f"Shard({p.dim}) on a 0-d tensor: a scalar cannot be sharded; use Replicate()")
            if p.dim < 0:
                p = Shard(p.dim % ndim)
        elif isinstance(p, Partial):
            mixed |= op is not None and p.reduce_op != op
            op = p.reduce_op
        out.append(p)
    if mixed:
        ops = sorted({p.reduce_op for p in out if isinstance(p, Partial)})
        # sum over one mesh dim and max over another do not commute: the value would
        # depend on the order of the reductions (PyTorch DTensor refuses it too)
        raise ValueError(f"{arg}={[str(p) for p in out]} mixes Partial ops {ops}: the value "
                         "would depend on which mesh dim is reduced first; use one reduce op "
                         "for every Partial, or reduce one of them first (reshard)")
    return tuple(out)


def check_partial_dtype(placements, dtype, arg: str = "placements") -> None:
    """Refuse a Partial that no reduction in ``dtype`` computes exactly.

    Reductions keep the tensor's dtype, as torch.distributed's do.  A bool has no sum
    (a sum of bools is a count, not a bool) and no average; an integer average rounds.
    ``Partial("max")`` / ``Partial("min")`` of bools are logical or / and."""
    for p in placements:
        if not isinstance(p, Partial):
            continue
        if dtype == torch.bool and p.reduce_op in ("sum", "avg"):
            raise ValueError(f"{arg}: {p} on a torch.bool tensor: a {p.reduce_op} of bools "
                             "is not a bool; use Partial('max') (logical or) or "
                             "Partial('min') (logical and), or cast to an integer dtype first")
        if p.reduce_op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"{arg}: {p} on a {dtype} tensor: an integer average rounds; "
                             "cast to a floating-point dtype first, or use Partial('sum')")


def fmt_placements(ps: Sequence[Placement]) -> str:
    return "[" + ", ".join(str(p) for p in ps) + "]"
