"""Sorting along one dim: ``sort`` (values and indices), ``argsort``, ``msort``
(``topk``, ``argmax``: ``sampling.py``); the selections ``kthvalue`` and ``median``
(composed of sort) and ``nanmedian`` (its own rule: torch's kernel on whole rows).

Per mesh dim:

    sort / argsort(dim)   R                -> R
                          S(d), d != dim   -> S(d)    each row is sorted alone
                          S(dim)           -> whole   (a sorted row mixes every shard's
                                                      elements: gathered first)

No Partial passes (the order of a sum is not the order of its parts). Dims are wrapped
by the parsers (an out-of-range dim is torch's IndexError), so they reach the rules
non-negative. Ties keep their index order where ``stable=True``, as torch.
"""
from __future__ import annotations

import math

import torch

from . import costs
from ._util import shift, wrap_dim
from .reduction import along_dim_options
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["sort_rule"]

T = torch.Tensor


def sort_rule(x, dim, n_out=2, **_):
    """sort / argsort(dim): the sorted dim whole; other dims pass to every output."""
    opts = [(ins, outs * n_out, note) for ins, outs, note in along_dim_options(x, dim)]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1, n_outputs=n_out)


def _sort_parse(x, dim=-1, descending=False, *, stable=False):
    return (x,), {"dim": wrap_dim(dim, x.ndim), "descending": bool(descending),
                  "stable": bool(stable)}


def _argsort_parse(x, dim=-1, descending=False, *, stable=False):
    inputs, attrs = _sort_parse(x, dim, descending, stable=stable)
    return inputs, dict(attrs, n_out=1)


def _sort_local(nd, ctx, x, dim, descending, stable, n_out=2):
    if x.dim() == nd:                 # a 0-d tensor: itself, index 0 (as torch)
        # torch's kernel on one element: its checks too (a complex raises RuntimeError:
        # seed 2004315 of the wide random sweep gave a result)
        out = tuple(o.squeeze(-1) for o in torch.sort(x.unsqueeze(-1), dim=-1,
                                                      descending=descending, stable=stable))
    else:
        out = tuple(torch.sort(x, dim=shift(dim, x.dim() - nd, nd), descending=descending,
                               stable=stable))
    return out if n_out == 2 else out[1]


def _sort_cost(ins, outs, dim, **_):
    """A comparison sort: n ceil(log2 n) compares per row of n (Knuth, TAOCP vol. 3,
    5.3.1: no comparison sort does better than log2(n!) ~ n log2 n)."""
    x = ins[0]
    n = x.shape[dim] if x.dim() else 1
    f = x.numel() * max(1, math.ceil(math.log2(max(n, 2))))
    return costs.Cost(f, costs.nbytes(x) + sum(costs.nbytes(o) for o in outs), 0,
                      costs.backward_bytes(ins, outs[:1], costs.nbytes(outs[-1])))


_SORT = register("sort", [torch.sort, T.sort], parse=_sort_parse, rule=sort_rule,
                 local=_sort_local, cost=_sort_cost, op_class="reduction", n_out=2,
                 sample=lambda g: [Sample(torch.sort, (g.rn(5, 6), 1)),
                                   Sample(torch.sort, (g.rn(7, 3), 0), {"descending": True}),
                                   Sample(torch.sort, (g.grid(5, 6).round(),),
                                          {"stable": True})])               # ties
_SORT.extra["result_type"] = torch.return_types.sort          # (values, indices), named
register("argsort", [torch.argsort, T.argsort], parse=_argsort_parse, rule=sort_rule,
         local=_sort_local, cost=_sort_cost, op_class="reduction",
         sample=lambda g: [Sample(torch.argsort, (g.rn(5, 6),)),
                           Sample(torch.argsort, (g.grid(7, 3).round(),),
                                  {"dim": 0, "stable": True, "descending": True})])


def _msort_parse(x):
    return (x,), {"dim": 0, "descending": False, "stable": False, "n_out": 1}


def _msort_local(nd, ctx, x, dim, descending, stable, n_out):
    if x.dim() == nd:                 # a 0-d tensor: itself (as torch; its checks too)
        return torch.sort(x.unsqueeze(-1), dim=-1, stable=stable).values.squeeze(-1)
    return torch.sort(x, dim=nd, stable=stable).values


