"""The state dict of :class:`~.zero_optimizer_dist.ChunkedZeroOptimizer`: every rank's
chunks of the inner optimizer's states given in the module's shapes (as one device's
optimizer holds them), and loaded back into each rank's chunks."""
from __future__ import annotations

import torch

from .flat_shards import unflat
from .optim_layout import check_state_shapes
from .zero_chunk_comm import _fit, _narrow_to
from .zero_chunk_groups import _copy_hyper


class _ChunkStates:
    """The state dict (a base of ``ChunkedZeroOptimizer``)."""

    def consolidate_state_dict(self, to: int = 0) -> None:
        """torch's ``ZeroRedundancyOptimizer.consolidate_state_dict(to)``, which a user calls
        before ``state_dict()``: nothing to gather here (it raised AttributeError "no
        attribute 'group'", habits7b), as :meth:`state_dict` gives this layout's states,
        each shard's (the dict loads into the same layout)."""
        if not isinstance(to, int) or isinstance(to, bool) or not 0 <= to < self.n:
            raise ValueError(f"consolidate_state_dict(to={to!r}): give a rank index in "
                             f"[0, {self.n - 1}] of the data-parallel group")

    def state_dict(self):
        """torch's format with each parameter's states in its module shape, gathered from
        every rank's chunks (torch's ZeroRedundancyOptimizer's consolidated state dict is
        the parameters'), so it loads into a one-device optimizer, another layout, or this
        one.  It gave the flat chunks' storage, ``(dp, tp, chunk)`` (habits13b: Adam's
        ``exp_avg`` (2, 2, 5) for (6, 3)).  Under torch.distributed: this process's chunks
        (the storage), as before."""
        # the current hyperparameters (an lr scheduler sets them here; step copies them in)
        _copy_hyper(self.param_groups, self.optimizer.param_groups)
        sd = self.optimizer.state_dict()
        if self.distributed:
            return sd
        state = {}
        for i, st in sd["state"].items():
            shard = self.shards[i]
            state[i] = {k: self._module_state(i, v) if isinstance(v, torch.Tensor) and
                        k != "step" and v.shape == shard.shape else v for k, v in st.items()}
        return {**sd, "state": state}

    @torch.no_grad()
    def _module_state(self, i: int, v: torch.Tensor) -> torch.Tensor:
        """State ``v`` of shard ``i`` (every rank's chunk) as the parameter's global
        tensor: the chunks side by side as ``step`` gathers the parameters (not traced:
        a read, no step's collective), the padding dropped."""
        from ...sim_mesh.trace import suspend
        from ..dist_tensor import DistTensor
        p, nd = self.params[i], self.mesh.ndim
        with suspend():
            full = self._all_gather(self.replicas.lead(v.detach()))
        loc = _narrow_to(unflat(full, p._local.shape[nd:], nd), p._local)
        return DistTensor(loc.contiguous(), self.mesh, p.placements, p.shape, v.dtype).full()

    @torch.no_grad()
    def _chunk_state(self, i: int, v: torch.Tensor) -> torch.Tensor:
        """A module-shaped state of parameter ``i`` cut into its shard's chunks."""
        from ..dist_tensor import shard_tensor
        p = self.params[i]
        loc = shard_tensor(v.detach().to(self.shards[i].dtype), self.mesh, p.placements)._local
        return self._my_chunk(_fit(loc, p._local)).clone()

    def load_state_dict(self, state_dict) -> None:
        """:meth:`state_dict`'s (module shapes: cut into the chunks) or this layout's
        storage-shaped states (an older save); another shape is refused before anything
        changes (under torch.distributed: this layout's, as :meth:`state_dict` gives)."""
        if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict) and \
                not self.distributed:
            state = {}
            for i, st in state_dict["state"].items():
                ok = isinstance(i, int) and 0 <= i < len(self.shards) and isinstance(st, dict)
                state[i] = {k: self._chunk_state(i, v) if ok and k != "step" and
                            isinstance(v, torch.Tensor) and v.dim() > 0 and
                            tuple(v.shape) == tuple(self.params[i].shape) and
                            tuple(v.shape) != tuple(self.shards[i].shape) else v
                            for k, v in st.items()} if ok else st
            state_dict = {**state_dict, "state": state}
        check_state_shapes("ZeroRedundancyOptimizer", self.optimizer, state_dict)
        self.optimizer.load_state_dict(state_dict)
        # as torch.optim: the groups' hyperparameters too (step copies ours into the inner)
        _copy_hyper(self.optimizer.param_groups, self.param_groups)

    def shard_numel(self) -> list[int]:
        """Elements of each parameter's shard per rank (padded numel / N_d)."""
        return [s.shape[-1] for s in self.shards]
