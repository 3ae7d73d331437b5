"""What a kernel costs on a profile: the roofline of ``compute_time`` with the profile's
efficiency per op class, launch cost and measured kernel bandwidths; the tile and wave
quantization of GEMMs (``gemm_efficiency``); and a kernel sharing the SMs with a
collective (``overlap``).  ``sim_mesh.cost`` re-exports these names: the clock's one
place for prices is that module, this file holds its compute half.

A kernel beside a collective: what is modeled is NCCL's SM share (``collective_sms``:
one SM per channel, 24 channels inside an NVSwitch node of 8 A100 or H100, 16 across
nodes of 8 NICs, 2 across Jean Zay's Omni-Path nodes, each from NCCL's own logs) and a
GEMM's extra waves on the SMs left (``overlap``).  The memory bandwidth the collective's
traffic takes (``hbm_share``) is a component with no point: the profiles give it factor
0 (their ``topology.collective_hbm_factor``), the estimate's range 3 at its slow end
(``plan.ranges``).  UNCERTAIN, what the component measurements found say:

- HBM contention.  The mechanism, NCCL's maintainer (S. Jeaugey, NVIDIA/nccl #1428,
  2024-09): the kernels beside a collective are "Very likely ... competing for memory
  bandwidth"; the NVLink rate "needs to be multiplied by at least 2x for memory bandwidth,
  as we need to store to memory, then read back from it. If you add reading from or
  writing to user data, it can be 3x".  ``hbm_share``: that factor x the group's link
  rate over the HBM bandwidth, every kernel beside the collective slowed by that share on
  top of the SMs (an ASSUMPTION: a compute-bound GEMM need not lose the whole share).
  The figures (tests/test_i21c11.py holds each inside the range, factor 0 .. 3):
  pytorch/pytorch PR #172714 (2026-01, 8 x H100 on NVLink, benchmarks/distributed/
  bench_overlapped_matmul_allgather.py): an fp16 8192^3 matmul and an all-gather of 64 MiB
  per rank, 2.96 ms one after the other, 2.02 ms overlapped, 1.77 ms with NCCL's
  copy-engine all-gather (NCCL_CTA_POLICY_ZERO: no SMs; the copy engine's own rate
  unknown, so that figure isolates nothing); the clock: 2.90 ms, 1.81 ms with the SMs
  alone, 2.05 at factor 2 (1.5-1.9 fits).  #1428 (A100-SXM4-80GB, a GPT training under
  Nsight Systems, beside an AllGather, sizes not given): attention 0.18 -> 0.33 ms
  (1.83x), a GEMM 1.18 -> 2.08 ms (1.76x), an elementwise kernel 0.02 -> 0.05 ms (2.5x,
  at 10 us resolution); the SM share 1.29x, factor 2 .. 3 at the link's full rate 1.67 ..
  1.97x (2.3-2.6 fits).  Korthikanti et al. 2022 Table 4 (A100, one layer, tensor
  parallelism 8; tests/test_table4.py): the backward 11.88 ms at factor 0 against the
  published 11.9, 12.16 at factor 2 (above it by 2.2%; the sequence-parallel rows, 2% low
  at 0, fit 1.5-2).  pytorch/pytorch PR #179937 (2026-04, 8 x H100, FSDP): "NCCL
  collectives use SMs, which makes matmuls that are overlapped by them 30-40% slower" (a
  statement: the SM share 1.22x, factor 2 1.57x; 0.6-1.2 fits).  So the figures need
  factors from about 0 to 2.6: none is the point.  Not testable: Lee et al.,
  "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
  Learning" (arXiv:2507.03114, 2025), GPT and LLaMA on 4 A100, H100, MI250 or MI210:
  compute 18.9% slower on average beside communication, 40.0% at most (its per-kernel,
  per-GPU tables not in any stored copy: only the abstract and introduction were found);
  Hetu-Galvatron's galvatron/profile_hardware/profile_overlap.py (an fp32 1024 x 4096 x
  4096 Linear beside a 64 MB fp32 all-reduce, the larger of the two slowdowns): the
  committed hardware_configs/overlap_coefficient.json (AFDWang/Hetu-Galvatron, 3318a0b3)
  says 1.146, its GPU and group not given;
  NVIDIA/nccl #338 (2020, V100, Horovod): batch-norm backward kernels 2 ms alone, 4-8 ms
  beside a 25M-element fp16 all-reduce; parasailteam/coconet #6 (8 V100, a CUTLASS GEMM
  beside a 24-channel all-reduce): the pair slower than the two in sequence; AMD's
  characterizations on MI-series GPUs (Agrawal et al., arXiv:2412.14335: concurrent
  computation and communication reach 21% of the ideal speedup on average; FiCCO,
  arXiv:2512.10236; Cui & Pericas, arXiv:2606.09200 on A40 / A100 / H100 / MI250X) and
  Echo (arXiv:2412.12487, which models the slowdown) give no per-kernel figure in what was
  found; openxla/xla PR #33613: NCCL 2.28's fewer-SM policy, 7% faster Llama 3.1 8B on 8
  H100 (end to end).  Across nodes (the rows' data-parallel groups) the collective's HBM
  traffic runs at the NICs' rate: 2-3% of HBM at factor 2.
- The collective slowed by the kernel beside it.  NVIDIA/nccl #1433 (2024-09): a
  128-CTA CUTLASS GEMM on a 142-SM GPU beside ncclSend / ncclRecv (one CTA each): both
  slower, the communication up to 2x; the maintainer: "You may not compete for SMs but
  still compete for memory bandwidth".  No figure per collective and size.
- NCCL's channels for a group with fewer ranks per node than the node's GPUs (a
  data-parallel group beside tensor parallelism 8 has one per node): priced from NCCL's
  graph search where the profile's node links and NCCL release are read
  (``nccl_channels``: DGX A100 2 / 4 / 8 / 16 SMs for 1 / 2 / 4 / 8 ranks per node, DGX
  H100 under 2.20-2.21 4 / 8 / 16 / 16); other profiles and releases keep the all-ranks
  figure (``topology.collective_sms``, the profiles' citations: ASSUMPTION).
- Collectives of several groups in flight beside one kernel (a tensor-parallel
  all-reduce beside a data-parallel reduce-scatter): the kernel runs at the lowest of
  their rates, not at their summed SMs (``finish_beside``: ASSUMPTION, no measurement).
- A ring's send / recv (context parallelism): the SMs of a collective over its group
  (``plan.context_cost``: ASSUMPTION, NCCL's p2p channels for it not logged).
"""
from __future__ import annotations