register("msort", [torch.msort, T.msort], parse=_msort_parse, rule=sort_rule,
         local=_msort_local, cost=_sort_cost, op_class="reduction",
         sample=lambda g: [Sample(torch.msort, (g.rn(5, 6),))])


# ---- selections composed of sort (composites.py installs them) -------------------------

def kthvalue(input, k, dim=-1, keepdim=False, *, out=None):
    """``torch.kthvalue``: the k-th smallest along ``dim`` and its index (a sort, then a
    pick: the dim is made whole as sort's)."""
    if out is not None:
        raise TypeError("kthvalue(out=...) on a DistTensor: assign the result")
    from .blas import cpu_check, torch_check
    if type(dim) is int and -input.ndim <= dim < input.ndim and input.shape[dim] == 0:
        # torch's kernel: an empty dim's IndexError before k's range (meta checks k first)
        cpu_check(torch.kthvalue, input, 1, dim, keepdim)
    torch_check(torch.kthvalue, input, k, dim, keepdim)
    cpu_check(torch.kthvalue, input, 1, dim, keepdim)        # its dtypes (not bool)
    if input.ndim == 0:
        from .extreme_grad import no_complex_grad            # a 0-d complex requiring grad
        no_complex_grad("kthvalue", input)
        # (the index made long at once: ``zeros_like(x).long()`` cast a partial's zeros,
        # a needless all-reduce of a P(min) input; wide probe seed 342)
        return torch.return_types.kthvalue((input.clone(),
                                                torch.zeros_like(input, dtype=torch.long)))
    # torch's kernel on whole rows: its pick among ties
    v, i = _call(_kthvalue_rows, (input, k, wrap_dim(dim, input.ndim), bool(keepdim)))
    return torch.return_types.kthvalue((v, i))


def median(input, dim=None, keepdim=False, *, out=None):
    """``torch.median``: the lower median (the ((n - 1) // 2 + 1)-th smallest); over every
    element (a value) when ``dim`` is None, else (values, indices) along ``dim``."""
    if out is not None:
        raise TypeError("median(out=...) on a DistTensor: assign the result")
    from .blas import cpu_check, torch_check
    for check in (torch_check, cpu_check):                 # shapes, then its dtypes
        check(torch.median, input) if dim is None else check(torch.median, input, dim, keepdim)
    if dim is None:                          # torch's kernel on the whole tensor: NaN
        return _call(_median_all, (input,))  # propagates, ties share the gradient evenly
    if input.ndim == 0:
        return torch.return_types.median((input.clone(),
                                              torch.zeros_like(input, dtype=torch.long)))
    # torch's kernel on whole rows: its pick among ties
    v, i = _call(_median_rows, (input, wrap_dim(dim, input.ndim), bool(keepdim)))
    return torch.return_types.median((v, i))


def _call(fn, args):
    """The table's callable ``fn`` on ``args``: dispatched for a DistTensor; on a plain
    tensor under a torch function mode (``wb.compile``'s capture), handed to the mode as
    ``fn`` itself, so the program records the table's op (it recorded nothing and raised
    AttributeError from the dispatcher: wide probe seeds 77, 95, 109, 111, 117); else
    torch's own call."""
    from torch.overrides import handle_torch_function, has_torch_function
    from ..dist_tensor import DistTensor
    if isinstance(args[0], DistTensor):
        from ..dispatch import dispatch
        return dispatch(fn, args, None)
    if has_torch_function(args[:1]):
        return handle_torch_function(fn, args[:1], *args)
    return fn(*args)


SELECTIONS = {torch.kthvalue: kthvalue, T.kthvalue: kthvalue, torch.median: median,
              T.median: median}


# ---- nanmedian: torch's own kernel on whole rows ----------------------------------------
# torch.nanmedian is the lower median of the non-NaN elements (NaN for a row of NaNs),
# with the index torch's kernel picks among equal values: a sort cannot reproduce that
# pick, so the reduced dim is made whole (S(dim) -> R) and every rank runs torch.nanmedian
# on its rows, as sort does.  Over every element (no dim) the tensor is made whole and
# torch.nanmedian(x) runs as is (its backward spreads the gradient evenly over the
# elements equal to the median, not to one index as the dim form's does).
#
#   nanmedian(dim)   R -> R, R;  S(d), d != dim -> S(d'), S(d')  (d' = d shifted when
#                    keepdim=False drops dim);  S(dim) -> whole;  no Partial passes
#   nanmedian()      whole -> R

