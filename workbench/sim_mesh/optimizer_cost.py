"""What an optimizer step moves through memory: the kernels torch runs, counted per
parameter element.  One source for the planner (``plan.estimate``, ``plan.dryrun``) and
the modeled clock of a simulated step (``parallel.step_clock``).

An optimizer update is elementwise and memory bound: its time on the roofline is the
bytes its kernels read and write over the memory bandwidth, plus a launch per kernel
(``kernel_cost.compute_time``).  Counted as *accesses*: tensor reads + writes per
parameter element, each of the parameter's element size (torch keeps gradients and
states in the parameter's dtype: ``torch.zeros_like(p)``).  A kernel that takes the same
tensor twice (``addcmul_(v, g, g)``) reads it once.  From torch 2.13's
``torch/optim/adam.py`` and ``sgd.py``:

* AdamW / Adam, **fused** (``fused=True``: ``torch._fused_adamw_``, one kernel; the
  course's ``wb.ops.AdamW``; apex's FusedAdam): read p, g, m, v, write p, m, v: 7
  (+2 with ``amsgrad``: max_exp_avg_sq read and written).
* AdamW / Adam, **foreach** (the default on an accelerator, ``_multi_tensor_adam``):
  ``lerp_(m, g)`` 3, ``mul_(v)`` 2, ``addcmul_(v, g, g)`` 3, ``sqrt(v)`` 2, ``div_`` 2,
  ``add_(eps)`` 2, ``addcdiv_(p, m, denom)`` 4: 18 in 7 kernels; decoupled weight decay
  (AdamW) ``mul_(p)`` +2, Adam's L2 ``add(g, p)`` +3, ``maximize`` ``neg(g)`` +2,
  ``amsgrad`` ``maximum_`` +3, one kernel each.  The step counters live on the host
  (``capturable=False``): no device work.  ``foreach=False`` (``_single_tensor_adam``)
  runs the same passes one parameter at a time: the same bytes, a launch per parameter.
* SGD, **foreach** (``_multi_tensor_sgd``): ``add_(p, g, alpha=-lr)`` 3; weight decay
  ``add(g, p)`` +3; momentum: ``mul_(buf)`` 2 + ``add_(buf, g)`` 3, or on the first step
  ``g.clone()`` 2 (one per parameter); nesterov ``add_(g, buf)`` +3; ``maximize`` +2.
* SGD, **fused** (``torch._fused_sgd_``): read p, g, write p: 3; with momentum read and
  write the buffer: 5 (first step: written only, 4).

The planner prices Megatron-LM's mixed-precision AdamW on the rank's parameters:
:data:`MIXED_ADAMW_BYTES` = 28 bytes per parameter (read the 16-bit gradient 2, read
and write the fp32 master weight, m and v 24, write the 16-bit weight 2): the fused
kernel's 7 accesses of 4 bytes, plus the 16-bit copies in place of the fp32 gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

from .kernel_cost import compute_time

__all__ = ["MIXED_ADAMW_BYTES", "StepKernels", "adam_kernels", "sgd_kernels",
           "mixed_adamw_seconds", "step_seconds"]

# bytes per parameter of Megatron-LM's mixed-precision AdamW (module docstring)
MIXED_ADAMW_BYTES = 2 + 24 + 2


@dataclass(frozen=True)
class StepKernels:
    """One optimizer step's device work per parameter element: ``accesses`` tensor reads
    + writes, in ``launches`` kernels per launch unit (``per_tensor``: a launch per
    parameter, else one per step); ``name`` says which implementation."""
    accesses: int
    launches: int
    per_tensor: bool
    name: str
    # kernels run one parameter at a time besides the foreach ones (foreach SGD's
    # first-step ``device_grads[i].detach().clone()``, torch/optim/sgd.py)
    launches_each: int = 0


def adam_kernels(*, decoupled: bool, weight_decay: float, fused: bool, foreach: bool,
                 amsgrad: bool = False, maximize: bool = False) -> StepKernels:
    """Adam (``decoupled=False``) or AdamW as torch runs it (module docstring)."""
    which = "AdamW" if decoupled else "Adam"
    if fused:
        return StepKernels(7 + (2 if amsgrad else 0), 1, False, f"{which} (fused)")
    acc, k = 18, 7                                  # lerp, mul, addcmul, sqrt, div, add, addcdiv
    if weight_decay:
        acc, k = acc + (2 if decoupled else 3), k + 1
    if maximize:
        acc, k = acc + 2, k + 1
    if amsgrad:
        acc, k = acc + 3, k + 1
    return StepKernels(acc, k, not foreach, f"{which} ({'foreach' if foreach else 'for-loop'})")


def sgd_kernels(*, momentum: float, weight_decay: float, nesterov: bool, fused: bool,
                foreach: bool, first_step: bool, maximize: bool = False) -> StepKernels:
    """SGD as torch runs it (module docstring); ``first_step``: no momentum buffer yet."""
    if fused:
        acc = 3 if not momentum else 4 if first_step else 5
        return StepKernels(acc, 1, False, "SGD (fused)")
    acc, k = 3, 1                                   # add_(p, g, alpha=-lr)
    if weight_decay:
        acc, k = acc + 3, k + 1
    if maximize:
        acc, k = acc + 2, k + 1
    each = 0
    if momentum:
        if first_step:      # the clone runs one parameter at a time, foreach or not
            acc, k, each = (acc + 2, k, 1) if foreach else (acc + 2, k + 1, 0)
        else:
            acc, k = acc + 5, k + 2
        if nesterov:
            acc, k = acc + 3, k + 1
    return StepKernels(acc, k, not foreach, f"SGD ({'foreach' if foreach else 'for-loop'})",
                       each)


def step_seconds(nbytes: float, launches: int, profile, dtype) -> float:
    """Seconds of an optimizer step moving ``nbytes`` in ``launches`` kernels."""
    return compute_time(0.0, nbytes, profile, dtype, launches=launches)


def mixed_adamw_seconds(n_params: float, profile) -> float:
    """The planner's AdamW over ``n_params`` parameters: :data:`MIXED_ADAMW_BYTES` each,
    on the roofline (one fused kernel)."""
    return compute_time(0.0, MIXED_ADAMW_BYTES * n_params, profile, "float32")
