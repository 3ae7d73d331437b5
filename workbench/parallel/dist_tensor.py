"""DistTensor: a logical (global) tensor laid out over a mesh by placements.

    >>> mesh = Mesh.grid((2, 2), ("dp", "tp"))
    >>> t = shard_tensor(torch.randn(8, 6), mesh, [Shard(0), Shard(1)])
    >>> t                                   # the notation of "How to Scale Your Model"
    DistTensor f32[I_dp, J_tp] shape=(8, 6) on Mesh(dp=2, tp=2; ranks [0, 1, 2, 3])
    >>> t.local(3).shape
    torch.Size([4, 3])

Every rank's local shard is held in ``t._local``: one stacked tensor with one
leading axis per mesh dimension (size 1 where the tensor is replicated), or, when
shard shapes differ (uneven ``torch.chunk`` splits), :class:`Cells`, one tensor per
rank; on torch.distributed, this process's shard.  :mod:`workbench.parallel.storage`
owns these forms; this module never asks which one it holds.

A DistTensor keeps torch.Tensor's habits: operators and methods go through the SPMD
rules (``tensor_methods.install``), in-place ops (``x.add_``, ``x[i] = v``, ``nn.init``) write
into the same object (:mod:`.inplace`), ``==`` is elementwise and ``x in d``, ``bool``,
``item`` read the full tensor (:mod:`.habits`).
"""
from __future__ import annotations

import copy
import itertools
import math
from typing import Sequence

import weakref

import torch

from ..sim_mesh import backends as _B
from ..sim_mesh.collectives import Cells
from ..sim_mesh.mesh import Mesh
from . import layout, replicas, storage, strides
from .placement import Partial, Replicate, check_partial_dtype, normalize_placements
from .spec import TensorSpec, notation
from .versions import explained as _explained

__all__ = ["DistTensor", "TensorSpec", "shard_tensor", "distribute_tensor", "from_local"]

_SUM = Partial("sum")

_RETAINS: dict = {}     # id(DistTensor) -> weakref: retain_grad() was called on it


def retains(x) -> bool:
    """Did :meth:`DistTensor.retain_grad` keep ``x``'s gradient (read without touching
    its local tensors: ``retains_grad`` of a view written through its base regenerates
    the view's grad_fn, a write of its own)?"""
    r = _RETAINS.get(id(x))
    return r is not None and r() is x


