"""Choosing the next token from the last position's logits: greedy, or sampled with
temperature, top-k and top-p (nucleus) filtering and a seeded ``torch.Generator``.

    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    nxt = sample_next(logits[:, -1, :], params, generator=torch.Generator().manual_seed(0))

The order and meaning are Hugging Face ``transformers``' logits warpers
(``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``):

    temperature T    logits / T (T = 0: greedy, the argmax; no draw)
    top_k = k        keep the logits >= the k-th largest (ties with it kept)
    top_p = p        keep the smallest set of most likely tokens whose probability
                     reaches p (Holtzman et al. 2020, "The Curious Case of Neural Text
                     Degeneration"): in descending order, token i is kept when the
                     mass before it is < p, so the most likely token always is;
                     tokens tied with the last one kept are kept too, as top_k keeps
                     ties (probabilities 0.5, 0.25, 0.25 and p = 0.6 keep all three;
                     Hugging Face's sort keeps one of the tied pair, whichever it puts
                     first): the set does not depend on an order of ties, so every
                     layout keeps the same tokens
    then             softmax, one draw per row (``torch.multinomial``)

Written with torch ops only (argmax, topk, softmax, cumsum, gather, masked_fill,
multinomial), so the same code runs on DistTensors: vocabulary-sharded logits take
the op table's vocabulary-parallel argmax / topk (``parallel/ops_table/sampling.py``)
and one draw shared by every rank, so every layout picks one device's tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "filter_logits", "sample_next"]


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen (module docstring)."""
    temperature: float = 0.0        # 0: greedy (argmax); > 0: divide the logits, then draw
    top_k: int | None = None        # keep the k most likely tokens (None: all)
    top_p: float | None = None      # keep the smallest set reaching this mass (None: all)

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 \
                or math.isinf(t):
            raise ValueError(f"temperature={t!r}: give a number >= 0 (0 = greedy)")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k={k!r}: give an int >= 1, or None to keep every token")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                              or not 0 < p <= 1):
            raise ValueError(f"top_p={p!r}: give a probability in (0, 1], or None")
        if t == 0 and (k is not None or p is not None):
            raise ValueError(f"top_k={k!r} / top_p={p!r} with temperature=0: greedy decoding "
                             "takes the argmax and filters nothing; give a temperature > 0 "
                             "to sample, or leave top_k and top_p None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits, params: SamplingParams):
    """logits (B, V) -> float32 logits / temperature with the tokens top-k and top-p
    drop set to -inf (B, V).  Greedy params (temperature 0) are refused: logits / 0 are
    inf and nan, as Hugging Face's ``TemperatureLogitsWarper`` refuses them."""
    if params.greedy:
        raise ValueError("filter_logits(params=SamplingParams(temperature=0)): greedy decoding "
                         "filters nothing (logits / 0 would be inf and nan); give a temperature "
                         "> 0, or take the argmax with sample_next(logits, params)")
    if logits.ndim != 2:
        raise ValueError(f"filter_logits: logits of shape {tuple(logits.shape)}; give the last "
                         "position's (B, V), e.g. logits[:, -1, :]")
    x = logits.float() / params.temperature                                 # (B, V)
    V = x.shape[-1]
    if params.top_k is not None and params.top_k < V:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]           # (B, 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1:
        vals = torch.topk(x, V, dim=-1).values                              # (B, V) descending
        probs = torch.softmax(vals, -1)
        before = torch.cumsum(probs, -1) - probs                            # mass before each
        n_keep = (before < params.top_p).sum(-1, keepdim=True)             # (B, 1) >= 1
        smallest = vals.gather(-1, n_keep - 1)                              # (B, 1)
        x = x.masked_fill(x < smallest, float("-inf"))
    return x


def sample_next(logits, params: SamplingParams = SamplingParams(), generator=None):
    """The next token of each row: logits (B, V) -> (B,) int64.  ``generator``: one
    ``torch.Generator`` for the batch, or a list of B, one per sequence (as vLLM's
    per-request seed: a sequence then draws the same tokens whatever batch it is in)."""
    if logits.ndim != 2:
        raise ValueError(f"sample_next: logits of shape {tuple(logits.shape)}; give the last "
                         "position's (B, V), e.g. logits[:, -1, :]")
    if params.greedy:
        return logits.argmax(-1)                                            # (B,)
    probs = torch.softmax(filter_logits(logits, params), -1)               # (B, V)
    if isinstance(generator, (list, tuple)):
        if len(generator) != probs.shape[0]:
            raise ValueError(f"sample_next: {len(generator)} generators for {probs.shape[0]} "
                             "sequences; give one per row, or one for the batch")
        return torch.cat([torch.multinomial(probs[b:b + 1], 1, generator=g)[:, 0]
                          for b, g in enumerate(generator)])                # (B,)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]          # (B,)
