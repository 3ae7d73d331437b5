"""Cross-entropy, including Megatron's vocabulary parallelism.

cross_entropy(logits, target), logits (N, C) or (N, C, d1, ...) with the class dim 1
(or (C,) with a scalar target), per mesh dim (logits, target -> loss):

    R,    R      -> R          every rank computes the same loss
    S(b), S(b')  -> S(b')      reduction="none": each rank's rows alone
                 -> P(sum)     reduction="sum": sum(loss) = sum_i sum(loss_i)
                 -> P(sum)     reduction="mean": each rank divides its partial sum by
                               the GLOBAL count of non-ignored targets, all-reduced
                               inside the op (a few bytes)
    S(b), R      -> P(sum)     reduction="mean": the replicated target gives the global
                               count without communication; each rank keeps its rows
    S(c), R      -> R          vocabulary parallel (Megatron's vocab_parallel_cross_entropy):
                               loss = log(sum_k sum_j exp(z_kj - m)) + m - z_target with
                               m = max_k max_j z_kj, so three all-reduces INSIDE the op:
                               max (of the detached local max), sum (of the local sums of
                               exp), sum (of the target logit, contributed by the one rank
                               whose vocabulary slice holds it); a fourth (sum of the
                               logits) with label_smoothing; backward needs none
                               (softmax - one_hot is local to each vocabulary slice)
    P(sum) logits                not valid: log-sum-exp is not linear; reduced first

The ops with collectives inside need every rank's shard at once, which the
dispatcher gives only to even layouts; so those strategies are offered only when
the split is even.  Megatron has the same constraint and pads the vocabulary to
a multiple of the tensor-parallel size (``make_vocab_size_divisible_by``); under
``loss_parallel()`` an uneven vocabulary runs as table ops instead, with the same
all-reduces (``parallel/tp_loss_compose.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import _reduction as _legacy

from ...sim_mesh import collectives as C
from .. import layout
from ..placement import Partial, Replicate, Shard
from .cross_entropy_forms import cross_entropy_other_forms
from .loss_pricing import cross_entropy_cost
from .samples import Sample
from .strategy import combine
from .table import TABLE, register
from ._util import broadcast_shapes

R = Replicate()
P = Partial("sum")


def _cdim(ndim: int) -> int:
    return 1 if ndim >= 2 else 0


def _tdim(d: int, cdim: int) -> int:
    """The target dim that meets logits dim d (d != class dim)."""
    return d if d < cdim else d - 1


def ce_options(x, t, reduction):
    cdim = _cdim(x.ndim)
    opts = [((R, R), (R,), "replicated")]
    for d in range(x.ndim):
        if d == cdim or x.shape[d] <= 1:
            continue
        td = _tdim(d, cdim)
        if reduction == "none":
            opts.append(((Shard(d), Shard(td)), (Shard(td),), f"rows (dim {d}) sharded"))
        elif reduction == "sum":
            opts.append(((Shard(d), Shard(td)), (P,), f"rows (dim {d}) sharded: partial sums"))
        else:
            opts.append(((Shard(d), R), (P,), f"rows (dim {d}) sharded: partial sums over "
                         "the global count (counted from the replicated target)"))
            opts.append(((Shard(d), Shard(td)), (P,), f"rows (dim {d}) sharded: partial sums "
                         "over the global count (all-reduced)"))
    if x.shape[cdim] > 1:
        opts.append(((Shard(cdim), R), (R,), "vocabulary parallel: max, sum of exp and "
                     "target logit all-reduced inside the op"))
    return opts


def _rows_split_alike(xs, ts, cdim) -> bool:
    """Each row dim of the target is split by the same mesh dims as the logits' (or by
    none: then each rank keeps its rows of the replicated target)."""
    for td in {p.dim for p in ts if p.is_shard()}:
        d = td + (td >= cdim)                           # the logits dim it meets
        if [j for j, p in enumerate(xs) if p.is_shard(d)] != \
                [j for j, p in enumerate(ts) if p.is_shard(td)]:
            return False
    return True


def cross_entropy_rule(x, t, *, reduction="mean", **_):
    """cross_entropy: rows sharded -> S / P(sum); classes sharded -> vocabulary parallel."""
    mesh, cdim = x.mesh, _cdim(x.ndim)
    out_shape = t.shape if reduction == "none" else ()
    keep = []
    for st in combine(mesh.ndim, [ce_options(x, t, reduction)] * mesh.ndim, 2):
        xs, ts = st.inputs
        if not _rows_split_alike(xs, ts, cdim):
            continue
        inside = any(p.is_shard(cdim) for p in xs) or \
            (reduction == "mean" and any(p.is_shard() for p in ts))
        if inside and not (layout.is_even(x.shape, mesh, xs) and layout.is_even(t.shape, mesh, ts)
                           and layout.is_even(out_shape, mesh, st.outputs[0])):
            continue                                    # collectives inside need even shards
        keep.append(st)
    return keep


def _bcast(nd, *xs):
    lead = broadcast_shapes(*[x.shape[:nd] for x in xs])
    return [x.expand(lead + tuple(x.shape[nd:])) for x in xs]


def _own_rows(nd, ctx, x, t, cdim):
    """Where the logits' rows are split but the target is replicated, keep this rank's
    rows of the target (its offsets along that dim)."""
    xspec, tspec = ctx.in_specs
    for d in range(x.dim() - nd):
        td = _tdim(d, cdim)
        if d == cdim or not any(p.is_shard(d) for p in xspec.placements) or \
                any(p.is_shard(td) for p in tspec.placements):
            continue
        n_loc = x.shape[nd + d]
        shape = [1] * (t.dim() - nd)
        shape[td] = n_loc
        off = ctx.offsets(xspec, d, like=x).reshape(tuple(x.shape[:nd]) + (1,) * (t.dim() - nd))
        # (lead, 1.., n_loc, 1..); on the offsets' device (meta in a dry run)
        rows = off + torch.arange(n_loc, device=off.device).view(tuple(shape))
        t, rows = _bcast(nd, t, rows)
        size = list(t.shape)
        size[nd + td] = n_loc
        t = t.gather(nd + td, rows.expand(size))
    return t


class _GatherKeepIndex(torch.autograd.Function):
    """x.gather(dim, idx) whose backward keeps only idx and x's shape (ATen's gather saves
    x itself): the target logits of Megatron's vocab-parallel cross-entropy, which keeps
    just the softmax for backward.  The gradient is ATen's gather_backward: a
    scatter_add of the output gradient into zeros."""

    @staticmethod
    def forward(ctx, x, dim, idx):
        ctx.save_for_backward(idx)
        ctx.dim, ctx.shape, ctx.dtype = dim, x.shape, x.dtype
        return x.gather(dim, idx)

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        out = torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device)
        return out.scatter_add(ctx.dim, idx, grad), None, None


def _vocab_parallel_losses(nd, ctx, x, t, axes, cdim, ignore_index, label_smoothing):
    """Megatron's vocab_parallel_cross_entropy on stacked shards: per-row losses."""
    mesh, xspec = ctx.mesh, ctx.in_specs[0]
    c, v_loc, v = nd + cdim, x.shape[nd + cdim], xspec.shape[cdim]
    m = x.detach().amax(c, keepdim=True)                  # stop-gradient, as Megatron
    for a in axes:
        m = C.all_reduce(m, mesh, a, "max", label="cross_entropy: global max logit")
    s = torch.exp(x - m).sum(c, keepdim=True)
    for a in axes:
        s = C.all_reduce(s, mesh, a, "sum", label="cross_entropy: sum of exp")
    lse = (torch.log(s) + m).squeeze(c)                   # (lead, N, d..)
    off = ctx.offsets(xspec, cdim, like=x).reshape(tuple(x.shape[:nd]) + (1,) * (t.dim() - nd))
    loc = t - off
    mine = (loc >= 0) & (loc < v_loc) & (t != ignore_index)
    xb, idx = _bcast(nd, x, torch.where(mine, loc, 0))
    z = _GatherKeepIndex.apply(xb, c, idx.unsqueeze(c)).squeeze(c)
    z = torch.where(mine, z, z.new_zeros(()))              # only the owner contributes
    for a in axes:
        z = C.all_reduce(z, mesh, a, "sum", label="cross_entropy: target logit")
    loss = lse - z
    if label_smoothing:                                   # eps * (lse - mean_c z_c)
        zs = x.sum(c)
        for a in axes:
            zs = C.all_reduce(zs, mesh, a, "sum", label="cross_entropy: sum of logits")
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - zs / v)
    return torch.where(t != ignore_index, loss, loss.new_zeros(()))