class DistTensor:
    """A global tensor of ``shape`` laid out on ``mesh`` by ``placements``.

    Build one with :func:`shard_tensor` or :func:`from_local`; move it with
    :func:`workbench.reshard`.  Torch functions and operators on DistTensors go
    through the SPMD rules (:mod:`workbench.parallel.dispatch`).
    """
    __slots__ = ("mesh", "placements", "shape", "dtype", "_local", "names", "_spec",
                 "_view", "_is_param", "_gstride", "_ring_order", "_ring_also",
                 "__weakref__")
    # _is_param: set by nn.Parameter(d); _gstride: the global strides where the shards
    # cannot tell them (strides.py), else None; _ring_order: the order its sequence is
    # in, where context parallelism laid it out (seq_order.py), else None; _ring_also: other
    # dims known to be in that order, whole on the ring's mesh dim (seq_order.py)

    def __init__(self, local, mesh: Mesh, placements, shape, dtype=None, names=None):
        self.mesh = mesh
        # (a tuple and a torch.Size kept as they are: both immutable; the dispatcher's
        # outputs pass their prepared op's)
        self.placements = placements if type(placements) is tuple else tuple(placements)
        self.shape = shape if type(shape) is torch.Size else torch.Size(shape)
        self._local = local
        self.dtype = dtype if dtype is not None else local.dtype
        self.names = names
        self._spec = None
        self._view = None       # (base, index or None, aliased): see parallel/inplace.py
        self._gstride = None    # strides.py
        self._ring_order = None  # seq_order.py
        self._ring_also = ()

    # ---- facts -----------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, d: int | None = None):
        if d is None:
            return self.shape
        n = len(self.shape)
        if type(d) is not int or not -n <= d < n:
            raise IndexError(f"size({d!r}): dimension out of range for a {n}-d DistTensor"
                             + (f" (expected a dim in [{-n}, {n - 1}])" if n else ""))
        return self.shape[d]

    def numel(self) -> int:
        return math.prod(self.shape)

    def stride(self, dim: int | None = None):
        """The global tensor's strides, as DTensor's (:mod:`.strides`)."""
        from .strides import global_stride
        st = global_stride(self)
        if dim is None:
            return st
        n = len(st)
        if type(dim) is not int or not -n <= dim < n:
            raise IndexError(f"stride({dim!r}): dimension out of range for a {n}-d DistTensor"
                             + (f" (expected a dim in [{-n}, {n - 1}])" if n else ""))
        return st[dim]

    def is_contiguous(self, memory_format=torch.contiguous_format) -> bool:
        """torch's ``is_contiguous`` of the global tensor's strides (:mod:`.strides`)."""
        from .strides import is_contiguous
        return is_contiguous(self, memory_format)

    @property
    def spec(self) -> TensorSpec:
        if self._spec is None:
            self._spec = TensorSpec(self.shape, self.mesh, self.placements, self.dtype,
                                    _trusted=True)
        return self._spec

    @property
    def is_even(self) -> bool:
        return not storage.is_cells(self._local)

    @property
    def device(self):
        return storage.device(self._local)

    # ---- shards ----------------------------------------------------------------------
    def local(self, rank: int | None = None) -> torch.Tensor:
        """The local shard that ``rank`` holds (on torch.distributed: this process's,
        ``rank`` may be omitted)."""
        if storage.holds_own(self.mesh):
            me = _B.rank()
            if rank is not None and rank != me:
                raise ValueError(f"local(rank={rank}) in process {me}: on torch.distributed "
                                 "each process holds only its own shard")
            return storage.own(self._local, self.mesh)
        if rank is None and self.mesh.size == 1:
            rank = self.mesh.ranks[0]       # one rank: its shard is the only one
        if rank is None:
            raise ValueError("local(rank=None): give the rank whose shard you want, one of "
                             f"{list(self.mesh.ranks)}")
        if rank not in self.mesh:
            raise ValueError(f"local(rank={rank!r}): not a rank of this mesh; use one of "
                             f"{list(self.mesh.ranks)}")
        return storage.rank_view(self._local, self.mesh, rank)

    @staticmethod
    def from_local(local_tensor, device_mesh=None, placements=None, *, run_check=False,
                   shape=None, stride=None, grad_placements=None) -> "DistTensor":
        """DTensor.from_local's signature (:func:`.dtensor_api.dtensor_from_local`): on
        simulated ranks a list of every rank's local, or one tensor every rank passes."""
        from .dtensor_api import dtensor_from_local
        return dtensor_from_local(local_tensor, device_mesh, placements, run_check=run_check,
                                  shape=shape, stride=stride, grad_placements=grad_placements)

    def locals(self) -> list[torch.Tensor]:
        """Every rank's local shard, in mesh (row-major) order (simulation only)."""
        return [self.local(r) for r in self.mesh.ranks]

    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        """This process's shard (torch.distributed), as DTensor.to_local, differentiable.
        On simulated ranks: the one local every rank holds alike (a one-rank mesh, or
        Replicate on every mesh dim of more than one rank); other layouts raise, naming
        ``local(rank)``.  ``grad_placements``: the layout the local gradient has; only
        this DistTensor's own is built (:func:`.dtensor_api.check_grad_placements`)."""
        from .dtensor_api import check_grad_placements
        check_grad_placements(self, grad_placements, "to_local", self.placements)
        if storage.holds_own(self.mesh):
            return self.local()
        if any(not p.is_replicate() and n > 1 for p, n in zip(self.placements, self.mesh.shape)):
            raise ValueError(f"to_local() on simulated ranks: all {int(self.mesh.size)} ranks of "
                             f"{self.mesh} live in this one process and hold different shards "
                             f"({[str(p) for p in self.placements]}), so there is no one local "
                             "tensor; take one rank's with d.local(rank), every rank's with "
                             "d.locals(), or the global tensor with d.full_tensor()")
        return self.local(self.mesh.ranks[0])

    def full(self) -> torch.Tensor:
        """The global tensor, gathered by a (traced) reshard to Replicate."""
        from .reshard import reshard
        t = self
        if any(not p.is_replicate() for p in self.placements):
            if storage.holds_own(self.mesh):        # a read one process makes alone: told
                from ..sim_mesh.agreed_reads import reading
                with reading(f"a DistTensor {self.notation()}"):
                    t = reshard(self, self.mesh, [Replicate()] * self.mesh.ndim)
            else:
                t = reshard(self, self.mesh, [Replicate()] * self.mesh.ndim)
        return t.local(None if storage.holds_own(self.mesh) else self.mesh.ranks[0])

    def cells(self) -> Cells:
        """The local shards as Cells (a grid of tensors), whatever the layout."""
        return storage.to_cells(self._local, self.mesh.ndim)

    # ---- autograd ----------------------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        ts = storage.tensors(self._local)
        # FSDP / Zero3 over DistTensors: the template's flag is its shard's, the leaf the
        # optimizer steps (fsdp_dist_habits: frozen through opt's parameter, the module's
        # read True, habits16)
        of = ts[0].__dict__.get("_wb_requires_grad_of")
        if of is not None:
            return of.requires_grad
        return storage.requires_grad(self._local)

    @property
    def grad_fn(self):
        """The autograd node that made this value (one rank's local tensor's: every
        rank's comes from the same op), None for a leaf or a value without history."""
        return storage.tensors(self._local)[0].grad_fn

    @property
    def is_leaf(self) -> bool:
        return all(t.is_leaf for t in storage.tensors(self._local))

    def requires_grad_(self, flag: bool = True) -> "DistTensor":
        """Make this DistTensor a leaf of autograd: its ``.grad`` becomes a DistTensor."""
        if not (self.dtype.is_floating_point or self.dtype.is_complex) and flag:
            raise TypeError(f"requires_grad_() on a {self.dtype} DistTensor: only floating "
                            "point and complex tensors can require gradients")
        if flag and not self.is_leaf and self.requires_grad:
            return self                 # a result of ops: torch keeps its history
        ts = storage.tensors(self._local)
        if all(t.is_leaf and t.__dict__.get("_wb_keep_leaf") for t in ts):
            # a wrapper's leaves (DDP's replicas: the tensors its optimizer and hooks
            # hold): the flag set on them, as torch sets a parameter's, not new leaves
            for t in ts:
                hook = t.__dict__.get("_wb_on_requires_grad")
                if hook is not None:
                    hook(flag)          # may refuse, before anything changes
            for t in ts:
                t.requires_grad_(flag)
            return self

        def leaf(t):
            out = t.detach().requires_grad_(flag)
            # what a wrapper told the storage (fsdp_dist_habits: a template's
            # ``_wb_stale`` and the hook that passes the flag on to its shard) stays
            out.__dict__.update({k: v for k, v in t.__dict__.items() if k.startswith("_wb_")})
            hook = t.__dict__.get("_wb_on_requires_grad")
            if hook is not None:
                hook(flag)
            return out
        self._local = storage.map_tensors(self._local, leaf)
        return self

    def retain_grad(self) -> None:
        """torch's ``retain_grad``: a non-leaf keeps its gradient in ``.grad`` after
        backward, a DistTensor in the gradient's placements (:meth:`_grad_placements`:
        a Partial(sum) value's gradient Replicate); on a leaf it does nothing, as torch
        (a leaf keeps its gradient anyway); torch's RuntimeError for a value that does not
        require grad.  Kept through an in-place write into it (``inplace._assign``), as
        torch's (``y.retain_grad(); y.add_(1)``: y.grad is the new value's gradient)."""
        if not self.requires_grad:
            raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")
        kept = False
        for t in storage.tensors(self._local):
            if t.requires_grad and not t.is_leaf:
                t.retain_grad()
                kept = True
        if kept:
            k = id(self)
            _RETAINS[k] = weakref.ref(self, lambda _: _RETAINS.pop(k, None))

    @property
    def retains_grad(self) -> bool:
        """True after :meth:`retain_grad` on a non-leaf (False for a leaf, as torch)."""
        return retains(self)

    @property
    def grad(self) -> "DistTensor | None":
        ts = storage.tensors(self._local)
        of = _grad_source(ts)
        # a ZeRO-3 / FSDP parameter: its shard's gradient (strategies/fsdp_dist_views.
        # GradOf); a ZeRO-1/2 replica's: zero_optimizer_dist.GradInShard
        if of is not None:
            return of.get()
        return self._storage_grad()

    def _storage_grad(self) -> "DistTensor | None":
        """The gradient autograd accumulated into this DistTensor's storage, as a
        DistTensor (``grad``'s answer where no wrapper keeps it elsewhere)."""
        ts = storage.tensors(self._local)
        if all(t.grad is None for t in ts):
            return None
        g = storage.map_tensors(self._local,
                                lambda t: torch.zeros_like(t) if t.grad is None else t.grad)
        # a data-parallel wrapper's replicas before it sums their gradients (ZeRO-1/2's
        # step, DDP's no_sync, DataParallel before finish_gradient_synchronization): each
        # copy is its rank's share, Partial("sum") on those axes (GradReplicas._replica_grad)
        unsummed = {a for t in ts if t.grad is not None
                    for a in getattr(t.grad, "_wb_unsummed", ())}
        out = DistTensor(g, self.mesh, self._grad_placements(unsummed), self.shape)
        if strides.lost_dims(out) and strides.known(self):
            # torch's AccumulateGrad lays a leaf's gradient out as the leaf's strides
            strides.keep(out, strides.global_stride(self))
        return out

    @grad.setter
    def grad(self, value) -> None:
        if value is not None and self._holds_grad(value):
            return      # p.grad *= c: the in-place result given back (torch: the same tensor)
        if value is not None:
            raise ValueError(
                "p.grad = value on a DistTensor: set .grad to None (zero_grad), assign "
                "gradients through backward(), or change the gradient in place "
                "(p.grad.mul_(c), p.grad.copy_(value), p.grad *= c)")
        ts = storage.tensors(self._local)
        of = _grad_source(ts)
        if of is not None:
            of.clear()
            return
        for t in ts:
            t.grad = None

    def _holds_grad(self, value) -> bool:
        """Is ``value`` this DistTensor's gradient itself (the same local tensors: what
        ``p.grad *= c`` assigns back after its in-place multiply; habits12: it raised,
        where torch's ``p.grad *= c`` scales the gradient)?"""
        cur = self.grad if isinstance(value, DistTensor) else None
        if cur is None or cur.mesh != value.mesh or tuple(cur.shape) != tuple(value.shape):
            return False
        a, b = storage.tensors(cur._local), storage.tensors(value._local)
        return len(a) == len(b) and all(
            x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
            for x, y in zip(a, b))

    def _grad_placements(self, unsummed=()):
        # The gradient of a Partial("sum") value is the same on every rank: Replicate.
        # Of a Partial avg / max / min value, each rank's local gradient is its share of
        # the global one (1/n of it for avg; all of it on the rank holding the max): the
        # shares sum to it, Partial("sum") (DTensor reduces them to Replicate; held as the
        # shares, ``x.grad`` stays the local tensors' own .grad, so x.grad.zero_() works)
        return tuple(_SUM if a in unsummed else
                     Replicate() if p.is_partial() and p.reduce_op == "sum" else
                     _SUM if p.is_partial() else p for a, p in enumerate(self.placements))

    def detach(self) -> "DistTensor":
        """A new DistTensor on the same storage, with no history (as ``Tensor.detach``):
        an in-place write to it (``p.detach().zero_()``, a common init idiom) writes
        ``self``.  A ZeRO-3 / FSDP parameter's storage is not always its values' home
        (``strategies/fsdp_dist_habits``): the copy a forward gathered (the module's
        attribute until the next forward) detaches to its parameter's template, whose
        storage views the flat shards on simulated ranks, so the write reaches them as
        in FSDP2 (its module parameters are DTensor views of the shards); where the
        storage is a copy (the template under torch.distributed, a gathered copy in
        another dtype) the result keeps the ``_wb_stale`` mark, so a write raises its
        message (``inplace._assign``) instead of being lost.  Before, the detach dropped
        the mark and ``model.fc.weight.detach().zero_()`` after a forward changed nothing."""
        ts = storage.tensors(self._local)
        of = ts[0].__dict__.get("_wb_data_of") if ts else None
        if of is not None and of.dtype == self.dtype and of.shape == self.shape:
            return of.detach()

        def det(t):
            out = t.detach()
            # the memory's other holder: a tracked write into the result would take new
            # memory and not reach it (inplace._check_detached); kept beside the tensor,
            # not in its __dict__, which torch.save pickles
            key = id(out)
            DETACHED[key] = (weakref.ref(out, lambda _, k=key: DETACHED.pop(k, None)),
                             weakref.ref(t))
            d = t.__dict__
            if d.get("_wb_stale") and (d.get("_wb_data_stale") or "_wb_data_of" in d):
                out._wb_stale = d["_wb_stale"]
            return out
        loc = storage.map_tensors(self._local, det)
        out = DistTensor(loc, self.mesh, self.placements, self.shape, self.dtype, self.names)
        out._gstride = getattr(self, "_gstride", None)      # torch's detach keeps strides
        out._ring_order = getattr(self, "_ring_order", None)  # and the values' order
        out._ring_also = getattr(self, "_ring_also", ())
        alias(out, self)
        return out

    def backward(self, gradient=None, retain_graph=None, create_graph=False,
                 inputs=None) -> None:
        """Backpropagate from this DistTensor (a Partial sum or avg without reducing it).

        ``gradient``: the gradient of the global tensor, as a DistTensor of the same
        shape on the same mesh (resharded to this layout if needed) or a plain tensor of
        the global shape; it may be left out for a one-element tensor. ``retain_graph``,
        ``create_graph``, ``inputs`` (DistTensors or tensors): as torch.Tensor.backward."""
        if self.numel() != 1 and gradient is None:
            raise RuntimeError(f"backward() on a DistTensor of shape {tuple(self.shape)}: "
                               "grad can be implicitly created only for scalars; pass gradient=")
        kw = {}
        if retain_graph is not None or create_graph or inputs is not None:
            kw = {"retain_graph": retain_graph, "create_graph": create_graph}
            if inputs is not None:
                ins = [inputs] if isinstance(inputs, (DistTensor, torch.Tensor)) else inputs
                kw["inputs"] = [u for x in ins for u in (
                    storage.tensors(x._local) if isinstance(x, DistTensor) else [x])]
        with _explained():      # (a saved value written in place: the DistTensor write)
            if not kw and gradient is None and storage.backward_scalar(
                    self._local, self.mesh, self.placements):
                return
            outs, grads = self._seed(gradient, "backward")
            torch.autograd.backward(outs, grads, **kw)

    def _seed(self, gradient, fn: str):
        """The local tensors to start backpropagation from and their gradients (None: a
        one-element value's implicit 1), for ``backward`` and ``torch.autograd.grad``.
        A Partial sum or avg seeds each rank's partial with its share of the gradient
        (storage.seed_like: no all-reduce, as torch); a max or min one is reduced first."""
        from .reshard import reshard
        t = self
        seed_ps = tuple(Replicate() if p.is_partial() else p for p in self.placements)
        if seed_ps != self.placements and not storage.seeds_partial(
                self._local, self.mesh, self.placements):
            t = reshard(self, self.mesh, seed_ps)
        if gradient is None:
            if t.placements == seed_ps:
                # replicated axes are compact (size 1): the first element is the one value
                return [storage.tensors(t._local)[0].reshape(-1)[:1].sum()], [None]
            gradient = torch.ones(t.shape, dtype=t.dtype, device=storage.device(t._local))
        if isinstance(gradient, DistTensor):
            if gradient.mesh != t.mesh or gradient.shape != t.shape:
                raise ValueError(f"{fn}(gradient={gradient!r}): expected the shape "
                                 f"{tuple(t.shape)} on {t.mesh}; reshard or give a plain tensor")
            g = gradient if gradient.placements == seed_ps else \
                reshard(gradient, t.mesh, seed_ps)
        else:
            gt = _as_tensor(gradient, "gradient", fn)
            if gt.shape != t.shape:
                raise ValueError(f"{fn}(gradient of shape {tuple(gt.shape)}): expected the "
                                 f"global shape {tuple(t.shape)}")
            g = shard_tensor(gt.to(t.dtype), t.mesh, seed_ps)
        gl = storage.seed_like(g._local, t._local, t.mesh, t.placements)
        return storage.tensors(t._local), storage.tensors(gl)

    # ---- printing --------------------------------------------------------------------
    def notation(self) -> str:
        return notation(self.shape, self.mesh, self.placements, self.dtype, self.names)

    def __repr__(self) -> str:
        grad = ", requires_grad" if self.requires_grad else ""
        return (f"DistTensor {self.notation()} shape={tuple(self.shape)} on {self.mesh}{grad}")

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DistTensor")          # as torch: len() of a 0-d tensor
        return self.shape[0]

    def __bool__(self):
        raise RuntimeError("the truth value of a DistTensor is ambiguous; use .full()")

    def __hash__(self):
        return id(self)

    def __getstate__(self):
        """Pickled (``torch.save``) without the cached ``_spec``: a TensorSpec is no
        safe global of ``torch.load(weights_only=True)``, and its cached hash is this
        process's; it is rebuilt on first use.  (A saved optimizer state had read its
        ``.spec`` in the step, so ``torch.load`` of ``opt.state_dict()`` raised.)"""
        slots = self._slots()
        # the local tensors as torch.save keeps a Parameter's (``Parameter.__reduce_ex__``
        # saves ``self.data`` and requires_grad; Note [Don't serialize hooks]): the
        # attributes and hooks a wrapper hangs on them are this process's wiring (ZeRO-1/2's
        # zero_grad hook, a closure, made torch.save(state_dict(keep_vars=True)) raise
        # "Can't pickle local object '..._zero_shard_hook.<locals>.hook'", habits10)
        slots["_local"] = storage.map_tensors(self._local, _saved)
        return None, {**slots, "_spec": None}

    def _slots(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__
                if k not in ("__weakref__", "_spec") and hasattr(self, k)}

    def __deepcopy__(self, memo):
        """``copy.deepcopy``: every slot deep-copied, the local tensors as they are (their
        own ``__deepcopy__``), as the default copy did before pickling dropped their
        wiring (``__getstate__``)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self._slots().items():
            setattr(new, k, copy.deepcopy(v, memo))
        new._spec = None
        return new


def _saved(t: torch.Tensor) -> torch.Tensor:
    """A local tensor for pickling: itself, or where a wrapper hung attributes or backward
    hooks on it, an alias of its memory with its requires_grad and nothing else (storages
    shared between local tensors stay shared in the file)."""
    if type(t) is not torch.Tensor or not (t.__dict__ or t._backward_hooks):
        return t
    c = t.detach()
    return c.requires_grad_() if t.requires_grad else c


# id(a local tensor made by DistTensor.detach) -> (weakref to it, weakref to its source)
DETACHED: dict = {}

# id(a DistTensor made by detach() / .data) -> (weakref to it, a callable giving its source
# or None): the two share memory as torch's do (inplace_overlap follows the link while they
# still do).  The source is held weakly (a detached activation must not keep its autograd
# graph alive), except a view that is a copy of its base (uneven shards): held, so that a
# write into ``x[1:].detach()`` is refused (inplace._check_alias_of_copy), not lost
ALIAS_OF: dict = {}
# id(a view that is a copy) -> weakrefs to its detach() / .data handles (held by them, so
# its id is not reused while one lives): views.refresh gives them the copy's new memory
COPY_HANDLES: dict = {}


def alias(out: "DistTensor", src: "DistTensor") -> None:
    """Record that ``out`` is ``src``'s memory under another handle (detach, .data)."""
    key = id(out)
    copy = src._view is not None and not src._view[2]
    chain = None
    if src._view is not None and not copy:
        # a view sharing its root's memory (``x[1:].detach()``): the view itself may be
        # gone by the time the handle is written (a temporary), so the way down from the
        # root is kept too (the root weakly), for inplace_overlap's check
        from .inplace_overlap import _chain
        root, steps = _chain(src)
        if root is not src:
            chain = (weakref.ref(root), tuple(steps))
    ALIAS_OF[key] = (weakref.ref(out, lambda _, k=key: ALIAS_OF.pop(k, None)),
                     (lambda: src) if copy else weakref.ref(src), chain)
    if copy:
        refs = COPY_HANDLES.get(id(src))
        if refs is None or len(COPY_HANDLES) > 4096:
            for k in [k for k, rs in COPY_HANDLES.items() if all(r() is None for r in rs)]:
                del COPY_HANDLES[k]
            refs = COPY_HANDLES.setdefault(id(src), [])
        refs.append(weakref.ref(out))


