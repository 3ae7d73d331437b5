"""Autoregressive generation with a KV cache, on one device or any layout.

    model = wb.models.build_model("tiny").eval()
    out = generate(model, idx, 20)                                # greedy, KV cache
    out = generate(model, idx, 20, temperature=0.8, top_k=20,
                   generator=torch.Generator().manual_seed(0))    # sampled, reproducible
    out = generate(model, padded, 20, attention_mask=mask,
                   eos_token_id=0)     # prompts of different lengths, each stops at its eos

    served = serve_model("tiny", tp=2)                            # Megatron TP on 2 ranks
    out = generate(served.model, served.place(idx), 20).full()    # one device's tokens

Prefill runs the prompt once and fills the cache; each decode step runs the newest
token alone (``kv_cache.py``).  ``use_cache=False`` is the textbook loop that
recomputes the whole prefix for every token (``Splittable.generate``): the reference
the cache is held to, token by token.

On a layout (:func:`serve_model`: the hybrid recipe's dp x tp meshes, simulated or
one process per rank under torchrun) the prompt's rows are split over dp and
replicated over tp; the weights are Megatron's tensor-parallel split, so the cache's
key/value heads shard over tp with them, and the vocabulary-sharded logits pick
their token with the vocabulary-parallel argmax / topk (2 numbers per row and rank,
not V) of ``parallel/ops_table/sampling.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel import storage
from ..parallel.dist_tensor import DistTensor, shard_tensor
from ..parallel.placement import Replicate, Shard
from ..parallel.reshard import reshard
from .generate_inputs import check_attention_mask, check_eos, check_reuse
from .kv_cache import KVCache
from .sampling import SamplingParams, sample_next

__all__ = ["generate", "serve_model", "Served"]


def _check(model, idx, max_new_tokens, use_cache):
    wrapped = getattr(model, "_wb_wrapped", None) or \
        getattr(getattr(model, "module", None), "_wb_wrapped", None)
    if wrapped or not hasattr(model, "cfg"):
        what = f"wrapped by {wrapped} for training (its parameters are per-rank copies or " \
            "shards)" if wrapped else f"a {type(model).__name__}, not a workbench model"
        raise TypeError(f"generate(model=...): {what}; generate with a workbench model "
                        "(wb.models.build_model(cfg), or serve_model(cfg, dp=..., tp=...).model) "
                        "holding its weights, e.g. serve_model(cfg, state_dict=sd) with sd "
                        "the wrapper's full_state_dict() (DDP, FSDP wrappers), or the "
                        "state_dict() of a module sharded in place (fully_shard, "
                        "parallelize_module: its DistTensors are gathered)")
    meshes = []
    for p in model.parameters():
        if isinstance(p, DistTensor) and not any(p.mesh == m for m in meshes):
            meshes.append(p.mesh)
    if len(meshes) > 1:     # the model's own forward refused it naming training's calls
        raise TypeError(f"generate(model=...): a model split into pipeline stages (its "
                        f"parameters live on {len(meshes)} meshes); generation runs the whole "
                        "model token by token on one layout: serve its weights with "
                        "serve_model(model.cfg, tp=..., state_dict=model.state_dict()) (each "
                        "stage's DistTensors gathered), then generate(served.model, "
                        "served.place(idx), ...)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: give an int >= 0")
    if not isinstance(idx, (torch.Tensor, DistTensor)):
        raise TypeError(f"generate: idx is a {type(idx).__name__}; give token ids as a (B, S) "
                        "tensor, e.g. torch.tensor([[5, 7, 9]]) (Engine.add_request takes a "
                        "list of ids)")
    if idx.ndim != 2 or idx.shape[1] < 1:
        raise ValueError(f"generate: idx of shape {tuple(idx.shape)}; give token ids (B, S) "
                         "with S >= 1 (a prompt of at least one token)")
    if idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"generate: idx of dtype {idx.dtype}; give token ids (torch.long)")
    # each rank checks the ids it holds (no collective: a serving rank checks its own)
    if isinstance(idx, DistTensor):
        held = [idx.to_local()] if storage.holds_own(idx.mesh) else idx.locals()
    else:
        held = [idx]
    held = [t for t in held if t.numel()]
    v = model.cfg.vocab_size
    lo = min((int(t.min()) for t in held), default=0)
    hi = max((int(t.max()) for t in held), default=0)
    if lo < 0 or hi >= v:
        bad = lo if lo < 0 else hi
        raise ValueError(f"generate: idx holds token id {bad}, outside the vocabulary "
                         f"[0, {v}) of this model (cfg.vocab_size={v}); encode the prompt "
                         "with the model's tokenizer (e.g. the course's models.data "
                         "Tokenizer.encode)")
    cf = getattr(model.cfg, "moe_capacity_factor", None)
    if use_cache and getattr(model.cfg, "moe_experts", 0) and cf is not None:
        raise ValueError(f"generate: a mixture of experts with moe_capacity_factor={cf}: its "
                         "capacity, ceil(cf S k / E) slots per sequence, depends on the tokens "
                         "in the forward (S), so a decode step of one token drops other tokens "
                         "than a recompute of the whole sequence and the KV cache's tokens would "
                         "differ from it; generate with a dropless model "
                         "(cfg.replace(moe_capacity_factor=None), as MoE inference runs), or "
                         "use_cache=False")
    n = idx.shape[1] + max_new_tokens
    if use_cache and n > model.cfg.seq_len:
        raise ValueError(f"generate: {idx.shape[1]} prompt + {max_new_tokens} new tokens = {n} "
                         f"> seq_len={model.cfg.seq_len}, the longest context the model's "
                         "positions cover; ask for fewer tokens, or use_cache=False (which "
                         "crops the context to the last seq_len tokens)")


@torch.no_grad()
def generate(model, idx, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None,
             generator=None, use_cache: bool = True, cache=None,
             eos_token_id=None, pad_token_id: int | None = None, attention_mask=None):
    """Append ``max_new_tokens`` tokens to idx (B, S) (a tensor, or a DistTensor of a
    :func:`serve_model` layout); returns (B, S + max_new_tokens) of the same kind.
    Greedy unless ``temperature`` > 0 (:class:`~.sampling.SamplingParams`); ``generator``:
    one ``torch.Generator``, or one per sequence (:func:`~.sampling.sample_next`).  ``cache``:
    a cache to fill (a :class:`~.kv_cache.KVCache` or :class:`~.paged_cache.PagedKVCache`;
    default a new KVCache): empty, or the one an earlier ``generate`` call filled, with idx
    the whole sequence (that call's output, then new tokens), as Transformers'
    ``past_key_values``: only the tokens the cache does not hold yet are run.

    ``eos_token_id`` (an id, or a list of ids), as Hugging Face's ``generate``: a sequence
    that samples one is finished, its later tokens are ``pad_token_id`` (default: the first
    eos id), and generation stops once every sequence has finished, so the result may be
    shorter than S + max_new_tokens.  The draws are those without eos (every row still
    draws each step), so a sequence's tokens up to its eos are the same either way.

    ``attention_mask`` (B, S) of 1 (a token) and 0 (padding), prompts of different lengths
    padded on the left, as Transformers' ``generate`` takes them: a row's positions count
    its tokens only and no query attends to a pad, so each row gets the tokens it gets
    alone, unpadded (in float32; in bfloat16 the padded batch rounds its sums otherwise,
    and a near tie can flip a token: 1 row of 48 measured on the tiny models)."""
    params = SamplingParams(temperature, top_k, top_p)
    _check(model, idx, max_new_tokens, use_cache)
    stop, pad = check_eos(eos_token_id, pad_token_id, model.cfg.vocab_size)
    keep = check_attention_mask(attention_mask, idx, cache)      # (B, S) bool, or None
    if keep is not None:
        keep = keep.to(model.tok_emb.weight.device)                 # positions index there
    start = 0 if cache is None else cache.get_seq_length()         # tokens held already
    if cache is not None and not use_cache:
        raise ValueError("generate(cache=..., use_cache=False): the textbook loop recomputes "
                         "every token and keeps no cache; leave cache None, or use_cache=True")
    if start:
        check_reuse(cache, idx, start, keep)
    if max_new_tokens == 0:
        return idx
    was_training = model.training
    model.eval()
    try:
        if cache is None and use_cache:
            cache = KVCache.for_model(model)
        out, done = idx, None           # done (B,): the rows that sampled an eos id
        new = idx[:, start:] if start else idx                      # the tokens not held
        if keep is not None:            # left padding: positions and keys of tokens only
            logits = _padded_forward(model, new, keep, cache)
        else:
            logits, _ = model(new, cache=cache) if cache is not None \
                else model(idx[:, -model.cfg.seq_len:])                    # prefill (B, S, V)
        for i in range(max_new_tokens):
            nxt = sample_next(logits[:, -1, :], params, generator)          # (B,)
            if stop:
                if done is not None:
                    nxt = nxt.masked_fill(done, pad)    # a finished row: padding from here
                hit = nxt == stop[0]
                for e in stop[1:]:
                    hit = hit | (nxt == e)
                done = hit if done is None else done | hit
            out = torch.cat((out, nxt.unsqueeze(1).to(out.dtype)), 1)       # (B, S + i + 1)
            if i == max_new_tokens - 1 or (done is not None and bool(done.all())):
                break
            nxt = nxt.unsqueeze(1)                                          # (B, 1)
            if keep is not None:
                keep = torch.cat((keep, keep.new_ones(keep.shape[0], 1)), 1)    # (B, S + i + 1)
                logits = _padded_forward(model, nxt if cache is not None else out, keep, cache)
            elif cache is not None:
                logits, _ = model(nxt, cache=cache)                         # decode (B, 1, V)
            else:
                logits, _ = model(out[:, -model.cfg.seq_len:])              # recompute all
        if cache is not None:           # what it holds: every token but the last (never fed)
            cache._wb_tokens = out[:, :-1]
        if isinstance(out, DistTensor) and not isinstance(idx, DistTensor):
            out = out.full()            # a plain prompt on a laid-out model: plain tokens back
        return out
    finally:
        model.train(was_training)


def _padded_forward(model, ids, keep, cache):
    """The last position's logits (B, 1, V) of ``ids`` (the new tokens after what ``cache``
    holds, or with no cache the whole left-padded sequence, cropped to seq_len), each
    token at its row's own position, no query attending to a pad (``keep`` (B, T) bool:
    every token held after this forward)."""
    if cache is None:                   # recompute everything: a fresh cache, prefilled
        keep = keep[:, -model.cfg.seq_len:]
        ids = ids[:, -keep.shape[1]:]
        cache = KVCache.for_model(model)
    pos = (keep.long().cumsum(1) - 1).clamp_min(0)[:, -ids.shape[1]:]     # (B, S)
    cache.key_mask = keep.to(pos.device)
    logits, _ = model(ids, cache=cache, position_ids=pos, logits_to_keep=1)
    return logits                                                           # (B, 1, V)


@dataclass
class Served:
    """A model laid out for serving: ``model`` (eval mode), its ``mesh`` (dp x tp), and
    :meth:`place` to lay out a prompt on it (rows over dp, replicated over tp)."""
    model: torch.nn.Module
    mesh: object
    dp: int
    tp: int

    def place(self, idx: torch.Tensor) -> DistTensor:
        return shard_tensor(idx, self.mesh, [Shard(0), Replicate()])


def serve_model(cfg, *, dp: int = 1, tp: int = 1, seed: int = 0, state_dict=None,
                distributed: bool = False) -> Served:
    """The model of ``cfg`` (a ModelConfig or a preset name) on a dp x tp layout, built by
    the hybrid recipe (``seed``: its deterministic init), then ``state_dict`` (full
    tensors, or DistTensors of any layout, e.g. a model trained on another mesh: each is
    gathered whole first) loaded into it.  ``distributed``: one rank per
    process under torchrun (``wb.distributed.init()`` first)."""
    from ..models.config import get_config
    from ..recipes.hybrid import Hybrid
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    for name, val in (("n_head", cfg.n_head), ("n_kv_head", cfg.n_kv_head), ("d_ff", cfg.d_ff)):
        if isinstance(tp, int) and tp >= 1 and val % tp:
            raise ValueError(f"serve_model(tp={tp}): tp does not divide {name}={val}; tensor "
                             "parallelism splits heads and hidden features evenly")
    recipe = Hybrid(dp=dp, tp=tp, distributed=distributed)
    model = recipe.build_model(cfg, seed).eval()
    # (a tied lm_head: the recipe gives it the embedding's DistTensor, recipes/hybrid.py)
    if state_dict is not None:
        mesh = recipe.meshes[0]
        if any(isinstance(v, DistTensor) and v.mesh != mesh for v in state_dict.values()):
            meta = getattr(state_dict, "_metadata", None)       # torch's module versions
            state_dict = type(state_dict)(
                (k, v.full() if isinstance(v, DistTensor) and v.mesh != mesh else v)
                for k, v in state_dict.items())
            if meta is not None:
                state_dict._metadata = meta
        model.load_state_dict(state_dict)
    for p in model.parameters():
        p.requires_grad_(False)
    if tp > 1:
        model.tok_emb.register_forward_hook(_residual_layout)
    return Served(model, recipe.meshes[0], dp, tp)


def _residual_layout(module, args, out):
    """The residual stream after the (vocabulary-parallel) embedding: rows over dp,
    replicated over tp (Megatron's all-reduce after ``VocabParallelEmbedding``; the hybrid
    recipe's ``_layout``).  Left to the dispatcher, the partial sum may be
    reduce-scattered onto the batch rows instead, uneven when B / dp < tp."""
    return reshard(out, out.mesh, [Shard(0), Replicate()])
