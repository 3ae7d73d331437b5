"""Per-token positions and the logits to keep: the two optional arguments of both course
models' ``forward`` (:class:`~workbench.models.llama.Llama`,
:class:`~workbench.models.gpt.GPT`), spelled as Hugging Face Transformers spells them.

    logits, _ = model(idx, position_ids=pos, logits_to_keep=last)

``position_ids`` (B, S) or (1, S), integer: the position of every token, where the
default is ``start, start + 1, ...`` for every row (``start``: the tokens a KV cache
holds, else 0).  A batch that packs several sequences in one row (Orca's selective
batching, Yu et al. OSDI'22; vLLM's model runner) gives each token its own sequence's
position: the RoPE angles (Llama, Su et al. 2021) or the learned position embedding
(GPT) are then looked up per token.  As in Transformers' models, only the positions
change: attention is still the model's (causal over the row, or the cache's).

``logits_to_keep`` (Transformers' ``logits_to_keep``, formerly ``num_logits_to_keep``):
0 keeps every position (the default); an int n > 0 the last n; a 1-d integer tensor
those indices along the sequence.  The final norm and the head run on the kept
positions only, so a prefill that samples from its last token pays the head once.
"""
from __future__ import annotations

import torch

__all__ = ["check_position_ids", "check_logits_to_keep"]


def check_position_ids(name: str, position_ids, B: int, S: int, seq_len: int):
    """``position_ids`` checked for a (B, S) batch of a model of ``seq_len`` positions;
    a clear error otherwise (an out-of-range index would wrap around, or fail deep in a
    lookup: never a silently wrong position)."""
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"{name}(position_ids={type(position_ids).__name__}): give an integer "
                        f"tensor of shape ({B}, {S}) or (1, {S})")
    if position_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: position_ids of dtype {position_ids.dtype}; give integer "
                        "positions (torch.long)")
    if position_ids.ndim != 2 or position_ids.shape[1] != S or position_ids.shape[0] not in (1, B):
        raise ValueError(f"{name}: position_ids of shape {tuple(position_ids.shape)} for idx of "
                         f"shape ({B}, {S}); give ({B}, {S}), or (1, {S}) for every row")
    if position_ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(position_ids))
        if lo < 0 or hi >= seq_len:
            raise ValueError(f"{name}: position_ids in [{lo}, {hi}]; the model's positions "
                             f"cover [0, {seq_len - 1}] (cfg.seq_len={seq_len}); crop the "
                             "sequence or raise cfg.seq_len")
    return position_ids


def check_logits_to_keep(name: str, logits_to_keep, S: int, has_targets: bool):
    """``logits_to_keep`` checked before the forward runs (an error after it would leave a
    cache holding the failed call's keys) -> what x (B, S, h) is indexed with along the
    sequence: None (every position), a slice or an index tensor (module docstring)."""
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.ndim != 1 or logits_to_keep.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name}: logits_to_keep of shape {tuple(logits_to_keep.shape)} "
                             f"and dtype {logits_to_keep.dtype}; give a 1-d integer tensor of "
                             "sequence indices, or an int")
        if logits_to_keep.numel():
            lo, hi = (int(v) for v in torch.aminmax(logits_to_keep))
            if lo < -S or hi >= S:
                raise ValueError(f"{name}: logits_to_keep holds indices in [{lo}, {hi}] for a "
                                 f"sequence of {S} tokens; give indices in [{-S}, {S - 1}]")
    elif isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) \
            or logits_to_keep < 0:
        raise ValueError(f"{name}(logits_to_keep={logits_to_keep!r}): give an int >= 0 (0: "
                         "every position, n: the last n) or a 1-d tensor of indices")
    elif logits_to_keep == 0:
        return None
    if has_targets:
        raise ValueError(f"{name}: targets with logits_to_keep={logits_to_keep!r}; the loss "
                         "needs every position's logits: leave logits_to_keep=0")
    if isinstance(logits_to_keep, int):
        return slice(-logits_to_keep, None)                                 # the last n
    return logits_to_keep
