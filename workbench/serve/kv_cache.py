"""The key/value cache of incremental decoding, and what it costs.

Without a cache, generating token t recomputes the keys and values of all t-1 tokens
before it (``Splittable.generate``: O(T^2) work for T tokens).  With one, the model
runs twice as two phases (Pope et al. 2022, "Efficiently Scaling Transformer
Inference", sec. 2):

    prefill   the prompt (B, S) in one forward: every layer's k, v (B, nkv, S, hd)
              are kept; logits of the last position give the first new token;
    decode    one token (B, 1) per forward: its k, v are appended, its query attends
              to every key kept so far (no causal mask needed: it is the last row).

The models take the cache as ``model(idx, cache=cache)`` (``Llama.forward``,
``GPT.forward``): each attention layer calls :meth:`KVCache.attend` with its new
q, k, v, and the model reads :meth:`KVCache.get_seq_length` (as Hugging Face's
``Cache``) for the position of ``idx``'s first token (RoPE angle, position
embedding).  Keys and values may be DistTensors (heads sharded over tp: the
column-parallel wk, wv give each rank whole key/value heads, so the cache shards
with them and attention needs no communication, Megatron's attention TP).

The cache grows by concatenation along the sequence (as Hugging Face's
``DynamicCache``), so it holds exactly the tokens seen; a server that reserves each
sequence's maximum length up front reserves :func:`kv_cache_bytes` of ``max_len``
tokens instead (what paged attention saves: ``workbench.ops.paged_attention``).  The
concatenation copies the cache each step, and a trace prices that copy; a static or
paged cache writes only the new slot, which is what ``roofline.step_cost`` counts
(the cache read once, the new keys and values written once).

Bytes per token (every layer's k and v): ``2 * n_layer * n_kv_head * head_dim *
dtype bytes`` (Pope et al. 2022, sec. 3.1; Kwon et al. 2023, "vLLM", sec. 2.3: 800 KB
per token for OPT-13B in fp16 = 2 * 40 * 5120 * 2).
"""
from __future__ import annotations

import torch

from ..ops import flash_attention

__all__ = ["KVCache", "kv_bytes_per_token", "kv_cache_bytes", "causal_offset_mask"]


def _dtype_bytes(dtype) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(cfg, dtype=None) -> int:
    """Bytes of keys and values one token keeps in the cache, all layers:
    2 (k and v) * n_layer * n_kv_head * head_dim * bytes per element (``dtype``,
    default the model's)."""
    return 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * _dtype_bytes(dtype or cfg.dtype)


def kv_cache_bytes(cfg, batch: int, tokens: int, dtype=None) -> int:
    """Bytes of a cache holding ``tokens`` positions for each of ``batch`` sequences."""
    return batch * tokens * kv_bytes_per_token(cfg, dtype)


def causal_offset_mask(q_len: int, k_len: int, device=None) -> torch.Tensor:
    """(q_len, k_len) bool, True = may attend: the queries are the LAST q_len positions
    of k_len (bottom-right aligned causal, as FlashAttention-2's ``causal`` when
    seqlen_q != seqlen_k): query i sits at position k_len - q_len + i and sees keys
    j <= that position."""
    if not 0 <= q_len <= k_len:
        raise ValueError(f"causal_offset_mask(q_len={q_len}, k_len={k_len}): the queries are the "
                         "last q_len of the k_len positions, so 0 <= q_len <= k_len (a first "
                         "query row would see no key: its softmax is nan)")
    pos = torch.arange(k_len - q_len, k_len, device=device)
    return pos[:, None] >= torch.arange(k_len, device=device)[None, :]


class KVCache:
    """Per layer, the keys and values of every token seen: (B, nkv, T, hd) each, plain
    tensors or DistTensors (whatever the model's k, v are)."""

    def __init__(self, n_layer: int, max_len: int | None = None):
        if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
            raise ValueError(f"KVCache(n_layer={n_layer!r}): give the model's layer count, "
                             "an int >= 1")
        self.n_layer, self.max_len = n_layer, max_len
        self.keys: list = [None] * n_layer
        self.values: list = [None] * n_layer
        # (B, T) bool, False at a padding token's key (generate's attention_mask, left
        # padding): set by the caller for the tokens held after this forward's; None: all
        self.key_mask = None

    @classmethod
    def for_model(cls, model) -> "KVCache":
        """An empty cache for ``model`` (its ``cfg.n_layer`` layers, ``cfg.seq_len`` long)."""
        return cls(model.cfg.n_layer, model.cfg.seq_len)

    def get_seq_length(self, layer: int = 0) -> int:
        """Tokens held by ``layer`` (the model reads layer 0 before its first block)."""
        k = self.keys[layer]
        return 0 if k is None else int(k.shape[2])

    def update(self, layer: int, k, v):
        """Append k, v (B, nkv, S, hd) to ``layer``'s; return all of them (B, nkv, T, hd)."""
        if not 0 <= layer < self.n_layer:
            raise IndexError(f"KVCache.update(layer={layer}): the cache has {self.n_layer} "
                             "layers; build it with KVCache.for_model(model)")
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None and tuple(old_k.shape[:2]) != tuple(k.shape[:2]):
            raise ValueError(f"KVCache.update: new keys {tuple(k.shape)} do not continue the "
                             f"cached {tuple(old_k.shape)} (batch and heads must match); start "
                             "a new cache for a new batch")
        if self.max_len is not None and self.get_seq_length(layer) + k.shape[2] > self.max_len:
            raise ValueError(f"KVCache: {self.get_seq_length(layer)} held + {k.shape[2]} new "
                             f"tokens exceed max_len={self.max_len} (nothing was stored); "
                             "ask for fewer tokens, or build the cache with a larger "
                             "max_len, at most the model's seq_len (KVCache.for_model)")
        self.keys[layer] = k if old_k is None else torch.cat((old_k, k), 2)       # (B, nkv, T, hd)
        self.values[layer] = v if old_v is None else torch.cat((old_v, v), 2)
        return self.keys[layer], self.values[layer]

    def attend(self, layer: int, q, k, v):
        """Store k, v of ``layer`` and attend q (B, nh, S, hd), the last S positions, to
        every key held: causal within the new tokens, all earlier ones visible."""
        K, V = self.update(layer, k, v)                                     # (B, nkv, T, hd)
        S, T = q.shape[2], K.shape[2]
        if self.key_mask is not None:   # padding: no query sees a pad's key
            if tuple(self.key_mask.shape) != (K.shape[0], T):
                raise ValueError(f"KVCache.key_mask of shape {tuple(self.key_mask.shape)}; the "
                                 f"cache holds ({K.shape[0]}, {T}) tokens after this forward: "
                                 "set it for every token held, the new ones included")
            keep = self.key_mask[:, None, None, :]                          # (B, 1, 1, T)
            if S > 1:
                keep = keep & causal_offset_mask(S, T, self.key_mask.device)    # (B, 1, S, T)
            return flash_attention(q, K, V, mask=keep)  # a pad's own row sees no key: 0
        if S == 1:                      # decode: the newest row sees every key
            return flash_attention(q, K, V)                                 # (B, nh, 1, hd)
        if S == T:                      # prefill into an empty cache
            return flash_attention(q, K, V, causal=True)                    # (B, nh, S, hd)
        return flash_attention(q, K, V, mask=causal_offset_mask(S, T))     # chunked prefill

    def nbytes(self) -> int:
        """Bytes held (keys and values, all layers, the global tensors)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values
                   if t is not None)

    def __repr__(self) -> str:
        return f"KVCache(n_layer={self.n_layer}, tokens={self.get_seq_length()})"
