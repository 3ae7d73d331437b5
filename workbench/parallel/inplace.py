"""In-place ops on DistTensors: ``x.add_(y)``, ``x += y``, ``x[i] = v``, ``x.copy_(src)``,
``x.zero_()``, ``nn.init.normal_(x)``, ``F.relu(x, inplace=True)``, ``torch.add(a, b, out=x)``.

One recipe, as PyTorch defines an in-place op (the out-of-place result, written into
``x``):

1. PyTorch judges the call first on meta tensors of the global shapes: its own errors
   (a result that broadcasts to a bigger shape, a float result cast into an int tensor,
   an in-place op on a leaf that requires grad while grad mode is on) come before
   anything is changed;
2. the out-of-place op runs through the SPMD rules (``x.relu_()`` is ``x.relu()``), and
   its result is laid out as ``x`` is (a reshard, traced: a Partial ``x`` after a
   non-linear op is reduced and laid out Partial again);
3. the result is written into ``x`` (and, for a view of another DistTensor, into that
   base, as torch writes through a view): the same Python object keeps its mesh, shape,
   dtype and placements (as DTensor keeps self's placements). The values go into
   ``x``'s own local tensors, so views of ``x`` (``x[0]``, ``x.data``, ``x.view(..)``),
   optimizers and hooks that hold them see the new values. Where autograd records the
   op (grad mode on and a tensor that requires grad), ``x`` takes the result's history
   instead (torch rebases ``x``'s history the same way); local tensors that cannot be
   written elementwise (one memory location for several elements) are replaced.  Either
   way the old local tensors' version counters are bumped (:mod:`.versions`): a value an
   op saved for backward then raises torch's "modified by an inplace operation" there.

Random fills (``normal_``, ``uniform_``, ``bernoulli_``..., and ``torch.nn.init``): the
full tensor is what one device would draw for the global shape with the same generator
state, whatever the layout (as :mod:`workbench.sim_mesh.rng` does for dropout masks);
each rank keeps its part. On torch.distributed every process draws the global tensor
from its own generator: seed them alike (``torch.manual_seed``), as torchrun scripts do.
"""
from __future__ import annotations

import warnings

import torch

from . import inplace_overlap as overlap
from . import storage, versions
from .dist_tensor import DistTensor, retains, shard_tensor
from .ops_table.checks import _to_meta
from .seq_order import check_write, orders_of, same_order
from .views import copy_link, push_link, refresh, through_view

__all__ = ["method", "assign", "setitem", "init", "out_call", "inplace_kwarg", "IDUNDERS",
           "RANDOM", "index_put_", "index_put"]

T = torch.Tensor

RANDOM = ("normal_", "uniform_", "bernoulli_", "exponential_", "geometric_", "log_normal_",
          "cauchy_", "random_")
# reductions whose ``out=`` sets the dtype they compute in, as their ``dtype=`` does (aten's
# ``sum_out`` / ``prod_out`` / ``mean_out`` / ``cumsum_out``... infer it from the result:
# torch.sum(x, 1, out=z) equals torch.sum(x, 1, dtype=z.dtype), the input cast first, for
# every dtype of z; checked against torch 2.13 in tests/test_inplace_out_dtype.py)
_DTYPE_FROM_OUT = (torch.sum, torch.prod, torch.nansum, torch.mean, torch.nanmean,
                   torch.cumsum, torch.cumprod)
_VIEWS = ("squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_")
_UNSUPPORTED = ("resize_", "resize_as_", "set_", "as_strided_", "share_memory_", "map_",
                "apply_", "map2_", "record_stream")
# x += y is x.add_(y), as torch.Tensor's in-place operators
IDUNDERS = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_",
            "__ifloordiv__": "floor_divide_", "__imod__": "remainder_", "__ipow__": "pow_",
            "__iand__": "bitwise_and_", "__ior__": "bitwise_or_", "__ixor__": "bitwise_xor_",
            "__ilshift__": "bitwise_left_shift_", "__irshift__": "bitwise_right_shift_"}


# ---- PyTorch's verdict first ----------------------------------------------------------

_meta = _to_meta     # a tensor or DistTensor (or lists of them) on the meta device

def _meta_self(x: DistTensor) -> torch.Tensor:
    """``x`` on the meta device with its autograd standing (a leaf that requires grad,
    or a non-leaf), so that torch raises what it raises for ``x``."""
    m = torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    if x.requires_grad:
        m.requires_grad_()
        if not x.is_leaf:
            with torch.enable_grad():
                m = m.clone()
    return m


def _judge(call) -> None:
    """Run ``call`` on meta tensors: torch's own errors propagate; an op meta tensors
    cannot run (data-dependent) is judged by the real run instead."""
    try:
        call()
    except NotImplementedError:
        pass
    except RuntimeError as e:
        # a 0-d tensor argument read as a number (addcdiv_'s value=: torch.optim's tensor
        # lr) has no value on meta tensors: the real run judges
        if "cannot be called on meta tensors" not in str(e):
            raise


# ---- writing a result into x ----------------------------------------------------------

