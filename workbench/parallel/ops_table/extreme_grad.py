"""The gradients of ``amax`` / ``amin`` and of ``max()`` / ``min()`` (every dim), as torch's.

torch (``tools/autograd/derivatives.yaml``, ``FunctionsManual.cpp``, 2.13) spreads the
gradient evenly over the elements that hold the result::

    amax / amin (dim):  scale_grad_by_count(restore_reduced_dims(grad, dim, keepdim),
                                            restore_reduced_dims(result, dim, keepdim) == self, dim)
                        = (grad / mask.sum(dim, keepdim=True)) * mask,   mask = self == result
    max() / min():      evenly_distribute_backward(grad, self, result), on CPU:
                        zeros.masked_fill_(mask, grad / mask.sum()),
                        mask = isnan(self) if isnan(result) else self == result

(its CUDA / tensor-subclass branch, the one DTensor runs, is ``mask * (grad / count)``:
NaN everywhere for a NaN ``grad``; the CPU branch, the one-device reference here, gives
zeros off the mask.)

Two DistTensor answers differed (silently) before:

* a reduced dim that is sharded: the local amax splits a tie among one rank's elements,
  then the P(max) all-reduce's backward splits it again among the ranks that hold it
  (three equal maxima, two on rank 0: 1/4, 1/4, 1/2 where torch gives 1/3 each);
* ``max()`` of a tensor holding NaN: built from amax, whose gradient is NaN everywhere
  (no element equals NaN: a count of 0), where torch's ``max()`` gives the NaN elements
  an even share.

The fix is DTensor's (its backward runs torch's formula on DTensors): the backward is
torch's formula on DistTensors (the count's all-reduce is traced), through a
``torch.autograd.Function`` (``custom_function.py``'s bridge) whose output is reduced (a
P(max) output's all-reduce would split its gradient by amax's rule again).  It runs only
where the local gradients would differ: ``amax`` / ``amin`` whose reduced dims are sharded, or
whose input is Partial, and ``max()`` / ``min()`` of a tensor that requires grad.
"""
from __future__ import annotations

import torch

__all__ = ["even_extreme", "crosses_ranks", "extreme_form", "inf_norm", "no_complex_grad"]


class _EvenExtreme(torch.autograd.Function):
    """``amax`` / ``amin`` over ``dims`` (a sorted tuple of wrapped dims) with torch's
    even gradient; ``nan`` adds max()'s NaN elements to the mask."""

    @staticmethod
    def forward(ctx, x, dims, keepdim, kind, nan):
        out = (torch.amax if kind == "amax" else torch.amin)(x, dims, keepdim)
        if any(p.is_partial() for p in out.placements):
            # reduced here: a P(max) output's own all-reduce would take its gradient by
            # amax's rule again (NaN everywhere for a NaN max, split among tied ranks)
            from ..placement import Replicate
            from ..reshard import reshard
            out = reshard(out, out.mesh, [Replicate() if p.is_partial() else p
                                          for p in out.placements])
        ctx.save_for_backward(x, out)
        ctx.dims, ctx.keepdim, ctx.nan = dims, keepdim, nan
        return out

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        if not ctx.keepdim and x.ndim:                  # restore_reduced_dims
            for d in ctx.dims:
                g, out = g.unsqueeze(d), out.unsqueeze(d)
        mask = x == out
        if ctx.nan:
            mask = mask | (torch.isnan(x) & torch.isnan(out))
        count = mask.sum(ctx.dims, keepdim=True) if x.ndim else mask.sum()
        if ctx.nan:                 # max(): zeros off the mask, even for a NaN / inf grad
            gx = torch.where(mask, g / count, torch.zeros((), dtype=g.dtype))
        else:                       # amax: a NaN / inf grad times False is NaN, as torch's
            gx = (g / count) * mask
        return gx, None, None, None, None


