"""FlashAttention-2 on the A100 priced per shape (sim_mesh.fa2_a100): the table against
the figure it cites (Dao 2023, Fig. 4), the forward / backward split, the lookup, and the
clock pricing a shaped attention kernel on the a100 profile from it."""
import json
import math

import pytest

from workbench.sim_mesh import cost, fa2_a100 as fa2
from workbench.sim_mesh.kernel_cost import AttentionShape
from workbench.sim_mesh.profiles import Profile, get_profile

# Dao 2023 (arXiv 2307.08691) Fig. 4, FlashAttention-2 bars, TFLOP/s as printed on the
# bars of Dao-AILab/flash-attention assets/flash2_a100_fwd_bwd_benchmark.png (4f285b35);
# None: the label is covered by the legend (read off the bar's height in the module)
FIGURE_4_LABELS = {
    "a": ((False, 64), (132, None, 162, 171, 175, 176)),
    "b": ((False, 128), (None, None, 187, 196, 201, 203)),
    "c": ((True, 64), (88, 119, 140, 156, 165, 171)),
    "d": ((True, 128), (99, 133, 155, 173, 182, 189)),
}
# the covered bars' heights against the panel's labelled bars (0.544 TFLOP/s per pixel)
READ_OFF_THE_CHART = {((False, 64), 1024): 153.1, ((False, 128), 512): 151.5,
                      ((False, 128), 1024): 173.3}


def _fwd_bwd(f, b):
    """The forward + backward rate of a kernel whose halves run at f and b (FLOPs 1 : 2.5,
    benchmark_flash_attention.py's flops())."""
    return 3.5 / (1 / f + 2.5 / b)


def test_the_table_is_the_figure():
    for panel, (key, labels) in FIGURE_4_LABELS.items():
        row = fa2.FWD_BWD[key]
        assert len(row) == len(fa2.SEQS) == 6, panel
        for s, got, label in zip(fa2.SEQS, row, labels):
            if label is not None:
                assert got == label, (panel, s)
            else:
                assert abs(got - READ_OFF_THE_CHART[(key, s)]) <= 1.0, (panel, s)


def test_each_grid_point_splits_into_halves_that_recombine_to_the_figure():
    for (causal, d), row in fa2.FWD_BWD.items():
        for s, c in zip(fa2.SEQS, row):
            f = fa2.rate(s, d, causal, False) / 1e12
            b = fa2.rate(s, d, causal, True) / 1e12
            assert _fwd_bwd(f, b) == pytest.approx(c, rel=1e-12)
            assert b == pytest.approx(fa2.BWD_OVER_FWD * f)


def test_the_split_ratio_comes_from_the_papers_best_forward():
    # sec. 4: up to 230 TFLOP/s (the forward, ASSUMED) where Fig. 4(b) 16k gives 203
    assert fa2.rate(16384, 128, False, False) == pytest.approx(230e12)
    assert fa2.BWD_OVER_FWD == pytest.approx(0.843, abs=5e-4)
    assert 230 / 312 == pytest.approx(0.73, abs=0.01)    # "73% of the theoretical maximum"


def test_the_split_ratio_lies_among_the_same_codes_h100_measurements():
    path = "workbench/sim_mesh/measurements/h100-sxm-80gb.json"
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)["attention"]
    ratios = [r["bwd_tflops"] / r["fwd_tflops"] for r in rows if r.get("backend") == "flash"
              and "error" not in r and r["batch"] * r["heads"] >= 16]
    assert len(ratios) >= 6
    assert min(ratios) <= fa2.BWD_OVER_FWD <= max(ratios)
    full = [r["fwd_tflops"] / r["bwd_tflops"] for r in rows if r.get("backend") == "flash"
            and "error" not in r and not r["causal"]]
    assert full and min(full) > 1.0      # the forward is the faster half (the ASSUMPTION)


def test_the_rate_depends_on_the_shape_as_the_figure_shows():
    # backward slower than forward; causal below full; short sequences below long ones
    for causal in (False, True):
        for d in fa2.HEAD_DIMS:
            fwd = [fa2.rate(s, d, causal, False) for s in fa2.SEQS]
            bwd = [fa2.rate(s, d, causal, True) for s in fa2.SEQS]
            assert all(b < f for f, b in zip(fwd, bwd))
            assert fwd == sorted(fwd)
    for s in fa2.SEQS:
        for d in fa2.HEAD_DIMS:
            assert fa2.rate(s, d, True, False) < fa2.rate(s, d, False, False)
    assert fa2.rate(512, 128, True, False) / fa2.rate(16384, 128, False, False) < 0.5


def test_interpolation_in_log2_and_held_at_the_edges():
    c = fa2.FWD_BWD[(True, 128)]
    f_2k, f_4k = (fa2.split(v)[0] * 1e12 for v in c[2:4])
    mid = fa2.rate(round(math.sqrt(2048 * 4096)), 128, True, False)   # log2 midpoint
    assert mid == pytest.approx((f_2k + f_4k) / 2, rel=1e-3)
    assert fa2.rate(3000, 128, True, False) < fa2.rate(4096, 128, True, False)
    assert fa2.rate(3000, 128, True, False) > fa2.rate(2048, 128, True, False)
    # head dimension 96: log2(96) lies 0.585 of the way from 64 to 128
    w = math.log2(96 / 64)
    lo, hi = fa2.rate(4096, 64, False, True), fa2.rate(4096, 128, False, True)
    assert fa2.rate(4096, 96, False, True) == pytest.approx((1 - w) * lo + w * hi)
    # beyond the grid the edge holds
    assert fa2.rate(256, 128, True, False) == fa2.rate(512, 128, True, False)
    assert fa2.rate(65536, 64, True, True) == fa2.rate(16384, 64, True, True)
    assert fa2.rate(4096, 256, False, False) == fa2.rate(4096, 128, False, False)
    assert fa2.rate(4096, 32, False, False) == fa2.rate(4096, 64, False, False)


