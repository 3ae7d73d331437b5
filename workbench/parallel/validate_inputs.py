"""Inputs for :mod:`validate`: every layout of a sample's tensors, Partial values made of
deliberately unequal parts (so that coincidences cannot pass), and the plumbing that puts
DistTensors where a sample call has tensors."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from ..sim_mesh.mesh import Mesh
from .dist_tensor import DistTensor, from_local, shard_tensor
from .placement import PARTIAL_OPS, Partial, Replicate, Shard

if TYPE_CHECKING:
    from .ops_table.samples import Sample

def _parts(x: torch.Tensor, op: str, n: int, seed: int) -> list[torch.Tensor]:
    """n tensors whose ``op`` is x, deliberately unequal (never x / n)."""
    g = torch.Generator().manual_seed(1000 + seed)
    if op in ("sum", "avg"):
        if x.is_floating_point():
            # on a 1/64 grid: parts of grid values sum exactly (ties stay ties)
            ps = [((torch.randn(x.shape, generator=g, dtype=torch.float64) * 64).round() / 64
                   * (0.5 + k)).to(x.dtype) for k in range(n - 1)]
        else:
            ps = [torch.randint(-3, 4, x.shape, generator=g).to(x.dtype) for _ in range(n - 1)]
        ps.append(x - sum(ps) if ps else x.clone())
        return [p * n for p in ps] if op == "avg" else ps
    # max / min: each element is exact on one rank (which one varies), lower/higher elsewhere
    who = torch.randint(0, n, x.shape, generator=g)        # random: no dim lines up
    out = []
    for k in range(n):
        off = (torch.rand(x.shape, generator=g, dtype=torch.float64) + 0.5 + k).to(x.dtype) \
            if x.is_floating_point() else torch.full(x.shape, k + 1, dtype=x.dtype)
        off = torch.where(who == k, torch.zeros_like(off), off)
        part = x - off if op == "max" else x + off
        # an integer that wraps (uint8 0 - 1 = 255) is not lower: x itself (still exact)
        wrapped = part > x if op == "max" else part < x
        out.append(torch.where(wrapped, x, part) if not x.is_floating_point() else part)
    return out


def partial_slot(mesh: Mesh, ps, rank: int) -> tuple[int, int]:
    """(k, n): which of the n parts of a Partial value ``rank`` holds, n being the number of
    ranks over the Partial mesh dims of ``ps`` (k counts them row-major)."""
    k, n = 0, 1
    c = mesh.coordinate(rank)
    for i, p in enumerate(ps):
        if p.is_partial():
            k, n = k * mesh.shape[i] + c[i], n * mesh.shape[i]
    return k, n


def distribute(x: torch.Tensor, mesh: Mesh, ps, seed: int = 0) -> DistTensor:
    """``x`` laid out as ``ps`` on ``mesh``; Partial placements from unequal parts (one
    reduce op per tensor: a mix is not a well-defined value)."""
    ops = {p.reduce_op for p in ps if p.is_partial()}
    if not ops:
        return shard_tensor(x, mesh, ps)
    (op,) = ops
    base = shard_tensor(x, mesh, [Replicate() if p.is_partial() else p for p in ps])
    locs = []
    for r in mesh.ranks:
        k, n = partial_slot(mesh, ps, r)
        locs.append(_parts(base.local(r), op, n, seed)[k])
    return from_local(locs, mesh, ps, shape=x.shape)


def _options(t: torch.Tensor, mesh_ndim: int) -> list[tuple]:
    one = [Replicate()] + [Shard(d) for d in range(t.dim())]
    if t.dtype != torch.bool and t.dim() > 0:
        one += [Partial(op) for op in PARTIAL_OPS if t.is_floating_point() or op != "avg"
                if not (t.is_complex() and op in ("max", "min"))]   # complex: no order
    combos = itertools.product(one, repeat=mesh_ndim)
    return [c for c in combos if len({p.reduce_op for p in c if p.is_partial()}) <= 1]


def _leaves(sample: Sample) -> list:
    """Paths to the tensors of a sample: ("a", i) / ("a", i, j) / ("k", name)."""
    out = []
    for i, a in enumerate(sample.args):
        if isinstance(a, torch.Tensor):
            out.append(("a", i))
        elif isinstance(a, (list, tuple)):
            out += [("a", i, j) for j, b in enumerate(a) if isinstance(b, torch.Tensor)]
    out += [("k", k) for k, v in sample.kwargs.items() if isinstance(v, torch.Tensor)]
    return out


def _substitute(sample: Sample, paths, values):
    args, kwargs = [list(a) if isinstance(a, (list, tuple)) else a for a in sample.args], \
        dict(sample.kwargs)
    for p, v in zip(paths, values):
        if p[0] == "k":
            kwargs[p[1]] = v
        elif len(p) == 2:
            args[p[1]] = v
        else:
            args[p[1]][p[2]] = v
    args = [type(a)(b) if isinstance(a, (list, tuple)) else b
            for a, b in zip(sample.args, args)]             # an index stays a tuple
    return args, kwargs


def _get(sample, p):
    return sample.kwargs[p[1]] if p[0] == "k" else \
        (sample.args[p[1]] if len(p) == 2 else sample.args[p[1]][p[2]])



def _neg(x):
    """-x for floating tensors and numbers (integer tensors are often indices: kept)."""
    if isinstance(x, torch.Tensor):
        return -x if x.is_floating_point() else x
    return x if isinstance(x, bool) else -x
