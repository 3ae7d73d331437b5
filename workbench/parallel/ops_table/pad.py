"""``F.pad`` with ``mode="constant"`` (``pad = (left, right)`` of the last dim, then of
the one before...; a negative pad crops).

Per mesh dim:

    S(d), d not padded   -> S(d)      every shard padded alike
    S(d), d padded       -> whole     (the pad belongs to the first and last shard only)
    P(sum), P(avg)       -> the same, value 0 only   # pad(sum a_i, 0) = sum pad(a_i, 0)
    P(max), P(min)       -> the same, any value      # max(v, ..., v) = v in the margins

Other modes (reflect, replicate, circular) read the tensor's own edges: not on
DistTensors yet (they raise, naming the fix).
"""
from __future__ import annotations

import torch.nn.functional as F

from ..placement import Partial, Replicate, Shard
from . import costs
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["pad_rule"]

R = Replicate()


def _padded_dims(ndim, pad):
    """The dims whose (left, right) pads are not both 0."""
    return {ndim - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]}


def pad_rule(x, *, pad, value, **_):
    """F.pad (constant): padded dims whole; the others pass; P(max/min) pass, and
    P(sum/avg) for a zero pad value."""
    moved = _padded_dims(x.ndim, pad)
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim):
        if d not in moved and x.shape[d] > 1:
            opts.append(((Shard(d),), (Shard(d),), f"dim {d} not padded: passes"))
    ops = ("max", "min") + (("sum", "avg") if not value else ())
    opts += [((Partial(op),), (Partial(op),), f"padding with {value or 0} keeps P({op})")
             for op in ops]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


def _pad_parse(input, pad, mode="constant", value=None):
    if mode != "constant":
        raise NotImplementedError(
            f"F.pad(mode={mode!r}) on a DistTensor: only mode='constant' is supported; "
            "gather first (.full()) for reflect / replicate / circular padding")
    pad = tuple(int(p) for p in pad)
    if value is not None and not isinstance(value, (int, float, bool)):
        raise TypeError(f"F.pad(value={value!r}): give a number")
    return (input,), {"pad": pad, "value": value}


def _pad_local(nd, ctx, x, pad, value):
    return F.pad(x, pad, mode="constant", value=value)


register("pad", [F.pad], parse=_pad_parse, rule=pad_rule, local=_pad_local,
         cost=costs.movement, op_class="data_movement",
         sample=lambda g: [Sample(F.pad, (g.rn(5, 6), (1, 2))),
                           Sample(F.pad, (g.rn(5, 6), (0, 0, 2, 1)), {"value": -1.5}),
                           Sample(F.pad, (g.rn(5, 3, 4), (-1, 1)))])
