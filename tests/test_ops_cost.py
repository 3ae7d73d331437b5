"""wb.ops.cost: FLOPs against PyTorch's FLOP counter, bytes against hand counts,
and the OpCost data type."""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import workbench.ops as ops


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def counted_flops(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("Hq, Hkv, Sq, Sk, D, Dv", [(4, 4, 33, 17, 8, 8), (6, 2, 16, 40, 4, 12)])
def test_attention_flops_match_the_flop_counter_on_the_unfused_matmuls(Hq, Hkv, Sq, Sk, D, Dv):
    q, k, v = torch.randn(2, Hq, Sq, D), torch.randn(2, Hkv, Sk, D), torch.randn(2, Hkv, Sk, Dv)
    with ops.use("unfused"):
        counted = counted_flops(lambda: ops.flash_attention(q, k, v))
    assert ops.cost("flash_attention", q, k, v).flops == counted


def test_causal_attention_counts_only_the_attended_pairs():
    S, D = 1024, 64
    full = ops.cost("flash_attention", meta(1, 8, S, D), meta(1, 8, S, D), meta(1, 8, S, D))
    causal = ops.cost(ops.flash_attention, meta(1, 8, S, D), meta(1, 8, S, D), meta(1, 8, S, D),
                      causal=True)
    assert full.flops == 4 * 8 * S * S * D
    assert causal.flops == 4 * 8 * (S * (S + 1) // 2) * D        # the lower triangle
    assert causal.backward_flops == 10 * 8 * (S * (S + 1) // 2) * D   # FA2: 5 matmuls
    window = ops.cost("flash_attention", meta(1, 1, S, D), meta(1, 1, S, D), meta(1, 1, S, D),
                      mask=ops.SlidingWindow(128))
    assert window.flops == 4 * D * (128 * S - 128 * 127 // 2)


def test_attention_bytes_fused_are_inputs_outputs_and_the_log_sum_exp():
    B, H, S, D = 1, 8, 1024, 64
    c = ops.cost("flash_attention", *(meta(B, H, S, D, dtype=torch.bfloat16),) * 3)
    assert c.bytes_fused == 4 * B * H * S * D * 2 + B * H * S * 4
    # unfused: the S x S scores are written and read back several times
    assert c.bytes_unfused > 10 * c.bytes_fused
    extra = B * H * S * S * 2 - B * H * S * (D * 2 + 4)     # P kept; o and the LSE not
    assert c.saved_bytes_unfused - c.saved_bytes_fused == extra
    # a causal mask is made from positions; a bool tensor mask is read (1 byte per element)
    qkv = (meta(B, H, S, D, dtype=torch.bfloat16),) * 3
    causal = ops.cost("flash_attention", *qkv, causal=True)
    assert causal.bytes_fused == c.bytes_fused
    dense = ops.cost("flash_attention", *qkv, mask=torch.ones(S, S, dtype=torch.bool).tril())
    assert dense.bytes_fused == c.bytes_fused + S * S and dense.flops == causal.flops


def test_linear_flops_match_the_flop_counter():
    x, w, b = torch.randn(3, 7, 16), torch.randn(5, 16), torch.randn(5)
    counted = counted_flops(lambda: ops.linear(x, w))
    assert ops.cost("linear", x, w).flops == counted == 2 * 21 * 16 * 5
    assert ops.cost("linear", x, w, b).flops == counted + 21 * 5    # the bias adds


def test_pointwise_costs_count_each_kernel():
    x, w = meta(4, 1024), meta(1024)
    rms = ops.cost("rms_norm", x, w)
    X = 4 * 1024 * 4
    assert rms.bytes_fused == 2 * X + 1024 * 4 + 4 * 4               # x, w in; y, rstd out
    assert rms.traffic_ratio > 2
    sw = ops.cost("swiglu", meta(4, 2048))
    assert sw.bytes_fused == 4 * 2048 * 4 * 3 // 2                   # read x, write half
    rope = ops.cost("rotary_embedding", meta(2, 4, 16, 64), meta(16, 64), meta(16, 64))
    assert rope.saved_bytes_fused == rope.saved_bytes_unfused == 2 * 16 * 64 * 4
    adam = ops.cost("adamw", [meta(1000)], [meta(1000)], [meta(1000)], [meta(1000)], 1)
    assert (adam.bytes_fused, adam.bytes_unfused, adam.flops) == (28000, 88000, 14000)


def test_op_cost_is_plain_addable_data():
    a = ops.cost("swiglu", meta(8, 64))
    b = ops.cost("rms_norm", meta(8, 32), meta(32))
    total = a + b
    assert total.op == "swiglu+rms_norm"
    assert total.flops == a.flops + b.flops
    assert total.bytes_unfused == a.bytes_unfused + b.bytes_unfused
    assert sum([a, b], ops.OpCost.zero()).bytes_fused == total.bytes_fused
    assert math.isclose(a.intensity_fused, a.flops / a.bytes_fused)
    text = str(ops.cost("flash_attention", *(meta(1, 8, 1024, 64),) * 3, causal=True))
    assert text.startswith("flash_attention: 1.07 GFLOP forward, moves 8.42 MB fused vs")


def test_unknown_op_cost_is_a_clear_error():
    with pytest.raises(KeyError, match="no cost model for this op; ops with one: adamw"):
        ops.cost("softmax", meta(3))
