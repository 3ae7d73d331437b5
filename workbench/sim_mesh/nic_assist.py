"""Tensor-parallel collectives that also use the node's idle RDMA NICs (opt-in).

Tensor parallelism lives inside a node: its all-reduces, all-gathers and
reduce-scatters run over NVLink / HCCS, while the node's NICs (one per device on a DGX
A100 / H100 or an Atlas 800T A2) carry nothing during them, unless data parallelism's
gradient traffic happens to overlap.  The CANN article the course follows (issue 18:
"tensor-parallel traffic using idle RDMA NICs") proposes sending part of the TP
collective's bytes through the NICs: the devices of a node reach each other over RoCE
through the leaf switch too (HCCL can run intra-server traffic over RoCE:
``HCCL_INTRA_ROCE_ENABLE``, CANN HCCL environment variable reference, hcclenvref_07_0007;
there it replaces the intra-server link, here it runs beside it).

The model (an opt-in price; ``cost.price`` and the clock's "auto" are unchanged):

- the buffer is split in two, a share s of its bytes on the NICs and 1 - s on the fast
  link, each part a collective of the same kind over the same k ranks, both at once;
- the fast part is priced by the clock as the library runs it
  (``cost.price(kind, (1 - s) n, ranks, profile)``), the NIC part as a ring over the k
  ranks on their NICs (``cost.collective_time`` on a link of each rank's NIC rate as the
  clock prices a ring crossing nodes, ``topology.nic_rate``: its share of the node's
  NICs at their effective rate, at most ``Topology.ring_nics`` adapters shared by the k
  where the profile says the library routes its rings through fewer, and the
  inter-node latency);
- the collective ends when the slower part does: max of the two;
- s defaults to the bandwidth-proportional split s = B_nic / (B_nic + B_intra) (the
  per-rank effective rates: the NIC's, and the fast link's), the split at which the two
  parts' bandwidth terms finish together, as a multi-rail transfer stripes bytes across
  rails in proportion to their rates.  It is an ASSUMPTION that the NICs reach their
  inter-node efficiency between devices of one node and that nothing else uses them.

With the profiles' rates that is about 9 % of the bytes on an A100 node (24 of 259 GB/s),
11 % on H100 and on the 910B: the bandwidth term shrinks by 1 - s, latency is unchanged,
so large TP collectives gain up to ~10 % and small ones nothing (the NIC ring's
latency then dominates: ``NicAssist.seconds`` may exceed ``baseline``; the planner
should keep the default there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import cost as _cost
from . import topology as _topo
from .profiles import Link, get_profile

__all__ = ["NicAssist", "nic_assisted", "nic_share"]

_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class NicAssist:
    """One TP collective with a share of its bytes on the node's NICs (module docstring)."""
    kind: str
    nbytes: float
    p: int
    profile: str
    intra_rate: float          # bytes/s per rank on the fast link (effective)
    nic_rate: float            # bytes/s per rank on its NIC (effective)
    nic_share: float           # s: the share of the bytes sent over the NICs
    intra_seconds: float       # the fast-link part, (1 - s) n, as the library runs it
    nic_seconds: float         # the NIC part, s n, a ring over the NICs
    baseline: float            # every byte on the fast link (the clock's price)

    @property
    def seconds(self) -> float:
        """Both parts run at once: the slower one."""
        return max(self.intra_seconds, self.nic_seconds)

    @property
    def speedup(self) -> float:
        return self.baseline / self.seconds if self.seconds else 1.0

    def __str__(self) -> str:
        us = 1e6
        return (f"{self.kind} of {self.nbytes:.4g} B over {self.p} ranks ({self.profile}): "
                f"{self.nic_share:.1%} of the bytes on the NICs ({self.nic_rate / 1e9:.0f} vs "
                f"{self.intra_rate / 1e9:.0f} GB/s per rank): max(fast {self.intra_seconds * us:.1f}, "
                f"NIC {self.nic_seconds * us:.1f}) = {self.seconds * us:.1f} us against "
                f"{self.baseline * us:.1f} us on the fast link alone ({self.speedup:.3f}x)")


def _rates(profile, p: int):
    intra = profile.intra_node.effective_bandwidth   # a switch port, or all HCCS links (mesh)
    # each of the p ranks' share of the node's NICs, as the clock prices a ring crossing
    # nodes (topology.nic_rate): at most Topology.ring_nics adapters shared by the p where
    # the profile sets it (it was ignored here: Jean Zay's NIC ring got 4 adapters' share)
    return intra, _topo.nic_rate(profile, p)


def nic_share(profile, p: int | None = None) -> float:
    """The bandwidth-proportional share of the bytes on the NICs: B_nic / (B_nic + B_intra),
    for a tensor-parallel group of ``p`` ranks of one node (default: the whole node)."""
    profile = get_profile(profile)
    p = profile.devices_per_node if p is None else p
    if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= profile.devices_per_node:
        raise ValueError(f"nic_share(p={p!r}): give the tensor-parallel group's size, an int "
                         f"in [1, {profile.devices_per_node}] (the ranks of one node)")
    intra, nic = _rates(profile, p)
    return nic / (nic + intra)


def nic_assisted(kind: str, nbytes: float, ranks, profile=None,
                 share: float | None = None) -> NicAssist:
    """Price a TP collective over ``ranks`` (all in one node) with ``share`` of its bytes on
    the NICs (default: :func:`nic_share`).  ``share=0`` gives the clock's own price."""
    profile = get_profile(profile)
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r}: NIC assistance splits {list(_KINDS)}")
    g = _topo.group_of(ranks, profile)
    _cost._check(kind, nbytes, g.p)
    if g.nodes != 1:
        raise ValueError(f"ranks={list(ranks)!r:.80} span {g.nodes} nodes; NIC assistance is "
                         f"for a tensor-parallel group inside one node (whose NICs idle); "
                         f"across nodes the NICs already carry the traffic")
    if share is None:
        share = nic_share(profile, g.p)
    if isinstance(share, bool) or not isinstance(share, (int, float)) \
            or not math.isfinite(share) or not 0 <= share <= 1:
        raise ValueError(f"share={share!r} must be the fraction of the bytes on the NICs, in "
                         f"[0, 1] (None: bandwidth-proportional, {nic_share(profile, g.p):.3f})")
    intra, nic = _rates(profile, g.p)
    base = _cost.price(kind, nbytes, list(ranks), profile)
    fast = _cost.price(kind, (1 - share) * nbytes, list(ranks), profile) if share < 1 else 0.0
    link = Link("NICs via the leaf switch", nic, profile.inter_node.latency)
    slow = _cost.collective_time(kind, share * nbytes, g.p, link, "ring") if share > 0 else 0.0
    return NicAssist(kind, float(nbytes), g.p, profile.name, intra, nic, float(share),
                     fast, slow, base)
