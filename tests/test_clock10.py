"""The clock against published component measurements it was not held to before
(clock10): collectives, GEMMs, attention and memory bandwidth, each priced by the clock
and compared with what real hardware measured.

Sources (all new to the project; ``grep`` the tests and benchmarks for them):

- AZ_A100: Azure/AI-benchmarking-guide, ``Azure_Results/ND_A100_v4_results.md`` (commit
  3bb66cacc25632d8ece36bc1d5128c5ea886a60b): one ND A100 v4 node, 8 x A100-SXM4-80GB on
  NVSwitch (the DGX A100's fabric), NCCL 2.18.5, CUDA 12.5.  Tables "HBM Bandwidth"
  (BabelStream), "Flash Attention 2.0" and "NCCL Bandwidth" (its "GEMM CuBLASLt" table is
  already held by tests/test_measured.py, not repeated here).
- AZ_H100: the same repository, ``Azure Results/ND_H100_v5_results.md`` (commit
  f350e7e65b82cfcb9220b32b582bc34342d9c1a6): one ND H100 v5 node, 8 x H100 80GB HBM3,
  NCCL 2.18.5.  Tables "GEMM CuBLASLt" (FP8), "HBM Bandwidth", "NCCL Bandwidth" (NVLS).
  How each was run: the repository's ``Benchmarks/NVIDIA/*.py`` (GEMMCublasLt.py:
  superbenchmark's cublaslt_gemm, ``-b 1 -i 1000 -w 10000``, fp16 on the A100, fp8e4m3
  on the H100; HBMBandwidth.py: BabelStream's cuda-stream; FlashAttention.py:
  flash-attention's benchmarks/benchmark_flash_attention.py; NCCLBandwidth.py:
  ``all_reduce_perf -b 8 -e 8G -f 2 -g 8 -n 40``, in-place busbw).
- LIPLUS: li-plus/playground ``cuda/nccl.md`` (commit b85070fb449ea55858fed14cf69cefe10592261b):
  ``sendrecv_perf -b 128M -e 1G -f 2 -g 8`` on 8 A100 on NVSwitch, 195 GB/s at 1 GiB.
- XLA_H100: openxla/xla ``xla/service/gpu/model/collective_interpolator_data.h``,
  ``kDefaultCollectivePTable`` key "sm_90" (the index's 90,334-character version of the
  file; later regenerated, e.g. at 040b3849aff88d770f0677110fb5efc58e366a95), made by
  ``xla/tools/collective_perf_table_gen.cc`` (040b3849): one 8-GPU node, f32, median of
  20 runs of the XLA executable, ``network_throughput_bytes_per_sec = tensor_size_bytes /
  runtime`` with the size the all-gather's output and the reduce-scatter's input (the
  clock's and nccl-tests' "size").  ASSUMPTION: the node is 8 x H100 SXM on NVSwitch
  (``hlo_op_profiles_data.h`` names sm_90 "NVIDIA H100 80GB HBM3"; ~400 GB/s all-gather
  rules out PCIe).  Its all-reduces are left out: 393 GB/s busbw at 2 GiB is above the
  ring's 370 and below NVLS's 480, the algorithm is not known.
- XLA_MM: the same repository, ``xla/service/gpu/model/matmul_interpolator_data.h``,
  ``kDefaultMatmulPTable`` key "sm_90" (the index's 79,035-character version), made by
  ``xla/tools/matmul_perf_table_gen.cc``: (b, m, n, k) -> FLOP/s of XLA's dot,
  "BF16xBF16->BF16".  ASSUMPTION: timed like the collective table (the executable's
  time, a few us of launch included: a lower bound on the kernel's rate).
- FLAGPERF: FlagOpen/FlagPerf ``base/toolkits/interconnect-MPI_intraserver/nvidia/A100/
  README.md`` (commit 2c54c3ede6b6a04e043c526f697607d3019873a9): one DGX A100, 8 x
  A100-SXM4-40GB, "464.65GB/s", which its ``bandwidth.cu`` (869ce466) computes as 2 x
  busbw of a 4 GiB fp32 ncclAllReduce averaged over 10,000 iterations.
- NCCL583: NVIDIA/nccl issue #583 (2021-10-18, the description's table): ``all_reduce_perf``
  with ``nThread 1 nGpus 2`` on 2 x A100-SXM4-40GB of one node: out-of-place 10.14 us at
  32 B and at 64 B (in-place 10.21, 10.31).
- NCCL1455: NVIDIA/nccl issue #1455 (2024-09-19, 8 x H100 SXM): "when using ALGO=RING,
  busbw is about 365-370 GBps when gpus from 2 to 8" (``all_reduce_perf -b 2G -e 4G``).

Where the clock is off by more than 15% the test says why, and is marked xfail(strict):
it fails the day the clock meets the measurement, so that the note is updated."""
import pytest

