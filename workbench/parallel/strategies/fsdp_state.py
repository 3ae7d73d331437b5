"""``FullyShardedDataParallel``'s state dicts, as FSDP2 gives them.

* :meth:`~FSDPStateDict.state_dict`: the module's own names (FSDP2 shards the module
  in place, so no prefix); each parameter a DistTensor of its own shape placed
  ``Shard(0)`` on the data-parallel dim (FSDP2's ``state_dict()`` returns DTensors
  ``Shard(0)``: torch 2.13, ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``);
  ``.full()`` gathers one.  A parameter whose first dim the N ranks do not divide
  (or a 0-d one) is ``Replicate`` instead (uneven shards are not supported on
  torch.distributed yet; simulated ranks do the same, so both give one layout).
  Our shards are chunks of the flattened tensor (FSDP1's
  ``FlatParameter`` layout, :mod:`.flat_shards`), so making the dim-0 shards costs one
  all-gather per parameter; buffers are plain tensors, as in FSDP2.
* :meth:`~FSDPStateDict.load_state_dict`: that dict, or full tensors (a plain model's
  ``state_dict()``): keys and shapes checked first as torch does with ``strict``, then
  each rank's chunk copied into its shard in place (the optimizer keeps its leaves).
* :meth:`~FSDPStateDict.full_state_dict`: plain full tensors (FSDP1's
  ``FULL_STATE_DICT``).
"""
from __future__ import annotations

import torch
from torch import nn

from ...sim_mesh import backends as _B
from ..dist_tensor import DistTensor, shard_tensor
from ..load_back import flush, mark
from ..placement import Replicate, Shard
from .flat_shards import flat_padded, unflat
from .fsdp_units import all_gather
from .laid_out import module_shaped
from .ranks import set_extra_states, state_dict_check

__all__ = ["FSDPStateDict"]


class FSDPStateDict:
    """Mixed into FullyShardedDataParallel (``self.group``, ``self._meta``)."""

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """{the module's own name: the full fp32 tensor} (parameters gathered)."""
        flush()                     # a write into an earlier state_dict()'s copies
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            out[name] = self._full(t).clone() if id(t) in self._meta else \
                t.detach().clone() if isinstance(t, torch.Tensor) else t    # extra state
        return out

    def _full(self, shard):
        g = self.group
        shape, _ = self._meta[id(shard)]
        flat = all_gather([shard.detach()], g)[0] if g.distributed else shard.detach().reshape(-1)
        return unflat(flat, shape)

    def _dist_mesh(self):
        """The mesh the DistTensors of ``state_dict()`` live on (mesh=None: a 1-d mesh
        over the default group named "world", made once; every rank makes it, in the
        same order; registering it makes every equal Mesh distributed in this process,
        hence a name a simulated mesh is unlikely to have)."""
        g = self.group
        if g.mesh is not None:
            return g.mesh, g.axis
        if getattr(self, "_sd_mesh", None) is None:
            object.__setattr__(self, "_sd_mesh", _B.mesh(g.n, ["world"]))
        return self._sd_mesh, 0

    @torch.no_grad()
    def state_dict(self, destination=None, prefix="", keep_vars=False):
        """{the module's own name: a DistTensor ``Shard(0)`` on the data-parallel dim}
        for the parameters, plain tensors for the buffers (FSDP2's sharded state dict).
        The DistTensors are copies; a write into one reaches the shards before the next
        forward, step or state dict (:func:`..load_back.flush`), or raises there when the
        shards changed since it was taken.  ``keep_vars=True`` gives the parameters
        themselves (the objects ``parameters()`` gives, as FSDP2's: its sharded
        parameters), not copies a write would miss."""
        flush()                     # a write into an earlier state_dict()'s copies
        out = {} if destination is None else destination
        cfg = getattr(self, "_wb_full_sd", None)
        if cfg is not None:         # inside state_dict_type(FULL_STATE_DICT) (.fsdp_summon)
            return self._full_state_dict_as(cfg, out, prefix)
        mesh, ax = self._dist_mesh()
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) not in self._meta:     # a buffer, or a module's extra state (as it is)
                out[prefix + name] = t if keep_vars or not isinstance(
                    t, torch.Tensor) else t.detach()
                continue
            if keep_vars:
                # torch FSDP2 (2.13 torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
                # :909-930, a state-dict pre-hook _to_sharded() puts each FSDPParam's
                # sharded_param, _fsdp_param.py:325-333, back on the module; then
                # nn.Module._save_to_state_dict keeps the parameter itself): the very
                # objects parameters() gives, so here the shard parameter itself (its
                # storage's shape; a write into it is a write into the parameter)
                out[prefix + name] = t
                continue
            full = self._full(t)
            ps = [Replicate()] * mesh.ndim
            if full.dim() > 0 and full.shape[0] % self.group.n == 0:
                ps[ax] = Shard(0)       # else Replicate (see the module's docstring)
            # every rank holds the full tensor here: no broadcast (src_data_rank=None)
            dt = shard_tensor(full.clone(), mesh, ps, src_data_rank=None)
            # a copy (FSDP2's are the shards): a load in place cuts it into the shards
            out[prefix + name] = mark(dt, lambda v, t=t: self._store(t, v), source=t)
        if destination is None:         # DCP reads it too (..dcp_interop)
            from ..dcp_interop import as_stateful
            return as_stateful(out)
        return out

    def _full_state_dict_as(self, cfg, out, prefix) -> dict:
        """FSDP1's FULL_STATE_DICT under ``cfg`` (a ``FullStateDictConfig``): full tensors,
        on CPU with ``offload_to_cpu``, and none on ranks but 0 with ``rank0_only``."""
        full = self.full_state_dict()           # every process: the gathers
        if cfg.rank0_only and self.group.distributed and _B.rank() != 0:
            return out
        for name, v in full.items():
            out[prefix + name] = v.cpu() if cfg.offload_to_cpu and \
                isinstance(v, torch.Tensor) else v
        return out

    def _store(self, t, v) -> None:
        """The full value ``v`` (a tensor or DistTensor) cut into the shard ``t``."""
        g = self.group
        if isinstance(v, DistTensor):
            v = v.full()
        rows = flat_padded(torch.as_tensor(v).detach().to(t.dtype), g.n).view(g.n, -1)
        t.copy_(rows[g.k] if g.distributed else rows)

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load :meth:`state_dict`'s DistTensors or full tensors (the module's own names)
        into the shards in place; checked first (``strict`` as torch)."""
        if assign:
            raise NotImplementedError("FullyShardedDataParallel.load_state_dict(assign=True):"
                                      " the parameters are the shards; load with assign=False"
                                      " (copies each rank's chunk into them)")
        flush(release=False)        # a write into a state_dict() copy lands first, as torch's
        # a keep_vars=True dict (the parameters themselves, the chunks): their module-shaped
        # values, as torch loads its keep_vars dict
        state_dict = {k: module_shaped(v) for k, v in state_dict.items()}
        mine = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            mine[name] = torch.empty(self._meta[id(t)][0], device="meta") \
                if id(t) in self._meta else t
        missing, unexpected = state_dict_check("FullyShardedDataParallel", mine, state_dict,
                                               strict)
        extra = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if name not in state_dict:
                continue
            v = state_dict[name]
            if not isinstance(t, torch.Tensor):     # set_extra_state's, as torch's
                extra[name] = v
                continue
            if isinstance(v, DistTensor):
                v = v.full()
            v = torch.as_tensor(v).detach()
            if id(t) not in self._meta:
                t.copy_(v.clone())
                continue
            self._store(t, v)
        set_extra_states(self.module, extra)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

