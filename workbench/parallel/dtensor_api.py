"""DTensor's own spellings on a DistTensor, where they need more than a new name:
``DistTensor.from_local(local, mesh, placements, run_check=, shape=, stride=)``,
``to_local(grad_placements=)`` / ``full_tensor(grad_placements=)``, and the gradient of
every replica given to ``from_local`` (torch 2.13, ``torch/distributed/tensor/_api.py``).

What the simulator changes: every rank lives in this one process, so ``from_local``
takes one local tensor per rank (a list in mesh order) or one tensor that every rank
passes (the same program on every rank, as DTensor's SPMD reads it: under ``Shard(0)``
on 4 ranks a (2, 3) local is a (8, 3) global of four equal blocks).
"""
from __future__ import annotations

import torch

from .placement import Replicate, normalize_placements

__all__ = ["check_grad_placements", "share_replicas", "dtensor_from_local", "zeros",
           "ones", "empty", "full", "rand", "randn"]


def check_grad_placements(x, grad_placements, fn: str, expected) -> None:
    """``grad_placements`` of ``to_local`` / ``full_tensor`` / ``from_local``: the
    layout the returned tensor's gradient has.  The one that says "as the value"
    (``expected``) is what autograd computes here; on a mesh dim of one rank every
    placement is that one.  Another (e.g. ``Partial`` for a replicated value whose
    ranks computed different losses) would need the ranks' gradients told apart, which
    simulated ranks sharing one program do not have: it raises."""
    if grad_placements is None:
        return
    gps = normalize_placements(grad_placements, x.mesh, x.ndim, arg="grad_placements")
    want = tuple(expected)
    for i, (g, e) in enumerate(zip(gps, want)):
        if g != e and x.mesh.shape[i] != 1:
            raise NotImplementedError(
                f"{fn}(grad_placements={[str(p) for p in gps]}): the gradient is taken in the "
                f"layout {[str(p) for p in want]} here (mesh dim {x.mesh.dim_names[i]!r}: "
                f"{e}, not {g}); leave grad_placements=None, or reshard the value to the "
                "layout its gradient has before reading it")


class _Replicas(torch.autograd.Function):
    """Several ranks' copies of one replicated local: the value is the first's; each
    copy's gradient is the whole gradient, as each rank's own ``from_local`` gives
    (DTensor: a Replicate value's gradient is Replicate)."""

    @staticmethod
    def forward(ctx, first, *others):
        ctx.n = 1 + len(others)
        return first.view_as(first)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) * ctx.n


def share_replicas(copies: list) -> torch.Tensor:
    """The one local tensor that stands for ``copies`` (distinct tensor objects given
    for the ranks of one replica group, equal in value): the first.  Each other copy
    that requires grad and is its rank's own autograd input receives the gradient too,
    as each process's ``DistTensor.from_local`` gives it: a leaf, or a result computed
    from leaves no other copy reaches (``[a_r * 2 for a_r in leaves]``).  A copy computed
    from the same leaves as a kept one stands for the same tensor (``d.locals()`` are
    views of one stored tensor; ``[t * 2 for t in d.locals()]``): it gets nothing, so
    those leaves receive the gradient once, not once per rank.  Copies that share some
    leaves but not all cannot be told apart: refused (ValueError naming the fix)."""
    extra, kept = [], [(copies[0], _leaves(copies[0]))]
    for t in copies[1:]:
        if not t.requires_grad:
            continue
        mine = _leaves(t)
        if any(mine == theirs and not _other_part(t, k) for k, theirs in kept):
            continue                    # a copy of a kept one: the gradient once
        # views of other parts of one tensor (``[s[r] for r in ranks]`` of a stacked
        # leaf ``s``): each rank's own input, as its process's from_local gives it
        clash = [theirs for k, theirs in kept if mine & theirs
                 and not (mine == theirs and _other_part(t, k))]
        if clash:
            raise ValueError(
                "from_local: the replicas of one shard are computed from leaf tensors that "
                "some replicas share and others do not, so it cannot be told whether they "
                "are each rank's own input (each gets the gradient, as DTensor) or copies "
                "of one tensor (it gets the gradient once); build each rank's local from "
                "its own leaves only (e.g. detach the shared part, or clone a shared leaf "
                "per rank), or pass the same tensor for every rank")
        kept.append((t, mine))
        extra.append(t)
    if not extra or not torch.is_grad_enabled():
        return copies[0]
    return _Replicas.apply(copies[0], *extra)