import math
from typing import NamedTuple

from .profiles import OP_CLASSES, dtype_name, get_profile, profile_memo

__all__ = ["compute_time", "explain_compute", "gemm_efficiency", "overlap", "overlap_rate",
           "collective_sms", "hbm_share", "finish_beside", "AttentionShape"]


class AttentionShape(NamedTuple):
    """A fused attention kernel's shape, given to ``compute_time`` as its ``gemm`` (op
    class "attention"): a profile with ``measured`` attention prices it at the rate
    measured for this shape (``sim_mesh.measured``)."""
    bh: int                 # batch x heads (query heads)
    seq: int
    head_dim: int
    causal: bool
    backward: bool
    dropout: bool = False   # attention dropout inside the kernel (CUDNN_DROPOUT_TIME)


# cuDNN's fused attention with attention dropout 0.1 against without: forward + backward
# through Transformer Engine's DotProductAttention (the FusedAttention backend forced,
# qkv_format "sbhd" as Megatron-LM runs it), bf16, 4 sequences x 1024 tokens, 16 heads,
# head dim 128, median of 50 iterations: 0.594 ms at p = 0.0, 0.614 ms at p = 0.1 on an
# H200 (sm90, the H100's SM; TE 2.15.0): NVIDIA/TransformerEngine issue #3312 (table,
# "H200 (sm90) | 2.15.0 | sbhd"), also quoted in PR #3313.  One ratio for the forward and
# the backward (only their sum was measured).  UNCERTAIN: one shape (sequence 1024, the
# rows' is 4096), TE 2.15 (a 2024 run's cuDNN and TE were not measured); the measured
# FlashAttention-2 rates (the range's slow end) get no factor: no sm90 measurement of
# FA2 with dropout was found (PR #3313: FA2 1.05x with p = 0.1 on a GB200, sm100)
CUDNN_DROPOUT_TIME = 0.614 / 0.594


_MEASURED_GEMM = {"bfloat16", "float16", "float8"}


