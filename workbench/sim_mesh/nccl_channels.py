"""NCCL's collective channels for a communicator spanning nodes, from its graph search.

A collective's kernel holds one SM per channel (``kernel_cost.collective_sms``), and how many
channels NCCL builds depends on how many of the communicator's ranks share a node.  A
data-parallel group beside tensor parallelism 8 has one rank per node; NCCL then searches
its rings on a node topology holding that one GPU and the NICs, and the GPU's own PCIe link
carries every channel's NET -> GPU and GPU -> NET traffic.  :func:`channels` follows that
search as each release writes it (NVIDIA/nccl, read at the tags of ``nccl_tuning.VERSIONS``):

- link widths: a PCIe link is ``width * speed / 80`` GB/s (src/graph/topo.cc: v2.8.3-1
  :360, v2.10.3-1 :433, v2.12.7-1 :438, v2.20.5-1 :446, v2.21.5-1 :459; kvDictPciGen
  "16 GT/s" 120, "32.0 GT/s PCIe" 240): Gen4 x16 24 GB/s, Gen5 x16 48 GB/s; a NIC
  ``mbps / 8000`` (v2.8.3-1 :273 .. v2.21.5-1 :358): 200 Gb/s 25 GB/s, 400 Gb/s 50 GB/s.
- the ring search (src/graph/search.cc ``ncclTopoCompute``) starts at the first entry of
  its speed array not above the GPU-to-NIC path width (v2.8.3-1 :651 one array; v2.10.3-1
  :711 / v2.12.7-1 :730 ``speedArrayInter``; v2.20.5-1 :840 / :845, v2.21.5-1 :851 / :856
  the sm90 array on Hopper), takes as many channels as the links carry at that speed (each
  channel takes ``speed`` of the GPU's PCIe link each way: ppn x floor(pcie / speed)), and
  lowers the speed while the next one is above 0.49 of the best found (v2.8.3-1 :756,
  v2.21.5-1 :991), keeping a solution only when channels x speed grows (strictly).
- duplication: up to 2.12 at the end of the search when speedIntra >= 25 (v2.8.3-1 :799,
  v2.10.3-1 :869, v2.12.7-1 :893); from 2.20 after the first pass, ``ncclTopoDupChannels``,
  unless bw < 25 or (sm > 80, bw < 50 and more than 4 channels) (v2.20.5-1 :827-828,
  v2.21.5-1 :838-839), then the ring's speed raised if the same channels still fit
  (v2.20.5-1 :1007, v2.21.5-1 :1018); at most ``MAXCHANNELS/2`` = 16 search channels
  (src/init.cc ringGraph.maxChannels: v2.8.3-1 :646 .. v2.21.5-1 :1051).
- the communicator: min(tree, ring) channels (init.cc v2.10.3-1 :669 .. v2.21.5-1 :1105;
  the tree's maximum is the ring's: v2.8.3-1 :656 .. v2.21.5-1 :1059), doubled by
  ``ncclTopoPostset`` (src/graph/connect.cc v2.8.3-1 :267, v2.10.3-1 :293, v2.12.7-1 :294,
  v2.20.5-1 :442, v2.21.5-1 :443), doubled again on Hopper from 2.20 when the ring's speed
  is above 45 GB/s and fewer than 16 (connect.cc v2.20.5-1 :456, v2.21.5-1 :457).  NVLS
  (Hopper, more than two GPUs of the communicator on the node) adds channels that ring and
  tree collectives do not use (``collChannels``, connect.cc v2.21.5-1 :472).

The results (tests/test_nccl12.py): DGX A100 (Gen4 x16 GPUs, 200 Gb/s NICs) 2 / 4 / 8 / 16
channels for 1 / 2 / 4 / 8 ranks per node in every release read; DGX H100 (Gen5 x16,
400 Gb/s) 4 / 8 / 16 / 16 in 2.20.5 and 2.21.5; at 8 ranks per node both give the 16 that
NCCL's logs show (the profiles' ``topology.collective_sms`` citations).  A log at one rank
per node on Hopper agrees: two GH200 nodes over NDR InfiniBand, 'Channel 00/04' (NVIDIA/nccl
issue #1291, NCCL 2.20-era; its node is not a DGX: only consistent).  ASSUMPTIONS: the
tree search reaches the ring's channels (its down links bind it as the ring's); the GPU
and its NIC sit under one PCIe switch at full width (the DGX user guides); the link speed
strings as Linux 5.4 writes them ("16 GT/s", which v2.8.3-1's table reads).  Hopper
before 2.20 is not read (those releases predate sm90's speed array): it raises.
"""
from __future__ import annotations

import math
from functools import lru_cache

__all__ = ["channels", "HOSTS", "host_channels", "release_of"]

_SPEEDS = {
    "2.8": (42.0, 30.0, 24.0, 21.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0,
            2.4, 1.2, 0.24, 0.12),
    "2.10": (48.0, 30.0, 24.0, 22.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0,
             2.4, 1.2, 0.24, 0.12),
    "2.20": (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0,
             3.0, 2.4, 1.2, 0.24, 0.12),
    "2.20-sm90": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0,
                  3.0, 2.4, 1.2, 0.24, 0.12),
}
_FAMILY = {"2.8.3": "2.8", "2.10.3": "2.10", "2.12.7": "2.10", "2.20.5": "2.20",
           "2.21.5": "2.20"}
