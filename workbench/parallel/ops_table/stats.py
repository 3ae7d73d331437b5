"""Statistics and stacking composed of ops in the table (each keeps its own rule, cost
and trace event):

    std_mean / var_mean     (std or var, mean) over dim     composites.var, mean
    aminmax                 (amin, amax), named as torch's
    count_nonzero           (x != 0).sum(dim), int64
    nansum / nanmean        nan taken as 0 / left out of the count
    tile(reps)              repeat with reps padded by leading 1s
    hstack / vstack         cat along dim 1 (0 for 1-d) / along dim 0 of 2-d views
    tensor_split            split at torch's own section sizes
    Tensor.type(dtype)      .to(dtype); no argument: the type's name ('torch.FloatTensor')
    F.glu(dim)              a * sigmoid(b), a and b the halves of ``dim``
    rot90(k, dims)          flips and a transpose
    tensordot(a, b, dims)   einsum over the paired dims
    diff(n, dim)            x[1:] - x[:-1] along dim, n times (prepend / append joined)

torch's own checks run first on meta tensors of the global shapes.
"""
from __future__ import annotations

import math

import torch

from .blas import cpu_check, torch_check
from .composites import _var_args, std, var

__all__ = ["STATS"]

T = torch.Tensor


def _with_mean(fn, root):
    def composed(input, *args, **kwargs):
        dims, _, keepdim = _var_args(input, args, dict(kwargs), fn.__name__)
        # std, not sqrt(var): torch's std_mean gradient is std's, 0 where the std is 0
        # (sqrt's was nan: a constant row of std_mean(x, 1) got nan)
        v = (std if root else var)(input, *args, **kwargs)
        m = input.mean(dims, keepdim=keepdim)
        if input.ndim and not math.prod(input.shape[d] for d in dims):
            # no element: torch's var_mean kernel's nan is positive (mean's 0 / 0 is x86's
            # default nan, sign bit set), as var's; a complex mean stays complex (abs made
            # it real: seed 2010165 wide), nan + nanj with both signs clear
            m = m.abs() if not m.dtype.is_complex else \
                torch.view_as_complex(torch.view_as_real(m).abs())
        return v, m
    composed.__name__ = fn.__name__
    composed.__doc__ = f"``torch.{fn.__name__}``: ({'std' if root else 'var'}, mean)."
    return composed


std_mean = _with_mean(torch.std_mean, True)
var_mean = _with_mean(torch.var_mean, False)


def aminmax(input, *, dim=None, keepdim=False):
    """``torch.aminmax``: (min, max) over ``dim`` (all dims when None).  An empty
    reduction raises as torch's CPU kernel does (its meta kernel raises a RuntimeError
    where the kernel raises IndexError for an empty ``dim``)."""
    n = input.ndim
    if dim is None and input.numel() == 0:
        raise RuntimeError("aminmax(): cannot compute aminmax over an empty dimension as the "
                           "operation has no identity. Give a dim whose size is not 0")
    if type(dim) is int and n and -n <= dim < n and input.shape[dim % n] == 0:
        raise IndexError(f"aminmax: Expected reduction dim {dim % n} to have non-zero size "
                         f"(dim={dim} of shape {tuple(input.shape)})")
    torch_check(torch.aminmax, input, dim=dim, keepdim=keepdim)
    dims = tuple(range(input.ndim)) if dim is None else dim
    if input.ndim == 0 or input.dtype.is_complex:
        # torch's CPU kernel checks the dtype (a complex raises NotImplementedError, even
        # of no element and requiring grad: there amin's autograd RuntimeError came
        # first, complex-grad focus seed 7000009 of sweep17)
        cpu_check(torch.aminmax, input, dim=dim, keepdim=keepdim)
    if input.ndim == 0:
        # amin() / amax() of the one element, not clone(): their gradient is torch's at a
        # NaN (grad * (x == min) / count: NaN; a clone passed the gradient through: wide
        # seed 2016292, t5.grad inf where one device has nan)
        return torch.return_types.aminmax((input.amin(), input.amax()))
    return torch.return_types.aminmax((input.amin(dims, keepdim=keepdim),
                                       input.amax(dims, keepdim=keepdim)))


