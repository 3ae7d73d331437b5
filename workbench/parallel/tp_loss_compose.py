"""``loss_parallel()``'s vocabulary-parallel log_softmax, nll_loss and cross-entropy of
table ops, for the layouts the fused ``cross_entropy`` op (``ops_table/cross_entropy.py``)
does not take: a vocabulary that the tp size does not divide (uneven ``torch.chunk``
shards, as PyTorch's DTensor ``Shard(-1)``), and ``log_softmax`` / ``nll_loss`` called
alone.

The algorithm is PyTorch's (``torch/distributed/tensor/parallel/loss.py``, torch 2.13:
``_log_softmax`` and ``_nll_loss_forward``, after ``torch._decomp``), itself Megatron-LM's
``vocab_parallel_cross_entropy`` (Shoeybi et al. 2019, sec. 3):

    m    = max_c x_c               local amax -> Partial(max)  -> all-reduce (max)
    lse  = m + log sum_c e^(x_c-m) local sum  -> Partial(sum)  -> all-reduce (sum)
    logp = x - lse                 stays Shard(class dim), as torch's
    pick = logp[target]            the owner's masked entry  -> all-reduce (sum): torch's
                                   _MaskPartial (each rank masks the classes it lacks)

so three all-reduces of one value per row, as torch; a fourth (the row sum of ``logp``)
with ``label_smoothing``, which torch's loss_parallel does not support.  Each step is an
op of the table (its own rule, cost and trace event; uneven shards run per cell), and
autograd differentiates the composition exactly (``m`` detached, as Megatron's), so
``log_softmax`` followed by anything has its true gradient (torch's handler returns the
output gradient unchanged, correct only when ``nll_loss`` follows it).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..sim_mesh.grid import Cells
from .dist_tensor import DistTensor, distribute_tensor
from .ops_table.cross_entropy import _cross_entropy_parse
from .placement import Replicate, Shard

__all__ = ["log_softmax", "nll_loss", "cross_entropy"]


def _settle(d: DistTensor) -> DistTensor:
    """Partial -> Replicate (the all-reduce); other placements kept."""
    ps = [Replicate() if p.is_partial() else p for p in d.placements]
    return d if list(d.placements) == ps else d.redistribute(d.mesh, ps)


def log_softmax(x: DistTensor, dim: int, md: int, dtype=None) -> DistTensor:
    """torch's loss_parallel ``_log_softmax``: two all-reduces on mesh dim ``md``, the
    output laid out as ``x`` (Shard(dim) kept)."""
    if dtype is not None:
        x = x.to(dtype)
    out_dtype, x = x.dtype, _computation(x)
    m = _settle(x.detach().amax(dim, keepdim=True))       # (.., 1, ..): max over the ranks
    shifted = x - m
    lse = _settle(torch.exp(shifted).sum(dim, keepdim=True)).log()
    out = (shifted - lse).to(out_dtype)
    key = id(out)
    _MADE[key] = (weakref.ref(out, lambda _, k=key: _MADE.pop(k, None)), out._local,
                  _versions(out._local), dim, x, lse + m)
    return out


def _versions(loc) -> tuple:
    """The version counters of a local tensor (or of each of its cells)."""
    return tuple(t._version for t in (loc.items if isinstance(loc, Cells) else (loc,)))


# log_softmax outputs -> (the output, its local tensor and version, dim, logits, lse): an
# nll_loss of one, unchanged since, picks from the logits (torch's fused backward)
_MADE: dict = {}


def _made_from(logp, cdim):
    """(logits, lse) where ``logp`` is an unchanged :func:`log_softmax` output over
    ``cdim``; else None."""
    rec = _MADE.get(id(logp))
    if rec is None or rec[0]() is not logp or logp._local is not rec[1] or \
            _versions(rec[1]) != rec[2] or rec[3] != cdim:
        return None
    return rec[4], rec[5].squeeze(cdim)


def _computation(x):
    """torch's computation dtype (``utils.elementwise_dtypes``, DEFAULT): float16 and
    bfloat16 logits computed in float32 (torch's loss_parallel ``_log_softmax`` does; in
    bfloat16 the log-probabilities were 1.7x one device's error, measured)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _class_ids(x: DistTensor, md: int) -> DistTensor:
    """arange(C) viewed (1, C, 1..) and laid out as the logits' class dim: each rank's
    slice of the vocabulary (Megatron's vocab_start_index .. vocab_end_index)."""
    c = x.shape[1]
    ps = [Shard(0) if i == md else Replicate() for i in range(x.mesh.ndim)]
    ids = distribute_tensor(torch.arange(c, device=x.device), x.mesh, ps)
    return ids.view((1, c) + (1,) * (x.ndim - 2))


def _check_targets(t, c: int, ignore_index: int):
    """torch's IndexError for a class index out of range (the mask would drop it)."""
    locs = t.cells().items if isinstance(t, DistTensor) else [t]
    for loc in locs:
        bad = ((loc < 0) | (loc >= c)) & (loc != ignore_index)
        if not loc.is_meta and bool(bad.any()):
            raise IndexError(f"cross_entropy: target {int(loc[bad][0])} is out of bounds "
                             f"for {c} classes (and not ignore_index={ignore_index})")


def _meta(t):
    return None if t is None else torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


def _torch_checks(fn, x, t, weight, **kw):
    """torch's own checks of shapes and arguments (the call on meta tensors), and
    nll_loss's checks of the weight that the meta call does not make."""
    if weight is not None:
        if weight.dtype != x.dtype:
            raise RuntimeError(f"expected scalar type {x.dtype} but found {weight.dtype} "
                               "(weight); give weight=weight.to(input.dtype)")
        if weight.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("The function 'nll_loss_forward' is not differentiable with "
                               "respect to argument 'weight'. This input cannot have "
                               "requires_grad True.")
    fn(_meta(x), _meta(t), _meta(weight), **kw)


def _target_weights(weight, safe, keep):
    """weight[target], 0 where ignored (a plain weight indexed by the target's layout)."""
    if weight is None:
        return None
    w = F.embedding(safe, weight.reshape(-1, 1)).squeeze(-1)
    return torch.where(keep, w, torch.zeros((), dtype=w.dtype))


def _reduce(loss, denom, reduction):
    if reduction == "none":
        return loss
    total = _settle(loss.sum())          # the sum first: 0 / 0 is nan, as torch's
    return total if reduction == "sum" else total / denom


def _nll_rows(logp, t, md, ignore_index):
    """(-logp[target] per row, keep mask, safe target)."""
    keep = t != ignore_index
    safe = torch.where(keep, t, torch.zeros((), dtype=t.dtype))
    hit = _class_ids(logp, md) == safe.unsqueeze(1)       # only the owner's slice matches
    zero = torch.zeros((), dtype=logp.dtype)
    picked = _settle(torch.where(hit, logp, zero).sum(1))
    return torch.where(keep, -picked, zero), keep, safe


def _batched(x, t):
    one = x.ndim == 1                     # (C,) logits, a 0-d target: a batch of one
    return (x.unsqueeze(0), t.unsqueeze(0), True) if one else (x, t, False)


def nll_loss(logp, t, md, weight=None, ignore_index=-100, reduction="mean"):
    """torch's loss_parallel ``_nll_loss_forward`` on class-sharded log-probabilities:
    one all-reduce (the masked pick)."""
    _torch_checks(F.nll_loss, logp, t, weight, ignore_index=ignore_index, reduction=reduction)
    made = _made_from(logp, 1 if logp.ndim >= 2 else 0)
    logp, t, one = _batched(logp, t)
    _check_targets(t, logp.shape[1], ignore_index)
    if made is not None:
        # -logp[t] = lse - x[t]: the gradient reaches the logits as softmax - one_hot,
        # local to each slice (torch's fused nll_loss + log_softmax backward, which it
        # gives whatever follows log_softmax; here only to an unchanged output)
        x, lse = made
        x, lse = (x.unsqueeze(0), lse.unsqueeze(0)) if one else (x, lse)
        nll, keep, safe = _lse_minus_target(x, lse, t, md, ignore_index)
        nll = nll.to(logp.dtype)
    else:
        nll, keep, safe = _nll_rows(logp, t, md, ignore_index)
    wt = _target_weights(weight, safe, keep)
    if wt is not None:
        nll = nll * wt
    loss = _reduce(nll, keep.sum() if wt is None else wt.sum(), reduction)
    return loss.squeeze(0) if one and reduction == "none" else loss


def _lse_minus_target(x, lse, t, md, ignore_index):
    """(``lse - x[target]`` per row, 0 where ignored; keep mask; safe target): the
    target logit picked by the one slice that holds it, all-reduced (torch's _MaskPartial,
    Megatron's masked target logit)."""
    keep = t != ignore_index
    safe = torch.where(keep, t, torch.zeros((), dtype=t.dtype))
    hit = _class_ids(x, md) == safe.unsqueeze(1)          # only the owner's slice matches
    zero = torch.zeros((), dtype=x.dtype)
    return torch.where(keep, lse - _settle(torch.where(hit, x, zero).sum(1)), zero), keep, safe


def _lse(x: DistTensor) -> DistTensor:
    """log sum_c e^(x_c) per row over the ranks' slices: two all-reduces; its gradient,
    softmax(x), is local to each slice (Megatron's point: no backward communication)."""
    m = _settle(x.detach().amax(1, keepdim=True))
    return (_settle(torch.exp(x - m).sum(1, keepdim=True)).log() + m).squeeze(1)


def cross_entropy(x, t, md, weight=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0):
    """F.cross_entropy of class indices on class-sharded logits, as Megatron's
    vocab_parallel_cross_entropy: ``lse - x[target]`` (never log_softmax itself, whose
    gradient would need the sum over the classes: one more all-reduce in backward).
    torch's formula with ``label_smoothing`` (aten/src/ATen/native/LossNLL.cpp,
    cross_entropy_loss_label_smoothing): ``(1 - eps) nll + eps / C * smooth``, with
    ``smooth = -sum_c w_c logp_c = lse sum_c w_c - sum_c w_c x_c`` (0 where ignored),
    "mean" dividing both by the same ``sum w[t]`` (the count of kept targets without
    weights)."""
    (x, t), kw = _cross_entropy_parse(x, t, None, None, ignore_index, None, reduction,
                                      label_smoothing)              # torch's own checks
    reduction, eps = kw["reduction"], kw["label_smoothing"]
    _torch_checks(F.cross_entropy, x, t, weight, ignore_index=ignore_index,
                  reduction=reduction, label_smoothing=eps)
    x, t, one = _batched(x, t)
    c = x.shape[1]
    _check_targets(t, c, ignore_index)
    out_dtype, x = x.dtype, _computation(x)
    zero = torch.zeros((), dtype=x.dtype)
    lse = _lse(x)
    loss, keep, safe = _lse_minus_target(x, lse, t, md, ignore_index)
    wt = _target_weights(weight, safe, keep)
    if wt is not None:
        loss = loss * wt
    if eps > 0:
        if weight is None:
            smooth = lse * c - _settle(x.sum(1))
        else:
            w_ = weight.to(x.dtype).reshape((c,) + (1,) * (x.ndim - 2))
            smooth = lse * weight.to(x.dtype).sum() - _settle((x * w_).sum(1))
        loss = (1 - eps) * loss + (eps / c) * torch.where(keep, smooth, zero)
    loss = _reduce(loss, keep.sum() if wt is None else wt.sum(), reduction).to(out_dtype)
    return loss.squeeze(0) if one and reduction == "none" else loss