def _check_detached(x: DistTensor, op: str) -> None:
    """``x = t.detach()`` shares ``t``'s memory; torch writes a tracked value
    (``x.mul_(w)`` with ``w`` requiring grad) into that memory, so ``t`` sees it.  Here
    the tracked write gives ``x`` memory of its own (the result's history), which ``t``
    would not see: refused while ``t``'s memory is still ``x``'s (before anything is
    written)."""
    from .dist_tensor import DETACHED
    for t in storage.tensors(x._local):
        refs = DETACHED.get(id(t))
        src = refs[1]() if refs is not None and refs[0]() is t else None
        if src is not None and src.untyped_storage().data_ptr() == \
                t.untyped_storage().data_ptr():
            raise NotImplementedError(
                f"{op}() of a value that requires grad into a detach()ed DistTensor: torch "
                "writes it into the memory the detached tensor shares with its source, which "
                "would not see it here. Write into the source instead (under torch.no_grad() "
                "for an untracked write), or clone() the detached tensor first")


def _storages(*xs) -> set:
    out = set()
    for x in xs:
        if isinstance(x, DistTensor):
            out |= {t.untyped_storage().data_ptr() for t in storage.tensors(x._local)}
        elif isinstance(x, torch.Tensor):
            out.add(x.untyped_storage().data_ptr())
    return out


# torch's own overlap test (private; 2 = "unknown" where a torch lacks it: then the
# elements' memory is counted exactly below)
_overlap = getattr(torch, "_debug_has_internal_overlap", lambda t: 2)


def _writable(loc) -> bool:
    """True if every element of ``loc`` has its own memory (no stride-0 copies, no two
    cells over the same elements): a write cannot land twice."""
    ts = [t for t in storage.tensors(loc) if t.numel()]
    status = [_overlap(t) for t in ts]    # 0 no, 1 yes, 2 unknown
    if 1 in status:
        return False
    groups: dict = {}
    for t, st in zip(ts, status):
        groups.setdefault(t.untyped_storage().data_ptr(), []).append((t, st))
    for grp in groups.values():
        if len(grp) > 1 or grp[0][1] != 0:          # count the elements' memory exactly
            t0 = grp[0][0]
            pos = torch.arange(t0.untyped_storage().nbytes() // t0.element_size())
            offs = torch.cat([pos.as_strided(t.shape, t.stride(), t.storage_offset()).reshape(-1)
                              for t, _ in grp])
            if offs.unique().numel() != offs.numel():
                return False
    return True


def _like(y_loc, x_loc, nd: int):
    """``y``'s local tensors arranged as ``x``'s (same layout; a replicated axis may be
    held once by one and per rank by the other)."""
    if storage.is_cells(x_loc):
        yc = storage.to_cells(y_loc, nd)
        return [yc[tuple(ci if n > 1 else 0 for ci, n in zip(c, yc.lead))]
                for c in x_loc.coords()]
    y = storage.to_stacked(y_loc)
    for i in range(nd):
        if x_loc.shape[i] == 1 and y.shape[i] > 1:
            y = y.narrow(i, 0, 1)          # a replicated axis: one copy stands for all
    return [y]


class _Overwrite(torch.autograd.Function):
    """``value`` written over ``old`` (a tensor with history): the result is ``value``
    and requires grad as torch's in-place result does; ``old`` gets a zero gradient, and
    ``value`` (when it requires grad: x.copy_(y)) the result's."""

    @staticmethod
    def forward(ctx, value, *olds):       # every tensor of x's storage (uneven: per cell)
        ctx.olds = [(o.shape, o.dtype, o.device) for o in olds]
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.needs_input_grad[0] else None,
                *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.olds))


def over_old(y: DistTensor, x: DistTensor) -> DistTensor:
    """``y`` written over ``x`` for autograd: ``y``'s values and history, with every local
    tensor of ``x`` given a zero gradient through ``_Overwrite`` (one anchor on ``y``'s
    first tensor carries them all; a tensor of ``y`` without history after it is anchored
    too: uneven shards keep a tensor per rank, and a constant one (``x.zero_()``: zeros)
    did not require grad, so backward raised 'element 1 of tensors does not require grad'
    (wide seed 2015290: ``t.clone().zero_()`` of 3 elements over 4 ranks); each further
    anchor gives ``x``'s old values zeros again, which add to zero)."""
    olds, done = storage.tensors(x._local), []

    def anchor(t):
        if done:
            return t if t.requires_grad else _Overwrite.apply(t, *olds)
        done.append(t)
        return _Overwrite.apply(t, *olds)
    return DistTensor(storage.map_tensors(y._local, anchor), y.mesh, y.placements, y.shape,
                      y.dtype, y.names)


def assign(x: DistTensor, y, op: str, *, sources=()) -> DistTensor:
    """Write ``y`` (a DistTensor on x's mesh, or a plain global tensor) into ``x``: values
    cast to ``x.dtype``, laid out in ``x.placements``. ``sources``: the op's inputs
    (``x``'s new data must not alias them). Returns ``x``; its views see the new values
    (:func:`.views.refresh`)."""
    _check_alias_of_copy(x, op)
    before = x._local
    _assign(x, y, op, sources=sources)
    refresh(x, x._local is not before)
    if x._local is before:
        _refresh_bases(x)
        _refresh_sources(x)
    return x


def _refresh_bases(x: DistTensor) -> None:
    """After a write into ``x``'s own memory where ``x`` is a view sharing its base's: the
    base's (and its bases') other views that are copies see the write, as torch's views of
    one memory do (``vc = t[:, 1:]`` over uneven column shards is a copy; ``t[1:].add_(1)``
    wrote t's memory and left vc as it was, silently)."""
    d = x
    while d._view is not None and d._view[2]:
        d = d._view[0]
        refresh(d, False)


