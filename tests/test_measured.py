"""The clock priced from a device's component measurements (``sim_mesh.measured``, the
H100 profile's ``measured``): the file's own figures come back at its grid points, the
interpolation stays between them, and the layers composed from the measured kernels
agree with the whole layers timed on the same card."""
import dataclasses
import json
import sys
from importlib import resources
from pathlib import Path

import pytest

from workbench.plan import layer_cost as L
from workbench.sim_mesh import cost, measured
from workbench.sim_mesh.profiles import get_profile

H100 = get_profile("h100")
FILE = H100.measured["file"]
RAW = json.loads(resources.files("workbench.sim_mesh").joinpath(
    "measurements", FILE).read_text())


def test_the_file_records_the_card_and_its_software():
    env = RAW["environment"]
    assert env["name"] == "NVIDIA H100 80GB HBM3" and env["sm_count"] == 132
    assert env["torch"].startswith("2.11") and env["smi"]["power.limit"] == "700.00 W"
    s = measured.summary(FILE)
    # sustained 8192^3 bf16 under the 700 W cap: about 683 TFLOP/s, not the MAMF 792
    assert 650 < s["sustained_tflops"] < 700 and s["gemm_grid_points"] == 1173


def test_grid_points_come_back_exactly():
    exact = measured.load(FILE).exact
    for m, n, k, tflops in RAW["gemm_grid"][::37]:
        if (min(m, n), max(m, n), k) in exact:
            continue                    # the product's own three-layout timing wins
        assert measured.gemm_rate(FILE, m, n, k) == pytest.approx(tflops * 1e12)


def test_an_exact_product_uses_its_layout_measurement():
    row = next(r for r in RAW["model_gemms"] if (r["m"], r["n"], r["k"]) == (4096, 3840, 10240))
    # forward: output 4096 x 3840, 10240 reduced; weight gradient: 3840 x 10240, 4096
    assert measured.gemm_rate(FILE, 4096, 3840, 10240) == pytest.approx(row["fwd"] * 1e12)
    assert measured.gemm_rate(FILE, 3840, 10240, 4096) == pytest.approx(row["wgrad"] * 1e12)
    assert measured.gemm_rate(FILE, 10240, 3840, 4096) == pytest.approx(row["wgrad"] * 1e12)


def test_interpolation_lies_between_neighbours_and_holds_at_the_edges():
    g = {(m, n, k): t * 1e12 for m, n, k, t in RAW["gemm_grid"]}
    a, b = g[(2048, 4096, 4096)], g[(2048, 6144, 4096)]
    mid = measured.gemm_rate(FILE, 2048, 5000, 4096)
    assert min(a, b) <= mid <= max(a, b)
    # beyond the largest sizes the plateau holds; a one-token product keeps the edge's
    # rate and the roofline's memory term prices it (reading the weight)
    assert measured.gemm_rate(FILE, 65536, 65536, 65536) == pytest.approx(
        measured.gemm_rate(FILE, 16384, 49152, 49152))
    t = cost.compute_time(2 * 4096 * 4096, 2 * 4096 * 4096, H100, "bfloat16", "matmul",
                          gemm=(1, 1, 4096))
    assert t == pytest.approx(2 * 4096 * 4096 / (3.35e12 * 0.901) + 1e-6)


def test_a_gemm_is_priced_at_its_measured_rate():
    flops = 2 * 4096 * 8192 * 8192
    t = cost.compute_time(flops, 0, H100, "bfloat16", "matmul", gemm=(1, 4096, 8192))
    assert t == pytest.approx(flops / measured.gemm_rate(FILE, 4096, 8192, 8192) + 1e-6)
    # fp32 was not measured: peak x the MAMF efficiency x tile quantization, as before
    t32 = cost.compute_time(flops, 0, H100, "float32", "matmul", gemm=(1, 4096, 8192))
    assert t32 == pytest.approx(flops / (67e12 * 0.801 * cost.gemm_efficiency(
        (1, 4096, 8192), H100)) + 1e-6)


def test_a_batched_gemm_is_priced_as_its_items_stacked():
    """16 products of (2048 x 2048, K = 128), attention's scores: the rate of the one
    (32,768 x 2048) GEMM they fill the device as, not a lone item's (about 3x slower)."""
    b, m, n, k = 16, 2048, 2048, 128
    flops = 2 * b * m * n * k
    t = cost.compute_time(flops, 0, H100, "bfloat16", "matmul", gemm=(b, m, n))
    assert t == pytest.approx(flops / measured.gemm_rate(FILE, b * m, n, k) + 1e-6)
    assert measured.gemm_rate(FILE, b * m, n, k) > 2 * measured.gemm_rate(FILE, m, n, k)


