"""Serving: generation with a KV cache on any layout, sampling, paged attention's cache,
weight-only quantization, and the decode step on the roofline.

    from workbench.serve import generate, serve_model, KVCache, SamplingParams
"""
from .kv_cache import KVCache, kv_bytes_per_token, kv_cache_bytes, causal_offset_mask
from .sampling import SamplingParams, filter_logits, sample_next
from .generate import generate, serve_model, Served
from .paged_cache import PagedKVCache

__all__ = ["KVCache", "kv_bytes_per_token", "kv_cache_bytes", "causal_offset_mask",
           "SamplingParams", "filter_logits", "sample_next", "generate", "serve_model",
           "Served", "PagedKVCache"]
