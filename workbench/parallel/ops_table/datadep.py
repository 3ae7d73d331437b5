"""Ops whose output size depends on the values: ``masked_select``, ``nonzero`` /
``argwhere``, ``unique``, ``unique_consecutive`` and ``x[mask]`` with a bool mask tensor.

PyTorch DTensor's answer for such ops is to run them on replicated inputs: no rank can
know the length of its part of the result before every rank has counted. Per mesh dim:

    every input   R, S(d), P   ->  R     (redistributed to Replicate first: the
                                          all-gather / all-reduce is planned, priced and
                                          traced like any reshard)
    every output  R

The rule offers that one strategy; the local op then runs once on the global values
(``dispatch_datadep.py``: the output shape is known only after it ran, so these entries
skip the meta-tensor shape check and the prepared-call cache).  ``masked_select`` and
``x[mask]`` are differentiable in ``x`` (torch's backward scatters the gradient back);
``unique``'s outputs are not (as torch's).
"""
from __future__ import annotations

import math

import torch

from . import costs
from .samples import Sample
from .strategy import Strategy
from .table import register

__all__ = ["replicate_rule", "bool_mask_index", "DATA_DEPENDENT"]

T = torch.Tensor
DATA_DEPENDENT = ("masked_select", "nonzero", "argwhere", "unique", "unique_consecutive",
                  "bool_mask_index")


def replicate_rule(*specs, n_out=1, dim=None, **_):
    """Every tensor input Replicate, every output Replicate: the only layout in which
    each rank can compute a result whose length depends on every element."""
    mesh = next(s for s in specs if s is not None).mesh
    if dim is not None:               # unique(dim=): out of range is torch's IndexError
        from ._util import wrap_dim
        wrap_dim(dim, max(specs[0].ndim, 1))
    from ..placement import Replicate
    r = (Replicate(),) * mesh.ndim
    return [Strategy(tuple(None if s is None else r for s in specs), (r,) * n_out,
                     "the output's length depends on the values: inputs replicated")]


def _cost(per_element=1, sort=False):
    """Reading the inputs and writing the outputs, ``per_element`` compares per input
    element (a mask test / a nonzero test); ``sort``: torch's unique sorts on the CPU and
    GPU (aten/src/ATen/native/Unique.cpp, cuda/Unique.cu), n ceil(log2 n) compares
    (Knuth, TAOCP vol. 3, 5.3.1). Backward (masked_select, x[mask]): a scatter of the
    output's gradient into a zero input gradient, one write per input element."""
    def cost(ins, outs, **_):
        n = ins[0].numel() if isinstance(ins[0], T) else 0
        f = n * (max(1, math.ceil(math.log2(max(n, 2)))) if sort else per_element)
        return costs.Cost(int(f), sum(costs.nbytes(t) for t in list(ins) + list(outs)), n,
                          costs.backward_bytes(ins[:1], outs[:1], costs.nbytes(ins[-1])))
    return cost


def _tensor_like(x, what, name):
    from ..dist_tensor import DistTensor
    if not isinstance(x, (T, DistTensor)):
        raise TypeError(f"{name}(): argument '{what}' must be Tensor, not {type(x).__name__}")


# ---- masked_select ------------------------------------------------------------------------

def _masked_select_parse(input, mask):
    _tensor_like(input, "input", "masked_select")
    _tensor_like(mask, "mask", "masked_select")
    if mask.dtype != torch.bool:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask, got {mask.dtype}")
    torch.broadcast_shapes(tuple(input.shape), tuple(mask.shape))   # torch's shape error
    return (input, mask), {}


register("masked_select", [torch.masked_select, T.masked_select],
         parse=_masked_select_parse, rule=replicate_rule,
         local=lambda nd, ctx, x, m: torch.masked_select(x, m), cost=_cost(1),
         op_class="data_movement", meta_check=False,
         sample=lambda g: [Sample(torch.masked_select, (g.rn(5, 6), g.rn(5, 6) > 0)),
                           Sample(torch.masked_select, (g.rn(7, 3), g.rn(3) > 0))])


# ---- nonzero / argwhere ---------------------------------------------------------------------

def _nonzero_parse(input, *, as_tuple=False):
    _tensor_like(input, "input", "nonzero")
    return (input,), {"as_tuple": bool(as_tuple)}


def _nonzero_local(nd, ctx, x, as_tuple):
    return torch.nonzero(x, as_tuple=True) if as_tuple else torch.nonzero(x)


register("nonzero", [torch.nonzero, T.nonzero], parse=_nonzero_parse, rule=replicate_rule,
         local=_nonzero_local, cost=_cost(1), op_class="data_movement", meta_check=False,
         multi=True,
         sample=lambda g: [Sample(torch.nonzero, (g.rn(5, 6).round(),)),
                           Sample(torch.nonzero, (g.rn(7, 3).round(),), {"as_tuple": True})])


def _argwhere_parse(input):
    _tensor_like(input, "input", "argwhere")
    return (input,), {}


register("argwhere", [torch.argwhere, T.argwhere], parse=_argwhere_parse,
         rule=replicate_rule, local=lambda nd, ctx, x: torch.argwhere(x), cost=_cost(1),
         op_class="data_movement", meta_check=False,
         sample=lambda g: [Sample(torch.argwhere, (g.rn(5, 6).round(),))])


# ---- unique / unique_consecutive -------------------------------------------------------------

def _n_out(return_inverse, return_counts):
    return 1 + bool(return_inverse) + bool(return_counts)


