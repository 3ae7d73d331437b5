"""Torch functions composed of ops in the table (each op keeps its own rule, cost and
trace event): ``var`` / ``std``, ``F.mse_loss``, ``F.nll_loss``, ``logsumexp``, ``dot``,
``outer``. The value and the
gradient are those of the composition, equal to torch's fused kernels up to rounding."""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from ._util import wrap_dims

__all__ = ["COMPOSITES"]

T = torch.Tensor


def _var_args(input, args, kwargs, fn):
    """torch.var's overloads: (dim=None, *, correction=1, keepdim=False), (unbiased),
    (dim, unbiased, keepdim=False)."""
    kwargs = dict(kwargs)
    dim, correction, keepdim = kwargs.pop("dim", None), 1, kwargs.pop("keepdim", False)
    args = list(args)
    if args and isinstance(args[0], bool):
        correction = int(args.pop(0))
    elif args:
        dim = args.pop(0)
        if args and isinstance(args[0], bool):
            correction = int(args.pop(0))
        if args:
            keepdim = args.pop(0)
    if "unbiased" in kwargs:
        correction = int(bool(kwargs.pop("unbiased")))
    if "correction" in kwargs:
        c = kwargs.pop("correction")
        correction = 1 if c is None else c
    if args or kwargs:
        raise TypeError(f"{fn}(): unexpected arguments {args or ''} {list(kwargs) or ''} on a "
                        "DistTensor")
    if not (input.dtype.is_floating_point or input.dtype.is_complex):
        raise RuntimeError(f"{fn}(): input dtype should be either floating point or complex. "
                           f"Got {str(input.dtype).replace('torch.', '').capitalize()} instead.")
    dims = tuple(range(input.ndim)) if dim is None else \
        tuple(sorted(wrap_dims(dim if isinstance(dim, (list, tuple)) else (dim,), input.ndim)))
    return dims, correction, bool(keepdim)


def var(input, *args, **kwargs):
    """``sum((x - mean)^2) / max(N - correction, 0)`` over ``dim`` (torch.var).  With no
    degrees of freedom left (N - correction <= 0) the value is inf (or nan where the sum
    is 0), and the gradient torch's ``var_backward`` gives (:class:`_NoDof`)."""
    dims, correction, keepdim = _var_args(input, args, kwargs, "var")
    given = input
    whole = input.ndim == 0 or _dim_is_none(args, kwargs)
    if input.ndim == 0:          # dim 0 / -1 of a 0-d tensor: its one element (0-d out)
        input, dims, keepdim = input.reshape(1), (0,), False
    n = math.prod(input.shape[d] for d in dims)
    if n - correction <= 0:
        warnings.warn("var(): degrees of freedom is <= 0. Correction should be strictly less "
                      "than the reduction factor (input numel divided by output numel).")
        if given.requires_grad and torch.is_grad_enabled():
            return _NoDof.apply(given, dims, correction, keepdim, whole, n)
    return _var_value(input, dims, correction, keepdim, n)


def _dim_is_none(args, kwargs) -> bool:
    """Whether torch.var's ``dim`` was left None (its gradient differs: var_backward)."""
    if "dim" in kwargs:
        return kwargs["dim"] is None
    return not args or isinstance(args[0], bool) or args[0] is None


def _var_value(input, dims, correction, keepdim, n):
    # the mean detached: torch's var_backward is (2 / (N - correction)) grad (x - mean), the
    # mean's path left out (its gradient, -2 sum(x - mean) / N, is 0 in exact arithmetic);
    # through it a slice holding +-inf got nan everywhere (sum(x - mean) = nan), where
    # torch's is -+inf beside the inf's own nan (sweep14)
    centered = input - input.mean(dims, keepdim=True).detach()
    if centered.is_complex():         # |x - mean|^2, a real variance (torch.var of complex;
        a = centered.abs()            # a complex DistTensor has no gradient)
        s = (a * a).sum(dims, keepdim=keepdim)
    else:
        s = (centered * centered).sum(dims, keepdim=keepdim)
    out = s / max(n - correction, 0)
    # no element at all: torch's kernel gives a positive nan (0 / 0 here is x86's default
    # nan, sign bit set: signbit() read True where torch's reads False; seed 1045897)
    return out.abs() if n == 0 and n - correction <= 0 else out


