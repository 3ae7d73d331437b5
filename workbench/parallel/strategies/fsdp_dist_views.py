"""On simulated ranks, the module's parameters of a ZeRO-3 over DistTensors are views of
its dp shards: they read the values the optimizer wrote last.

:class:`.fsdp_dist.DistTensorFSDP` (``wb.FullyShardedDataParallel`` over a
``wb.parallelize``'d module, ``Zero3``, ``Hybrid(zero=3)``, ``fully_shard`` after tensor
parallelism) keeps each parameter's values in a flat shard ``(*mesh dims, chunk)``, dp
rank k holding chunk k of the flattened, padded local tensor of every other mesh
coordinate (:mod:`.flat_shards`).  The module's own DistTensor (``model.parameters()``,
``named_parameters()``, the template of placements and shape) kept its storage from
wrapping, so after a step it silently read the values at wrapping (0.02 off after two
steps at lr 1e-2; ``state_dict()`` and the forward, which gather the shards, were
right).  FSDP2's parameters are its sharded DTensors, stepped in place (torch 2.13,
``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``: ``sharded_param``): the value
the optimizer last wrote, whenever read.

A template can be a view of its shard when, for every coordinate of the other mesh dims,
the dp chunks lie one after the other in memory: then they are that coordinate's
flattened local tensor (plus the padding, sliced off).  :func:`dp_minor` stores the
shard so (the dp axis the last before the chunk; the shard's shape, values and the
chunk each dp rank holds stay as they were; only the strides change), and
:func:`view_template` points the template's storage at it.  With one coordinate (no tp)
the contiguous shard already is laid out so (that is why the values agreed without tp).
Nothing is gathered or copied at a step, so the trace and the memory counted do not
change.  :func:`relink` re-points a template whose storage no longer is its shard's
(an optimizer that assigns ``p.data``, a load that replaced the template's storage).
"""
from __future__ import annotations

import torch

from .. import storage
from .flat_shards import unflat

__all__ = ["dp_minor", "view_template", "relink", "is_view", "VIEW_NOTE", "GradOf",
           "wrapper_names"]

# what a .view() that the dp-minor storage cannot give says (laid_out.LaidOutParameter)
VIEW_NOTE = ("this parameter is a flat dp shard of ZeRO-3 over DistTensors, stored with "
             "each tensor-parallel coordinate's dp chunks side by side so that the module's "
             "parameter is a view of it (fsdp_dist_views): a view across its mesh axes does "
             "not exist; use .reshape (a copy), e.g. torch.cat([p.reshape(-1) for p in "
             "fsdp.parameters()]) for torch.nn.utils.parameters_to_vector")

# what a template's storage tensors carry for the habits (fsdp_dist_habits.install_habits)
_MARKS = ("_wb_stale", "_wb_clip_refuse", "_wb_grad_of", "_wb_clip_shard",
          "_wb_requires_grad_of")


def _moves(axis) -> tuple:
    """(the data-parallel axes, where they go innermost before ``c``): ``axis`` an int, or
    a tuple of adjacent axes (dp x cp: :mod:`.flat_dims`), the first slowest."""
    axes = (axis,) if isinstance(axis, int) else tuple(sorted(axis))
    return axes, tuple(range(-len(axes) - 1, -1))


def dp_minor(chunk: torch.Tensor, axis) -> torch.Tensor:
    """``chunk`` (``(*mesh dims, c)``, dp at ``axis``, or at the adjacent axes of a tuple)
    with the same shape and values, stored with the dp axis (axes) innermost before ``c``:
    each other coordinate's chunks side by side in memory."""
    src, dst = _moves(axis)
    return chunk.movedim(src, dst).contiguous().movedim(dst, src)


def is_dp_minor(t: torch.Tensor, axis) -> bool:
    """Is ``t`` stored as :func:`dp_minor` stores it?"""
    src, dst = _moves(axis)
    return t.detach().movedim(src, dst).is_contiguous()


def _view(shard: torch.Tensor, axis, local) -> torch.Tensor:
    """The template's local storage ``(*mesh dims with dp of size 1, *local)`` as a view of
    ``shard`` (raises if the shard is not stored dp-minor)."""
    nd = shard.dim() - 1
    src, dst = _moves(axis)
    with torch._C.DisableTorchFunctionSubclass():   # a plain view, as before (not
        base = shard.detach().movedim(src, dst)     # laid_out's guarded one for users)
        if not base.is_contiguous():                # (*other dims, n, c), contiguous
            raise RuntimeError("the shard is not stored dp-minor")
        flat = base.flatten(dst[0])                 # (*other dims, n * c): a view
        loc = unflat(flat, tuple(local), nd - len(src))
        for a in src:
            loc = loc.unsqueeze(a)
    if loc.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr():
        raise RuntimeError("the template would be a copy of its shard")
    return loc