def _other_part(a, b) -> bool:
    """Whether ``a`` and ``b`` are views of one storage at different places (their
    elements are different memory: the same leaves, yet not copies of one tensor)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    return (a.data_ptr(), a.stride(), a.shape) != (b.data_ptr(), b.stride(), b.shape)


def _leaves(t) -> frozenset:
    """ids of the leaf tensors requiring grad that ``t``'s value is computed from."""
    if t.grad_fn is None:
        return frozenset([id(t)]) if t.requires_grad else frozenset()
    out, seen, stack = set(), set(), [t.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        v = getattr(n, "variable", None)
        if v is not None and type(n).__name__ == "AccumulateGrad":
            out.add(id(v))
            continue
        stack.extend(f for f, _ in n.next_functions)
    return frozenset(out)


def dtensor_from_local(local_tensor, device_mesh=None, placements=None, *, run_check=False,
                       shape=None, stride=None, grad_placements=None):
    """``DistTensor.from_local``: DTensor's signature for :func:`from_local`.

    ``local_tensor``: on torch.distributed this process's tensor; on simulated ranks a
    list of every rank's (mesh order) or one tensor every rank passes.  ``placements``
    default to Replicate.  ``run_check`` checks Replicate copies equal (a collective)
    under torchrun; simulated ranks always check (free, and a difference would otherwise
    be a silent choice of one copy).  ``stride``, if given, must be the contiguous one of
    ``shape``.  ``grad_placements``: the gradient's layout (only the value's own, as
    the gradient placements of a Partial, Replicate, are built)."""
    from ..sim_mesh.mesh import Mesh
    from . import storage
    from .dist_tensor import DistTensor, from_local
    if isinstance(local_tensor, DistTensor):
        raise RuntimeError("DistTensor.from_local(local_tensor=DistTensor): the local_tensor "
                           "argument only accepts torch.Tensor; use redistribute() to move a "
                           "DistTensor")
    if not isinstance(device_mesh, Mesh):
        raise TypeError(f"DistTensor.from_local(device_mesh={device_mesh!r:.60}): give the "
                        "workbench Mesh, e.g. wb.init_device_mesh('cpu', (2, 2))")
    if placements is None:
        placements = [Replicate()] * device_mesh.ndim
    if stride is not None and shape is None:
        raise RuntimeError(f"DistTensor.from_local(stride={stride!r}) without shape: pass both "
                           "shape and stride, or neither")
    own = storage.holds_own(device_mesh)
    if not own and isinstance(local_tensor, torch.Tensor):
        local_tensor = [local_tensor] * device_mesh.size
    out = from_local(local_tensor, device_mesh, placements, shape=shape,
                     check_replicas=run_check if own else True)
    if stride is not None:
        want = tuple(torch.empty(tuple(out.shape), device="meta").stride())
        if tuple(stride) != want:
            raise NotImplementedError(
                f"DistTensor.from_local(stride={tuple(stride)}): a DistTensor here is "
                f"contiguous, stride {want} for shape {tuple(out.shape)}; pass that stride "
                "or leave it out")
    from_ps = tuple(Replicate() if p.is_partial() else p for p in out.placements)
    check_grad_placements(out, grad_placements, "from_local", from_ps)
    return out


# ---- DTensor's factories: torch.distributed.tensor.zeros / ones / empty / full / rand / randn

def _size(size, fn):
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in size):
        raise TypeError(f"{fn}(size={size!r}): give the global shape as non-negative ints, "
                        "e.g. wb.parallel.zeros(4, 6, device_mesh=mesh, placements=[Shard(0)])")
    return tuple(size)


def _factory(init, fn, size, device_mesh, placements, requires_grad, layout, **kw):
    """``init`` of the GLOBAL shape (one device's tensor: one device's draw for rand /
    randn), laid out by ``placements`` (default Replicate), as a new autograd leaf."""
    from ..sim_mesh.mesh import Mesh
    from .dist_tensor import shard_tensor
    if not isinstance(device_mesh, Mesh):
        raise TypeError(f"{fn}(device_mesh={device_mesh!r:.60}): give the workbench Mesh, "
                        "e.g. wb.init_device_mesh('cpu', (2, 2))")
    if layout != torch.strided:
        raise NotImplementedError(f"{fn}(layout={layout}): DistTensors are strided; leave "
                                  "layout=torch.strided")
    if placements is None:
        placements = [Replicate()] * device_mesh.ndim
    ps = normalize_placements(placements, device_mesh, len(size))
    if any(p.is_partial() for p in ps):
        raise ValueError(f"{fn}(placements={[str(p) for p in ps]}): a Partial value made by a "
                         "factory is ambiguous (DTensor fills every rank's part); use Shard or "
                         "Replicate, then redistribute")
    out = shard_tensor(init(size, **kw), device_mesh, ps, src_data_rank=None)
    return out.requires_grad_() if requires_grad else out


def _make(init, name):
    def factory(*size, dtype=None, layout=torch.strided, requires_grad=False,
                device_mesh=None, placements=None):
        return _factory(init, name, _size(size, name), device_mesh, placements,
                        requires_grad, layout, dtype=dtype)
    factory.__name__ = name
    factory.__doc__ = (f"DTensor's ``torch.distributed.tensor.{name}(*size, dtype=, "
                       "requires_grad=, device_mesh=, placements=)``: the global tensor "
                       f"``torch.{name}(size)`` laid out on ``device_mesh``.")
    return factory


zeros = _make(torch.zeros, "zeros")
ones = _make(torch.ones, "ones")
empty = _make(torch.empty, "empty")
rand = _make(torch.rand, "rand")
randn = _make(torch.randn, "randn")


def full(size, fill_value, *, dtype=None, layout=torch.strided, requires_grad=False,
         device_mesh=None, placements=None):
    """DTensor's ``torch.distributed.tensor.full(size, fill_value, ...)``."""
    return _factory(lambda s, **kw: torch.full(s, fill_value, **kw), "full",
                    _size((size,), "full"), device_mesh, placements, requires_grad, layout,
                    dtype=dtype)