class _NoDof(torch.autograd.Function):
    """var with N - correction <= 0 (its value inf, or nan where every element equals
    the mean) and torch 2.13's gradient, ``var_backward`` in
    torch/csrc/autograd/FunctionsManual.cpp (checked against the installed torch):

    * ``dim`` None, or a 0-d input: ``grad * where(x == x.mean(), nan, inf)``;
    * ``dim`` given: ``(2 / (N - correction)) * grad * (x - x.mean(dim, keepdim=True))``,
      the factor inf at N == correction and negative (finite) below it.

    The composition (``s / 0``) would give nan through the mean's path instead."""

    @staticmethod
    def forward(ctx, x, dims, correction, keepdim, whole, n):
        ctx.save_for_backward(x)
        ctx.args = (dims, correction, keepdim, whole, n)
        flat = x.reshape(1) if x.ndim == 0 else x
        return _var_value(flat, dims, correction, keepdim, n)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        dims, correction, keepdim, whole, n = ctx.args
        if whole:
            eq = x == x.mean()
            nan = torch.full((), math.nan, dtype=x.dtype)
            inf = torch.full((), math.inf, dtype=x.dtype)
            return grad * torch.where(eq, nan, inf), None, None, None, None, None
        if not keepdim and x.ndim > 1:
            for d in dims:
                grad = grad.unsqueeze(d)
        dof = n - correction
        k = math.inf if dof == 0 else 2.0 / dof
        return k * grad * (x - x.mean(dims, keepdim=True)), None, None, None, None, None


def std(input, *args, **kwargs):
    """``sqrt(var)`` (torch.std), with torch's gradient where the std is 0 (a constant
    slice, one element): 0, not sqrt's 0 * inf = nan (torch's std_backward masks it:
    ``(grad / (result * 2)).masked_fill_(result == 0, 0)``, FunctionsManual.cpp)."""
    v = var(input, *args, **kwargs)
    nonzero = v != 0                  # a nan / inf variance keeps its sqrt
    one, zero = torch.ones((), dtype=v.dtype), torch.zeros((), dtype=v.dtype)
    return torch.where(nonzero, torch.sqrt(torch.where(nonzero, v, one)), zero)


def _reduce(loss, reduction, fn):
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"{reduction} is not a valid value for reduction")


def mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    """``F.mse_loss``: ``(input - target)^2`` reduced."""
    if size_average is not None or reduce is not None or weight is not None:
        raise NotImplementedError("mse_loss on DistTensors: size_average / reduce / weight "
                                  "are not supported; use reduction=")
    if tuple(input.shape) != tuple(target.shape):
        torch.broadcast_shapes(tuple(input.shape), tuple(target.shape))   # torch's error
    from .blas import cpu_check       # its CPU kernel's dtypes: NotImplementedError for an
    cpu_check(F.mse_loss, input, target, reduction=reduction)   # integer / bool result
    if torch.bool in (input.dtype, target.dtype):   # torch promotes; bool - x raises
        dt = torch.promote_types(input.dtype, target.dtype)
        input, target = input.to(dt), target.to(dt)
    d = input - target
    return _reduce(d * d, reduction, "mse_loss")


def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
             reduction="mean"):
    """``F.nll_loss`` (class dim 1, or 0 for one sample): ``-input[target]`` where the
    target is not ``ignore_index``; "mean" divides by the number of such targets."""
    from .blas import cpu_check       # its CPU kernel's dtypes first: NotImplementedError
    cpu_check(F.nll_loss, input, target, weight, size_average, ignore_index,   # for a uint8
              reduce, reduction)      # / bool input (sweep11 seed 2002290 wide; a bool input
    # met the meta decomposition's negation RuntimeError first), RuntimeError for a bool
    if target.dtype == torch.uint8:   # target; "Long or Byte": torch's CPU kernel reads a
        target = target.long()        # uint8 target, its meta decomposition's gather refuses
    F.nll_loss(torch.empty(tuple(input.shape), dtype=input.dtype, device="meta"),
               torch.empty(tuple(target.shape), dtype=target.dtype, device="meta"),
               ignore_index=ignore_index, reduction=reduction)      # torch's shape checks
    if weight is not None or size_average is not None or reduce is not None:
        raise NotImplementedError("nll_loss on DistTensors: weight / size_average / reduce "
                                  "are not supported; use reduction= and ignore_index=")
    one = input.ndim == 1
    if one:
        input, target = input.unsqueeze(0), target.unsqueeze(0)
    keep = target != ignore_index
    safe = torch.where(keep, target, torch.zeros((), dtype=target.dtype))
    picked = torch.gather(input, 1, safe.unsqueeze(1)).squeeze(1)
    loss = torch.where(keep, -picked, torch.zeros((), dtype=input.dtype))
    if reduction == "mean":
        return loss.sum() / keep.sum().to(input.dtype)
    if one and reduction == "none":
        return loss.squeeze(0)
    return _reduce(loss, reduction, "nll_loss")


