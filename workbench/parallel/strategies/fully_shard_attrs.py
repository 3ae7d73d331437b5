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

Identity: outside forward each read is a new gather, so ``model.head.weight is
model.head.weight`` (and, for a tied weight, ``model.head.weight is model.emb.weight``)
is False there, where FSDP2's attribute is the one sharded parameter (True); inside a
forward every place of a tied weight reads the one copy its pre-hook gathered.  Values
and gradients are one device's either way; code that tells parameters apart by identity
should use ``model.parameters()`` / ``named_parameters()`` (the shards: a tied weight
once), as torch's optimizers do.
"""
from __future__ import annotations

import torch

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
