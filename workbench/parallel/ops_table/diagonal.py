"""Diagonals: ``diagonal`` (a view, as torch's), and composed of it ``trace`` and
``diag`` (a matrix's diagonal, or a vector placed on one).

diagonal(x, offset, dim1, dim2) drops dim1 and dim2 and appends the diagonal. Per mesh dim:

    S(d), d not dim1 / dim2 -> S(d')   d' = d's place among the kept dims
    S(dim1) or S(dim2)      -> whole   (a diagonal entry pairs a row and a column that
                                       may live on different ranks)
    P(any)                  -> the same (picking entries is linear, and keeps max / min)
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from . import costs
from ._util import wrap_dim
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["diagonal_rule", "DIAGONALS"]

T = torch.Tensor
R = Replicate()


def diagonal_rule(x, *, offset, dim1, dim2, **_):
    """diagonal: dim1 and dim2 whole; the other dims pass (renumbered); Partials pass."""
    _, attrs = _diagonal_parse(x, offset, dim1, dim2)     # wrapped (infer: as the user gave)
    dim1, dim2 = attrs["dim1"], attrs["dim2"]
    kept = [d for d in range(x.ndim) if d not in (dim1, dim2)]
    opts = [((R,), (R,), "replicated")]
    opts += [((Shard(d),), (Shard(j),), f"dim {d} not on the diagonal: passes")
             for j, d in enumerate(kept) if x.shape[d] > 1]
    opts += [((Partial(op),), (Partial(op),), f"picking entries keeps P({op})")
             for op in ("sum", "avg", "max", "min")]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


def _diagonal_parse(x, offset=0, dim1=0, dim2=1):
    d1, d2 = wrap_dim(dim1, x.ndim), wrap_dim(dim2, x.ndim)
    if d1 == d2:
        raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
    return (x,), {"offset": int(offset), "dim1": d1, "dim2": d2}


def _diagonal_local(nd, ctx, x, offset, dim1, dim2):
    return torch.diagonal(x, offset, dim1 + nd, dim2 + nd)


register("diagonal", [torch.diagonal, T.diagonal], parse=_diagonal_parse, rule=diagonal_rule,
         local=_diagonal_local, cost=costs.view, op_class="view",
         sample=lambda g: [Sample(torch.diagonal, (g.rn(5, 6),)),
                           Sample(torch.diagonal, (g.rn(3, 5, 4), 1, 2, 0))])


def trace(input):
    """``torch.trace``: the sum of a matrix's diagonal."""
    if input.ndim != 2:
        raise RuntimeError(f"trace: expected a matrix, but got tensor with dim {input.ndim}")
    from .blas import cpu_check
    cpu_check(torch.trace, input)   # torch's kernel's dtypes (a bool raises; a sum counts)
    return torch.diagonal(input).sum()


def diag(input, diagonal=0, *, out=None):
    """``torch.diag``: a matrix's ``diagonal``-th diagonal, or a vector placed on it."""
    if out is not None:
        raise TypeError("diag(out=...) on a DistTensor: assign the result")
    if input.ndim == 2:
        return torch.diagonal(input, diagonal)
    if input.ndim != 1:
        raise RuntimeError("diag(): Supports 1D or 2D tensors. Got " f"{input.ndim}D")
    n, k = input.shape[0], int(diagonal)
    on = torch.eye(n, dtype=torch.bool)                          # where the vector goes
    m = torch.where(on, input.unsqueeze(1), torch.zeros((), dtype=input.dtype))
    if k == 0:
        return m
    a = abs(k)
    return torch.nn.functional.pad(m, (a, 0, 0, a) if k > 0 else (0, a, a, 0))


DIAGONALS = {torch.trace: trace, T.trace: trace, torch.diag: diag, T.diag: diag}