@torch.no_grad()
def view_template(tmpl, shard: torch.Tensor, axis, name: str) -> None:
    """Point the DistTensor ``tmpl``'s storage at ``shard`` (stored by :func:`dp_minor`):
    the same values, shape of the local tensor and ``requires_grad``; its dp axis of size
    1 (one copy, every dp rank's)."""
    old = storage.tensors(tmpl._local)
    if len(old) != 1:
        raise NotImplementedError(f"{name}: a template held as cells (uneven shards) cannot "
                                  "view its flat dp shard")
    (t,) = old
    nd = shard.dim() - 1
    loc = _view(shard, axis, t.shape[nd:])
    loc.requires_grad_(True)            # (a hook needs it; it stays when frozen after)
    loc.register_post_accumulate_grad_hook(_refuse_grad(name))
    loc.requires_grad_(t.requires_grad)
    for k in _MARKS:
        if hasattr(t, k):
            setattr(loc, k, getattr(t, k))
    tmpl._local = loc


def _refuse_grad(name: str):
    """A gradient accumulated into a template (a loss term on ``model.parameters()``
    outside forward: the template is a leaf, its storage the shard's, its autograd not)
    would never reach the shard an optimizer steps: raise rather than drop it."""
    def hook(t):
        t.grad = None
        raise RuntimeError(
            f"a gradient reached {name} as the module holds it (ZeRO-3's template of the "
            "parameter, whose values live in the wrapper's flat shards): it would not reach "
            "the shards the optimizer steps.  Build the loss term in the forward, or on the "
            "module's attribute after a forward (module.weight: the gathered copy, whose "
            "gradient reaches the shards)")
    return hook


def is_view(tmpl, shard: torch.Tensor) -> bool:
    """Does the template's storage still live in its shard's?"""
    ts = storage.tensors(tmpl._local)
    return len(ts) == 1 and \
        ts[0].untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()


@torch.no_grad()
def relink(fsdp, i: int) -> None:
    """Entry ``i``'s template a view of its shard again, if it no longer is one (a shard
    whose ``.data`` was assigned is first stored dp-minor again, in place of its data)."""
    tmpl, shard = fsdp.entries[i][2], fsdp.entries[i][3]
    if is_view(tmpl, shard):
        return
    if not is_dp_minor(shard, fsdp.axes):
        with torch._C.DisableTorchFunctionSubclass():    # not this hook again
            shard.data = dp_minor(shard.detach(), fsdp.axes)
    view_template(tmpl, shard, fsdp.axes, fsdp.names[i])
    for mod, attr in fsdp._places[i]:   # a forward's gathered copy viewed the old storage
        if "_wb_fs_attrs" not in mod.__dict__:      # (fully_shard's attributes gather)
            mod.__dict__.pop(attr, None)


def wrapper_names(fsdp) -> tuple:
    """(what the user called, the variable a message names) for the DistTensor-mode
    wrapper ``fsdp``: ``fully_shard``'s parameters() are the model's own (FSDP2)."""
    if getattr(fsdp.module, "_wb_fully_shard", None) is not None:
        return "fully_shard", "model"
    if type(fsdp).__name__ == "Zero3":
        return "Zero3", "zero3"
    return "FullyShardedDataParallel", "fsdp"


class GradOf:
    """Entry ``i``'s gradient as the module's parameter answers it (``p.grad``, read by
    ``DistTensor.grad`` from a storage's ``_wb_grad_of``): a DistTensor of the template's
    placements whose storage views the shard's gradient, as the template views the shard
    (``torch.optim``'s ``AccumulateGrad`` gives a dense parameter's gradient its strides,
    so it is stored dp-minor too; one that is not, e.g. assigned, is stored so first).
    FSDP2's module parameters are its sharded DTensors, whose ``.grad`` is the sharded
    gradient; here it was None after every backward (the template is not the leaf
    autograd reaches), so a loop logging ``p.grad.norm()`` over ``model.named_parameters()``
    read nothing.  A write into it (``p.grad.zero_()``, ``p.grad.mul_(c)``) reaches the
    shard's gradient; ``p.grad = None`` clears it.  Under torch.distributed the shard is
    this process's chunk and the template a copy: reading it raises, naming the shards."""

    def __init__(self, fsdp, i: int):
        self.fsdp, self.i = fsdp, i

    def get(self):
        from ..dist_tensor import DistTensor
        fsdp, i = self.fsdp, self.i
        tmpl, shard = fsdp.entries[i][2], fsdp.entries[i][3]
        g = shard.grad
        if g is None:
            return None
        if not fsdp.async_:
            who, var = wrapper_names(fsdp)
            raise RuntimeError(
                f"{fsdp.names[i]}.grad read from the module under torch.distributed: "
                f"{who} keeps the gradient in its flat dp shards (this process holds 1/"
                f"{fsdp.n} of it) and the module's parameter is a copy, so it has no view "
                f"of it; read the shards' gradients, [p.grad for p in {var}.parameters()], "
                f"or clip them with torch.nn.utils.clip_grad_norm_({var}.parameters(), "
                "max_norm)")
        if not is_dp_minor(g, fsdp.axes):
            with torch.no_grad():
                g = shard.grad = dp_minor(g.detach(), fsdp.axes)
        nd = shard.dim() - 1
        loc = _view(g.detach(), fsdp.axes, storage.tensors(tmpl._local)[0].shape[nd:])
        return DistTensor(loc, fsdp.mesh, tmpl.placements, tmpl.shape, g.dtype)

    def clear(self) -> None:
        self.fsdp.entries[self.i][3].grad = None