def _measured_peak(profile, dtype, op_class, flops, gemm):
    """The measured FLOP/s of this kernel on ``profile`` (``sim_mesh.measured``; for
    16-bit attention on a profile with an ``attention_table`` and no measured file, that
    table's rate, ``sim_mesh.fa2_a100``), or None where the profile has neither."""
    ms = profile.measured
    if not ms:
        if profile.attention_table and op_class == "attention" and isinstance(
                gemm, AttentionShape) and dtype_name(dtype) in ("bfloat16", "float16"):
            from . import fa2_a100        # a published per-shape table (FlashAttention-2)
            return fa2_a100.rate(gemm.seq, gemm.head_dim, gemm.causal, gemm.backward)
        return None
    from . import measured as _m
    scale = _m.scales(profile)[0]      # a sibling card's factor (1: the measured card)
    if op_class == "attention" and isinstance(gemm, AttentionShape):
        backend = ms["attention_backend"]
        slow = CUDNN_DROPOUT_TIME if gemm.dropout and backend == "cudnn" else 1.0
        return scale * _m.attention_rate(ms["file"], backend, gemm.bh, gemm.seq,
                                         gemm.head_dim, gemm.causal, gemm.backward) / slow
    if op_class != "matmul" or gemm is None or isinstance(gemm, AttentionShape):
        return None
    name = dtype_name(dtype)
    b, rows, cols = _gemm_shape(gemm)
    if name not in _MEASURED_GEMM or b * rows * cols == 0 or flops <= 0:
        return None
    k = max(1, round(flops / (2 * b * rows * cols)))
    # a batched GEMM (attention's scores, a head's context) fills the device as one
    # GEMM of its items' rows stacked: b x rows by cols (ASSUMPTION: the grid measured
    # single GEMMs; a (2048 x 2048, K 128) item alone runs at 147 TFLOP/s on the H100,
    # 16 of them batched are priced at the stacked (32,768 x 2048) product's 423)
    return scale * _m.gemm_rate(ms["file"], b * rows, cols, k,
                                "float8" if name == "float8" else "bfloat16")


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
    then divided by ``gemm_efficiency`` (tile and wave quantization), or, on a profile
    with ``measured`` GEMMs (16-bit or FP8), priced at the rate measured for that
    product (K = flops / (2 x batch x rows x columns); a batch as its rows stacked).
    An ``AttentionShape`` for op class "attention": the measured rate of that fused kernel where the profile has one
    (or, in 16 bits, its ``attention_table``'s rate: ``sim_mesh.fa2_a100``).
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
    if gemm is not None and not isinstance(gemm, AttentionShape):
        _gemm_shape(gemm)               # a bad shape raises, memoized or not
    # memoized per profile once the arguments are known good (the clock prices the same
    # kernels every step); the gemm's type is in the key: an AttentionShape is a tuple
    key = (flops, bytes_moved, dtype, op_class, launches, kernel, type(gemm), gemm)
    memo = profile_memo("compute_time", profile)
    try:
        got = memo.get(key)
    except TypeError:                    # an unhashable gemm (a list): priced, not kept
        memo, got = None, None
    if got is not None:
        return got
    engine, peak, bandwidth, launch = _rates(profile, dtype, op_class, kernel)
    peak = _peak(profile, engine, peak, dtype, op_class, flops, gemm)
    got = max(flops / peak, bytes_moved / bandwidth) + launches * launch
    if memo is not None:
        if len(memo) >= _MEMO_MAX:
            memo.clear()
        memo[key] = got
    return got


_MEMO_MAX = 1 << 16             # kernels remembered per profile; then it starts again


def _peak(profile, engine, peak, dtype, op_class, flops, gemm):
    """The FLOP/s a kernel runs at: measured where the profile measured it, else peak
    x efficiency, a GEMM's after tile and wave quantization."""
    if engine != "main":
        return peak
    got = _measured_peak(profile, dtype, op_class, flops, gemm)
    if got is not None:
        return got
    if isinstance(gemm, AttentionShape):
        return peak
    if _gemm_shape(gemm) is not None and op_class == "matmul":
        peak *= gemm_efficiency(gemm, profile)
    return peak


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
                    kernel: "str | None" = None, gemm=None) -> dict:
    """``compute_time``'s terms as plain data, for the course: the compute, memory
    and launch seconds, the engine, and what bounds the kernel (a GEMM's compute term
    after its tile and wave quantization, as ``compute_time``)."""
    total = compute_time(flops, bytes_moved, profile, dtype, op_class, launches, kernel, gemm)
    profile = get_profile(profile)
    engine, peak, bandwidth, launch = _rates(profile, dtype, op_class, kernel)
    peak = _peak(profile, engine, peak, dtype, op_class, flops, gemm)
    terms = {"compute": flops / peak, "memory": bytes_moved / bandwidth,
             "launch": launches * launch}
    return {**terms, "seconds": total, "engine": engine, "op_class": op_class,
            "bound": max(terms, key=terms.get)}


