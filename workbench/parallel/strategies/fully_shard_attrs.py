"""``module.weight`` of a ``fully_shard``-ed model over DistTensors: the value it has now.

In FSDP2 (torch 2.13, ``_fsdp_param.py``, ``_setattr_on_modules``) the attribute a module
reads its parameter from is the sharded DTensor parameter outside forward and the
unsharded one inside: the value the optimizer last wrote, whenever it is read.  Here the
DistTensor mode (:mod:`.fully_shard_tp`) keeps the values in flat dp shards; the module's
attribute was the DistTensor left from wrapping (the template), or the copy the last
forward gathered: after ``optimizer.step()`` both are old values, read silently
(``model.layers[0].attention.wq.weight.full()``, a tied head reading the embedding's
weight, a weight-norm logged after a step).

So each module holding shards gets a class (its own name kept, as :mod:`..module_state`
does) whose parameter attributes are descriptors: inside the root's forward, the copy the
module's pre-hook gathered while the shard it came from is unchanged (its version
counter, ``tensor._version``, which every in-place write moves), so a forward (and a tied
weight read after its module ran) reads the gathered copy autograd holds; else a fresh
gather of the shard now, with autograd to the shard (a loss term built on it outside
forward, e.g. a weight penalty, gives the shard its gradient), whose in-place writes
(``nn.init`` after ``fully_shard``, torchtitan's ``init_weights``) reach the shards
before the next forward, state dict or optimizer step (:mod:`..load_back`, as a
``state_dict()`` copy's).  Under
torch.distributed that gather would be a collective one process alone cannot run, so a
read outside forward raises there, naming ``state_dict()``.

Identity (simulated ranks): outside forward the attribute is one DistTensor per parameter
(:func:`_outside_forward`), as FSDP2's is its one sharded parameter: ``m.w is m.w``, and
for a tied weight ``model.head.weight is model.emb.weight``, hold there (each read was a
new gather: False).  Its storage is a view of the dp shards with autograd to them (the
shards are stored dp-minor so that such a view exists, :mod:`.fsdp_dist_views`), so it
reads the value the optimizer wrote last whenever it is read (a reference kept across a
step too), a write into it (``nn.init.normal_(m.w)``, ``m.w.data.copy_(t)``, ``with
torch.no_grad(): m.w.mul_(2)``) is a write into the shards, at once, and a loss term on it
gives the shards its gradient.  It is rebuilt (a new object) only when the shard's storage
was replaced (``.to(dtype)``, an optimizer assigning ``.data``).  A shard laid out so that
no view exists (uneven cells) keeps the fresh gather per read (writes reach the shards
before the next forward, state dict or step, as above).  Inside a forward every place of a
tied weight reads the one copy its pre-hook gathered (FSDP2's unsharded parameter, another
object there too).  ``model.parameters()`` / ``named_parameters()`` are the flat shards
(what an optimizer steps), not these DistTensors.  Before the sharded state is built (built
lazily, at the first forward or ``parameters()``: :mod:`.fully_shard_tp`) the attribute is
the module's own DistTensor, another object than the one read after it (FSDP2 shards at
``fully_shard``; a reference taken before is its template, whose writes and gradients raise).
"""
from __future__ import annotations

import torch

from .. import storage
from ..dist_tensor import DistTensor
from .flat_shards import unflat

__all__ = ["install"]

_CLASSES: dict = {}


