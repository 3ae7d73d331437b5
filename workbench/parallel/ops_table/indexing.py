"""Gather-like ops and broadcasting copies: gather, scatter, index_select, expand, repeat.

Per mesh dim:

    gather(x, dim, index)          x and index whole along dim (an index points anywhere
                                   in it); another dim d passes sharded in both when x and
                                   index have the same size there (their shards line up);
                                   linear in x: P(x), R(index) -> P
    scatter(x, dim, index, src)    the same; linear in (x, src) jointly: P, R, P -> P
    index_select(x, dim, index)    dim whole in x, index replicated; other dims pass;
                                   linear in x
    expand(sizes)                  kept dims pass (shifted by the new leading dims); an
                                   expanded (size-1) dim is whole by definition; linear
    repeat(reps)                   a dim repeated more than once is whole (the copies tile
                                   the global dim, not each shard); others pass; linear
"""
from __future__ import annotations

import contextlib
import re

import torch

from ..placement import Partial, Replicate, Shard
from . import costs
from ._util import align, is_tensor, wrap_dim, broadcast_shapes
from .strategy import combine
from .table import register

__all__ = ["gather_rule", "scatter_rule", "index_select_rule", "expand_rule", "repeat_rule"]

T = torch.Tensor
R = Replicate()
P = Partial("sum")


def _per_dim(mesh, opts, n_in):
    return combine(mesh.ndim, [opts] * mesh.ndim, n_in)


# ---- gather --------------------------------------------------------------------------

def gather_rule(x, index, *, dim, **_):
    """gather along an unsharded dim; other dims pass where x and index line up."""
    dim = wrap_dim(dim, x.ndim)           # infer hands the user's dim=-1 as given
    opts = [((R, R), (R,), "replicated")]
    for d in range(x.ndim):
        if d != dim and index.shape[d] > 1 and x.shape[d] == index.shape[d]:
            opts.append(((Shard(d), Shard(d)), (Shard(d),), f"dim {d} sharded in x and index"))
    opts.append(((P, R), (P,), "linear in x: a selection of a sum is the sum of selections"))
    return _per_dim(x.mesh, opts, 2)


def _gather_parse(x, dim, index, *, sparse_grad=False):
    return (x, index), {"dim": wrap_dim(dim, x.ndim)}


def _gather_local(nd, ctx, x, index, dim):
    x, index = align(nd, x, index)
    lead = broadcast_shapes(x.shape[:nd], index.shape[:nd])
    x = x.expand(lead + tuple(x.shape[nd:]))
    index = index.expand(lead + tuple(index.shape[nd:]))
    if x.dim() == nd:                 # 0-d x and index along dim 0 (as torch)
        return torch.gather(x.unsqueeze(-1), nd, index.unsqueeze(-1)).squeeze(-1)
    with _global_dims(nd):
        return torch.gather(x, dim + nd, index)


@contextlib.contextmanager
def _global_dims(nd):
    """torch's bound error of a stacked call ("index 8 is out of bounds for dimension 2
    with size 6") names the global dim, as the user's call of torch does (dimension 1)."""
    try:
        yield
    except RuntimeError as e:
        m = re.fullmatch(r"index (-?\d+) is out of bounds for dimension (\d+) with size (\d+)",
                         str(e))
        if m is None or int(m[2]) < nd:
            raise
        raise RuntimeError(f"index {m[1]} is out of bounds for dimension {int(m[2]) - nd} "
                           f"with size {m[3]}") from None


register("gather", [torch.gather, T.gather], parse=_gather_parse, rule=gather_rule,
         local=_gather_local, cost=costs.movement, op_class="data_movement")


# ---- scatter -------------------------------------------------------------------------

def scatter_rule(x, index, src=None, *, dim, **_):
    """scatter along an unsharded dim; other dims pass where x, index, src line up."""
    dim = wrap_dim(dim, x.ndim)
    opts = [((R, R, None if src is None else R), (R,), "replicated")]
    for d in range(x.ndim):
        same = x.shape[d] == index.shape[d] and (src is None or src.shape[d] == index.shape[d])
        if d != dim and index.shape[d] > 1 and same:
            opts.append(((Shard(d), Shard(d), None if src is None else Shard(d)), (Shard(d),),
                         f"dim {d} sharded in x, index and src"))
    if src is not None:
        opts.append(((P, R, P), (P,), "linear in (x, src): written and kept entries both sums"))
    return _per_dim(x.mesh, opts, 3)


