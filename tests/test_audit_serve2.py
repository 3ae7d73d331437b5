"""Second audit of train-to-serve as a PyTorch / Transformers / vLLM user would write it:
each test pins one defect a probe found (a silent wrong answer, a silent no-op, or an
unclear error), held to one device's plain PyTorch answer."""
import pytest
import torch

import workbench as wb
from workbench.models.config import build_model, get_config
from workbench.serve import KVCache, PagedKVCache, generate
from workbench.serve.kv_cache import kv_bytes_per_token
from workbench.serve.roofline import linear_weights, step_cost


def prompt(B, S, seed=0):
    return torch.randint(0, 75, (B, S), generator=torch.Generator().manual_seed(seed))


# ---- the paged cache keeps the keys in the dtype the model computes them in -----------------

@pytest.mark.parametrize("preset_dtype, cast", [("bfloat16", torch.float32),
                                                ("float32", torch.float64)])
def test_a_paged_cache_for_a_cast_model_keeps_its_keys_unrounded(preset_dtype, cast):
    """for_model made the pools in cfg.dtype: a bfloat16 preset cast with .float() had its
    keys and values rounded to bfloat16 in the cache, the prefill's logits 6e-4 off the
    model's own forward (the contiguous KVCache: exact)."""
    m = build_model(get_config("tiny", dtype=preset_dtype), seed=0).to(cast).eval()
    idx = prompt(2, 20)
    cache = PagedKVCache.for_model(m, batch=2, num_blocks=16, block_size=4)
    assert cache.k_pools[0].dtype == cast
    with torch.no_grad():
        want, _ = m(idx)
        got, _ = m(idx, cache=cache)
        dense, _ = m(idx, cache=KVCache.for_model(m))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 if cast == torch.float64 else 1e-6)
    torch.testing.assert_close(got, dense, rtol=0, atol=0)


# ---- the decode step on the roofline counts the bytes of the dtype it is priced in ----------

def test_step_cost_in_float32_reads_four_byte_weights_and_cache():
    """dtype='float32' priced the FLOPs at the float32 peak but still counted 2 bytes per
    weight and a bfloat16 cache: half the bytes, half the time of a memory-bound decode."""
    cfg = get_config("llama2-7b")
    P = linear_weights(cfg)
    bf = step_cost(cfg, batch=1, new_tokens=1, context=512)
    f32 = step_cost(cfg, batch=1, new_tokens=1, context=512, dtype="float32")
    assert (bf.weight_bits, bf.weight_bytes) == (16, 2 * P)
    assert (f32.weight_bits, f32.weight_bytes) == (32, 4 * P)
    assert f32.kv_read_bytes == 512 * kv_bytes_per_token(cfg, "float32") == 2 * bf.kv_read_bytes
    assert f32.bound == "memory" and f32.seconds > 1.9 * bf.seconds
    # explicit choices still hold: bf16 weights computed in float32, a bf16 cache
    mixed = step_cost(cfg, batch=1, new_tokens=1, context=512, dtype="float32",
                      weight_bits=16, kv_dtype="bfloat16")
    assert (mixed.weight_bytes, mixed.kv_read_bytes) == (bf.weight_bytes, bf.kv_read_bytes)
    with pytest.raises(ValueError, match="weight_bits=12"):
        step_cost(cfg, batch=1, new_tokens=1, context=8, weight_bits=12)
    with pytest.raises(ValueError, match="dtype='fp32'"):
        step_cost(cfg, batch=1, new_tokens=1, context=8, dtype="fp32")