class _InfNorm(torch.autograd.Function):
    """``vector_norm(x, +-inf, dims)`` = ``amax`` / ``amin`` of ``|x|`` with torch's gradient
    (``FunctionsManual.cpp`` ``norm_backward``, 2.13, the ``isinf(p)`` branch)::

        mask = (|x| == norm) | isnan(|x|)
        grad_x = sgn(x) * ((grad / mask.sum(dim, keepdim=True)) * mask)

    a NaN element is in the mask (the norm is NaN then, no element equals it), so the other
    elements get 0 where amax's formula gave NaN everywhere, and ``sgn(NaN)`` is 0 (torch's
    ``sign``): a NaN-holding slice gets a zero gradient; ties share it evenly, across ranks
    too (the count's all-reduce is traced)."""

    @staticmethod
    def forward(ctx, x, dims, keepdim, kind):
        out = (torch.amax if kind == "amax" else torch.amin)(x.abs(), dims, keepdim)
        if any(p.is_partial() for p in out.placements):
            from ..placement import Replicate
            from ..reshard import reshard
            out = reshard(out, out.mesh, [Replicate() if p.is_partial() else p
                                          for p in out.placements])
        ctx.save_for_backward(x, out)
        ctx.dims, ctx.keepdim = dims, keepdim
        return out

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        if not ctx.keepdim:                             # unsqueeze_multiple
            for d in ctx.dims:
                g, out = g.unsqueeze(d), out.unsqueeze(d)
        a = x.abs()
        mask = (a == out) | torch.isnan(a)
        count = mask.sum(ctx.dims, keepdim=True)
        return torch.sign(x) * ((g / count) * mask), None, None, None


def inf_norm(x, dims, keepdim, kind):
    """``amax(|x|)`` (``kind`` "amax", ord inf) or ``amin(|x|)`` (-inf) of the real
    DistTensor ``x`` over ``dims`` (sorted, wrapped, not empty), torch's gradient
    (:class:`_InfNorm`)."""
    return _InfNorm.apply(x, tuple(dims), bool(keepdim), kind)


def no_complex_grad(name, x, kernel=None) -> None:
    """torch's refusal of a complex output that requires grad for an op whose derivative
    is real-only (``amax``, ``cummax``, ``kthvalue``...; tools/autograd/gen_variable_type.py
    GRADIENT_IMPLEMENTED_FOR_COMPLEX lacks them): after the kernel's own checks
    (``kernel``, run on a cut stand-in of ``x``: ops_table/blas.cpu_check), where ``x``
    requires grad under grad mode and is complex."""
    if not (x.dtype.is_complex and x.requires_grad and torch.is_grad_enabled()):
        return
    if kernel is not None:
        from .blas import cpu_check
        cpu_check(kernel, x)
    raise RuntimeError(f"{name} does not support automatic differentiation for outputs "
                       "with complex dtype.")


def crosses_ranks(x, dims) -> bool:
    """True when an extreme of ``x`` (a DistTensor) over ``dims`` (wrapped) is taken across
    ranks: a reduced dim sharded, or a Partial input."""
    return any(p.is_partial() or p.is_shard() and p.dim in dims for p in x.placements)


def even_extreme(x, dims, keepdim, kind, nan=False):
    """``amax`` (``kind``) of the DistTensor ``x`` over ``dims`` (a sorted tuple of
    wrapped dims, every dim when empty) with torch's gradient (module docstring).  A
    complex ``x`` raises as torch: its kernel's error (a complex amax is not implemented),
    else, where the kernel has nothing to compare (an empty ``x``), autograd's (the
    Function's forward runs without it: a result, seed 2007734 wide)."""
    dims = tuple(dims) if dims else tuple(range(x.ndim))
    if x.dtype.is_complex:
        no_complex_grad(kind if not nan else kind[1:], x, lambda t: (
            getattr(torch, kind[1:])(t) if nan else getattr(torch, kind)(t, dims, keepdim)))
    return _EvenExtreme.apply(x, dims, bool(keepdim), kind, nan)


def extreme_form(kind, parse):
    """The op table's ``other_form`` of ``amax`` / ``amin`` (``dispatch`` asks it first):
    :func:`even_extreme` where the gradient is needed and the extreme crosses ranks,
    else ``NotImplemented`` (the table's op: each rank's own torch gradient is exact)."""
    def form(args, kwargs):
        from ..dist_tensor import DistTensor
        x = args[0] if args else kwargs.get("input")
        if not (type(x) is DistTensor and x.requires_grad and torch.is_grad_enabled()):
            return NotImplemented
        (x,), attrs = parse(*args, **kwargs)
        dims = attrs["dim"] or tuple(range(x.ndim))
        if not crosses_ranks(x, dims):
            return NotImplemented
        return even_extreme(x, dims, attrs["keepdim"], kind)
    return form