def _scatter_parse(x, dim, index, src=None, *, value=None, reduce=None):
    if reduce is not None:
        raise NotImplementedError("scatter(reduce=...) on DistTensors: use scatter_reduce "
                                  "on gathered tensors, or reduce=None")
    if src is None and value is None:
        raise TypeError("scatter(x, dim, index): give src (a tensor) or value (a number)")
    if src is not None and not is_tensor(src):
        src, value = None, src
    return (x, index, src), {"dim": wrap_dim(dim, x.ndim), "value": value}


def _scatter_local(nd, ctx, x, index, src, dim, value):
    ts = [t for t in (x, index, src) if t is not None]
    lead = broadcast_shapes(*(t.shape[:nd] for t in ts))
    x, index = (t.expand(lead + tuple(t.shape[nd:])) for t in (x, index))
    if x.dim() == nd:            # a 0-d x (dim 0 / -1): its one element, as torch's
        x, index = x.unsqueeze(-1), index.reshape(lead + (1,))
        src = None if src is None else src.reshape(tuple(src.shape[:nd]) + (1,))
        return _scatter_local(nd, ctx, x, index, src, 0, value).squeeze(-1)
    with _global_dims(nd):
        if src is None:
            return torch.scatter(x, dim + nd, index, value)
        return torch.scatter(x, dim + nd, index, src.expand(lead + tuple(src.shape[nd:])))


register("scatter", [torch.scatter, T.scatter], parse=_scatter_parse, rule=scatter_rule,
         local=_scatter_local, cost=costs.movement, op_class="data_movement")


# ---- index_select --------------------------------------------------------------------

def index_select_rule(x, index, *, dim, **_):
    """index_select: dim whole, index replicated; other dims pass; linear in x."""
    dim = wrap_dim(dim, x.ndim)
    opts = [((R, R), (R,), "replicated")]
    for d in range(x.ndim):
        if d != dim and x.shape[d] > 1:
            opts.append(((Shard(d), R), (Shard(d),), f"dim {d} sharded passes"))
    opts.append(((P, R), (P,), "linear in x"))
    return _per_dim(x.mesh, opts, 2)


def _index_select_parse(x, dim, index):
    return (x, index), {"dim": wrap_dim(dim, x.ndim)}


def _index_select_local(nd, ctx, x, index, dim):
    idx = index[(0,) * nd].reshape(-1)        # replicated (the rule): every copy is the same
    if x.dim() == nd:           # a 0-d x: its one element, as torch's (here an IndexError)
        if idx.numel() != 1:
            raise RuntimeError("index_select(): Index to scalar can have only 1 value, got "
                               f"{idx.numel()} value(s)")
        return _index_select_local(nd, ctx, x.unsqueeze(-1), index, 0).squeeze(-1)
    n = x.shape[dim + nd]
    # (a meta index, the dry run's: values unknown, nothing to check)
    if idx.numel() and n and not idx.is_meta and bool(((idx < 0) | (idx >= n)).any()):
        # torch's error for the global call (the stacked one's dim is dim + nd, another
        # kernel's): index_select_out_cpu_ (aten/src/ATen/native/TensorAdvancedIndexing.cpp)
        # takes index_select_out_cpu_dim1_ for dim 1 of a tensor of more than one dim
        # ("INDICES element is out of DATA bounds", a RuntimeError, the first bad one),
        # else checks "index out of range in self" (an IndexError); measured on 2.13
        if x.dim() - nd > 1 and dim == 1:
            bad = int(idx[(idx < 0) | (idx >= n)][0])
            raise RuntimeError(f"INDICES element is out of DATA bounds, id={bad} "
                               f"axis_dim={n}")
        raise IndexError("index out of range in self")
    return torch.index_select(x, dim + nd, idx)


register("index_select", [torch.index_select, T.index_select], parse=_index_select_parse,
         rule=index_select_rule, local=_index_select_local, cost=costs.movement,
         op_class="data_movement")


