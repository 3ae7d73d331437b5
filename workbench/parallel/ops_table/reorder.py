"""Reordering along dims: ``flip`` (``fliplr``, ``flipud``) and ``roll``.

Both move elements and compute nothing; each is a permutation of the elements, so
every Partial passes (``flip(sum a_i) = sum flip(a_i)``; the same for avg, max, min).
Per mesh dim:

    flip(dims)            S(d), d not flipped  -> S(d)     each shard flips alone
                          S(d), d flipped      -> whole    (the shard of rank r would
                                                           hold another rank's rows)
    roll(shifts, dims)    S(d), d not rolled   -> S(d)
                          S(d), d rolled       -> whole    (elements cross shards)
    roll(shifts)          (no dims: over the flattened tensor) every dim whole

A dim that must be whole and is sharded is gathered first (the reshard planner's
all-gather, recorded in the trace). Dims are wrapped by the parsers (an out-of-range
dim is torch's IndexError), so they reach the rules non-negative.
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from . import costs
from ._util import wrap_dim, wrap_dims
from .samples import Sample
from .strategy import combine
from .table import add_funcs, register

__all__ = ["reorder_rule"]

T = torch.Tensor
R = Replicate()


def reorder_rule(x, *, dims, **_):
    """flip / roll over ``dims`` (None: every dim): those dims whole, the others pass;
    every Partial passes (a permutation of the elements)."""
    moved = set(range(x.ndim)) if dims is None else set(dims)
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim):
        if d not in moved and x.shape[d] > 1:
            opts.append(((Shard(d),), (Shard(d),), f"dim {d} not reordered: passes"))
    opts += [((Partial(op),), (Partial(op),), f"a permutation keeps P({op})")
             for op in ("sum", "avg", "max", "min")]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


def _dims_arg(args, kwargs, fn):
    """``flip(x, dims)``, ``x.flip(0, 1)``, ``x.flip(dims=(0,))``."""
    if "dims" in kwargs:
        if args:
            raise TypeError(f"{fn}(): got dims both positionally and by keyword")
        return kwargs.pop("dims")
    if len(args) == 1:
        return args[0]
    if not args:
        raise TypeError(f"{fn}() missing required argument 'dims' (e.g. {fn}(x, dims=[0]))")
    return args


def _flip_parse(x, *args, **kwargs):
    dims = _dims_arg(args, kwargs, "flip")
    if kwargs:
        raise TypeError(f"flip(): unexpected arguments {sorted(kwargs)} on a DistTensor")
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return (x,), {"dims": tuple(sorted(wrap_dims(dims, x.ndim)))}


def _fixed_flip(dim, least, name):
    def parse(x):
        if x.ndim < least:
            raise RuntimeError(f"Input must be >= {least}-d.")      # torch's words
        return (x,), {"dims": (dim,)}
    parse.__name__ = f"_{name}_parse"
    return parse


def _flip_local(nd, ctx, x, dims):
    if x.dim() == nd:                 # 0-d tensors: nothing to flip
        return x.clone()
    return torch.flip(x, [d + nd for d in dims])


_FLIP = register("flip", [torch.flip, T.flip], parse=_flip_parse, rule=reorder_rule,
                 local=_flip_local, cost=costs.movement, op_class="data_movement",
                 sample=lambda g: [Sample(torch.flip, (g.rn(5, 6), [0])),
                                   Sample(torch.flip, (g.rn(5, 3, 2), [-1, 0]))])
add_funcs("flip", [(torch.fliplr, _fixed_flip(1, 2, "fliplr")),
                   (T.fliplr, _fixed_flip(1, 2, "fliplr")),
                   (torch.flipud, _fixed_flip(0, 1, "flipud")),
                   (T.flipud, _fixed_flip(0, 1, "flipud"))])


# ---- roll ----------------------------------------------------------------------------

def _roll_parse(x, shifts, dims=None):
    shifts = (shifts,) if isinstance(shifts, int) else tuple(int(s) for s in shifts)
    if dims is None or isinstance(dims, (tuple, list)) and len(dims) == 0:   # as torch
        if len(shifts) != 1:
            raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, "
                               "dims:0")                                 # torch's words
        return (x,), {"shifts": shifts, "dims": None}
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if len(dims) != len(shifts):
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, "
                           f"dims:{len(dims)}")                          # torch's words
    return (x,), {"shifts": shifts, "dims": tuple(wrap_dim(d, x.ndim) for d in dims)}


def _roll_local(nd, ctx, x, shifts, dims):
    if x.dim() == nd:
        return x.clone()
    if dims is None:                  # over the flattened local (whole) tensor
        lead = tuple(x.shape[:nd])
        return torch.roll(x.reshape(lead + (-1,)), shifts, nd).reshape(x.shape)
    return torch.roll(x, shifts, tuple(d + nd for d in dims))


def _roll_rule(x, *, shifts, dims, **_):
    return reorder_rule(x, dims=dims)


register("roll", [torch.roll, T.roll], parse=_roll_parse, rule=_roll_rule, local=_roll_local,
         cost=costs.movement, op_class="data_movement",
         sample=lambda g: [Sample(torch.roll, (g.rn(5, 6), 2, 1)),
                           Sample(torch.roll, (g.rn(5, 6), -3)),
                           Sample(torch.roll, (g.rn(5, 3, 2), (1, -1), (0, 2)))])
