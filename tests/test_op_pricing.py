"""Compute on the trace: every op priced from the op table's cost on the busiest rank's
local shapes, forward when it runs and backward when its gradient passes."""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.sim_mesh import cost as sim_cost

M2 = wb.Mesh.grid(2, ["tp"])
R, S = wb.Replicate(), wb.Shard


def compute(tr, name, phase="forward"):
    return [e for e in tr.events if e.stream == "compute" and e.name == name
            and e.args.get("phase") == phase]


@pytest.mark.parametrize("heads", [[R], [S(1)]])
def test_attention_priced_as_wb_ops_cost(heads):
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    with wb.trace() as tr:
        F.scaled_dot_product_attention(*(wb.shard_tensor(t, M2, heads) for t in (q, k, v)),
                                       is_causal=True)
    (ev,) = compute(tr, "scaled_dot_product_attention")
    h = 4 if heads == [R] else 2                                  # heads on the busiest rank
    local = q[:, :h]
    want = wb.ops.cost("flash_attention", local, local, local, causal=True)
    assert ev.flops == want.flops and ev.bytes == want.bytes_fused
    assert ev.duration == sim_cost.compute_time(want.flops, want.bytes_fused, tr.profile,
                                                torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_flops_and_bytes_by_dtype(dtype):
    A, B = torch.randn(8, 12, dtype=dtype), torch.randn(12, 6, dtype=dtype)
    e = torch.empty((), dtype=dtype).element_size()
    with wb.trace() as tr:
        wb.shard_tensor(A, M2, [S(0)]) @ wb.shard_tensor(B, M2, [R])
    (ev,) = compute(tr, "matmul")
    assert ev.flops == 2 * 4 * 12 * 6                            # rows 8 / 2 ranks
    assert ev.bytes == (4 * 12 + 12 * 6 + 4 * 6) * e             # read A, B; write C


def test_matmul_priced_in_one_place():
    A, B = torch.randn(8, 12), torch.randn(12, 6)
    a, b = wb.shard_tensor(A, M2, [R]), wb.shard_tensor(B, M2, [R])
    with wb.trace() as tr:
        a @ b
        torch.mm(a, b)
        torch.einsum("mk,kn->mn", a, b)
        F.linear(a, wb.shard_tensor(B.T.contiguous(), M2, [R]))
    flops = {e.name: e.flops for e in tr.events if e.stream == "compute"}
    assert flops == {"matmul": 2 * 8 * 12 * 6, "mm": 2 * 8 * 12 * 6, "einsum": 2 * 8 * 12 * 6,
                     "linear": wb.ops.cost("linear", A, B.T).flops}
    assert flops["linear"] == flops["matmul"]


def test_elementwise_counts_its_formula_not_one_flop():
    x = wb.shard_tensor(torch.randn(4, 6, dtype=torch.float16), M2, [S(0)])
    with wb.trace() as tr:
        F.silu(x)
        torch.relu(x)
    assert compute(tr, "silu")[0].flops == 4 * 12                 # x / (1 + exp(-x))
    assert compute(tr, "relu")[0].flops == 12
    assert compute(tr, "silu")[0].bytes == 2 * 12 * 2            # read + write, 2-byte halves


def test_backward_compute_recorded_when_the_gradient_passes():
    """A linear's backward is its dgrad then its wgrad, two kernels after the forward:
    together the op's backward FLOPs and bytes, each priced on its own roofline."""
    X, W = torch.randn(6, 8), torch.randn(4, 8)
    x = wb.shard_tensor(X, M2, [R]).requires_grad_()   # (data that needs no gradient
    w = wb.shard_tensor(W, M2, [S(0)]).requires_grad_()  # has no dgrad: test_backward_needs)
    with wb.trace() as tr:
        y = torch.relu(F.linear(x, w))
        assert not compute(tr, "linear", "backward")
        y.sum().backward()
    (fwd,) = compute(tr, "linear")
    dgrad, wgrad = compute(tr, "linear", "backward")
    assert (dgrad.args["part"], wgrad.args["part"]) == ("dgrad", "wgrad")
    want = wb.ops.cost("linear", X, W[:2])                        # the busiest rank's slice
    assert fwd.flops == want.flops and dgrad.flops + wgrad.flops == want.backward_flops
    assert dgrad.flops == 2 * 6 * 8 * 2                           # dX = dY W: 2 M K N
    assert dgrad.bytes == 4 * (6 * 2 + 2 * 8 + 6 * 8)             # read dY, W; write dX
    assert wgrad.bytes == 4 * (6 * 8 + 2 * 8)                     # read X; write dW
    assert dgrad.bytes + wgrad.bytes == 4 * (6 * 2 + 2 * (6 * 8 + 2 * 8))   # the op's
    for ev in (dgrad, wgrad):
        assert ev.duration == sim_cost.compute_time(ev.flops, ev.bytes, tr.profile,
                                                    torch.float32, op_class="matmul")
    assert compute(tr, "relu", "backward")[0].flops == 2 * compute(tr, "relu")[0].flops
    assert dgrad.start >= fwd.start + fwd.duration and wgrad.start == dgrad.end


def test_no_backward_node_without_a_trace():
    w = wb.shard_tensor(torch.randn(4, 8), M2, [S(0)]).requires_grad_()
    y = torch.relu(w)
    assert "BackwardCompute" not in type(y._local.grad_fn).__name__
    with wb.trace():
        y = torch.relu(w)
    assert "BackwardCompute" in type(y._local.grad_fn).__name__


def test_float64_under_a_trace_is_priced_never_refused():
    prof = wb.get_profile(None)
    try:
        prof.peak(torch.float64)
    except ValueError:
        pytest.skip("the profiles gain float64 peaks with the clock's issue 11")
    x = wb.shard_tensor(torch.randn(4, 6, dtype=torch.float64), M2, [S(0)])
    with wb.trace() as tr:
        y = torch.exp(x).sum()
    assert compute(tr, "exp")[0].duration > 0 and y.dtype == torch.float64


def test_causal_attention_priced_on_the_busiest_rank_when_rows_are_sharded():
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    with wb.trace() as tr:
        F.scaled_dot_product_attention(wb.shard_tensor(q, M2, [S(2)]), wb.shard_tensor(k, M2, [R]),
                                       wb.shard_tensor(v, M2, [R]), is_causal=True)
    (ev,) = compute(tr, "scaled_dot_product_attention")
    pairs = sum(r + 1 for r in range(4, 8))           # rank 1 holds rows 4..7 of 8: 26 pairs
    assert ev.flops == 2 * 1 * 2 * pairs * (4 + 4)    # 2 pairs (D + Dv) per (batch, head)


def test_gemms_on_the_trace_carry_their_tile_and_wave_quantization():
    """A linear big enough to fill waves of 256x128 tiles on the A100 (meta tensors: no
    data): forward, dgrad and wgrad priced with their output shapes, as plan.layer_cost
    prices the same GEMMs (cost.gemm_efficiency)."""
    T, K, N = 8192, 6144, 3072 * 2                 # tp 2 splits N: 3072 columns per rank
    x = wb.shard_tensor(torch.empty(T, K, device="meta", dtype=torch.bfloat16), M2,
                        [R]).requires_grad_()      # an activation: its dgrad runs
    w = wb.shard_tensor(torch.empty(N, K, device="meta", dtype=torch.bfloat16), M2,
                        [S(0)]).requires_grad_()
    with wb.trace(profile="a100") as tr:
        F.linear(x, w).sum().backward()
    (fwd,) = compute(tr, "linear")
    dgrad, wgrad = compute(tr, "linear", "backward")
    for ev, out in ((fwd, (1, T, N // 2)), (dgrad, (1, T, K)), (wgrad, (1, N // 2, K))):
        eff = sim_cost.gemm_efficiency(out, "a100")
        assert ev.duration == sim_cost.compute_time(ev.flops, ev.bytes, "a100",
                                                    torch.bfloat16, "matmul", gemm=out)
        assert eff < 1 or out == (1, N // 2, K)
    assert sim_cost.gemm_efficiency((1, T, N // 2), "a100") == pytest.approx(768 / 864)
