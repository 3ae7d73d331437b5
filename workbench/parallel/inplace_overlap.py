"""Writes whose inputs share memory with the written tensor, judged as torch judges them.

``x[1:].add_(x[:-1])``, ``x.add_(x.t())``, ``x.copy_(x.view(6, 4).t())``,
``torch.add(x[:-1], 1, out=x[1:])``: on one device the input and the written-to tensor are
views of one memory.  Here the op is computed out of place first (:mod:`.inplace`), so the
inputs are always read before anything is written; torch instead

* refuses an input that overlaps the output in part where both are dense (TensorIterator's
  ``assert_no_partial_overlap``, ``at::get_overlap_status`` in ATen/MemoryOverlap.cpp:
  "unsupported operation: some elements of the input tensor and the written-to tensor
  refer to a single memory location"), and any overlap at all for ``index_add_``,
  ``scatter_``, ``index_copy_``, ``put_``... (``assert_no_overlap``);
* computes the rest in its own loop order (an overlap it cannot tell, "TooHard": neither
  tensor dense, ``x[:, 1:].mul_(x[:, :-1])``), reading elements it has already written.

:func:`check` decides it before anything is written: torch's own op runs on stand-ins of
the memory (a zero tensor with the root DistTensor's global strides, each view made from it
by the same view ops, so each stand-in aliases as torch's view would) and its overlap
error is raised as is.  Where torch computes, an elementwise op is taken when no element
is read at another index than the one it is written at (then the order cannot matter and
the out-of-place result is torch's); otherwise, and for any overlap in an op that is not
elementwise (``x.addmm_(x, w)``, ``torch.matmul(x, x, out=x)``: torch's result depends on
its kernel), it raises naming ``clone()``, as ``x[:, 1:] = x[:, :-1]`` does
(:func:`.inplace._partial_overlap`).

What it sees: views made by the view ops this package tracks (``x._view``: getitem,
reshapes, permutations, diagonals, split / chunk / unbind pieces), and ``x.detach()`` /
``x.data`` (``dist_tensor.ALIAS_OF``: ``y = x.detach(); y[1:].add_(x[:-1])`` is refused as
torch refuses it; before, the detached handle was another memory here), and ``expand`` /
``expand_as`` (``views.EXPANDED``: ``x.add_(x[:1].expand(4, 4))`` reads row 0 after torch
wrote it, refused naming clone()).
"""
from __future__ import annotations

import warnings

import torch

from . import storage
from .dist_tensor import ALIAS_OF, DistTensor
from .views import expanded

_EXPAND = object()      # a step of _chain: an expand (views.EXPANDED) to the step's shape

__all__ = ["check"]

# ops that read a 0-d tensor argument as a number before writing (masked_fill_(mask, v):
# ``value.item()`` in ATen's masked_fill__cpu; index_fill_ likewise)
_NUMBER_READS = ("masked_fill", "index_fill")


def _same_memory(a: DistTensor, b: DistTensor) -> bool:
    """``a`` and ``b`` hold the same elements of the same memory (``a = b.detach()`` or
    ``b.data`` while neither has taken memory of its own since)."""
    ta, tb = storage.tensors(a._local), storage.tensors(b._local)
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and len(ta) == len(tb) \
        and all(u.data_ptr() == v.data_ptr() and u.stride() == v.stride() and
                u.shape == v.shape for u, v in zip(ta, tb))


def _chain(d: DistTensor):
    """``d``'s root (the DistTensor its view chain starts from, through ``detach()`` and
    ``.data``, which share their source's memory) and the views down to ``d``:
    ``[(index, shape), ...]``, root first."""
    steps = []
    while True:
        if d._view is not None and d._view[1] is not None:
            steps.append((d._view[1], tuple(d.shape)))
            d = d._view[0]
            continue
        if d._view is not None and expanded(d) is not None:
            steps.append((_EXPAND, tuple(d.shape)))
            d = d._view[0]
            continue
        refs = ALIAS_OF.get(id(d))
        src = refs[1]() if refs is not None and refs[0]() is d else None
        if src is None and refs is not None and refs[0]() is d and refs[2] is not None:
            root = refs[2][0]()         # the source view is gone: down from its root
            if root is not None and _in_memory_of(d, root):
                steps.extend(refs[2][1][::-1])
                d = root
                continue
        if src is None or not _same_memory(d, src):
            break
        d = src
    return d, steps[::-1]


def _in_memory_of(d: DistTensor, root: DistTensor) -> bool:
    """Every tensor behind ``d`` lies in the memory of a tensor behind ``root`` (a view's
    handle while neither has taken memory of its own since)."""
    mine = {t.untyped_storage().data_ptr() for t in storage.tensors(root._local)}
    return all(t.untyped_storage().data_ptr() in mine for t in storage.tensors(d._local))