from workbench.sim_mesh import cost
from workbench.sim_mesh.kernel_cost import AttentionShape
from workbench.sim_mesh.profiles import get_profile

A100, H100 = get_profile("a100"), get_profile("h100")
K, M, G = 1 << 10, 1 << 20, 1 << 30

# AZ_A100 "NCCL Bandwidth": in-place all_reduce busbw (GB/s) by size (the table's "1K" ..
# "8G" are nccl-tests' powers of two: its "65K" is 65,536 B, "1G" 1,073,741,824 B)
AZ_A100_ALL_REDUCE = {
    1 * K: 0.04, 2 * K: 0.08, 4 * K: 0.17, 8 * K: 0.33, 16 * K: 0.67, 32 * K: 1.37,
    64 * K: 2.70, 128 * K: 5.15, 256 * K: 10.11, 512 * K: 19.24, 1 * M: 36.22,
    2 * M: 53.54, 4 * M: 71.43, 8 * M: 89.99, 16 * M: 109.22, 32 * M: 132.77,
    64 * M: 166.63, 128 * M: 174.18, 256 * M: 213.87, 512 * M: 221.58, 1 * G: 228.10,
    2 * G: 230.22, 4 * G: 230.48, 8 * G: 231.58}
# AZ_H100 "NCCL Bandwidth": NVLS (NVLink SHARP) all_reduce busbw, the large sizes
AZ_H100_NVLS = {1 * G: 466.35, 2 * G: 472.36, 4 * G: 475.54, 8 * G: 478.87}
# AZ_H100 "GEMM CuBLASLt": (m, n, k) -> TFLOP/s, FP8 (e4m3).  (AZ_A100's FP16 table is
# held by tests/test_measured.py::test_the_a100_model_against_an_sxm_a100s_sustained_gemms.)
AZ_H100_GEMM_FP8 = {
    (1024, 1024, 1024): 274.1, (2048, 2048, 2048): 1011.3, (4096, 4096, 4096): 1216.9,
    (8192, 8192, 8192): 1290.1, (16384, 16384, 16384): 1377.3,
    (32768, 32768, 32768): 1382.2, (1024, 2145, 1024): 410.7,
    (6144, 12288, 12288): 1351.4, (802816, 192, 768): 663.8}
# "HBM Bandwidth" (BabelStream, TB/s): Copy (read a, write c) and Triad (read b, c, write a)
AZ_STREAM = {("a100", "copy"): 1.61, ("a100", "triad"): 1.70,
             ("h100", "copy"): 2.90, ("h100", "triad"): 2.97}
# LIPLUS: sendrecv_perf busbw (= algbw) GB/s, out-of-place
LIPLUS_SENDRECV = {128 * M: 110.81, 256 * M: 188.60, 512 * M: 192.75, 1 * G: 195.10}


def _busbw(kind, n, p, profile):
    return cost.bus_bandwidth(kind, n, p, cost.price(kind, n, range(p), profile)) / 1e9


def _ratio_all_reduce(n):
    """clock busbw / AZ_A100's, 8 ranks in one node."""
    return _busbw("all_reduce", n, 8, A100) / AZ_A100_ALL_REDUCE[n]


# --- collectives -------------------------------------------------------------------

@pytest.mark.parametrize("n", [256 * M, 512 * M, 1 * G, 2 * G, 4 * G, 8 * G])
def test_a100_all_reduce_bandwidth_regime(n):
    """256 MiB .. 8 GiB on 8 A100-SXM4-80GB (AZ_A100): the clock's ring (NCCL's Simple
    protocol at the profile's NVLink rate, nccl-tests #175's 232.5 GB/s) within 8%.
    Why 8%: at 256 MiB the ring's latency (8.4 + 14 x 3.4 us, tuning.cc) is 2.7% of the
    time, and the harness's launch floor seen at small sizes below (about 33 us, 8 GPUs
    launched from one thread with ``-g 8``) 1.6%; the profile's tables are NCCL 2.12.7's,
    the run's 2.18.5 (the Simple ring's bandwidth term is the same in both); the rest is
    run-to-run spread of a 40-iteration mean."""
    r = _ratio_all_reduce(n)
    assert r == pytest.approx(1.0, abs=0.08), (n, r)


