"""Losses and similarities composed of ops in the table (each keeps its own rule, cost
and trace event), with ``F.mse_loss`` / ``F.nll_loss`` (``composites.py``):

    F.l1_loss                        |x - y|
    F.smooth_l1_loss(beta)           0.5 d^2 / beta where d = |x - y| < beta, else d - beta / 2
    F.huber_loss(delta)              0.5 d^2 where d < delta, else delta (d - delta / 2)
    F.binary_cross_entropy_with_logits
                                     (1 - y) x + (1 + (pw - 1) y) (log1p(exp(-|x|)) + max(-x, 0))
                                     (the log-sum-exp trick of PyTorch's kernel; times weight)
    F.binary_cross_entropy           -(y log x + (1 - y) log(1 - x)), each log at least -100
    F.kl_div                         y (log y - x), 0 where y = 0 (log_target: e^y (y - x))
    F.softmin(dim)                   softmax(-x)
    F.cosine_similarity(dim, eps)    sum((x1 / max(|x1|, eps)) (x2 / max(|x2|, eps)))
                                     (the max outside autograd, as torch's kernel)

(the formulas of the PyTorch documentation of each function). torch's own checks run
first on meta tensors of the global shapes. The value and the gradient are those of the
composition, equal to torch's fused kernels up to rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .blas import cpu_check, torch_check
from .composites import _reduce
from .vector_norm import vector_norm

__all__ = ["LOSSES"]


def _legacy(fn, size_average, reduce):
    if size_average is not None or reduce is not None:
        raise NotImplementedError(f"{fn} on DistTensors: size_average / reduce are "
                                  "deprecated and not supported; use reduction=")


def _float_input(fn, input):
    """torch's kernels of these losses run on floating inputs only."""
    if not (input.dtype.is_floating_point or input.dtype.is_complex):
        raise NotImplementedError(f"{fn}: not implemented for "
                                  f"'{str(input.dtype).replace('torch.', '').capitalize()}' "
                                  "input (as torch's kernel); cast it to a float dtype")


def _diff(fn, input, target):
    """``input - target`` (torch's size-mismatch warning comes from its own function,
    called on meta tensors by :func:`torch_check`)."""
    return input - target


def l1_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    """``F.l1_loss``: ``|input - target|`` reduced."""
    _legacy("l1_loss", size_average, reduce)
    if weight is not None:
        raise NotImplementedError("l1_loss(weight=...) on DistTensors: multiply the "
                                  "reduction='none' loss by the weight instead")
    cpu_check(F.l1_loss, input, target, reduction=reduction)
    torch_check(F.l1_loss, input, target, reduction=reduction)
    return _reduce(_diff("l1_loss", input, target).abs(), reduction, "l1_loss")


# each loss runs torch's CPU kernel on cut stand-ins first (blas.cpu_check): its dtype
# checks, which the meta kernels skip (smooth_l1_loss of a complex, bce of a float32 input
# and a float64 target, bce_with_logits of a bool: the wide random sweep, sweep11)


def _quadratic_below(d, limit, scale_sq, linear):
    """``linear`` where ``d >= limit``, else ``d^2 scale_sq`` (a NaN ``d`` takes the square's
    side, as torch's backward kernels: their gradient is NaN there).  The square is of 0
    where the linear side is taken: its gradient is 0 there, not 0 * inf = nan at an
    infinite ``d`` (seed 2006376 wide: the target's gradient of smooth_l1_loss(-inf, y) was
    nan)."""
    above = d >= limit
    q = torch.where(above, 0, d)
    return torch.where(above, linear, q * q * scale_sq)


def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean",
                   beta=1.0):
    """``F.smooth_l1_loss``: quadratic below ``beta``, linear above (beta=0: l1)."""
    _legacy("smooth_l1_loss", size_average, reduce)
    if beta < 0:                      # (torch's kernel checks it; its meta kernel does not)
        raise RuntimeError("smooth_l1_loss does not support negative values for beta.")
    cpu_check(F.smooth_l1_loss, input, target, reduction=reduction, beta=beta)
    torch_check(F.smooth_l1_loss, input, target, reduction=reduction, beta=beta)
    if torch.bool in (input.dtype, target.dtype):   # torch promotes; bool - x raises (the
        dt = torch.promote_types(input.dtype, target.dtype)        # wide sweep, seed 2003341)
        input, target = input.to(dt), target.to(dt)
    d = _diff("smooth_l1_loss", input, target).abs()
    loss = d if beta == 0 else _quadratic_below(d, beta, 0.5 / beta, d - 0.5 * beta)
    return _reduce(loss, reduction, "smooth_l1_loss")