def collective_sms(profile, ranks=None) -> int:
    """The SMs NCCL's kernel holds while a collective over ``ranks`` (global ranks; None:
    not said) runs: one CTA per channel, each on an SM it does not share with compute
    kernels (NVIDIA/nccl issue #689), and the kernel's grid is the collective's channels
    (NCCL v2.12.7-1, 3c223c10, src/enqueue.cc:703-704), all of them once a ring message
    passes nChannels x 512 threads x 64 B (enqueue.cc:441-462, comm.h:30-32; 786 KB at 24
    channels, below every bucket the planner overlaps).  How many channels NCCL builds
    depends on where the ranks are: its logs show 24 rings inside one NVSwitch node of
    8 A100 (NVIDIA/nccl-tests issue #100) or 8 H100 (aws-samples/aws-do-eks nccl-test
    README, one p5.48xlarge), 16 across nodes with 8 NICs each (nccl #689; nccl #1453 and
    the same README on two H100 nodes), 2 across Jean Zay's Omni-Path nodes (bigscience
    all_reduce_bench-a100-n4.txt).  So: a group inside one node (every rank r has the same
    r // devices_per_node) gets ``topology.collective_sms_intra`` where the profile gives
    it; a group spanning nodes the channels NCCL's graph search builds for its fewest ranks
    on a node (``nccl_channels``, where the profile's node and release are read there and
    give its ``topology.collective_sms`` for full nodes), else, and for ``ranks=None``,
    ``topology.collective_sms``; a group of one rank 0 (NCCL launches no kernel for one
    rank: enqueue.cc:687-693)."""
    prof = get_profile(profile)
    t = prof.topology
    if ranks is None:
        return t.collective_sms
    try:
        group = list(ranks)
    except TypeError:
        group = None
    # (the planner asks once per layout and stage: plain ints checked at C speed first)
    if not group or not (set(map(type, group)) == {int} and min(group) >= 0) \
            and any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in group):
        raise ValueError(f"ranks={ranks!r} must be the group's global ranks (ints >= 0, at "
                         f"least one), or None when the group is not known")
    lo, hi = min(group), max(group)
    if lo == hi:
        return 0
    d = prof.devices_per_node
    if lo // d == hi // d:                                # every rank in lo's node
        return t.collective_sms_intra or t.collective_sms
    return _spanning_sms(prof, group, d)


