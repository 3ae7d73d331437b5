"""Measured kernels on the clock: named kernels at their measured bandwidth
(profile ``kernel_bandwidth``) and the attention GEMMs priced as memory-bound."""
import dataclasses

import pytest

from workbench.plan.layer_cost import layer_ops
from workbench.sim_mesh import cost
from workbench.sim_mesh.profiles import get_profile

A100 = get_profile("a100")
LAYER = dict(h=6144, a=64, s=2048, b=4, tp=8, dtype="float16", profile="a100")


def test_named_kernel_runs_at_its_measured_bandwidth():
    n = 100e6
    fwd = cost.compute_time(0, n, A100, "float16", "norm", 1, kernel="layer_norm_forward")
    assert fwd == pytest.approx(n / 1258.0e9 + 1e-6)        # apex PR #1037, FWD
    bwd = cost.compute_time(0, n, A100, "float16", "norm", 2, kernel="layer_norm_backward")
    assert bwd == pytest.approx(n / 1163.4e9 + 2e-6)        # apex PR #1037, BWD
    # an unknown name, or a profile without the measurement: the copy-kernel rate
    plain = n / (2.039e12 * 0.88) + 1e-6
    assert cost.compute_time(0, n, A100, "float16", "norm", 1, kernel="softmax") == \
        pytest.approx(plain)
    npu = get_profile("ascend-910b")         # measured no LayerNorm: the copy rate
    assert cost.compute_time(0, n, npu, "float16", "norm", kernel="layer_norm_forward") == \
        cost.compute_time(0, n, npu, "float16", "norm")
    h100 = get_profile("h100")               # PyTorch's LayerNorm measured on an H100
    assert cost.compute_time(0, n, h100, "float16", "norm", 0, "layer_norm_forward") == \
        pytest.approx(n / 1822e9)
    terms = cost.explain_compute(0, n, A100, "float16", "norm", 1, "layer_norm_forward")
    assert terms["memory"] == pytest.approx(n / 1258.0e9) and terms["bound"] == "memory"


def test_kernel_bandwidth_errors():
    with pytest.raises(ValueError, match=r"kernel=3 must be a kernel name"):
        cost.compute_time(0, 1, A100, "float16", "norm", 1, kernel=3)
    with pytest.raises(ValueError, match=r"kernel_bandwidth\['x'\]=3000000000000.0 exceeds"):
        dataclasses.replace(A100, kernel_bandwidth={"x": 3e12})
    with pytest.raises(ValueError, match=r"kernel_bandwidth\['x'\]"):
        dataclasses.replace(A100, kernel_bandwidth={"x": -1.0})
    back = type(A100).from_dict(A100.to_dict())
    assert dict(back.kernel_bandwidth) == dict(A100.kernel_bandwidth)


def test_layer_norms_use_the_persistent_kernel():
    ops = {(o.phase, o.name): o for o in layer_ops(**LAYER)}
    tokens, h, e = 2048 * 4, 6144, 2
    fwd, bwd = ops["forward", "layernorm_1"], ops["backward", "layernorm_1_grad"]
    assert fwd.bytes == 2 * e * tokens * h and fwd.launches == 1
    assert fwd.seconds == pytest.approx(fwd.bytes / 1258.0e9 + 1e-6)
    assert bwd.bytes == 3 * e * tokens * h and bwd.launches == 2   # x and dy read once
    assert bwd.seconds == pytest.approx(bwd.bytes / 1163.4e9 + 2e-6)


def test_attention_bmms_are_memory_bound():
    # Q K^T and P V: 32 batched [2048 x 96] x [96 x 2048] GEMMs per rank (K = head
    # dim 96): 2 x 96 FLOPs per score element read or written, below the A100's
    # ridge of 0.827 x 312 / (0.88 x 2.039) = 144 FLOP/byte: priced by their bytes, at
    # the rate measured for Megatron's unfused core (tests/test_attention_kernels.py)
    for o in layer_ops(**LAYER):
        if o.name.startswith(("qk_baddbmm", "pv_bmm")):
            kernel = "attention_core_" + ("backward" if o.phase == "backward" else "forward")
            terms = cost.explain_compute(o.flops, o.bytes, A100, "float16", o.op_class,
                                         kernel=kernel)
            assert terms["bound"] == "memory", o.name
            assert cost.explain_compute(o.flops, o.bytes, A100, "float16",
                                        o.op_class)["bound"] == "memory"
            assert o.seconds == pytest.approx(terms["seconds"])
    # the big projections are compute-bound
    qkv = next(o for o in layer_ops(**LAYER) if o.name == "qkv_gemm")
    assert cost.explain_compute(qkv.flops, qkv.bytes, A100, "float16", "matmul")["bound"] \
        == "compute"
