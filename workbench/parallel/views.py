"""Views of DistTensors, as torch's: ``x[1:]``, ``x.T``, ``x.view(...)`` share ``x``'s memory,
so that a write into the view reaches ``x`` (``x[0].zero_()``, ``w[:, :k].copy_(...)``).

The dispatcher tells :func:`note_views` of every output of a view op (op class
"view"). Most share the base's local memory: a write into them lands in the base
(:mod:`.inplace` writes into local tensors). Where the op had to move data (an uneven
shard re-cut, a reshape that gathers), the output is a copy: a write into a getitem
view then also goes into the base as ``base[index] = value``, into a reshaping view
(view, reshape, flatten, unflatten, unsqueeze, squeeze) as ``base.copy_(value reshaped)``
into a permuting one (permute, transpose, movedim, t) as ``base.copy_(value permuted
back)`` and into a diagonal as ``base.copy_(diagonal_scatter(base, value, ...))``; so does a
write autograd records (the view then takes memory of its own, as the result's).  Into
any other such view (expand, view_as_real, ...) it raises (the write could
not reach the base), as does a write into an expanded view (several elements in one
memory location, as torch). ``x._view`` holds ``(base, index or None, aliased)``.
"""
from __future__ import annotations

import weakref

import torch

from . import storage

__all__ = ["note_views", "through_view", "copy_link", "push_link", "refresh"]


def _torch_index(index) -> tuple:
    """getitem's normalized index (``rules/shape.normalize_index``) as a torch index."""
    conv = {"all": lambda e: slice(None), "slice": lambda e: slice(*e[1:]),
            "int": lambda e: e[1], "new": lambda e: None}
    return tuple(conv[e[0]](e) for e in index)


# base id -> weakrefs to its views that can be recomputed (an index or WHOLE): refreshed
# after a write into the base that they do not see (they are copies, or the base took new
# memory).  A live view holds its base (``_view[0]``), so a base's id is not reused while
# one of its views lives.
_VIEWS: dict = {}


def _register(base, views) -> None:
    refs = _VIEWS.get(id(base))
    if refs is None:
        if len(_VIEWS) > 4096:
            for k in [k for k, rs in _VIEWS.items() if all(r() is None for r in rs)]:
                del _VIEWS[k]
        refs = _VIEWS[id(base)] = []
    elif len(refs) > 16:
        refs[:] = [r for r in refs if r() is not None]
    refs.extend(weakref.ref(v) for v in views)


def refresh(base, replaced: bool) -> None:
    """After a write into ``base``: its views that do not share its memory now (copies, or
    all of them when ``replaced``: the base took new local tensors) are computed again
    from it, as torch's views show the base's new values; and so on down their views."""
    refs = _VIEWS.get(id(base))
    if not refs:
        return
    from .dispatch import dispatch
    from .reshard import reshard
    for r in list(refs):
        v = r()
        if v is None or v._view is None or v._view[0] is not base:
            continue
        _, index, aliased = v._view
        if (aliased and not replaced) or index is None:
            continue
        if index == WHOLE:
            new = dispatch(torch.Tensor.reshape, (base, tuple(v.shape)), None)
        elif isinstance(index, Perm):
            new = dispatch(torch.Tensor.permute, (base, tuple(index)), None)
        elif isinstance(index, Diag):
            new = dispatch(torch.Tensor.diagonal, (base, *index), None)
        else:
            new = dispatch(torch.Tensor.__getitem__, (base, index), None)
        if new.placements != v.placements:
            new = reshard(new, v.mesh, v.placements)
        old = v._local
        v._local = new._local
        if not aliased:
            # a view of the written base: torch's views share its version counter (a view
            # saved for backward raises there); a copy here does not share it: bumped (an
            # alias shares the memory it views, bumped by that memory's write)
            from .versions import bump
            bump(storage.tensors(old), f"a write into {base.notation()} seen by its view")
        v._view = (base, index, new._view is not None and new._view[2])
        _follow_handles(v, old)
        refresh(v, True)


