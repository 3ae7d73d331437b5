"""How a decoder-only model splits, for the parallel recipes above it.

A recipe (``workbench.recipes.hybrid``) knows nothing of a model's parts: it asks the
model.  Both course models (``Llama``, ``GPT``) answer with this mixin:

    model.tp_plan(tp)            Megatron's tensor-parallel plan, by module path
    model.tp_regions(layers)     the modules that take Megatron's f before and g after
                                 (with MoE blocks, attention only: the router and the
                                 experts are replicated over tp, Megatron-LM's expert
                                 tensor parallel size 1; expert parallelism splits them)
    model.norm_classes()         the model's norm layers (sequence parallelism splits
                                 their input on the sequence, so their gradients are
                                 partial sums over tp)
    model.pipeline_stages(n)     n stages of equal layer counts and the modules each owns
                                 (``sizes``: the layers of each, uneven)
    model.head(x, stage)         final norm and lm head (or the tied embedding's table)
    model.set_recompute(mode)    none | selective | full, per block
    model.generate(idx, n)       sampling, as nanoGPT's

A model sets ``TP_BLOCK_PLAN`` (the plan inside its blocks, keys from the model's root
such as ``"layers.*.attn.wq"``), ``FIRST_MODULES`` (what the first stage adds before
the blocks: the embeddings) and ``NORM_CLASSES`` (its norm layers' classes; torch's
``LayerNorm`` and ``RMSNorm`` unless it says otherwise).  ``workbench.parallel`` never
imports a model: the recipe hands these answers down to the strategies.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import RECOMPUTE

__all__ = ["Splittable"]


class Splittable:
    """Mixin for a model with ``cfg``, ``layers``, ``norm``, ``lm_head`` and ``tok_emb``."""

    TP_BLOCK_PLAN: dict = {}
    FIRST_MODULES: tuple = ("tok_emb",)
    NORM_CLASSES: tuple = (nn.LayerNorm, nn.RMSNorm)

    def norm_classes(self) -> tuple:
        """The classes of the model's norm layers (for
        ``workbench.parallel.strategies.tensor_parallel.sequence_parallel_norms``)."""
        return tuple(self.NORM_CLASSES)

    def tp_plan(self, tp: int) -> dict:
        """Megatron's tensor-parallel plan over ``tp`` ranks, by module path (for
        ``wb.parallelize``): the blocks' plan, and, when the vocabulary divides by tp,
        the word embedding vocabulary-parallel (Megatron's ``VocabParallelEmbedding``)
        and the head column-parallel (vocabulary-sharded logits)."""
        plan = dict(self.TP_BLOCK_PLAN) if tp > 1 else {}
        if getattr(self.cfg, "moe_experts", 0):     # MoE blocks: router and experts
            plan = {k: v for k, v in plan.items() if ".mlp." not in k}   # replicated over tp
        if tp > 1 and self.cfg.vocab_size % tp == 0:
            plan.update({"tok_emb": "rowwise", "lm_head": "colwise"})
        return plan

    def tp_regions(self, layers) -> list[str]:
        """The modules that take Megatron's f before and g after (attention and MLP)."""
        parts = ("attn",) if getattr(self.cfg, "moe_experts", 0) else ("attn", "mlp")
        return [f"layers.{i}.{part}" for i in layers for part in parts]

    def pipeline_stages(self, n_stages: int, sizes=None) -> list[dict]:
        """The model cut in ``n_stages`` consecutive stages of equal layer counts (or of
        ``sizes[s]`` layers each: uneven stages, as Megatron-LM's
        ``--decoder-first-pipeline-num-layers``): per stage its layer indices and the
        top-level modules it owns (the first adds the embeddings, the last the final norm
        and the head; with tied embeddings on one stage the head reads the word
        embedding's table and owns no module)."""
        L = self.cfg.n_layer
        if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1 \
                or (sizes is None and L % n_stages):
            raise ValueError(f"n_stages={n_stages!r} does not divide n_layer={L}: use a "
                             f"divisor of {L}, or give sizes=")
        if sizes is None:
            sizes = [L // n_stages] * n_stages
        sizes = list(sizes)
        if len(sizes) != n_stages or sum(sizes) != L or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
            raise ValueError(f"sizes={sizes!r}: give n_stages={n_stages} layer counts "
                             f"(ints >= 0) adding up to n_layer={L}")
        tied_here = self.cfg.tie_embeddings and n_stages == 1
        out, start = [], 0
        for s, per in enumerate(sizes):
            layers = list(range(start, start + per))
            start += per
            last = (["norm"] if tied_here else ["norm", "lm_head"]) if s == n_stages - 1 else []
            names = (list(self.FIRST_MODULES) if s == 0 else []) + \
                [f"layers.{i}" for i in layers] + last
            out.append({"layers": layers, "modules": names})
        return out

    def head(self, x, stage: dict):
        """Final norm and lm head of the last stage: (B, S, h) -> logits (B, S, V)."""
        x = self.norm(x)
        if "lm_head" not in stage["modules"]:         # tied, one stage: the embedding's table
            return F.linear(x, self.tok_emb.weight)
        return self.lm_head(x)

    def set_recompute(self, mode: str, layers=None) -> None:
        """Set ``recompute`` on the blocks with index in ``layers`` (default: all)."""
        if mode not in RECOMPUTE:
            raise ValueError(f"recompute={mode!r}; use one of {RECOMPUTE}")
        if mode == "op" and (self.cfg.arch != "llama" or self.cfg.moe_experts):
            from .config import op_recompute_error
            raise ValueError(op_recompute_error(self.cfg))
        for i, block in enumerate(self.layers):
            if layers is None or i in layers:
                block.recompute = mode

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None):
        """Append ``max_new_tokens`` sampled tokens to idx (B, S); temperature 0 = greedy.
        The textbook loop: every token recomputes the whole prefix
        (``workbench.serve.generate`` keeps a KV cache, and runs on any layout)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 0:
            raise ValueError(f"generate(max_new_tokens={max_new_tokens!r}): give an int >= 0")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not 0 <= temperature < math.inf:
            raise ValueError(f"generate(temperature={temperature!r}): give a number >= 0 "
                             "(0 = greedy); a negative one would favour the least likely tokens")
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.seq_len:])
            last = logits[:, -1, :].float()                                 # (B, V)
            if temperature == 0:
                nxt = last.argmax(-1, keepdim=True)                         # (B, 1)
            else:
                probs = torch.softmax(last / temperature, -1)
                nxt = torch.multinomial(probs, 1, generator=generator)     # (B, 1)
            idx = torch.cat((idx, nxt), 1)
        return idx
