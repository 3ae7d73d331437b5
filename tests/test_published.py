"""The planner beside published end-to-end measurements (``benchmarks/published.py``):
robust properties only, never a fit.

- every row estimates, to a finite positive figure, and fits device memory, since the
  layout really ran (a row the memory model rejects would be a bug to report, marked
  ``xfail(strict=True)`` with the reason; none is today);
- the ratio predicted / published stays in its source's ``BANDS``.  REGRESSION GUARD,
  NOT A TARGET.  Measured when this file was written: A100 rows (Narayanan Table 1 and
  the Korthikanti MFU) 1.091 .. 1.251 (1.056 .. 1.219 since the attention core and dropout
  are priced at their measured A100 rates; Table 1 1.039 .. 1.127 since its rows run
  Megatron-LM's layer of 2021, plan.megatron_2021, and its pp=1 rows overlap torch DDP's
  all-reduce with the last backward as DDP does), band 0.85 .. 1.50; H100 rows (Megatron-LM's 2024
  table, many assumptions: see benchmarks/published.py) 0.835 .. 1.560 (0.899 .. 1.605 since
  their DP sync overlaps as the README's flags say; 0.754 .. 1.599 since Megatron-LM
  reduces bf16 gradients in fp32, plan.frameworks; 0.727 .. 1.548 since the H100 profile
  has its 132 SMs, NCCL's 16 beside compute and GEMM waves; 0.687 .. 1.225 on the H100
  rates measured on an H100; 0.788 .. 1.225 since they run with --tp-comm-overlap as the
  README says, plan.tp_overlap: band unchanged), band
  0.60 .. 1.85; MT-NLG 530B at data parallelism 8, 10, 12 (a secondary source's quote)
  1.432 .. 1.501 (1.430 .. 1.498 since DeepSpeed's pipeline engine is priced from its
  source, plan.deepspeed_step; 1.301 .. 1.364 since its Megatron-DeepSpeed layers run
  as their source does, without the async TP all-reduce and the fused gradient
  accumulation of later Megatron-LM, plan.megatron_2021; 1.203 .. 1.259 since they run
  bf16 as the paper's sec. 2.3 says, through DeepSpeed's BF16_Optimizer, tests/
  test_mtnlg2.py: band unchanged), band 1.15 .. 1.80; Narayanan Table 2's ZeRO-3 rows
  (DeepSpeed of spring 2021, ``plan.zero3_2021``, a secondary source's encoding) 0.896 ..
  1.402, band 0.65 .. 1.65; BLOOM-176B on Jean Zay (``published_bloom``: the final run and
  the prequel's rows at its shape, NCCL over Omni-Path at the cluster's measured
  efficiency) 0.765 .. 0.935 (1.032 .. 1.198 since that benchmark's NCCL log showed it
  ran on one adapter per direction, profile a100-jeanzay's ring_nics, bloom3), band
  0.80 .. 1.45; torchtitan's FSDP2 rows
  (``published_torchtitan``: eager, H100 on profile h100-hbm2e at its peak's midpoint,
  A100 on the a100 profile) 1.144 .. 1.375 (1.081 .. 1.218 since their Llama block runs
  torchtitan's eager kernels, plan.titan_eager), band 0.85 .. 1.50: each the measured
  spread widened by about 0.25 either side.
  It catches a clock
  that loses or doubles a term (backward unpriced: ratio ~2; recompute counted twice:
  ~0.75), not a few percent.
  Do not tune the planner to move the ratios toward 1, and do not widen the band
  silently: a change that moves a row out of it says why in its commit;
- the transcribed data agree with the published tables' own redundant columns.
"""
import importlib.util
import math
from pathlib import Path

import pytest

from workbench.models import param_count
from workbench.sim_mesh.estimates import megatron_params

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "published.py"
_spec = importlib.util.spec_from_file_location("benchmarks_published", _PATH)
P = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(P)

BANDS = {"narayanan": (0.85, 1.50), "korthikanti": (0.85, 1.50),
         "megatron_h100": (0.60, 1.85), "mt_nlg": (1.15, 1.80),
         "narayanan_zero3": (0.65, 1.65), "bloom": (0.80, 1.45),
         "torchtitan": (0.85, 1.50)}
_IDS = [f"{r['source']}-{r['name'].split()[-1]}-{r['devices']}" for r in P.ROWS]


@pytest.fixture(scope="module")
def results():
    return {i: P.predict(r) for i, r in zip(_IDS, P.ROWS)}


@pytest.mark.parametrize("rid", _IDS)
def test_row_estimates_finite_positive(results, rid):
    r = results[rid]
    est = r["estimate"]
    for name, x in [("step_time", est.step_time), ("predicted", r["predicted"]),
                    ("mfu", est.mfu), ("hfu", est.hfu), *est.memory.items(),
                    *est.breakdown.items()]:
        assert math.isfinite(x) and x >= 0, (rid, name, x)
    assert est.step_time > 0 and r["predicted"] > 0
    assert 0 < est.mfu <= est.hfu <= 1, (est.mfu, est.hfu)
    assert est.breakdown["compute"] > 0


