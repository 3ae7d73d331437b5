"""The overlap strategies price their kernels on the clock's roofline with the op class
and one launch per kernel (``sim_mesh.cost.compute_time``), forward and backward.

Expected durations are written out from the profile's fields and the roofline formula
(max(F / (peak x eff[class]), B / (bw x mem_eff)) + launch), not by calling the clock.
"""
from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.parallel.strategies.overlap import matmul_all_reduce
from workbench.parallel.strategies.overlap_multicopy import multi_copy_estimate
from workbench.sim_mesh.profiles import get_profile
from workbench.sim_mesh.trace import trace


def roofline(flops, nbytes, prof, op_class, dtype="bfloat16"):
    peak = prof.peak_flops[dtype] * prof.efficiency[op_class]
    bw = prof.memory_bandwidth * prof.memory_efficiency
    return max(flops / peak, nbytes / bw) + prof.launch_overhead


def gemm_roofline(m, k, n, nbytes, prof):
    """A GEMM [m, k] @ [k, n] with its shape: the device's measured rate for it where the
    profile has one (``sim_mesh.measured``), else peak x efficiency x tile and wave
    quantization (``cost.gemm_efficiency``)."""
    from workbench.sim_mesh import cost, measured
    if prof.measured:
        rate = measured.gemm_rate(prof.measured["file"], m, n, k)
    else:
        rate = prof.peak_flops["bfloat16"] * prof.efficiency["matmul"] * \
            cost.gemm_efficiency((1, m, n), prof)
    bw = prof.memory_bandwidth * prof.memory_efficiency
    return max(2 * m * k * n / rate, nbytes / bw) + prof.launch_overhead


@pytest.mark.parametrize("name", ["a100", "ascend-910b", "h100"])
@pytest.mark.parametrize("k", [1, 4])
def test_chunk_matmul_priced_as_a_gemm_with_a_launch(name, k):
    prof = get_profile(name)
    M, K, N, p = 4096, 4096, 8192, 8
    mesh = wb.Mesh.grid(p, ("tp",))
    x = torch.empty(p, M, K // p, dtype=torch.bfloat16, device="meta")
    w = torch.empty(p, K // p, N, dtype=torch.bfloat16, device="meta")
    with trace(name) as tr:
        matmul_all_reduce(x, w, mesh, "tp", k)
    mm = [e for e in tr.events if e.stream == "compute"]
    m = M // k
    want = gemm_roofline(m, K // p, N, (m * K // p + K // p * N + m * N) * 2, prof)
    assert len(mm) == k
    # priced alone; a chunk beside the previous chunk's all-reduce lasts longer
    assert all(e.args.get("alone", e.duration) == pytest.approx(want, rel=1e-12) for e in mm)
    assert all(e.duration >= e.args.get("alone", e.duration) for e in mm)
    assert all(e.args["op_class"] == "matmul" for e in mm)


def test_multi_copy_ffn_forward_and_backward_priced_per_kernel_class():
    """FFN of one copy (b=1, S, H, F/p): up GEMM, GeLU (elementwise), down GEMM; its
    backward as Megatron-LM runs it: w2's dX and dW, GeLU' and w1's dX, then w1's dW
    beside the all-reduce (``overlap_multicopy_kernels``)."""
    prof = get_profile("a100")
    b, S, H, heads, F, p = 2, 1024, 2048, 16, 8192, 4
    mesh = wb.Mesh.grid(p, ("tp",))
    r = multi_copy_estimate(b, S, H, heads, F, mesh, "tp", copies=2, profile="a100")
    T, Fl, e = S, F // p, 2                      # one sample per copy

    def mm(m, k, n):
        return gemm_roofline(m, k, n, (m * k + k * n + m * n) * e, prof)
    fwd = mm(T, H, Fl) + roofline(8 * T * Fl, 2 * T * Fl * e, prof, "elementwise") + mm(T, Fl, H)
    down = mm(T, H, Fl) + mm(Fl, T, H)
    dx = roofline(10 * T * Fl, 3 * T * Fl * e, prof, "elementwise") + mm(T, Fl, H)
    dw = mm(H, T, Fl)
    got = {e.label: e.args.get("alone", e.duration)      # priced alone (trace.py)
           for e in r.forward.events + r.backward.events if e.stream == "compute"}
    assert got["ffn A"] == pytest.approx(fwd, rel=1e-12)
    assert got["w2 dX dW A"] == pytest.approx(down, rel=1e-12)
    assert got["ffn dX B"] == pytest.approx(dx, rel=1e-12)
    assert got["w1 dW A"] == pytest.approx(dw, rel=1e-12)
    phases = {e.args["phase"] for e in r.backward.events if e.stream == "compute"}
    assert phases == {"backward"}


def test_multi_copy_at_batch_one_says_what_to_do():
    mesh = wb.Mesh.grid(2, ("tp",))
    with pytest.raises(ValueError, match=r"copies=2 must be an int in \[1, 1\].*"
                                         r"micro-batch of 1 sample.*matmul_all_reduce"):
        multi_copy_estimate(1, 128, 256, 4, 1024, mesh, "tp", copies=2, profile="a100")
    one = multi_copy_estimate(1, 128, 256, 4, 1024, mesh, "tp", copies=1, profile="a100")
    assert one.forward.hidden_share == 0.0