def _row_losses(nd, x, t, cdim, ignore_index, label_smoothing):
    """Per-row losses of whole rows: torch's kernel with the device axes folded into N."""
    x, t = _bcast(nd, x, t)
    lead = tuple(t.shape[:nd])
    xf = x.reshape((-1, x.shape[-1])) if cdim == 0 else x.flatten(0, nd)
    tf = t.reshape(-1) if cdim == 0 else t.flatten(0, nd)
    out = F.cross_entropy(xf, tf, reduction="none", ignore_index=ignore_index,
                          label_smoothing=label_smoothing)
    return out.reshape(lead + tuple(t.shape[nd:]))


def _sum_local(nd, x):
    """Sum over the local dims, keeping the device axes (x.sum(()) would sum them all)."""
    return x.sum(tuple(range(nd, x.dim()))) if x.dim() > nd else x.to(torch.promote_types(
        x.dtype, torch.int64) if not x.dtype.is_floating_point else x.dtype)


def _cross_entropy_local(nd, ctx, x, t, *, reduction, ignore_index, label_smoothing):
    if ctx is None:                                                     # output shapes only
        return F.cross_entropy(x, t, reduction=reduction, ignore_index=ignore_index)
    mesh, (xspec, tspec) = ctx.mesh, ctx.in_specs
    cdim = _cdim(xspec.ndim)
    v = xspec.shape[cdim]
    bad = ((t < 0) | (t >= v)) & (t != ignore_index)
    if not t.is_meta and bool(bad.any()):
        raise IndexError(f"cross_entropy: target {int(t[bad][0])} is out of bounds for "
                         f"{v} classes (and not ignore_index={ignore_index})")
    given = t
    t = _own_rows(nd, ctx, x, t, cdim)
    axes = [i for i, p in enumerate(xspec.placements) if p.is_shard(cdim)]
    if axes:
        loss = _vocab_parallel_losses(nd, ctx, x, t, axes, cdim, ignore_index, label_smoothing)
    else:
        loss = _row_losses(nd, x, t, cdim, ignore_index, label_smoothing)
    if reduction == "none":
        return loss
    total = _sum_local(nd, loss)
    if reduction == "sum":
        return total
    count = _sum_local(nd, given != ignore_index)
    for a, p in enumerate(tspec.placements):
        if p.is_shard():
            count = C.all_reduce(count, mesh, a, "sum",
                                 label="cross_entropy: global count of targets")
    return total / count


