"""What ``fully_shard`` keeps: each module's settings, and the root's sharded state.

FSDP2 (torch 2.13, ``torch/distributed/fsdp/_fully_shard/_fully_shard.py``) gives every
module ``fully_shard`` is applied to a state (its parameter group, its mixed precision,
its ``reshard_after_forward``) and finds the root, the topmost such module, at the first
forward.  Here each call builds the sharded state for its whole subtree at once, a
:class:`FullyShardRoot`: :class:`~.fsdp.FullyShardedDataParallel` with the modules
``fully_shard`` was applied to below it as its units.  A later call on an ancestor takes
the subtree over (:func:`.fully_shard.fully_shard`): it adopts the same shard objects, so a
shard stays the one ``nn.Parameter`` the module holds (an optimizer built in between
would still step it).

On top of the wrapper, per unit:

* ``reshard_after_forward=False`` (FSDP2's default for the root, ``None``): the weights
  the unit gathered for forward stay alive for its backward (FSDP2 keeps the unsharded
  parameters), so its backward gathers nothing; ``True``: they are freed after forward
  and gathered again in backward (the wrapper's ``re-gather``);
* ``set_requires_gradient_sync(False)`` (FSDP2's replacement of FSDP1's ``no_sync``): the
  unit's backward reduces nothing; each rank's unsharded gradients add up here, in the
  gather dtype (FSDP2 accumulates the unsharded gradient in ``param_dtype`` when no other
  ``reduce_dtype`` is given, else in ``reduce_dtype``, ``_fsdp_param.py``), and the next
  backward with sync reduce-scatters the sum once: the shards then hold the gradient one
  device accumulates.
"""
from __future__ import annotations

from .fsdp import FullyShardedDataParallel

__all__ = ["FSState", "FullyShardRoot"]


class FSState:
    """One module's ``fully_shard`` settings (``module._wb_fully_shard``).
    ``wrapper``: the :class:`FullyShardRoot` built on this module when it is the root of
    its subtree, else None; ``owner``: the root wrapper whose unit it is."""

    def __init__(self, module, mesh, dim, mp_policy, reshard_after_forward):
        self.name = type(module).__name__
        self.mesh, self.dim, self.mp_policy = mesh, dim, mp_policy
        self.reshard_after_forward = reshard_after_forward     # None: root False, else True
        self.requires_gradient_sync = True
        self.wrapper = None
        self.owner = None
        self.hooks = []                  # the wrapper's hooks on its units: [(dict, key, fn)]
        self.tp = None                   # over DistTensor parameters: (their mesh, dp dim)
        self.building = False
        self.top = None                  # ... the marked module above (:mod:`.fully_shard_tp`)


class FullyShardRoot(FullyShardedDataParallel):
    """The sharded state of a ``fully_shard`` root (module docstring).  Built only by
    :func:`.fully_shard.fully_shard`; the user keeps calling their own module."""

    _who = "fully_shard"
    _zero_grad_drops_held = False    # FSDP2: held gradients outlive zero_grad (fsdp_no_sync)

    def __init__(self, module, mesh, dim, compute_dtype, units, adopt: dict,
                 reduce_dtype=None):
        object.__setattr__(self, "_adopt", adopt)      # id(shard) -> its meta, reused
        super().__init__(module, mesh, dim, compute_dtype=compute_dtype, units=units,
                         reduce_dtype=reduce_dtype)

    def _shard(self, name, p):
        meta = self._adopt.get(id(p))
        if meta is not None:             # a block's shard: the same nn.Parameter, kept
            self._meta[id(p)] = meta
            return p
        return super()._shard(name, p)

    @property
    def _casts_inputs(self) -> bool:
        """The root's ``cast_forward_inputs``: False, its floating inputs reach its forward
        uncast, as FSDP2's (``_fsdp_state.py`` ``_cast_forward_inputs``)."""
        return self.module._wb_fully_shard.mp_policy.cast_forward_inputs

    @staticmethod
    def _state(unit):
        return unit.module._wb_fully_shard

    def _reshards(self, unit) -> bool:
        """``reshard_after_forward`` per unit (None: the wrapper's rule, the root kept); a
        kept unit's backward re-gathers nothing (the wrapper's ``_pack``)."""
        v = self._state(unit).reshard_after_forward
        return (unit.index != 0) if v is None else v

    # ---- set_requires_gradient_sync(False): accumulate unreduced (the wrapper's no_sync
    # machinery, :class:`.fsdp_no_sync.NoSync`), per unit ----------------------------------
    def _syncs(self, unit) -> bool:
        return self._state(unit).requires_gradient_sync

    def _held_dtype(self, grads):
        return self._to_reduce_dtype(grads)     # FSDP2 accumulates in reduce_dtype