_MAX_SEARCH = 16            # ringGraph.maxChannels = MAXCHANNELS/2 (MAXCHANNELS 32)

# built-in NVIDIA profiles: (sm, GPU PCIe GB/s, NIC GB/s, NVLink GB/s per GPU as NCCL sums
# it, why): NCCL's widths of the DGX's links (module docstring)
HOSTS = {
    "a100": (80, 24.0, 25.0, 12 * 20.0,
             "DGX A100 user guide: A100 SXM4 on PCIe Gen4 x16 (24 GB/s as NCCL counts it), "
             "ConnectX-6 200 Gb/s (25 GB/s), 12 NVLinks at SM80_NVLINK_BW 20"),
    "h100": (90, 48.0, 50.0, 18 * 20.6,
             "DGX H100 user guide: H100 SXM5 on PCIe Gen5 x16 (48 GB/s as NCCL counts it), "
             "ConnectX-7 400 Gb/s (50 GB/s), 18 NVLinks at SM90_NVLINK_BW 20.6"),
    "h100-hbm2e": (90, 48.0, 50.0, 18 * 20.6,
                   "ASSUMPTION: the h100 profile's DGX H100 links (400 Gb/s RDMA per GPU "
                   "as torchtitan states)"),
}


def release_of(version):
    """The release read here that ``version`` names ("2.21.5", "v2.21.5-1"), else None."""
    v = version.strip().lstrip("v").split("-")[0] if isinstance(version, str) else None
    return v if v in _FAMILY else None


def _release(version: str) -> str:
    v = version.strip().lstrip("v").split("-")[0] if isinstance(version, str) else None
    if v not in _FAMILY:
        raise ValueError(f"nccl_version={version!r}: NCCL's graph search is read here for "
                         f"{sorted(_FAMILY)} only")
    return v


def _search(speeds, start_max, pcie, ppn, total):
    """(channels, speed) of the first pass: from the first speed <= start_max down while
    the next is above 0.49 of the best speed found (or none found)."""
    i = next((k for k, s in enumerate(speeds) if s <= start_max), len(speeds) - 1)
    best = (0, 0.0)
    while True:
        s = speeds[i]
        c = min(ppn * math.floor(pcie / s + 1e-9), _MAX_SEARCH)
        if c and c * s > best[0] * best[1]:
            best = (c, s)
        if best[0] and best[0] * best[1] >= total:      # "goto done": the node's NVLink
            break
        if i + 1 >= len(speeds) or (best[0] and speeds[i + 1] / best[1] <= .49):
            break
        i += 1
    return best


@lru_cache(maxsize=None)
def channels(version: str, sm: int, ppn: int, pcie: float, nic: float,
             nvlink_total: float) -> int:
    """The collective channels (one SM each while a ring or tree collective runs) of an NCCL
    ``version`` communicator spanning nodes with ``ppn`` of its ranks on each node, GPUs of
    compute capability ``sm`` (80, 90) on PCIe links of ``pcie`` GB/s, NICs of ``nic`` GB/s
    (one per GPU), ``nvlink_total`` GB/s of NVLink per GPU (module docstring)."""
    v = _release(version)
    if not isinstance(ppn, int) or isinstance(ppn, bool) or ppn < 1:
        raise ValueError(f"ppn={ppn!r} must be an int >= 1 (the group's ranks per node)")
    fam = _FAMILY[v]
    if sm >= 90 and fam != "2.20":
        raise ValueError(f"sm={sm} on NCCL {v}: Hopper's search is read for 2.20.5 and "
                         f"2.21.5 only (earlier releases predate sm90's speed array)")
    speeds = _SPEEDS["2.20-sm90" if sm >= 90 and fam == "2.20" else fam]
    max_bw = min(pcie, nic)
    total = max(pcie, nvlink_total)
    n, bw = _search(speeds, max_bw, pcie, ppn, total)
    if fam == "2.20":
        if bw >= 25.0 and not (sm > 80 and bw < 50.0 and n > 4):      # ncclTopoDupChannels
            d = min(2 * n, _MAX_SEARCH)
            bw /= math.ceil(d / n)
            n = d
        for s in reversed([s for s in speeds if s > bw]):              # pass 2, rings
            c = min(ppn * math.floor(pcie / s + 1e-9), _MAX_SEARCH)
            if c >= n and c * s > n * bw:
                n, bw = c, s
    elif bw >= 25.0:                                                   # 2.8 .. 2.12
        d = min(2 * n, _MAX_SEARCH)
        bw /= math.ceil(d / n)
        n = d
    n = min(32, 2 * n)                                                 # ncclTopoPostset
    if fam == "2.20" and sm == 90 and bw > 45.0 and n < 16:
        n *= 2
    return n


def host_channels(profile, version: str, ppn: int):
    """``channels`` on a built-in profile's node (``HOSTS``), or None for a profile whose
    links are not read here."""
    h = HOSTS.get(profile.name)
    if h is None:
        return None
    sm, pcie, nic, nvl, _ = h
    if sm >= 90 and _FAMILY[_release(version)] != "2.20":
        return None
    return channels(version, sm, min(ppn, profile.devices_per_node), pcie, nic, nvl)