def count_nonzero(input, dim=None):
    """``torch.count_nonzero``: int64 counts of the nonzero elements."""
    torch_check(torch.count_nonzero, input, dim)
    return (input != 0).sum(tuple(range(input.ndim)) if dim is None else dim)


def _nan_as_zero(x):
    """``x`` with nan as 0, whose gradient is torch's ``nansum_backward``: ``grad * ~isnan(x)``
    (a multiplication: an inf gradient gives nan at a nan, as after nanmean of a slice of
    nans, count 0; a where gave 0 there: sweep11). nan_to_num's gradient is ``grad *
    isfinite(x)``, so an inf keeps its own through the where."""
    return torch.where(torch.isinf(x), x, torch.nan_to_num(x, 0.0))


def nansum(input, dim=None, keepdim=False, *, dtype=None):
    """``torch.nansum``: nan counted as zero."""
    ref = torch_check(torch.nansum, input, dim, keepdim, dtype=dtype)
    cpu_check(torch.nansum, input, dim, keepdim, dtype=dtype)   # a complex: torch's CPU raises
    x = _nan_as_zero(input) if input.dtype.is_floating_point else input
    out = x.sum(tuple(range(input.ndim)) if dim is None else dim, keepdim=keepdim,
                dtype=dtype)
    return out.to(ref.dtype)


def nanmean(input, dim=None, keepdim=False, *, dtype=None):
    """``torch.nanmean``: the mean of the elements that are not nan."""
    ref = torch_check(torch.nanmean, input, dim, keepdim, dtype=dtype)
    cpu_check(torch.nanmean, input, dim, keepdim, dtype=dtype)  # (sweep11 seed 2000595)
    x = input if dtype is None else input.to(dtype)
    keep = ~torch.isnan(x)
    dims = tuple(range(x.ndim)) if dim is None else dim
    s = _nan_as_zero(x).sum(dims, keepdim=keepdim)
    return (s / keep.sum(dims, keepdim=keepdim)).to(ref.dtype)


def tile(input, *dims):
    """``torch.tile``: ``repeat`` with ``dims`` padded by leading 1s."""
    if len(dims) == 1 and isinstance(dims[0], (tuple, list, torch.Size)):
        dims = dims[0]
    dims = tuple(int(d) for d in dims)
    torch_check(torch.tile, input, dims)
    return input.repeat((1,) * (input.ndim - len(dims)) + dims)


def _atleast(t, n):
    while t.ndim < n:
        t = t.unsqueeze(0)
    return t


def hstack(tensors, *, out=None):
    """``torch.hstack``: cat along dim 1, or along dim 0 of 1-d tensors."""
    if out is not None:
        raise TypeError("hstack(out=...) on DistTensors: assign the result")
    torch_check(torch.hstack, list(tensors))
    ts = [_atleast(t, 1) for t in tensors]
    return torch.cat(ts, 0 if ts[0].ndim == 1 else 1)


def vstack(tensors, *, out=None):
    """``torch.vstack``: cat along dim 0 of the tensors seen as at least 2-d."""
    if out is not None:
        raise TypeError("vstack(out=...) on DistTensors: assign the result")
    torch_check(torch.vstack, list(tensors))
    return torch.cat([_atleast(t, 2) for t in tensors], 0)


def tensor_split(input, indices_or_sections, dim=0):
    """``torch.tensor_split``: pieces of torch's own sizes (``split`` of them)."""
    if isinstance(indices_or_sections, T) and indices_or_sections.ndim == 0:
        indices_or_sections = int(indices_or_sections)
    elif isinstance(indices_or_sections, T):
        indices_or_sections = indices_or_sections.tolist()
    pieces = torch_check(torch.tensor_split, input, indices_or_sections, dim)
    d = dim % max(input.ndim, 1)
    return tuple(input.split([p.shape[d] for p in pieces], d))