@pytest.mark.parametrize("rid", _IDS)
def test_layout_that_ran_fits(results, rid):
    est = results[rid]["estimate"]
    assert est.fits, (f"{rid} ran on A100-80GB but the planner says "
                      f"{est.memory['total'] / 1e9:.1f} GB does not fit: {est.memory}")


@pytest.mark.parametrize("rid", _IDS)
def test_ratio_in_regression_band(results, rid):
    ratio, band = results[rid]["ratio"], BANDS[results[rid]["row"]["source"]]
    assert band[0] <= ratio <= band[1], (
        f"{rid}: predicted / published = {ratio:.3f} left the regression band {band} "
        f"(module docstring: find which term changed; never tune to this)")


@pytest.mark.parametrize("row", P.TABLE_1, ids=[r[0] for r in P.TABLE_1])
def test_table_1_transcription_consistent(row):
    name, h, l, params_b, mp, gpus, batch, tflops, pct, pflops = row
    heads, tp, pp, mbs, vls = P.RUN_TABLE_1[name]
    assert tp * pp == mp                                  # the README's model-parallel size
    assert gpus % mp == 0 and batch % (mbs * gpus // mp) == 0
    assert h % heads == 0 and l % pp == 0 and (vls is None or l % (pp * vls) == 0)
    # eq. 2 (vocabulary 51,200, sequence 2048) gives the printed parameter count
    assert abs(megatron_params(l, h, 51200, 2048) / 1e9 - params_b) <= 0.05 + 1e-9
    # per-GPU teraFLOP/s (rounded to 1) x GPUs = aggregate petaFLOP/s (rounded to 0.1)
    assert abs(tflops * gpus / 1000 - pflops) <= 0.5 * gpus / 1000 + 0.05
    assert abs(100 * tflops / 312 - pct) <= 100 * 0.5 / 312 + 0.5   # A100 peak 312


@pytest.mark.parametrize("row", P.README_MFU, ids=[r[0] for r in P.README_MFU])
def test_readme_hfu_counts_attention_core_twice(row):
    """Why the README's HFU is not compared: its HFU / MFU is (1 + s/3h + V/12hL) /
    (1 + s/6h + V/12hL), within the rounding of two percentages to 0.1."""
    name, h, l, *_, mfu, hfu = row
    tol = 0.05 / mfu + 0.05 * hfu / mfu ** 2
    assert abs(hfu / mfu - P.readme_hfu_over_mfu(h, l)) <= tol, name


@pytest.mark.parametrize("row", P.TABLE_H100, ids=[r[0] for r in P.TABLE_H100])
def test_h100_table_transcription_consistent(row):
    name, heads, h, l, tp, pp, dp, gpus, batch, tflops, mfu, pflops = row
    assert tp * pp * dp == gpus and batch % dp == 0 and h % heads == 0 and l % pp == 0
    assert abs(100 * tflops / 989 - mfu) <= 0.5 + 1e-9          # MFU column: x / 989
    assert abs(tflops * gpus / 1000 - pflops) <= 0.05 * gpus / 1000 + 0.05
    # the model-size column counts untied embeddings (our assumption; tied would be
    # 1.49B for "1.7B"): the count rounded or truncated to the column's last digit
    cfg, _, _ = P.build(next(r for r in P.ROWS if r["source"] == "megatron_h100"
                             and r["name"] == f"GPT {name}"))
    size, unit = float(name[:-1]), 0.1 if "." in name else 1.0
    assert size - unit / 2 <= param_count(cfg).module / 1e9 < size + unit


@pytest.mark.parametrize("row", P.MT_NLG, ids=[str(r[0]) for r in P.MT_NLG])
def test_mt_nlg_quote_consistent(row):
    """The quoted iteration times and teraFLOP/s agree through Narayanan et al.'s eq. 3
    (full recompute, vocabulary 51,200) within 1%: the figures cohere, and the metric
    counts the recomputed forward, as ``tflops_per_device`` does."""
    from workbench.sim_mesh.estimates import megatron_flops
    nodes, seconds, tflops = row
    got = megatron_flops(1920, 2048, 105, 20480, 51200) / (seconds * 8 * nodes) / 1e12
    assert got == pytest.approx(tflops, rel=0.01)


@pytest.mark.parametrize("row", P.ZERO3_2021, ids=[f"{r[0]}B-{r[1]}" for r in P.ZERO3_2021])
def test_zero3_2021_encoding_consistent(row):
    """Table 2's teraFLOP/s and training days agree through Narayanan et al.'s eq. 4
    (8 T P / (n X), T = 300e9 tokens, P = 174.6e9 / 529.6e9 parameters) within 4%
    (eq. 4 leaves out eq. 3's small terms); the GPUs divide the batch (one micro-batch
    per step each)."""
    size, gpus, gbs, tflops, days = row
    params = {175: 174.6e9, 530: 529.6e9}[size]
    got = 8 * 300e9 * params / (gpus * tflops * 1e12) / 86400
    assert got == pytest.approx(days, rel=0.04)
    assert gbs % gpus == 0
