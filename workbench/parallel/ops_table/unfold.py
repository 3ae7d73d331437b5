"""``Tensor.unfold(dimension, size, step)``: every window of ``size`` elements along
``dimension``, ``step`` apart (a view, as torch's): the dim becomes the number of windows,
(n - size) // step + 1, and a last dim of ``size`` is appended.  Per mesh dim:

    S(d), d != dimension -> S(d)     each window lies in one position of the other dims
    S(dimension)         -> whole    a window may straddle two ranks' shards (a halo
                                     exchange would serve it; gathered here, never wrong)
    P(any)               -> the same (picking elements is linear, and keeps max / min)

Backward: torch's ``unfold_backward`` (overlapping windows' gradients summed), through the
local call's autograd.  On a sequence in ring order (``seq_order.py``) the windows read
neighbouring positions: unfolding the recorded dim is refused there.
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from . import costs
from ._util import wrap_dim
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["unfold_rule"]

T = torch.Tensor
R = Replicate()


def unfold_rule(x, *, dim, size, step, **_):
    """unfold: the unfolded dim whole; the other dims pass (same index); Partials pass."""
    dim = wrap_dim(dim, max(x.ndim, 1))
    opts = [((R,), (R,), "replicated")]
    opts += [((Shard(d),), (Shard(d),), f"dim {d} not unfolded: passes")
             for d in range(x.ndim) if d != dim and x.shape[d] > 1]
    opts += [((Partial(op),), (Partial(op),), f"picking elements keeps P({op})")
             for op in ("sum", "avg", "max", "min")]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


def _unfold_parse(x, dimension, size, step):
    for name, v in (("dimension", dimension), ("size", size), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"unfold(): argument '{name}' must be int, not "
                            f"{type(v).__name__}")
    return (x,), {"dim": wrap_dim(dimension, max(x.ndim, 1)), "size": size, "step": step}


def _unfold_local(nd, ctx, x, dim, size, step):
    if x.dim() == nd:                 # a 0-d tensor: one window of its element, shape
        return x.unsqueeze(-1).unfold(nd, size, step).select(nd, 0)     # (size,) (torch's)
    return x.unfold(dim + nd, size, step)


register("unfold", [T.unfold], parse=_unfold_parse, rule=unfold_rule, local=_unfold_local,
         cost=costs.view, op_class="view",
         sample=lambda g: [Sample(T.unfold, (g.rn(5, 7), 1, 3, 2)),
                           Sample(T.unfold, (g.rn(6, 4), 0, 2, 1)),
                           Sample(T.unfold, (g.rn(3, 5, 4), -1, 4, 4))])
