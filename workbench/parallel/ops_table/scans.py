"""Scans along one dim beyond ``cumsum`` / ``cumprod`` (``reduction.py``): ``cummax``,
``cummin`` (values and indices) and ``logcumsumexp``.

Per mesh dim:

    R                  -> R
    S(d), d != dim     -> S(d)        each row scans alone
    S(dim)             -> whole       (a scan crosses shards: gathered first)

No Partial passes (neither the running max's index nor log-sum-exp is linear). Dims are
wrapped by the parsers (an out-of-range dim is torch's IndexError).
"""
from __future__ import annotations

import torch

from . import costs
from ._util import wrap_dim
from .reduction import along_dim_options
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["scan_rule"]

T = torch.Tensor


def scan_rule(x, dim, n_out=1, **_):
    """A scan over ``dim``: that dim whole; other dims pass to every output."""
    opts = [(ins, outs * n_out, note) for ins, outs, note in along_dim_options(x, dim)]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1, n_outputs=n_out)


def _parse(n_out):
    def parse(x, dim):
        return (x,), {"dim": wrap_dim(dim, x.ndim), "n_out": n_out}
    return parse


class _GradThrough(torch.autograd.Function):
    """``out`` (computed from ``x``) whose gradient is passed to ``x`` unchanged: torch's
    logcumsumexp_backward returns ``grad`` itself for a 0-d input
    (torch/csrc/autograd/FunctionsManual.cpp), where the formula of a 1-element dim gives
    0 for a NaN gradient and NaN for an infinite input (random sweep seed 1051387)."""

    @staticmethod
    def forward(ctx, x, out):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _local(fn, n_out):
    def local(nd, ctx, x, dim, n_out=n_out):
        if x.dim() == nd:                 # a 0-d tensor: itself (index 0)
            if n_out == 2:                # torch's cummax / cummin return it unchecked (a
                # complex too, which their kernels refuse): measured, torch 2.13; but not
                # to autograd (a complex requiring grad: RuntimeError, as torch)
                from .extreme_grad import no_complex_grad
                no_complex_grad(fn.__name__, x)
                return x.clone(), torch.zeros(x.shape, dtype=torch.long, device=x.device)
            out = fn(x.reshape(tuple(x.shape) + (1,)), nd)
            if fn is torch.logcumsumexp:
                return _GradThrough.apply(x, out.detach().reshape(x.shape))
            return tuple(o.reshape(x.shape) for o in out) if n_out > 1 else out.reshape(x.shape)
        out = fn(x, dim + nd)
        return tuple(out) if n_out > 1 else out
    return local


for _n, _fn, _k, _fl in (("cummax", torch.cummax, 2, 1), ("cummin", torch.cummin, 2, 1),
                         ("logcumsumexp", torch.logcumsumexp, 1, 4)):
    # a compare per element (cummax, cummin); max, subtract, exp, log1p (logcumsumexp's
    # running log(e^a + e^b) = max + log1p(exp(-|a - b|)))
    _e = register(_n, [_fn, getattr(T, _n)], parse=_parse(_k), rule=scan_rule,
                  local=_local(_fn, _k), cost=costs.reduction(_fl), op_class="reduction",
                  n_out=_k, sample=lambda g, f=_fn: [Sample(f, (g.rn(5, 6), 1)),
                                                     Sample(f, (g.rn(7, 3), 0))])
    if _k == 2:
        _e.extra["result_type"] = getattr(torch.return_types, _n)
