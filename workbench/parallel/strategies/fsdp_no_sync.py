"""``FullyShardedDataParallel.no_sync()``: FSDP1's gradient accumulation without
communication, and the machinery ``fully_shard``'s ``set_requires_gradient_sync(False)``
shares (:class:`~.fully_shard_state.FullyShardRoot`: per unit, held in ``reduce_dtype``).

FSDP1 (torch 2.13 ``torch/distributed/fsdp/fully_sharded_data_parallel.py`` ``no_sync``;
``_runtime_utils.py`` ``_post_backward_hook``: with ``_sync_gradients`` False the
unsharded gradient stays in the flat parameter's ``.grad`` and nothing is
reduce-scattered): inside the block each rank's backward keeps its unsharded gradients,
summed over the block's backwards in the dtype they arrive in (the compute dtype, as
FSDP1's unsharded ``.grad`` in ``param_dtype``), and communicates nothing; the first
backward outside it adds them to its own and reduce-scatters the sum once, so the shards
then hold one device's accumulated gradient.  Memory: the unsharded gradients are kept
meanwhile (FSDP1's note: "higher memory usage because FSDP will accumulate the full model
gradients (instead of gradient shards)"), counted by :meth:`NoSync.unsynced_bytes`.
A unit that runs inside the block but not in the synced backward keeps its held
gradients until a later synced backward of it.

``zero_grad`` drops them, as FSDP1's drops its unsharded ``.grad`` (``model.zero_grad()``
clears the flat parameter's; ``optimizer.zero_grad()`` the original parameters' views of
it, and ``_reset_flat_param_grad_info_if_needed``, torch 2.13 ``_flat_param.py:2448-2475``,
then frees the flat one) and as one device drops what it accumulated: each trainable shard
whose unit holds gradients shows a gradient meanwhile (a zero one where it had none), and
the next forward drops the held gradients of a shard whose gradient was cleared or
written since (``optimizer.zero_grad()``, ``set_to_none=False`` too).  Before, they were
added to the next synced backward's, silently.  ``fully_shard``'s
``set_requires_gradient_sync(False)`` keeps FSDP2's semantics instead: the shards' ``.grad``
stays None meanwhile and the held gradients outlive a ``zero_grad`` (FSDP2 keeps them on
its unsharded parameters, which no ``zero_grad`` reaches, and reduces them in the next
synced backward: torch 2.13 ``_fsdp_param_group.py:620-632``).
"""
from __future__ import annotations

import contextlib

import torch

from .laid_out_hooks import refuse_held_hooks

__all__ = ["NoSync", "HELD_READ"]

HELD_READ = ("p.grad of FullyShardedDataParallel inside no_sync() (or after it, before the "
             "next backward outside it): each rank holds its own unreduced gradient sum "
             "(FSDP1 keeps it unsharded) and the shard's p.grad is not the gradient yet (a "
             "zero, or the last reduced step's); read p.grad after a backward outside "
             "no_sync(), which reduces what the block held, or zero_grad() to drop it")


class NoSync:
    """A mixin of :class:`~.fsdp.FullyShardedDataParallel`, reading what its constructor
    sets (``_sync_enabled``, ``_unsynced``: (unit index, rank) -> [held gradient]) and
    calling its ``_reduce_scatter_now`` (the unit's reduction) and ``_to_reduce_dtype``."""

    @contextlib.contextmanager
    def no_sync(self):
        """FSDP1's ``no_sync`` (module docstring): inside the block no backward
        communicates; each rank's unsharded gradients are held and the first backward
        after it reduce-scatters their sum onto the shards."""
        refuse_held_hooks(self.module.parameters(), "FullyShardedDataParallel.no_sync()")
        old, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = old

    def _syncs(self, unit) -> bool:
        """Does ``unit``'s backward reduce-scatter now (False: hold the gradients)?"""
        return self._sync_enabled

    def _held_dtype(self, grads):
        """The held gradients' dtype: as they arrive (FSDP1's unsharded ``.grad``)."""
        return grads

    def _reduce_scatter(self, call, k, grads, needs):
        """Rank k's part of the unit's gradient reduction, or (not syncing) held."""
        key = (call.unit.index, k)
        if not self._syncs(call.unit):   # nothing sent: rank k's unsharded gradients held
            call.cache.pop(k, None)
            call.done.add(k)
            held = self._unsynced.setdefault(key, [None] * len(grads))
            for i, (gr, need) in enumerate(zip(self._held_dtype(grads), needs)):
                if need and gr is not None:
                    held[i] = gr.detach().clone() if held[i] is None else held[i] + gr
                    self._mark_held(call.unit, i)
            return (None,) * len(grads)
        held = self._unsynced.pop(key, None)
        if held is not None:             # the synced backward: its gradients plus the held
            grads = tuple(h if gr is None else gr if h is None else gr + h
                          for gr, h in zip(grads, held))
            self._synced(call.unit)
        return self._reduce_scatter_now(call, k, grads, needs)

    _zero_grad_drops_held = True     # FSDP1's; fully_shard (FSDP2): False

    def _mark_held(self, unit, i) -> None:
        """Shard ``i`` of ``unit`` has held gradients: it shows a gradient (a zero one
        where it had none), whose identity and version the next forward compares."""
        if not self._zero_grad_drops_held:
            return
        shard = unit.params[i][1]
        marks = self.__dict__.setdefault("_held_marks", {})
        if id(shard) in marks and shard.grad is marks[id(shard)][3]:
            return
        if shard.grad is None:
            shard.grad = self._zero_shard_grad(shard)
        # its values are not the gradient now (a zero, or the last synced step's without
        # what the block holds): reads of them raise, was a silent 0.0 norm (habits10)
        shard.grad._wb_held = (HELD_READ, shard.grad._version)
        marks[id(shard)] = (unit.index, i, shard, shard.grad, shard.grad._version)

    def _zero_shard_grad(self, shard):
        from .rank_grads import as_chunk_rows, as_shard_grad
        z = torch.zeros_like(shard)
        if self.group.distributed:
            return as_shard_grad(z, self.group.pg, param=shard)
        return as_chunk_rows(z, self._meta[id(shard)][1], self._meta[id(shard)][0])

    def _drop_cleared(self) -> None:
        """At a forward: the held gradients of each shard whose gradient was cleared or
        written since they were held (a ``zero_grad``) are dropped, as one device's."""
        marks = self.__dict__.get("_held_marks")
        if not marks:
            return
        for sid, (u, i, shard, g, version) in list(marks.items()):
            if shard.grad is g and g._version == version:
                continue
            del marks[sid]
            g.__dict__.pop("_wb_held", None)      # zeroed or replaced: one device's again
            for (ui, _), held in self._unsynced.items():
                if ui == u:
                    held[i] = None

    def _synced(self, unit) -> None:
        """``unit``'s held gradients went into a reduction: its marks go."""
        marks = self.__dict__.get("_held_marks")
        for sid in [sid for sid, m in (marks or {}).items() if m[0] == unit.index]:
            marks[sid][3].__dict__.pop("_wb_held", None)
            del marks[sid]

    def unsynced_bytes(self) -> int:
        """Bytes of unsharded gradients held for the next synced backward (all ranks)."""
        return sum(g.numel() * g.element_size() for v in self._unsynced.values()
                   for g in v if g is not None)
