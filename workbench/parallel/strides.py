"""A DistTensor's strides: ``d.stride()`` and ``d.is_contiguous()`` of the global tensor,
as ``torch.distributed.tensor.DTensor`` gives them (its strides are a property of the spec:
the global tensor's, those one device's tensor would have, not a shard's).

Here the shards are held in the storage's own forms (:mod:`.storage`: one stacked tensor,
each rank's shard a view of it, or one tensor per rank), so a shard's strides tell the
global tensor's dim order (a transpose shows as swapped strides) but not its spacing.
The global strides are the dense strides of the global shape in that order: a contiguous
tensor's for a contiguous layout, a transposed tensor's for a transposed one.  A view op
(``expand``, a step slice ``x[:, ::2]``, ``diagonal``, ``unfold``) gets torch's own
strides from :func:`track` (fsdpw17: ``expand(3, 4, 4)`` read (16, 4, 1) for torch's
(0, 4, 1)), though its shards are new tensors here.  A dim a shard holds one element of
is ambiguous in that order (its stride says nothing): it is put inside the dims of equal stride, which gives the
contiguous and transposed layouts right where some shard holds more; a layout whose
shards all hold at most one element of a dim (of more than one) has lost that dim's place: torch's ops give a
size-1 dim any stride (``exp`` of a transposed (2, 1) shard reads (1, 1), a contiguous
one's), so that case raises rather than guess (:func:`_refuse_ambiguous`), unless the
DistTensor kept its strides beside the shards (``d._gstride``, as DTensor's spec carries
them): set where the shards lose a dim's place (or an input knew its strides already),
from what torch gives the global tensor.  :func:`shard_tensor` takes the source tensor's
order, ``from_local`` the shards' (DTensor's ``compute_global_tensor_info`` derives the
global strides from the local ones), ``reshard`` / ``detach`` keep the input's, and the
dispatcher runs the torch function on meta tensors of the inputs' global strides
(:func:`track`): ``x.transpose(0, 1)`` of a (2, 7) tensor split into shards of one
column keeps the transposed order through ``exp``, ``clone``, ``positive``, so that
``.view(-1)`` raises as torch's does (seed 1040236 returned a result).
"""
from __future__ import annotations

import warnings
from functools import lru_cache

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import storage

__all__ = ["global_stride", "is_contiguous", "canonical_contiguous", "lost_dims",
           "dense_stride", "known", "track", "keep", "lost_layout", "view_needs_track"]


def _shard(d) -> torch.Tensor | None:
    """A non-empty local shard of ``d`` (this process's on torch.distributed)."""
    if storage.holds_own(d.mesh):
        return d.local()
    loc = d._local
    if not storage.is_cells(loc):           # stacked: the first rank's, one view
        return loc[(0,) * d.mesh.ndim] if loc.numel() else None
    return next((t for t in storage.tensors(loc) if t.numel()), None)


def global_stride(d) -> tuple[int, ...]:
    """The global tensor's strides (module docstring)."""
    known_ = getattr(d, "_gstride", None)       # (a DistTensor pickled before it: absent)
    if known_ is not None and len(known_) == len(d.shape):
        return known_
    st = shard_stride(d)
    if st is not None and lost_dims(d):
        _refuse_ambiguous(d)
    return st


def shard_stride(d) -> tuple[int, ...]:
    """The strides the shards tell (a size-1 dim put inside the dims of equal stride),
    whether or not a dim's place is lost."""
    shape = tuple(d.shape)
    t = _shard(d)
    if t is None:
        return dense_stride(shape, range(len(shape)))
    # outermost first; a tie: a size-1 dim inside
    return dense_stride(shape, _order(t.stride(), [t.size(i) == 1 for i in range(len(shape))],
                                      shape))