def huber_loss(input, target, reduction="mean", delta=1.0, weight=None):
    """``F.huber_loss``: ``0.5 d^2`` below ``delta``, ``delta (d - delta / 2)`` above."""
    if weight is not None:
        raise NotImplementedError("huber_loss(weight=...) on DistTensors: multiply the "
                                  "reduction='none' loss by the weight instead")
    cpu_check(F.huber_loss, input, target, reduction=reduction, delta=delta)
    torch_check(F.huber_loss, input, target, reduction=reduction, delta=delta)
    _float_input("huber_loss", input)
    common = torch.promote_types(input.dtype, target.dtype)
    if not torch.can_cast(common, input.dtype):
        raise RuntimeError(f"result type {str(common).replace('torch.', '').capitalize()} "
                           f"can't be cast to the desired output type "
                           f"{str(input.dtype).replace('torch.', '').capitalize()}")  # torch's
    d = _diff("huber_loss", input, target).abs()
    return _reduce(_quadratic_below(d, delta, 0.5, (d - 0.5 * delta) * delta), reduction,
                   "huber_loss").to(input.dtype)      # torch's kernel: the input's dtype


def _softplus_neg(x):
    """``softplus(-x)`` = ``log1p(exp(-|x|)) + relu(-x)`` (no exp of a positive number), by
    the sign of ``x``: the same values, and at ``x = 0`` the derivative ``sigmoid(0) - 1``
    of torch's kernel, where |x|'s and relu's were 0 (bce_with_logits(0, 0.5) had gradient
    0.5, torch's 0: seed 2008353 wide).  Each side reads ``x`` only where it is taken (0
    elsewhere: no exp(+inf) * 0 = nan in the gradient)."""
    pos = x >= 0                                   # NaN: the negative side, NaN either way
    xp, xn = torch.where(pos, x, 0), torch.where(pos, 0, x)
    return torch.where(pos, torch.log1p(torch.exp(-xp)), torch.log1p(torch.exp(xn)) - xn)


def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None,
                                     reduce=None, reduction="mean", pos_weight=None):
    """``F.binary_cross_entropy_with_logits`` (stable: no exp of a positive number)."""
    _legacy("binary_cross_entropy_with_logits", size_average, reduce)
    cpu_check(F.binary_cross_entropy_with_logits, input, target, weight,
              reduction=reduction, pos_weight=pos_weight)
    ref = torch_check(F.binary_cross_entropy_with_logits, input, target, weight,
                      reduction=reduction, pos_weight=pos_weight)
    _float_input("binary_cross_entropy_with_logits", input)
    soft = _softplus_neg(input)
    if pos_weight is not None:
        soft = soft * ((pos_weight - 1) * target + 1)
    loss = (1 - target) * input + soft
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction, "binary_cross_entropy_with_logits").to(ref.dtype)


class _GradOnly(torch.autograd.Function):
    """Value 0 (``t * 0``), gradient ``grad * slope`` to ``t``: a gradient that the value's
    composition cannot give (0 * inf in the value would be nan)."""

    @staticmethod
    def forward(ctx, t, slope):
        ctx.save_for_backward(slope)
        return t * 0

    @staticmethod
    def backward(ctx, grad):
        (slope,) = ctx.saved_tensors
        return grad * slope, None