def _view(s: torch.Tensor, index, shape) -> torch.Tensor:
    """The torch view op an index of :mod:`.views` stands for, on the stand-in ``s``."""
    from .views import WHOLE, Diag, Perm
    if isinstance(index, Perm):
        return s.permute(tuple(index))
    if isinstance(index, Diag):
        return s.diagonal(*index)
    if index is _EXPAND:
        return s.expand(shape)
    if isinstance(index, str) and index == WHOLE:
        return s.reshape(shape)          # a view where torch's is one, else a copy
    return s[index]


def _walk(v, fn):
    if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
        return type(v)(_walk(u, fn) for u in v)
    return fn(v)


def _tensors(args, kwargs) -> list:
    """The DistTensors among the arguments (in lists and tuples too)."""
    out, todo = [], [*args, *kwargs.values()]
    while todo:
        v = todo.pop()
        if isinstance(v, DistTensor):
            out.append(v)
        elif isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
            todo.extend(v)
    return out


def _elementwise(func, name: str) -> bool:
    """Each output element computed from the inputs' elements at its own index (the op
    table's "elementwise" class; copy_, addcmul_, addcdiv_ have no entry of their own)."""
    from .ops_table.table import BY_FUNC
    hit = BY_FUNC.get(func)
    return (hit is not None and hit[0].op_class == "elementwise") or \
        name.strip("_") in ("copy", "addcmul", "addcdiv")


def _positions(s: torch.Tensor, n: int) -> torch.Tensor:
    """The storage element each element of the stand-in ``s`` sits at."""
    return torch.arange(n).as_strided(tuple(s.shape), s.stride(), s.storage_offset())


def check(x: DistTensor, run, args, kwargs, name: str, func=None) -> None:
    """Raise as torch would for the write ``run(x, args, kwargs)`` (a torch call writing
    into its first argument; ``func``: the op's out-of-place torch callable, for its op
    class) where an input is ``x`` or a view of ``x``'s memory (module docstring); return
    quietly where none is, or where the out-of-place result is torch's."""
    ds = _tensors(args, kwargs)
    if not ds:
        return
    root, _ = _chain(x)
    mine = [d for d in ds if _chain(d)[0] is root]
    if not mine:
        return
    elementwise = _elementwise(func, name)
    if elementwise and all(d is x for d in mine):
        return          # x.add_(x): one tensor, one index per element (torch's "Full")
    from . import strides
    try:
        st = strides.global_stride(root)
    except (RuntimeError, NotImplementedError, ValueError):
        return
    mem = torch.empty_strided(tuple(root.shape), st, dtype=root.dtype).zero_()
    made: dict = {}

    def stand_in(d):
        if not isinstance(d, DistTensor):
            return d
        if id(d) not in made:
            r, steps = _chain(d)
            if r is root:
                s = mem
                for index, shape in steps:
                    s = _view(s, index, shape)
            else:            # another tensor: its shape and dtype are what torch checks
                s = torch.zeros(tuple(d.shape), dtype=d.dtype)
            made[id(d)] = s
        return made[id(d)]

    xs = stand_in(x)
    a_s = _walk(tuple(args), stand_in)
    k_s = {k: _walk(v, stand_in) for k, v in kwargs.items()}
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(xs, a_s, k_s)
    except RuntimeError as e:
        if "single memory location" in str(e):
            raise RuntimeError(f"{name}(): {e}") from None
    except Exception:            # noqa: BLE001 - the stand-ins' own errors: the real run's
        pass
    ptr = mem.untyped_storage().data_ptr()
    if xs.untyped_storage().data_ptr() != ptr or xs.numel() == 0:
        return                   # x is a copy in torch (a reshape that could not view)
    n = mem.untyped_storage().nbytes() // mem.element_size()
    dst = _positions(xs, n)
    for d in mine:
        s = made[id(d)]
        if s.untyped_storage().data_ptr() != ptr or s.numel() == 0:
            continue
        if s.dim() == 0 and name.rstrip("_") in _NUMBER_READS:
            continue             # read as a number first
        src = _positions(s, n)
        if elementwise:
            try:
                src = src.broadcast_to(dst.shape)
            except RuntimeError:
                continue         # torch's shape error comes from the real run
            other = (src != dst).reshape(-1)            # read at another index
            # copy_ leaves an element it writes from itself as it was
            # (x.copy_(x[:1].expand(4, 4)): row 0 keeps its values, the rows read them)
            changed = dst.reshape(-1)[other] if name.strip("_") == "copy" else dst.reshape(-1)
            clash = bool((torch.isin(src.reshape(-1), changed) & other).any())
        else:
            clash = bool(torch.isin(src.reshape(-1), dst.reshape(-1)).any())
        if clash:
            raise NotImplementedError(
                f"{name}(): an input is a view of the written-to DistTensor that overlaps it "
                "without being it, element for element (e.g. x[:, 1:].mul_(x[:, :-1])): torch "
                "writes in its own memory order, reading elements it has already written, "
                "where here every input is read first. Pass a copy (.clone()) of the input "
                "for the values read before the write")