def _alias_sources(x: DistTensor):
    """The DistTensors whose memory ``x``'s root is under another handle (``t.detach()``,
    ``t.data``, and so on up), nearest first."""
    from .dist_tensor import ALIAS_OF
    d = x
    while d._view is not None:
        d = d._view[0]
    while True:
        refs = ALIAS_OF.get(id(d))
        src = refs[1]() if refs is not None and refs[0]() is d else None
        if src is None and refs is not None and refs[0]() is d and refs[2] is not None:
            root = refs[2][0]()     # a handle of a view that is gone: its root's memory
            if root is not None and overlap._in_memory_of(d, root):
                yield root
                d = root
                continue
        if src is None or not overlap._same_memory(d, src):
            return
        yield src
        d = src


def _check_alias_of_copy(x: DistTensor, op: str) -> None:
    """``v = t[1:]`` over uneven shards is a copy of ``t`` (the view op moved data; a write
    into ``v`` goes back through ``t[1:] = ...``); ``v.detach()`` shares the copy's memory,
    so a write into it would not reach ``t`` (torch's would): refused before anything is
    written."""
    for src in _alias_sources(x):
        if src._view is not None and not src._view[2]:
            raise NotImplementedError(
                f"{op}() into a detach() / .data of a view of the DistTensor "
                f"{src._view[0].notation()} that the view op could not keep in its memory "
                "(its layout moved data): the write would not reach the base, as torch's "
                "does. Write into the view itself under torch.no_grad() (v.add_(1)), or "
                "into the base")


def _refresh_sources(x: DistTensor) -> None:
    """After a write into ``x``'s own memory: where x's root is ``t.detach()`` / ``t.data``
    (the same memory), ``t``'s views that are copies see the write too, as torch's views of
    ``t`` do (``v = t[1:]; t.detach().add_(1)`` changes v)."""
    for src in _alias_sources(x):
        refresh(src, False)
        _refresh_bases(src)       # src a view (x = t[1:].detach()): t's copies too


def _assign(x: DistTensor, y, op: str, *, sources=()) -> DistTensor:
    from .dispatch import dispatch
    from .reshard import reshard
    for t in storage.tensors(x._local):
        stale = getattr(t, "_wb_stale", None)     # a wrapper's template (fsdp_dist_habits)
        if stale:
            raise RuntimeError(f"{op}: {stale}")
    if not isinstance(y, DistTensor):
        y = torch.as_tensor(y, device=x.device)
        y = shard_tensor(y.expand(x.shape).to(x.dtype), x.mesh, x.placements,
                         src_data_rank=None)
    if y.mesh != x.mesh:
        raise ValueError(f"{op}: the value lives on {y.mesh}, the DistTensor on {x.mesh}; "
                         "reshard the value onto the DistTensor's mesh first")
    if y.shape != x.shape:
        y = dispatch(T.expand, (y, tuple(x.shape)), None)
    if y.dtype != x.dtype:
        y = dispatch(T.to, (y, x.dtype), None)
    if y.placements != x.placements:
        y = reshard(y, x.mesh, x.placements)
    nd = x.mesh.ndim
    link = None
    olds = storage.tensors(x._local)     # (before a write through a view replaces them)
    if x._view is not None:
        if through_view(x, y, op):
            x._view = x._view[:2] + (False,)    # written through base[index] from now on
        elif x._view[2]:
            link = copy_link(x)     # x aliases a view that is a copy: written back after
    mine = _storages(x)
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
        if not x.requires_grad:
            _check_detached(x, op)
        # autograd records the op: x takes the result's history (its own memory)
        if y is x or _storages(y) & (mine | _storages(*sources)):
            y = dispatch(T.clone, (y,), None)
            if y.placements != x.placements:
                # clone may lay a zero-size tensor out anew (every layout costs nothing:
                # S(0), S(1), R came back R, R, R and x's placements no longer described
                # its local tensors, random sweep seed 1028653)
                y = reshard(y, x.mesh, x.placements)
        if x.requires_grad:
            # a value written over a value with history (y.zero_(), y.fill_(v),
            # y.copy_(plain), y.copy_(z) with z tracked): x still requires grad, its old
            # values get a zero gradient, as torch's CopyBackwards gives (seed 941030: with
            # a tracked z, x's history was dropped and its leaf's grad was None, not zeros)
            y = over_old(y, x)
        x._local = y._local
        if retains(x):                  # y.retain_grad(); y.add_(1): the new value's grad
            x.retain_grad()
        # the old values stay in their memory: torch's version counter says they were
        # written (a value saved for backward then raises there, as torch: versions.py)
        versions.bump(olds, f"{op}() on {x.notation()}")
        if x._view is not None:
            x._view = x._view[:2] + (False,)
        return x
    ys = _like(y._local, x._local, nd)
    if _storages(y) & mine:             # e.g. x.copy_(x.flip(0)) with a view: read first
        ys = [t.clone() for t in ys]
    xs = storage.tensors(x._local)
    if _writable(x._local) and len(xs) == len(ys) and \
            all(torch.broadcast_shapes(a.shape, b.shape) == a.shape for a, b in zip(xs, ys)):
        with torch.no_grad():
            for a, b in zip(xs, ys):
                a.copy_(b)
        # (copy_ bumped them; the copies an op read of them, and the write's name: versions)
        versions.bump(xs, f"{op}() on {x.notation()}")
        if link is not None:
            push_link(link)
        return x
    keep = x.requires_grad           # a leaf under no_grad (nn.init): stays a leaf
    new = storage.map_tensors(y._local, lambda t: t.detach().clone())
    x._local = storage.map_tensors(new, lambda t: t.requires_grad_()) if keep else new
    versions.bump(olds, f"{op}() on {x.notation()}")    # (written in place: copy_ bumps)
    if link is not None:
        push_link(link)
    return x


