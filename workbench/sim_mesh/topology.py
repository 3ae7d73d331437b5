"""Collectives priced on the real topology, with the algorithm the vendor's library uses.

Links run at ``Link.effective_bandwidth`` (line rate x the library's efficiency).
A group of ranks is seen by where its ranks sit (node = rank // devices_per_node):
``k`` ranks on each of ``m`` nodes. The node's fabric (``profiles.Topology``) decides
what one rank can push:

- NVSwitch (A100, H100): each GPU has one port of ``intra_node.bandwidth`` into the
  switches; any pattern of traffic between GPUs of a node runs at that rate.
- HCCS full mesh (Atlas 800T A2): each NPU has ``intra_links`` = 7 direct links of
  ``intra_node.bandwidth / 7`` each. A ring uses one link per direction (1/7 of the
  NPU's bandwidth); HCCL's Mesh algorithm sends to all peers at once over all links
  (HCCL user guide, "Mesh": ReduceScatter and AllGather each alpha + n/p beta,
  AllReduce 2 alpha + 2 n/p beta, beta per link).
- Between nodes, each device has its own NIC (rail-optimized: DGX A100 8 x HDR,
  DGX H100 8 x NDR, Atlas 800T A2 8 x 200GE RoCE), so ``k`` ranks of a node drive
  ``k`` NICs at once: a flat ring across nodes (NCCL) crosses each node boundary on
  k rails, bounded by min(intra rate, k x NIC).  Where NICs are shared (fewer than
  devices: ``nics_per_node``) each rank drives its share, and where the library is
  seen to route a communicator's rings through fewer NICs (``Topology.ring_nics``:
  Jean Zay's NCCL log, one Omni-Path adapter per direction) at most that many.

Algorithms (n bytes, the size convention of ``cost.py``; alpha, beta from the links):

- "ring": (p-1) or 2(p-1) steps at the group's bottleneck rate (``cost.collective_time``).
  Inside one node, when the profile lists the library's protocols
  (``Topology.protocols``: NCCL's LL, LL128, Simple), each protocol costs
  base + steps x step latency + bytes sent / (rate x its bandwidth factor), as in
  NCCL's tuning model (src/graph/tuning.cc), and the fastest is taken: LL for
  small messages, LL128 in between, Simple for large ones (``protocol_of``).
  Across nodes, when the profile lists NCCL's net protocols (``Topology.net_protocols``),
  all_reduce, all_gather and reduce_scatter rings are priced by the same tuning model
  with its inter-node figures: every ring step pays a latency, the (N-1) or 2(N-1)
  steps that cross a node boundary the network's, so a ring over 1,536 ranks pays
  about 1,535 steps (milliseconds) whatever its message (``_net_protocols``).
- "tree": NCCL's double binary tree for all_reduce (Sanders et al. 2009; NCCL
  2.4): across m nodes a tree of depth ceil(log2 m), inside a node a chain of k:
  2 (log2 m alpha_inter + (k-1) alpha_intra) + 2 n / rate; with the net protocols,
  NCCL's tuning model of it (floor(log2 m) inter-node steps, its own latencies and
  bandwidth factor 0.92 per protocol). all_reduce only.
- "halving_doubling": recursive halving / doubling (Thakur et al. 2005; Rabenseifner's
  all-reduce), HCCL's "H-D_R": the "tree" rows of ``cost.collective_time``.
- "mesh": HCCL's full-mesh algorithm inside one server (formulas above).
- "pairwise": all_to_all as p-1 exchanges, the intra-node and inter-node shares
  running at the same time on their own links; inside one node with protocols,
  p-1 protocol steps like all_gather (an assumption: NCCL's tuning model has no
  all_to_all).
- "hierarchical": intra-node reduce-scatter, inter-node all-reduce of n/k among the
  ranks with the same local index (each on its own NIC), intra-node all-gather; the
  intra phases use the library's intra-node algorithm (NCCL: ring, HCCL: mesh).
- "pipelined": the same phases cut into c chunks that flow through them at once, the
  intra phases on the node's links while the inter phase uses the NICs (HCCL's
  "pipeline" algorithm: "uses intra-server and inter-server links concurrently",
  CANN HCCL_ALGO reference; SDMA inside, RDMA between servers). With per-chunk phase
  times x, y, z (z on the same links as x) and T = max(x + z, y), chunk i reduce-scatters
  at i T, all-reduces right after, and all-gathers after chunk i + 1's reduce-scatter;
  the last chunk all-gathers once its all-reduce and the previous all-gather are done:
  (c-1) T + x + max(y, z) + z for c >= 2 (``pipelined_seconds``; (x + y + z) +
  (c-1) T when y >= z), minimized over c in 1, 2, 4, ... 64; c = 1 is "hierarchical",
  so pipelined never costs more.

What the libraries choose ("auto"; ``choose`` says which and why):

- NCCL (NCCL_ALGO in the NCCL user guide; its tuning model picks the fastest
  predicted algorithm per call): all_reduce ring, or tree when the group spans
  nodes; all_gather, reduce_scatter, broadcast ring; all_to_all pairwise
  (grouped send/recv). NVLS / CollNet (switch reductions) are not modeled.
- HCCL (CANN HCCL_ALGO: level0 = intra-server, fixed by the hardware; level1 =
  inter-server ring | H-D_R | NHR | NB | pipeline | pairwise, chosen adaptively):
  one server: mesh; one rank per server, or an uneven group: ring or
  halving_doubling (all_to_all: pairwise); several ranks on each of several
  servers: hierarchical or pipelined (broadcast: hierarchical; all_to_all:
  pairwise or hierarchical). NHR and NB are not modeled (ring / H-D stand in).

The cheapest of the library's candidates is taken; ties go to the earlier one.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType

from . import cost as _cost  # cost imports this module too: use it at call time only
from .profiles import Link, Profile

__all__ = ["PRICE_ALGORITHMS", "PIPELINE_CHUNKS", "Group", "Choice", "group_of",
           "algorithm_time", "choose", "protocol_of", "phase_times", "pipelined_seconds",
           "flat_link", "nic_rate"]

PRICE_ALGORITHMS = ("ring", "tree", "halving_doubling", "mesh", "pairwise",
                    "hierarchical", "pipelined")
_CHUNKS = (1, 2, 4, 8, 16, 32, 64)
PIPELINE_CHUNKS = _CHUNKS   # the chunk counts "pipelined" chooses from


@dataclass(frozen=True)
class Group:
    """Where a group's ranks sit: ranks per node, for the nodes it touches."""
    per_node: tuple[int, ...]

    @property
    def p(self) -> int:
        return sum(self.per_node)

    @property
    def nodes(self) -> int:
        return len(self.per_node)

    @property
    def local(self) -> int:
        return min(self.per_node)

    @property
    def even(self) -> bool:
        return len(set(self.per_node)) == 1