# ---- construction -------------------------------------------------------------------------

def _grad_source(ts):
    """Where a wrapper keeps this parameter's gradient (``GradOf`` of
    ``strategies/fsdp_dist_views``): set on a ZeRO-3 / FSDP template's storage, reached
    from the copy a forward gathered through ``_wb_data_of``; None for any other tensor."""
    if not ts:
        return None
    d = ts[0].__dict__
    of = d.get("_wb_grad_of")
    if of is None and d.get("_wb_data_of") is not None:
        return _grad_source(storage.tensors(d["_wb_data_of"]._local))
    return of


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, a NaN equal to a NaN in the same place (replicas of a tensor with
    NaNs are the same tensor; torch.equal says no, as NaN != NaN)."""
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or a.dtype != b.dtype or not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _stack_cells(cells: Cells, nd: int) -> torch.Tensor:
    """Cells of equal shapes as one stack (kept for callers; see storage.to_stacked)."""
    return storage.to_stacked(cells)


def _as_tensor(x, arg: str, fn: str) -> torch.Tensor:
    """A tensor from a tensor, a number or a nested list of numbers; anything else is
    an error naming the argument."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, DistTensor):
        raise TypeError(f"{fn}({arg}=DistTensor): it is already distributed; use reshard()")
    ok = isinstance(x, (int, float, complex, bool, list, tuple)) or hasattr(x, "__array__")
    if ok:
        try:
            return torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"{fn}({arg}={x!r:.60}): cannot make a tensor of it ({e}); "
                            "give a torch.Tensor") from None
    raise TypeError(f"{fn}({arg}={x!r:.60}): a {type(x).__name__} is not a tensor; "
                    "give a torch.Tensor (or numbers)")