# ---- x.op_(...) -----------------------------------------------------------------------


def _unsupported(op: str, why: str):
    raise NotImplementedError(f"{op}() on a DistTensor: {why}")


def _full_args(v):
    if isinstance(v, DistTensor):
        return v.full()
    if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
        return type(v)(_full_args(u) for u in v)
    return v


def _random(x, op, args, kwargs):
    """One device's draw for the global shape; each rank keeps its part."""
    _judge(lambda: getattr(_meta_self(x), op)(*_meta(args), **{k: _meta(v) for k, v in
                                                                   kwargs.items()
                                                                   if k != "generator"}))
    g = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    getattr(g, op)(*_full_args(args), **{k: _full_args(v) for k, v in kwargs.items()})
    return g


def _view_inplace(x, op, args, kwargs):
    """squeeze_, t_, transpose_...: ``x`` becomes the view (same data, new shape and
    placements, as DTensor re-labels self)."""
    from .dispatch import dispatch
    _judge(lambda: getattr(_meta_self(x), op)(*args, **kwargs))
    if x.requires_grad and not torch.is_grad_enabled() and not _moves(x, op, args, kwargs):
        # (squeeze_() without a size-1 dim: nothing moves; x keeps its history or stays a
        # leaf, its counter bumped as torch's)
        if x.is_leaf:
            versions.bump(storage.tensors(x._local), f"{op}() on {x.notation()}")
            return x
        with torch.enable_grad():
            return _view_inplace(x, op, args, kwargs)
    if x.requires_grad and not torch.is_grad_enabled():
        # torch keeps x's history as it was: a non-leaf's grad_fn of the old shape then
        # gets the new shape's gradient, summed to the old shape where it broadcasts (so
        # unsqueeze_'s is the recorded unsqueeze's gradient: recorded so here), else as it
        # is (a square t_(): unpermuted) or torch raises at backward; a leaf stays a leaf of
        # the new shape.  Here x lost requires_grad, silently (its optimizer skipped it)
        if op == "unsqueeze_" and not x.is_leaf:
            with torch.enable_grad():
                return _view_inplace(x, op, args, kwargs)
        raise NotImplementedError(
            f"{op}() under torch.no_grad() on a DistTensor {x.notation()} that requires "
            "grad: torch keeps its autograd history of the old shape, which a DistTensor "
            f"does not; call {op}() outside no_grad, or use the out-of-place view "
            f"(x = x.{op[:-1]}(...)), or detach() first")
    olds = storage.tensors(x._local)
    y = dispatch(getattr(T, op[:-1]), (x,) + tuple(args), kwargs)
    loc = y._local
    if storage.requires_grad(loc):
        # x's new local tensors (views of the old ones) under a version counter of their
        # own: the bump below then reaches what ops saved of x's old values, not x (a
        # view of x's memory made in the dispatcher's custom Functions is unusable once
        # its counter moves: "Output 0 of ... is a view and its base ... modified inplace")
        loc = storage.map_tensors(loc, lambda t: versions.unversioned_local(t))
    x._local, x.placements, x.shape, x._spec, x.names = loc, y.placements, y.shape, None, None
    if retains(x):
        x.retain_grad()
    # torch's in-place view ops bump the version counter: a value an op saved of x (exp's
    # output, mul's input) then raises at backward, as torch's (versions.py)
    versions.bump(olds, f"{op}() on {x.notation()}")
    x._gstride = y._gstride
    if x._view is not None:            # a view of a view: base[index] no longer matches x
        x._view = (x._view[0], None, x._view[2])
    return x


def _moves(x: DistTensor, op: str, args, kwargs) -> bool:
    """Does the in-place view op change ``x``'s shape or the order of its elements (not
    ``squeeze_()`` without a size-1 dim, ``transpose_(0, 0)``, ``t_()`` of a vector)?"""
    m = torch.empty(tuple(x.shape), device="meta")
    v = getattr(m, op)(*args, **kwargs)
    return v.shape != torch.Size(tuple(x.shape)) or v.stride() != \
        torch.empty(tuple(x.shape), device="meta").stride()