def test_a100_all_reduce_clock_never_slower_than_the_measurement():
    """Every size 1 KiB .. 8 GiB: the clock's time is at most the measured one (it prices
    NCCL's kernel; nccl-tests' time adds its own launch of 8 GPUs from one thread, a
    flat 42-45 us at 1 KiB .. 256 KiB in AZ_A100 where the clock gives 10-18 us)."""
    for n, busbw in AZ_A100_ALL_REDUCE.items():
        measured = 2 * 7 / 8 * n / (busbw * 1e9)
        clock = cost.price("all_reduce", n, range(8), A100)
        assert clock <= measured, (n, clock, measured)
    small = [2 * 7 / 8 * n / (AZ_A100_ALL_REDUCE[n] * 1e9) for n in (1 * K, 16 * K, 256 * K)]
    assert max(small) / min(small) < 1.1        # the flat floor the clock does not model


def test_a100_all_reduce_flagperf_dgx_a100_40gb():
    """FLAGPERF: 464.65 / 2 = 232.3 GB/s busbw at 4 GiB on a DGX A100 40GB.  The a100
    profile's NVLink efficiency was taken from nccl-tests #175's 232.5 GB/s on the 80GB
    part (profiles/a100.json), so this checks that figure on another DGX A100 (the 40GB
    part, same NVSwitch fabric) rather than the model: within 3% (the two measurements
    differ by 0.1%).  ASSUMPTION: the README's "GB/s" is 1e9 B/s (as GiB/s, 249 GB/s busbw would
    exceed every A100 figure published: nccl-tests #175, #149, AZ_A100)."""
    busbw = _busbw("all_reduce", 4 * G, 8, A100)
    assert busbw == pytest.approx(464.65 / 2, rel=0.03), busbw


MID = [1 * M, 2 * M, 4 * M, 8 * M, 16 * M, 32 * M, 64 * M, 128 * M]


@pytest.mark.xfail(strict=True, reason=(
    "KNOWN GAP: 1 MiB .. 128 MiB all-reduce on 8 A100 (AZ_A100): the clock is 22-56% "
    "faster than measured (busbw 44-222 vs 36-174 GB/s).  The clock is NCCL's own tuning "
    "model (tuning.cc: base + steps x step latency + bytes / busBw), which predicts these "
    "sizes the same way.  The run launched the 8 GPUs from one thread (-g 8): a flat "
    "42-45 us at 1-256 KiB, 2-20% of the measured time at 8-128 MiB, not separable from "
    "the kernel's (at 1 MiB the measured 50.7 us is barely above it).  No component "
    "mechanism (channel count, chunking) found that accounts for the rest, and no second "
    "8-GPU A100 curve run one process per GPU was found, so nothing is changed; TP "
    "all-reduces of 8-64 MiB (a layer's activations) fall here: the clock's TP "
    "communication on A100 may be optimistic"))
@pytest.mark.parametrize("n", MID)
def test_a100_all_reduce_mid_sizes_within_15_percent(n):
    assert _ratio_all_reduce(n) == pytest.approx(1.0, abs=0.15)


def test_a100_all_reduce_mid_size_gap_does_not_grow():
    """The known gap above, bounded: the clock at most 1.6x the measured busbw, and
    never below it, at 1-128 MiB (a change that widened it would fail here)."""
    for n in MID:
        assert 1.0 <= _ratio_all_reduce(n) <= 1.6, (n, _ratio_all_reduce(n))


@pytest.mark.xfail(strict=True, reason=(
    "KNOWN GAP: the smallest all-reduce, 2 A100 (NCCL583): 10.14 us measured, the clock "
    "4.54 us (NCCL's tuning model: ring LL baseLat 3.6 + 2 x 0.47 us, tuning.cc).  The "
    "model prices the algorithm, not the launch and host enqueue of NCCL's kernel that "
    "nccl-tests' per-iteration time holds.  No source gives that per-call cost, so nothing is "
    "changed: it matters for many tiny collectives (a loss or grad-norm scalar), not for "
    "the MB-sized ones the published rows are made of"))