def logsumexp(input, dim, keepdim=False):
    """``log(sum(exp(x - m))) + m`` with ``m`` the max over ``dim`` (torch.logsumexp; a
    slice of -inf gives -inf)."""
    dims = tuple(sorted(wrap_dims(dim if isinstance(dim, (list, tuple)) else (dim,),
                                  input.ndim)))
    if not (input.dtype.is_floating_point or input.dtype.is_complex):
        input = input.to(torch.get_default_dtype())
    if input.ndim == 0:          # dim 0 / -1 of a 0-d tensor: its one element (0-d out)
        input, dims, keepdim = input.reshape(1), (0,), False
    if any(input.shape[d] == 0 for d in dims):       # an empty sum: log(0) = -inf, as torch
        out = torch.log(torch.exp(input).sum(dims, keepdim=True))
        return out if keepdim else out.squeeze(dims)
    # a complex input: the max of its real parts (torch's logsumexp_out_impl; a complex
    # input came back float32 here, sweep11)
    # (input.real: view_as_real refuses a conjugate view, logsumexp(z.conj()) does not)
    re = input.real if input.dtype.is_complex else input
    m = torch.amax(re, dims, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=m.dtype))
    out = torch.log(torch.exp(input - m).sum(dims, keepdim=True)) + m
    return out if keepdim else out.squeeze(dims)


def dot(input, other):
    """``torch.dot``: the sum of the products of two 1-d tensors."""
    torch.dot(torch.empty(tuple(input.shape), dtype=input.dtype, device="meta"),
              torch.empty(tuple(other.shape), dtype=other.dtype, device="meta"))  # its checks
    return _dot_sum(torch.dot, input, other, input * other)


def _dot_sum(fn, input, other, prod):
    """The products' sum in torch's dot's dtype, the inputs' (sum() takes an integer to
    int64: vdot of two uint8 came back int64, torch's uint8, sweep15 focus seed 5000308;
    the sum kept in uint8 wraps as torch's kernel, modulo 2^8), after its CPU kernel's
    dtype checks (a bool raises NotImplementedError, not the meta kernel)."""
    from .blas import cpu_check
    cpu_check(fn, input, other)
    if input.dtype.is_floating_point or input.dtype.is_complex:
        return prod.sum()
    return prod.sum(dtype=input.dtype)


def vdot(input, other):
    """``torch.vdot``: ``dot(conj(input), other)`` (``parametrizations.spectral_norm``'s
    sigma, ``vdot(u, W @ v)``: habits12, was NoRuleError on a tensor-parallel W)."""
    torch.vdot(torch.empty(tuple(input.shape), dtype=input.dtype, device="meta"),
               torch.empty(tuple(other.shape), dtype=other.dtype, device="meta"))  # its checks
    # conj (complex.py, sweep18; sweep15 had built it from view_as_real, which refuses an
    # input that is itself a conjugate view, vdot(z.conj(), w), where torch computes)
    conj = input.conj() if input.dtype.is_complex else input
    return _dot_sum(torch.vdot, input, other, conj * other)


def outer(input, vec2):
    """``torch.outer``: ``input[:, None] * vec2[None, :]``."""
    torch.outer(torch.empty(tuple(input.shape), dtype=input.dtype, device="meta"),
                torch.empty(tuple(vec2.shape), dtype=vec2.dtype, device="meta"))
    return input.unsqueeze(1) * vec2.unsqueeze(0)


COMPOSITES = {torch.logsumexp: logsumexp, T.logsumexp: logsumexp, torch.dot: dot, T.dot: dot,
              torch.vdot: vdot, T.vdot: vdot,
              torch.outer: outer, T.outer: outer, torch.ger: outer, T.ger: outer,
              torch.var: var, T.var: var, torch.std: std, T.std: std,
              F.mse_loss: mse_loss, F.nll_loss: nll_loss}

# more compositions, each family in its module: addmm / baddbmm / addcmul ... (blas.py),
# vector_norm / norm / normalize (vector_norm.py), l1 / smooth_l1 / huber / bce / kl losses,
# softmin, cosine_similarity (losses.py), std_mean, aminmax, nansum, tile, hstack... (stats.py),
# kthvalue / median (sort.py), trace / diag (diagonal.py), pairwise_distance (distances.py)
from .blas import BLAS  # noqa: E402
from .diagonal import DIAGONALS  # noqa: E402
from .losses import LOSSES  # noqa: E402
from .sort import SELECTIONS  # noqa: E402
from .stats import STATS  # noqa: E402
from .vector_norm import NORMS  # noqa: E402
from .distances import DISTANCES  # noqa: E402

for _more in (BLAS, NORMS, LOSSES, STATS, SELECTIONS, DIAGONALS, DISTANCES):
    COMPOSITES.update(_more)
