"""Serving: generation with a KV cache on any layout, sampling, a paged KV cache, weight-only
quantization, and the decode step on the roofline.

    from workbench.serve import generate, serve_model
    out = generate(model, idx, 20)                              # greedy, KV cache
    out = generate(model, idx, 20, temperature=0.8, top_k=20, top_p=0.9,
                   generator=torch.Generator().manual_seed(0))
    out = generate(model, idx, 20, eos_token_id=0)              # each row stops at its eos
    out = generate(model, padded, 20, attention_mask=mask)      # prompts padded on the left
    s = serve_model("tiny", dp=2, tp=2)                         # the hybrid recipe's layout
    generate(s.model, s.place(idx), 20).full()                  # one device's tokens

Modules: ``kv_cache`` (KVCache, kv_bytes_per_token), ``sampling`` (SamplingParams,
sample_next), ``generate`` (generate, serve_model; its eos, attention_mask and cache
reuse checked in ``generate_inputs``), ``paged_cache`` (PagedKVCache over
``workbench.ops.paged_attention``), ``quantize`` (int8 / int4 weights), ``roofline``
(step_cost: prefill and decode as plain data), ``cli`` (``python -m workbench serve``),
``engine`` (Engine: continuous batching that generates, over a paged cache per sequence).
"""
from .kv_cache import KVCache, kv_bytes_per_token, kv_cache_bytes, causal_offset_mask
from .sampling import SamplingParams, filter_logits, sample_next
from .generate import generate, serve_model, Served
from .paged_cache import PagedKVCache
from .engine import Engine

__all__ = ["KVCache", "kv_bytes_per_token", "kv_cache_bytes", "causal_offset_mask",
           "SamplingParams", "filter_logits", "sample_next", "generate", "serve_model",
           "Served", "PagedKVCache", "Engine"]
