"""The ops of decoding: argmax / argmin, topk and multinomial (greedy, top-k and
sampled next tokens; ``workbench.serve.generate``).

Per mesh dim:

    argmax, argmin(dim)   R                -> R      every rank picks from whole rows
                          S(d), d != dim   -> S(d')  other dims pass
                          S(dim)           -> R      vocabulary parallel: each rank's
                                                     best (value, global index) in its
                                                     slice, all-gathered (2 numbers per
                                                     row and rank, not the V logits),
                                                     the best of those; ties go to the
                                                     lowest index and NaN wins, as torch
    topk(k, dim)          R, S(d != dim)   -> the same, values and indices
                          S(dim)           -> R      each rank's k best with global
                                                     indices, all-gathered (2 k numbers
                                                     per row and rank), the k best of
                                                     those k * n (Megatron-LM's
                                                     vocabulary-parallel top-k sampling
                                                     idea; equal to one device's values;
                                                     tied values' indices in any order,
                                                     as torch.topk's)
    multinomial(p, n)     R                -> R      rows and categories whole: one
                                                     draw from the generator, the same
                                                     on every rank (every process seeds
                                                     its generator alike, as one
                                                     device's seed); no communication

P(sum) passes none of them (argmax of a sum is not the argmax of its parts).  The
vocabulary-parallel strategies gather inside the op, so they are offered only for even
splits (as cross_entropy's; Megatron pads the vocabulary to a multiple of tp).
Dims are wrapped by the parsers, so they reach the rules non-negative.
"""
from __future__ import annotations

import math

import torch

from ...sim_mesh import collectives as C
from .. import layout
from ..placement import Replicate, Shard
from . import costs
from ._util import shift, wrap_dim
from .reduction import along_dim_options
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["arg_rule", "topk_rule", "multinomial_rule"]

T = torch.Tensor
R = Replicate()


def _vocab_parallel(x, dim, n_out: int = 1):
    """The option "dim sharded -> R, gathered inside the op" (:func:`_even_and_enough`
    keeps it only where the split is even and every rank holds enough entries)."""
    if dim is None or x.shape[dim] < 2:
        return None
    return ((Shard(dim),), (R,) * n_out, "vocabulary parallel: each rank's best "
            "(value, global index), all-gathered inside the op")


def _even_and_enough(strategies, x, dim, need):
    keep = []
    for st in strategies:
        ps = st.inputs[0]
        axes = [i for i, p in enumerate(ps) if p.is_shard(dim)]
        if axes:
            n = math.prod(x.mesh.shape[a] for a in axes)
            if not layout.is_even(x.shape, x.mesh, ps) or x.shape[dim] // n < need:
                continue
        keep.append(st)
    return keep


def _gather_best(nd, ctx, vals, idx, dim, k, largest):
    """vals, idx (lead.., k along stacked ``dim``) of each rank's slice -> the k best
    over the ranks that shard ``dim`` (global indices), by all-gathers along ``dim``."""
    spec = ctx.in_specs[0]
    axes = [i for i, p in enumerate(spec.placements) if p.is_shard(dim - nd)]
    for a in axes:
        vals = C.all_gather(vals, ctx.mesh, a, dim - nd, label="argmax/topk: (value, index)")
        idx = C.all_gather(idx, ctx.mesh, a, dim - nd, label="argmax/topk: (value, index)")
    if k == 1:                          # argmax / argmin: first best, NaN wins (as torch)
        nan = vals.isnan()
        best = vals.amax(dim, keepdim=True) if largest else vals.amin(dim, keepdim=True)
        win = torch.where(nan.any(dim, keepdim=True), nan, vals == best)
        big = torch.iinfo(idx.dtype).max
        return None, torch.where(win, idx, big).amin(dim, keepdim=True)
    v, j = torch.topk(vals, k, dim, largest, True)
    return v, idx.gather(dim, j)


# ---- argmax, argmin ------------------------------------------------------------------

def arg_rule(x, dim=None, keepdim=False, **_):
    """argmax / argmin(dim): dim whole, or vocabulary parallel (gathered pairs); other
    dims pass; dim=None (over the flattened tensor): replicated."""
    if dim is None:
        return combine(x.mesh.ndim, [[((R,), (R,), "replicated")]] * x.mesh.ndim, 1)
    dim = wrap_dim(dim, x.ndim)                  # negative: from the end (spmd.infer)
    opts = along_dim_options(x, dim, keepdim)
    vp = _vocab_parallel(x, dim)
    if vp is not None:
        opts.append(vp)
    return _even_and_enough(combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1), x, dim, 1)


def _arg_parse(x, dim=None, keepdim=False):
    return (x,), {"dim": None if dim is None else wrap_dim(dim, x.ndim), "keepdim": bool(keepdim)}