@pytest.mark.parametrize("args, name", [((0, 128, True, False), "seq"),
                                        ((2048.0, 128, True, False), "seq"),
                                        ((2048, -64, True, False), "head_dim"),
                                        ((2048, True, True, False), "head_dim"),
                                        ((2048, 128, "yes", False), "causal"),
                                        ((2048, 128, True, 1), "backward")])
def test_bad_shapes_are_refused_by_name(args, name):
    with pytest.raises(ValueError, match=name):
        fa2.rate(*args)


def test_the_a100_profile_prices_a_shaped_16bit_kernel_from_the_table():
    prof = get_profile("a100")
    assert prof.attention_table == fa2.NAME
    flops = 4e12
    for shape in (AttentionShape(32, 8192, 128, True, False),
                  AttentionShape(64, 2048, 128, True, True),
                  AttentionShape(16, 4096, 64, False, False)):
        want = flops / fa2.rate(shape.seq, shape.head_dim, shape.causal, shape.backward)
        for dt in ("bfloat16", "float16"):
            got = cost.compute_time(flops, 0, "a100", dt, "attention", gemm=shape)
            assert got == pytest.approx(want + prof.launch_overhead)
    # without its shape, or in fp32 (FlashAttention-2 runs only 16 bits), the one
    # efficiency prices it as before
    peak = prof.peak("bfloat16") * prof.efficiency["attention"]
    assert cost.compute_time(flops, 0, "a100", "bfloat16", "attention") == \
        pytest.approx(flops / peak + prof.launch_overhead)
    fp32 = prof.peak("float32") * prof.efficiency["attention"]
    assert cost.compute_time(flops, 0, "a100", "float32", "attention",
                             gemm=AttentionShape(32, 8192, 128, True, False)) == \
        pytest.approx(flops / fp32 + prof.launch_overhead)


def test_a_measured_profile_keeps_its_measurements():
    shape = AttentionShape(16, 4096, 128, True, False)
    h100 = cost.compute_time(1e12, 0, "h100", "bfloat16", "attention", gemm=shape)
    a100 = cost.compute_time(1e12, 0, "a100", "bfloat16", "attention", gemm=shape)
    assert get_profile("h100").attention_table == "" and h100 != pytest.approx(a100)


def test_the_profile_field_round_trips_and_refuses_unknown_tables():
    prof = get_profile("a100")
    data = prof.to_dict()
    assert data["attention_table"] == fa2.NAME
    assert Profile.from_dict(data).attention_table == fa2.NAME
    data["attention_table"] = "fa3-h100"
    with pytest.raises(ValueError, match="attention_table='fa3-h100'"):
        Profile.from_dict(data)
    del data["attention_table"]
    assert Profile.from_dict(data).attention_table == ""
    assert "attention_table" in prof.citations and "ASSUMPTION" in prof.citations[
        "attention_table"]


def test_a_flash_estimate_on_the_a100_names_the_table_among_its_assumptions():
    from types import SimpleNamespace
    from workbench.plan import frameworks
    from workbench.plan.layout import Layout
    cfg = SimpleNamespace(dtype="bfloat16")          # all the function reads of a model
    got = frameworks.assumptions(cfg, Layout(dp=8), get_profile("a100"), "flash", True,
                                 False)
    line = [a for a in got if a.startswith("attention:")]
    assert len(line) == 1 and fa2.NAME in line[0] and "ASSUMED" in line[0]
    assert any("attention_table" in a for a in got)     # its citation marks an ASSUMPTION


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_training_clock_prices_a_dist_attention_as_the_planner_does(dtype):
    # the op table's fused attention on DistTensors (heads split over 2 ranks), traced on
    # the a100's clock: forward and backward at the table's rate for the rank's shape in
    # 16 bits (parallel.ops_table.attention_pricing), the roofline's one efficiency in fp32
    import torch
    import torch.nn.functional as F
    import workbench as wb
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    B, H, S, D = 2, 4, 256, 64
    mesh = wb.Mesh([0, 1], dim_names=["tp"])
    q, k, v = (wb.shard_tensor(torch.randn(B, H, S, D, dtype=dt, requires_grad=True), mesh,
                               [wb.Shard(1)]) for _ in range(3))
    with wb.trace(profile="a100") as tr:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
    evs = [e for e in tr.events if e.name == "scaled_dot_product_attention"]
    fwd = [e for e in evs if e.args.get("phase") == "forward"]
    bwd = [e for e in evs if e.args.get("phase") == "backward"]
    assert len(fwd) == 1 and len(bwd) == 1
    prof = get_profile("a100")
    for e, backward in ((fwd[0], False), (bwd[0], True)):
        shape = AttentionShape(B * H // 2, S, D, True, backward)
        want = cost.compute_time(e.flops, e.bytes, prof, dtype, "attention",
                                 gemm=shape if dtype == "bfloat16" else None)
        assert e.duration == pytest.approx(want, rel=1e-9)
    if dtype == "bfloat16":       # causal, 256 rows, head dim 64: below Fig. 4(c)'s 512
        assert fwd[0].flops / (fwd[0].duration - prof.launch_overhead) == pytest.approx(
            fa2.rate(512, 64, True, False), rel=1e-6)
