"""``torch.mode``: the most frequent value along a dim and an index of it, by torch's own
kernel on whole rows (its pick among the positions of the mode, and among equally frequent
values, is the kernel's: no sort reproduces it, as nanmedian's in ``sort.py``).

    mode(dim)   R -> R, R;  S(d), d != dim -> S(d'), S(d')  (d' shifted when keepdim=False
                drops dim);  S(dim) -> whole (the counts need every element of a row);
                no Partial passes (the mode of a sum is not the mode of its parts)

Backward: torch's ``value_selecting_reduction_backward`` (the gradient to the index picked),
through the local call's autograd.
"""
from __future__ import annotations

import math

import torch

from . import costs
from ._util import shift, wrap_dim
from .samples import Sample
from .sort import _nanmedian_rule
from .table import register

__all__ = ["mode_rule"]

T = torch.Tensor


def mode_rule(x, dim=-1, keepdim=False, **_):
    """mode(dim): the dim whole; other dims pass to both outputs."""
    return _nanmedian_rule(x, wrap_dim(dim, max(x.ndim, 1)), keepdim)


def _mode_parse(input, dim=-1, keepdim=False):
    return (input,), {"dim": wrap_dim(dim, max(input.ndim, 1)), "keepdim": bool(keepdim)}


def _mode_local(nd, ctx, x, dim, keepdim=False):
    if x.dim() == nd:                 # a 0-d tensor: itself, index 0 (torch's kernel, its
        v, i = torch.mode(x.unsqueeze(-1), nd)      # dtype checks too)
        return v, i
    v, i = torch.mode(x, shift(dim, x.dim() - nd, nd), keepdim)
    return v, i


def _mode_cost(ins, outs, dim, **_):
    """torch's CPU kernel sorts each row's (value, index) pairs with ``std::sort``, then
    counts runs in one pass (pytorch aten/src/ATen/native/cpu/TensorCompareKernel.cpp,
    ``mode_kernel_impl``): n ceil(log2 n) compares and n more per row of n.  ASSUMPTION:
    one compare is one FLOP (as sort.py's)."""
    x = ins[0]
    n = x.shape[dim] if x.dim() else 1
    f = x.numel() * (max(1, math.ceil(math.log2(max(n, 2)))) + 1)
    return costs.Cost(f, costs.nbytes(x) + sum(costs.nbytes(o) for o in outs), 0,
                      costs.backward_bytes(ins, outs[:1], costs.nbytes(outs[-1])))


def _mode_sample(g):
    ties = g.grid(5, 7).round()
    return [Sample(torch.mode, (ties, 1)), Sample(torch.mode, (ties, 0), {"keepdim": True}),
            Sample(torch.mode, (g.ints(7, 3),))]


_MODE = register("mode", [torch.mode, T.mode], parse=_mode_parse, rule=mode_rule,
                 local=_mode_local, cost=_mode_cost, op_class="reduction", n_out=2,
                 sample=_mode_sample)
_MODE.extra["result_type"] = torch.return_types.mode
