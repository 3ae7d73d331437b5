"""DDP's DistTensor mode (:class:`~.ddp_dist.DistTensorDDP`): the replicas an optimizer
steps, as one device's parameters (simulated ranks).

``ddp.parameters()`` are the replicas' storage, each a tensor led by the mesh's dims
(``(dp, tp, *local)``: ``(2, 1, 10, 8)`` for a ``(10, 8)`` weight replicated over tp on
a 2 x 2 mesh).  Two habits of one device would read that storage as the parameter:

* a ``torch.optim`` optimizer's ``state_dict()`` gave its states in the storage's shape,
  which neither a plain optimizer nor another layout takes (AdamW's next step fails on
  the shapes); each replica now says how its storage and the parameter's global tensor
  map (``_wb_shape`` / ``_wb_full`` / ``_wb_store``, read by
  :func:`.laid_out._module_shaped_states` and :func:`.laid_out._lay_out_loaded_states`),
  so the states come in one device's shapes and go back, as over FSDP's shards.  Under
  torch.distributed too (each process's replica ``(1, 1, *local)``: its tensor-parallel
  shard; the global tensor gathered over tp, a collective every process of the mesh
  joins as it takes the same ``state_dict()``): a checkpoint saved under torchrun loads
  into a plain optimizer, another layout or the simulated ranks, and back;
* an in-place write of ``ddp.parameters()`` that is not the same on every replica (a
  random ``nn.init`` draws each rank's copy on its own; a fan-in init reads the storage's
  shape) left the replicas different, and the ranks then trained N different models
  with no error.  :func:`check_written_replicas` (before each forward) compares the
  replicas of every parameter written since it last looked, and raises naming it; an
  optimizer step (every replica the same update from the summed gradient) is taken as
  seen by a step post-hook, so a training loop pays nothing (a step pre-hook checks a
  write made since the last look first).  Writes through the
  module's DistTensor parameters (``nn.init.normal_(model.fc.weight)``: one device's draw,
  laid out) and ``ddp.load_state_dict`` keep the replicas equal.

``model.<name>.requires_grad_(flag)`` (the module's DistTensor parameter) sets the flag
on its replica in place, as torch sets a parameter's (it made a new leaf, which no
optimizer held: a parameter frozen then unfrozen stopped training with no error); one
frozen when the wrapper was built is refused unfreezing, as ``ddp.requires_grad_``.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)
from torch.utils.weak import WeakIdKeyDictionary

from ..dist_tensor import DistTensor, shard_tensor
from .laid_out_replicas import as_replica_storage

__all__ = ["install", "check_written_replicas", "replicas_equal"]

_SEEN = WeakIdKeyDictionary()       # a replica storage -> its version when last found equal


class _Replicas:
    """A parameter's replica storage and its global tensor, both ways."""

    def __init__(self, p: DistTensor, name: str = "a parameter"):
        self.mesh, self.placements, self.shape = p.mesh, p.placements, tuple(p.shape)
        self.name = name

    @torch.no_grad()
    def full(self, t, of: str = ""):
        """The global tensor of the storage ``t`` (``of``: "the gradient of " for the
        gradient's, named in the error of a read not every process makes)."""
        from ...sim_mesh.trace import suspend
        from ...sim_mesh import backends as _B
        if _B.is_distributed(self.mesh):
            # a collective over the processes holding the other shards: each makes the
            # same read, or the reader gets an error naming the fix (it hung: fixlist16)
            from ...sim_mesh.agreed_reads import agree
            agree(_gather_ranks(self.mesh, self.placements),
                  f"{of}DistributedDataParallel's {self.name!r} "
                  f"{tuple(self.shape)} over tensor-parallel DistTensors")
        with suspend():                 # not the step's traffic
            return DistTensor(t.detach(), self.mesh, self.placements, self.shape,
                              t.dtype).full()

    @torch.no_grad()
    def store(self, v, like):
        loc = shard_tensor(v.detach().to(like.dtype), self.mesh, self.placements)._local
        return loc.expand(like.shape)