@pytest.mark.parametrize("n", [32, 64])
def test_a100_tiny_all_reduce_latency_within_15_percent(n):
    assert cost.price("all_reduce", n, [0, 1], A100) == pytest.approx(10.14e-6, rel=0.15)


def test_a100_tiny_all_reduce_gap_bounded():
    """The gap above, bounded: the clock 0.4-0.5 of the measured 10.14 us."""
    for n in (32, 64):
        assert 0.4 <= cost.price("all_reduce", n, [0, 1], A100) / 10.14e-6 <= 0.5


@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("n", [2 * G, 4 * G])
def test_h100_ring_bus_bandwidth_does_not_depend_on_the_rank_count(p, n):
    """NCCL1455: NCCL_ALGO=RING, 2-4 GiB, 2 to 8 H100 of one node: busbw "about 365-370
    GBps".  The profile's NVLink efficiency comes from nccl-tests #212's 370 GB/s at 8
    GPUs (so p = 8 agrees by construction); p = 2..7 test that a ring's busbw inside an
    NVSwitch node does not depend on p (the ring model's n (p-1)/p bytes per rank).
    Tolerance: the issue's own range, 365-370, widened by 5 GB/s each side ("about")."""
    busbw = cost.bus_bandwidth("all_reduce", n, p,
                               cost.price("all_reduce", n, range(p), H100, "ring")) / 1e9
    assert 360.0 <= busbw <= 375.0, (p, n, busbw)


@pytest.mark.parametrize("n", sorted(AZ_H100_NVLS))
def test_h100_nvls_measured_above_the_clocks_ring_by_the_maintainers_factor(n):
    """AZ_H100's all-reduce ran NVLS (NVLink SHARP, the switch reduces), which the clock
    does not model (profiles/h100.json: "NVLS ... is not modeled"): the clock prices the
    ring.  The measured NVLS busbw exceeds the clock's ring by 480 / 370 = 1.30, the
    ratio NCCL's maintainer gives for 8 H100 (nccl-tests #212: ~370 GB/s ring, ~480 GB/s
    NVLS peak); within 4% (AZ_H100's 466-479 GB/s against that ~480 peak)."""
    ring = _busbw("all_reduce", n, 8, H100)
    assert AZ_H100_NVLS[n] / ring == pytest.approx(480 / 370, rel=0.04), (n, ring)


@pytest.mark.xfail(strict=True, reason=(
    "KNOWN GAP: NCCL send/recv inside an A100 node (LIPLUS: 189-195 GB/s at 256 MiB - "
    "1 GiB) runs at 0.65 of the 300 GB/s NVLink, the clock at the collectives' 0.783 "
    "(nccl-tests #175): 20-24% fast.  nccl-tests #331 (4 A100-SXM-64GB, NVLink 3 pairs) "
    "also finds NCCL p2p at 72% of the link, below the ring's 78%.  One measurement on "
    "NVSwitch, NCCL version not given: not changed (send/recv inside a node prices "
    "pipeline stages and context-parallel rings on one node; no published row depends "
    "on it)"))
@pytest.mark.parametrize("n", [256 * M, 512 * M, 1 * G])
def test_a100_send_recv_within_15_percent(n):
    clock = n / cost.price("send_recv", n, [0, 1], A100) / 1e9
    assert clock == pytest.approx(LIPLUS_SENDRECV[n], rel=0.15)


def test_a100_send_recv_gap_bounded():
    """The gap above, bounded (1.15 .. 1.3x); 128 MiB is left out: it is the run's first
    size and takes 1,211 us against 1,423 us for twice the bytes (a warm-up artifact)."""
    for n in (256 * M, 512 * M, 1 * G):
        clock = n / cost.price("send_recv", n, [0, 1], A100) / 1e9
        assert 1.15 <= clock / LIPLUS_SENDRECV[n] <= 1.3, (n, clock)


# XLA_H100: size (MiB) -> throughput (GB/s), 8 ranks; XLA's own launch of the executable,
# 6.11 us, is the same table's all-gather over groups of one rank at 1 KiB (1,024 B /
# 167,539,267 B/s: nothing moves between GPUs), taken off each measured time
XLA_H100_ALL_GATHER = {1: 42.67, 2: 62.59, 4: 87.32, 8: 134.43, 16: 194.61, 32: 232.40,
                       64: 313.43, 128: 338.03, 256: 368.0, 512: 384.03, 1024: 391.04,
                       2048: 400.12}