def dense_stride(shape, order) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` whose dims lie in ``order`` (outermost
    first)."""
    out, acc = [0] * len(shape), 1
    for i in reversed(list(order)):
        out[i] = acc
        acc *= max(shape[i], 1)
    return tuple(out)


def _dense_like(shape, stride) -> tuple[int, ...]:
    """The dense strides in the order of ``stride`` (torch's strides of a view that skips
    elements, or a size-1 dim's arbitrary one, put as global_stride puts them)."""
    return dense_stride(shape, _order(stride, [n == 1 for n in shape], shape))


def _order(stride, one, shape) -> list[int]:
    """The dims outermost first by stride (a tie: a size-1 dim inside, then the logical
    order).  A dim of stride 0 and more than one element (an expanded one: ``expand_as``
    of a shard) tells no order: it keeps its logical place, as torch's TensorIterator
    skips a stride-0 operand in ``reorder_dimensions`` (aten/src/ATen/TensorIterator.cpp):
    ``x.expand(3, 8) * y`` is contiguous there, where ordering by stride alone put the
    expanded dim innermost, a transposed (3, 8) whose ``.view(-1)`` raised (random sweep
    seed 1053778).  Without such a dim this is the plain sort by that key."""
    n = len(stride)
    key = [(-stride[i], one[i], i) for i in range(n)]
    free = [stride[i] == 0 and shape[i] > 1 for i in range(n)]
    perm = list(reversed(range(n)))             # innermost first, as TensorIterator's perm_
    for i in range(1, n):                       # its insertion sort
        d1 = i
        for d0 in range(i - 1, -1, -1):
            a, b = perm[d0], perm[d1]
            if free[a] or free[b]:
                continue                        # ambiguous: compare with the next
            if key[a] < key[b]:                 # a (inside) is the outer one: swap
                perm[d0], perm[d1] = b, a
                d1 = d0
            else:
                break
    return perm[::-1]


def lost_dims(d) -> tuple[int, ...]:
    """The dims of more than one element whose every shard holds at most one, where
    another dim of more than one element exists: their place in the layout is lost."""
    return lost_layout(tuple(d.shape), tuple(d.mesh.shape), tuple(d.placements))


@lru_cache(maxsize=4096)
def lost_layout(shape, mesh_shape, placements) -> tuple[int, ...]:
    big = [i for i, n in enumerate(shape) if n > 1]
    if len(big) < 2 or 0 in shape or not any(p.is_shard() for p in placements):
        return ()
    most = list(shape)                      # the largest shard (torch.chunk: the first)
    for m, p in zip(mesh_shape, placements):
        if p.is_shard():
            most[p.dim] = -(-most[p.dim] // m)
    return tuple(i for i in big if most[i] <= 1)


def known(d) -> bool:
    """True when ``d``'s strides are told (by its shards, or kept beside them)."""
    return getattr(d, "_gstride", None) is not None or not lost_dims(d)


def keep(out, stride, dense: bool = False) -> None:
    """``out`` holds the global strides ``stride`` (made dense in their order unless
    ``dense``), where its shards cannot tell them or tell others; nothing kept where the
    shards tell the same."""
    if len(stride) != len(out.shape):
        return
    if not dense:
        stride = _dense_like(tuple(out.shape), stride)
    if not lost_dims(out) and shard_stride(out) == stride:
        stride = None
    out._gstride = stride


def _dist():
    global _DistTensor
    if _DistTensor is None:         # (dist_tensor imports this module)
        from .dist_tensor import DistTensor as _DistTensor
    return _DistTensor


_DistTensor = None


def _meta(x):
    """``x`` with every tensor a meta tensor of its global shape and strides."""
    if isinstance(x, _DistTensor or _dist()):
        return torch.empty_strided(tuple(x.shape), global_stride(x), dtype=x.dtype,
                                   device="meta")
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    if type(x) in (list, tuple):
        return type(x)(_meta(y) for y in x)
    if isinstance(x, dict):
        return {k: _meta(v) for k, v in x.items()}
    return x


_ATOMS = (int, float, bool, complex, str, type(None), type(Ellipsis), slice, torch.dtype,
          torch.device, torch.layout, torch.memory_format)


def _key(x):
    """A hashable key of what :func:`_meta` keeps of ``x`` (a tensor's shape, strides and
    dtype; anything else by type and value); TypeError where x holds something else."""
    if type(x) in _ATOMS:
        return (type(x), x.start, x.stop, x.step) if type(x) is slice else (type(x), x)
    if isinstance(x, _DistTensor or _dist()):
        return (0, tuple(x.shape), global_stride(x), x.dtype)
    if isinstance(x, torch.Tensor):
        return (1, tuple(x.shape), x.stride(), x.dtype)
    if type(x) in (list, tuple):
        return (type(x),) + tuple(_key(y) for y in x)
    if isinstance(x, dict):
        return (dict,) + tuple((k, _key(v)) for k, v in sorted(x.items()))
    raise TypeError(type(x).__name__)


# view ops whose output, from an input whose shards tell its strides (a dense layout),
# is dense too, in an order the output's shards tell: not tracked (tracking every view
# cost ``valgrind --tool=callgrind --instr-atstart=no benchmarks/sim_instr.py gpt 3``
# 222.00M -> 232.06M instructions; these skipped, 222.12M; fsdpw17, measured here)
DENSE_VIEWS = frozenset({"view", "reshape", "transpose", "permute", "t", "unsqueeze",
                         "squeeze", "flatten", "unflatten", "movedim", "moveaxis",
                         "swapaxes", "swapdims", "view_as", "reshape_as", "detach", "alias"})


def view_needs_track(func) -> bool:
    """Whether a view op's output may hold strides its shards cannot tell (``expand``'s
    0, a slice's step or its base's spacing, ``diagonal``): then :func:`track` gives it
    torch's."""
    return getattr(func, "__name__", "") not in DENSE_VIEWS


_TRACKED: dict = {}     # (func, inputs' key) -> the outputs' strides, or None (unknown)


def _flat(x, cls) -> list:
    if isinstance(x, cls):
        return [x]
    if isinstance(x, (list, tuple)):
        return [y for z in x for y in _flat(z, cls)]
    return []


def track(func, args, kwargs, result) -> None:
    """After the dispatcher ran ``func``: give each DistTensor output the strides torch
    gives the global one (``func`` on meta tensors of the inputs' global strides), where
    its shards cannot tell them (or an input's strides were kept, so that its shards may
    tell others).  Nothing where an input's strides are unknown or the meta run fails:
    ``stride()`` then refuses as before.  Memoized on the inputs' shapes, strides, dtypes
    and constants (a training step asks the same each time)."""
    outs = _flat(result, _DistTensor or _dist())
    try:
        key = (func, _key(tuple(args)), _key(kwargs) if kwargs else ())
        hit = _TRACKED.get(key, False)
    except (TypeError, NotImplementedError):     # unhashable, or an input's strides unknown
        key, hit = None, False
    if hit is False:
        hit = None
        try:
            with _disable_current_modes(), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")         # the program's call warned already
                metas = _flat(func(*_meta(tuple(args)), **_meta(dict(kwargs or {}))),
                              torch.Tensor)
            if all(m.device.type == "meta" for m in metas):
                # torch's strides as they are (a view's stride 0 or step too: fsdpw17)
                hit = tuple((tuple(m.shape), tuple(m.stride())) for m in metas)
        except Exception:           # noqa: BLE001 (an unknown input, or an op meta lacks)
            pass
        if key is not None:
            if len(_TRACKED) > 4096:
                _TRACKED.clear()
            _TRACKED[key] = hit
    if hit is None or len(hit) != len(outs):
        return
    for o, (shape, stride) in zip(outs, hit):
        if shape == tuple(o.shape):
            keep(o, stride, dense=True)


def _refuse_ambiguous(d) -> None:
    """Raise where the shards cannot tell the order: every shard holds at most one element
    of a dim of more than one (its stride in a shard is arbitrary: torch's own ops give a
    size-1 dim any stride) while another dim of more than one element exists, so that the
    dim could sit anywhere among them (a transpose then reads as contiguous)."""
    shape = tuple(d.shape)
    i = lost_dims(d)[0]
    raise NotImplementedError(
        f"stride()/is_contiguous() of a DistTensor of shape {shape} with "
        f"placements {tuple(d.placements)}: every shard holds at most one element of dim "
        f"{i} (size {shape[i]}), so the shards cannot tell that dim's place in the "
        f"layout; ask the global tensor instead (d.full_tensor().stride()), or "
        f"redistribute so that dim {i} is split into pieces of more than one element")


def is_contiguous(d, memory_format=torch.contiguous_format) -> bool:
    """torch's ``is_contiguous`` of a tensor of the global shape and strides."""
    meta = torch.empty_strided(tuple(d.shape), global_stride(d), device="meta")
    return meta.is_contiguous(memory_format=memory_format)


def canonical_contiguous(t, memory_format=torch.contiguous_format) -> torch.Tensor:
    """``t.contiguous()`` whose size-1 dims carry a contiguous tensor's strides too: torch
    counts a (6, 1) view of strides (1, 6) (a transposed shard) contiguous and returns it
    as it is, and the shard's strides would then still read as a transpose."""
    out = t.contiguous(memory_format=memory_format)
    if memory_format is not torch.contiguous_format:
        return out
    want = torch.empty(out.shape, device="meta").stride()
    if out.stride() == want:
        return out
    return out.as_strided(out.shape, want, out.storage_offset())