def _cross_entropy_parse(x, t, weight=None, size_average=None, ignore_index=-100, reduce=None,
                         reduction="mean", label_smoothing=0.0):
    if weight is not None:
        raise NotImplementedError("cross_entropy on DistTensors: class weights (weight=) are "
                                  "not supported; leave weight=None")
    if not (x.dtype.is_floating_point or x.dtype.is_complex):
        # torch's log_softmax has no integer kernel (the meta check does not see it): an
        # integer input raised there and returned a loss here (seed 970628)
        name = {torch.int64: "Long", torch.int32: "Int", torch.bool: "Bool"}.get(
            x.dtype, str(x.dtype))
        raise NotImplementedError(f'"log_softmax_lastdim_kernel_impl" not implemented for '
                                  f"'{name}': cross_entropy takes float logits. Fix: "
                                  "x.float() (or x.to(torch.float32)) first")
    if t.dtype.is_floating_point:
        raise NotImplementedError("cross_entropy on DistTensors: class-probability targets "
                                  "are not supported; give class indices (int64)")
    if size_average is not None or reduce is not None:
        reduction = _legacy.legacy_get_string(size_average, reduce)
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"cross_entropy: reduction={reduction!r}; use 'none', 'mean' or 'sum'")
    return (x, t), {"reduction": reduction, "ignore_index": int(ignore_index),
                    "label_smoothing": float(label_smoothing)}


# log_softmax (5 FLOPs per logit, see reduction.py) then the pick of the target;
# backward 2 x forward (the convention of costs.py); the clock prices it at a profile's
# measured rate of the loss where there is one (loss_pricing.py)
register("cross_entropy", [F.cross_entropy], parse=_cross_entropy_parse, rule=cross_entropy_rule,
         local=_cross_entropy_local, cost=cross_entropy_cost, op_class="loss",
         sample=lambda g: [Sample(F.cross_entropy, (g.rn(5, 7), g.ints(5, lo=0, hi=7))),
                           Sample(F.cross_entropy, (g.rn(4, 5, 3), g.ints(4, 3, lo=0, hi=5)),
                                  {"reduction": "sum"})])
# probability targets and class weights: composed of table ops (cross_entropy_forms.py)
TABLE["cross_entropy"].extra["other_form"] = cross_entropy_other_forms
