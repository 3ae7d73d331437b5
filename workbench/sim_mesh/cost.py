"""The alpha-beta cost model: what a collective or a kernel costs on a profile.

A message of n bytes over a link costs ``alpha + n * beta``: alpha is the link's
latency, beta = 1 / bandwidth (see ``profiles.Link``). A collective over p ranks
is a sequence of such steps; its time is the sum over steps (Hockney 1994;
Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH", 2005; Chan et al. 2007). Formulas (n bytes, p ranks):

    kind            "ring"                               "tree"
    all_reduce      2(p-1) a + 2 (p-1)/p n b             2 L a + 2 (p-1)/p n b
                                                         (recursive halving + doubling,
                                                          Rabenseifner: reduce-scatter then
                                                          all-gather, each "tree" below)
    all_gather      (p-1) a + (p-1)/p n b                L a + (p-1)/p n b (recursive doubling)
    reduce_scatter  (p-1) a + (p-1)/p n b                L a + (p-1)/p n b (recursive halving)
    all_to_all      (p-1) a + (p-1)/p n b  (pairwise)    L a + L n/2 b     (Bruck)
    broadcast       a + n b  (pipelined chain, fill      L (a + n b)       (binomial tree)
                    time neglected)
    send_recv       a + n b                              a + n b

with L = ceil(log2 p). The "tree" rows are exact for powers of two and the usual
approximations otherwise. The all-reduce "tree" row is Rabenseifner's algorithm
(Thakur et al. 2005), which is never slower in this model than a reduce-scatter
followed by an all-gather, so a reshard planner never finds it cheaper to split an
all-reduce in two. (NCCL's double binary tree, 2 L a + 2 n b, is dominated by it
in the alpha-beta model; ``price(..., "tree")`` prices it on the topology.)

Size convention: ``nbytes`` is the full buffer per rank: the tensor being
all-reduced; the gathered OUTPUT of all_gather; the INPUT of reduce_scatter; the
bytes each rank holds (sends and receives) in all_to_all; the message of
broadcast and send_recv. This is also nccl-tests' "size", so ``bus_bandwidth``
reads the same numbers. p == 1 or nbytes == 0 costs 0.0 (nothing moves).

``collective_time`` prices one algorithm on one link; ``price`` prices a group of
ranks on a profile's topology with the algorithm NCCL or HCCL actually runs
(``topology.py``: NVSwitch, HCCS full mesh, one NIC per device between nodes;
ring / tree / mesh / halving-doubling / pairwise / hierarchical / pipelined; NCCL's
LL / LL128 / Simple protocols inside a node where the profile lists them), and
``choose`` says which algorithm and why. ``compute_time`` prices a kernel on the
profile's roofline with its efficiency per op class and launch cost (or a named
kernel's measured bandwidth, and a GEMM's tile and wave quantization); ``overlap``
stretches a kernel that shares the SMs with a collective (both in ``kernel_cost.py``,
re-exported here).
"""
from __future__ import annotations

import math

from . import topology as _topo
from .kernel_cost import AttentionShape, compute_time, explain_compute, finish_beside, \
    gemm_efficiency, hbm_share, overlap, overlap_rate
from .profiles import Link, Profile, get_profile
from .profiles import profile_memo as _profile_memo

__all__ = ["AttentionShape", "KINDS", "ALGORITHMS", "wire_bytes", "collective_time", "send_link",
           "hierarchical_time", "link_for", "choose", "price", "sent_buffer", "compute_time", "explain_compute", "alg_bandwidth",
           "bus_bandwidth", "overlap", "overlap_rate", "hbm_share", "finish_beside",
           "gemm_efficiency"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
ALGORITHMS = ("ring", "tree")


def _check(kind, nbytes, p):
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a collective; use one of {list(KINDS)}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) \
            or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r} must be a number of bytes >= 0")
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"p={p!r} must be the number of ranks, an int >= 1")


def _log2(p: int) -> int:
    return (p - 1).bit_length()  # ceil(log2 p) for p >= 1