def _nanmedian_rule(x, dim, keepdim=False, **_):
    opts = [(ins, outs * 2, note) for ins, outs, note in along_dim_options(x, dim, keepdim)]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1, n_outputs=2)


def _nanmedian_parse(input, dim=None, keepdim=False):
    if dim is None:                  # (the other form: :func:`_nanmedian_alone`), as torch
        raise TypeError("nanmedian(): argument 'dim' must be int, not NoneType (give a "
                        "dim, or call torch.nanmedian(x) for the median of every element)")
    return (input,), {"dim": wrap_dim(dim, max(input.ndim, 1)), "keepdim": bool(keepdim)}


def _nanmedian_local(nd, ctx, x, dim, keepdim=False):
    if x.dim() == nd:                 # a 0-d tensor along its dim 0 (as torch)
        v, i = torch.nanmedian(x.unsqueeze(-1), nd, keepdim=False)
        return v, i
    v, i = torch.nanmedian(x, shift(dim, x.dim() - nd, nd), keepdim=keepdim)
    return v, i


def _select_cost(ins, outs, dim=None, **_):
    """torch's CPU kernel selects, it does not sort: ``median_with_indices_impl``
    (pytorch aten/src/ATen/native/Sorting.cpp, commit fc55308874, L641-L740) runs
    ``std::nth_element`` on each row, linear on average.  Compares per row of n: Hoare's
    FIND for the median, 2 (1 + ln 2) n ~ 3.39 n expected (Knuth, "Mathematical analysis
    of algorithms", IFIP Congress 1971: 2n + 2k ln(n/k) + 2(n-k) ln(n/(n-k)) at k = n/2).
    ASSUMPTION: one compare is one FLOP (std::nth_element's introselect in libstdc++ is
    Hoare's FIND until its depth limit)."""
    x = ins[0]
    f = math.ceil(2 * (1 + math.log(2)) * x.numel())
    return costs.Cost(f, costs.nbytes(x) + sum(costs.nbytes(o) for o in outs), 0,
                      costs.backward_bytes(ins, outs[:1], costs.nbytes(outs[-1])))


def _with_nans(g):
    x = g.rn(5, 6)
    x[x > 0.8] = float("nan")                   # NaNs to skip, a row of NaNs, ties
    x[2] = float("nan")
    x[4, :3] = 0.25
    return x


def _nanmedian_sample(g):
    x = _with_nans(g)
    return [Sample(torch.nanmedian, (x, 1)),
            Sample(torch.nanmedian, (x, 0), {"keepdim": True}),
            Sample(torch.nanmedian, (g.ints(7, 3), -2))]


_NANMEDIAN = register("nanmedian", [torch.nanmedian, T.nanmedian], parse=_nanmedian_parse,
                      rule=_nanmedian_rule, local=_nanmedian_local, cost=_select_cost,
                      op_class="reduction", n_out=2, sample=_nanmedian_sample)
_NANMEDIAN.extra["result_type"] = torch.return_types.nanmedian


# kthvalue / median along a dim: torch's kernel on whole rows, as nanmedian (its
# ``std::nth_element`` picks one index among equal values that no sort reproduces: a
# stable sort's pick differs, e.g. kthvalue([2, -1, 2, -1, 1, 0, -3], 7) is the 2 at
# index 0 in torch).  The composites above check the arguments and dispatch these.

def _kthvalue_rows(input, k, dim, keepdim):
    """``torch.kthvalue(input, k, dim, keepdim)`` with a wrapped dim (the table's callable)."""
    return torch.kthvalue(input, k, dim, keepdim)


def _median_rows(input, dim, keepdim):
    """``torch.median(input, dim, keepdim)`` with a wrapped dim (the table's callable)."""
    return torch.median(input, dim, keepdim)


