"""BLOOM-176B's published runs (``benchmarks/published_bloom.py``), the Jean Zay profile
and DeepSpeed's BF16_Optimizer (``plan.bf16_optimizer``) held to their cited figures.

REGRESSION GUARDS, NOT TARGETS: the ratios' bands are the spread measured when this file
was written (time 0.765 .. 0.935 on the profile's Omni-Path efficiency read as the node's
four adapters; 1.032 .. 1.198 since NCCL's log of the same benchmark showed one adapter
per direction carrying it, bloom3; memory against nvidia-smi 0.767 .. 0.827, 0.812 ..
0.855 with DeepSpeed's partitioned pipeline outputs and the embedding LayerNorm's saved
input, 0.915 .. 0.982 with the caching allocator's cached sync segment, plan.allocator,
and Jean Zay's own NCCL log in plan.comm_memory)
widened by about 0.25 either side; never tune the planner toward them.
"""
import importlib.util
import statistics
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench.plan import bf16_optimizer as BF
from workbench.plan import megatron_2021 as M21
from workbench.plan.memory import stage_params
from workbench.sim_mesh.cost import price
from workbench.sim_mesh.estimates import megatron_flops
from workbench.sim_mesh.profiles import get_profile

_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_DIR))
_spec = importlib.util.spec_from_file_location("benchmarks_published_bloom",
                                               _DIR / "published_bloom.py")
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)
import published as P  # noqa: E402  (the shared comparison, beside it)

_IDS = [r["name"] for r in B.ROWS]
_MEM_IDS = [r["name"] for r in B.MEMORY_ROWS]        # the prequel's other shapes' readings
_OOM_IDS = [r["name"] for r in B.OOM_ROWS]
# a published out-of-memory layout the planner calls fitting: a missing component not
# found in the sources read (the report says which were examined); strict, so that the
# day it is found this test says so
_CALLED_FITTING = {"206B OOM dp8-tp4-pp12-mb2"}


@pytest.fixture(scope="module")
def times():
    return {r["name"]: P.predict(r) for r in B.ROWS}


@pytest.fixture(scope="module")
def mems():
    return {r["name"]: B.memory(r) for r in B.ROWS + B.MEMORY_ROWS + B.OOM_ROWS}


# ---- the rows are the sources' figures ---------------------------------------------

def test_final_run_is_the_readme_layout():
    row = B.ROWS[0]
    lay, m = row["layout"], row["model"]
    assert (lay["tp"], lay["pp"], lay["dp"], lay["micro_batch"], lay["global_batch"]) == \
        (4, 12, 8, 2, 2048) and row["devices"] == 384
    assert (m["d_model"], m["n_layer"], m["n_head"], m["vocab_size"]) == \
        (14336, 70, 112, 250880)
    # "pp rank 0: [embed | 5 transformer blocks] ... pp rank 11: [5 transformer blocks | embed]"
    assert lay["stages"] == (5,) + (6,) * 10 + (5,) and sum(lay["stages"]) == 70
    assert lay["framework"] == "deepspeed" and lay["zero"] == 1 and m["dtype"] == "bfloat16"


def test_published_tflops_are_eq3_of_the_published_seconds():
    """The README's and the prequel's TFLOPs follow from their seconds per iteration
    through Narayanan et al.'s eq. 3 with vocabulary 250,880 (math/README.md: the 4 x 2
    hardware coefficient): the metric is ``Estimate.tflops_per_device``'s."""
    got = megatron_flops(2048, 2048, 70, 14336, 250880) / (104.70 * 384) / 1e12
    assert got == pytest.approx(149.77, abs=0.02)
    for dp, tp, pp, mbs, a, mem, sec, tflops in B.PREQUEL_0228:
        got = megatron_flops(2048, 2048, 70, 14336, 250880) / (sec * dp * tp * pp) / 1e12
        assert got == pytest.approx(tflops, rel=0.002), (dp, tp, a, mbs)


def test_memory_rows_are_the_prequels_other_shapes():
    """chronicles-prequel.md 02-28 'Rebalancing layers': the rows with a Mem reading;
    their TFLOPs follow from eq. 3 at their sizes, as the final shape's do."""
    assert [(r["model"]["d_model"], r["model"]["n_layer"]) for r in B.MEMORY_ROWS] == \
        [(12288, 106)] * 4 + [(12288, 100)] * 2 + [(13312, 82)] * 5 + [(13312, 94)]
    assert sorted(r["published_mem_gib"] for r in B.MEMORY_ROWS) == \
        [52, 60, 61, 62, 63, 65, 67, 67, 67, 72, 74, 79]
    for n, h, l, rows in B.PREQUEL_0228_SHAPES:
        for dp, tp, pp, mbs, a, mem, sec, tflops in rows:
            got = megatron_flops(2048, 2048, l, h, 250880) / (sec * dp * tp * pp) / 1e12
            assert got == pytest.approx(tflops, rel=0.002), (n, dp, tp, mbs, a)


