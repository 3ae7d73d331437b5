"""``F.cross_entropy``'s other forms on DistTensors, composed of ops in the table (each
keeps its own rule, cost and trace event): class-probability targets, and class weights
(``weight=``), with ``label_smoothing``.  Class indices without weights stay the
``cross_entropy`` op (:mod:`.cross_entropy`, vocabulary parallel included).

The formulas are torch's (torch 2.13, ``aten/src/ATen/native/LossNLL.cpp``):

* probabilities: ``t' = t (1 - eps) + eps / C``; ``loss = -sum_c w_c t'_c log_softmax(x)_c``;
  "mean" divides the sum by the number of samples ``numel / C`` (not by the weights);
* indices with weights: ``nll = -w[t] log_softmax(x)[t]`` where ``t != ignore_index``,
  "mean" divides by ``sum w[t]`` over those; with ``eps``, ``(1 - eps) nll + eps / C
  smooth`` where ``smooth = -sum_c w_c log_softmax(x)_c`` (0 where ignored), "mean"
  dividing both by the same ``sum w[t]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import _reduction as _legacy

from ..placement import Replicate

__all__ = ["cross_entropy_other_forms"]

_TYPE = {torch.float64: "Double", torch.float32: "Float", torch.float16: "Half",
         torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int"}  # c10's names


def _meta(t):
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


def _parse(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
           reduction="mean", label_smoothing=0.0):
    if size_average is not None or reduce is not None:
        reduction = _legacy.legacy_get_string(size_average, reduce)
    return input, target, weight, int(ignore_index), reduction, float(label_smoothing)


def cross_entropy_other_forms(args, kwargs):
    """The value of ``F.cross_entropy(*args, **kwargs)`` for probability targets or class
    weights; ``NotImplemented`` for the forms the ``cross_entropy`` op runs itself."""
    x, t, w, ignore, reduction, eps = _parse(*args, **kwargs)
    soft = t.dtype.is_floating_point
    if not soft and w is None:
        return NotImplemented
    c = x.shape[0 if x.ndim == 1 else 1]
    if w is not None and tuple(w.shape) != (c,):      # torch's message (meta: another)
        raise RuntimeError(f"weight tensor should be defined either for all {c} classes or "
                           f"no classes but got weight tensor of shape: {list(w.shape)}")
    if not soft:       # nll_loss's checks (the meta call below makes neither)
        if w.dtype != x.dtype:
            raise RuntimeError(f"expected scalar type {_TYPE.get(x.dtype, x.dtype)} but found "
                               f"{_TYPE.get(w.dtype, w.dtype)}")
        if w.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("The function 'nll_loss_forward' is not differentiable with "
                               "respect to argument 'weight'. This input cannot have "
                               "requires_grad True.")
    F.cross_entropy(_meta(x), _meta(t), None if w is None else _meta(w), ignore_index=ignore,
                    reduction=reduction, label_smoothing=eps)       # torch's own checks
    one = x.ndim == 1
    if one:                                  # (C,) logits: a batch of one
        x, t = x.unsqueeze(0), t.unsqueeze(0)
    logp = F.log_softmax(x, dim=1)
    w_ = None if w is None else w.to(logp.dtype).reshape((c,) + (1,) * (x.ndim - 2))
    if soft:
        if eps > 0:
            t = t * (1 - eps) + eps / c
        prod = logp * t if w_ is None else logp * t * w_
        if reduction == "mean":
            return -prod.sum() / (x.numel() // c) if x.numel() else -prod.sum() * float("nan")
        if reduction == "sum":
            return -prod.sum()
        loss = -prod.sum(1)
        return loss.squeeze(0) if one else loss
    keep = t != ignore
    safe = torch.where(keep, t, torch.zeros((), dtype=t.dtype))
    picked = torch.gather(logp, 1, safe.unsqueeze(1)).squeeze(1)
    wt = torch.gather(torch.zeros_like(logp) + w_, 1, safe.unsqueeze(1)).squeeze(1)
    zero = torch.zeros((), dtype=logp.dtype)
    wt = torch.where(keep, wt, zero)
    nll = -(picked * wt)
    if eps > 0:
        smooth = torch.where(keep, -(logp * w_).sum(1), zero)
    if reduction == "none":
        loss = nll if eps == 0 else (1 - eps) * nll + (eps / c) * smooth
        return loss.squeeze(0) if one else loss
    total = nll.sum() if eps == 0 else (1 - eps) * nll.sum() + (eps / c) * smooth.sum()
    if reduction != "mean":
        return total
    ps = getattr(total, "placements", ())
    if any(p.is_partial() for p in ps):
        # the sum first (one scalar all-reduce, the one reading the loss would make): a
        # batch whose every target is ignored (a padded micro-batch) divides 0 by 0, nan
        # as torch gives it, which the partial parts over 0 cannot give (the rule refuses)
        total = total.redistribute(total.mesh, [Replicate() if p.is_partial() else p
                                                for p in ps])
    return total / wt.sum()