def test_attention_rates_at_the_measured_points():
    for r in RAW["attention"]:
        if r["head_dim"] != 128 or r["backend"] not in ("cudnn", "flash"):
            continue
        args = (FILE, r["backend"], r["batch"] * r["heads"], r["seq"], 128, r["causal"])
        assert measured.attention_rate(*args) == pytest.approx(r["fwd_tflops"] * 1e12)
        assert measured.attention_rate(*args, backward=True) == \
            pytest.approx(r["bwd_tflops"] * 1e12)
    # head dimension 64: scaled by the file's ratio at 64 (cuDNN: 329.7 / 453.9 forward)
    assert measured.attention_rate(FILE, "cudnn", 16, 4096, 64) == pytest.approx(329.7e12)


def test_layers_composed_from_measured_kernels_agree_with_whole_layers():
    """The whole layers the file timed on the same card (plain PyTorch: SDPA, unfused
    LayerNorm / GeLU / dropout; Llama with K and V repeated per group) against
    ``layer_times`` composed from the measured GEMMs, attention and kernels: within 8%
    (the plain-PyTorch layers fuse less than Megatron's, whose kernels layer_cost
    prices)."""
    for row in RAW["layers"]:
        kv, ffn = (row["kv_heads"], row["ffn"]) if row["arch"] == "llama" else (None, None)
        t = L.layer_times(row["h"], row["heads"], row["seq"], 1, 1, attention="flash",
                          profile="h100", kv_heads=kv, ffn=ffn)
        assert t.combined == pytest.approx(row["fwd_bwd_s"], rel=0.08), row["name"]


def test_the_loss_runs_at_the_measured_rate():
    rate = measured.cross_entropy_rate(FILE)
    rows = [r for r in RAW["memory_bound"] if r["kernel"] == "cross_entropy_fwd_bwd_fp32"
            and r["shape"][1] >= 16384]
    assert min(4096 * r["shape"][1] / r["seconds"] for r in rows) <= rate <= \
        max(4096 * r["shape"][1] / r["seconds"] for r in rows)


def test_bad_measured_fields_are_refused():
    with pytest.raises(ValueError, match="attention_backend.*'triton' was not measured"):
        dataclasses.replace(H100, measured={"file": FILE, "attention_backend": "triton"})
    with pytest.raises(ValueError, match="no such file"):
        dataclasses.replace(H100, measured={"file": "nope.json", "attention_backend": "x"})
    with pytest.raises(ValueError, match="exactly file and attention_backend"):
        dataclasses.replace(H100, measured={"file": FILE})
    back = type(H100).from_dict(H100.to_dict())
    assert dict(back.measured) == dict(H100.measured)


