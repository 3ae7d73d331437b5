"""A KV cache in pages: the models' cache interface (``attend``, ``get_seq_length``) on
a shared block pool read through block tables (``workbench.ops.paged_attention``).

    cache = PagedKVCache.for_model(model, batch=2, num_blocks=16, block_size=4)
    out = generate(model, idx, 20, cache=cache)     # the contiguous cache's tokens
    cache.memory(max_len=model.cfg.seq_len)         # paged against contiguous, as data

Every layer has its own pool (num_blocks, n_kv_head, block_size, head_dim) of keys and
one of values; all layers share the block tables (vLLM keeps one block table per
sequence for every layer: Kwon et al. 2023, sec. 4.3).  Layer 0 reserves the slots of
a step's new tokens (allocating blocks as a sequence crosses into a new one), every
layer writes its keys and values there, and the last layer commits the new length.
Plain tensors on one device (a layout shards the pools by heads the same way as the
contiguous cache; not built).  Its sequences share one length (generate's batch); the
serving engine's ``engine_forward.RaggedPagedCache`` gives each its own (``engine.py``).
"""
from __future__ import annotations

import torch

from ..ops import paged_attention
from ..ops.kv_blocks import BlockAllocator, BlockTables, OutOfBlocks, PagedMemory, paged_memory
from ..parallel.dist_tensor import DistTensor
from .kv_cache import kv_bytes_per_token

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """Sequences 0 .. batch - 1 of a batch, their keys and values in pages."""

    def __init__(self, cfg, batch: int, num_blocks: int, block_size: int, dtype=None,
                 allocator: BlockAllocator | None = None, device=None):
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"PagedKVCache(batch={batch!r}): give the number of sequences the "
                             "cache serves, an int >= 1 (generate's idx.shape[0])")
        self.cfg = cfg
        self.n_layer = cfg.n_layer
        dtype = dtype or cfg.torch_dtype
        if allocator is not None and num_blocks != allocator.num_blocks:
            raise ValueError(f"PagedKVCache(num_blocks={num_blocks!r}, allocator={allocator}): "
                             "the pools are the allocator's; give num_blocks="
                             f"{allocator.num_blocks}, the blocks it hands out")
        self.allocator = allocator or BlockAllocator(num_blocks)
        n = self.allocator.num_blocks
        self.tables = BlockTables(self.allocator, block_size)
        shape = (n, cfg.n_kv_head, block_size, cfg.head_dim)                # (blocks, Hkv, bs, hd)
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=device)
                        for _ in range(self.n_layer)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=device)
                        for _ in range(self.n_layer)]
        self.seqs = list(range(batch))
        for s in self.seqs:
            self.tables.add(s)
        self._slots = None           # this step's (block, offset) per sequence (layer 0 sets)
        self._length = 0

    @classmethod
    def for_model(cls, model, batch: int, num_blocks: int, block_size: int) -> "PagedKVCache":
        """An empty cache for ``model``, its pools in the dtype of the model's weights (what
        its keys and values are computed in: a ``bfloat16`` preset cast with ``.float()``
        keeps float32 keys, as the contiguous cache does), not ``cfg.dtype``, on the
        weights' device."""
        w = model.tok_emb.weight
        return cls(model.cfg, batch, num_blocks, block_size, dtype=w.dtype, device=w.device)

    def get_seq_length(self, layer: int = 0) -> int:
        return self._length

    def attend(self, layer: int, q, k, v):
        """Write k, v (B, Hkv, S, hd) into their slots, attend q through the tables."""
        if isinstance(q, DistTensor):
            raise TypeError("PagedKVCache holds plain tensors on one device; a DistTensor "
                            "model (serve_model) takes the contiguous KVCache")
        B, _, S, _ = k.shape
        if B != len(self.seqs):
            raise ValueError(f"PagedKVCache: a batch of {B} sequences, the cache was built for "
                             f"batch={len(self.seqs)}")
        if not 0 <= layer < self.n_layer:
            raise IndexError(f"PagedKVCache.attend(layer={layer}): the cache has {self.n_layer} "
                             "layers; build it with PagedKVCache.for_model(model, ...)")
        pool = self.k_pools[layer]
        if (k.shape[1], k.shape[3]) != (pool.shape[1], pool.shape[3]) or v.shape != k.shape:
            raise ValueError(f"PagedKVCache: keys {tuple(k.shape)} and values {tuple(v.shape)} "
                             f"of {k.shape[1]} heads of {k.shape[3]}; the pools hold "
                             f"{pool.shape[1]} heads of {pool.shape[3]} (the cache was built for "
                             "another model's n_kv_head / head_dim): build it with "
                             "PagedKVCache.for_model(model, ...)")
        if layer == 0 and self._slots is not None:
            raise RuntimeError(f"PagedKVCache: the previous step stopped before layer "
                               f"{self.n_layer - 1} (a model with fewer layers than the cache's "
                               f"n_layer={self.n_layer}, or an error mid-forward): its positions "
                               "would be wrong; build a new cache with "
                               "PagedKVCache.for_model(model, ...)")
        if layer == 0:               # all or nothing: a pool too small changes no table
            need = sum(self.tables._need(s, S) for s in self.seqs)
            if need > self.allocator.num_free:
                raise OutOfBlocks(f"PagedKVCache: {S} more tokens for {B} sequences need {need} "
                                  f"blocks, {self.allocator.num_free} are free; build the "
                                  "cache with more num_blocks")
            self._slots = [self.tables.reserve(s, S) for s in self.seqs]
        if self._slots is None:
            raise RuntimeError(f"PagedKVCache.attend(layer={layer}) before layer 0 of this "
                               "step: the layers run in order, 0 first (layer 0 reserves the "
                               "new tokens' slots)")
        for b, (blk, off) in enumerate(self._slots):
            self.k_pools[layer][blk, :, off] = k[b].transpose(0, 1).to(self.k_pools[layer].dtype)
            self.v_pools[layer][blk, :, off] = v[b].transpose(0, 1).to(self.v_pools[layer].dtype)
        kp, vp = self.k_pools[layer], self.v_pools[layer]
        if kp.dtype != q.dtype:      # a cache kept in another dtype (dtype=...): its keys and
            kp, vp = kp.to(q.dtype), vp.to(q.dtype)     # values read back in the model's
        out = paged_attention(q, kp, vp, self.tables.table(self.seqs),
                              self.tables.seq_lens(self.seqs))
        if layer == self.n_layer - 1:
            self._length += S
            self._slots = None
        return out

    def free(self) -> None:
        """Give every sequence's blocks back to the pool (a request ended); the cache is
        then empty, its tables reset, ready for a new batch of as many sequences (vLLM
        frees a finished sequence's blocks for the next request, Kwon et al. 2023, sec.
        4.2)."""
        for s in self.seqs:
            self.tables.free(s)
            self.tables.add(s)
        self._slots = None
        self._length = 0

    def memory(self, max_len: int | None = None) -> PagedMemory:
        """This cache's tokens in pages against a contiguous ``max_len`` (default the
        model's seq_len) reservation per sequence."""
        return paged_memory([self.tables.lengths[s] for s in self.seqs], self.tables.block_size,
                            max_len or self.cfg.seq_len,
                            kv_bytes_per_token(self.cfg, self.k_pools[0].dtype))

    def __repr__(self) -> str:
        return (f"PagedKVCache({len(self.seqs)} sequences, {self._length} tokens each, "
                f"{self.allocator})")