# ---- expand, expand_as ---------------------------------------------------------------

def expand_rule(x, *, shape, **_):
    """expand: kept dims pass, moved right by the new leading dims; linear."""
    new = len(shape) - x.ndim
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim):
        if x.shape[d] > 1:
            opts.append(((Shard(d),), (Shard(d + new),), f"kept dim {d} passes to {d + new}"))
    opts += [((Partial(op),), (Partial(op),), f"copies of P({op}) are P({op})")
             for op in ("sum", "avg", "max", "min")]
    return _per_dim(x.mesh, opts, 1)


def _expand_parse(x, *sizes):
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    meta = torch.empty(tuple(x.shape), dtype=x.dtype, device="meta").expand(*sizes)
    return (x,), {"shape": tuple(meta.shape)}


def _expand_local(nd, ctx, x, shape):
    glob = tuple(ctx.in_specs[0].shape) if ctx is not None else tuple(x.shape[nd:])
    new = len(shape) - len(glob)
    x = x.reshape(tuple(x.shape[:nd]) + (1,) * new + tuple(x.shape[nd:]))
    # dims of global size 1 expanded to shape take their size; the others stay local
    target = [-1] * nd + [s if n == 1 else -1 for n, s in zip((1,) * new + glob, shape)]
    return x.expand(target)


# (torch.broadcast_to(x, shape) is x.expand(shape): "Equivalent to calling
# input.expand(shape)", torch docs)
register("expand", [T.expand, torch.broadcast_to, T.broadcast_to], parse=_expand_parse,
         rule=expand_rule, local=_expand_local, cost=costs.view, op_class="view")
register("expand_as", [T.expand_as], parse=lambda x, other: _expand_parse(x, tuple(other.shape)),
         rule=expand_rule, local=_expand_local, cost=costs.view, op_class="view")


# ---- repeat --------------------------------------------------------------------------

def repeat_rule(x, *, reps, **_):
    """repeat: dims repeated once pass (moved right by new leading dims); linear."""
    new = len(reps) - x.ndim
    opts = [((R,), (R,), "replicated")]
    for d in range(x.ndim):
        if x.shape[d] > 1 and reps[d + new] == 1:
            opts.append(((Shard(d),), (Shard(d + new),), f"dim {d} not repeated: passes"))
    opts += [((Partial(op),), (Partial(op),), f"copies of P({op}) are P({op})")
             for op in ("sum", "avg", "max", "min")]
    return _per_dim(x.mesh, opts, 1)


def _repeat_parse(x, *reps):
    if len(reps) == 1 and isinstance(reps[0], (tuple, list, torch.Size)):
        reps = tuple(reps[0])
    torch.empty(tuple(x.shape), device="meta").repeat(reps)         # torch's own checks
    return (x,), {"reps": tuple(int(r) for r in reps)}


def _repeat_local(nd, ctx, x, reps):
    new = len(reps) - (x.dim() - nd)
    x = x.reshape(tuple(x.shape[:nd]) + (1,) * new + tuple(x.shape[nd:]))
    return x.repeat((1,) * nd + tuple(reps))


register("repeat", [T.repeat], parse=_repeat_parse, rule=repeat_rule, local=_repeat_local,
         cost=costs.movement, op_class="data_movement")


# ---- x[idx] with one integer / bool index (advanced indexing) as index_select ----------------

