"""AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization",
Algorithm 2), as one in-place step over lists of tensors:

    p   <- p * (1 - lr * weight_decay)                 # decoupled decay
    m   <- beta1 * m + (1 - beta1) * g                 # first moment
    v   <- beta2 * v + (1 - beta2) * g^2               # second moment
    p   <- p - lr * m_hat / (sqrt(v_hat) + eps)     # m_hat = m / (1 - beta1^t),
                                                    # v_hat = v / (1 - beta2^t)

``step`` is t, counted from 1 (the step being taken).  The fused kernel reads
p, g, m, v and writes p, m, v once per element; the unfused composition below
runs nine element-wise kernels.  Not differentiable: an optimizer step runs
under ``torch.no_grad``.  :class:`AdamW` wraps the functional step as a
``torch.optim.Optimizer``.
"""
from __future__ import annotations

import math
import numbers
from collections import defaultdict
from typing import Sequence

import torch
from torch.overrides import handle_torch_function, has_torch_function

from ..npu.guard import check_dtype
from .cost import OpCost
from .registry import dispatch, register, register_cost

__all__ = ["adamw", "AdamW"]

_OP = "adamw"
_FUSED_DEVICES = ("cpu", "cuda")    # where torch._fused_adamw_ has kernels


def adamw(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
          exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], step: int, *,
          lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.01) -> None:
    """One AdamW step, in place on ``params``, ``exp_avgs`` and ``exp_avg_sqs``."""
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    tensors = tuple(t for seq in lists for t in seq)
    if has_torch_function(tensors):
        return handle_torch_function(adamw, tensors, params, grads, exp_avgs, exp_avg_sqs, step,
                                     lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                     weight_decay=weight_decay)
    _check(lists, step, lr, beta1, beta2, eps, weight_decay)
    with torch.no_grad():
        dispatch(_OP, tensors)(*(list(s) for s in lists), int(step), float(lr), float(beta1),
                               float(beta2), float(eps), float(weight_decay))


def _check(lists, step, lr, beta1, beta2, eps, weight_decay) -> None:
    _check_lists(lists)
    _check_numbers(step, lr, beta1, beta2, eps, weight_decay)


def _check_numbers(step, lr, beta1, beta2, eps, weight_decay) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"{_OP}: step={step!r}; it counts steps from 1 (the step being taken)")
    for name, value, lo, hi in (("lr", lr, 0, math.inf), ("beta1", beta1, 0, 1),
                                ("beta2", beta2, 0, 1), ("eps", eps, 0, math.inf),
                                ("weight_decay", weight_decay, 0, math.inf)):
        real = isinstance(value, numbers.Real) and not isinstance(value, bool) or (
            isinstance(value, torch.Tensor) and value.numel() == 1
            and value.dtype.is_floating_point)          # (a str gave "'<=' not supported")
        if not real:
            raise TypeError(f"{_OP}: {name}={value!r}; give a real number (e.g. lr=1e-3)")
        if not lo <= value < hi:
            raise ValueError(f"{_OP}: {name}={value}; it must be in [{lo}, {hi})")


def _check_lists(lists) -> None:
    """One (param, grad, exp_avg, exp_avg_sq) per parameter, alike in shape, dtype, device
    (the op's check and its cost's: a cost of lists the op refuses would be a wrong number)."""
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs")
    lengths = {n: len(s) for n, s in zip(names, lists)}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{_OP}: the four lists must have one entry per parameter, got {lengths}")
    for i, group in enumerate(zip(*lists)):
        for n, t in zip(names, group):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"{_OP}: {n}[{i}] must be a floating-point tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
            if t.shape != group[0].shape:
                raise ValueError(f"{_OP}: {n}[{i}].shape={tuple(t.shape)} differs from "
                                 f"params[{i}].shape={tuple(group[0].shape)}")
            # checked before any write: torch._fused_adamw_ refuses a mixed group only
            # after it has stepped the tensors before it ("expected scalar type Float but
            # found Double"), and the other paths would mix precisions silently
            if t.dtype != group[0].dtype or t.device != group[0].device:
                raise TypeError(f"{_OP}: {n}[{i}] is {t.dtype} on {t.device} but params[{i}] "
                                f"is {group[0].dtype} on {group[0].device}; a parameter's "
                                f"gradient and states share its dtype and device (as "
                                f"torch.optim.AdamW keeps them): cast with "
                                f"{n}[{i}].to(params[{i}])")


@register(_OP, "reference")
def _reference(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, wd):
    """Algorithm 2 line by line, one parameter at a time, in float32 (the fused
    kernels' math type for float16/bfloat16 parameters), written back in place."""
    bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        ct = torch.promote_types(p.dtype, torch.float32)
        pf, gf, mf, vf = (t.to(ct) for t in (p, g, m, v))
        pf = pf * (1 - lr * wd)                          # decoupled weight decay
        mf = beta1 * mf + (1 - beta1) * gf
        vf = beta2 * vf + (1 - beta2) * gf * gf
        m_hat, v_hat = mf / bias1, vf / bias2            # bias correction
        pf = pf - lr * m_hat / (v_hat.sqrt() + eps)
        p.copy_(pf), m.copy_(mf), v.copy_(vf)


@register(_OP, "unfused")
def _unfused(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, wd):
    """Nine separate element-wise kernels per parameter, in the parameter's dtype."""
    bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p.mul_(1 - lr * wd)
        m.mul_(beta1)
        m.add_(g, alpha=1 - beta1)
        v.mul_(beta2)
        v.addcmul_(g, g, value=1 - beta2)
        denom = v.sqrt()
        denom.div_(math.sqrt(bias2))
        denom.add_(eps)
        p.addcdiv_(m, denom, value=-lr / bias1)