def test_rebalanced_stages_count_the_embeddings_as_layers():
    assert B._stages(70, 12) == (5,) + (6,) * 10 + (5,)
    assert B._stages(100, 6) == (16, 17, 17, 17, 17, 16)
    with pytest.raises(ValueError, match="does not split"):
        B._stages(71, 12)


# ---- time: the spread, bounded ------------------------------------------------------

@pytest.mark.parametrize("rid", _IDS)
def test_time_ratio_in_regression_band(times, rid):
    r = times[rid]
    assert 0.75 <= r["ratio"] <= 1.45, (rid, r["ratio"])
    assert r["low"] <= r["predicted"] <= r["high"]


def test_time_spread_and_the_network_range(times):
    ratios = [r["ratio"] for r in times.values()]
    assert 0.80 <= statistics.median(ratios) <= 1.30
    # the range spans one Omni-Path adapter as NCCL 2.10.3 drove it on the A100 nodes ..
    # on the V100 nodes (plan.ranges): the faster network only raises the throughput
    assert all(r["low"] <= r["predicted"] < r["high"] for r in times.values())


# ---- memory: ran rows fit, OOM rows do not ------------------------------------------

@pytest.mark.parametrize("rid", _IDS + _MEM_IDS)
def test_layout_that_ran_fits(mems, rid):
    assert mems[rid]["fits"], (rid, mems[rid]["busiest"] / 1e9)


@pytest.mark.parametrize("rid", [pytest.param(i, marks=pytest.mark.xfail(
    strict=True, reason="called fitting: a memory component the sources read do not "
                        "give (benchmarks/published_bloom.py)"))
    if i in _CALLED_FITTING else i for i in _OOM_IDS])
def test_published_oom_layout_does_not_fit(mems, rid):
    assert not mems[rid]["fits"], (rid, mems[rid]["busiest"] / 1e9)


def test_memory_against_nvidia_smi_bounded(mems):
    """Stage 0's peak plus the CUDA context over nvidia-smi's reading: below 1 (the
    caching allocator reserves more than the live peak), within the guard band."""
    ratios = [m["ratio"] for m in mems.values() if m["ratio"] is not None]
    assert len(ratios) == len(B.PREQUEL_0228) + len(B.MEMORY_ROWS) == 17
    assert all(0.55 <= x <= 1.05 for x in ratios), ratios