def advanced_index(x, idx):
    """``(dim, index)`` when ``x[idx]`` is basic slices around one advanced index (an int or
    bool tensor, a list of ints or bools, an int DistTensor): ``x[..., i, ...]`` is
    ``index_select(x, dim, i.flatten()).unflatten(dim, i.shape)``; None for a basic index
    (getitem's). Other forms raise, naming the supported ones."""
    from ..dist_tensor import DistTensor
    items = idx if isinstance(idx, tuple) else (idx,)
    adv = [k for k, i in enumerate(items)
           if isinstance(i, (torch.Tensor, DistTensor, list)) and not (
               isinstance(i, torch.Tensor) and i.dim() == 0 and not i.dtype.is_floating_point
               and i.dtype != torch.bool)]
    if not adv:
        return None
    if len(adv) > 1 or any(not (i == slice(None) or i is Ellipsis)
                           for k, i in enumerate(items) if k != adv[0]):
        raise NotImplementedError(
            f"x[{idx!r:.80}]: DistTensor advanced indexing takes one index tensor (or list) "
            "with only ':' and '...' beside it; use torch.index_select / torch.gather, or "
            "index in two steps")
    k = adv[0]
    ell = [j for j, i in enumerate(items) if i is Ellipsis]
    dim = k if not ell or ell[0] > k else x.ndim - (len(items) - k)
    i = items[k]
    if isinstance(i, list):
        i = list_index(i)
    if i.dtype == torch.uint8:        # a mask, as torch reads it (deprecated there too)
        import warnings
        warnings.warn("indexing with dtype torch.uint8 is now deprecated, please use a "
                      "dtype torch.bool instead.", UserWarning, stacklevel=4)
        i = i.bool()
    if not isinstance(i, DistTensor) and i.dtype == torch.bool:
        if i.dim() != 1 or i.shape[0] != x.shape[dim]:
            raise IndexError(f"The shape of the mask {list(i.shape)} at index {dim} does not "
                             f"match the shape of the indexed tensor {list(x.shape)}"
                             if i.dim() == 1 else
                             f"x[mask]: a {i.dim()}-d bool mask on a DistTensor; index with a "
                             "1-d mask per dim, or gather first with .full()")
        i = i.nonzero().squeeze(1)
    if isinstance(i, DistTensor) and i.dtype == torch.bool:
        raise NotImplementedError(
            "x[mask] with a DistTensor bool mask: the result's length depends on the mask's "
            "values (as masked_select's); keep the shape with torch.where(mask, x, 0) or "
            "x.masked_fill(~mask, 0), or index with the gathered mask (mask.full())")
    if i.dtype.is_floating_point or i.dtype == torch.bool:
        raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    if not 0 <= dim < x.ndim:
        raise IndexError(f"x[{idx!r:.60}]: too many indices for a {x.ndim}-d tensor")
    n = x.shape[dim]
    if x.numel() == 0 and n:
        # torch's index kernel reads no element of an empty result, so it checks no
        # bound (x (1, 0)[tensor([5])] is a (1, 0) tensor): nor do we
        return dim, torch.zeros_like(i).long()
    from .index_bounds import first_out_of_bounds, wrap_indices
    if isinstance(i, DistTensor) or i.device.type == "meta":
        # values not known yet (a DistTensor's, or a meta one wb.compile's capture
        # traces): checked where they are, in torch's order (index_bounds.py)
        return dim, wrap_indices(i.unsqueeze(-1), (n,)).squeeze(-1)
    msg = first_out_of_bounds(i.unsqueeze(-1), (n,))
    if msg is not None:
        raise IndexError(msg)
    return dim, torch.where(i < 0, i + n, i).long()


def index_with(x, dim, i):
    """``x[..., i, ...]`` along ``dim`` (see :func:`advanced_index`)."""
    flat = i.reshape(-1)
    y = torch.index_select(x, dim, flat)
    return y if tuple(i.shape) == tuple(flat.shape) else y.unflatten(dim, tuple(i.shape))


# ---- x[i, :, j], x[1:, i], x[0, i, None]: advanced indices beside others -------------------

def _is_advanced(i) -> bool:
    from ..dist_tensor import DistTensor
    if isinstance(i, (list, bool)):
        return True
    if isinstance(i, (torch.Tensor, DistTensor)):
        # a 0-d integer tensor is an int (a select), as torch's indexing reads it; a 0-d
        # bool or uint8 one is a bool (bool_scalar)
        return not (i.dim() == 0 and not i.dtype.is_floating_point and not i.dtype.is_complex
                    and i.dtype not in (torch.bool, torch.uint8))
    return False


def bool_scalar(i) -> bool:
    """A Python bool, or a 0-d bool / uint8 tensor: torch's indexing adds a dim there and
    indexes it with ``[0]`` (True) or ``[]`` (False) (``boolToIndexingTensor`` in
    torch/csrc/autograd/python_variable_indexing.cpp): ``x[True, 0]`` is (1, ...)."""
    from ..dist_tensor import DistTensor
    return isinstance(i, bool) or isinstance(i, (torch.Tensor, DistTensor)) and \
        i.dim() == 0 and i.dtype in (torch.bool, torch.uint8)


