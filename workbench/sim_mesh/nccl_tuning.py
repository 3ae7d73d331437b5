"""NCCL's tuning model at the release a run used: the clock's collective constants per version.

The clock prices NCCL's rings and trees with NCCL's own tuning model (``topology.py``:
src/graph/tuning.cc, ``ncclTopoTuneModel``), from the constants in a profile's
``topology.protocols`` / ``topology.net_protocols``.  Those constants change between
releases, and published runs used different releases: an inter-node Simple ring step is
9.6 us in NCCL 2.8-2.11, 28 us in 2.12-2.13 and 14 us from 2.18; the ring LL factor is
1/4 or 1/3 up to 2.20 and 0.5 from 2.21; the LL intra-node step is x1.8 across nodes up
to 2.17, while from 2.18 every ring step across nodes is at least the network overhead
(1 us on Intel hosts, 2 us on AMD, x3 for Simple).  :func:`with_nccl` returns a profile
whose two tables are NCCL ``version``'s, derived by :func:`tables` from the constants
below (read from NVIDIA/nccl at each release tag; every figure cites file:line) and the
rules of that release's ``ncclTopoTuneModel``:

ring, one node (``protocols``): base = baseLat[Ring][p]; step = hwLat[NVLINK][Ring][p];
  bandwidth factor LL 1/3 (all_reduce 1/4) up to 2.20, 0.5 from 2.21, both capped at
  llMaxBws[gpu][N1] / the profile's effective NVLink rate; LL128 0.92; Simple 1;
ring, several nodes (``net_protocols``): intra step = hwLat[NVLINK][Ring][p] (LL x1.8
  up to 2.17; from 2.18 at least the network overhead); inter step = hwLat[NET][Ring][p]
  (one rank per node: the same, 2.8-2.21); factor LL 1/4 (0.5 from 2.21) capped at
  llMaxBws[cpu][N4], LL128 0.92 (0.7 with one rank per node), Simple 1;
tree (all_reduce across nodes): base = baseLat[Tree][p]; intra = hwLat[NVLINK][Tree][p]
  (LL x1.8 up to 2.17); inter = hwLat[NET][Tree][p]; factor 0.92, x 1/3.8 for LL (capped
  as the ring's), x 0.915 (2.8-2.9) or 120/128 (2.10 on) for LL128.

Not modeled, in every version (as before): the per-channel bandwidth caps
(ll128MaxBwPerCh / perChMaxRingLL128Bws, perChMaxTreeBws: x the channel count, which
NCCL's graph search (src/graph/search.cc) picks at run time from the node's topology, so
no constant here gives it), the 235 GB/s sm80 cap of 2.8-2.17 (the profiles' NVLink
efficiency stands in), the all_reduce ring's 2N inter-node steps of 2.12 on (2(N-1)
here, as 2.8-2.11 count), the graph's latencyInter (0), the tree's
treeCorrectionFactor and the ring Simple all_reduce's "plateau" factor of
``ncclTopoGetAlgoTime`` (x1.9 on its latency across nodes; x1.4 on sm80+ from 2.18).
A profile's own tables (its JSON) are left as they are: ``topology.nccl_version``
names the release they follow.

The channel count those caps multiply: NCCL 2.8.3's ring search (src/graph/search.cc:
speedArray from the GPU-to-NIC path width, each channel taking ``speed`` of one NIC's
width, channels duplicated only when speedIntra >= 25 GB/s; init.cc: the tuning model
gets the graph's nChannels, before ncclTopoPostset doubles them) would give a DGX A100
across nodes 8 ring channels at 24 GB/s (one per 200 Gb/s NIC: 25 GB/s wide), if its
PCIe paths are as wide as the NIC; those widths are read from the machine at run time
(sysfs), not from a constant, so the caps stay unmodeled.  Measured with them at 8
channels (ring LL128 18.3 / 15.2 / 16.9 GB/s per channel for all_gather /
reduce_scatter / all_reduce in 2.8.3, 20.0 from 2.10; tree 16.0 / 17.8): the published
table's ZeRO-3 rows move by -0.003 .. -0.036, others by <= 0.002.  The ring plateau
factor moves no published row by more than 0.001.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .profiles import Profile, get_profile

__all__ = ["VERSIONS", "Constants", "constants", "tables", "with_nccl", "host_of",
           "assumptions", "scale_assumption", "PROTOCOLS"]

PROTOCOLS = ("LL", "LL128", "Simple")
_US = 1e-6
_GB = 1e9
_TC = "src/graph/tuning.cc"


@dataclass(frozen=True)
class Constants:
    """One release's tuning constants (us, GB/s, as tuning.cc writes them; (LL, LL128,
    Simple) triples) and the rules of its ``ncclTopoTuneModel`` that the clock prices."""
    version: str
    tag: str
    commit: str
    date: str
    same_as: tuple          # releases whose tuning.cc prices these terms identically
    base_tree: tuple
    base_ring: tuple
    nvlink_tree: tuple      # hwLat[NVLINK][Tree]
    nvlink_ring: tuple      # hwLat[NVLINK][Ring]
    net_tree: tuple         # hwLat[NET][Tree]
    net_ring: tuple         # hwLat[NET][Ring]
    ll_max_one_node: dict   # llMaxBws[gpu][N1], GB/s
    ll_max_nodes: dict      # llMaxBws[cpu][N4] (3 nodes or more), GB/s
    ring_ll: tuple          # (factor, all_reduce factor) of the ring LL bus bandwidth
    ring_ll_nodes: float    # the same across nodes
    ll_intra_x: float       # LL's intra-node latency factor across nodes (1.8 or 1)
    net_overhead: dict      # getNetOverhead by cpu, us ({}: none in this release)
    ll128_one_per_node: float   # ring LL128 factor when ppn < 2
    tree_ll128: float       # the tree's LL128 factor across nodes (after x 0.92)
    lines: dict             # what -> "src/graph/tuning.cc:N"


def _cite(c: Constants, what: str) -> str:
    return f"NVIDIA/nccl {c.tag} ({c.commit}, {c.date}) {c.lines[what]}"


_OLD_CPU = {"amd": 19.0, "intel": 20.4}   # llMaxBws[AMD|Intel][N4], 2.8.3 .. 2.21.5

VERSIONS: dict[str, Constants] = {}
for _c in (
    Constants("2.8.3", "v2.8.3-1", "920dbe5b35", "2020-11-17",
              ("2.8.3", "2.8.4", "2.9.6", "2.9.8", "2.9.9"),
              base_tree=(4.4, 4.4, 0.0), base_ring=(3.6, 10.0, 8.4),
              nvlink_tree=(0.52, 1.25, 28.0), nvlink_ring=(0.47, 1.9, 3.4),
              net_tree=(5.0, 8.5, 28.0), net_ring=(2.7, 4.0, 9.6),
              ll_max_one_node={"ampere": 87.7}, ll_max_nodes=_OLD_CPU,
              ring_ll=(1 / 3, 1 / 4), ring_ll_nodes=1 / 4, ll_intra_x=1.8, net_overhead={},
              ll128_one_per_node=0.7, tree_ll128=0.915,
              lines={"baseLat": f"{_TC}:56", "hwLat NVLINK": f"{_TC}:65",
                     "hwLat NET": f"{_TC}:69", "llMaxBws": f"{_TC}:75",
                     "ring LL": f"{_TC}:125", "ring LL128": f"{_TC}:126",
                     "tree": f"{_TC}:127", "tree LL": f"{_TC}:128",
                     "tree LL128": f"{_TC}:129", "LL x1.8": f"{_TC}:141",
                     "nInterSteps": f"{_TC}:112"}),
    Constants("2.10.3", "v2.10.3-1", "7e51592129", "2021-07-08", ("2.10.3", "2.11.4"),
              base_tree=(4.4, 4.4, 0.0), base_ring=(3.6, 10.0, 8.4),
              nvlink_tree=(0.52, 1.25, 28.0), nvlink_ring=(0.47, 1.9, 3.4),
              net_tree=(5.0, 8.5, 28.0), net_ring=(2.7, 4.0, 9.6),
              ll_max_one_node={"ampere": 87.7}, ll_max_nodes=_OLD_CPU,
              ring_ll=(1 / 3, 1 / 4), ring_ll_nodes=1 / 4, ll_intra_x=1.8, net_overhead={},
              ll128_one_per_node=0.7, tree_ll128=120 / 128,
              lines={"baseLat": f"{_TC}:56", "hwLat NVLINK": f"{_TC}:65",
                     "hwLat NET": f"{_TC}:69", "llMaxBws": f"{_TC}:74",
                     "ring LL": f"{_TC}:128", "ring LL128": f"{_TC}:129",
                     "tree": f"{_TC}:130", "tree LL": f"{_TC}:131",
                     "tree LL128": f"{_TC}:132", "LL x1.8": f"{_TC}:142",
                     "nInterSteps": f"{_TC}:115"}),
    Constants("2.12.7", "v2.12.7-1", "3c223c105a", "2022-03-02",
              ("2.12.7", "2.12.10", "2.12.12", "2.13.4"),
              base_tree=(4.4, 4.4, 0.0), base_ring=(3.6, 10.0, 8.4),
              nvlink_tree=(0.52, 1.25, 28.0), nvlink_ring=(0.47, 1.9, 3.4),
              net_tree=(5.0, 8.5, 28.0), net_ring=(2.7, 4.0, 28.0),
              ll_max_one_node={"ampere": 87.7}, ll_max_nodes=_OLD_CPU,
              ring_ll=(1 / 3, 1 / 4), ring_ll_nodes=1 / 4, ll_intra_x=1.8, net_overhead={},
              ll128_one_per_node=0.7, tree_ll128=120 / 128,
              lines={"baseLat": f"{_TC}:56", "hwLat NVLINK": f"{_TC}:65",
                     "hwLat NET": f"{_TC}:69", "llMaxBws": f"{_TC}:74",
                     "ring LL": f"{_TC}:127", "ring LL128": f"{_TC}:128",
                     "tree": f"{_TC}:129", "tree LL": f"{_TC}:130",
                     "tree LL128": f"{_TC}:131", "LL x1.8": f"{_TC}:142",
                     "nInterSteps": f"{_TC}:114"}),
    Constants("2.20.5", "v2.20.5-1", "48bb7fec79", "2024-02-26", ("2.20.3", "2.20.5"),
              base_tree=(6.8, 14.0, 0.0), base_ring=(6.6, 14.0, 8.4),
              nvlink_tree=(0.6, 1.25, 28.0), nvlink_ring=(0.6, 1.9, 3.4),
              net_tree=(5.0, 8.5, 28.0), net_ring=(2.7, 4.0, 14.0),
              ll_max_one_node={"ampere": 87.7, "hopper": 87.7}, ll_max_nodes=_OLD_CPU,
              ring_ll=(1 / 3, 1 / 4), ring_ll_nodes=1 / 4, ll_intra_x=1.0,
              net_overhead={"intel": 1.0, "amd": 2.0},
              ll128_one_per_node=0.7, tree_ll128=120 / 128,
              lines={"baseLat": f"{_TC}:57", "hwLat NVLINK": f"{_TC}:67",
                     "hwLat NET": f"{_TC}:75", "llMaxBws": f"{_TC}:87-89",
                     "getNetOverhead": f"{_TC}:115-116", "ring LL": f"{_TC}:181",
                     "ring LL128": f"{_TC}:182", "tree": f"{_TC}:183",
                     "tree LL": f"{_TC}:184", "tree LL128": f"{_TC}:185",
                     "netOverhead": f"{_TC}:244-248", "nInterSteps": f"{_TC}:162"}),
    Constants("2.21.5", "v2.21.5-1", "ab2b89c4c3", "2024-04-02", ("2.21.5",),
              base_tree=(6.8, 14.0, 0.0), base_ring=(6.6, 14.0, 8.4),
              nvlink_tree=(0.6, 1.25, 28.0), nvlink_ring=(0.6, 1.9, 3.4),
              net_tree=(5.0, 8.5, 28.0), net_ring=(2.7, 4.0, 14.0),
              ll_max_one_node={"ampere": 87.7, "hopper": 141.0}, ll_max_nodes=_OLD_CPU,
              ring_ll=(0.5, 0.5), ring_ll_nodes=0.5, ll_intra_x=1.0,
              net_overhead={"intel": 1.0, "amd": 2.0},
              ll128_one_per_node=0.7, tree_ll128=120 / 128,
              lines={"baseLat": f"{_TC}:57", "hwLat NVLINK": f"{_TC}:67",
                     "hwLat NET": f"{_TC}:75", "llMaxBws": f"{_TC}:87-89",
                     "getNetOverhead": f"{_TC}:115-116", "ring LL": f"{_TC}:180",
                     "ring LL128": f"{_TC}:181", "tree": f"{_TC}:182",
                     "tree LL": f"{_TC}:183", "tree LL128": f"{_TC}:184",
                     "netOverhead": f"{_TC}:243-247", "nInterSteps": f"{_TC}:161"}),
):
    for _v in _c.same_as:
        VERSIONS[_v] = _c

# (GPU family, host CPU vendor) of each built-in NVIDIA profile: llMaxBws is indexed by
# the GPU inside a node and by the CPU across nodes, getNetOverhead by the CPU
_HOSTS = {
    "a100": ("ampere", "amd", "DGX A100: AMD EPYC 7742 (DGX A100 user guide)"),
    "a100-jeanzay": ("ampere", "amd", "ASSUMPTION: AMD as the a100 profile's DGX A100 "
                     "(the profile's own LL cap citation)"),
    "h100": ("hopper", "intel", "DGX H100: Intel Xeon 8480C (DGX H100 user guide)"),
    "h100-hbm2e": ("hopper", "intel", "ASSUMPTION: Intel as the h100 profile's DGX H100 "
                   "(the profile's own LL cap citation)"),
}


def host_of(profile: Profile) -> tuple[str, str, str]:
    """(GPU family, CPU vendor, why) of a built-in NVIDIA profile."""
    if profile.name not in _HOSTS:
        raise ValueError(f"with_nccl: profile {profile.name!r} has no known GPU family and "
                         f"host CPU for NCCL's tuning model; use one of {sorted(_HOSTS)}")
    return _HOSTS[profile.name]


def constants(version: str) -> Constants:
    """The tuning constants of NCCL ``version`` ("2.8.3", "2.10.3", ...)."""
    if not isinstance(version, str) or version.strip().lstrip("v").split("-")[0] \
            not in VERSIONS:
        raise ValueError(f"nccl_version={version!r} is not a release read here; use one of "
                         f"{sorted(VERSIONS, key=lambda v: tuple(map(int, v.split('.'))))}")
    return VERSIONS[version.strip().lstrip("v").split("-")[0]]


def tables(version: str, gpu: str, cpu: str, nvlink_busbw: float):
    """(protocols, net_protocols): the profile tables (``profiles.PROTOCOL_KEYS``,
    ``NET_PROTOCOL_KEYS``; seconds, fractions, bytes/s) of NCCL ``version`` for a node of
    ``gpu`` ("ampere" | "hopper") GPUs on NVSwitch with ``cpu`` ("amd" | "intel") hosts;
    ``nvlink_busbw``: the profile's effective NVLink rate (bytes/s), against which
    llMaxBws[gpu][N1] caps the one-node LL factor (module docstring)."""
    c = constants(version)
    if gpu not in c.ll_max_one_node:
        raise ValueError(f"gpu={gpu!r}: NCCL {c.version}'s llMaxBws has "
                         f"{sorted(c.ll_max_one_node)}")
    if cpu not in c.ll_max_nodes:
        raise ValueError(f"cpu={cpu!r}: use one of {sorted(c.ll_max_nodes)}")
    cap1 = c.ll_max_one_node[gpu] * _GB / nvlink_busbw
    protos, net = {}, {}
    for i, p in enumerate(PROTOCOLS):
        f, far = (min(c.ring_ll[0], cap1), min(c.ring_ll[1], cap1)) if p == "LL" else \
            (0.92, 0.92) if p == "LL128" else (1.0, 1.0)
        protos[p] = {"base_latency": c.base_ring[i] * _US,
                     "step_latency": c.nvlink_ring[i] * _US,
                     "bandwidth_factor": f, "all_reduce_bandwidth_factor": far}
        x = c.ll_intra_x if p == "LL" else 1.0
        overhead = c.net_overhead.get(cpu, 0.0) * (3 if p == "Simple" else 1)
        ring_f = c.ring_ll_nodes if p == "LL" else 0.92 if p == "LL128" else 1.0
        tree_f = 0.92 * (1 / 3.8 if p == "LL" else c.tree_ll128 if p == "LL128" else 1.0)
        net[p] = {"intra_step_latency": max(c.nvlink_ring[i] * x, overhead) * _US,
                  "inter_step_latency": c.net_ring[i] * _US,
                  "inter_step_latency_one_per_node": c.net_ring[i] * _US,
                  "bandwidth_factor": ring_f,
                  "bandwidth_factor_one_per_node": c.ll128_one_per_node
                  if p == "LL128" else ring_f,
                  "max_bandwidth": c.ll_max_nodes[cpu] * _GB if p == "LL" else 0.0,
                  "tree_base_latency": c.base_tree[i] * _US,
                  "tree_intra_latency": c.nvlink_tree[i] * x * _US,
                  "tree_inter_latency": c.net_tree[i] * _US,
                  "tree_bandwidth_factor": tree_f}
    return protos, net


def _citations(c: Constants, gpu: str, cpu: str, why: str) -> dict:
    from .profiles import NET_PROTOCOL_KEYS, PROTOCOL_KEYS
    out = {}
    for p in PROTOCOLS:
        one = (
            f"{_cite(c, 'baseLat')} baseLat[Ring][{p}]; {_cite(c, 'hwLat NVLINK')} "
            f"hwLat[NVLINK][Ring][{p}]; factor: {_cite(c, 'ring LL')} (LL, capped at "
            f"llMaxBws[{gpu}][N1], {_cite(c, 'llMaxBws')}), {_cite(c, 'ring LL128')}")
        nodes = (
            f"{_cite(c, 'hwLat NET')} hwLat[NET][Ring|Tree][{p}]; "
            f"{_cite(c, 'hwLat NVLINK')}; "
            + (f"LL x{c.ll_intra_x} {_cite(c, 'LL x1.8')}; " if c.ll_intra_x != 1 else
               f"network overhead {c.net_overhead[cpu]} us ({cpu}) "
               f"{_cite(c, 'getNetOverhead')}, {_cite(c, 'netOverhead')}; ")
            + f"LL cap llMaxBws[{cpu}][N4] {_cite(c, 'llMaxBws')}; tree "
              f"{_cite(c, 'tree')}, {_cite(c, 'tree LL')}, {_cite(c, 'tree LL128')}; host: "
              f"{why}")
        out.update({f"topology.protocols.{p}.{k}": one for k in PROTOCOL_KEYS})
        out.update({f"topology.net_protocols.{p}.{k}": nodes for k in NET_PROTOCOL_KEYS})
    return out


def with_nccl(profile: "str | Profile", version: str) -> Profile:
    """``profile`` with its collective tables (``topology.protocols``,
    ``topology.net_protocols``) those of NCCL ``version``'s tuning model (module
    docstring), ``topology.nccl_version`` set to it; everything else unchanged."""
    prof = get_profile(profile)
    if prof.topology.library != "nccl":
        raise ValueError(f"with_nccl: profile {prof.name!r} runs "
                         f"{prof.topology.library!r}, not NCCL")
    c = constants(version)
    gpu, cpu, why = host_of(prof)
    protos, net = tables(c.version, gpu, cpu, prof.intra_node.effective_bandwidth)
    cites = {k: v for k, v in prof.citations.items()
             if not k.startswith(("topology.protocols.", "topology.net_protocols."))}
    cites.update(_citations(c, gpu, cpu, why))
    cites["topology.nccl_version"] = (f"NCCL {version}: the tables of {c.tag} "
                                      f"(sim_mesh/nccl_tuning.py; the same for "
                                      f"{', '.join(c.same_as)})")
    topo = replace(prof.topology, protocols=protos, net_protocols=net,
                   nccl_version=version.strip().lstrip("v").split("-")[0])
    return replace(prof, topology=topo, citations=cites)


def assumptions(profile: Profile) -> tuple:
    """One line for an estimate's ``details["assumptions"]``: the NCCL release whose
    tuning model prices its collectives, and what that model leaves out."""
    t = profile.topology
    if t.library != "nccl" or not t.protocols:
        return ()
    v = t.nccl_version or "unstated"
    return (f"collectives priced by NCCL {v}'s tuning model (src/graph/tuning.cc; "
            f"sim_mesh/nccl_tuning.py): per-channel bandwidth caps, the tree's correction "
            f"factors and the ring all_reduce's plateau factor not modeled",)


def scale_assumption(profile: Profile, nodes: int) -> tuple:
    """One line for an estimate whose largest collective group spans ``nodes`` nodes, when
    that is more than two: NCCL's tuning model gives a ring or tree across three nodes or
    more the bus bandwidth of the graph's inter-node speed x its channels whatever the node
    count (``float speed = nNodes <= 2 || ... ? speedIntra : speedInter; float busBw =
    graphs[a]->nChannels * speed``, NVIDIA/nccl v2.8.3-1 src/graph/tuning.cc:120-121; the
    same in 2.12.7 at :122-123, ``bwInter`` in 2.21.5 at :174-177), and only its ring and
    tree latencies grow with the ranks; the profiles' per-NIC rates are few-node figures
    (``inter_node`` citations: nccl-tests issue #119's per-NIC peak, Jean Zay's four-node
    benchmark).  Measured at scale (tests/test_nccl_scale.py), and agreeing with this
    pricing: the tree's latency across 32 A100 nodes (NVIDIA/nccl issue #652: all_reduce
    of 8-128 B in 62.9-65.5 us, the clock 67.5 us) and the fall of an H100 cluster's
    reduce-scatter bus bandwidth from 360 to 260 GB/s between 4 and 128 nodes (NVIDIA/nccl
    issue #1229, no message size given), which the ring's per-step latency gives within
    5% at every node count for a 2 GiB reduce-scatter.  No bus bandwidth measured on A100
    nodes at 48 to 280 nodes was found (searched: the NCCL and nccl-tests issue trackers,
    NVIDIA's DGX SuperPOD and dgxc-benchmarking material, Azure's AI-benchmarking-guide
    and NDv4 notes), so fabric contention, routing and stragglers there are not priced:
    the line says so.  Searched again (2026-11-30: the same trackers, AWS p4d / EFA posts,
    Selene / SuperPOD material, BigScience, Stability, llm-jp, DeepSpeed's blogs, the
    Demystifying-NCCL and PAT papers' abstracts): the one bus-bandwidth-against-nodes curve
    found for nodes of 8 NVLink GPUs at a training-size message is the Ultra-Scale
    Playbook's (Hugging Face 2025, "Communication Bandwidth by Number of Nodes (size=256MB)",
    1-64 nodes; vinjn/nanotron-ultrascale-playbook@e3bcfc5c0b
    fragments/pp_comm_bandwidth.html), whose all_gather / reduce_scatter, normalised to
    one node, fall 2.9x to 9x more at 8 to 64 nodes than this pricing
    (tests/test_nccl15.py): a fall of the size the 530B ZeRO-3 rows would need (0.3-0.4 of
    the priced rate, ``benchmarks/zero3_audit.py``) is measured there, but on a cluster
    whose GPU, fabric and NCCL release the figure does not state and whose one-node figure
    is 0.71 of nccl-tests' NVLink ring: read, not applied to the A100 / HDR profile.  NCCL's
    maintainer's rule of thumb, ~20 GB/s per NIC (NVIDIA/nccl #320, 2023-01-03), is again a
    few-node figure.  On A100 / HDR InfiniBand at scale the one component reading found is
    of other jobs' traffic, not of NCCL: De Sensi et al. (SC24, arXiv 2408.14090; through
    its published summaries) measured on Leonardo (Dragonfly+) production noise costing
    "up to 50%" of NCCL allreduce goodput at 1,024 GPUs, partly recovered on a non-default
    IB service level (as NVIDIA's own scripts select, ``export NCCL_IB_SL=1``,
    NVIDIA/Megatron-LM 6df14fa6c4 examples/multimodal/llama_3p1_nemotron_nano_vl_8b_v1/
    text_generation.sh:3); read against the rows in ``benchmarks/zero3_audit.py`` and
    ``benchmarks/mtnlg_audit.py`` (not one figure for ZeRO-3; under 8% of MT-NLG's gap),
    not priced: one scale, another topology, an upper figure only.  NCCL's own source
    adds nothing that grows with the nodes beyond that latency for the ring all_gather /
    reduce_scatter these rows run: 2.8.3's ``computeColl`` (NVIDIA/nccl v2.8.3-1
    src/enqueue.cc:348-351, :377-379, :419-420) cuts a ring collective into nRanks chunks a
    channel and loop and runs (nRanks - 1) steps a loop, the steps the tuning model's
    latency counts; its chunk shrinking with the depth (:383-387, :404-409) is the tree's
    and LL128 tree's, all_reduce only.  Every at-scale figure found is now one row of
    ``benchmarks/nccl_scale_audit.py`` (measured against this pricing for the same
    collective; tests/test_i2118.py; searched again 2026-11-30, branch i2118: Azure NDv4
    posts, Selene / SuperPOD material, MegaScale, Alibaba HPN, Meta's RoCE paper, Llama 3,
    the PCCL paper on Perlmutter, NCCL's trackers).  They split by fabric, not by
    algorithm: NVIDIA's own DGX A100 reference, 192 GB/s all_reduce over 32 GPUs (GTC25
    S72583), is this pricing at 4 nodes (the few-node figure the line names); the tree
    latency (#652) and an H100 ring over 4-128 nodes (#1229) agree;
    rings on three other fabrics fall below it: NVIDIA/nccl #1218 (H100 over RoCE, 32
    nodes, all_gather of 2 GiB at 200 GB/s: 0.64 of this pricing's 312), nccl-tests #169
    (A100 over 8 x 100G RoCE, all_reduce of 8 GiB: 0.73 / 0.61 / 0.42 at 3 / 4 / 6 nodes),
    the Playbook's fall (0.34 / 0.20 / 0.11 at 8 / 32 / 64 nodes); NCCL's maintainer:
    "Rings degrade at scale" (#1649, 2025-03), no figure.  What the ZeRO-3 530B rows would
    need (0.27-0.40 of the priced rate) lies inside that span, as does 1: not one figure,
    none on A100 / HDR, so nothing is applied.  The line itself is unchanged (notebook 17
    stores it), so its "no bus bandwidth measured at that scale on A100" stands: true of
    A100 still.  () for other libraries or at most two nodes."""
    if profile.topology.library != "nccl" or not profile.topology.protocols or nodes <= 2:
        return ()
    nic = profile.inter_node.effective_bandwidth / 1e9
    return (f"UNCERTAIN: NCCL across {nodes} nodes priced at {nic:.0f} GB/s per NIC (a "
            f"few-node figure, the profile's inter_node citations) with a bus bandwidth that "
            f"does not fall with the node count (NCCL's tuning model, src/graph/tuning.cc: "
            f"speedInter x nChannels beyond two nodes; only the ring/tree latency grows): "
            f"at scale that latency agrees with NVIDIA/nccl issues #652 (A100, 32 nodes) "
            f"and #1229 (H100, 4-128 nodes; tests/test_nccl_scale.py), no bus bandwidth "
            f"measured at that scale on A100 found: fabric contention, routing and "
            f"stragglers at {nodes} nodes not modeled (sim_mesh/nccl_tuning.py "
            f"scale_assumption)",)