def _rows_rule(x, k=None, dim=-1, keepdim=False, **_):
    return _nanmedian_rule(x, dim, keepdim)


def _kthvalue_local(nd, ctx, x, k, dim, keepdim):
    return tuple(torch.kthvalue(x, k, shift(dim, x.dim() - nd, nd), keepdim))


def _median_local(nd, ctx, x, dim, keepdim):
    return tuple(torch.median(x, shift(dim, x.dim() - nd, nd), keepdim))


def _ties(g):
    return g.grid(5, 7).round()


_KTH = register("kthvalue_rows", [_kthvalue_rows],
                parse=lambda input, k, dim, keepdim: ((input,), {"k": int(k), "dim": dim,
                                                                 "keepdim": keepdim}),
                rule=_rows_rule, local=_kthvalue_local, cost=_select_cost,
                op_class="reduction", n_out=2,
                sample=lambda g: [Sample(_kthvalue_rows, (_ties(g), 3, 1, False)),
                                  Sample(_kthvalue_rows, (g.ints(7, 3), 2, 0, True))])
_MEDIAN = register("median_rows", [_median_rows],
                   parse=lambda input, dim, keepdim: ((input,), {"dim": dim,
                                                                 "keepdim": keepdim}),
                   rule=lambda x, dim, keepdim=False, **_: _nanmedian_rule(x, dim, keepdim),
                   local=_median_local, cost=_select_cost, op_class="reduction", n_out=2,
                   sample=lambda g: [Sample(_median_rows, (_ties(g), 1, False)),
                                     Sample(_median_rows, (g.ints(7, 3), 0, True))])


def _nanmedian_all(input):
    """``torch.nanmedian(input)``: the table's callable for the no-dim form."""
    return torch.nanmedian(input)


def _whole_rule(x, **_):
    from ..placement import Replicate
    R = Replicate()
    return combine(x.mesh.ndim, [[((R,), (R,), "whole: the median of every element")]]
                   * x.mesh.ndim, 1)


def _each_rank_whole(fn):
    """The local form of a whole-tensor reduction ``fn`` (median / nanmedian of every
    element): each rank's copy reduced alone, by torch's own kernel."""
    def local(nd, ctx, x):
        lead = tuple(x.shape[:nd])
        if all(n == 1 for n in lead):
            return fn(x.reshape(x.shape[nd:])).reshape(lead)
        rows = x.reshape((-1,) + tuple(x.shape[nd:]))      # a copy per rank: each alone
        return torch.stack([fn(r) for r in rows.unbind(0)]).reshape(lead)
    return local


_nanmedian_all_local = _each_rank_whole(torch.nanmedian)


register("nanmedian_all", [_nanmedian_all], parse=lambda input: ((input,), {}),
         rule=_whole_rule, local=_nanmedian_all_local, cost=_select_cost,
         op_class="reduction",
         sample=lambda g: [Sample(_nanmedian_all, (_with_nans(g),))])


def _median_all(input):
    """``torch.median(input)``: the table's callable for the no-dim form.  Its value is NaN
    where an element is (a sort's k-th of the flat tensor was not), and its backward is
    ``evenly_distribute_backward`` (derivatives.yaml, torch 2.13): the elements equal to
    the median share the gradient evenly (all the NaNs, for a NaN median), where the
    k-th's gradient went to one index."""
    return torch.median(input)


_median_all_local = _each_rank_whole(torch.median)


def _median_ties(g):
    x = _with_nans(g)
    return [Sample(_median_all, (x[3:],)), Sample(_median_all, (_ties(g),)),
            Sample(_median_all, (x,))]


register("median_all", [_median_all], parse=lambda input: ((input,), {}),
         rule=_whole_rule, local=_median_all_local, cost=_select_cost,
         op_class="reduction", sample=_median_ties)


def _nanmedian_alone(args, kwargs):
    """``torch.nanmedian(x)`` (no dim): the median of every element (``nanmedian_all``)."""
    if len(args) + len(kwargs) != 1 or kwargs and "input" not in kwargs:
        return NotImplemented
    from ..dispatch import dispatch
    return dispatch(_nanmedian_all, (args[0] if args else kwargs["input"],), None)


_NANMEDIAN.extra["other_form"] = _nanmedian_alone