def method(x: DistTensor, op: str, args=(), kwargs=None) -> DistTensor:
    """``x.op(*args, **kwargs)`` for an in-place method name ``op`` (ending in ``_``)."""
    if torch.is_autocast_enabled("cpu"):     # in-place ops are not autocast (torch.amp
        with torch.autocast("cpu", enabled=False):     # docs; dispatch._writes)
            return method(x, op, args, kwargs)
    from .dispatch import dispatch
    from .rules import NoRuleError
    kwargs = dict(kwargs or {})
    if op in _UNSUPPORTED:
        _unsupported(op, "it changes the storage itself, which a layout over ranks does not "
                         "have; build a new DistTensor (shard_tensor / reshard) instead")
    if op == "detach_":
        return _detach_(x)
    from .views import check_multi_output_write
    check_multi_output_write(x, op)
    if op in _VIEWS:
        return _view_inplace(x, op, args, kwargs)
    _int_recorded(x, op, args, kwargs)
    _judge(lambda: getattr(_meta_self(x), op)(*_meta(tuple(args)),
                                               **{k: _meta(v) for k, v in kwargs.items()}))
    if op not in RANDOM and op != "fill_":      # (fill_ reads its value as a number first)
        overlap.check(x, lambda xs, a, k: getattr(xs, op)(*a, **k), args, kwargs, op,
                      getattr(T, op[:-1], None))
    if op in RANDOM:
        return assign(x, _random(x, op, args, kwargs), op)
    if op in ("zero_", "fill_") and x._view is not None and not _writable(x._local):
        from .views import expanded
        shape = expanded(x)
        if shape is not None:
            # x[:1].expand(4, 4).zero_(): torch's fill_ does not refuse a written-to tensor
            # whose elements share memory (ATen's fill_ sets check_mem_overlap false): the
            # value goes into the memory, all of the base, which an expand covers
            base = x._view[0]
            method(base, op, args, kwargs)
            x._local = dispatch(T.expand, (base, shape), None)._local
            return x
    if op in ("masked_fill_", "index_fill_") and x._view is not None and \
            not _writable(x._local):
        from .views import expanded
        shape = expanded(x)
        if shape is not None:
            return _fill_expanded(x, op, shape, args, kwargs)
    if op == "zero_":
        return assign(x, torch.zeros((), dtype=x.dtype, device=x.device), op)
    if op == "fill_":
        (value,) = args or (kwargs["value"],)
        value = value.full() if isinstance(value, DistTensor) else value
        if not isinstance(value, torch.Tensor):   # a number: in x's dtype, as torch fills
            # (as_tensor(1.8) is float32: 1.7999999523 written into a float64 x, seed 992249)
            value = torch.full((), value, dtype=x.dtype, device=x.device)
        return assign(x, torch.as_tensor(value, device=x.device), op)
    if op == "index_put_":
        return index_put_(x, *args, **kwargs)
    if op == "copy_":
        src = args[0] if args else kwargs["src"]
        if not isinstance(src, DistTensor):
            src = torch.as_tensor(src, device=x.device)
        return assign(x, src, op, sources=(src,))
    base = getattr(T, op[:-1], None)
    if base is None or not callable(base):
        _unsupported(op, f"PyTorch has no out-of-place {op[:-1]}() to compute it from; "
                         "write the result with x.copy_(...)")
    try:
        y = dispatch(base, (_self(x, args, kwargs),) + tuple(args), kwargs)
    except NoRuleError as e:
        raise NoRuleError(f"{op}() on a DistTensor {x.notation()}: {e}") from None
    if not isinstance(y, DistTensor):
        _unsupported(op, f"{op[:-1]}() gives a {type(y).__name__}, not a tensor")
    if not torch.can_cast(y.dtype, x.dtype):
        # torch's own check (meta tensors skip it for a Python scalar: int.mul_(2.5))
        raise RuntimeError(f"{op}(): result type {y.dtype} can't be cast to the desired "
                           f"output type {x.dtype}; use x = x.{op[:-1]}(...) for a new tensor")
    return assign(x, y, op, sources=(x,) + tuple(args) + tuple(kwargs.values()))


_VIEW_DETACH = (
    "Can't detach views in-place. Use detach() instead. If you are using "
    "DistributedDataParallel (DDP) for training, and gradient_as_bucket_view is set as True, "
    "gradients are views of DDP buckets, and hence detach_() cannot be called on these "
    "gradients. To fix this error, please refer to the Optimizer.zero_grad() function in "
    "torch/optim/optimizer.py as the solution.")


def _detach_(x: DistTensor) -> DistTensor:
    """``x.detach_()`` as torch's (torch/csrc/autograd/VariableTypeManual.cpp, ``detach_``):
    a view of another DistTensor raises torch's RuntimeError, nothing changed; otherwise
    ``x`` loses its history in place.  A local tensor with history is detached in place,
    as torch detaches the tensor itself: an op that saved it as an input then raises
    torch's "Trying to use a saved tensor that has been detached in-place" at backward
    (before, ``x._local`` took new detached tensors and backward ran silently), while one
    that saved it as its output (``exp``) does not, as on one device."""
    if x._view is not None:
        raise RuntimeError(_VIEW_DETACH)

    from . import versions

    def det(t):
        if t.grad_fn is not None:
            # the checks of ops that saved a copy or a view of t where one device saves t
            # (versions.detach_check / guard_detach) raise as torch's (inplace18); t a
            # view is replaced by a new tensor below, and they raise for it too
            versions.detached(t)
            if not t._is_view():
                return t.detach_()
        return t.detach()
    x._local = storage.map_tensors(x._local, det)
    return x


def _fill_expanded(x: DistTensor, op: str, shape, args, kwargs) -> DistTensor:
    """``x[:1].expand(4, 4).masked_fill_(m, v)`` / ``.index_fill_(d, i, v)``: torch fills
    a written-to tensor whose elements share memory (ATen warns "Use of masked_fill_ on
    expanded tensors is deprecated" and writes): the value lands in the base element
    under any selected position, the same value each time.  The selection is made in the
    expanded shape, folded back onto the base (any over the expanded dims), and written
    as ``base.masked_fill_``; before, "more than one element ... refers to a single memory
    location" was raised where torch computes."""
    import warnings
    from .dispatch import dispatch
    base = x._view[0]
    if op == "masked_fill_":
        mask, value = (list(args) + [kwargs.get("mask"), kwargs.get("value")])[:2] \
            if len(args) < 2 else args[:2]
        mask = mask.full() if isinstance(mask, DistTensor) else torch.as_tensor(mask)
        sel = mask.broadcast_to(tuple(shape))
    else:
        names = ("dim", "index", "value")
        dim, index, value = (list(args) + [kwargs.get(n) for n in names[len(args):]])[:3]
        index = index.full() if isinstance(index, DistTensor) else torch.as_tensor(index)
        sel = torch.zeros(tuple(shape), dtype=torch.bool).index_fill_(dim, index, True)
    warnings.warn(f"Use of {op} on expanded tensors is deprecated. Please clone() the "
                  "tensor before performing this operation.", UserWarning, stacklevel=3)
    lead = len(shape) - base.ndim
    if lead:
        sel = sel.any(dim=tuple(range(lead)))
    for d, (n, b) in enumerate(zip(sel.shape, tuple(base.shape))):
        if n != b:                                   # b is 1: expanded along d
            sel = sel.any(dim=d, keepdim=True)
    method(base, "masked_fill_", (sel, value))
    x._local = dispatch(T.expand, (base, tuple(shape)), None)._local
    return x