def list_index(i: list) -> torch.Tensor:
    """A list index as torch reads it (``indexing_tensor_from_data``): bools (or uint8)
    as a mask, anything else as int64 (``x[[0.5, 1.7]]`` is ``x[[0, 1]]``, ``x[[]]`` empty)."""
    t = torch.as_tensor(i)
    return t if t.dtype in (torch.bool, torch.uint8) else t.long()


def sequence_as_tuple(index) -> bool:
    """torch's ``treatSequenceAsTuple`` (NumPy's rule, deprecated in torch): a list of fewer
    than 32 items holding a tensor, a sequence, a slice, ``...`` or None indexes as the
    tuple of its items (``x[[[0, 1], [1, 2]]]`` is ``x[[0, 1], [1, 2]]``), with torch's
    warning."""
    from ..dist_tensor import DistTensor
    if type(index) is not list or len(index) >= 32:
        return False
    if any(isinstance(i, (torch.Tensor, DistTensor, list, tuple, str, slice)) or i is None
           or i is Ellipsis for i in index):
        import warnings
        warnings.warn("Using a non-tuple sequence for multidimensional indexing is deprecated "
                      "and will be changed in pytorch 2.9; use x[tuple(seq)] instead of "
                      "x[seq]. In pytorch 2.9 this will be interpreted as tensor index, "
                      "x[torch.tensor(seq)], which will result either in an error or a "
                      "different result", UserWarning, stacklevel=3)
        return True
    return False


def _mask_nd(i) -> bool:
    """A plain bool (or uint8) mask of two dims or more: its ``nonzero()`` indices, here
    (``x[..., mask]``; :func:`advanced_index` takes one dim only)."""
    return isinstance(i, torch.Tensor) and i.dim() > 1 and i.dtype in (torch.bool, torch.uint8)


class _NewDim:
    """A bool index (:func:`bool_scalar`): a new dim, indexed by ``t`` ([0] or [])."""
    __slots__ = ("t",)

    def __init__(self, value: bool):
        self.t = torch.zeros(1 if value else 0, dtype=torch.long)


