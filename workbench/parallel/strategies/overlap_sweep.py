"""Sweep the decomposed ops over k, matrix sizes and profiles: the course's overlap table.

    >>> sw = overlap_sweep("matmul_all_reduce", [(4096, 4096, 4096)], Mesh.grid(8, ["tp"]),
    ...                    "tp", ks=[1, 2, 4, 8], profile=["ascend-910b", "a100"])
    >>> print(sw)          # C/M, k, total, exposed, hidden (measured), formula, speedup

The ops run on meta tensors (shapes only), so real-model sizes cost nothing;
the times are the modeled clock of each profile.  "formula" is
:func:`~workbench.parallel.strategies.overlap.expected_hidden_share` on the
chunks' own totals (latency and weight re-reads included), "C/M" the ratio of
the unsplit op, which bounds the hidden share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ...sim_mesh.profiles import get_profile
from ...sim_mesh.trace import trace
from .overlap import OPS, all_gather_matmul, expected_hidden_share

__all__ = ["SweepRow", "Sweep", "meta_inputs", "overlap_sweep"]


def meta_inputs(op, shape: Sequence[int], mesh, axis, dtype=torch.bfloat16):
    """Stacked meta tensors (shapes only, nothing allocated) for ``op`` on a global
    (M, K, N) matmul, laid out as in the table of :mod:`.overlap`'s docstring."""
    op = _op(op)
    M, K, N = shape
    ax = mesh.dim(axis)
    p = mesh.shape[ax]
    lead = [1] * mesh.ndim
    lead[ax] = p
    if op is all_gather_matmul:
        dims = {"M": M, "N": N}
    else:
        dims = {"K": K}
    bad = [f"{d}={v}" for d, v in dims.items() if v % p]
    if bad:
        raise ValueError(f"shape={tuple(shape)}: {', '.join(bad)} not divisible by p={p} "
                         f"(mesh dim {mesh.dim_names[ax]!r}) for {op.__name__}")
    if op is all_gather_matmul:
        xs, ws = (M // p, K), (K, N // p)
    else:
        xs, ws = (M, K // p), (K // p, N)
    return (torch.empty(*lead, *xs, dtype=dtype, device="meta"),
            torch.empty(*lead, *ws, dtype=dtype, device="meta"))


def _op(op):
    if callable(op) and getattr(op, "__name__", None) in OPS:
        return OPS[op.__name__]
    if isinstance(op, str) and op in OPS:
        return OPS[op]
    raise ValueError(f"op={op!r}: use one of {list(OPS)} (or the function itself)")


@dataclass(frozen=True)
class SweepRow:
    op: str
    profile: str
    shape: tuple            # global (M, K, N)
    k: int
    ratio: float            # C / M of the unsplit op (k = 1)
    compute: float          # seconds, all chunks
    comm: float             # seconds, all chunks
    exposed: float
    total: float
    hidden_share: float     # measured
    expected: float         # expected_hidden_share(compute, comm, k)
    speedup: float          # total at k = 1 / total at k


@dataclass(frozen=True)
class Sweep:
    """Rows of :func:`overlap_sweep`; ``str()`` prints the table."""
    rows: tuple

    def __str__(self) -> str:
        """The table: the op on a line of its own (a sweep runs one op), then one row per
        (profile, shape, k), the text columns as wide as their longest entry, so that a
        row stays under 100 characters (JupyterLab wraps wider text mid-word)."""
        shapes = ["x".join(str(s) for s in r.shape) for r in self.rows]
        wp = max([len("profile")] + [len(r.profile) for r in self.rows]) + 2
        ws = max([len("M x K x N")] + [len(s) for s in shapes]) + 2
        ops = sorted({r.op for r in self.rows})
        lines = [f"op {', '.join(ops)}",
                 f"{'profile':<{wp}}{'M x K x N':<{ws}}{'C/M':>5}{'k':>4}{'total ms':>10}"
                 f"{'exposed ms':>11}{'hidden':>8}{'formula':>8}{'speedup':>8}"]
        for r, shp in zip(self.rows, shapes):
            lines.append(f"{r.profile:<{wp}}{shp:<{ws}}{r.ratio:>5.2f}{r.k:>4}"
                         f"{r.total * 1e3:>10.3f}{r.exposed * 1e3:>11.3f}"
                         f"{r.hidden_share:>8.1%}{r.expected:>8.1%}{r.speedup:>7.2f}x")
        return "\n".join(lines)


def overlap_sweep(kind, shapes: Sequence[Sequence[int]], mesh, axis, ks: Sequence[int],
                  profile="a100", dtype=torch.bfloat16) -> Sweep:
    """Hidden share against k and the compute/communication ratio.

    ``kind``: one of :data:`OPS` (name or function); ``shapes``: global (M, K, N);
    ``profile``: a name, a Profile or a list of them (each changes C/M).  Runs the
    real op on meta tensors, so any size is free to model."""
    op = _op(kind)
    profiles = profile if isinstance(profile, (list, tuple)) else [profile]
    rows = []
    for prof in profiles:
        name = get_profile(prof).name
        for shape in shapes:
            x, w = meta_inputs(op, shape, mesh, axis, dtype)
            base = None
            for k in [1] + [k for k in ks if k != 1]:
                with trace(prof):
                    _, rep = op(x, w, mesh, axis, k)
                base = base or rep
                if k == 1 and 1 not in ks:
                    continue
                rows.append(SweepRow(op.__name__, name, tuple(shape), k,
                                     base.compute / base.comm if base.comm else float("inf"),
                                     rep.compute, rep.comm, rep.exposed, rep.total,
                                     rep.hidden_share,
                                     expected_hidden_share(rep.compute, rep.comm, k),
                                     base.total / rep.total if rep.total else 1.0))
    return Sweep(tuple(rows))
