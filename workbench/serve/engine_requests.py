"""What the serving engine (``engine.py``) takes and gives, as plain data: a request's
state, the new token of a step (:class:`RequestOutput`), what a step ran
(:class:`StepRecord`), and the checks of a model and a prompt before they enter."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams

__all__ = ["RequestOutput", "StepRecord"]


@dataclass(frozen=True)
class RequestOutput:
    """One request's new token of a step."""
    request_id: object
    token: int
    finished: bool
    finish_reason: str | None       # "eos", "length" (max_new_tokens), or None
    logits: torch.Tensor = field(repr=False, compare=False)    # (V,) it was chosen from


@dataclass(frozen=True)
class StepRecord:
    """What one engine step ran (plain data)."""
    step: int
    prefill: tuple          # (request id, context before, new tokens) per prompt chunk
    decode: tuple           # (request id, context before) per decode token
    admitted: tuple         # request ids that entered the batch this step
    preempted: tuple        # request ids whose blocks were freed to recompute later
    finished: tuple         # request ids that left the batch this step
    tokens: int             # tokens in the forward
    blocks_in_use: int      # after the step (finished requests' blocks already freed)
    running: int            # requests in the batch after the step
    waiting: int            # requests queued after the step


@dataclass(eq=False)
class _Request:
    id: object
    prompt: list
    max_new_tokens: int
    eos: tuple                      # the ids that finish it (none: only its length)
    params: SamplingParams
    generator: torch.Generator | None
    output: list = field(default_factory=list)
    computed: int = 0               # tokens whose keys and values are in the cache

    @property
    def tokens(self) -> list:
        return self.prompt + self.output


def _check_model(model) -> None:
    wrapped = getattr(model, "_wb_wrapped", None) or \
        getattr(getattr(model, "module", None), "_wb_wrapped", None)
    if wrapped or not hasattr(model, "cfg") or getattr(model.cfg, "arch", None) not in (
            "llama", "gpt"):
        what = f"wrapped by {wrapped} for training" if wrapped else \
            f"a {type(model).__name__}, not a workbench Llama or GPT"
        raise TypeError(f"Engine(model=...): {what}; serve a workbench model holding its "
                        "weights, on one device (wb.models.build_model(cfg)) or tensor "
                        "parallel (serve_model(cfg, tp=...).model)")
    cf = getattr(model.cfg, "moe_capacity_factor", None)
    if getattr(model.cfg, "moe_experts", 0) and cf is not None:
        raise ValueError(f"Engine: a mixture of experts with moe_capacity_factor={cf}: its "
                         "capacity per expert depends on the tokens in the forward, so a "
                         "request's tokens would depend on what shares its step (and differ "
                         "from generate's); serve a dropless model "
                         "(cfg.replace(moe_capacity_factor=None), as MoE inference runs)")


def _token_list(ids, vocab: int) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool \
                or ids.is_complex():
            raise TypeError(f"prompt_token_ids: a tensor of shape {tuple(ids.shape)} and dtype "
                            f"{ids.dtype}; give one prompt's token ids, (S,) integers")
        ids = ids.tolist()
    ids = list(ids)
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise TypeError(f"prompt_token_ids holds {bad[0]!r} ({type(bad[0]).__name__}); give "
                        "token ids as ints")
    if not ids:
        raise ValueError("prompt_token_ids is empty; give a prompt of at least one token")
    out = [t for t in ids if not 0 <= t < vocab]
    if out:
        raise ValueError(f"prompt_token_ids holds {out[0]}; token ids are in [0, {vocab})")
    return [int(t) for t in ids]