def _foreach(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, wd):
    """Multi-tensor kernels: each line is one launch over every parameter."""
    bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(bias2))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -lr / bias1)


@register(_OP, "native")
def _native(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, wd):
    """``torch._fused_adamw_`` (one kernel per device and dtype) on CPU/CUDA for contiguous
    tensors, else the multi-tensor (foreach) kernels."""
    groups = defaultdict(list)                       # fused kernels take one device and dtype
    for i, p in enumerate(params):
        groups[(p.device, p.dtype)].append(i)
    for (device, _), idx in groups.items():
        sub = [[seq[i] for i in idx] for seq in (params, grads, exp_avgs, exp_avg_sqs)]
        if device.type in _FUSED_DEVICES and hasattr(torch, "_fused_adamw_") and _same_layout(sub):
            steps = [torch.tensor(float(step), device=device)] * len(idx)
            torch._fused_adamw_(*sub, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
            # the fused kernel writes p, m and v in place without bumping their version
            # counters (torch 2.13: torch.optim.AdamW(fused=True).step() leaves
            # p._version 0, foreach 2): bumped here, as torch.autograd.graph.
            # increment_version's docstring asks of a kernel autograd does not know
            # writes, so what reads ``_version`` to know a tensor was written (the
            # gradient ways' meeting points, reshard_backward._source and
            # gather_backward_dist._stand_in; load_back) sees the step on both paths
            torch.autograd.graph.increment_version([t for seq in sub[:1] + sub[2:]
                                                    for t in seq])
        else:
            _foreach(*sub, step, lr, beta1, beta2, eps, wd)


def _same_layout(lists) -> bool:
    """The fused kernel walks p, g, m, v as flat memory: all must be contiguous."""
    return all(t.is_contiguous() for seq in lists for t in seq)


@register(_OP, "npu")
def _npu(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, wd):
    """Multi-tensor (foreach) kernels, which torch_npu implements on the NPU.

    ``torch_npu.npu_apply_adam_w`` is not used: its bias-correction convention is
    unconfirmed (torch_npu.md).  For a whole model on Ascend,
    ``torch_npu.optim.NpuFusedAdamW`` flattens the parameters into one buffer.
    """
    for p in params:
        check_dtype(p, "wb.ops.adamw")
    _foreach(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, wd)


@register_cost(_OP)
def _cost(params, grads, exp_avgs, exp_avg_sqs, step=1, **_hyper) -> OpCost:
    _check_lists((params, grads, exp_avgs, exp_avg_sqs))
    n = sum(p.numel() for p in params)
    e = sum(p.numel() * p.element_size() for p in params) // max(n, 1)
    # unfused reads / writes per element, kernel by kernel as in _unfused:
    # mul p (1/1), mul m (1/1), add g (2/1), mul v (1/1), addcmul g (2/1),
    # sqrt (1/1), div (1/1), add eps (1/1), addcdiv (3/1)
    return OpCost(_OP, flops=14 * n, backward_flops=0,
                  bytes_fused=7 * n * e,             # read p, g, m, v; write p, m, v
                  bytes_unfused=(13 + 9) * n * e,
                  saved_bytes_fused=0, saved_bytes_unfused=0)


_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


def _refuse_unsupported(where: str, options) -> None:
    """torch.optim.AdamW options this update does not implement: refuse rather than ignore."""
    for name in _UNSUPPORTED:
        if options.get(name):
            raise ValueError(f"{where}: {name}={options[name]!r} is not supported by "
                             f"wb.ops.AdamW; use torch.optim.AdamW for {name}=True, or drop it")


class AdamW(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` running :func:`adamw` (so ``wb.ops.use`` picks its path)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, *, amsgrad: bool = False,
                 maximize: bool = False):
        _refuse_unsupported("AdamW", dict(amsgrad=amsgrad, maximize=maximize))
        # torch.optim.AdamW's checks (0 <= lr, eps, weight_decay; 0 <= beta < 1), and the
        # values finite real numbers: a NaN or infinite one would train to NaN silently
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise ValueError(f"AdamW(betas={betas!r}): give two numbers in [0, 1), e.g. "
                             "(0.9, 0.999)") from None
        for name, v, hi, eg in (("lr", lr, math.inf, "1e-3"), ("eps", eps, math.inf, "1e-8"),
                                ("weight_decay", weight_decay, math.inf, "0.01"),
                                ("betas[0]", b1, 1.0, "0.9"), ("betas[1]", b2, 1.0, "0.999")):
            ok = not isinstance(v, bool) and (isinstance(v, (int, float)) or (
                isinstance(v, torch.Tensor) and v.numel() == 1 and v.dtype.is_floating_point))
            if not ok or not 0 <= float(v) < hi:
                rng = "in [0, 1)" if hi == 1.0 else "finite and >= 0"
                raise ValueError(f"AdamW({name}={v!r}): give a real number {rng}, e.g. {eg}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # every group checked before any is stepped: a group whose options were edited
        # into bad values (param_groups[1]["lr"] = -1) raised after the groups before it had
        # stepped and its own step counts had been bumped with no update
        for group in self.param_groups:
            _refuse_unsupported("AdamW param group", group)
            beta1, beta2 = group["betas"]
            _check_numbers(1, group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError("AdamW: sparse gradients are not supported")
        for group in self.param_groups:
            by_step = defaultdict(lambda: ([], [], [], []))  # parameters at the same step
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if isinstance(state["step"], torch.Tensor):   # torch.optim.AdamW's state_dict
                    state["step"] = int(state["step"].item())
                state["step"] += 1
                lists = by_step[state["step"]]
                for seq, t in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"])):
                    seq.append(t)
            beta1, beta2 = group["betas"]
            for t, lists in by_step.items():
                adamw(*lists, t, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                      weight_decay=group["weight_decay"])
        return loss
