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
kernel's measured bandwidth); ``overlap`` stretches a kernel that shares the SMs
with a collective.
"""
from __future__ import annotations

import math

from . import topology as _topo
from .profiles import OP_CLASSES, Link, Profile, get_profile

__all__ = ["KINDS", "ALGORITHMS", "wire_bytes", "collective_time", "hierarchical_time",
           "link_for", "choose", "price", "compute_time", "explain_compute", "alg_bandwidth",
           "bus_bandwidth", "overlap", "gemm_efficiency"]

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
    broadcast and send_recv n (the root / sender); 0 when p == 1. When p does not
    divide n the shards are uneven (``torch.chunk``) and ranks send different
    amounts; the formula is then their mean, rounded down to whole bytes (exact
    integers whenever p divides n).
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
    g = _topo.group_of(ranks, profile)
    _check(kind, nbytes, g.p)
    if algorithm == "auto":
        return _topo.choose(kind, nbytes, g, profile).seconds
    return _topo.algorithm_time(kind, nbytes, g, profile, algorithm)


def _gemm_shape(gemm):
    if gemm is None:
        return None
    if not isinstance(gemm, (tuple, list)) or len(gemm) != 3 or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in gemm):
        raise ValueError(f"gemm={gemm!r} must be the output's (batch, rows, columns), "
                         f"three ints >= 0, or None")
    return tuple(gemm)


def gemm_efficiency(gemm, profile, sms: "int | None" = None) -> float:
    """The fraction of the matmul rate a GEMM whose output is ``gemm = (batch, rows,
    columns)`` keeps after tile and wave quantization, on ``sms`` of the device's SMs
    (default all).

    NVIDIA, "Matrix Multiplication Background User's Guide" (DU-09799-001, 2023),
    sec. 3: the output is cut into tiles of the profile's ``gemm_tile`` (m x n), one
    thread block each; ``per_sm`` of them run at once on each SM, so tiles run in
    waves of ``sms x per_sm`` and a partly filled last wave, or a tile partly
    outside the matrix, takes as long as a full one. With W = sm_count x per_sm
    (a full wave on the whole device) and w = sms x per_sm:

        efficiency = batch x rows x columns / (ceil(tiles / w) x W x m x n),
        tiles = batch x ceil(rows / m) x ceil(columns / n)

    (1.0 when the tiles exactly fill waves of the whole device; the better of the
    tile's two orientations, m x n or n x m). The profile's matmul
    efficiency is the best shape's measured rate, which fills its waves; this factor
    is what other shapes lose. A GEMM of fewer tiles than one wave on the whole device
    is small: cuBLAS picks smaller tiles for it (the guide, sec. 2.3), which this
    model does not follow: it keeps the unquantized rate, scaled by sms / sm_count.
    A profile without ``gemm_tile`` (or without ``topology.sm_count``) gives
    sms / sm_count (1.0 when all SMs run it)."""
    profile = get_profile(profile)
    b, rows, cols = _gemm_shape(gemm)
    t = profile.topology
    total = t.sm_count
    if not total and sms is None:
        return 1.0
    sms = total if sms is None else sms
    if isinstance(sms, bool) or not isinstance(sms, int) or not 0 < sms <= max(total, 1):
        raise ValueError(f"sms={sms!r} must be an int in [1, {total}] (the device's SMs)")
    share = sms / total if total else 1.0
    tile = profile.gemm_tile
    if not tile or b * rows * cols == 0:
        return share
    tm, tn, per = tile["m"], tile["n"], tile["per_sm"]
    full = total * per
    best = 0.0
    for m, n in ((tm, tn), (tn, tm)):     # cuBLAS has the tile both ways round
        tiles = b * -(-rows // m) * -(-cols // n)
        if tiles < full:
            return share
        waves = -(-tiles // (sms * per))
        best = max(best, b * rows * cols / (waves * full * m * n))
    return best


def compute_time(flops: float, bytes_moved: float, profile, dtype,
                 op_class: str = "elementwise", launches: int = 1,
                 kernel: "str | None" = None, gemm=None) -> float:
    """Seconds for ``launches`` kernels doing ``flops`` and moving ``bytes_moved``:
    a roofline (Williams, Waterman & Patterson 2009) with measured efficiencies,

        max(flops / (peak[dtype] x efficiency[op_class]),
            bytes_moved / (memory_bandwidth x memory_efficiency)) + launches x launch_overhead

    ``dtype`` is a torch dtype or a name ("bfloat16", "fp32", "float64", "int64"...);
    a dtype with a slow path on the profile (the 910B runs float64 on its AI CPU)
    is priced on that engine's rates and launch cost. ``op_class`` is one of
    ``profiles.OP_CLASSES``. ``launches=0`` prices work fused into another kernel.
    ``kernel`` names a kernel whose achieved bandwidth the profile measured
    (``profile.kernel_bandwidth``): its bytes then move at that rate instead of
    memory_bandwidth x memory_efficiency (a name the profile lacks falls back to
    those, so profiles without the measurement price as before).
    ``gemm``: a matmul's output shape ``(batch, rows, columns)``; its compute term is
    then divided by ``gemm_efficiency`` (tile and wave quantization).
    """
    for name, v in (("flops", flops), ("bytes_moved", bytes_moved)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) \
                or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}={v!r} must be a number >= 0")
    if op_class not in OP_CLASSES:
        raise ValueError(f"op_class={op_class!r} is not an op class the clock knows; use "
                         f"one of {list(OP_CLASSES)}")
    if isinstance(launches, bool) or not isinstance(launches, int) or launches < 0:
        raise ValueError(f"launches={launches!r} must be the number of kernels, an int >= 0")
    if kernel is not None and (not isinstance(kernel, str) or not kernel):
        raise ValueError(f"kernel={kernel!r} must be a kernel name (a str) or None")
    profile = get_profile(profile)
    engine, peak, bandwidth, launch = _rates(profile, dtype, op_class, kernel)
    if _gemm_shape(gemm) is not None and op_class == "matmul" and engine == "main":
        peak *= gemm_efficiency(gemm, profile)
    return max(flops / peak, bytes_moved / bandwidth) + launches * launch


def _rates(profile, dtype, op_class, kernel=None):
    """(engine, FLOP/s, bytes/s, seconds per launch) a kernel runs at."""
    engine, peak, bandwidth, launch = profile.compute_path(dtype)
    if engine == "main":
        peak *= profile.efficiency.get(op_class, 1.0)
        if kernel in profile.kernel_bandwidth:
            bandwidth = profile.kernel_bandwidth[kernel]
        else:
            bandwidth *= profile.memory_efficiency
    return engine, peak, bandwidth, launch


def explain_compute(flops: float, bytes_moved: float, profile, dtype,
                    op_class: str = "elementwise", launches: int = 1,
                    kernel: "str | None" = None) -> dict:
    """``compute_time``'s terms as plain data, for the course: the compute, memory
    and launch seconds, the engine, and what bounds the kernel."""
    total = compute_time(flops, bytes_moved, profile, dtype, op_class, launches, kernel)
    profile = get_profile(profile)
    engine, peak, bandwidth, launch = _rates(profile, dtype, op_class, kernel)
    terms = {"compute": flops / peak, "memory": bytes_moved / bandwidth,
             "launch": launches * launch}
    return {**terms, "seconds": total, "engine": engine, "op_class": op_class,
            "bound": max(terms, key=terms.get)}


def overlap(compute_seconds: float, comm_seconds: float, profile,
            gemm=None) -> tuple[float, float]:
    """A kernel and a collective running at the same time: (the kernel's stretched
    seconds, the collective's exposed seconds after the kernel ends).

    The collective's kernel holds ``topology.collective_sms`` of the device's
    ``topology.sm_count`` SMs while it runs (NCCL: one SM per channel, not shared
    with compute kernels, NVIDIA/nccl #689), so the kernel progresses at
    r = (sm_count - collective_sms) / sm_count meanwhile (it is assumed to scale
    with SMs: a large GEMM does). With G the kernel alone and C the collective:
    r C >= G: the kernel ends at G / r, the collective shows C - G / r;
    else the kernel ends at G + (1 - r) C and hides the collective. A profile
    with no SM figures (r = 1) gives (G, max(0, C - G)). For a GEMM given by its
    output ``gemm = (batch, rows, columns)``, r is the ratio of ``gemm_efficiency``
    on the SMs left to that on all of them: its tiles then run in more, partly
    filled waves (the tail effect of a GEMM beside an NCCL kernel, NVIDIA Developer
    Forums, "Compute-Communication Overlap Causes Severe GEMM Performance
    Degradation because of Tail Effect", 2025). Competition for HBM bandwidth
    (NCCL's traffic crosses memory two or three times) is not modeled.
    """
    for name, v in (("compute_seconds", compute_seconds), ("comm_seconds", comm_seconds)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) \
                or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}={v!r} must be seconds >= 0")
    prof = get_profile(profile)
    t = prof.topology
    if not t.sm_count or not t.collective_sms or comm_seconds == 0:
        r = 1.0
    elif _gemm_shape(gemm) is None:
        r = (t.sm_count - t.collective_sms) / t.sm_count
    else:
        r = gemm_efficiency(gemm, prof, t.sm_count - t.collective_sms) / \
            gemm_efficiency(gemm, prof)
    g, c = float(compute_seconds), float(comm_seconds)
    if r * c >= g:
        return g / r, c - g / r
    return g + (1 - r) * c, 0.0


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