def shard_tensor(x: torch.Tensor, mesh: Mesh, placements, names: str | None = None,
                 src_data_rank: int | None = 0) -> DistTensor:
    """Lay the global tensor ``x`` out on ``mesh``: each rank keeps its shard.

    ``Partial("sum")`` keeps the value on the first rank of each group and zeros
    elsewhere (so the sum is exact); other Partial ops keep the value everywhere.
    The DistTensor holds a copy: later in-place edits of ``x`` do not change it.
    On torch.distributed every process's ``x`` is first replaced by the one at index
    ``src_data_rank`` on every mesh dim (a broadcast; ``None``: each keeps its own, as
    DTensor's ``distribute_tensor``)."""
    if isinstance(x, DistTensor):
        raise TypeError("shard_tensor(x=DistTensor): x is already distributed; use reshard()")
    x = _as_tensor(x, "x", "shard_tensor")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard_tensor(mesh={mesh!r:.60}): expected a workbench Mesh, "
                        "e.g. Mesh.grid((2, 2))")
    ps = normalize_placements(placements, mesh, x.dim())
    check_partial_dtype(ps, x.dtype)
    if names is not None and not isinstance(names, str):
        raise TypeError(f"shard_tensor(names={names!r}): expected a string of one letter per "
                        "dim for the notation, e.g. 'BSH', or None")
    ok = type(src_data_rank) is int and 0 <= src_data_rank < min(mesh.shape)
    if src_data_rank is not None and not ok:
        raise ValueError(f"shard_tensor(src_data_rank={src_data_rank!r}): give an index below "
                         f"every mesh dim's size {tuple(mesh.shape)}, or None (no broadcast)")
    if storage.holds_own(mesh) and src_data_rank is not None:
        x = replicas.broadcast_global(x, mesh, src_data_rank)
    nd = mesh.ndim
    cur = tuple(Replicate() for _ in range(nd))
    loc = storage.from_global(x, mesh)
    for i, p in enumerate(ps):          # left to right, as DTensor nests shards
        if not p.is_replicate():
            nxt = cur[:i] + (p,) + cur[i + 1:]
            loc = storage.local_step(loc, x.shape, mesh, cur, nxt, i)
            cur = nxt
    if storage.holds_own(mesh) and isinstance(loc, torch.Tensor) \
            and loc.untyped_storage().nbytes() > loc.numel() * loc.element_size():
        # this process's shard on its own, as DTensor's distribute_tensor scatters it into
        # a new tensor: a view kept the whole global tensor alive (a dp 4 rank held the
        # 8-sequence batch, counted 4,096 B of tokens for its 1,024; task tdclock)
        loc = loc.clone(memory_format=torch.contiguous_format)
    out = DistTensor(loc, mesh, ps, x.shape, x.dtype, names)
    st = x.stride()
    expanded = any(k == 0 and n > 1 for k, n in zip(st, x.shape))
    if expanded or strides.lost_dims(out):
        # the shards cannot tell x's order: x tells it.  An expanded x keeps its strides
        # exactly, as DTensor's spec does, its local tensors being dense copies
        # (distribute_tensor on torch 2.13, a 1-rank gloo mesh, measured:
        # ``arange(4.).expand(3, 4)`` stride() (0, 1), is_contiguous() False; DTensor's
        # TensorMeta takes tensor.stride(): torch/distributed/tensor/_api.py
        # distribute_tensor).  Before inplace18: (4, 1) and True.  (DTensor keeps a step
        # slice's or a narrowed x's gaps too, (8, 2) for ``base[:, ::2]``: not matched,
        # their dense strides kept, as d.view(-1) then answers here)
        strides.keep(out, st, dense=expanded)
    return out