def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None,
                         reduction="mean"):
    """``F.binary_cross_entropy``: ``-(y log x + (1 - y) log(1 - x))``, each log clamped
    at -100 (as torch's kernel, so that x = 0 or 1 gives a finite loss)."""
    _legacy("binary_cross_entropy", size_average, reduce)
    cpu_check(F.binary_cross_entropy, input, target, weight, reduction=reduction)
    ref = torch_check(F.binary_cross_entropy, input, target, weight, reduction=reduction)
    _float_input("binary_cross_entropy", input)
    x = input.detach()
    whole = x.full() if hasattr(x, "placements") else x
    if not bool(((whole >= 0) & (whole <= 1)).all()):     # a NaN too (sweep11 seed 2000267)
        raise RuntimeError("all elements of input should be between 0 and 1 (torch's "
                           "binary_cross_entropy check; a NaN fails it): pass probabilities, "
                           "e.g. input.sigmoid(), or use binary_cross_entropy_with_logits")
    t = target.detach() if getattr(target, "requires_grad", False) else target
    loss = -(t * torch.log(x).clamp_min(-100.0) + (1 - t) * torch.log(1 - x).clamp_min(-100.0))
    if t is not target:
        # the target's gradient is torch's (derivatives.yaml binary_cross_entropy_target_
        # backward): -grad logit(x), unclamped: +-inf at x = 0 or 1, where the clamped
        # logs' gave -+100 (sweep11 seed 2000267 wide); a term of value 0
        loss = loss + _GradOnly.apply(target, -torch.logit(x))
    # the input's gradient is torch's kernel's (Loss.cpp binary_cross_entropy_backward):
    # grad (x - y) / max((1 - x) x, EPSILON = 1e-12), finite at x = 0 or 1, where the
    # clamped log's gave 0 * inf = nan (sweep11 seeds 2000323, 2000418 wide); the term adds
    # 0 to the value
    slope = (x - target.detach()) / ((1 - x) * x).clamp_min(1e-12)
    loss = loss + (input - x) * slope
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction, "binary_cross_entropy").to(ref.dtype)


def kl_div(input, target, size_average=None, reduce=None, reduction="mean",
           log_target=False):
    """``F.kl_div``: ``target (log target - input)`` pointwise (input holds log-probs)."""
    _legacy("kl_div", size_average, reduce)
    cpu_check(F.kl_div, input, target, reduction=reduction, log_target=log_target)
    torch_check(F.kl_div, input, target, reduction=reduction, log_target=log_target)
    if log_target:
        loss = torch.exp(target) * (target - input)
    else:
        loss = torch.xlogy(target, target) - target * input
    if reduction == "batchmean":
        return loss.sum() / (input.shape[0] if input.ndim else 1)
    return _reduce(loss, reduction, "kl_div")


def softmin(input, dim=None, _stacklevel=3, dtype=None):
    """``F.softmin``: ``softmax(-input)``."""
    if dim is None:
        raise TypeError("softmin(dim=None) on a DistTensor: give the dim, e.g. "
                        "softmin(x, dim=-1)")
    return torch.softmax(-input, dim, dtype=dtype)


def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """``F.cosine_similarity``: each input divided by its norm (at least eps), summed
    products over ``dim``. As torch's kernel, the norms are clamped outside autograd:
    the gradient flows through the unclamped norm (a vector below eps included)."""
    torch_check(F.cosine_similarity, x1, x2, dim, eps)
    common = torch.promote_types(x1.dtype, x2.dtype)
    if not common.is_floating_point:
        raise RuntimeError(f"expected common dtype to be floating point, yet common dtype "
                           f"is {str(common).replace('torch.', '').capitalize()}")  # torch's
    x1, x2 = (x if x.dtype.is_floating_point else x.to(common) for x in (x1, x2))
    # torch's kernel expands both first (expand_outplace): each norm is over the broadcast
    # dim (a (1, 1) x2 against a (3, 9) x1 was normed over 1 element, not 9: sweep11)
    shape = torch.broadcast_shapes(tuple(x1.shape), tuple(x2.shape))
    x1, x2 = (x if tuple(x.shape) == shape else x.expand(shape) for x in (x1, x2))
    n1, n2 = (_clamped_outside_autograd(vector_norm(x, 2, dim, keepdim=True), eps)
              for x in (x1, x2))
    return ((x1 / n1) * (x2 / n2)).sum(dim)


def _clamped_outside_autograd(n, eps):
    """``n.clamp_min(eps)`` in value, ``n`` in gradient (torch clamps in place under
    no_grad)."""
    return n + (n.clamp_min(eps) - n).detach()


LOSSES = {F.binary_cross_entropy: binary_cross_entropy, F.l1_loss: l1_loss, F.smooth_l1_loss: smooth_l1_loss, F.huber_loss: huber_loss,
          F.binary_cross_entropy_with_logits: binary_cross_entropy_with_logits,
          F.kl_div: kl_div, F.softmin: softmin, F.cosine_similarity: cosine_similarity,
          torch.cosine_similarity: cosine_similarity}
