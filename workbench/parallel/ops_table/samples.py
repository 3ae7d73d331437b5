"""The validator's sample calls (:mod:`..validate`), registered with each op.

``register(..., sample=lambda g: [Sample(torch.relu, (g.rn(5, 6),))])``: the op's calls
on data drawn from ``g``, a :class:`Gen` seeded 0 for each op (an op's samples do not
depend on any other op's). Shapes broadcast and split unevenly on 2, 3 and 4 ranks (5
and 7 rows), in several dtypes. ``sample="why"`` says why an op cannot be validated;
an op without a sample is reported as such, never silently passed."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .table import TABLE

__all__ = ["Sample", "Gen", "samples", "unchecked"]


@dataclass(frozen=True)
class Sample:
    """One call ``fn(*args, **kwargs)``; every tensor in it (lists included) is laid out.
    ``known_bug``: the issue that filed the bug this call hits (left out by
    ``samples(known_bugs=False)``)."""
    fn: Callable
    args: tuple
    kwargs: dict = field(default_factory=dict)
    known_bug: str = ""

    def __str__(self) -> str:
        def s(a):
            if isinstance(a, torch.Tensor):
                return f"{str(a.dtype).replace('torch.', '')}{list(a.shape)}"
            if isinstance(a, (list, tuple)):
                return "[" + ", ".join(s(b) for b in a) + "]"
            return repr(a)
        parts = [s(a) for a in self.args] + [f"{k}={s(v)}" for k, v in self.kwargs.items()]
        name = getattr(self.fn, "__name__", str(self.fn))
        return f"{name}({', '.join(parts)})"


class Gen:
    """Sample data from one fixed-seed generator."""

    def __init__(self, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)

    def rn(self, *shape, dtype=torch.float32):
        """Normal values (drawn in float64, then cast)."""
        return torch.randn(shape, generator=self.g, dtype=torch.float64).to(dtype)

    def pos(self, *shape, dtype=torch.float32):
        """Away from 0 (log, sqrt, 1/x): |normal| + 0.5."""
        return (self.rn(*shape).abs() + 0.5).to(dtype)

    def ints(self, *shape, lo=-5, hi=6):
        return torch.randint(lo, hi, shape, generator=self.g)

    def grid(self, *shape):
        """Values on a 1/16 grid, so that partial parts of a comparison sum exactly."""
        return (self.rn(*shape) * 16).round() / 16

    def ties(self, a, b):
        """``a`` or ``b`` at random, elementwise: equal to ``a`` in about half the places."""
        return torch.where(self.ints(*a.shape, lo=0, hi=2).bool(), a, b)


def unchecked(name: str) -> str | None:
    """Why op ``name`` cannot be validated (its registration says), else None."""
    e = TABLE.get(name)
    return e.sample if e is not None and isinstance(e.sample, str) else None


def samples(known_bugs: bool = True) -> dict[str, list[Sample]]:
    """{op name: [Sample]} of every op registered with a sample (each op's drawn from a
    generator seeded 0). ``known_bugs=False`` leaves out the calls that hit a bug already
    filed (``Sample.known_bug``), for a test suite that must pass until it is fixed."""
    out = {}
    for name, e in TABLE.items():
        if callable(e.sample):
            out[name] = [s for s in e.sample(Gen()) if known_bugs or not s.known_bug]
    return out
