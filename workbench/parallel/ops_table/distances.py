"""``torch.renorm`` (each slice along a dim scaled down to a p-norm of at most maxnorm), and
composed of table ops ``F.pairwise_distance`` (``composites.py`` installs it; cdist is
``vector_norm.py``'s).

renorm(x, p, dim, maxnorm): slice i is ``x.select(dim, i)``, its norm over every other dim.
Per mesh dim:

    S(dim)               -> S(dim)   each rank's slices are whole: normed alone
    S(d), d != dim       -> whole    a slice's norm sums over the ranks' shards
    P(any)               -> whole    the norm of a sum is not the sum of the norms

Backward: torch's ``renorm_backward`` through the local call's autograd.
"""
from __future__ import annotations

import math

import torch

from ..placement import Replicate, Shard
from . import costs
from ._util import wrap_dim
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["renorm_rule", "DISTANCES"]

T = torch.Tensor
R = Replicate()


def renorm_rule(x, *, p, dim, maxnorm, **_):
    """renorm: every dim but ``dim`` whole (a slice's norm); ``dim`` may stay sharded."""
    dim = wrap_dim(dim, max(x.ndim, 1))
    opts = [((R,), (R,), "replicated")]
    if x.ndim and x.shape[dim] > 1:
        opts.append(((Shard(dim),), (Shard(dim),), f"dim {dim}: each slice normed alone"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


def _renorm_parse(input, p, dim, maxnorm, *, out=None):
    if out is not None:
        raise TypeError("renorm(out=...) on a DistTensor: assign the result")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"renorm(): argument 'dim' must be int, not {type(dim).__name__}")
    return (input,), {"p": p, "dim": wrap_dim(dim, max(input.ndim, 1)), "maxnorm": maxnorm}


def _renorm_local(nd, ctx, x, p, dim, maxnorm):
    if nd == 0:
        return torch.renorm(x, p, dim, maxnorm)
    # the ranks' slices side by side along one dim (each normed alone, never across the
    # device axes): (lead.., n, rest..) -> (lead * n, rest..), back after
    lead = tuple(x.shape[:nd])
    y = x.movedim(dim + nd, nd)
    shape = tuple(y.shape)
    # the merged length spelled out: -1 is ambiguous for a tensor of no element (sweep15,
    # seed 5000048: renorm of a (1, 4, 0) tensor raised reshape's RuntimeError)
    n = math.prod(shape[:nd + 1])
    out = torch.renorm(y.reshape((n,) + shape[nd + 1:]), p, 0, maxnorm)
    return out.reshape(shape).movedim(nd, dim + nd).contiguous() if lead else out


def _renorm_cost(ins, outs, **_):
    """torch's kernel: ``linalg_vector_norm`` over the other dims (2 FLOPs per element:
    |x|^p and the sum), a scale factor per slice, one multiply per element (pytorch
    aten/src/ATen/native/ReduceOps.cpp ``TORCH_IMPL_FUNC(renorm_out)``): 3 per element."""
    return costs.elementwise(3)(ins, outs)


register("renorm", [torch.renorm, T.renorm], parse=_renorm_parse, rule=renorm_rule,
         local=_renorm_local, cost=_renorm_cost, op_class="norm",
         sample=lambda g: [Sample(torch.renorm, (g.rn(5, 6), 2, 0, 1.0)),
                           Sample(torch.renorm, (g.rn(3, 4, 5), 1, -1, 2.5)),
                           Sample(torch.renorm, (g.rn(4, 6), float("inf"), 1, 0.5))])


def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """``F.pairwise_distance``: ``norm(x1 - x2 + eps, p)`` over the last dim of the
    broadcast shape (torch's composition: aten/src/ATen/native/Distance.cpp,
    ``pairwise_distance``), its checks run first on meta tensors."""
    torch.pairwise_distance(torch.empty(tuple(x1.shape), dtype=x1.dtype, device="meta"),
                            torch.empty(tuple(x2.shape), dtype=x2.dtype, device="meta"),
                            p, eps, keepdim)
    nd = max(x1.ndim, x2.ndim)
    return torch.linalg.vector_norm(x1 - x2 + eps, p, dim=nd - 1 if nd else -1,
                                    keepdim=keepdim)


DISTANCES = {torch.pairwise_distance: pairwise_distance}