XLA_H100_REDUCE_SCATTER = {16: 204.56, 32: 233.90, 64: 311.52, 128: 327.50, 256: 347.9,
                           512: 359.2, 1024: 364.9, 2048: 373.84}
XLA_LAUNCH = 1024 / 167539267


def _xla_ratio(kind, mib, table):
    """measured kernel time (less XLA's launch) / the clock's, 8 H100 in one node."""
    n = mib * M
    return (n / (table[mib] * 1e9) - XLA_LAUNCH) / cost.price(kind, n, range(8), H100)


@pytest.mark.parametrize("mib", [64, 128, 256, 512, 1024, 2048])
def test_h100_all_gather_large(mib):
    """XLA_H100 all-gather, 64 MiB .. 2 GiB: the clock (ring, 370 GB/s busbw) within 12%
    (measured 1.05-1.12x the clock's time: 350 GB/s busbw at 2 GiB against nccl-tests
    #212's 370, a different run of a different NCCL)."""
    r = _xla_ratio("all_gather", mib, XLA_H100_ALL_GATHER)
    assert 1.0 <= r <= 1.12, (mib, r)


@pytest.mark.parametrize("mib", [1, 2, 4, 8, 16, 32])
def test_h100_all_gather_small(mib):
    """XLA_H100 all-gather, 1 .. 32 MiB (NCCL's LL / LL128 / Simple switch-over): the
    clock 7-24% fast, the most at 32 MiB where A100's curve (AZ_A100) also falls below
    the clock; within 25% (the mid-size gap of test_a100_all_reduce_mid_sizes_...)."""
    r = _xla_ratio("all_gather", mib, XLA_H100_ALL_GATHER)
    assert 1.0 <= r <= 1.25, (mib, r)


@pytest.mark.parametrize("mib", sorted(XLA_H100_REDUCE_SCATTER))
def test_h100_reduce_scatter(mib):
    """XLA_H100 reduce-scatter, 16 MiB .. 2 GiB: the clock within 0-25% fast.  Above
    256 MiB the measured reduce-scatter runs 6.5% below the all-gather of the same size
    (373.8 vs 400.1 GB/s at 2 GiB: each ring step also reduces, f32), which NCCL's tuning
    model, and so the clock, does not distinguish (tuning.cc prices both as p - 1 steps
    of the same bus bandwidth); below 16 MiB the table's reduce-scatter is erratic
    (0.81-1.37x the clock, faster than its all-gather at 2-8 MiB) and is left out."""
    r = _xla_ratio("reduce_scatter", mib, XLA_H100_REDUCE_SCATTER)
    assert 1.0 <= r <= 1.25, (mib, r)
    if mib >= 256:
        assert XLA_H100_REDUCE_SCATTER[mib] / XLA_H100_ALL_GATHER[mib] == pytest.approx(
            0.935, abs=0.015)
        assert cost.price("reduce_scatter", mib * M, range(8), H100) == \
            cost.price("all_gather", mib * M, range(8), H100)


# --- kernels -----------------------------------------------------------------------

def _gemm_tflops(mnk, profile, dtype):
    m, n, k = mnk
    flops = 2 * m * n * k
    size = {"float16": 2, "float8": 1}[dtype]
    t = cost.compute_time(flops, size * (m * k + k * n + m * n), profile, dtype, "matmul", 1,
                          gemm=(1, m, n))
    return flops / t / 1e12


@pytest.mark.parametrize("mnk", sorted(AZ_H100_GEMM_FP8))
def test_h100_fp8_gemm(mnk):
    """AZ_H100 cuBLASLt FP8 (e4m3), nine shapes 1024^3 .. 32768^3: the clock prices FP8
    as the bf16 rate measured for the shape on an H100 SXM (measurements/h100-sxm-80gb.json)
    x the median FP8 / bf16 ratio of that file (sim_mesh/measured.py): one ratio for every
    shape, so a shape whose FP8 kernel gains more or less than the median is off by that
    spread: within 15% (measured here 0.88 .. 1.10)."""
    r = _gemm_tflops(mnk, H100, "float8") / AZ_H100_GEMM_FP8[mnk]
    assert r == pytest.approx(1.0, abs=0.15), (mnk, r)