def _follow_handles(v, old) -> None:
    """``v`` (a view that is a copy) took new memory: its ``detach()`` / ``.data`` handles
    that still held its old memory take the new one too, as torch's share one memory
    (``d = t[1:].detach()`` over uneven shards kept the values of before a write into
    ``t``, silently)."""
    from .dist_tensor import COPY_HANDLES
    refs = COPY_HANDLES.get(id(v))
    if not refs:
        return
    olds = {t.data_ptr() for t in storage.tensors(old)}
    live = []
    for r in refs:
        h = r()
        if h is None:
            continue
        live.append(r)
        if {t.data_ptr() for t in storage.tensors(h._local)} <= olds:
            h._local = storage.map_tensors(v._local, lambda t: t.detach())
    refs[:] = live


def note_views(name, base, outs, attrs) -> None:
    """Remember that the outputs of view op ``name`` are views of ``base``: an alias of
    its memory, or (where the op had to move data, e.g. an uneven shard re-cut) a copy
    that a write must reach through ``base[index] = ...`` (getitem) or cannot (others)."""
    if not outs:                # x.unbind(d) of a size-0 dim: no view to remember
        return
    if name in _MULTI and torch.is_grad_enabled() and base.requires_grad:
        for o in outs:          # torch's views of a multi-output node: no in-place write
            key = id(o)
            MULTI_OUT[key] = (weakref.ref(o, lambda _, k=key: MULTI_OUT.pop(k, None)), name)
    if name in ("expand", "expand_as"):
        for o in outs:          # (no index: a write cannot go back through base[index])
            key = id(o)
            EXPANDED[key] = (weakref.ref(o, lambda _, k=key: EXPANDED.pop(k, None)),
                             tuple(o.shape))
    index = _torch_index(attrs["index"]) if name == "getitem" else \
        WHOLE if name in _RESHAPES else \
        Perm(tuple(attrs["dims"])) if name in _PERMUTES else \
        Diag((attrs["offset"], attrs["dim1"], attrs["dim2"])) if name == "diagonal" else None
    indices = _pieces(name, attrs, len(outs)) or (index,) * len(outs)
    b = base._local
    if type(b) is torch.Tensor:
        # the common case first: a stacked output that torch made a view of the stacked
        # base (its _base is the base's root) shares its memory, no storage compared
        root = b if b._base is None else b._base
        rest = []
        for o, ix in zip(outs, indices):
            t = o._local
            if type(t) is torch.Tensor and (t is b or t._base is root):
                o._view = (base, ix, True)
            else:
                rest.append((o, ix))
        if not rest:
            if indices[0] is not None:
                _register(base, outs)
            return
    else:
        rest = list(zip(outs, indices))
    mine = {_ptr(t) for t in storage.tensors(base._local) if t.numel()} - {None}
    for o, ix in rest:
        ts = [t for t in storage.tensors(o._local) if t.numel()]
        aliased = all(_ptr(t) in mine for t in ts)
        o._view = (base, ix, aliased)
    if indices[0] is not None:
        _register(base, outs)


# id(an output of split / chunk / unbind made with grad) -> (weakref to it, the op): torch
# marks such views (CreationMeta MULTI_OUTPUT_NODE) and refuses an in-place write into them
# or their views (check_multi_output_write)
MULTI_OUT: dict = {}
_MULTI = ("split", "chunk", "unbind")


def check_multi_output_write(x, op) -> None:
    """torch 2.13 raises RuntimeError for an in-place write, with grad on, into an output of
    split / chunk / unbind made from a tensor that requires grad, or into a view of one
    ('Output 0 of SplitBackward0 is a view and is being modified inplace. This view is the
    output of a function that returns multiple views...'); ours wrote it (random sweep old
    seed 1071550: ``t3.split(1, 0)[0].select(0, -1).lerp_(t5)`` returned a result)."""
    if not torch.is_grad_enabled():
        return
    d = x
    while d is not None:
        hit = MULTI_OUT.get(id(d))
        if hit is not None and hit[0]() is d and d.requires_grad:
            raise RuntimeError(
                f"{op}(): output of {hit[1]}() is a view and is being modified inplace. "
                "This view is the output of a function that returns multiple views. Such "
                "functions do not allow the output views to be modified inplace. You "
                "should replace the inplace operation by an out-of-place one (torch's rule)")
        d = d._view[0] if d._view is not None else None