def wire_bytes(kind: str, nbytes: int, p: int) -> int:
    """Bytes each rank sends, the "bytes moved" a plan reports (ring algorithms).

    all_reduce 2(p-1)/p n; all_gather, reduce_scatter, all_to_all (p-1)/p n;
    broadcast and send_recv n (the root / sender); 0 when p == 1. Exact integers
    whenever the shards are even (p divides n); rounded down to whole bytes otherwise.

    Uneven shards (``torch.chunk`` pieces: ranks send different amounts), the
    convention of plans and traces (simulator and torch.distributed alike):

    * all_to_all: not this formula.  The step's and each group's event bytes are the
      busiest rank's, exact (``grid.all_to_all_sent``: its shard less the piece it
      keeps; ``parallel.layout.all_to_all_sent`` for a plan), priced as the buffer
      :func:`sent_buffer` gives; the backward all-to-all counts the gradient's own
      shards.  4 x 12288 f32 S(1) -> S(0) on 3 ranks: rank 2 sends 65,536 B, where
      (p-1)/p of the largest shard is 43,690 B.
    * all_gather / reduce_scatter: not this formula on the largest buffer (the gathered
      output, the input).  Every rank sends p-1 pieces padded to its group's largest
      (DTensor pads them, ``sim_mesh/padded.py`` runs them so on torch.distributed), so
      the step's and each group's event bytes are (p-1) times the group's largest piece
      (``grid.gather_sent``; ``parallel.layout.gather_sent`` for a plan), priced as the
      buffer :func:`sent_buffer` gives (the padded p pieces), the backward collective
      the same: rows 2, 2, 0 of f32 on 3 ranks send 16 B (this formula on the 16 B
      gathered buffer: 10 B); 75 rows of 64 f32 on 2 ranks, 38 rows, 9,728 B (9,600 B).
    """
    _check(kind, nbytes, p)
    n = int(nbytes)
    if p == 1:
        return 0
    if kind == "all_reduce":
        return 2 * (p - 1) * n // p
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) * n // p
    return n  # broadcast, send_recv


def sent_buffer(kind: str, sent: int, p: int) -> float:
    """The buffer n whose :func:`wire_bytes` is ``sent``, the bytes the busiest rank
    sends: ``sent * p / (p - 1)`` for all_gather, reduce_scatter, all_to_all (the
    inverse of their (p-1)/p n).  An uneven all-to-all (torch.chunk pieces) has ranks
    that send more than (p-1)/p of the largest shard (4 rows on 3 ranks are cut 2, 2, 0:
    the third rank sends all 4); the collective ends when its busiest rank is done, so
    the clock prices this buffer, exact for the ring and pairwise formulas (bandwidth
    term (p-1)/p n beta = sent beta, module docstring)."""
    _check(kind, sent, p)
    if kind not in ("all_gather", "reduce_scatter", "all_to_all"):
        raise ValueError(f"sent_buffer(kind={kind!r}): only all_gather, reduce_scatter and "
                         "all_to_all send (p-1)/p of their buffer")
    return 0 if p == 1 or sent == 0 else sent * p / (p - 1)


def collective_time(kind: str, nbytes: float, p: int, link: Link,
                    algorithm: str = "ring") -> float:
    """Seconds for one collective over p ranks on one link (formulas in the module
    docstring). ``algorithm`` is "ring" or "tree"."""
    _check(kind, nbytes, p)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: use one of {list(ALGORITHMS)} "
                         f"(price() also takes 'auto' and the topology's algorithms, e.g. 'mesh')")
    if not isinstance(link, Link):
        raise ValueError(f"link={link!r} must be a profiles.Link "
                         f"(e.g. get_profile('a100').intra_node)")
    if p == 1 or nbytes == 0:
        return 0.0
    a, b, n, L = link.latency, 1.0 / link.bandwidth, float(nbytes), _log2(p)
    share = (p - 1) / p * n
    if kind == "send_recv":
        return a + n * b
    if algorithm == "ring":
        if kind == "all_reduce":
            return 2 * (p - 1) * a + 2 * share * b
        if kind == "broadcast":
            return a + n * b
        return (p - 1) * a + share * b  # all_gather, reduce_scatter, all_to_all
    if kind == "all_reduce":
        return 2 * L * a + 2 * share * b
    if kind == "broadcast":
        return L * (a + n * b)
    if kind == "all_to_all":
        return L * a + L * (n / 2) * b
    return L * a + share * b  # all_gather, reduce_scatter


