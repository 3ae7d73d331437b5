"""A kernel beside an NCCL collective: the HBM its traffic takes (``kernel_cost.hbm_share``),
held to each component measurement found (issue 21, helper i21c11).

The clock's point prices the SMs NCCL holds alone (``topology.collective_hbm_factor`` 0);
the range's slow end adds the memory bandwidth the collective's traffic takes, 3 x its
link's rate (NCCL's maintainer, NVIDIA/nccl #1428: "at least 2x ... it can be 3x").  Each
figure below must lie between the two ends; none fixes a point (they need factors from
about 0 to 2.6: the profiles' citation "topology.collective_hbm_factor").

- pytorch/pytorch pull request #172714 (2026-01, 8 x H100 on NVLink): an fp16 8192^3
  matmul and an all-gather of 64 MiB per rank, 2.96 ms one after the other, 2.02 ms
  overlapped (benchmarks/distributed/bench_overlapped_matmul_allgather.py).
- NVIDIA/nccl issue #1428 (2024-09, A100-SXM4-80GB, kernels beside an AllGather): a GEMM
  1.18 -> 2.08 ms (1.76x), attention 0.18 -> 0.33 ms (1.83x).
- pytorch/pytorch pull request #179937 (2026-04, 8 x H100, FSDP): "NCCL collectives use
  SMs, which makes matmuls that are overlapped by them 30-40% slower".
- Korthikanti et al. 2022, Table 4 (A100, one tensor-parallel layer; tests/test_table4.py):
  the backward 11.9 ms.
"""
import math

import pytest

from workbench.plan import Cluster, Layout, estimate_range
from workbench.plan.layer_cost import layer_times
from workbench.plan.ranges import BOUNDS, profile_at
from workbench.models.config import get_config
from workbench.sim_mesh import cost
from workbench.sim_mesh import kernel_cost as kc
from workbench.sim_mesh.profiles import Profile, Topology, get_profile

H100, A100 = get_profile("h100"), get_profile("a100")
NODE = list(range(8))


def _with(profile, factor):
    d = profile.to_dict()
    d["topology"]["collective_hbm_factor"] = factor
    d["name"] = f"{profile.name} (hbm x{factor})"
    return Profile.from_dict(d)


def _pr172714(profile):
    """(sequential, overlapped) seconds of PR #172714's pair on ``profile``."""
    m = n = k = 8192
    g = kc.compute_time(2 * m * n * k, 2 * (m * k + k * n + m * n), profile, "float16",
                        "matmul", gemm=(1, m, n))
    c = cost.price("all_gather", 8 * 64 * 2**20, NODE, profile)    # the gathered bytes
    run, exposed = kc.overlap(g, c, profile, gemm=(1, m, n), ranks=NODE)
    return g + c, run + exposed


def test_hbm_share_is_the_factor_times_the_groups_link_over_hbm():
    p = _with(H100, 2.0)
    assert kc.hbm_share(p, NODE) == pytest.approx(2 * 450e9 * 0.822 / 3350e9)
    assert kc.hbm_share(p, range(16)) == pytest.approx(2 * 50e9 * 0.96 / 3350e9)
    assert kc.hbm_share(p) == kc.hbm_share(p, [0, 8])          # not said: across nodes
    assert kc.hbm_share(p, [5]) == 0.0 and kc.overlap_rate(p, [5]) == 1.0
    assert kc.hbm_share(H100, NODE) == 0.0                    # the point: not priced
    assert kc.overlap_rate(p, NODE) == pytest.approx(108 / 132 * (1 - 2 * 450 * 0.822 / 3350))
    assert kc.hbm_share(p, iter(NODE)) == kc.hbm_share(p, NODE)   # an iterator, read once
    assert kc.overlap_rate(p, iter(NODE)) == kc.overlap_rate(p, NODE)
    for bad in ([0, -1], 8, [True, 1]):
        with pytest.raises(ValueError, match="ranks"):
            kc.hbm_share(p, bad)
    with pytest.raises(ValueError, match="below 1"):          # 5 x 370 of 3350 GB/s: fine;
        kc.hbm_share(_with(H100, 10.0), NODE)                 # 10 x: more than HBM has


