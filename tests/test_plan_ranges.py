"""Ranges on estimates (``wb.plan.ranges``): each bounded figure against the published
figure its bound comes from, the range around the point, and the CLI's table."""
import dataclasses

import pytest

import workbench.plan as P
from workbench.models.config import get_config
from workbench.plan import costs as C
from workbench.plan.ranges import BOUNDS, estimate_range, profile_at
from workbench.sim_mesh.profiles import get_profile

H100, A100 = get_profile("h100"), get_profile("a100")


def _flat(text: str) -> str:
    """``text`` with its line breaks and continuation indents as single spaces: the
    phrases as printed before ``text_width.wrap`` (which neither drops nor adds a word)."""
    return " ".join(text.split())


def test_h100_attention_bounds_are_the_two_measured_kernels():
    """The H100's fused attention: cuDNN's (the point and the fast end) and
    FlashAttention-2 (the slow end), both measured on an H100 (sim_mesh/measurements):
    at sequence 4096, 16 heads of 128, causal, FlashAttention-2 ran forward at 212.5
    and backward at 207.3 TFLOP/s, cuDNN's at 453.9 and 370.3."""
    from workbench.sim_mesh import measured
    assert H100.measured["attention_backend"] == "cudnn"
    assert profile_at(H100, "slow").measured["attention_backend"] == "flash"
    assert profile_at(H100, "fast").measured["attention_backend"] == "cudnn"
    f = H100.measured["file"]
    for backend, fwd, bwd in (("flash", 212.5e12, 207.3e12), ("cudnn", 453.9e12, 370.3e12)):
        assert measured.attention_rate(f, backend, 16, 4096, 128) == pytest.approx(fwd)
        assert measured.attention_rate(f, backend, 16, 4096, 128, backward=True) == \
            pytest.approx(bwd)


def test_a100_measured_kernels_unscaled_at_the_slow_end():
    """The attention core's forward was measured at 1.036 TB/s on the A100 40GB
    (FlashAttention Appendix E.6, the profile's citation) and scaled to the 80GB part's
    2,039 GB/s; the slow end is that measurement."""
    slow = profile_at(A100, "slow").kernel_bandwidth
    assert slow["attention_core_forward"] == pytest.approx(1.036e12, rel=2e-3)
    assert profile_at(A100, "fast").kernel_bandwidth["attention_core_forward"] == \
        A100.kernel_bandwidth["attention_core_forward"]
    assert profile_at(A100, "fast").kernel_bandwidth["layer_norm_forward"] == \
        pytest.approx(1258e9 * 2039 / 1555)
    for name, bounds in BOUNDS.items():        # every bound is a figure the profile
        cites = get_profile(name).citations   # marks ASSUMPTION or UNCERTAIN
        for field, *_ in bounds:
            assert "ASSUMPTION" in cites[field] or "UNCERTAIN" in cites[field], field


def test_range_is_the_attention_kernels_time_on_the_h100():
    """A Llama on one H100 node, no data parallelism: the slow end differs from the
    point by exactly the layers' fused attention priced at FlashAttention-2's measured
    rates instead of cuDNN's (NCCL's HBM traffic, the other bounded figure, pinned at the
    point's 0: tests/test_i21c11.py holds it)."""
    cfg = get_config("llama3-8b", n_layer=4)
    lay, cl = P.Layout(dp=1, tp=8, sp=True, global_batch=2), P.Cluster("h100", 8)
    hbm = {"topology.collective_hbm_factor": 0.0}
    r = estimate_range(cfg, lay, cl, pinned=hbm)
    slow_layer = C.layer_cost(cfg, 1, 8, True, "none",
                              profile_at(H100, "slow", tuple(hbm.items())), "flash")
    fast_layer = C.layer_cost(cfg, 1, 8, True, "none", H100, "flash")
    per = (slow_layer.fwd_compute + slow_layer.bwd_compute) - \
        (fast_layer.fwd_compute + fast_layer.bwd_compute)
    assert per > 0
    assert r.slow.step_time - r.estimate.step_time == pytest.approx(2 * 4 * per, rel=1e-9)
    lo, hi = r.step_time
    assert lo == r.estimate.step_time < hi == r.slow.step_time
    assert r.mfu[0] < r.estimate.mfu == r.mfu[1]
    assert "FlashAttention-2" in _flat(str(r)) and "inter_node.latency" in r.unbounded
    assert any("cuDNN's fused attention" in a and "measured" in a
               for a in r.estimate.assumptions())


def test_a_profile_without_bounds_has_a_point_range():
    mine = dataclasses.replace(H100, name="my-h100")
    cfg = get_config("llama3-8b", n_layer=2)
    r = estimate_range(cfg, P.Layout(dp=1, global_batch=1), P.Cluster(mine, 1))
    assert r.step_time == (r.estimate.step_time,) * 2 and not r.varied
    assert "the range is the point" in _flat(str(r))
    with pytest.raises(ValueError, match="end='middle'"):
        profile_at(H100, "middle")


def test_cli_prints_ranges_and_assumptions(capsys):
    from workbench.cli import main
    assert main(["plan", "--model", "gpt-22b", "--devices", "64", "--global-batch", "64",
                 "--top", "2"]) == 0
    out = _flat(capsys.readouterr().out)        # the text unwrapped (text_width.wrap)
    assert "range: every profile figure with a stated bound" in out
    assert "kernel_bandwidth.attention_core_forward" in out and "#1 assumes: " in out
    unbounded = out.split("not in the range (ASSUMED, no bound stated): ")[1].split(
        " #1 assumes: ")[0]
    assert "inter_node.latency" in unbounded.split(", ")


def test_mfu_counts_the_full_core_and_gives_the_causal_count_beside():
    """Model FLOPs count the whole s x s core (Megatron-LM's count behind the published
    rows); ``mfu_causal`` halves the core as Megatron-LM does since 2025 (8873b55d6a):
    the difference is 3 x 2 b s^2 h per layer (forward and backward, halved)."""
    cfg = get_config("llama3-8b", n_layer=4)
    lay, cl = P.Layout(dp=1, tp=8, sp=True, global_batch=2), P.Cluster("h100", 8)
    e = P.estimate(cfg, lay, cl)
    s, h, B = cfg.seq_len, cfg.d_model, 2
    full = e.mfu * e.step_time * cl.profile.peak(cfg.dtype) * 8
    causal = e.details["mfu_causal"] * e.step_time * cl.profile.peak(cfg.dtype) * 8
    assert full - causal == pytest.approx(4 * 3 * 2 * B * s * s * h, rel=1e-9)
