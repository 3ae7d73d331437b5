"""The inputs of :func:`~.generate.generate` beyond the prompt, checked as Transformers'
``generate`` reads them: ``eos_token_id`` / ``pad_token_id``, a left-padded batch's
``attention_mask``, and a cache an earlier call filled (``past_key_values``).  Each
returns what generate runs with, or raises naming the argument, the value and the fix."""
from __future__ import annotations

import torch

from ..parallel.dist_tensor import DistTensor
from .kv_cache import KVCache

__all__ = ["check_eos", "check_attention_mask", "check_reuse"]


def check_eos(eos_token_id, pad_token_id, vocab: int):
    """(eos ids as a list, the pad id) of :func:`generate`; a clear error otherwise."""
    def is_id(v):
        return not isinstance(v, bool) and isinstance(v, int) and 0 <= v < vocab
    if eos_token_id is None:
        if pad_token_id is not None:
            raise ValueError(f"generate(pad_token_id={pad_token_id!r}) without eos_token_id: "
                             "no sequence finishes early, so nothing is padded; give "
                             "eos_token_id too, or leave pad_token_id None")
        return [], None
    stop = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if not stop or not all(is_id(e) for e in stop):
        raise ValueError(f"generate(eos_token_id={eos_token_id!r}): give a token id in "
                         f"[0, {vocab}), or a non-empty list of them")
    if pad_token_id is not None and not is_id(pad_token_id):
        raise ValueError(f"generate(pad_token_id={pad_token_id!r}): give a token id in "
                         f"[0, {vocab}), or None (the first eos id)")
    return stop, stop[0] if pad_token_id is None else pad_token_id


def check_reuse(cache, idx, start: int, keep) -> None:
    """A cache holding ``start`` tokens may continue only the sequence an earlier generate
    put in it: idx must start with those tokens (checked), and add at least one."""
    S = idx.shape[1]
    held = getattr(cache, "_wb_tokens", None)
    if held is None or tuple(held.shape) != (idx.shape[0], start):
        raise ValueError(f"generate(cache=...): this cache holds {start} tokens that no "
                         "generate call left there (or of another batch), so they cannot be "
                         "checked against idx; give an empty cache, or the cache of the "
                         "generate call whose output idx continues")
    if start >= S:
        raise ValueError(f"generate(cache=...): the cache holds {start} tokens and idx has {S}; "
                         "give idx as the whole sequence: the cached tokens (the earlier "
                         "call's output), then at least one new token")

    def whole(t):
        return t.full() if isinstance(t, DistTensor) else t
    if not torch.equal(whole(idx[:, :start]).cpu(), whole(held).cpu().to(idx.dtype)):
        raise ValueError(f"generate(cache=...): idx's first {start} tokens are not the ones "
                         "the cache holds (the earlier call's output); give that output, then "
                         "the new tokens, or an empty cache")
    before = getattr(cache, "key_mask", None)
    if before is not None and (keep is None or not torch.equal(keep[:, :start].cpu(),
                                                                before.cpu())):
        raise ValueError("generate(cache=...): the cache was filled with an attention_mask; "
                         "give the attention_mask of the whole sequence (that call's mask, "
                         "then ones for its output and the new tokens)")
    if before is None and keep is not None and not bool(keep[:, :start].all()):
        raise ValueError("generate(cache=...): attention_mask pads tokens the cache holds as "
                         "real ones (it was filled without a mask); pad only the new tokens' "
                         "batch in a fresh cache")


def check_attention_mask(attention_mask, idx, cache):
    """generate's ``attention_mask`` as (B, S) bool (None when it pads nothing)."""
    if attention_mask is None:
        return None
    if isinstance(attention_mask, DistTensor):
        attention_mask = attention_mask.full()
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.is_floating_point() \
            or attention_mask.is_complex() or \
            tuple(attention_mask.shape) != tuple(idx.shape):
        what = f"of shape {tuple(attention_mask.shape)} and dtype {attention_mask.dtype}" \
            if isinstance(attention_mask, torch.Tensor) else f"a {type(attention_mask).__name__}"
        raise ValueError(f"generate: attention_mask {what}; give an integer or bool tensor of "
                         f"idx's shape {tuple(idx.shape)}, 1 at a token, 0 at padding")
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("generate: attention_mask holds values other than 0 and 1; give 1 at "
                         "a token, 0 at padding")
    keep = attention_mask.bool()
    if keep.all():
        return None
    if not bool(keep[:, -1].all()) or bool((keep.long().diff(dim=1) < 0).any()):
        raise ValueError("generate: attention_mask has padding after a token (right padding, "
                         "or a row of only padding); pad the prompts on the left (Transformers' "
                         "tokenizer.padding_side='left' for decoder-only generation), so that "
                         "every row's new tokens follow its prompt")
    if cache is not None and not isinstance(cache, KVCache):
        raise TypeError(f"generate(attention_mask=..., cache={type(cache).__name__}): the "
                        "padded batch needs the contiguous KVCache (its key mask); serve prompts "
                        "of different lengths in pages with workbench.serve.Engine")
    return keep