def test_the_script_runs_on_the_cpu_and_its_output_loads(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import gpu_components
    finally:
        sys.path.pop(0)
    out = tmp_path / "m.json"
    res = gpu_components.main(["--smoke", "--out", str(out)])
    t = measured.load(str(out))
    assert res["attention"] and res["layers"] and res["memory_bound"]
    assert t.gemm and measured.gemm_rate(str(out), 16, 16, 16) > 0


def test_a_whole_one_gpu_step_against_the_planner():
    """A GPT of 1.75B parameters (h 2048, 24 layers, vocabulary 131,072, sequence 4096,
    micro-batch 1) trained in plain PyTorch on the same H100 (benchmarks/gpu_step.py:
    layers, head, fp32 loss, fused AdamW; no communication): the planner's step on the
    h100 profile is within 8% of the measured one, for 4 micro-batches and for 1.  The
    update priced as that script runs it, not as Megatron-LM's (plan.optimizer_step):
    torch's fused AdamW on the bf16 weights and their bf16 states (7 accesses of 2 bytes,
    sim_mesh.optimizer_cost) after ``zero_grad(set_to_none=False)`` (a 2-byte memset)."""
    import workbench as wb
    from workbench.sim_mesh.cost import compute_time
    from workbench.sim_mesh.optimizer_cost import adam_kernels
    ran = adam_kernels(decoupled=True, weight_decay=0.01, fused=True, foreach=False)
    steps = json.loads(resources.files("workbench.sim_mesh").joinpath(
        "measurements", "h100-sxm-80gb-gpt-step.json").read_text())["steps"]
    assert [s["micro_batches"] for s in steps] == [4, 1]
    for s in steps:
        cfg = wb.models.ModelConfig(arch="gpt", vocab_size=s["vocab"], seq_len=s["seq"],
                                    n_layer=s["layers"], n_head=s["heads"], d_model=s["h"],
                                    tie_embeddings=False, dropout=0.1, dtype="bfloat16")
        lay = wb.plan.Layout(dp=1, micro_batch=1, global_batch=s["micro_batches"])
        e = wb.plan.estimate(cfg, lay, wb.plan.Cluster("h100", 1), attention="flash")
        update = compute_time(0.0, (2 * ran.accesses + 2) * s["params"], "h100", "bfloat16",
                              launches=ran.launches + 1)
        step = e.step_time - e.details["optimizer"] + update
        assert step == pytest.approx(s["step_s"], rel=0.08)


def test_the_tile_model_the_a100_relies_on_is_not_optimistic_on_the_measured_card():
    """Profiles without a GEMM grid (the A100) price a GEMM at one large product's
    sustained rate times ``cost.gemm_efficiency`` (256 x 128 tiles in waves of the SMs).
    Held to the H100's 240 measured layer GEMMs (80 products, three layouts each) from
    its sustained 8192^3 rate, the model errs both ways (by -26% .. +84%: cuBLAS picks
    other tiles) and is not optimistic on the whole (median measured / model 1.03), so the
    shape model is not what makes the A100 rows optimistic."""
    import statistics
    sustained = statistics.median(r["tflops"] for r in RAW["sustained"]["per_second"])
    ratios = []
    for r in RAW["model_gemms"]:
        m, n, k = r["m"], r["n"], r["k"]
        for out, lay in (((m, n), "fwd"), ((m, k), "dgrad"), ((n, k), "wgrad")):
            model = sustained * cost.gemm_efficiency((1, *out), H100)
            ratios.append(r[lay] / model)
    assert len(ratios) == 240
    assert min(ratios) < 0.8 and max(ratios) > 1.5          # wrong both ways, shape by shape
    assert 1.0 <= statistics.median(ratios) <= 1.06        # not optimistic on the whole


# Agrawal et al., Vidur (MLSys 2024), microsoft/vidur at 7d47513363ec447a741ac5e47241580b47724fbf,
# data/profiling/compute/{a100,h100}/<org>/<model>/mlp.csv: the kernel time of each Linear of a
# Llama layer, profiled by vidur/profiling/mlp (fp16 weights, dummy-initialised uniform in
# +-1e-3, torch.inference_mode(); the GPU kernels inside each record_function range of one
# 20-layer forward, read from its Kineto trace: vidur/profiling/utils/record_function_tracer.py),
# column time_stats.<op>.median (ms, the median over the 20 layers), the file's line given.
# Rows: (model, line, op, M tokens, N out features, K in features, ms); x (M, K) @ W^T (K, N).
# Lines 2 / 67 / 197 are tensor-parallel 1, 263 / 523 / 653 tensor-parallel 2 (W sliced).
# mlp_down_proj is left out: its input, SiLU(gate) x up of those tiny weights, underflows fp16
# to exactly zero (emulated on the CPU for a 64-token Llama 2 7B layer, fp32 accumulation: every
# element 0), and zeros draw less switching power, so run faster (He 2024); on the H100 those
# rows read 1.09 of our measured rate (median) where the other three read 0.99-1.04.
VIDUR_A100 = (
    ("Llama-2-7b-hf", 2, "attn_pre_proj", 4096, 12288, 4096, 1.911),
    ("Llama-2-7b-hf", 2, "attn_post_proj", 4096, 4096, 4096, 0.611),
    ("Llama-2-7b-hf", 2, "mlp_up_proj", 4096, 22016, 4096, 3.3655),
    ("Llama-2-7b-hf", 263, "attn_pre_proj", 4096, 6144, 4096, 0.9215),
    ("Llama-2-7b-hf", 263, "attn_post_proj", 4096, 4096, 2048, 0.315),
    ("Llama-2-7b-hf", 263, "mlp_up_proj", 4096, 11008, 4096, 1.6015),
    ("Llama-2-70b-hf", 2, "attn_pre_proj", 4096, 10240, 8192, 2.872),
    ("Llama-2-70b-hf", 2, "attn_post_proj", 4096, 8192, 8192, 2.377),
    ("Llama-2-70b-hf", 2, "mlp_up_proj", 4096, 57344, 8192, 15.9405),
    ("Llama-2-70b-hf", 263, "attn_pre_proj", 4096, 5120, 8192, 1.411),
    ("Llama-2-70b-hf", 263, "attn_post_proj", 4096, 8192, 4096, 1.276),
    ("Llama-2-70b-hf", 263, "mlp_up_proj", 4096, 28672, 8192, 7.97),
    ("CodeLlama-34b-Instruct-hf", 2, "attn_pre_proj", 4096, 10240, 8192, 2.842),
    ("CodeLlama-34b-Instruct-hf", 2, "attn_post_proj", 4096, 8192, 8192, 2.367),
    ("CodeLlama-34b-Instruct-hf", 2, "mlp_up_proj", 4096, 44032, 8192, 12.1265),
    ("CodeLlama-34b-Instruct-hf", 263, "attn_pre_proj", 4096, 5120, 8192, 1.426),
    ("CodeLlama-34b-Instruct-hf", 263, "attn_post_proj", 4096, 8192, 4096, 1.286),
    ("CodeLlama-34b-Instruct-hf", 263, "mlp_up_proj", 4096, 22016, 8192, 6.1905),
    ("Meta-Llama-3-8B", 67, "attn_pre_proj", 16384, 6144, 4096, 4.046),
    ("Meta-Llama-3-8B", 67, "attn_post_proj", 16384, 4096, 4096, 2.5685),
    ("Meta-Llama-3-8B", 67, "mlp_up_proj", 16384, 28672, 4096, 16.7235),
    ("Meta-Llama-3-8B", 197, "attn_pre_proj", 4096, 6144, 4096, 1.013),
    ("Meta-Llama-3-8B", 197, "attn_post_proj", 4096, 4096, 4096, 0.625),
    ("Meta-Llama-3-8B", 197, "mlp_up_proj", 4096, 28672, 4096, 4.127),
    ("Meta-Llama-3-8B", 523, "attn_pre_proj", 16384, 3072, 4096, 1.972),
    ("Meta-Llama-3-8B", 523, "attn_post_proj", 16384, 4096, 2048, 1.356),
    ("Meta-Llama-3-8B", 523, "mlp_up_proj", 16384, 14336, 4096, 8.956),
    ("Meta-Llama-3-8B", 653, "attn_pre_proj", 4096, 3072, 4096, 0.444),
    ("Meta-Llama-3-8B", 653, "attn_post_proj", 4096, 4096, 2048, 0.334),
    ("Meta-Llama-3-8B", 653, "mlp_up_proj", 4096, 14336, 4096, 2.2045),
    ("Meta-Llama-3-70B", 67, "attn_pre_proj", 16384, 10240, 8192, 11.213),
    ("Meta-Llama-3-70B", 67, "attn_post_proj", 16384, 8192, 8192, 8.8785),
    ("Meta-Llama-3-70B", 67, "mlp_up_proj", 16384, 57344, 8192, 68.289),
    ("Meta-Llama-3-70B", 197, "attn_pre_proj", 4096, 10240, 8192, 2.964),
    ("Meta-Llama-3-70B", 197, "attn_post_proj", 4096, 8192, 8192, 2.475),
    ("Meta-Llama-3-70B", 197, "mlp_up_proj", 4096, 57344, 8192, 16.5495),
    ("Meta-Llama-3-70B", 523, "attn_pre_proj", 16384, 5120, 8192, 5.957),
    ("Meta-Llama-3-70B", 523, "attn_post_proj", 16384, 8192, 4096, 5.2045),
    ("Meta-Llama-3-70B", 523, "mlp_up_proj", 16384, 28672, 8192, 32.623),
    ("Meta-Llama-3-70B", 653, "attn_pre_proj", 4096, 5120, 8192, 1.4775),
    ("Meta-Llama-3-70B", 653, "attn_post_proj", 4096, 8192, 4096, 1.329),
    ("Meta-Llama-3-70B", 653, "mlp_up_proj", 4096, 28672, 8192, 8.2455),
)
VIDUR_H100 = (
    ("Llama-2-7b-hf", 2, "attn_pre_proj", 4096, 12288, 4096, 0.584),
    ("Llama-2-7b-hf", 2, "attn_post_proj", 4096, 4096, 4096, 0.193),
    ("Llama-2-7b-hf", 2, "mlp_up_proj", 4096, 22016, 4096, 0.987),
    ("Llama-2-7b-hf", 263, "attn_pre_proj", 4096, 6144, 4096, 0.2815),
    ("Llama-2-7b-hf", 263, "attn_post_proj", 4096, 4096, 2048, 0.102),
    ("Llama-2-7b-hf", 263, "mlp_up_proj", 4096, 11008, 4096, 0.499),
    ("Llama-2-70b-hf", 2, "attn_pre_proj", 4096, 10240, 8192, 0.9825),
    ("Llama-2-70b-hf", 2, "attn_post_proj", 4096, 8192, 8192, 0.7885),
    ("Llama-2-70b-hf", 2, "mlp_up_proj", 4096, 57344, 8192, 5.6685),
    ("Llama-2-70b-hf", 263, "attn_pre_proj", 4096, 5120, 8192, 0.493),
    ("Llama-2-70b-hf", 263, "attn_post_proj", 4096, 8192, 4096, 0.4045),
    ("Llama-2-70b-hf", 263, "mlp_up_proj", 4096, 28672, 8192, 2.756),
    ("CodeLlama-34b-Instruct-hf", 2, "attn_pre_proj", 4096, 10240, 8192, 0.96),
    ("CodeLlama-34b-Instruct-hf", 2, "attn_post_proj", 4096, 8192, 8192, 0.771),
    ("CodeLlama-34b-Instruct-hf", 2, "mlp_up_proj", 4096, 44032, 8192, 4.219),
    ("CodeLlama-34b-Instruct-hf", 263, "attn_pre_proj", 4096, 5120, 8192, 0.4935),
    ("CodeLlama-34b-Instruct-hf", 263, "attn_post_proj", 4096, 8192, 4096, 0.388),
    ("CodeLlama-34b-Instruct-hf", 263, "mlp_up_proj", 4096, 22016, 8192, 2.107),
)


def _vidur_rates(rows):
    """(FLOP/s, (M, N, K)) of each transcribed Vidur row: 2 M N K over its median kernel time."""
    return [(2.0 * m * n * k / (ms * 1e-3), (m, n, k)) for _, _, _, m, n, k, ms in rows]


def test_vidurs_kernel_times_reproduce_the_measured_h100():
    """The method check: Vidur's H100 figures (an SXM part as far as can be told: the repo's
    H100 node is a DGX, and an H100 NVL, 835 TFLOP/s dense, would have to sustain 0.9 of its
    peak to match the fastest) against the same products in the H100 file, timed back to back on
    random bf16 data: median 1.03 of our rate (0.97 .. 1.12). Kernel times read from one
    traced forward agree with sustained back-to-back timing within a few per cent, so what
    separates Vidur's A100 figures from the a100 profile (next test) is not the method."""
    import statistics
    ratios = [rate / measured.gemm_rate(FILE, m, n, k)
              for rate, (m, n, k) in _vidur_rates(VIDUR_H100)]
    assert len(ratios) == 18
    assert 0.98 <= statistics.median(ratios) <= 1.06
    assert 0.95 <= min(ratios) and max(ratios) <= 1.15


def test_the_a100_model_against_vidurs_a100_layer_gemms():
    """The only published per-shape A100 GEMM set found at transformer shapes (issue 21,
    branch a100gemm): 42 Llama layer GEMMs timed by Vidur on an A100 80GB, held to the a100
    profile's price (258 TFLOP/s x the tile / wave factor, cost.gemm_efficiency).

    Which A100 is NOT stated per file: docs/profiling.md (lines 30, 81, 83) keeps one compute
    folder for both its A100 nodes, "a100_pair_nvlink: Azure Standard_NC96ads_A100_v4 with 4
    80GB A100 PCIe GPUs" and "a100_dgx: A100 DGX with 8 80GB A100s", and the Llama 3 rows
    came with "Support Llama3 8B and 70B ... on a100_pairwise_nvlink" (commit 1478250): most
    likely the 300 W PCIe card, not the profile's 400 W SXM (He 2024's 258 is an SXM under its
    400 W cap; the MAMF table's best-shape bursts: PCIe 252.9 / 256.4 against SXM 271.2 /
    267.9). So these rows price no A100 here; they show:

    - the level: measured / model median 0.91 (0.79 .. 1.01); the card's own plateau
      (products the tile model fills to 0.98 or more) 232.5 TFLOP/s = 0.90 of 258. On an
      A100-SXM4-80GB the same large products hold 0.99-1.00 of the model (next test), so
      the 0.90 is this card's (a 300 W cap), not the SXM's ceiling (Mu Li,
      mli/transformers-benchmarks README: "A100 80GB" fp16 matmul 230 TFLOP/s at n = 8192,
      SKU not stated, reads the same 0.89);
    - the shape: held to that plateau instead, the tile / wave factor errs both ways by at
      most 13% (0.87 .. 1.12, median 1.01), as on the H100 (test_the_tile_model_the_a100_
      relies_on_is_not_optimistic_on_the_measured_card): the shape model is not what makes
      the A100 rows optimistic."""
    import statistics
    a100 = get_profile("a100")
    rates = _vidur_rates(VIDUR_A100)
    assert len(rates) == 42
    model = [cost.compute_time(2.0 * m * n * k, 0, a100, "float16", "matmul", launches=0,
                               gemm=(1, m, n)) for _, (m, n, k) in rates]
    ratios = [rate * t / (2.0 * m * n * k) for (rate, (m, n, k)), t in zip(rates, model)]
    assert 0.88 <= statistics.median(ratios) <= 0.94
    assert min(ratios) > 0.75 and max(ratios) < 1.05        # the model is above almost every row
    eff = [cost.gemm_efficiency((1, m, n), a100) for _, (m, n, k) in rates]
    plateau = statistics.median(r for (r, _), e in zip(rates, eff) if e >= 0.98)
    assert 0.88 <= plateau / (a100.peak_flops["float16"] * a100.efficiency["matmul"]) <= 0.92
    shape = [r / (plateau * e) for (r, _), e in zip(rates, eff)]
    assert 0.97 <= statistics.median(shape) <= 1.05
    assert 0.85 <= min(shape) and max(shape) <= 1.15


# Azure/AI-benchmarking-guide at 8fd0c6e1bd0f853ef8f0500a3640a7d80a2a92ef,
# Azure_Results/ND_A100_v4_results.md lines 21-31 ("NVIDIA A100-SXM4-80GB", CUDA 12.5, driver
# 550.90.07; "random initialization ..., FP16, and 10,000 warmup iterations"): cuBLASLt through
# superbench's cublaslt_gemm as the guide builds it (Benchmarks/GEMMCublasLt.py: -w 10000 -i 1000,
# its fork gitaumark/superbenchmark at 3e2f95d1b6c3e27fe4a675559fa37b57513b1e4f, the version of
# the run's date: A and B uniform in [-1, 1] by curand, lines 121-122; 1000 back-to-back calls
# between CUDA events, lines 141-150). (m, n, k, TFLOP/s): output m x n, k reduced (C = A^T B).
AZURE_A100_SXM = (
    (1024, 1024, 1024, 119.4),
    (2048, 2048, 2048, 221.8),
    (4096, 4096, 4096, 228.0),
    (8192, 8192, 8192, 253.7),
    (16384, 16384, 16384, 256.5),
    (1024, 2145, 1024, 132.8),
    (6144, 12288, 12288, 250.8),
    (802816, 192, 768, 157.8),
)


def test_the_a100_model_against_an_sxm_a100s_sustained_gemms():
    """A100-SXM4-80GB (Azure ND A100 v4), random fp16 data, sustained (10,000 warm-up calls):
    the profile's ceiling holds where the model says the tiles fill the waves: 8192^3 0.985,
    16384^3 0.996, 6144 x 12288 x 12288 (a GPT-3 175B layer's shape) 1.002, 4096^3 0.932 of
    the price. So the A100 rows' optimism is not the GEMM rate of large products. Where the
    model errs is documented in cost.gemm_efficiency and shown here: a product of fewer
    256 x 128 tiles than one wave keeps the full rate in the model (kernel_cost.py line 114)
    and runs at 0.46-0.51 of it (1024^3: 32 tiles; 1024 x 2145: 68), while 2048^3 (128
    tiles, two waves, priced at 0.59) runs 1.45x faster than priced (cuBLAS's smaller tiles;
    NVIDIA's Matrix Multiplication Background guide, sec. 2.3)."""
    a100 = get_profile("a100")
    ratio = {}
    for m, n, k, tflops in AZURE_A100_SXM:
        flops = 2.0 * m * n * k
        t = cost.compute_time(flops, 0, a100, "float16", "matmul", launches=0, gemm=(1, m, n))
        ratio[(m, n, k)] = tflops * 1e12 * t / flops
    for shape in ((8192,) * 3, (16384,) * 3, (6144, 12288, 12288)):
        assert ratio[shape] == pytest.approx(1.0, abs=0.02)
    assert 0.9 < ratio[(4096,) * 3] < 0.96
    assert ratio[(1024, 1024, 1024)] < 0.5 and ratio[(1024, 2145, 1024)] < 0.55
    assert ratio[(2048,) * 3] > 1.4

