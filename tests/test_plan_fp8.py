"""FP8 GEMMs on the H100 (``estimate(..., fp8=True)``, ``plan.fp8``): held to the
datasheet's FP8 peak and Transformer Engine's cast kernels."""
import pytest

import workbench.plan as P
from workbench.models.config import get_config
from workbench.plan.layer_cost import layer_ops
from workbench.sim_mesh.profiles import get_profile

H100 = get_profile("h100")
ARGS = dict(h=6144, a=64, s=2048, b=4, tp=8, sp=True, recompute="none", dtype="bfloat16",
            profile="h100", attention="flash")


def test_fp8_peak_is_the_datasheets_dense_figure():
    assert H100.peak("float8") == 1979e12          # 3,958 with 2:4 sparsity, halved
    assert "measured" in H100.citations["peak_flops.float8"]


def test_gemms_run_at_the_fp8_rate_and_casts_precede_them():
    """FP8 GEMMs run at the measured FP8 / bf16 ratio of the H100's products
    (``torch._scaled_mm`` against bf16 on the same shapes: 1.65 .. 2.07, median 1.88)."""
    from workbench.sim_mesh import measured
    ratio = measured.load(H100.measured["file"]).fp8_ratio
    assert ratio == pytest.approx(1.884, abs=0.001)
    bf, f8 = ({o.name: o for o in layer_ops(**ARGS, fp8=x)} for x in (False, True))
    launch = H100.launch_overhead
    for name in ("qkv_gemm", "fc1_gemm", "fc2_dgrad", "fc2_wgrad"):
        # compute-bound: the compute term divides by the measured ratio
        assert f8[name].seconds - launch == pytest.approx(
            (bf[name].seconds - launch) / ratio, rel=1e-9)
    # the attention kernel and the memory-bound kernels keep their 16-bit prices
    assert f8["flash_attention"].seconds == bf["flash_attention"].seconds
    # TE's cast-transpose before fc1 (input T x h, the gathered sequence): 2 + 1 + 1 bytes
    T, h = 2048 * 4, 6144
    assert f8["fp8_cast_fc1_gemm"].bytes == pytest.approx(4 * T * h)
    assert f8["fp8_cast_fc2_dgrad"].bytes == pytest.approx(4 * T * h)   # dy of fc2: T x h
    assert not [n for n in bf if n.startswith("fp8_cast")]
    assert len([n for n in f8 if n.startswith("fp8_cast")]) == 8        # 4 GEMMs x (fwd, dgrad)


def test_estimate_with_fp8():
    cfg, cl = get_config("gpt-22b"), P.Cluster("h100", 8)
    lay = P.Layout(dp=1, tp=8, sp=True, recompute="selective", micro_batch=4, global_batch=4)
    bf, f8 = (P.estimate(cfg, lay, cl, attention="flash", fp8=x) for x in (False, True))
    assert f8.step_time < bf.step_time and f8.memory == bf.memory
    assert f8.mfu / bf.mfu == pytest.approx(bf.step_time / f8.step_time)   # same peak
    assert any("FP8" in a for a in f8.assumptions())
    with pytest.raises(ValueError, match="no FP8 peak"):
        P.estimate(cfg, lay, P.Cluster("a100", 8), fp8=True)
    with pytest.raises(ValueError, match="fp8=1"):
        P.estimate(cfg, lay, cl, fp8=1)