def hierarchical_time(kind: str, nbytes: float, p_local: int, p_nodes: int,
                      intra: Link, inter: Link, algorithm: str = "ring") -> float:
    """Seconds for a collective over p_local ranks on each of p_nodes nodes, done in
    phases (each phase with ``algorithm``; the p_local inter-node phases run in
    parallel, one per device and its own NIC):

    - all_reduce: intra reduce-scatter(n), inter all-reduce(n / p_local), intra
      all-gather(n) (as NCCL/Horovod hierarchical all-reduce).
    - all_gather: inter all-gather(n / p_local), then intra all-gather(n).
    - reduce_scatter: intra reduce-scatter(n), then inter reduce-scatter(n / p_local).
    - all_to_all: intra all-to-all(n) grouping data by destination node, then
      inter all-to-all(n) (2-D hierarchical all-to-all, as in Tutel / DeepSpeed-MoE).
    - broadcast: inter broadcast(n) among one rank per node, then intra broadcast(n).

    The bytes each rank sends add up to ``wire_bytes`` for all_gather,
    reduce_scatter and all_reduce: the decomposition moves no extra data, it just
    puts most of it on the fast link.
    """
    if kind == "send_recv":
        raise ValueError("kind='send_recv' is point-to-point, it has no hierarchical "
                         "form; use collective_time('send_recv', n, 2, link)")
    for name, v in (("p_local", p_local), ("p_nodes", p_nodes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    _check(kind, nbytes, p_local * p_nodes)

    def t(k, n, p, link):
        return collective_time(k, n, p, link, algorithm)

    n, pl, pg = nbytes, p_local, p_nodes
    if kind == "all_reduce":
        return (t("reduce_scatter", n, pl, intra) + t("all_reduce", n / pl, pg, inter)
                + t("all_gather", n, pl, intra))
    if kind == "all_gather":
        return t("all_gather", n / pl, pg, inter) + t("all_gather", n, pl, intra)
    if kind == "reduce_scatter":
        return t("reduce_scatter", n, pl, intra) + t("reduce_scatter", n / pl, pg, inter)
    if kind == "all_to_all":
        return t("all_to_all", n, pl, intra) + t("all_to_all", n, pg, inter)
    return t("broadcast", n, pg, inter) + t("broadcast", n, pl, intra)


def _layout(ranks, profile: Profile) -> list[int]:
    """Ranks per node, for the nodes the group touches."""
    return list(_topo.group_of(ranks, profile).per_node)


def link_for(ranks, profile) -> Link:
    """The link a group's traffic is limited by: the intra-node link when all
    ranks share a node (node = rank // devices_per_node), else the inter-node one."""
    profile = get_profile(profile)
    return profile.intra_node if len(_layout(ranks, profile)) == 1 else profile.inter_node


def send_link(ranks, profile) -> Link:
    """The link ``price("send_recv", n, ranks, profile)`` prices a send between the two
    ``ranks`` on (``topology.py``): inside a node the switch port (one HCCS link on a
    full mesh) at the library's efficiency; across nodes the node's NIC share, capped at
    ``Topology.ring_nics`` adapters where the profile sets it.  :func:`link_for` is the
    raw link (line rate); a threshold set against a send's time reads this one."""
    profile = get_profile(profile)
    g = _topo.group_of(ranks, profile)
    if g.p != 2:
        raise ValueError(f"send_link(ranks={list(ranks)!r:.60}): give the two ranks of one "
                         "send")
    return _topo.flat_link(profile, g)


def choose(kind: str, nbytes: float, ranks, profile) -> "_topo.Choice":
    """Which algorithm the profile's library (NCCL or HCCL) runs for this collective,
    its time, why, and the times of the options it chose from (``topology.py``)."""
    profile = get_profile(profile)
    g = _topo.group_of(ranks, profile)
    _check(kind, nbytes, g.p)
    return _topo.choose(kind, nbytes, g, profile)


def price(kind: str, nbytes: float, ranks, profile, algorithm: str = "auto") -> float:
    """Seconds for a collective over ``ranks`` on ``profile``'s topology.

    ``algorithm="auto"`` prices what the vendor library runs (``choose``); a name
    from ``topology.PRICE_ALGORITHMS`` ("ring", "tree", "halving_doubling",
    "mesh", "pairwise", "hierarchical", "pipelined") prices that algorithm, or
    says why it does not apply to this group. p == 1 or nbytes == 0 costs 0.0.
    """
    profile = get_profile(profile)
    g = _topo.group_of(ranks, profile)          # checks the ranks (memoized)
    # memoized per profile (a trace prices the same collectives every step); nbytes's
    # type in the key, so that a bool still raises
    key = (kind, type(nbytes), nbytes, g, algorithm)
    memo = _profile_memo("price", profile)
    got = memo.get(key)
    if got is not None:
        return got
    _check(kind, nbytes, g.p)
    if algorithm == "auto":
        got = _topo.choose(kind, nbytes, g, profile).seconds
    else:
        got = _topo.algorithm_time(kind, nbytes, g, profile, algorithm)
    if len(memo) >= _PRICE_MAX:
        memo.clear()
    memo[key] = got
    return got


_PRICE_MAX = 1 << 16            # collectives remembered per profile; then it starts again


_BUS_FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p,
               "all_gather": lambda p: (p - 1) / p,
               "reduce_scatter": lambda p: (p - 1) / p,
               "all_to_all": lambda p: (p - 1) / p,
               "broadcast": lambda p: 1.0,
               "send_recv": lambda p: 1.0}


def alg_bandwidth(nbytes: float, seconds: float) -> float:
    """nccl-tests' "algbw": size / time, bytes/s (size per the module's convention)."""
    if not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"seconds={seconds!r} must be > 0")
    return nbytes / seconds


def bus_bandwidth(kind: str, nbytes: float, p: int, seconds: float) -> float:
    """nccl-tests' "busbw" (nccl-tests doc/PERFORMANCE.md): algbw x 2(p-1)/p for
    all_reduce, x (p-1)/p for all_gather, reduce_scatter, all_to_all, x 1 for
    broadcast and send_recv. A ring collective reaches busbw == link bandwidth
    when latency is negligible, whatever p is."""
    _check(kind, nbytes, p)
    return alg_bandwidth(nbytes, seconds) * _BUS_FACTOR[kind](p)