# ---- x[index] = value -----------------------------------------------------------------

def setitem(x: DistTensor, index, value) -> None:
    """``x[index] = value``: torch's indexing on the global shape (basic or advanced
    indices), written by ``where(mask, values, x)`` laid out as ``x``: no communication
    for Replicate and Shard, nor for Partial(sum) (the values sit on the group's first
    rank, zeros elsewhere: ``where`` is linear in (values, x) for a replicated mask)."""
    from .dispatch import dispatch
    from .placement import Replicate
    from .views import check_multi_output_write
    check_multi_output_write(x, "__setitem__")
    # the index as the user wrote it: torch reads ``x[True] = v`` (a copy, the value
    # cast) unlike ``x[(True,)] = v`` (index_put_: dtypes must match), and a top-level
    # list of lists as a tuple (``x[[[0, 1], [1, 2]]]``), not as one 2-d index
    idx = _full_args(index)
    val = value.full() if isinstance(value, DistTensor) else value

    # torch's checks, in torch's order (a number's conversion to x's dtype, the value's
    # dtype, the index, the value's shape): the same setitem on zeros of x's shape and dtype
    vals = torch.zeros(tuple(x.shape), dtype=x.dtype, device=x.device)
    vals[idx] = val
    if isinstance(val, torch.Tensor) and val.requires_grad and \
            not (x.dtype.is_floating_point or x.dtype.is_complex):
        if vals.requires_grad:
            _tracked_into_int(x, val, "x[index] = value", "x[index] = value.detach()")
        vals = vals.detach()
        val = val.detach()      # an integer x holds no gradient: torch writes the values
        # (seed 941145: int_x[i] = tracked float raised "Autograd not support dtype: Long")
    _partial_overlap(x, idx, value)
    mask = torch.zeros(tuple(x.shape), dtype=torch.bool, device=x.device)
    mask[_bool_masks(idx)] = True       # (a uint8 mask is a bool one, as torch reads it:
    # a number into it takes masked_fill_, which takes bool masks only)

    def judge():        # ... and autograd's checks (a leaf that requires grad)
        m = _meta_self(x)
        m[_meta(idx)] = _meta(val) if isinstance(val, torch.Tensor) else val
    _judge(judge)
    if orders_of(x):            # positions / values in the sequence's own order written
        check_write(x, index, mask, value, vals, "__setitem__")   # on a ring (seq_order)
    ps_mask = [Replicate() if p.is_partial() else p for p in x.placements]
    m = shard_tensor(mask, x.mesh, ps_mask, src_data_rank=None)
    v = shard_tensor(vals, x.mesh, x.placements, src_data_rank=None)
    if orders_of(x):            # built in x's global order (checked above): x's record
        same_order(m, x)
        same_order(v, x)
    y = dispatch(torch.where, (m, v, x), None)
    assign(x, y, "__setitem__", sources=(x,))


def _meta_tracked(v):
    """``v`` on the meta device, a tensor that requires grad still requiring it."""
    if isinstance(v, (DistTensor, torch.Tensor)):
        m = torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
        return m.requires_grad_() if v.requires_grad else m
    if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
        return type(v)(_meta_tracked(u) for u in v)
    return v


def _int_recorded(x: DistTensor, op: str, args, kwargs) -> None:
    """``int_x.masked_fill_(m, v)`` / ``.fill_(v)`` / ``.index_fill_(d, i, v)`` with a 0-d
    ``v`` requiring grad: torch records the write as ``int_x[i] = v`` (the integer x gets a
    grad_fn; its next differentiable op raises "Autograd not support dtype: Long"; torch
    2.13, measured in tests/test_inplace17.py), where the DistTensor wrote the values and
    stayed without history, silently.  Decided by the same op on meta tensors (torch's
    autograd runs there: ``requires_grad`` of the meta result), and refused as
    :func:`_tracked_into_int`, before anything is written."""
    if x.dtype.is_floating_point or x.dtype.is_complex or not torch.is_grad_enabled():
        return
    vals = tuple(args) + tuple(kwargs.values())
    tracked = [v for v in vals if isinstance(v, (DistTensor, torch.Tensor)) and v.requires_grad]
    if not tracked:
        return
    try:
        m = getattr(torch.empty(tuple(x.shape), dtype=x.dtype, device="meta"), op)(
            *_meta_tracked(tuple(args)), **{k: _meta_tracked(v) for k, v in kwargs.items()})
    except (RuntimeError, NotImplementedError, TypeError):
        return                  # torch's own error follows from the real run
    if m.requires_grad:
        _tracked_into_int(x, tracked[0], f"x.{op}(...)", f"x.{op}(..., value.detach())")