@dataclass(frozen=True)
class Choice:
    """The algorithm a library runs for one collective, its time, and why."""
    algorithm: str
    seconds: float
    library: str
    reason: str
    candidates: MappingProxyType = field(hash=False)  # algorithm -> seconds, read-only


# (ranks, devices per node) -> Group: a trace prices the same groups again and again,
# and counting their nodes (the Counter) cost more than the rest of ``cost.price``
_GROUPS: dict = {}
_GROUPS_MAX = 4096              # distinct groups remembered; then it starts again


def group_of(ranks, profile: Profile) -> Group:
    """Where ``ranks`` sit on ``profile``'s nodes (memoized on the tuple of ranks)."""
    memo = type(ranks) is tuple
    if memo:
        key = (ranks, profile.devices_per_node)
        hit = _GROUPS.get(key)
        # only a tuple of ints is a hit: (True, 2) and (1.0, 2) are equal keys to (1, 2),
        # and they must raise below
        if hit is not None and all(type(r) is int for r in ranks):
            return hit
    out = list(ranks)
    if not out or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in out):
        raise ValueError(f"ranks={ranks!r} must be a non-empty list of ints >= 0")
    if len(set(out)) != len(out):
        raise ValueError(f"ranks={ranks!r} holds a rank twice; list each rank once")
    counts = Counter(r // profile.devices_per_node for r in out)
    g = Group(tuple(counts[n] for n in sorted(counts)))
    if memo and all(type(r) is int for r in ranks):
        if len(_GROUPS) >= _GROUPS_MAX:
            _GROUPS.clear()
        _GROUPS[key] = g
    return g


def _rates(profile: Profile, g: Group):
    """(ring rate inside a node, mesh link rate, NIC rate per rank)."""
    t = profile.topology
    port = profile.intra_node.effective_bandwidth
    link = port / t.intra_links
    ring_intra = link if t.intra_fabric == "full_mesh" else port
    nic = profile.inter_node.effective_bandwidth * t.nics_per_node / profile.devices_per_node
    return ring_intra, link, nic


def nic_rate(profile: Profile, k: int) -> float:
    """Bytes/s each of ``k`` ranks of one node pushes through the NICs when all send at
    once: its share of the node's NICs (``nics_per_node / devices_per_node`` of one, at
    the library's efficiency), and where the library routes its rings through fewer
    adapters (``Topology.ring_nics``) the k share those: at most ``ring_nics`` adapters'
    rate over k."""
    _, _, nic = _rates(profile, Group((k,)))
    cap = profile.topology.ring_nics
    return nic if cap is None else min(nic, cap * profile.inter_node.effective_bandwidth / k)


def flat_link(profile: Profile, g: Group) -> Link:
    """The one link a flat (ring, halving-doubling) algorithm is bounded by: across
    nodes the group's k ranks of a node drive k NICs' shares, at most ``ring_nics``
    whole NICs where the profile says the library's rings cross a node on fewer
    (:func:`nic_rate`)."""
    ring_intra, _, _ = _rates(profile, g)
    if g.nodes == 1:
        return Link("intra", ring_intra, profile.intra_node.latency)
    rate = min(ring_intra, g.local * nic_rate(profile, g.local))
    return Link("flat", rate, profile.inter_node.latency)


_flat_link = flat_link          # the name tests and notes used before it was public


_RING_STEPS = {"all_reduce": lambda p: 2 * (p - 1), "all_gather": lambda p: p - 1,
               "reduce_scatter": lambda p: p - 1, "broadcast": lambda p: 1,
               "all_to_all": lambda p: p - 1}   # ASSUMPTION: tuning.cc has no
# all_to_all (grouped send/recv); priced as p - 1 protocol steps, like all_gather


def _ring_protocols(kind, n, p, profile):
    """{protocol: seconds} for a ring of p ranks inside one node, by NCCL's tuning
    model (src/graph/tuning.cc): base + steps x step latency + bytes / (busbw x
    factor); busbw is the port's effective rate, steps 2(p-1) for all_reduce, p-1
    for all_gather / reduce_scatter, one pipelined step for broadcast (chain).
    The library runs the fastest (NCCL picks per call from the same model)."""
    port = _rates(profile, Group((p,)))[0]
    out = {}
    for name, v in profile.topology.protocols.items():
        f = v["all_reduce_bandwidth_factor"] if kind == "all_reduce" else v["bandwidth_factor"]
        wire = _cost._BUS_FACTOR[kind](p) * n   # bytes each rank sends: nsteps / p x n
        out[name] = (v["base_latency"] + _RING_STEPS[kind](p) * v["step_latency"]
                     + wire / (port * f))
    return out


_NET_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def _net_protocols(kind, n, g, profile, algorithm="ring"):
    """{protocol: seconds} of NCCL's ring (all_reduce, all_gather, reduce_scatter) or
    double binary tree (all_reduce) over a group spanning nodes, by NCCL's tuning model
    (src/graph/tuning.cc, ``ncclTopoTuneModel``; the constants in the profile's
    ``topology.net_protocols``, each cited there).  With p ranks on N nodes, ppn = p // N:

    - ring: base + (nsteps - nInter) x intra step + nInter x inter step + bytes each
      rank sends / min(busbw x factor, cap); nsteps 2(p-1) for all_reduce, p-1 for
      all_gather and reduce_scatter; nInter 2(N-1) and N-1 (NCCL master; 2.12.7 counts
      2N for all_reduce, two steps more); one rank per node takes its own inter step
      latency and factor where the profile's NCCL version has them;
    - tree (all_reduce): base + 2 ((ppn - 1) x intra + floor(log2 N) x inter) +
      2 n / min(busbw x factor, cap) (tuning.cc converts a tree's bus bandwidth to
      algorithm bandwidth x 0.5).

    busbw is the flat ring's bottleneck rate (``flat_link``: NVLink or the node's
    NICs, each at NCCL's efficiency); the per-channel caps are not modeled."""
    net, protos = profile.topology.net_protocols, profile.topology.protocols
    rate = flat_link(profile, g).bandwidth
    p, nodes = g.p, g.nodes
    one = p // nodes == 1
    out = {}
    for name, v in net.items():
        cap = v["max_bandwidth"] or math.inf
        if algorithm == "ring":
            steps = _RING_STEPS[kind](p)
            inter = 2 * (nodes - 1) if kind == "all_reduce" else nodes - 1
            hop = v["inter_step_latency_one_per_node" if one else "inter_step_latency"]
            f = v["bandwidth_factor_one_per_node" if one else "bandwidth_factor"]
            lat = protos[name]["base_latency"] + (steps - inter) * v["intra_step_latency"] \
                + inter * hop
            out[name] = lat + _cost._BUS_FACTOR[kind](p) * n / min(rate * f, cap)
        else:
            lat = v["tree_base_latency"] + 2 * ((p // nodes - 1) * v["tree_intra_latency"]
                                                + (nodes.bit_length() - 1)
                                                * v["tree_inter_latency"])
            out[name] = lat + 2 * n / min(rate * v["tree_bandwidth_factor"], cap)
    return out


def _uses_net_model(kind, g, profile, algorithm="ring") -> bool:
    return (g.nodes > 1 and bool(profile.topology.net_protocols)
            and (kind in _NET_KINDS if algorithm == "ring" else kind == "all_reduce"))


def _ring(kind, n, g, profile):
    """A ring over the group: with the library's protocols inside one node when the
    profile gives them, across nodes with NCCL's net protocols when it gives those
    (``_net_protocols``), else the alpha-beta ring on the bottleneck link."""
    if g.nodes == 1 and profile.topology.protocols and kind in _RING_STEPS:
        return min(_ring_protocols(kind, n, g.p, profile).values())
    if _uses_net_model(kind, g, profile):
        return min(_net_protocols(kind, n, g, profile).values())
    return _cost.collective_time(kind, n, g.p, flat_link(profile, g), "ring")


def protocol_of(kind: str, n: float, g: Group, profile: Profile,
                algorithm: str = "ring") -> str:
    """The protocol NCCL's ``algorithm`` ("ring" or, across nodes, "tree") runs for this
    collective: inside one node by ``topology.protocols``, across nodes by
    ``topology.net_protocols`` ("" when the profile models none)."""
    if g.p == 1 or n == 0:
        return ""
    if algorithm == "tree" or g.nodes > 1:
        if not _uses_net_model(kind, g, profile, algorithm):
            return ""
        times = _net_protocols(kind, n, g, profile, algorithm)
    elif not profile.topology.protocols or kind not in _RING_STEPS:
        return ""
    else:
        times = _ring_protocols(kind, n, g.p, profile)
    return min(times, key=times.get)


def _mesh(kind, n, k, profile):
    """HCCL Mesh inside one full-mesh server (HCCL user guide, "Mesh")."""
    _, link, _ = _rates(profile, Group((k,)))
    a, b = profile.intra_node.latency, 1.0 / link
    if kind in ("all_reduce", "broadcast"):
        return 2 * a + 2 * n / k * b
    if kind == "send_recv":
        return a + n * b
    return a + n / k * b  # reduce_scatter, all_gather, all_to_all


def _intra(kind, n, k, profile):
    """The library's intra-node algorithm for one phase of k ranks."""
    if k == 1 or n == 0:
        return 0.0
    if profile.topology.intra_fabric == "full_mesh":
        return _mesh(kind, n, k, profile)
    return _ring(kind, n, Group((k,)), profile)


def _inter(kind, n, m, profile):
    """The inter-node phase among m ranks, one per node, each on its own NIC."""
    if m == 1 or n == 0:
        return 0.0
    link = Link("nic", _rates(profile, Group((1,) * m))[2], profile.inter_node.latency)
    if profile.topology.library == "nccl":
        return _cost.collective_time(kind, n, m, link, "ring")
    return min(_cost.collective_time(kind, n, m, link, a) for a in ("ring", "tree"))


def _phases(kind, n, g, profile, c=1):
    """Per-chunk phase times (x, y, z): z runs on the same links as x."""
    k, m, nc = g.local, g.nodes, n / c
    if kind == "all_reduce":
        return (_intra("reduce_scatter", nc, k, profile), _inter("all_reduce", nc / k, m, profile),
                _intra("all_gather", nc, k, profile))
    if kind == "all_gather":
        return _inter("all_gather", nc / k, m, profile), _intra("all_gather", nc, k, profile), 0.0
    if kind == "reduce_scatter":
        return (_intra("reduce_scatter", nc, k, profile),
                _inter("reduce_scatter", nc / k, m, profile), 0.0)
    if kind == "all_to_all":
        return _intra("all_to_all", nc, k, profile), _inter("all_to_all", nc, m, profile), 0.0
    return _inter("broadcast", nc, m, profile), _intra("broadcast", nc, k, profile), 0.0


def phase_times(kind: str, n: float, g: Group, profile: Profile, chunks: int = 1):
    """Per-chunk seconds (x, y, z) of the hierarchical phases of one collective cut into
    ``chunks`` pieces: for all_reduce x = intra-node reduce-scatter, y = inter-node
    all-reduce of n / (chunks k), z = intra-node all-gather (z on the same links as x;
    other kinds: the two phases of ``cost.hierarchical_time`` and z = 0).  The prices
    "hierarchical" (chunks = 1: x + y + z) and "pipelined" are built from these."""
    if not g.even:
        raise ValueError(f"phase_times needs the same number of ranks on every node; ranks "
                         f"per node are {list(g.per_node)}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be an int >= 1")
    return _phases(kind, n, g, profile, chunks)


def pipelined_seconds(x: float, y: float, z: float, c: int) -> float:
    """The pipelined schedule's time for per-chunk phase times x (intra), y (inter),
    z (intra, after y) over ``c`` chunks (module docstring): x + y + z for c = 1, else
    (c-1) max(x + z, y) + x + max(y, z) + z (the last all-gather waits for the previous
    one when z > y: the two share the intra-node links)."""
    if c == 1:
        return x + y + z
    return (c - 1) * max(x + z, y) + x + max(y, z) + z


def _pipelined(kind, n, g, profile):
    best = math.inf
    for c in _CHUNKS:
        best = min(best, pipelined_seconds(*_phases(kind, n, g, profile, c), c))
    return best


def algorithm_time(kind: str, n: float, g: Group, profile: Profile, algorithm: str) -> float:
    """Seconds for one collective with a named algorithm (module docstring)."""
    if algorithm not in PRICE_ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: use one of {['auto', *PRICE_ALGORITHMS]}")
    if g.p == 1 or n == 0:
        return 0.0
    if kind == "send_recv":
        return _cost.collective_time("send_recv", n, 2, flat_link(profile, g))
    if algorithm == "ring":
        return _ring(kind, n, g, profile)
    if algorithm == "halving_doubling":
        return _cost.collective_time(kind, n, g.p, flat_link(profile, g), "tree")
    if algorithm == "tree":
        if kind != "all_reduce":
            raise ValueError(f"algorithm='tree' (NCCL's double binary tree) exists for "
                             f"all_reduce only, not kind={kind!r}: use 'ring' or "
                             f"'halving_doubling'")
        if _uses_net_model(kind, g, profile, "tree"):
            return min(_net_protocols(kind, n, g, profile, "tree").values())
        ai, ae = profile.intra_node.latency, profile.inter_node.latency
        depth = (g.nodes - 1).bit_length()
        rate = flat_link(profile, g).bandwidth
        return 2 * (depth * ae + (g.local - 1) * ai) + 2 * n / rate
    if algorithm == "mesh":
        if profile.topology.intra_fabric != "full_mesh" or g.nodes != 1:
            raise ValueError(f"algorithm='mesh' needs a group inside one full-mesh node; "
                             f"profile {profile.name!r} has a {profile.topology.intra_fabric} "
                             f"and the group spans {g.nodes} node(s): use 'auto' or 'ring'")
        return _mesh(kind, n, g.p, profile)
    if algorithm == "pairwise":
        if kind != "all_to_all":
            raise ValueError(f"algorithm='pairwise' is an all_to_all algorithm, not for "
                             f"kind={kind!r}")
        if g.nodes == 1 and profile.topology.protocols:
            return _ring(kind, n, g, profile)   # inside a node: the protocols' steps
        ring_intra, _, nic = _rates(profile, g)
        a = profile.inter_node.latency if g.nodes > 1 else profile.intra_node.latency
        inside = (g.local - 1) / g.p * n / ring_intra
        outside = (g.p - g.local) / g.p * n / nic
        return (g.p - 1) * a + max(inside, outside)
    if not g.even:
        raise ValueError(f"algorithm={algorithm!r} needs the same number of ranks on every "
                         f"node; ranks per node are {list(g.per_node)}: use 'ring', "
                         f"'halving_doubling' or 'auto'")
    if algorithm == "hierarchical":
        return sum(_phases(kind, n, g, profile))
    return _pipelined(kind, n, g, profile)


def _candidates(kind: str, g: Group, profile: Profile):
    """(algorithms the library picks from, why) for this group."""
    lib, fabric = profile.topology.library, profile.topology.intra_fabric
    where = (f"{g.p} ranks in one node" if g.nodes == 1 else
             f"{g.nodes} nodes x {g.local} rank(s)" if g.even else
             f"{g.nodes} nodes, uneven {list(g.per_node)}")
    if kind == "send_recv":
        return ("ring",), f"{lib.upper()} point-to-point over the link between the two ranks"
    if lib == "nccl":
        if kind == "all_to_all":
            return ("pairwise",), f"NCCL all_to_all is grouped send/recv to every peer ({where})"
        if kind == "all_reduce" and g.nodes > 1:
            return ("ring", "tree"), (f"NCCL all_reduce across nodes: ring or double binary "
                                      f"tree, whichever its tuning model predicts faster ({where})")
        return ("ring",), (f"NCCL {kind} uses ring" + (" inside a node (tree spans nodes)"
                           if kind == "all_reduce" else "") + f" ({where})")
    if g.nodes == 1:
        if fabric == "full_mesh":
            links = profile.topology.intra_links
            used = (f"all {links} HCCS links" if g.p - 1 >= links else
                    f"{g.p - 1} of its {links} HCCS links (one per peer)")
            return ("mesh",), (f"HCCL inside a server: Mesh, each NPU sending on {used} "
                               f"at once (level0, fixed by the hardware) ({where})")
        return ("ring",), f"HCCL inside a switched node: ring ({where})"
    if g.local == 1 or not g.even:
        opts = ("pairwise",) if kind == "all_to_all" else ("ring", "halving_doubling")
        return opts, f"HCCL level1 between servers: {' or '.join(opts)} ({where})"
    if kind == "all_to_all":
        return ("pairwise", "hierarchical"), f"HCCL all_to_all across servers ({where})"
    if kind == "broadcast":
        return ("hierarchical",), f"HCCL broadcast: between servers, then inside ({where})"
    return ("hierarchical", "pipelined"), (f"HCCL across servers: level0 mesh + level1, "
                                           f"or the pipeline algorithm overlapping them ({where})")


@lru_cache(maxsize=65536)
def choose(kind: str, n: float, g: Group, profile: Profile) -> Choice:
    """The algorithm ``profile``'s library runs for this collective, its time and why
    (cached: planners price the same collective many times)."""
    names, why = _candidates(kind, g, profile)
    times = {a: algorithm_time(kind, n, g, profile, a) for a in names}
    best = min(names, key=lambda a: times[a])  # min keeps the first of equal times
    proto = protocol_of(kind, n, g, profile, "tree" if best == "tree" else "ring") \
        if best in ("ring", "pairwise", "tree") else ""
    if proto:
        why += f"; protocol {proto} (the fastest by the library's tuning model)"
    return Choice(best, times[best], profile.topology.library, why,
                  MappingProxyType(times))
