"""The torch calls capture's tracer answers itself rather than recording them as they come:
random draws, attribute ops (``x.T``), values asked of a traced tensor, ``max`` / ``min``
as eager DistTensors compose them, an op's input-alone form (``x.nanmedian()``), constants made ``*_like`` a traced tensor, factories
on the meta device, advanced indexing."""
from __future__ import annotations

import torch

from ..parallel.ops_table.sort import _nanmedian_all


T = torch.Tensor
# asking a traced tensor for its value: data-dependent control flow
# random draws made inside the program (capture would freeze one draw into a constant)
_RANDOM = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like,
           torch.randn_like, torch.randint_like, torch.normal, torch.bernoulli,
           torch.multinomial, T.normal_, T.uniform_, T.bernoulli_, T.random_}
# attributes that are ops: ``x.T`` reverses the dims (as DistTensor.T does: a permute),
# ``x.mT`` swaps the last two (the property's getter is what the mode sees)
_ALIASES = {T.T.__get__: lambda t: (T.permute, (t, tuple(reversed(range(t.ndim)))), {}),
            T.mT.__get__: lambda t: (T.transpose, (t, -2, -1), {})}
_VALUE_FUNCS = {T.__bool__, T.item, T.tolist, T.__int__, T.__float__, T.__index__,
                T.nonzero, T.numpy}


def _extremum(kind):
    """``torch.max`` / ``torch.min`` captured as eager DistTensors compose them
    (``parallel.habits._extremum``): with a dim, ``(values, indices)`` from ``argmax`` /
    ``argmin`` (the first extreme, as torch's) and ``gather`` at it, so the gradient goes to
    that one element; with a tensor, ``maximum`` / ``minimum``.  ``max(x)`` over every dim
    is recorded by the tracer as the eager call itself (``_Tracer``: an ``amax`` node whose
    call is ``max``, so the run takes eager's even gradient among ties and NaNs)."""
    arg, pair = (torch.argmax, torch.maximum) if kind == "max" else (torch.argmin, torch.minimum)
    result = getattr(torch.return_types, kind)

    def extremum(input, dim=None, keepdim=False, *, other=None, out=None):
        if out is not None or (dim is None and other is None):
            return NotImplemented
        if isinstance(dim, torch.Tensor) or other is not None:
            return pair(input, dim if other is None else other)
        if type(dim) is not int or type(keepdim) is not bool:
            return NotImplemented                       # torch's own error, from eager
        n = max(input.ndim, 1)
        if not -n <= dim < n:
            raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, "
                             f"{n - 1}], but got {dim})")
        key = input.to(torch.uint8) if input.dtype == torch.bool else input
        if input.ndim == 0:
            return result((input.clone(), arg(key)))
        idx = arg(key, dim, True)
        values = torch.gather(input, dim, idx)
        if not keepdim:
            values, idx = values.squeeze(dim), idx.squeeze(dim)
        return result((values, idx))
    return extremum


_EXTREMA = {f: _extremum(k) for k in ("max", "min") for f in (getattr(torch, k), getattr(T, k))}

# an op's form with the input alone, which eager dispatches as another entry of the table
# (the entry's ``other_form``): ``x.nanmedian()``, the median of every element, is
# ``nanmedian_all`` (ops_table/sort.py ``_nanmedian_alone``), recorded as that op (its
# parse wants a dim: a graph break where ``x.median()`` was captured)
_WHOLE = {torch.nanmedian: _nanmedian_all, T.nanmedian: _nanmedian_all}


def _whole(func, args, kwargs):
    """(the table's callable, its args) of a call of ``_WHOLE``'s form, else None."""
    if func not in _WHOLE or len(args) + len(kwargs) != 1 or (kwargs and "input" not in kwargs):
        return None
    return _WHOLE[func], (args[0] if args else kwargs["input"],)

# a new tensor shaped like a traced one (its shape and dtype are static): a constant of the
# program, as ``torch.zeros((8, 6))`` written out is (plain tensors are replicated);
# ``empty_like`` / ``new_empty`` as zeros (one of the values torch may leave there)
_FILL = {torch.zeros_like: 0, torch.ones_like: 1, torch.empty_like: 0,
         T.new_zeros: 0, T.new_ones: 1, T.new_empty: 0}


def _like(func, args, kwargs):
    """``torch.zeros_like(x)``, ``torch.full_like(x, v)``, ``x.new_zeros(size)``... as the
    constant they are: (the constant, or None for a form left to torch)."""
    kw = dict(kwargs)
    x, rest = args[0], list(args[1:])
    if "input" in kw:
        x = kw.pop("input")
    if kw.pop("memory_format", None) not in (None, torch.preserve_format,
                                             torch.contiguous_format):
        return None
    dtype = kw.pop("dtype", None) or x.dtype
    rg = bool(kw.pop("requires_grad", False))
    kw.pop("device", None), kw.pop("layout", None), kw.pop("pin_memory", None)
    if func in (torch.full_like, T.new_full):
        if func is T.new_full:
            if not rest and "size" not in kw:
                return None
            size = rest.pop(0) if rest else kw.pop("size")
        else:
            size = tuple(x.shape)
        if not rest and "fill_value" not in kw:
            return None
        value = rest.pop(0) if rest else kw.pop("fill_value")
    elif func in _FILL:
        value = _FILL[func]
        if func in (torch.zeros_like, torch.ones_like, torch.empty_like):
            size = tuple(x.shape)
        else:
            size = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) \
                else tuple(rest) if rest else kw.pop("size", None)
            rest = []
            if size is None:
                return None
    else:
        return None
    if rest or kw:
        return None
    return torch.full(tuple(size), value, dtype=dtype).requires_grad_(rg)


# factories whose values torch leaves unset: made again on the CPU they would hold garbage
_NO_VALUES = {torch.empty, torch.empty_like, torch.empty_strided, T.new_empty}


def _meta_device(device) -> bool:
    """``device`` (a factory's keyword) names the meta device (a stand-in's ``x.device``)."""
    return device is not None and not isinstance(device, int) and \
        torch.device(device).type == "meta"


def _advanced(index) -> bool:
    """An index holding an index tensor or a list: advanced indexing (a constant index or
    one the program computes; a computed bool mask breaks the graph at its ``nonzero``)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, (torch.Tensor, list)) for i in items)