def _tracked_into_int(x: DistTensor, val, what: str, fix: str) -> None:
    """``int_x[i] = v`` with ``v`` requiring grad where torch records the write (a 0-d
    ``v`` written by fill_, a bool mask's index_put_; a value copied by ``copy_`` is not
    recorded): torch 2.13 gives the integer x a ``grad_fn`` (``x.requires_grad`` True) and
    x's next differentiable op raises "Autograd not support dtype: Long" (sweep lead
    2012384; measured in tests/test_inplace15.py).  A DistTensor cannot hold that state:
    refused here, before anything is written, with torch's words and the fix."""
    name = torch.empty(0, dtype=x.dtype).type().split(".")[-1].replace("Tensor", "")
    raise RuntimeError(
        f"{what} with a value of {val.dtype} that requires grad, into a "
        f"DistTensor {x.notation()} of {x.dtype}: torch records the write and x's next "
        f"differentiable op raises \"Autograd not support dtype: {name}\" (an integer "
        "tensor with a grad_fn), a state a DistTensor does not hold. Fix: write the values "
        f"torch writes, {fix}, or make x floating (x = x.double())")


def _partial_overlap(x: DistTensor, idx, value) -> None:
    """torch's copy_ refuses a value that is a view of ``x`` partly overlapping the
    written region (``x[1:] = x[:-1]``: "some elements of the input tensor and the
    written-to tensor refer to a single memory location", at::assert_no_partial_overlap),
    where here the value is read first.  Decided by the same write on a stand-in of x's
    global strides (one byte per element), for a value that is a getitem view of ``x``
    and a basic index (ints, slices, None, ...), ``x`` or an alias of its memory (``x.data``,
    ``x.detach()``): other aliasing is not told apart."""
    from . import strides
    if not isinstance(value, DistTensor) or value._view is None \
            or not isinstance(value._view[1], tuple):
        return
    if value._view[0] is not x:         # x.data[1:] = x[:-1]: x's memory under two handles
        rx, rv = overlap._chain(x), overlap._chain(value._view[0])
        if rx[1] or rv[1] or rx[0] is not rv[0]:
            return
    items = idx if isinstance(idx, tuple) else (idx,)
    if not all(i is None or i is Ellipsis or type(i) in (int, slice) for i in items):
        return
    try:
        st = strides.global_stride(x)
    except (RuntimeError, NotImplementedError, ValueError):
        return
    p = torch.empty_strided(tuple(x.shape), st, dtype=torch.uint8).zero_()
    p[idx] = p[value._view[1]]          # torch's RuntimeError (both dense: told apart)
    # neither dense (x[:, 1:] = x[:, :-1]): torch copies in its own loop order, reading
    # elements it wrote before (its result is that order's); refused where an element
    # read is written another's value (x[:, :3] = x[:, 2:3] is order-free: taken)
    pos = torch.arange(p.numel()).as_strided(tuple(x.shape), st)
    dst, src = pos[idx], pos[value._view[1]]
    if src.shape != dst.shape:
        try:
            src = src.expand(dst.shape)
        except RuntimeError:
            return                      # torch's shape error follows
    dst, src = dst.reshape(-1), src.reshape(-1)
    read = torch.isin(dst, src)                 # written elements that are also read
    if bool((dst[read] != src[read]).any()):
        raise NotImplementedError(
            "x[index] = v where v is a view of x that overlaps the written elements in part: "
            "torch copies them in its own memory order, reading elements it has already "
            "written; write a copy (x[index] = v.clone()) for the values read before")


def _bool_masks(index):
    """``index`` with its uint8 tensors as bool ones (torch reads both as masks)."""
    if isinstance(index, torch.Tensor) and index.dtype == torch.uint8:
        return index.bool()
    if isinstance(index, (list, tuple)) and not isinstance(index, torch.Size):
        return type(index)(_bool_masks(i) for i in index)
    return index


def index_put_(x: DistTensor, indices, values, accumulate=False) -> DistTensor:
    """``x.index_put_(indices, values, accumulate)``: ``x[indices] = values``; with
    ``accumulate``, the values (repeated indices summed, as torch) are added to ``x``."""
    if not accumulate:
        setitem(x, tuple(indices), values)     # (its ring-order check sees DistTensors)
        return x
    idx = _full_args(tuple(indices))
    val = values.full() if isinstance(values, DistTensor) else values
    delta = torch.zeros(tuple(x.shape), dtype=x.dtype, device=x.device)
    # a tensor of another dtype raises as torch ("Index put requires the source and
    # destination dtypes match"; cast here before, silently: seed 994561)
    val = val if isinstance(val, torch.Tensor) else torch.as_tensor(val, dtype=x.dtype)
    delta = delta.index_put(idx, val.to(device=x.device), accumulate=True)
    return method(x, "add_", (delta,))


def index_put(x: DistTensor, indices, values, accumulate=False) -> DistTensor:
    """``torch.index_put(x, ...)``: a copy of ``x`` with ``index_put_`` applied."""
    from .dispatch import dispatch
    return index_put_(dispatch(T.clone, (x,), None), indices, values, accumulate)


# ---- torch functions that write: nn.init, out=, inplace=True, torch.relu_ ---------------

