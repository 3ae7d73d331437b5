"""What the 13B rows lack to reach the 15% edge, and the readings behind it
(``benchmarks/torchtitan_breakdown.py``, titan14): the edge arithmetic closes the gap,
the GEMM-rate probe lands on the step it is asked for, and the 13B recompute reading
prices exactly the ops a recompute re-runs, against the published rows' own figures.
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import published as P  # noqa: E402
import published_torchtitan as T  # noqa: E402
import torchtitan_breakdown as TB  # noqa: E402
import workbench as wb  # noqa: E402


@pytest.fixture(scope="module")
def terms():
    return [TB.breakdown(row) for row in TB.rows()]


def _row(name, rc):
    return next(r for r in TB.rows() if r["name"] == name and r["layout"]["recompute"] == rc)


def test_the_edge_closes_the_gap_term_by_term(terms):
    for x in terms:
        e = TB.to_edge(x)
        # the lacking seconds put the row exactly on the edge of |ratio - 1| <= 0.15
        assert x["published"] / (x["predicted"] + e["seconds"]) == pytest.approx(TB.EDGE)
        within = abs(x["ratio"] - 1) <= 0.15          # published.summary's test
        assert (e["seconds"] <= 0) == within, x["name"]
        for k, share in e["share"].items():
            assert share * x[k] == pytest.approx(e["seconds"]), (x["name"], k)
    beyond = {(x["name"], x["recompute"]) for x in terms if TB.to_edge(x)["seconds"] > 0}
    # the rows this reading is about: the two Llama 2 13B rows, as printed by published.py
    assert beyond == {("Llama 2 13B", "none"), ("Llama 2 13B", "op")}


def test_the_gemm_probe_lands_on_the_step_it_is_asked_for():
    row = _row("Llama 2 13B", "none")
    x = TB.breakdown(row)
    k = TB.gemm_scale(row, x["published"], iters=16)
    assert 0.25 < k < 1
    cfg, lay, cl = P.build(row)
    prof = TB._gemm_scaled(cl.profile, k)
    # only the GEMM rate moved, by k
    assert prof.efficiency["matmul"] == pytest.approx(cl.profile.efficiency["matmul"] * k)
    assert {a: b for a, b in prof.efficiency.items() if a != "matmul"} == \
        {a: b for a, b in cl.profile.efficiency.items() if a != "matmul"}
    est = wb.plan.estimate(cfg, lay, wb.plan.Cluster(prof, row["devices"]),
                           attention=row["attention"], **row["estimate_args"])
    assert est.step_time == pytest.approx(x["published"], rel=2e-3)
    # a step the profile already takes needs no slower GEMM
    assert TB.gemm_scale(row, 0.5 * x["predicted"]) == 1.0


def test_the_gemm_probe_refuses_a_profile_with_measured_gemms():
    row = _row("Llama 3.1 8B", "op")              # h100-hbm2e: GEMMs from measurements
    with pytest.raises(ValueError, match="measurements"):
        TB.gemm_scale(row, 10.0)


def test_the_13b_wps_are_the_planner_rows_own():
    # AC_13B (eb6aa6389 docs/performance.md) agrees with the rows published.py holds
    got = {rc: tps for name, _, _, _, rc, tps, _, _ in T.A100_ROWS if name == "Llama 2 13B"}
    assert got == {"none": TB.AC_13B["none"], "op": TB.AC_13B["op"]}
    # the selective-layer row lies between them, as recompute on half the blocks must
    assert TB.AC_13B["op"] < TB.AC_13B["layer"] < TB.AC_13B["none"]


def test_the_recompute_reading_prices_what_a_recompute_re_runs():
    from workbench.plan import fsdp2_cost as FS
    from workbench.plan import layer_cost as L
    from workbench.plan import titan_eager as TE
    rr = TB.recompute_reading()
    base = _row("Llama 2 13B", "none")
    cfg, lay, cl = P.build(base)
    prof = FS.sdpa_profile(cl.profile)
    b, m = lay.micro_batch, 1
    tokens = b * cfg.seq_len

    def recompute_ops(rc, early):
        lt = L.layer_times(cfg.d_model, cfg.n_head, cfg.seq_len, b, 1, False, rc, cfg.d_ff,
                           cfg.dtype, prof, None, "flash", False, cfg.n_kv_head, False,
                           False, True, True, early, False, False)
        return sum(o["seconds"] for o in lt.ops if o["phase"] == "recompute")

    # every torchtitan eager kernel of the forward re-runs (neither recompute saves one)
    eager_fwd = TE.extra_seconds(cfg, lay, prof, base["norm_type"])["forward"]
    per_block_full = recompute_ops("full", True) + eager_fwd
    per_block_op = recompute_ops("op", False) + eager_fwd
    assert rr["layer"]["blocks"] == cfg.n_layer // 2 == 20
    assert rr["layer"]["priced"] == pytest.approx(20 * m * per_block_full, rel=1e-6)
    assert rr["op"]["priced"] == pytest.approx(cfg.n_layer * m * per_block_op, rel=1e-6)
    # the published seconds: the steps of the WPS (tokens per GPU per step / WPS)
    assert rr["op"]["measured"] == pytest.approx(tokens / 1904.0 - tokens / 2162.0)
    assert rr["layer"]["measured"] == pytest.approx(tokens / 1914.0 - tokens / 2162.0)
    # the early-stopped full recompute re-runs the forward but w2 and the closing add
    lt = L.layer_times(cfg.d_model, cfg.n_head, cfg.seq_len, b, 1, False, "none", cfg.d_ff,
                       cfg.dtype, prof, None, "flash", False, cfg.n_kv_head, False)
    fwd = {o["name"]: o["seconds"] for o in lt.ops if o["phase"] == "forward"}
    assert per_block_full == pytest.approx(
        sum(fwd.values()) - fwd["w2_gemm"] - fwd["residual_add_2"] + eager_fwd, rel=1e-9)
    assert per_block_full > per_block_op > 0
    for kind in ("op", "layer"):
        assert rr[kind]["ratio"] == pytest.approx(rr[kind]["measured"] / rr[kind]["priced"])