def _gather_ranks(mesh, placements) -> list:
    """The processes a gather of a tensor laid out by ``placements`` joins with this one:
    those differing from it only along the dims it is not replicated on."""
    from ...sim_mesh import backends as _B
    mine = _B.coordinate(mesh)
    keep = [i for i, pl in enumerate(placements) if pl.is_replicate()]
    return [r for r in mesh.ranks
            if all(mesh.coordinate(r)[i] == mine[i] for i in keep)]


def install(ddp) -> None:
    """The replicas of ``ddp`` (a :class:`~.ddp_dist.DistTensorDDP` on simulated ranks)
    as one device's parameters (module docstring)."""
    for name, p in zip(ddp._names, ddp.replicas.params):
        # model.<name>.requires_grad_(flag): on the replica itself, the leaf the optimizer
        # and the gradient hooks hold (a new leaf left the old one stepped by nothing: a
        # parameter frozen then unfrozen silently stopped training)
        p._local._wb_keep_leaf = True
        p._local._wb_on_requires_grad = _refuse_late_unfreeze(ddp, p, name)
    for name, p in zip(ddp._names, ddp.replicas.params):
        loc, how = p._local, _Replicas(p, name)
        loc._wb_shape, loc._wb_full = how.shape, how.full
        loc._wb_store = lambda v, loc=loc, how=how: how.store(v, loc)
        loc._wb_distributed = ddp.replicas.distributed     # (a view's error says so)
        if not ddp.replicas.distributed:    # (one replica per process: none to tell apart)
            loc._wb_replicas = (name, ddp.replicas.axes)
            _SEEN[loc] = loc._version
        # a user's numel / dim / norm: the module's (habits13); under torch.distributed too,
        # gathered over tp (habits15: this process's shard's, numel 9 for 18, silently)
        as_replica_storage(loc)


def _refuse_late_unfreeze(ddp, p, name):
    def hook(flag: bool) -> None:
        if flag and id(p) not in ddp.replicas.hooked:
            raise ValueError(f"{name}.requires_grad_(True): it was frozen when "
                             "DistributedDataParallel was built, so its gradients would not "
                             "be summed over the data-parallel ranks; set requires_grad "
                             "before wrapping the module")
    return hook


def replicas_equal(loc, axes) -> bool:
    """Every replica along ``axes`` equals the first; NaN equals NaN (a diverged run's
    replicas are equal NaNs: torch's DDP trains on, so must this, with no error)."""
    for ax in axes:
        ref = loc.narrow(ax, 0, 1)
        if not bool(((loc == ref) | (loc.isnan() & ref.isnan())).all()):
            return False
    return True


@torch.no_grad()
def _check(loc) -> None:
    """``loc`` (a replica storage), written since last seen: its replicas equal, or raise."""
    if _SEEN.get(loc, loc._version) == loc._version:
        return
    name, axes = loc._wb_replicas
    if not replicas_equal(loc, axes):
        raise RuntimeError(
            f"DistributedDataParallel: the replicas of {name!r} differ between the "
            "data-parallel ranks since they were last equal: ddp.parameters() are the "
            f"replicas' storage (shape {tuple(loc.shape)}, not the parameter's "
            f"{loc._wb_shape}), so a random nn.init of them draws each rank's copy on its "
            "own (a fan-in init reads that shape).  Initialize the module before wrapping "
            "it, write through its DistTensor parameters (nn.init.normal_(model.<name>."
            "weight): one device's draw), or load values with ddp.load_state_dict")
    _SEEN[loc] = loc._version


def check_written_replicas(ddp) -> None:
    """Before a forward: every parameter written since last seen (module docstring)."""
    if not ddp.replicas.distributed:
        for p in ddp.replicas.params:
            _check(p._local)


def _step_pre_hook(optimizer, args, kwargs) -> None:
    """Before a step: a write since last seen is checked first (the step's own writes
    are then taken as seen)."""
    for group in optimizer.param_groups:
        for t in group["params"]:
            if t in _SEEN:
                _check(t)


def _step_post_hook(optimizer, args, kwargs) -> None:
    """A step keeps equal replicas equal: its writes are taken as seen."""
    for group in optimizer.param_groups:
        for t in group["params"]:
            if t in _SEEN:
                _SEEN[t] = t._version


register_optimizer_step_pre_hook(_step_pre_hook)
register_optimizer_step_post_hook(_step_post_hook)
