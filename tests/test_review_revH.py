"""Review revH: regressions for the defects found in the titanrows merge (7f73ec3..7e657a3:
torchtitan's FSDP rows, profile h100-hbm2e, ``plan.titan_eager``, ``plan.ranges``)."""
import pytest
import torch

from workbench.plan import titan_eager as E


def test_eager_counts_do_not_follow_torchs_default_dtype():
    """torchtitan's freqs_cis is complex64; under ``torch.set_default_dtype(torch.float64)``
    the counting built complex128 frequencies, RoPE's products promoted to them, and the
    counts (cached for the process) read 1.5 .. 1.7x the bytes."""
    E._measure.cache_clear()
    E.kernels.cache_clear()
    want = E.kernels("pre_attention", 64, 256, 4, 2, 64)
    E._measure.cache_clear()
    E.kernels.cache_clear()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = E.kernels("pre_attention", 64, 256, 4, 2, 64)
    finally:
        torch.set_default_dtype(old)
        E._measure.cache_clear()
        E.kernels.cache_clear()
    assert got == want


def test_hbm2e_range_moves_every_peak_with_the_bf16_peak():
    """h100-hbm2e's fp32, fp64, tf32 and FP8 peaks are cited as the SXM figures x the bf16
    peak's midpoint ratio (one clock): the range's ends moved the bf16 peak and the
    measured rates but left them at the midpoint, and listed them as unbounded."""
    from workbench.plan import ranges as R
    from workbench.sim_mesh.profiles import get_profile
    sxm, hbm2e = get_profile("h100"), get_profile("h100-hbm2e")
    slow, fast = R.profile_at(hbm2e, "slow"), R.profile_at(hbm2e, "fast")
    for k, v in sxm.peak_flops.items():
        assert hbm2e.peak_flops[k] == pytest.approx(v * 912 / 989, rel=1e-4), k
        assert fast.peak_flops[k] == pytest.approx(v, rel=1e-9), k
        assert slow.peak_flops[k] == pytest.approx(v * 835 / 989, rel=1e-9), k
    assert slow.measured["compute_scale"] == pytest.approx(835 / 989)
    import workbench as wb
    cfg = wb.plan.presets.get_config("llama3-8b", seq_len=1024, n_layer=2)
    lay = wb.plan.Layout(dp=8, zero=3, recompute="op", micro_batch=1, framework="fsdp")
    r = wb.plan.estimate_range(cfg, lay, wb.plan.Cluster(hbm2e, 8))
    assert not [k for k in r.unbounded if k.startswith("peak_flops.")], r.unbounded