def distribute_tensor(tensor: torch.Tensor, device_mesh: Mesh, placements=None, *,
                      src_data_rank: int | None = 0) -> DistTensor:
    """DTensor's name and signature for :func:`shard_tensor` (``placements=None``:
    Replicate on every mesh dim, as DTensor's).  As DTensor's, the result is a new leaf
    of autograd: ``requires_grad`` as ``tensor``'s, its gradient in its own ``.grad``,
    none flowing back to ``tensor`` (``shard_tensor`` is the differentiable one)."""
    if placements is None:
        if not isinstance(device_mesh, Mesh):
            raise TypeError(f"distribute_tensor(device_mesh={device_mesh!r:.60}): expected a "
                            "workbench Mesh")
        placements = [Replicate()] * device_mesh.ndim
    grad = isinstance(tensor, torch.Tensor) and tensor.requires_grad
    if grad:
        tensor = tensor.detach()
    out = shard_tensor(tensor, device_mesh, placements, src_data_rank=src_data_rank)
    return out.requires_grad_() if grad else out


def from_local(locals_: Sequence[torch.Tensor], mesh: Mesh, placements, shape=None,
               check_replicas: bool = True) -> DistTensor:
    """Build a DistTensor from every rank's local tensor (a list in mesh rank order).

    E.g. a Partial tensor whose ranks hold unequal parts, as after a row-parallel
    matmul.  The global shape is inferred from the shards unless ``shape`` is given;
    shards that do not fit it, or Replicate copies that differ, are errors (on
    torch.distributed: each process's copy is compared with its group's first rank's, a
    collective every process runs; ``check_replicas=False`` skips it)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"from_local(mesh={mesh!r:.60}): expected a workbench Mesh")
    if storage.holds_own(mesh):
        if isinstance(locals_, (list, tuple)):
            raise TypeError("from_local on torch.distributed takes this process's local tensor, "
                            "not a list of every rank's")
        t = _as_tensor(locals_, "locals_", "from_local")
        ps = normalize_placements(placements, mesh, t.dim())
        check_partial_dtype(ps, t.dtype)
        if check_replicas:          # a collective: every process passes the same flag
            replicas.check_replicas(t, mesh, ps)
        if shape is None:           # even shards: the global size is the local times the split
            shape = list(t.shape)
            for i, p in enumerate(ps):
                if p.is_shard():
                    shape[p.dim] *= mesh.shape[i]
        return DistTensor(t.reshape((1,) * mesh.ndim + tuple(t.shape)), mesh, ps, shape, t.dtype)
    if not isinstance(locals_, (list, tuple)):
        raise TypeError(f"from_local(locals_={type(locals_).__name__}): give a list of "
                        f"{mesh.size} tensors, one per rank in mesh order")
    locals_ = [_as_tensor(t, f"locals_[{k}]", "from_local") for k, t in enumerate(locals_)]
    if len(locals_) != mesh.size:
        raise ValueError(f"locals has {len(locals_)} tensors for a mesh of {mesh.size} ranks; "
                         "give one local tensor per rank, in mesh order")
    nd0 = locals_[0].dim()
    if any(t.dim() != nd0 for t in locals_):
        raise ValueError(f"local tensors have different numbers of dims "
                         f"{[t.dim() for t in locals_]}; every shard has the global tensor's rank")
    if any(t.dtype != locals_[0].dtype for t in locals_):
        raise TypeError(f"local tensors have different dtypes {sorted({str(t.dtype) for t in locals_})}")
    ps = normalize_placements(placements, mesh, nd0)
    check_partial_dtype(ps, locals_[0].dtype)
    if shape is None:
        shape = list(locals_[0].shape)
        for d in range(nd0):
            axes = [i for i, p in enumerate(ps) if p.is_shard(d)]
            if axes:
                first = [r for r in mesh.ranks
                         if all(c == 0 for i, c in enumerate(mesh.coordinate(r)) if i not in axes)]
                shape[d] = sum(locals_[mesh.index(r)].shape[d] for r in first)
    shape = TensorSpec(shape, mesh, ps).shape
    for r, t in zip(mesh.ranks, locals_):
        want = layout.local_shape(shape, mesh, ps, r)
        if tuple(t.shape) != want:
            raise ValueError(f"rank {r}'s local tensor has shape {tuple(t.shape)}, but "
                             f"{[str(p) for p in ps]} of a global {tuple(shape)} gives it {want} "
                             "(torch.chunk sizes); fix the shard or pass shape=")
    lead = tuple(1 if p.is_replicate() else n for p, n in zip(ps, mesh.shape))
    cells, copies = {}, {}
    for r, t in zip(mesh.ranks, locals_):
        c = tuple(ci if n > 1 else 0 for ci, n in zip(mesh.coordinate(r), lead))
        if c in cells:
            if check_replicas and not _same_values(cells[c], t):
                axes = [mesh.dim_names[i] for i, p in enumerate(ps) if p.is_replicate()]
                raise ValueError(f"rank {r} holds a different tensor than its replica along "
                                 f"{axes} under Replicate(); use Partial() if the locals are "
                                 "parts of a sum")
            if all(t is not u for u in copies[c]):
                copies[c].append(t)
            continue
        cells[c], copies[c] = t, [t]
    from .dtensor_api import share_replicas
    cl = Cells(lead, [share_replicas(copies[c])
                      for c in itertools.product(*[range(n) for n in lead])])
    out = DistTensor(storage.settle(cl, shape, mesh, ps), mesh, ps, shape, locals_[0].dtype)
    if strides.lost_dims(out):      # the shards' order, as DTensor.from_local derives the
        strides.keep(out, strides.shard_stride(out))    # global strides from the local's
    return out


def _allow_in_checkpoints() -> None:
    """``torch.load`` (``weights_only=True``, torch's default since 2.6) loads a file
    holding DistTensors, e.g. a saved sharded ``state_dict()``, as it loads DTensors:
    torch allowlists DTensor, its mesh and placements the same way (torch 2.13,
    ``torch/distributed/tensor/__init__.py``, ``add_safe_globals``)."""
    from ..sim_mesh import grid
    from .placement import Partial, Shard
    torch.serialization.add_safe_globals([DistTensor, Mesh, Replicate, Shard, Partial,
                                          grid.Cells, grid.Stacked, grid.CellGrid])


_allow_in_checkpoints()
