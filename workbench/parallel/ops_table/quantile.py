"""``torch.quantile`` / ``torch.nanquantile``: the q-th quantiles along one dim (or of
every element), interpolated between the two neighbouring order statistics.

PyTorch sorts along the dim, then gathers the two ranks around ``q (n - 1)`` and lerps
between them (pytorch/pytorch 002b4ce, aten/src/ATen/native/Sorting.cpp,
``quantile_impl``: "Sort to efficiently query kth values"; nanquantile counts the
non-nan values instead of n).  A quantile needs every element of its row, so per mesh
dim:

    quantile(dim)      R                 -> R
                       S(d), d != dim    -> S(d')   each row is whole on its rank
                       S(dim)            -> whole   (the order statistics of a row mix
                                                    every shard's elements: the
                                                    dispatcher gathers it first, an
                                                    all-gather recorded in the trace)
    quantile(dim=None) any               -> whole   (every element: the input gathered)

d' is d shifted for the removed dim (``keepdim=False``) and by one more for a 1-D ``q``,
whose quantiles lead the output, as torch's.  No Partial passes (the quantile of a sum
is not the sum of the quantiles).  ``q`` is a float or a plain tensor (0-d or 1-D, the
input's dtype) of values in [0, 1]; a DistTensor ``q`` raises (give ``q.full()``).
"""
from __future__ import annotations

import math

import torch

from ..placement import Replicate, Shard
from . import costs
from ._util import shift, wrap_dim
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["quantile_rule"]

R = Replicate()
T = torch.Tensor
_MODES = ("linear", "lower", "higher", "midpoint", "nearest")


def quantile_rule(x, dim, keepdim, q, **_):
    """quantile: the reduced dim whole (every dim when ``dim`` is None); other dims pass,
    shifted past a 1-D q's leading dim."""
    lead = 0 if not isinstance(q, tuple) else 1
    opts = [((R,), (R,), "replicated")]
    if dim is not None:
        d0 = wrap_dim(dim, x.ndim)
        for d in range(x.ndim):
            if d != d0 and x.shape[d] > 1:
                o = (d if keepdim or d < d0 else d - 1) + lead
                opts.append(((Shard(d),), (Shard(o),),
                             f"dim {d} sharded passes (each row of dim {d0} whole)"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


def _parse_for(fn):
    name = fn.__name__

    def parse(input, q, dim=None, keepdim=False, *, interpolation="linear", out=None):
        if out is not None:
            raise TypeError(f"{name}(out=...) on a DistTensor: assign the result")
        if hasattr(q, "placements"):
            raise NotImplementedError(
                f"{name}(q=DistTensor): q is read by every rank; give it as a float or a "
                "plain tensor (q.full())")
        if interpolation not in _MODES:
            raise RuntimeError(f"{name}() interpolation must be one of linear, lower, higher, "
                               f"midpoint or nearest. Got {interpolation}")
        if isinstance(q, torch.Tensor):
            if q.requires_grad and torch.is_grad_enabled():
                # torch differentiates through q (its lerp weight); q is read here as
                # floats, so q.grad would stay None, silently
                raise NotImplementedError(
                    f"{name}(q=tensor that requires grad) on a DistTensor: the gradient "
                    "to q is not built (torch gives one); pass q.detach(), or compute "
                    "the quantile on plain tensors if q must be trained")
            # torch's checks before q's values (a complex q was read by float(): a raw
            # TypeError, seed 2005974 wide); torch's messages (measured, 2.13)
            if input.dtype not in (torch.float32, torch.float64):
                raise RuntimeError("quantile() input tensor must be either float or double "
                                   "dtype")
            if q.dtype != input.dtype:
                raise RuntimeError("quantile() q tensor must be same dtype as the input "
                                   "tensor")
            vals = [float(v) for v in q.detach().reshape(-1).tolist()]
            if any(not 0 <= v <= 1 for v in vals):       # torch checks this on CPU only
                raise RuntimeError(f"{name}() q values must be in the range [0, 1]")
            qa = tuple(vals) if q.dim() == 1 else vals[0]
        else:
            if not isinstance(q, (int, float)) or isinstance(q, bool) or not 0 <= q <= 1:
                raise RuntimeError(f"{name}() q must be in the range [0, 1] but got {q}")
            qa = float(q)
        d = None if dim is None else wrap_dim(dim, input.ndim)
        return (input,), {"q": qa, "dim": d, "keepdim": bool(keepdim),
                          "interpolation": interpolation}
    return parse


def _local_for(fn):
    def local(nd, ctx, x, q, dim, keepdim, interpolation):
        qt = torch.tensor(q, dtype=x.dtype, device=x.device) if isinstance(q, tuple) else q
        lead = tuple(x.shape[:nd])
        if dim is None or x.dim() == nd:            # every element of each rank's copy
            # (a 0-d input along dim 0 / -1 is its one element, as torch's)
            flat = x.reshape(lead + (-1,))
            out = fn(flat, qt, dim=nd, keepdim=False, interpolation=interpolation)
            if isinstance(q, tuple):
                out = out.movedim(0, nd)            # (lead, k)
            if keepdim:
                out = out.reshape(tuple(out.shape) + (1,) * (x.dim() - nd))
            return out
        at = shift(dim, x.dim() - nd, nd)           # the dim in the stacked tensor
        if x.numel() == 0:
            # a rank's empty shard of another dim (4 columns on 3 ranks: 2, 2, 0): torch
            # refuses an empty input; its output is as empty, with autograd to the shard
            shape = list(x.shape)
            if keepdim:
                shape[at] = 1
            else:
                del shape[at]
            if isinstance(q, tuple):
                shape.insert(nd, len(q))
            return x.sum() * 0 + x.new_zeros(shape)
        out = fn(x, qt, dim=at, keepdim=keepdim, interpolation=interpolation)
        return out.movedim(0, nd) if isinstance(q, tuple) else out
    return local


def _cost(ins, outs, dim, q, **_):
    """The sort PyTorch runs (``quantile_impl``): n ceil(log2 n) compares per row of n
    (as ``sort.py``'s), then per quantile two gathers and a lerp (3 FLOPs)."""
    x = ins[0]
    n = (x.numel() if dim is None else x.shape[dim]) if x.dim() else 1
    f = x.numel() * max(1, math.ceil(math.log2(max(n, 2)))) + 3 * outs[0].numel()
    return costs.Cost(f, costs.nbytes(x) + costs.nbytes(outs[0]), 0,
                      costs.backward_bytes(ins, outs, costs.nbytes(x)))


def _samples(fn):
    # q as floats: the validator negates every tensor of a sample (a q tensor would leave
    # [0, 1]); a 1-D q is held to torch in tests/test_fixlist3.py
    return lambda g: [
        Sample(fn, (g.rn(5, 6), 0.3), {"dim": 1}),
        Sample(fn, (g.rn(7, 4), 1.0), {"dim": 0, "keepdim": True}),
        Sample(fn, (g.rn(5, 6), 0.5), {"interpolation": "midpoint"}),
        Sample(fn, (g.rn(6, 5), 0.75), {"dim": -1, "interpolation": "nearest"})]


for _fn, _tfn in ((torch.quantile, T.quantile), (torch.nanquantile, T.nanquantile)):
    register(_fn.__name__, [_fn, _tfn], parse=_parse_for(_fn), rule=quantile_rule,
             local=_local_for(_fn), cost=_cost, op_class="reduction",
             sample=_samples(_fn))