def mixed_index(x, idx):
    """``x[idx]`` where advanced indices (int / bool tensors, lists, bools) stand beside
    anything but ``:`` and ``...``, or there are several: torch's own algorithm
    (``applySlicing`` then ``index``, torch/csrc/autograd/python_variable_indexing.cpp):
    the basic part first (ints select, slices narrow, None adds a dim, a bool adds a dim
    indexed by [0] or [], each index tensor's dims kept whole), then the index tensors,
    broadcast together to ``B``, pick elements: if their dims are adjacent ``B`` takes
    their place, else it goes first (NumPy's rule).  Here the picked dims are moved
    together, flattened, and one ``index_select`` of the linear index (``i0 n1 n2 + i1 n2
    + i2``) is unflattened to ``B``: exact ops of the table, so placements follow their
    rules (a shard of a picked dim is gathered, the others pass).  A k-d bool mask is its
    ``nonzero()`` (k index tensors); a DistTensor index is gathered first.  torch's checks
    (broadcast, mask shapes, bounds, dtypes), errors and result shape come from the same
    index on a stand-in of x's shape (one byte expanded: no memory of x's size).  None
    when :func:`advanced_index` takes ``idx`` (one index tensor or list with only ``:`` /
    ``...`` beside it) or there is no advanced index."""
    from ..dist_tensor import DistTensor
    items = idx if isinstance(idx, tuple) else (idx,)
    adv = [k for k, i in enumerate(items) if _is_advanced(i)]
    if not adv or (len(adv) == 1 and not bool_scalar(items[adv[0]]) and not _mask_nd(
            items[adv[0]]) and all(i == slice(None) or i is Ellipsis
                                   for k, i in enumerate(items) if k != adv[0])):
        return None
    plain = []                  # DistTensor indices gathered, lists as torch reads them
    for i in items:
        if isinstance(i, DistTensor):
            if i.dtype == torch.bool:
                raise NotImplementedError(
                    "x[..., mask, ...] with a DistTensor bool mask beside other indices: the "
                    "result's length depends on the mask's values; index with the gathered "
                    "mask (mask.full()) or keep the shape with torch.where")
            i = i.full()
        plain.append(list_index(i) if isinstance(i, list) else i)
    # torch's checks, errors and result shape (its bounds too: none where x is empty)
    if any(isinstance(i, torch.Tensor) and i.device.type == "meta" for i in plain):
        # wb.compile's capture (the index's values unknown): the checks of shapes, on meta
        # stand-ins it does not trace
        probe = tuple(torch.empty(tuple(i.shape), dtype=i.dtype, device="meta")
                      if isinstance(i, torch.Tensor) else i for i in plain)
        want = torch.zeros((), dtype=torch.bool, device="meta").expand(tuple(x.shape))[probe].shape
    else:
        want = torch.zeros((), dtype=torch.bool).expand(tuple(x.shape))[tuple(plain)].shape
    expanded = []               # bools as new dims, bool masks as their nonzero() indices
    for i in plain:
        if bool_scalar(i):
            expanded.append(_NewDim(bool(i)))
        elif isinstance(i, torch.Tensor) and i.dim() and i.dtype in (torch.bool, torch.uint8):
            expanded.extend(i.bool().nonzero().unbind(1))
        else:
            expanded.append(i)
    # the basic part: each index tensor's dim kept whole (':'), ints as ints
    consumed = sum(1 for i in expanded if i is not None and i is not Ellipsis
                   and not isinstance(i, _NewDim))
    basic, where, out_dim = [], [], 0
    for i in expanded:
        if i is Ellipsis:
            basic.append(Ellipsis)
            out_dim += x.ndim - consumed
        elif i is None or isinstance(i, slice):
            basic.append(i)
            out_dim += 1
        elif isinstance(i, _NewDim):
            basic.append(None)
            where.append((out_dim, i.t))
            out_dim += 1
        elif isinstance(i, torch.Tensor) and i.dim():
            basic.append(slice(None))
            where.append((out_dim, i))
            out_dim += 1
        else:                   # an int or a 0-d integer tensor: a select
            basic.append(int(i))
    y = x[tuple(basic)] if any(b != slice(None) for b in basic) else x
    dims = [d for d, _ in where]
    sizes = [y.shape[d] for d in dims]
    ts = []
    for (d, i), n in zip(where, sizes):
        if y.numel() == 0 and n:        # torch's index kernel reads no element: no bound
            i = torch.zeros_like(i)     # checked (as advanced_index)
        ts.append(i)
    B = tuple(broadcast_shapes(*(t.shape for t in ts)))
    ts = [t.expand(B) for t in ts]            # broadcast_tensors, as table ops
    if y.numel() and any(t.device.type == "meta" for t in ts):
        # wb.compile's capture: the values are checked where they are known, in torch's
        # order (index_bounds.py); plain ones were checked above, by torch itself
        from .index_bounds import wrap_indices
        ts = list(wrap_indices(torch.stack(ts, -1), tuple(sizes)).unbind(-1))
    else:
        ts = [torch.where(t < 0, t + n, t).long() for t, n in zip(ts, sizes)]
    lin = torch.zeros(B, dtype=torch.long)
    for t, n in zip(ts, sizes):
        lin = lin * n + t
    adjacent = dims == list(range(dims[0], dims[0] + len(dims)))
    at = dims[0] if adjacent else 0
    if not adjacent:
        y = y.movedim(dims, list(range(len(dims))))
    if len(dims) > 1:
        y = y.flatten(at, at + len(dims) - 1)
    out = torch.index_select(y, at, lin.reshape(-1))
    out = out.unflatten(at, B) if B else out.squeeze(at)
    if tuple(out.shape) != tuple(want):     # (not met: a guard, torch's kind of error)
        raise RuntimeError(f"x[{idx!r:.60}] on a DistTensor: the result's shape "
                           f"{tuple(out.shape)} is not torch's {tuple(want)}; index the "
                           "gathered tensor (x.full()[...]) instead")
    return out