# XLA_MM: (b, m, n, k) -> TFLOP/s, BF16, the table's products of 26 us or more
XLA_MM_BF16 = {
    (1, 4096, 2048, 4096): 764.09, (1, 4096, 4096, 1024): 681.09,
    (1, 2048, 4096, 2048): 717.50, (2, 2048, 4096, 2048): 726.36,
    (2, 2048, 1024, 4096): 742.30, (2, 512, 4096, 4096): 734.18,
    (4, 4096, 4096, 512): 621.65, (1, 2048, 1024, 4096): 659.14,
    (4, 2048, 4096, 512): 608.52, (4, 4096, 1024, 1024): 673.19,
    (2, 2048, 2048, 1024): 604.92, (1, 512, 4096, 4096): 653.13}


@pytest.mark.parametrize("bmnk", sorted(XLA_MM_BF16))
def test_h100_bf16_gemm_against_xla_table(bmnk):
    """XLA_MM: H100 bf16 products of 1-4 x (512-4096)^2 x 512-4096.  The clock prices the
    project's own card (measurements/h100-sxm-80gb.json: its GEMMs sustained 1365-1440 MHz
    under the 700 W cap, 682 TFLOP/s at 8192^3): 0.82-1.01 of XLA's rate, never faster
    (and if, as assumed, XLA's figure includes its launch, its kernels are faster still),
    up to 18% slower on the batched K = 512 products.
    Held to [0.80, 1.03]: card-to-card clocks under the power cap and XLA's kernel choice
    (cuBLASLt or its own Triton GEMMs) are not modeled; the profile is of the measured
    card, so nothing is changed."""
    b, m, n, k = bmnk
    flops = 2 * b * m * n * k
    t = cost.compute_time(flops, 2 * b * (m * k + k * n + m * n), H100, "bfloat16", "matmul",
                          1, gemm=(b, m, n))
    r = flops / t / 1e12 / XLA_MM_BF16[bmnk]
    assert 0.80 <= r <= 1.03, (bmnk, r)


def test_a100_flash_attention_2_fwd_bwd():
    """AZ_A100 "Flash Attention 2.0": 179.5 TFLOP/s forward + backward, head dim 64,
    batch 2, sequence 8192 (flash-attention benchmark_flash_attention.py: dim 2048, so 32
    heads; FLOPs 3.5 x 4 b s^2 h d; fp16).  ASSUMPTION: not causal: the results name only
    the head dimension; an early version of the Azure script (Benchmarks/FlashAttention.py
    at 625c7d21) printed the first block its grep found, which the benchmark's loop order
    makes causal=False, headdim=64 (a causal run would read ~165: Fig. 4(c)'s 8k bar).  The
    clock's rate is Dao 2023 Fig. 4(a)'s 8k bar (176, on an A100 40GB) split into halves
    (sim_mesh/fa2_a100.py): a later FA2 release on the 80GB part; within 8%."""
    b, s, d = 2, 8192, 64
    h = 2048 // d
    f = 4 * b * s * s * h * d
    tf = cost.compute_time(f, 0, A100, "float16", "attention", 1,
                           gemm=AttentionShape(b * h, s, d, False, False))
    tb = cost.compute_time(2.5 * f, 0, A100, "float16", "attention", 1,
                           gemm=AttentionShape(b * h, s, d, False, True))
    assert 3.5 * f / (tf + tb) / 1e12 == pytest.approx(179.5, rel=0.08)


@pytest.mark.parametrize("name, kernel", sorted(AZ_STREAM))
def test_babelstream_hbm_bandwidth(name, kernel):
    """BabelStream Copy (2 arrays of doubles moved) and Triad (3), AZ_A100 / AZ_H100; the
    clock's memory-bound elementwise kernel (memory_bandwidth x memory_efficiency + one
    launch).  ASSUMPTION: BabelStream's default 2^25 doubles per array (the results do not
    state it; at 268 MB a launch is under 0.3% of the time).  Within 12%: the profiles'
    memory efficiency is another kernel's (a100: a streaming read kernel, 0.88 of 2.04
    TB/s; h100: a 6.4 GB device copy on the measured card, 0.901), and BabelStream's own
    kernels differ by 6% (A100 Copy 1.61 vs Triad 1.70 TB/s); the clock is 1.6-11% above
    them, the most for the A100's Copy."""
    n = 1 << 25
    arrays = {"copy": 2, "triad": 3}[kernel]
    prof = get_profile(name)
    t = cost.compute_time((arrays - 1) * n, arrays * 8 * n, prof, "float64", "elementwise", 1)
    got = arrays * 8 * n / t / 1e12
    assert got == pytest.approx(AZ_STREAM[(name, kernel)], rel=0.12), got