def _dim(dim, x, name):
    if dim is None:
        return None
    from ._util import wrap_dim
    try:
        return wrap_dim(int(dim), max(x.ndim, 1))
    except IndexError as e:
        raise IndexError(f"{name}(dim={dim}): {e}") from None


def _unique_parse(input, sorted=True, return_inverse=False, return_counts=False, dim=None):
    _tensor_like(input, "input", "unique")
    return (input,), {"sorted": bool(sorted), "return_inverse": bool(return_inverse),
                      "return_counts": bool(return_counts), "dim": _dim(dim, input, "unique"),
                      "n_out": _n_out(return_inverse, return_counts)}


def _unique_local(nd, ctx, x, sorted, return_inverse, return_counts, dim, n_out):
    return torch.unique(x, sorted=sorted, return_inverse=return_inverse,
                        return_counts=return_counts, dim=dim)


register("unique", [torch.unique, T.unique], parse=_unique_parse, rule=replicate_rule,
         local=_unique_local, cost=_cost(sort=True), op_class="reduction", meta_check=False,
         multi=True,
         sample=lambda g: [Sample(torch.unique, (g.rn(5, 6).round(),)),
                           Sample(torch.unique, (g.rn(7, 3).round(),),
                                  {"return_inverse": True, "return_counts": True}),
                           Sample(torch.unique, ((g.rn(6, 3) > 0).float(),),
                                  {"dim": 0, "return_counts": True})])


def _unique_consecutive_parse(input, return_inverse=False, return_counts=False, dim=None):
    _tensor_like(input, "input", "unique_consecutive")
    return (input,), {"return_inverse": bool(return_inverse),
                      "return_counts": bool(return_counts),
                      "dim": _dim(dim, input, "unique_consecutive"),
                      "n_out": _n_out(return_inverse, return_counts)}


def _unique_consecutive_local(nd, ctx, x, return_inverse, return_counts, dim, n_out):
    return torch.unique_consecutive(x, return_inverse=return_inverse,
                                    return_counts=return_counts, dim=dim)


register("unique_consecutive", [torch.unique_consecutive, T.unique_consecutive],
         parse=_unique_consecutive_parse, rule=replicate_rule,
         local=_unique_consecutive_local, cost=_cost(1), op_class="reduction",
         meta_check=False, multi=True,
         sample=lambda g: [Sample(torch.unique_consecutive, (g.rn(5, 6).round(),)),
                           Sample(torch.unique_consecutive, (g.rn(7, 3).round(),),
                                  {"return_inverse": True, "return_counts": True,
                                   "dim": 1})])


# ---- x[mask] with a bool mask tensor -------------------------------------------------------------

def _bool_index(x, mask, lead=0):
    return x[(slice(None),) * lead + (mask,)]


def _bool_index_parse(x, mask, lead=0):
    want = tuple(x.shape[lead:lead + mask.dim()])
    if lead + mask.dim() > x.dim() or tuple(mask.shape) != want:
        raise IndexError(f"x[mask]: the shape of the mask {list(mask.shape)} at index {lead} "
                         f"does not match the shape of the indexed tensor {list(x.shape)} "
                         f"(a bool mask covers as many of x's dims as it has, here {list(want)})")
    return (x, mask), {"lead": int(lead)}


register("bool_mask_index", [_bool_index], parse=_bool_index_parse, rule=replicate_rule,
         local=lambda nd, ctx, x, m, lead: _bool_index(x, m, lead), cost=_cost(1),
         op_class="data_movement", meta_check=False,
         sample=lambda g: [Sample(_bool_index, (g.rn(5, 6), g.rn(5, 6) > 0)),
                           Sample(_bool_index, (g.rn(7, 3), g.rn(7) > 0)),
                           Sample(_bool_index, (g.rn(3, 7, 2), g.rn(7) > 0), {"lead": 1})])


def bool_mask_index(x, index):
    """``x[mask]`` or ``x[:, ..., :, mask]`` for a bool mask tensor that the index-select
    path cannot take (a DistTensor mask, or a plain mask of more than one dim), after
    nothing but full slices: the data-dependent op above; None for any other index."""
    from ..dist_tensor import DistTensor
    items = index if isinstance(index, tuple) else (index,)
    if not items or any(i != slice(None) if isinstance(i, slice) else True
                        for i in items[:-1]):
        return None
    m = items[-1]
    if not isinstance(m, (T, DistTensor)) or m.dim() == 0:
        return None
    if m.dtype == torch.uint8:          # a mask, as torch reads it (deprecated there too)
        import warnings
        warnings.warn("indexing with dtype torch.uint8 is now deprecated, please use a "
                      "dtype torch.bool instead.", UserWarning, stacklevel=3)
        m = m.bool()
    elif m.dtype != torch.bool or not isinstance(m, DistTensor) and m.dim() == 1:
        return None                     # indexing.advanced_index (1-d: an index_select)
    from ..dispatch import dispatch
    return dispatch(_bool_index, (x, m, len(items) - 1), None)

for _name in DATA_DEPENDENT:
    from .table import TABLE as _TABLE
    _TABLE[_name].extra["data_dependent"] = True


def _where_alone(args, kwargs):
    """``torch.where(condition)`` is ``torch.nonzero(condition, as_tuple=True)`` (torch's
    documentation of torch.where says so); other calls are where's (select.py)."""
    if len(args) + len(kwargs) != 1 or kwargs and "condition" not in kwargs:
        return NotImplemented
    return torch.nonzero(args[0] if args else kwargs["condition"], as_tuple=True)


_TABLE["where"].extra["other_form"] = _where_alone
