"""Weight-only quantization (workbench.serve.quantize) and the decode step on the roofline
(workbench.serve.roofline): the rounding bound holds elementwise, the bytes are what the
tensors hold, the tiny model's loss barely moves (measured), and the roofline's FLOPs
are the ones the simulator's trace counts for a real prefill and decode step."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import workbench as wb
from workbench.serve import KVCache, generate, serve_model
from workbench.serve.quantize import (QuantizedLinear, dequantize, quantization_error,
                                      quantize_model, quantize_weight, weight_bytes)
from workbench.serve.roofline import decode_vs_prefill, linear_weights, ridge, step_cost


@settings(max_examples=40)
@given(rows=st.integers(1, 6), groups=st.integers(1, 3), seed=st.integers(0, 500),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_rounding_error_is_at_most_half_a_step(rows, groups, seed, dtype):
    w = (torch.randn(rows, 16 * groups, generator=torch.Generator().manual_seed(seed))
         * torch.rand(rows, 1, generator=torch.Generator().manual_seed(seed + 1)) * 3).to(dtype)
    for bits, gs in ((8, None), (4, 16)):
        q = quantize_weight(w, bits, gs or 32)
        back = dequantize(q)
        assert back.dtype == dtype and back.shape == w.shape
        step = q.scale.float() if bits == 8 else q.scale.float().repeat_interleave(gs, 1)
        err = (back.float() - w.float()).abs()
        # half a step from rounding, plus the dtype's own rounding of the result
        assert bool((err <= step / 2 + w.float().abs() * 2 ** -7 + 1e-7).all()), (bits, err.max())
        # the row's / group's largest weight is exactly +-127 / +-7 steps
        top = 127 if bits == 8 else 7
        amax = w.float().abs().amax(1) if bits == 8 else \
            w.float().abs().view(rows, -1, gs).amax(-1)
        scale = q.scale.float()[:, 0] if bits == 8 else q.scale.float()
        torch.testing.assert_close(scale * top, amax,
                                   rtol=2 ** -7, atol=1e-30)


def test_bytes_are_what_the_tensors_hold():
    w = torch.randn(12, 64)
    q8, q4 = quantize_weight(w, 8), quantize_weight(w, 4, 32)
    assert q8.data.dtype == torch.int8 and q8.nbytes == 12 * 64 + 12 * 4          # + fp32 scales
    assert q4.data.dtype == torch.uint8 and q4.nbytes == 12 * 64 // 2 + 12 * 2 * 4
    exact = torch.tensor([[-7.0, -1.0, 0.0, 3.0, 7.0, 2.0]]).repeat(2, 1) * 0.5  # on the grid
    assert torch.equal(dequantize(quantize_weight(exact, 4, 6)), exact)
    for bad, msg in ((dict(bits=3), "bits=3"), (dict(bits=4, group_size=5), "group_size=5")):
        with pytest.raises(ValueError, match=msg):
            quantize_weight(w, **bad)


@pytest.fixture(scope="module")
def tiny():
    cfg = wb.models.get_config("tiny")
    return cfg, wb.models.build_model(cfg, seed=0).eval()


def test_quantize_model_replaces_the_linears_and_keeps_the_model(tiny):
    cfg, m = tiny
    q8 = quantize_model(m, bits=8)
    lin = [n for n, x in q8.named_modules() if isinstance(x, QuantizedLinear)]
    assert len(lin) == 7 * cfg.n_layer + 1                  # q k v o, gate up down; lm head
    assert all(isinstance(x, torch.nn.Linear) for x in m.modules()
               if type(x).__name__ == "Linear")              # the original is untouched
    before, after = weight_bytes(m), weight_bytes(q8)
    P = linear_weights(cfg)
    assert before["linear"] == 4 * P                         # fp32
    rows = sum(x.out_features for x in q8.modules() if isinstance(x, QuantizedLinear))
    assert after["linear"] == P + 4 * rows and after["other"] == before["other"]
    gpt = wb.models.build_model("gpt-tiny").eval()           # tied head: left as it is
    assert "lm_head" not in [n for n, x in quantize_model(gpt, 8).named_modules()
                             if isinstance(x, QuantizedLinear)]
    with pytest.raises(TypeError, match="DistTensors"):
        quantize_model(serve_model("tiny").model)


def test_accuracy_change_on_the_tiny_model_is_measured_and_small(tiny):
    cfg, m = tiny
    idx, targets = wb.models.get_batch(cfg, 8, seed=1)
    e8 = quantization_error(m, quantize_model(m, 8), idx, targets)
    e4 = quantization_error(m, quantize_model(m, 4), idx, targets)
    # measured (seed 0, batch seed 1): int8 loss +0.0002, logits within 0.8% of the
    # largest; int4 (groups of 32) loss -0.0024, logits within 15%
    assert abs(e8["loss_delta"]) < 1e-3 and e8["logits_rel_error"] < 0.02
    assert abs(e4["loss_delta"]) < 2e-2 and e4["logits_rel_error"] < 0.3
    assert e8["logits_max_abs_error"] < e4["logits_max_abs_error"]
    assert e8["argmax_agreement"] > e4["argmax_agreement"] > 0.5
    out = generate(quantize_model(m, 8), idx[:2, :5], 8)     # it generates
    assert out.shape == (2, 13)


def test_roofline_flops_are_what_the_trace_counts(tiny):
    """The formula beside the simulator: a prefill of 8 tokens and one decode step of
    the tiny model on the op table, FLOPs of its linears and attention summed."""
    cfg, _ = tiny
    s = serve_model(cfg)
    idx = torch.randint(0, 75, (2, 8), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(s.model)
    counted = []
    with torch.no_grad():
        for x in (idx, idx[:, :1]):
            with wb.trace() as tr:
                s.model(s.place(x), cache=cache)
            counted.append(sum(e.flops for e in tr.events
                               if e.name in ("linear", "flash_attention")))
    pre = step_cost(cfg, batch=2, new_tokens=8, context=0)
    dec = step_cost(cfg, batch=2, new_tokens=1, context=8)
    assert counted == [pre.flops, dec.flops]


def test_decode_is_memory_bound_and_quantized_weights_cut_its_time():
    pre, dec = decode_vs_prefill("llama2-7b", batch=1, prompt=512, profile="h100")
    assert pre.bound == "compute" and dec.bound == "memory"
    assert dec.intensity < 2 < ridge("h100") < pre.intensity
    t = {b: step_cost("llama2-7b", batch=1, new_tokens=1, context=512, weight_bits=b)
         for b in (16, 8, 4)}
    P = linear_weights(wb.models.get_config("llama2-7b"))
    assert t[16].weight_bytes == 2 * P
    assert P < t[8].weight_bytes < 1.01 * P and P / 2 < t[4].weight_bytes < 0.57 * P
    # memory-bound: time follows bytes (weights + the 512-token cache)
    for b in (8, 4):
        assert t[b].bound == "memory"
        assert t[b].seconds / t[16].seconds == pytest.approx(t[b].bytes / t[16].bytes)
    # a bigger batch reads the weights once for more tokens
    big = step_cost("llama2-7b", batch=64, new_tokens=1, context=512)
    assert big.seconds_per_token < dec.seconds_per_token / 20
    with pytest.raises(ValueError, match="weight_bits=3"):
        step_cost("tiny", batch=1, new_tokens=1, context=0, weight_bits=3)