def test_nvidia_smi_reading_counts_the_allocators_cached_sync_segment(mems):
    """What nvidia-smi reads on stage 0 is the caching allocator's reserved memory plus
    the context: the live peak plus the segment torch 1.11 cudaMallocs for
    BF16_Optimizer's bf16 copy of the fp32 gradients at the DP sync (2 bytes per
    parameter in one block, larger than every block freed before it: plan.allocator),
    rounded to 2 MiB; the busiest rank's live peak alone decides ``fits``."""
    ctx = get_profile("a100-jeanzay").runtime_memory["context_bytes"]
    for row in B.ROWS:
        m, lay = mems[row["name"]], row["layout"]
        cfg = wb.models.ModelConfig(**{**dict(arch="gpt", seq_len=2048,
                                              tie_embeddings=True, dropout=0.1),
                                       **row["model"]})
        psi = stage_params(cfg, lay["tp"], lay["pp"], 0, lay["stages"][0])
        segment = -(-2 * psi // 2 ** 21) * 2 ** 21
        first = m["estimate"].details["stages"]["first"]
        assert m["predicted"] == first["memory"]["total"] + segment + ctx, row["name"]
        assert m["live"] == first["memory"]["total"] + ctx
        assert m["fits"] == (m["busiest"] <= m["usable"])


# ---- the Jean Zay profile against its cited figures ---------------------------------

def test_jeanzay_profile_cites_the_cluster():
    jz, a = get_profile("a100-jeanzay"), get_profile("a100")
    assert jz.topology.nics_per_node == 4 and jz.inter_node.bandwidth == 100e9 / 8
    # all_reduce_bench-a100-n4.txt: median busbw 40.54 Gbps through one 100 Gb/s adapter
    # per direction (NCCL's log: both rings GPU 0 <- NET/IB/1, GPU 7 -> NET/IB/3)
    assert jz.inter_node.efficiency == pytest.approx(40.54 / 100, abs=5e-4)
    assert jz.topology.ring_nics == 1 and a.topology.ring_nics is None
    assert jz.runtime_memory["context_bytes"] == 1573 * 2 ** 20
    for k in ("peak_flops", "memory_bandwidth", "memory_bytes", "efficiency",
              "kernel_bandwidth"):            # the same A100 SXM4 80GB
        assert getattr(jz, k) == getattr(a, k), k
    for k in ("inter_node.efficiency", "inter_node.bandwidth", "runtime_memory.context_bytes",
              "topology.ring_nics"):
        assert "bigscience" in jz.citations[k]


def test_jeanzay_all_reduce_reproduces_the_benchmark():
    """The benchmark's own case, a 4 GB all-reduce over 32 ranks on 4 nodes, priced on
    the profile: its bus bandwidth is the measured 40.5 Gbps (NCCL's protocol and step
    latencies add under 1%)."""
    n, p = 4e9, 32
    t = price("all_reduce", n, list(range(p)), "a100-jeanzay")
    busbw_gbps = n / t * 2 * (p - 1) / p * 8 / 1e9
    assert busbw_gbps == pytest.approx(40.54, rel=0.01)


# ---- DeepSpeed's BF16_Optimizer against its source ----------------------------------

def _bf16_small(**kw):
    cfg = wb.models.get_config("gpt3-175b", n_layer=8, d_model=1024, n_head=8, seq_len=512,
                               dtype="bfloat16")
    lay = wb.plan.Layout(**{**dict(dp=2, tp=8, pp=4, zero=1, recompute="full",
                                   global_batch=16, framework="deepspeed"), **kw})
    return cfg, lay, wb.plan.Cluster("a100", 64)


def test_bf16_optimizer_byte_counts():
    # update_hp_grads: hp_grad.add_(lp.grad.to(fp32)): read 2, write 4, read 4 + 4, write 4
    assert BF.HP_GRAD_BYTES == 18
    # allreduce_bucket: cast to bf16 (4 + 2), mul_(1/dp) (2 + 2), copy back (2 + 4)
    assert BF.REDUCE_COPY_BYTES == 16
    assert BF.state_bytes(1e9) == 4e9 and BF.transient_bytes(1e9, 1e6) == (4e6, 2e9)


def test_bf16_pipeline_holds_the_whole_fp32_gradients():
    cfg, lay, cl = _bf16_small()
    est = wb.plan.estimate(cfg, lay, cl)
    psi = stage_params(cfg, 8, 4, 1)
    mid = est.details["stages"]["middle"]["memory"]
    assert mid["buffers"] == pytest.approx(4 * psi, rel=1e-12)       # not divided by dp
    assert mid["optimizer"] == pytest.approx(12 * psi / 2, rel=1e-12)
    ds = est.details["deepspeed_pipe"]
    assert ds["bf16"] and not ds["fp16"]
    assert any("BF16_Optimizer" in a for a in est.assumptions())
    # the fp32 tied gradient (4 bytes), not the bf16 one
    tied = price("all_reduce", 4 * cfg.vocab_size * cfg.d_model / 8,
                 [lay.rank(0, 0, 0), lay.rank(0, 0, 3)], "a100")
    assert ds["tied"] == pytest.approx(tied, rel=1e-12)
    assert est.details["tied_embedding_sync"] == ds["tied"]


def test_bf16_pipeline_prices_its_passes():
    cfg, lay, cl = _bf16_small()
    est = wb.plan.estimate(cfg, lay, cl)
    fp16 = wb.plan.estimate(cfg.replace(dtype="float16"), lay, cl)
    ds, d16 = est.details["deepspeed_pipe"], fp16.details["deepspeed_pipe"]
    psi = stage_params(cfg, 8, 4, 1)
    # the same layers; each micro-batch's backward adds update_hp_grads, where fp16 adds
    # autograd's in-place accumulation of the 16-bit gradients (plan.megatron_2021)
    hp = BF.micro_batch_seconds(psi, 2, cl.profile)
    acc16 = M21.accumulate_seconds(cfg.replace(dtype="float16"), lay, psi, 2, cl.profile,
                                   fusion=False)
    assert acc16 > 0
    assert ds["stages"][1]["backward"] - d16["stages"][1]["backward"] == \
        pytest.approx(hp - acc16, rel=1e-9)
    # ReduceGrads: bf16 all-reduce of the fp32 buffer with its copies, then the all-gather
    ranks = lay.dp_ranks(0, 1)
    want = price("all_reduce", 2 * psi, ranks, "a100") + price("all_gather", 2 * psi, ranks,
                                                               "a100")
    assert ds["stages"][1]["dp"] > want
    assert ds["stages"][1]["dp"] == pytest.approx(BF.dp_sync(psi, lay, cl.profile, 1),
                                                  rel=1e-12)


def test_bf16_pipeline_refuses_zero_0():
    cfg, lay, cl = _bf16_small(zero=0)
    with pytest.raises(ValueError, match=r"BF16_Optimizer.*use zero=1"):
        wb.plan.estimate(cfg, lay, cl)
