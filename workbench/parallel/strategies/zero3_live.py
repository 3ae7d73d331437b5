"""ZeRO-3's working copies: the gathered parameters one rank holds, over the modeled clock.

ZeRO-3 keeps only a shard of each parameter; a module's whole parameters exist from the
moment their all-gather is issued (the receive buffer is allocated then) until ZeRO frees
them: after the module's forward, and after its backward (DeepSpeed's
``PartitionedParameterCoordinator.release_sub_module``).  With prefetch, the modules
gathered ahead hold their copies too, up to ``stage3_prefetch_bucket_size`` elements
beyond the module computing; a backward prefetch issued at the end of the forward
(:mod:`.zero3`) holds them from then on.

:class:`GatheredLedger` counts those bytes per rank (every rank of the group holds the
same): ``hold(key, nbytes)`` when a gather is issued, ``free(key)`` when the copy is
released; it keeps the current bytes, the peak and the timeline ``[(seconds on the
modeled clock, bytes)]`` at each change, on the compute clock of one rank of the group.
"""
from __future__ import annotations

__all__ = ["GatheredLedger"]


class GatheredLedger:
    """Bytes of gathered parameters live on one rank (module docstring)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.live: dict = {}                 # key -> bytes
        self.bytes = 0
        self.peak = 0
        self.timeline: list[tuple[float, int]] = []

    def _now(self) -> float:
        from ...sim_mesh.trace import current_trace
        tr = current_trace()
        return tr.now(self.rank) if tr is not None else 0.0

    def hold(self, key, nbytes: int) -> None:
        if key in self.live:
            return
        self.live[key] = nbytes
        self.bytes += nbytes
        self.peak = max(self.peak, self.bytes)
        self.timeline.append((self._now(), self.bytes))

    def free(self, key) -> None:
        nbytes = self.live.pop(key, None)
        if nbytes is None:
            return
        self.bytes -= nbytes
        self.timeline.append((self._now(), self.bytes))

    def free_all(self) -> None:
        for key in list(self.live):
            self.free(key)

    def reset(self) -> None:
        """Forget the peak and the timeline (the copies still live stay counted)."""
        self.peak = self.bytes
        self.timeline = [(self._now(), self.bytes)]