def _arg_local(fn, largest):
    def local(nd, ctx, x, dim=None, keepdim=False):
        if dim is None:               # over the flattened local tensor (replicated only)
            flat = x.reshape(tuple(x.shape[:nd]) + (-1,))
            out = fn(flat, nd)
            return out.reshape(tuple(x.shape[:nd]) + (1,) * (x.dim() - nd)) if keepdim else out
        d = shift(dim, x.dim() - nd, nd)
        if ctx is None or not any(p.is_shard(dim) for p in ctx.in_specs[0].placements):
            return fn(x, d, keepdim=keepdim)
        # vocabulary parallel: local pick, its global index, then the best over ranks
        j = fn(x, d, keepdim=True)
        v = x.gather(d, j)
        j = j + ctx.offsets(ctx.in_specs[0], dim, like=x)
        _, out = _gather_best(nd, ctx, v, j, d, 1, largest)
        return out if keepdim else out.squeeze(d)
    return local


for _n, _largest in (("argmax", True), ("argmin", False)):
    register(_n, [getattr(torch, _n), getattr(T, _n)], parse=_arg_parse, rule=arg_rule,
             local=_arg_local(getattr(torch, _n), _largest), cost=costs.reduction(1),
             op_class="reduction",                                      # one compare each
             sample=lambda g, _n=_n: [
                 Sample(getattr(torch, _n), (g.rn(5, 6), 1)),
                 Sample(getattr(torch, _n), (g.grid(4, 8).round(), -1))])    # ties


# ---- topk ----------------------------------------------------------------------------

def topk_rule(x, k, dim, **_):
    """topk(k, dim): dim whole, or vocabulary parallel (each rank's k best gathered);
    other dims pass to both outputs (values, indices)."""
    dim = wrap_dim(dim, x.ndim)                  # negative: from the end (spmd.infer)
    opts = [(ins, outs * 2, note) for ins, outs, note in along_dim_options(x, dim)]
    vp = _vocab_parallel(x, dim, n_out=2)
    if vp is not None:
        opts.append(vp)
    return _even_and_enough(combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1, n_outputs=2),
                            x, dim, k)


def _topk_parse(x, k, dim=-1, largest=True, sorted=True):
    return (x,), {"k": int(k), "dim": wrap_dim(dim, x.ndim), "largest": bool(largest),
                  "sorted": bool(sorted)}


def _topk_local(nd, ctx, x, k, dim, largest, sorted):
    d = shift(dim, x.dim() - nd, nd)
    if ctx is None or not any(p.is_shard(dim) for p in ctx.in_specs[0].placements):
        return tuple(torch.topk(x, k, d, largest, sorted))
    v, j = torch.topk(x, k, d, largest, True)                 # this rank's k best
    j = j + ctx.offsets(ctx.in_specs[0], dim, like=x)
    return _gather_best(nd, ctx, v, j, d, k, largest)


def _topk_cost(ins, outs, k, **_):
    """A heap selection: each element compared with the heap root and, when it enters,
    sifted down log2(k) levels (Knuth, TAOCP vol. 3, 5.2.3): n ceil(log2(k + 1))."""
    n = ins[0].numel()
    f = n * max(1, math.ceil(math.log2(k + 1)))
    return costs.Cost(f, costs.nbytes(ins[0]) + sum(costs.nbytes(o) for o in outs), 0,
                      costs.backward_bytes(ins, outs[:1], costs.nbytes(outs[1])))


_TOPK = register("topk", [torch.topk, T.topk], parse=_topk_parse, rule=topk_rule,
                 local=_topk_local, cost=_topk_cost, op_class="reduction", n_out=2,
                 sample=lambda g: [Sample(torch.topk, (g.rn(5, 8), 2, -1)),
                                   Sample(torch.topk, (g.rn(6, 4), 3, 0),
                                          {"largest": False})])
_TOPK.extra["result_type"] = torch.return_types.topk        # (values, indices), named


# ---- multinomial ---------------------------------------------------------------------

def multinomial_rule(p, **_):
    """multinomial: rows and categories whole on every rank (one draw, replicated)."""
    return combine(p.mesh.ndim, [[((R,), (R,), "one draw from the generator, the same on "
                                   "every rank (seeded alike)")]] * p.mesh.ndim, 1)


def _multinomial_parse(p, num_samples, replacement=False, *, generator=None):
    return (p,), {"num_samples": int(num_samples), "replacement": bool(replacement),
                  "generator": generator}


def _multinomial_local(nd, ctx, p, num_samples, replacement, generator):
    one = p[(0,) * nd] if nd else p        # replicated: every copy is the same; draw once
    out = torch.multinomial(one, num_samples, replacement, generator=generator)
    return out.reshape((1,) * nd + tuple(out.shape))


def _multinomial_cost(ins, outs, num_samples, **_):
    """Inverse-CDF sampling: a prefix sum over the categories (one add each) and a
    binary search per draw (ATen's multinomial without replacement for one sample)."""
    n = ins[0].numel()
    rows = max(1, n // max(1, ins[0].shape[-1]))
    f = n + rows * num_samples * max(1, math.ceil(math.log2(max(2, ins[0].shape[-1]))))
    return costs.Cost(f, costs.nbytes(ins[0]) + costs.nbytes(outs[0]), 0, 0)


register("multinomial", [torch.multinomial, T.multinomial], parse=_multinomial_parse,
         rule=multinomial_rule, local=_multinomial_local, cost=_multinomial_cost,
         op_class="reduction", meta_check=False,
         sample="a draw from a generator: two calls with one generator object differ; "
                "tests/test_op_table.py checks it with a fresh generator per call")