def _spanning_sms(prof, group, d) -> int:
    """SMs of a group spanning nodes: NCCL's channels for its fewest ranks on a node
    (``nccl_channels``: the release's graph search; NCCL takes the minimum over ranks,
    src/init.cc allGather3) where the profile's node links and NCCL release are read
    there, else ``topology.collective_sms``."""
    from . import nccl_channels as NC
    t = prof.topology
    if not t.collective_sms or prof.name not in NC.HOSTS \
            or NC.release_of(t.nccl_version) is None:
        return t.collective_sms
    per = {}
    for r in group:
        per[r // d] = per.get(r // d, 0) + 1
    # only where the search gives the profile's own (logged) figure for full nodes: a
    # profile whose collective_sms was set otherwise keeps it for every group
    if NC.host_channels(prof, t.nccl_version, d) != t.collective_sms:
        return t.collective_sms
    return NC.host_channels(prof, t.nccl_version, min(per.values()))


def hbm_share(profile, ranks=None) -> float:
    """The share of the device's memory bandwidth a collective over ``ranks`` takes from
    the kernels beside it: ``topology.collective_hbm_factor`` x its link's rate / the
    profile's ``memory_bandwidth``.  The link: the intra-node one for a group inside one
    node (every rank r has the same r // devices_per_node), else (or ``ranks=None``) the
    inter-node one, at bandwidth x efficiency (the collective at its full rate: an upper
    bound for small messages).  The factor is the HBM bytes NCCL moves per link byte (its
    maintainer: "at least 2x ... it can be 3x", NVIDIA/nccl #1428; the profiles' citation
    says what is ASSUMED).  0 for a group of one rank or a profile without the factor."""
    prof = get_profile(profile)
    ranks = _ranks(ranks)
    collective_sms(prof, ranks)                   # bad ranks raise, as there
    return _share(prof, ranks)


def _share(prof, ranks) -> float:
    """``hbm_share`` of checked ``ranks`` (a sequence or None) on a loaded profile."""
    k = prof.topology.collective_hbm_factor
    if not k or _one_rank(ranks):
        return 0.0
    link = prof.inter_node
    if ranks is not None:
        d = prof.devices_per_node
        if min(ranks) // d == max(ranks) // d:
            link = prof.intra_node
    share = k * link.effective_bandwidth / prof.memory_bandwidth
    if not share < 1:
        raise ValueError(f"profile {prof.name!r}: topology.collective_hbm_factor={k} x "
                         f"{link.effective_bandwidth / 1e9:.0f} GB/s on {link.name!r} "
                         f"is {share:.2f} of the memory bandwidth; it must stay below 1")
    return share


def _ranks(ranks):
    """``ranks`` read once (an iterator is read twice below); None and what is not
    iterable pass through for ``collective_sms`` to name."""
    if ranks is None or isinstance(ranks, (list, tuple, range)):
        return ranks
    try:
        return tuple(ranks)
    except TypeError:
        return ranks


def _one_rank(ranks) -> bool:
    """A group of one rank (ranks already checked by ``collective_sms``)."""
    return ranks is not None and min(ranks) == max(ranks)


def overlap_rate(profile, ranks=None) -> float:
    """The rate (1 = alone) at which compute kernels progress while a collective over
    ``ranks`` runs beside them: (sm_count - sms) / sm_count with sms =
    ``collective_sms(profile, ranks)`` (NCCL's CTAs hold their SMs, NVIDIA/nccl #689;
    ``overlap``), times 1 - ``hbm_share(profile, ranks)`` (the memory bandwidth the
    collective's traffic takes: the module docstring); ``ranks=None``: the profile's
    ``topology.collective_sms`` and inter-node link (a group across nodes); 1 for a
    profile without SM or HBM figures, and for a group of one rank."""
    prof = get_profile(profile)
    t = prof.topology
    ranks = _ranks(ranks)
    sms = collective_sms(prof, ranks)
    if not sms and _one_rank(ranks):          # NCCL launches no kernel for one rank
        return 1.0
    rate = (t.sm_count - sms) / t.sm_count if t.sm_count and sms else 1.0
    return rate * (1.0 - _share(prof, ranks)) if t.collective_hbm_factor else rate


def finish_beside(t: float, work: float, rate: "float | None", busy) -> float:
    """When ``work`` seconds of compute started at ``t`` end, running at full speed
    except inside the ``busy`` intervals ((start, end) pairs, any order, overlapping
    allowed: collectives in flight), where it runs at ``rate`` (``overlap_rate``).

    ``rate=None``: each interval is a (start, end, rate) triple carrying its own
    collective's rate (``overlap_rate(profile, ranks)`` of its group: a tensor-parallel
    group inside a node holds more SMs than a data-parallel group across nodes).  Where
    several are in flight at once the compute runs at the lowest of their rates: the
    SMs of the collective holding the most.  ASSUMPTION: not their sum.  Collectives of
    two communicators do run side by side (NVIDIA/nccl issue #574, S. Jeaugey: "You could
    create two communicators and that could effectively allow you to run both operations
    in parallel"), each kernel with its own CTAs, but whether the second kernel's CTAs
    take SMs of their own or share the first's (an sm_80 / sm_90 SM holds up to 2,048
    threads, four of NCCL's 512-thread CTAs: CUDA C++ Programming Guide, "Technical
    Specifications per Compute Capability") is not measured in any source found; the
    lowest rate is what the clock gave before the groups' figures, when every group had
    the same one.  Against it: NCCL builds every kernel ``__launch_bounds__(
    NCCL_MAX_NTHREADS, 1)`` (NVIDIA/nccl ``src/device/*``, generate.py), which lets the
    compiler give a thread up to 65,536 / 640 registers, so a second communicator's CTA
    may not fit on an SM beside the first: then the SMs held add up and the rate is below
    either (the built kernels' register counts were not read: a lead, not priced).  The planner prices each group beside the kernels on its own:
    ``plan.layer_cost`` a GEMM beside its tensor-parallel collective, ``plan.zero_cost``
    a block (those GEMMs already stretched) beside the data-parallel ones, so where both
    are in flight it takes the product of the two rates, this clock the lower (a
    difference older than the groups' figures)."""
    if rate is None:
        return _finish_groups(t, work, busy)
    if rate == 1.0 or work <= 0:
        return t + work
    merged = []
    for a, b in sorted(iv for iv in busy if iv[1] > t):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    for start, end in merged:
        if start > t:                          # idle until this collective starts
            if t + work <= start:
                return t + work
            work, t = work - (start - t), start
        if t + work / rate <= end:             # ends while the collective runs
            return t + work / rate
        work, t = work - (end - t) * rate, end
    return t + work


def _finish_groups(t: float, work: float, busy) -> float:
    """``finish_beside`` with (start, end, rate) triples: the lowest rate in flight."""
    live = [iv for iv in busy if iv[1] > t and iv[2] < 1.0]
    if work <= 0 or not live:
        return t + work
    rates = {iv[2] for iv in live}
    if len(rates) == 1:                        # one figure in flight: as before
        return finish_beside(t, work, rates.pop(), [iv[:2] for iv in live])
    for p in sorted({x for iv in live for x in iv[:2] if x > t}):
        # [t, p] lies wholly inside or outside each interval: its breakpoints are all p
        r = min((iv[2] for iv in live if iv[0] <= t and iv[1] >= p), default=1.0)
        if work <= (p - t) * r:
            return t + work / r
        work, t = work - (p - t) * r, p
    return t + work


def overlap(compute_seconds: float, comm_seconds: float, profile,
            gemm=None, ranks=None) -> tuple[float, float]:
    """A kernel and a collective running at the same time: (the kernel's stretched
    seconds, the collective's exposed seconds after the kernel ends).

    The collective's kernel holds ``collective_sms(profile, ranks)`` of the device's
    ``topology.sm_count`` SMs while it runs (NCCL: one SM per channel, not shared
    with compute kernels, NVIDIA/nccl #689; ``ranks``: the collective's group, None:
    ``topology.collective_sms``), so the kernel progresses at
    r = (sm_count - collective_sms) / sm_count meanwhile (it is assumed to scale
    with SMs: a large GEMM does). With G the kernel alone and C the collective:
    r C >= G: the kernel ends at G / r, the collective shows C - G / r;
    else the kernel ends at G + (1 - r) C and hides the collective. A profile
    with no SM figures (r = 1) gives (G, max(0, C - G)). For a GEMM given by its
    output ``gemm = (batch, rows, columns)``, r is the ratio of ``gemm_efficiency``
    on the SMs left to that on all of them: its tiles then run in more, partly
    filled waves (the tail effect of a GEMM beside an NCCL kernel, NVIDIA Developer
    Forums, "Compute-Communication Overlap Causes Severe GEMM Performance
    Degradation because of Tail Effect", 2025: a 132-tile GEMM beside an all-gather of
    24 CTAs on an H100, 80% MFU alone and 47% beside it, 1.70x; this model: 2 waves,
    2.0x). Both rates are then multiplied by 1 - ``hbm_share(profile, ranks)``: the
    memory bandwidth the collective's traffic takes (0 at the profiles' point; the
    range's slow end: the module docstring).
    """
    for name, v in (("compute_seconds", compute_seconds), ("comm_seconds", comm_seconds)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) \
                or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}={v!r} must be seconds >= 0")
    prof = get_profile(profile)
    t = prof.topology
    ranks = _ranks(ranks)
    sms = collective_sms(prof, ranks)
    if comm_seconds == 0 or not sms and _one_rank(ranks):
        r = 1.0
    elif _gemm_shape(gemm) is None or not t.sm_count or not sms:
        r = overlap_rate(prof, ranks)
    else:
        r = gemm_efficiency(gemm, prof, t.sm_count - sms) / gemm_efficiency(gemm, prof) \
            * (1.0 - _share(prof, ranks))
    g, c = float(compute_seconds), float(comm_seconds)
    if r * c >= g:
        return g / r, c - g / r
    return g + (1 - r) * c, 0.0