@pytest.mark.parametrize("bad", [-1.0, True, float("nan"), "2"])
def test_a_bad_factor_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="collective_hbm_factor"):
        Topology(collective_hbm_factor=bad)


def test_the_point_is_the_sms_alone_and_the_profiles_say_so():
    for p in (H100, A100, get_profile("h100-hbm2e"), get_profile("a100-jeanzay")):
        assert p.topology.collective_hbm_factor == 0.0
        assert kc.overlap_rate(p, NODE) == pytest.approx(
            (p.topology.sm_count - 24) / p.topology.sm_count)
        cite = p.citations["topology.collective_hbm_factor"]
        assert "UNCERTAIN" in cite and "#1428" in cite and "#172714" in cite
        assert profile_at(p, "slow").topology.collective_hbm_factor == 3.0
        assert profile_at(p, "fast").topology.collective_hbm_factor == 0.0
    assert "topology.collective_hbm_factor" not in [b[0] for b in BOUNDS["ascend-910b"]]


def test_pr172714_matmul_beside_an_all_gather_on_the_h100():
    seq, point = _pr172714(H100)
    assert seq == pytest.approx(2.96e-3, rel=0.03)            # the two alone: 2.90 ms
    assert point == pytest.approx(1.81e-3, rel=0.01)          # SMs alone: 10% fast
    slow = _pr172714(profile_at(H100, "slow"))[1]
    assert point < 2.02e-3 < slow                             # inside the range
    assert _pr172714(_with(H100, 2.0))[1] == pytest.approx(2.02e-3, rel=0.02)  # 2.05 ms


@pytest.mark.parametrize("kernel, alone, beside", [("gemm", 1.18, 2.08),
                                                   ("attention", 0.18, 0.33)])
def test_nccl1428_kernels_beside_an_all_gather_on_the_a100(kernel, alone, beside):
    slowdown = beside / alone
    fast = 1 / kc.overlap_rate(A100, NODE)                     # 108 / 84: 1.29x
    slow = 1 / kc.overlap_rate(profile_at(A100, "slow"), NODE)    # 1.97x
    assert fast < slowdown < slow, (kernel, fast, slowdown, slow)
    assert 1 / kc.overlap_rate(_with(A100, 2.0), NODE) < slowdown  # 2 is too few here


def test_pr179937_matmuls_beside_fsdp_collectives_on_the_h100():
    fast = 1 / kc.overlap_rate(H100, NODE)                     # 1.22x
    slow = 1 / kc.overlap_rate(profile_at(H100, "slow"), NODE)    # 1.83x
    assert fast < 1.30 and 1.40 < slow
    assert 1 / kc.overlap_rate(_with(H100, 2.0), NODE) > 1.40  # 2 is too many here


def test_korthikanti_table4_backward_rules_out_2_as_the_point():
    layer = dict(h=6144, a=64, s=2048, b=4, tp=8, dtype="float16")
    point = layer_times(profile=A100, **layer).backward
    at2 = layer_times(profile=_with(A100, 2.0), **layer).backward
    slow = layer_times(profile=profile_at(A100, "slow"), **layer).backward
    assert point == pytest.approx(11.9e-3, abs=0.05e-3)        # Table 4: 11.9 ms
    assert at2 > 11.9e-3 * 1.015                               # 12.16 ms: 2.2% above
    assert point < slow and 11.9e-3 < slow


def test_the_range_adds_the_contention_on_the_slow_side_only():
    # FSDP (ZeRO-3) on one H100 node: its all-gathers and reduce-scatters run beside the
    # layers; pinned at 0, the slow end loses the contention and nothing else moves
    cfg = get_config("llama3-8b", n_layer=2)
    lay = Layout(dp=8, zero=3, global_batch=8, micro_batch=1)
    r = estimate_range(cfg, lay, Cluster("h100", 8))
    off = estimate_range(cfg, lay, Cluster("h100", 8),
                         pinned={"topology.collective_hbm_factor": 0.0})
    assert any("collective_hbm_factor" in v and "#1428" in v for v in r.varied)
    assert not any("collective_hbm_factor" in v for v in off.varied)
    assert r.estimate.step_time == off.estimate.step_time
    assert r.fast.step_time == off.fast.step_time
    assert r.slow.step_time > off.slow.step_time
    assert math.isfinite(r.slow.step_time)