# id(a DistTensor made by expand / expand_as) -> (weakref to it, its shape): the overlap
# check (inplace_overlap) redoes the expand on its stand-in; fill_ / zero_ write its base
EXPANDED: dict = {}


def expanded(x):
    """The shape ``x`` was expanded to from its base (``x._view[0]``), where ``x`` is an
    expand of it that still shares its memory; else None."""
    v = x._view
    refs = EXPANDED.get(id(x))
    if v is None or v[1] is not None or not v[2] or refs is None or refs[0]() is not x:
        return None
    return refs[1]


WHOLE = "whole"     # the index of a reshape's view: all of the base, in the base's shape
# views that keep the elements' row-major order (a write goes back as a reshape)
# (positive: torch returns the tensor itself, so a write into it is a write into the base)
_RESHAPES = ("view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "positive")
_PERMUTES = ("permute", "transpose")     # movedim, swapaxes, t: the table's "dims" permutation


class Perm(tuple):
    """The index of a permuting view (``x.permute(dims)``, ``x.transpose(a, b)``,
    ``x.movedim(...)``, ``x.t()``): all of the base, its dims reordered.  A write into the
    view goes back as ``base.copy_(value.permute(inverse))`` (a bijection of the
    elements, so the base's every element is the view's one), which autograd records as
    torch records an in-place op through a view (seed sweeps: ``t.movedim(..).unsqueeze(..)
    .mul_(2)`` on a tracked tensor was refused)."""

    @property
    def inverse(self) -> tuple:
        inv = [0] * len(self)
        for j, d in enumerate(self):
            inv[d] = j
        return tuple(inv)


class Diag(tuple):
    """The index of a diagonal view (``x.diagonal(offset, dim1, dim2)``): ``(offset, dim1,
    dim2)``, dims wrapped.  A write into the view goes back as ``base.copy_(
    torch.diagonal_scatter(base, value, offset, dim1, dim2))``, composed of table ops
    (:func:`_diagonal_scatter`), which autograd records as torch's write through the view
    (seed sweeps 1028653, 1028983, ...: ``t.diagonal(0, 2, 3).mul_(w)`` was refused)."""


def _diagonal_scatter(base, value, offset, dim1, dim2):
    """``torch.diagonal_scatter(base, value, offset, dim1, dim2)`` from table ops: ``value``
    (the kept dims, then the diagonal's L) padded to dim1's length n1 (entry k of the
    diagonal sits at row k + max(-offset, 0)), placed on dim1 with a size-1 dim2, and
    picked by ``where`` on the diagonal's positions (column = row + offset); every other
    element is ``base``'s, bit for bit, and value's gradient is the output's on the
    diagonal."""
    nd, n1, n2 = base.ndim, base.shape[dim1], base.shape[dim2]
    lo = max(-offset, 0)
    length = value.shape[-1]
    vp = torch.nn.functional.pad(value, (lo, n1 - length - lo) if length else (0, n1))
    vp = vp.unsqueeze(-1)                         # kept..., n1, 1
    kept = iter(range(nd - 2))
    perm = tuple(nd - 2 if p == dim1 else nd - 1 if p == dim2 else next(kept)
                 for p in range(nd))
    embedded = vp.permute(perm)                   # n1 at dim1, 1 at dim2
    on = torch.arange(n1).unsqueeze(1) + offset == torch.arange(n2).unsqueeze(0)
    shape = [1] * nd
    shape[dim1], shape[dim2] = n1, n2
    on = on.reshape(shape) if dim1 < dim2 else on.t().reshape(shape)
    return torch.where(on, embedded, base)


def write_back(base, index, value) -> None:
    """``base[index] = value``; for a reshape's view (``WHOLE``) ``base.copy_(value
    reshaped to base's shape)``, for a permutation's (:class:`Perm`) ``base.copy_(value
    permuted back)``."""
    from .inplace import method, setitem
    if index == WHOLE:
        method(base, "copy_", (value.reshape(tuple(base.shape)),))
    elif isinstance(index, Perm):
        method(base, "copy_", (value.permute(index.inverse),))
    elif isinstance(index, Diag):
        method(base, "copy_", (_diagonal_scatter(base, value, *index),))
    else:
        setitem(base, index, value)


def _ptr(t):
    """``t``'s storage's data pointer, or None where torch has no valid storage to read
    (a view made inside a backward: old random sweep seed 1071256 raised 'Attempted to
    access the data pointer on an invalid python storage' in cumprod's gradient): not an
    alias then, as if a copy."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _pieces(name, attrs, n):
    """The pieces of split / chunk / unbind as indices of the base (``base[index]`` is
    the piece), so that a write into a piece that is a copy reaches the base."""
    if name in ("split", "chunk"):
        d, start, out = attrs["dim"], 0, []
        for size in attrs["sizes"]:
            out.append((slice(None),) * d + (slice(start, start + size),))
            start += size
        return tuple(out)
    if name == "unbind":
        return tuple((slice(None),) * attrs["dim"] + (k,) for k in range(n))
    return None


def _root(x):
    while x._view is not None:
        x = x._view[0]
    return x


def through_view(x, y, op) -> bool:
    """Before ``y`` is written into the view ``x``: torch's rule for a view of a leaf, and
    the write into the base where ``x`` does not share its memory (or autograd records
    the op). Returns True if ``x`` must get memory of its own (no longer an alias)."""
    from .inplace import _writable
    base, index, aliased = x._view
    root = _root(x)
    if torch.is_grad_enabled() and root.requires_grad and root.is_leaf:
        raise RuntimeError("a view of a leaf Variable that requires grad is being used in an "
                           f"in-place operation ({op}); wrap it in torch.no_grad()")
    tracked = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)
    if aliased and not tracked:
        if index is not None and not _writable(x._local):
            # the base holds one copy for several ranks (a stride-0 layout, e.g. Partial
            # max): the write goes into the base, which takes memory of its own
            write_back(base, index, y)
            return True
        if not _writable(x._local):
            raise RuntimeError(f"{op}: unsupported operation: more than one element of the "
                               "written-to tensor refers to a single memory location. Please "
                               "clone() the tensor before performing the operation.")
        return False
    if index is None:
        why = "autograd records the write" if aliased else "its layout moved data"
        raise NotImplementedError(
            f"{op}() on a view of a DistTensor {base.notation()} that the view op could not "
            f"keep in its memory ({why}): the write would not reach the base. Write into the "
            "base instead (base[i] = v, base.copy_(...)), or clone() the view first if the "
            "base must not change")
    write_back(base, index, y)
    return True


def copy_link(x):
    """For a write into ``x``'s own memory (an alias of its base): the nearest view up the
    chain that is a copy of its base (``v = x.view(-1)`` re-cut uneven shards; ``v[3:9]``
    aliases v), which must then be written into its base as ``base[index] = v``; None if
    the memory is the root's. Raises, before anything is written, where that copy has no
    index to write it back through."""
    v = x._view[0]
    while v._view is not None:
        base, index, aliased = v._view
        if not aliased:
            if index is None:
                raise NotImplementedError(
                    f"a write into a view of a view of the DistTensor {base.notation()}: the "
                    "inner view could not keep the base's memory (its layout moved data), so "
                    "the write would not reach the base. Write into the base instead "
                    "(base[i] = v, base.copy_(...)), or clone() the view first")
            return v
        v = base
    return None


def push_link(v) -> None:
    """After a write landed in the copy ``v`` (see :func:`copy_link`): ``base[index] = v``."""
    base, index, _ = v._view
    write_back(base, index, v)
