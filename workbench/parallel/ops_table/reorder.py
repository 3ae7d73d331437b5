"""Reordering along dims: ``flip`` (``fliplr``, ``flipud``), ``roll`` and
``repeat_interleave`` (``repeat`` / ``expand``: ``indexing.py``).

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
    moved = set(range(x.ndim)) if dims is None else set(wrap_dims(dims, x.ndim))  # spmd.infer
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


# ---- repeat_interleave ---------------------------------------------------------------
# Each element repeated r times in place along dim (GQA's k / v heads: n_kv -> n_kv r).
# S(dim) passes where the shards line up: rank k's rows [k c, (k + 1) c) become rows
# [k c r, (k + 1) c r), torch.chunk's block of the output iff ceil(N r / m) == ceil(N / m) r
# (m ranks on that one mesh dim; e.g. m divides N); otherwise the dim is made whole.

def repeat_interleave_rule(x, *, repeats, dim, **_):
    """repeat_interleave: other dims pass; dim passes S(dim) where chunks line up; every
    Partial passes (copies of the parts are parts of the copies)."""
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim):
        if x.shape[d] > 1 and (dim is not None and d != dim):
            opts.append(((Shard(d),), (Shard(d),), f"dim {d} not repeated: passes"))
    if dim is not None and x.shape[dim] > 1:
        opts.append(((Shard(dim),), (Shard(dim),), "each shard's rows repeated in place"))
    opts += [((Partial(op),), (Partial(op),), f"copies of P({op}) are P({op})")
             for op in ("sum", "avg", "max", "min")]
    out = []
    for st in combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1):
        axes = [i for i, p in enumerate(st.inputs[0]) if dim is not None and p.is_shard(dim)]
        if axes:
            m, n = x.mesh.shape[axes[0]], x.shape[dim]
            if len(axes) > 1 or -(-n * repeats // m) != -(-n // m) * repeats:
                continue
        out.append(st)
    return out


def _repeat_interleave_parse(x, repeats=None, dim=None, *, output_size=None):
    if repeats is None:
        raise NotImplementedError("repeat_interleave(repeats_tensor) (the indices form) on a "
                                  "DistTensor: give repeats= an int")
    if not isinstance(repeats, int) or isinstance(repeats, bool):
        if isinstance(repeats, torch.Tensor) and repeats.numel() == 1 and \
                not repeats.is_floating_point():
            repeats = int(repeats)
        else:
            raise NotImplementedError(
                f"repeat_interleave(repeats={type(repeats).__name__}) on a DistTensor: "
                "per-element repeats are not supported; give one int (as GQA's n_rep)")
    if repeats < 0:
        raise RuntimeError("Repeats must be non-negative")                # torch's words
    # torch's own checks with the int repeats (a repeats tensor has no meta kernel)
    torch.empty(tuple(x.shape), dtype=x.dtype, device="meta").repeat_interleave(repeats, dim)
    return (x,), {"repeats": repeats, "dim": None if dim is None else wrap_dim(dim, x.ndim)}


def _repeat_interleave_local(nd, ctx, x, repeats, dim):
    if dim is None:                   # over the flattened (whole) tensor: 1-d
        return x.reshape(tuple(x.shape[:nd]) + (-1,)).repeat_interleave(repeats, nd)
    if x.dim() == nd:                 # a 0-d tensor along its dim 0: 1-d
        return x.reshape(tuple(x.shape) + (1,)).repeat_interleave(repeats, nd)
    return x.repeat_interleave(repeats, dim + nd)


register("repeat_interleave", [torch.repeat_interleave, T.repeat_interleave],
         parse=_repeat_interleave_parse, rule=repeat_interleave_rule,
         local=_repeat_interleave_local, cost=costs.movement, op_class="data_movement",
         meta_check=False, sample=lambda g: [Sample(torch.repeat_interleave, (g.rn(4, 6), 2, 0)),
                           Sample(torch.repeat_interleave, (g.rn(5, 6), 3, 0)),
                           Sample(torch.repeat_interleave, (g.rn(5, 3, 2), 2, -1)),
                           Sample(torch.repeat_interleave, (g.rn(3, 2), 2))])
