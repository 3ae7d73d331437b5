"""Issue 21 (i2117): components the brief asked about, each found priced; the readings the
audit scripts print for them held to the planner's own pricing and to their cited figures.

- (d) kernel launches: the profile's 1 us a launch (CUDA Graphs blog, Gray 2019) is what
  ``compute_time`` adds per launch, and ``h100_breakdown.launch_bound`` counts the layers'
  launches the estimate prices; no single per-launch figure closes the small H100 rows
  without pushing the tp-8 rows beyond 30%.
- (c) DeepSpeed v0.3.13 ZeRO-3: ``zero3_audit.message_sizes`` prices each per-parameter
  collective as ``zero3_2021.dp_sync_parts`` does; the persistent parameters' calls are
  latency-bound, the matrices' bandwidth-bound; the hook count is two per traced module.
- (a) FSDP2's copies: ``torchtitan_breakdown.copy_share_reading`` reproduces the priced
  compute-stream copies from the estimate's byte count and ``fsdp2_cost.COPY_RATE``.
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import h100_breakdown as HB  # noqa: E402
import published as P  # noqa: E402
import step_audit as SA  # noqa: E402
import torchtitan_breakdown as TB  # noqa: E402
import zero3_audit as ZA  # noqa: E402
from workbench.plan import costs as C  # noqa: E402
from workbench.plan import fsdp2_cost as FS  # noqa: E402
from workbench.plan import zero3_2021 as Z  # noqa: E402
from workbench.sim_mesh.cost import compute_time  # noqa: E402
from workbench.sim_mesh.profiles import get_profile  # noqa: E402


def _h100(name):
    return next(r for r in HB.rows() if r["name"] == name)


# -- (d) kernel launches --------------------------------------------------------------

@pytest.mark.parametrize("profile", ["h100", "a100", "h100-hbm2e"])
def test_launch_overhead_is_the_cited_figure_and_charged_per_launch(profile):
    prof = get_profile(profile)
    # the CUDA Graphs blog's ~1 us per back-to-back launch (Gray 2019), the citation's
    assert prof.launch_overhead == pytest.approx(1e-6)
    assert "CUDA Graphs blog" in prof.citations["launch_overhead"]
    # compute_time adds it once per launch: zero work, k launches -> k us
    for k in (1, 7, 35):
        assert compute_time(0.0, 0.0, prof, "bfloat16", "elementwise", launches=k) \
            == pytest.approx(k * prof.launch_overhead)


@pytest.fixture(scope="module")
def launch_rows():
    return {r["name"]: HB.launch_bound(r) for r in HB.rows()}


def test_launch_bound_counts_the_estimates_launches(launch_rows):
    r = _h100("GPT 1.7B")
    cfg, lay, cl = P.build(r)
    ops = SA._layer_ops(cfg, lay, cl.profile, r.get("attention", "flash"),
                        r.get("tp_comm_overlap", False), r.get("transformer_engine", False))
    est = P.predict(r)["estimate"]
    x = launch_rows["GPT 1.7B"]
    assert x["per_layer"] == sum(o["launches"] for o in ops)
    assert x["launches"] == x["per_layer"] * cfg.n_layer * est.details["micro_batches"]
    assert x["priced"] == pytest.approx(x["launches"] * cl.profile.launch_overhead)
    # needed: the gap spread over the launches, on top of the priced 1 us
    assert x["needed"] == pytest.approx(x["gap"] / x["launches"] + 1e-6)
    # at the priced figure the reading is the row's own ratio
    assert x["ratio_at"](1e-6) == pytest.approx(x["ratio"])


def test_no_single_launch_figure_closes_the_small_rows(launch_rows):
    small = [launch_rows[n] for n in ("GPT 1.7B", "GPT 7.1B")]
    at = max(x["needed"] for x in small)
    # what the small rows need is far above the host's raw cuLaunchKernel (tritonbench #1017)
    assert min(x["needed"] for x in small) > 5 * HB.CULAUNCH_HOST_GB200
    assert all(x["ratio_at"](at) <= 1.0 + 1e-9 for x in small)
    # ... and it sends the tp-8 one-stage row beyond 30% pessimistic
    assert launch_rows["GPT 32B"]["ratio_at"](at) < 0.7
    assert launch_rows["GPT 16B"]["needed"] is None        # already pessimistic


# -- (c) DeepSpeed v0.3.13 ZeRO-3 message sizes and hooks -------------------------------

@pytest.fixture(scope="module")
def z530():
    return ZA.message_sizes("GPT 530B", 640)


def test_message_sizes_price_as_the_simulation(z530):
    row = next(r for r in P.ROWS if r["source"] == "narayanan_zero3"
               and r["name"] == "GPT 530B" and r["devices"] == 640)
    cfg, lay, cl = P.build(row)
    ranks = tuple(lay.grad_ranks(0, 0))
    assert z530["p"] == len(ranks) == 640
    names = [pid for _, ps in Z._layer_modules(cfg) for pid, _ in ps]
    assert [c["param"] for c in z530["calls"]] == names
    for c in z530["calls"]:
        assert c["persistent"] == (c["numel"] < Z.PERSISTENCE_NUMEL)
        assert c["reduce_scatter"] == pytest.approx(
            C.group_price("reduce_scatter", 2 * c["numel"], ranks, cl.profile))
        assert c["chunk_bytes"] == pytest.approx(2 * c["numel"] / 640)
        assert (c["all_gather"] is None) == c["persistent"]
    small = sum(c["reduce_scatter"] for c in z530["calls"] if c["persistent"])
    assert z530["small_seconds"] == pytest.approx(lay.m * cfg.n_layer * small)


def test_persistent_calls_latency_bound_matrices_bandwidth_bound(z530):
    pers = [c for c in z530["calls"] if c["persistent"]]
    mats = [c for c in z530["calls"] if not c["persistent"]]
    assert len(pers) == 8 and len(mats) == 4        # GPT layer: 2 LN x 2 + 4 biases; 4 matrices
    assert all(c["rs_latency_share"] > 0.95 for c in pers)
    assert all(c["rs_latency_share"] < 0.2 and c["ag_latency_share"] < 0.2 for c in mats)
    # the latency-bound calls are a few percent of the row's gap at most
    assert 0 < z530["small_seconds"] < 0.05 * z530["gap"]


def test_hooks_two_per_traced_module(z530):
    row = next(r for r in P.ROWS if r["source"] == "narayanan_zero3"
               and r["name"] == "GPT 530B" and r["devices"] == 640)
    cfg, lay, cl = P.build(row)
    est = P.predict(row)["estimate"]
    tcfg = ZA.EC.token_cfg(cfg, lay)
    edge = ZA.edge_times(tcfg, lay.micro_batch, lay.tp, lay.sp, cl.profile)
    trace = Z.gpt_trace(cfg, est.details["layer"], est.details["head"], edge, lay.recompute,
                        Z.partition_activation_seconds(cfg, lay.micro_batch, cl.profile),
                        lay.recompute_num_layers)
    assert z530["hooks"] == 2 * len(trace) * lay.m
    assert z530["per_hook"] == pytest.approx(z530["gap"] / z530["hooks"])
    # the one whole-module host figure found (TE #1191, 140 us) is far below what is needed
    assert z530["per_hook"] > 20 * HB.TE_LINEAR_FWD_HOST_2024


# -- (a) FSDP2's copies ----------------------------------------------------------------

@pytest.mark.parametrize("rc", ["none", "op"])
def test_copy_share_reading_reproduces_the_priced_copies(rc):
    row = next(r for r in TB.rows() if r["name"] == "Llama 2 13B"
               and r["layout"]["recompute"] == rc)
    cfg, lay, cl = P.build(row)
    y = TB.copy_share_reading(row)
    est = P.predict(row)["estimate"]
    cp, m = est.details["fsdp2_copies"], est.details["micro_batches"]
    # stage_copies' kernels a micro-batch: copy-out and chunk-cat of every unit (the root's
    # embedding and head units and the blocks), the copy-out again for the blocks
    # resharded after forward (all but the last): one launch each at launch_overhead,
    # which copy_share_reading leaves out
    launches = 2 * (cfg.n_layer + 2) + (cfg.n_layer - 1)
    assert y["priced"] == pytest.approx(
        m * (cp["forward"] + cp["backward"] - launches * cl.profile.launch_overhead),
        rel=1e-9)
    assert y["plain"] < y["priced"] < y["low"]
    assert y["low_share"] == pytest.approx(min(FS.COPY_RATE.values()))
    assert y["low_share"] == pytest.approx(1836 / 2998)         # the chunk-cat's measured share
    assert y["ratio_low"] < y["ratio"] < y["ratio_plain"]