def init(func, args, kwargs):
    """``torch.nn.init.<fn>(x, ...)``: ``fn`` fills a plain tensor of the global shape (one
    device's draw), and the result is written into ``x`` (under no_grad, as nn.init)."""
    kwargs = dict(kwargs or {})
    if "tensor" in kwargs:
        x, rest = kwargs.pop("tensor"), tuple(args[1:])
    else:
        x, rest = args[0], tuple(args[1:])
    g = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    with torch.no_grad():
        func(g, *rest, **kwargs)
        return assign(x, g, func.__name__)


def out_call(func, args, kwargs):
    """``func(..., out=x)``: the result computed as without ``out``, written into ``x``
    (resized first where its shape is not the result's, as torch: :mod:`.out_resize`)."""
    kwargs = dict(kwargs)
    out = kwargs.pop("out")
    name = getattr(func, "__name__", str(func))
    if torch.is_grad_enabled() and any(
            isinstance(a, (DistTensor, torch.Tensor)) and a.requires_grad
            for a in tuple(args) + tuple(kwargs.values()) + (out,)):
        raise RuntimeError(f"{name}(): functions with out=... arguments don't support "
                           "automatic differentiation, but one of the arguments requires "
                           "grad; assign the result instead (y = op(...))")
    if func in _DTYPE_FROM_OUT and kwargs.get("dtype") is None and \
            isinstance(out, (DistTensor, torch.Tensor)):
        if func in (torch.nansum, torch.nanmean) and not (
                out.dtype.is_floating_point or out.dtype.is_complex):
            # torch's nansum kernel runs in out's dtype and has none for these (its dtype=
            # path casts instead): "nansum_cpu" not implemented for 'Long'
            raise NotImplementedError(
                f"{name}(out=...): torch computes it in out's dtype {out.dtype} and its "
                "nansum kernel is not implemented for it; give a floating out, or assign "
                "the result and cast it")
        kwargs["dtype"] = out.dtype           # computed in out's dtype, as torch's
    _out_dtype_check(func, args, kwargs, out)
    overlap.check(out, lambda o, a, k: func(*a, **k, out=o), args, kwargs, name, func)
    res = func(*args, **kwargs)
    if not isinstance(res, (DistTensor, torch.Tensor)):
        raise TypeError(f"{name}(out=DistTensor): only single-tensor results can be written "
                        "into a DistTensor; assign the result instead")
    if not torch.can_cast(res.dtype, out.dtype):
        raise RuntimeError(f"{name}(out=...): result type {res.dtype} can't be cast to the "
                           f"desired output type {out.dtype}")
    if tuple(res.shape) != tuple(out.shape):      # resized as torch's (out_resize.py)
        from .out_resize import resize_out
        resize_out(out, res.shape, name)
    return assign(out, res, name)


def _empty_like(v):
    """A zero-element CPU stand-in of a (Dist)Tensor: same dtype and number of dims."""
    if isinstance(v, (list, tuple)):
        return type(v)(_empty_like(u) for u in v)
    if isinstance(v, (DistTensor, torch.Tensor)):
        return torch.empty((0,) * v.dim(), dtype=v.dtype)
    return v


def _out_dtype_check(func, args, kwargs, out):
    """Torch's dtype rule for ``out=``: most unary ops (neg, abs...) want the input's dtype
    ("Found dtype Float but expected Double": TensorIterator's same-dtype check), float
    ones and binary ops cast to an out they can cast to.  The meta kernels skip the check
    for some ops (torch.neg on meta accepts a float32 out of a float64 input), so torch runs
    it on zero-element CPU stand-ins; only its dtype errors are taken (shapes are judged on
    the real result below)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            func(*_empty_like(tuple(args)), **{k: _empty_like(v) for k, v in kwargs.items()},
                 out=torch.empty((0,) * out.dim(), dtype=out.dtype))
    except RuntimeError as e:
        if "dtype" in str(e) or "can't be cast" in str(e):
            raise RuntimeError(f"{getattr(func, '__name__', func)}(out=...): {e} (torch's "
                               "out= dtype rule). Fix: give an out of the result's dtype, "
                               "or assign the result and cast it") from None
    except TypeError as e:       # torch's argument parser: no overload takes these types
        raise TypeError(str(e)) from None   # (torch.sum(x, out=z) needs a dim, seed 1008276)
    except Exception:            # noqa: BLE001 - the stand-ins' own errors: judged below
        pass


def inplace_kwarg(func, args, kwargs):
    """``F.relu(x, inplace=True)``, ``F.dropout(x, inplace=True)``...: the op without
    ``inplace``, written into its first argument."""
    from .dispatch import dispatch
    x = args[0]
    _judge(lambda: func(_meta_self(x), *_meta(tuple(args[1:])),
                        **{k: _meta(v) for k, v in kwargs.items()}))
    name = getattr(func, "__name__", "op")
    overlap.check(x, lambda xs, a, k: func(xs, *a, **k), args[1:], kwargs, name, func)
    y = dispatch(func, (_self(x, args[1:], kwargs),) + tuple(args[1:]),
                 {**kwargs, "inplace": False})
    return assign(x, y, getattr(func, "__name__", "op"), sources=args)


def _self(x: DistTensor, args, kwargs):
    """``x`` as the out-of-place op that computes ``x.op_(...)`` reads it: where autograd
    records the write, under a version counter of its own (torch saves the original self
    of ``y.mul_(w)`` apart; the write then bumps ``x``'s: versions.py)."""
    if not torch.is_grad_enabled() or not (x.requires_grad or any(
            isinstance(a, (DistTensor, torch.Tensor)) and a.requires_grad
            for a in tuple(args) + tuple(kwargs.values()))):
        return x
    return versions.unversioned(x)
