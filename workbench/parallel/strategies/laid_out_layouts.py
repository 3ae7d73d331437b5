"""How a wrapper lays a parameter out, and how the module's tensor comes out of that
storage and goes back in: DDP's rows (:class:`Rows`), FSDP's flat padded chunks on
simulated ranks (:class:`Chunks`) and on torch.distributed (:class:`ProcessChunks`)."""
from __future__ import annotations

import torch

from .flat_shards import flat_padded, unflat


class Rows:
    """DDP's layout on N simulated ranks: ``(N, *shape)``, one copy per rank; the
    module's tensor is rank ``src``'s row."""

    def __init__(self, n: int, src: int):
        self.n, self.src = n, src

    def full(self, t):
        return t[self.src]

    def store(self, v):
        return v.unsqueeze(0).expand((self.n,) + tuple(v.shape))


class Chunks:
    """FSDP's layout on N simulated ranks: ``(N, chunk)``, the flattened tensor padded
    and cut in N chunks (:mod:`.flat_shards`)."""

    def __init__(self, n: int, shape):
        self.n, self.shape = n, tuple(shape)

    def full(self, t):
        return unflat(t.reshape(-1), self.shape)

    def store(self, v):
        return flat_padded(v, self.n).view(self.n, -1)


class ProcessChunks:
    """FSDP's layout on torch.distributed: this process's ``(chunk,)`` of the flattened
    padded tensor (``group``: the wrapper's :class:`~.ranks.RankGroup`).  The module's
    tensor is every process's chunk all-gathered, a collective: every process of the
    group asks for it in the same order, as for FSDP's own ``state_dict()`` (an
    optimizer's ``state_dict()`` over the shards gives one device's states on every
    process, so ``wb.checkpoint.save`` writes the whole of each, not rank 0's chunk)."""

    def __init__(self, group, shape):
        self.group, self.shape = group, tuple(shape)

    def full(self, t):
        from ...sim_mesh.agreed_reads import agree
        from .fsdp_units import all_gather
        # each process of the group makes the same read, or the reader gets an error
        # naming the fix (a read on one process hung: fixlist16)
        g = self.group
        agree(list(g.ranks),
              f"a sharded parameter (or its gradient or state) of shape {self.shape}")
        return unflat(all_gather([t.detach().reshape(-1)], self.group)[0], self.shape)

    def store(self, v):
        return flat_padded(v, self.group.n).view(self.group.n, -1)[self.group.k]

    @torch.no_grad()
    def same_draw(self, fresh) -> None:
        """``nn.init.normal_``'s draw, rank 0's on every process (their generators may
        differ), so the chunks are cut from one device's draw."""
        import torch.distributed as dist
        dist.broadcast(fresh, src=self.group.global_rank(0), group=self.group.pg)
