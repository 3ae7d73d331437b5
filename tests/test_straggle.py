"""The slowest device of a synchronous group (``wb.plan.variability``): the measured
per-device distribution it reads, the order statistic against the same statistic taken
exactly from the source file, and the range's slow end that it stretches (never the
point estimate)."""
import pytest

import workbench.plan as P
from workbench.models.config import get_config
from workbench.plan import variability as V
from workbench.plan.ranges import estimate_range

# hal-uw/blox-pal 1a26bbfc31 aggregated_data/ls6/resnet-ls6-agg.csv, the 213 GPUs left
# after the two faulty nodes: norm_perf's minimum, median, maximum, mean (module docstring)
MIN, MEDIAN, MAX, MEAN = 0.9490, 0.9993, 1.0915, 1.0014
# E[max of n draws] computed exactly from the same 213 values (the discrete order
# statistic, sum over k of x_(k) ((k/m)^n - ((k-1)/m)^n)), n = 8, 64, 512
EXACT = {8: 1.0338, 64: 1.0654, 512: 1.0903}


def test_quantile_table_is_the_sources_distribution():
    q = dict(V.QUANTILES)
    assert q[0.0] == MIN and q[0.5] == MEDIAN and q[1.0] == MAX
    ps, xs = zip(*V.QUANTILES)
    assert list(ps) == sorted(ps) and list(xs) == sorted(xs)     # a quantile function
    assert V.SAMPLE == 213 and "resnet-ls6-agg.csv" in V.SOURCE


def test_slowest_of_n_is_the_order_statistic():
    assert V.slowest_expected(1) == pytest.approx(MEAN, abs=1e-3)   # one draw: the mean
    # the quantile table against the exact statistic of the 213 values: within 0.5%
    # (linear interpolation between tabulated quantiles smooths the two slowest GPUs)
    for n, exact in EXACT.items():
        assert V.slowest_expected(n) == pytest.approx(exact, abs=5e-3), n
    fs = [V.slowest_expected(n) for n in (1, 2, 8, 64, 512, 4096)]
    assert fs == sorted(fs) and len(set(fs)) == len(fs)             # more devices: slower
    # no tail beyond the sample: the bound is the slowest measured GPU
    assert V.slowest_expected(10 ** 6) == pytest.approx(MAX, abs=1e-3)
    assert V.slowest_expected(10 ** 6) <= MAX


@pytest.mark.parametrize("n", [0, -3, 2.0, True, "8"])
def test_bad_device_count_is_named(n):
    with pytest.raises(ValueError, match=r"slowest_expected\(n="):
        V.slowest_expected(n)


def _case(pp):
    cfg = get_config("gpt-22b", n_layer=4 * pp)
    lay = P.Layout(dp=2, tp=8, pp=pp, micro_batch=1, global_batch=8, recompute="full")
    return cfg, lay, P.Cluster("a100", 16 * pp)


@pytest.mark.parametrize("pp", [1, 2])
def test_stretch_paces_device_work_not_communication(pp):
    cfg, lay, cl = _case(pp)
    est = P.estimate(cfg, lay, cl)
    n = cl.devices
    f = V.slowest_expected(n)
    s = V.stretch(est, n)
    b0, b1 = est.breakdown, s.breakdown
    assert b1["communication"] == b0["communication"]
    assert b1["compute"] == pytest.approx(f * b0["compute"], rel=1e-12)
    slow = next(v for v in est.details["stages"].values()
                if v["stage"] == est.details["slowest_stage"])
    share = slow["compute"] / slow["time"]
    assert b1["bubble"] == pytest.approx(b0["bubble"] * (1 + (f - 1) * share), rel=1e-12)
    assert (b1["bubble"] > b0["bubble"]) == (pp > 1)
    assert s.step_time == pytest.approx(sum(b1.values()), rel=1e-12)
    # every rate follows the step: work per step is unchanged
    for k in ("mfu", "hfu", "tflops_per_device"):
        assert getattr(s, k) * s.step_time == pytest.approx(getattr(est, k) * est.step_time)
    assert s.details["tokens_per_second"] * s.step_time == pytest.approx(
        est.details["tokens_per_second"] * est.step_time)
    assert s.memory == est.memory and s.fits == est.fits
    line = s.assumptions()[-1]
    assert "ASSUMPTION" in line and "resnet-ls6-agg.csv" in line and f"x{f:.3f}" in line
    assert s.details["straggler"]["factor"] == f and est.details.get("straggler") is None


def test_range_slow_end_only_on_a100_profiles():
    cfg, lay, cl = _case(2)
    r = estimate_range(cfg, lay, cl)
    point = P.estimate(cfg, lay, cl)
    assert r.estimate.step_time == point.step_time               # the point is untouched
    assert "straggler" not in r.estimate.details and "straggler" not in r.fast.details
    st = r.slow.details["straggler"]
    assert st["devices"] == cl.devices and st["factor"] == V.slowest_expected(cl.devices)
    assert any("slowest of the 32 synchronised devices" in v for v in r.varied)
    assert r.step_time[1] == r.slow.step_time > point.step_time
    # the H100 has no measured per-device distribution: no straggler term there
    h = estimate_range(cfg, lay, P.Cluster("h100", cl.devices))
    assert "straggler" not in h.slow.details
    assert not any("synchronised devices" in v for v in h.varied)