def type_(input, dtype=None, non_blocking=False, **kwargs):
    """``Tensor.type``: the type's name, or ``.to(dtype)`` (a str such as
    'torch.DoubleTensor' names a dtype)."""
    probe = torch.empty(0, dtype=input.dtype)
    if dtype is None:
        return probe.type()
    if isinstance(dtype, str):
        dtype = probe.type(dtype).dtype
    return input.to(dtype)


def glu(input, dim=-1):
    """``F.glu``: the first half of ``dim`` times the sigmoid of the second."""
    torch_check(torch.nn.functional.glu, input, dim)
    # then torch's CPU kernel's dtypes (an integer, a complex: NotImplementedError, where a
    # complex was computed: seed 2009093 wide), on two elements (cpu_check's cut to one
    # would not halve)
    torch.nn.functional.glu(torch.zeros(2, dtype=input.dtype), 0)
    a, b = input.chunk(2, dim)
    if input.dtype in (torch.float16, torch.bfloat16):    # the kernel's float32 "opmath":
        return (a.float() * torch.sigmoid(b.float())).to(input.dtype)    # rounded once
    return a * torch.sigmoid(b)


def rot90(input, k=1, dims=(0, 1)):
    """``torch.rot90``: k quarter turns from ``dims[0]`` towards ``dims[1]``."""
    torch_check(torch.rot90, input, k, dims)
    d0, d1 = (d % input.ndim for d in dims)
    k %= 4
    if k == 0:
        return input.clone()
    if k == 2:
        return input.flip((d0, d1))
    return (input.flip(d1) if k == 1 else input.flip(d0)).transpose(d0, d1)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def tensordot(a, b, dims=2, out=None):
    """``torch.tensordot``: the einsum contracting ``a``'s dims with ``b``'s."""
    if out is not None:
        raise TypeError("tensordot(out=...) on DistTensors: assign the result")
    torch_check(torch.tensordot, a, b, dims)
    if isinstance(dims, int):
        da, db = list(range(a.ndim - dims, a.ndim)), list(range(dims))
    else:
        da, db = ([dims[i]] if isinstance(dims[i], int) else list(dims[i]) for i in (0, 1))
    da, db = [d % a.ndim for d in da], [d % b.ndim for d in db]
    sa = list(_LETTERS[:a.ndim])
    sb = list(_LETTERS[a.ndim:a.ndim + b.ndim])
    for x, y in zip(da, db):
        sb[y] = sa[x]
    keep = [c for i, c in enumerate(sa) if i not in da] + \
        [c for i, c in enumerate(sb) if i not in db]
    return torch.einsum(f"{''.join(sa)},{''.join(sb)}->{''.join(keep)}", a, b)


def diff(input, n=1, dim=-1, prepend=None, append=None):
    """``torch.diff``: ``x[1:] - x[:-1]`` along ``dim`` (after ``prepend`` / ``append``
    are joined on), ``n`` times; bools give ``!=`` as torch's (narrows and a subtraction:
    a sharded ``dim`` is regathered by the rules where the two slices meet)."""
    torch_check(torch.diff, input, n=n, dim=dim, prepend=prepend, append=append)
    d = dim % max(input.ndim, 1)
    parts = [p for p in (prepend, input, append) if p is not None]
    x = torch.cat(parts, d) if len(parts) > 1 else input
    for _ in range(n):
        m = x.shape[d]
        if m == 0:
            break
        a, b = x.narrow(d, 1, m - 1), x.narrow(d, 0, m - 1)
        x = a != b if x.dtype == torch.bool else a - b
    return x


STATS = {torch.diff: diff, T.diff: diff, torch.rot90: rot90, T.rot90: rot90, torch.tensordot: tensordot, torch.nn.functional.glu: glu, torch.std_mean: std_mean, torch.var_mean: var_mean, torch.aminmax: aminmax,
         T.aminmax: aminmax, torch.count_nonzero: count_nonzero, T.count_nonzero: count_nonzero,
         torch.nansum: nansum, T.nansum: nansum, torch.nanmean: nanmean, T.nanmean: nanmean,
         torch.tile: tile, T.tile: tile, torch.hstack: hstack, torch.vstack: vstack,
         torch.tensor_split: tensor_split, T.tensor_split: tensor_split, T.type: type_}