class _ShardedAttr:
    """A parameter attribute read from the dp shards (module docstring)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        fsdp, i = obj.__dict__["_wb_fs_attrs"][self.name]
        shard = fsdp.entries[i][3]
        live = obj.__dict__["_wb_fs_live"].get(self.name)
        # inside the root's forward, or inside a backward (an activation checkpoint's
        # recompute, whose module pre-hook gathered again: FSDP2's unsharded parameter
        # there too, in param_dtype), the gathered copy
        # (one gathered in this forward: an earlier one's may hold no autograd, no_grad)
        if live is not None and live[1] == shard._version and \
                live[2] == fsdp.__dict__.get("_wb_forward_id", 0) and \
                (fsdp.__dict__.get("_wb_in_forward") or
                 torch._C._current_graph_task_id() != -1):
            return live[0]
        v = _outside_forward(fsdp, i)
        if v is not None:
            return v
        if not fsdp.async_:
            raise RuntimeError(
                f"{type(obj).__name__}.{self.name} read outside forward under "
                "torch.distributed: its value lives in the dp shards, and gathering it here "
                "would be a collective every process must join; read model.state_dict() "
                "(every process) or the shards in model.parameters()")
        from ..load_back import mark
        from .fsdp_dist_habits import _cut
        from .fsdp_dist_views import GradOf
        g = fsdp._gather(fsdp.entries[i][2], shard)
        # its own storage (the gather may be a view of the shard's, which a step moves)
        value = type(g)(g._local.clone(), g.mesh, g.placements, g.shape, g.dtype)
        # value.requires_grad_(False) freezes the parameter and its shard (the clone lost
        # the gather's hook, and the shard went on training: test_review_revP)
        value._local._wb_on_requires_grad = fsdp.entries[i][2].requires_grad_
        if getattr(g._local, "_wb_clip_refuse", None):  # no gradient: clip the shards
            value._local._wb_clip_refuse = g._local._wb_clip_refuse
            if getattr(g._local, "_wb_clip_shard", None) is not None:
                value._local._wb_clip_shard = g._local._wb_clip_shard
        # value.grad: the shard's gradient (FSDP2's module.weight is the sharded parameter,
        # with its gradient), a view of it in the parameter's layout; it was None
        value._local._wb_grad_of = GradOf(fsdp, i)
        # a write into it (nn.init after fully_shard, p.mul_(2)) reaches the shards before
        # the next forward, state dict or optimizer step, as a state_dict() copy's
        return mark(value, lambda v, fsdp=fsdp, i=i: _cut(fsdp, i, v), source=shard)

    def __set__(self, obj, value):
        # the wrapper's pre-forward gather (``object.__setattr__``) lands here
        fsdp, i = obj.__dict__["_wb_fs_attrs"][self.name]
        obj.__dict__["_wb_fs_live"][self.name] = (value, fsdp.entries[i][3]._version,
                                                   fsdp.__dict__.get("_wb_forward_id", 0))

    def __delete__(self, obj):
        obj.__dict__["_wb_fs_live"].pop(self.name, None)


def _outside_forward(fsdp, i: int):
    """Entry ``i``'s one DistTensor outside forward (module docstring): its storage a view
    of the shard, differentiable to it; None where the shard has no such view (uneven
    cells, torch.distributed: one process holds 1/N of it)."""
    from .fsdp_dist import _refuse_clip_as
    from .fsdp_dist_views import GradOf, is_view
    tmpl, shard = fsdp.entries[i][2], fsdp.entries[i][3]
    if not fsdp.async_ or not is_view(tmpl, shard):
        return None
    values = fsdp.__dict__.setdefault("_wb_fs_values", {})
    v = values.get(i)
    if v is not None and _views(v._local, shard):
        return v
    local = tuple(storage.tensors(tmpl._local)[0].shape[fsdp.mesh.ndim:])
    with torch.enable_grad():           # (read under no_grad too: autograd to the shard)
        loc = _grad_view(shard, fsdp.axis, local)
    if loc is None:
        return None
    loc._wb_on_requires_grad = tmpl.requires_grad_      # v.requires_grad_(False): frozen
    loc._wb_grad_of = GradOf(fsdp, i)                   # v.grad: the shard's, laid out
    _refuse_clip_as(loc, tmpl)
    if v is None or v.dtype != loc.dtype:
        v = values[i] = DistTensor(loc, tmpl.mesh, tmpl.placements, tmpl.shape, loc.dtype)
    else:
        v._local = loc                  # the shard's storage was replaced: the same object
    return v


def _grad_view(shard, axis: int, local):
    """The template's local tensor ``(*mesh dims with dp of size 1, *local)`` as a view of
    ``shard`` with autograd to it (:func:`.fsdp_dist_views._view`, not detached)."""
    nd = shard.dim() - 1
    with torch._C.DisableTorchFunctionSubclass():   # a plain view (not laid_out's guarded
        base = shard.movedim(axis, -2)              # one): the module's value, as before
        if not base.is_contiguous():                # (*other dims, n, c)
            return None
        loc = unflat(base.flatten(-2), tuple(local), nd - 1).unsqueeze(axis)
    if loc.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr():
        return None
    return loc


def _views(loc, shard) -> bool:
    """``loc`` (a value's storage) is still a view of ``shard`` as it is now."""
    return loc._base is not None and \
        loc.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr() and \
        loc.dtype == shard.dtype and loc.requires_grad == shard.requires_grad


def install(fsdp) -> None:
    """The descriptors on every module ``fsdp`` (the sharded state of a ``fully_shard``
    root over DistTensors) holds shards of; the copy a forward already gathered kept."""
    for m in fsdp.module.modules():
        items = fsdp._by_mod.get(id(m))
        if not items:
            continue
        attrs = tuple(sorted({a for a, _ in items}))
        d = m.__dict__
        d["_wb_fs_attrs"] = {a: (fsdp, i) for a, i in items}
        d["_wb_fs_live"] = {}
        for a in attrs:
            d.pop(a, None)                 # a copy gathered before: the descriptor's now
        key = (type(m), attrs)
        if key not in _CLASSES:
            cls = type(m)
            _CLASSES[key] = type(cls.__name__, (cls,),
                                 {"__module__": cls.__module__,
                                  **{a: _ShardedAttr(a) for a in attrs}})
        m.__class__ = _CLASSES[key]
