"""Models the planner is asked about that the course's presets do not hold: a mixture of
experts and long-context Llamas.

    cfg = wb.plan.presets.get_config("mixtral-8x7b")     # or any models.config preset
    wb.plan.search(cfg, wb.plan.Cluster("h100", 64), global_batch=256)

- ``mixtral-8x7b``: Jiang et al. 2024, "Mixtral of Experts" (arXiv:2401.04088), Table 1:
  dim 4096, 32 layers, head dim 128, hidden (expert FFN) 14336, 32 heads, 8 key/value
  heads, vocabulary 32000, 8 experts, top-2; "a context size of 32k tokens" (sec. 2),
  RoPE base 1e6 and RMSNorm eps 1e-5 (mistralai/Mixtral-8x7B-v0.1 config.json:
  rope_theta 1000000.0, rms_norm_eps 1e-05, tie_word_embeddings false); no shared
  experts, dropless.  47B parameters, 13B active per token (sec. 2.1).
- ``llama3-8b-128k`` / ``llama3-70b-128k``: Llama 3's 8B and 70B (``models.config``'s
  presets, Dubey et al. 2024, Table 3) at the 128K context of their final pre-training
  stage (sec. 3.4.2, "Long Context Pre-Training": the context grown in six stages from
  8K to 128K tokens; Table 4 runs it with context parallelism 16), 131,072 tokens as
  Llama 3.1's config.json (max_position_embeddings 131072).

The MoE fields are the issue's ``ModelConfig(moe_experts=, moe_topk=,
moe_capacity_factor=, moe_shared_experts=)``; an expert is an MLP of ``d_ff`` unless a
config gives ``moe_d_ff`` (``plan.moe_cost``).  Until ``models.config.ModelConfig``
carries the four, :class:`Config` adds them (and ``moe_d_ff``) to it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..models.config import PRESETS as _MODEL_PRESETS
from ..models.config import ModelConfig
from ..models.config import get_config as _model_config

__all__ = ["Config", "PRESETS", "get_config"]

_MOE_FIELDS = ("moe_experts", "moe_topk", "moe_capacity_factor", "moe_shared_experts",
               "moe_d_ff")

# the four fields; ``moe_d_ff`` is the planner's own (optional, getattr)
if all(f in {x.name for x in fields(ModelConfig)} for f in _MOE_FIELDS[:4]):
    Config = ModelConfig
else:
    @dataclass(frozen=True)
    class Config(ModelConfig):
        """``ModelConfig`` with the MoE fields the planner reads (module docstring)."""
        moe_experts: int = 0                    # routed experts E (0: dense)
        moe_topk: int = 2                       # experts per token k
        moe_capacity_factor: float | None = None  # at most c k T / E rows an expert; None: dropless
        moe_shared_experts: int = 0             # experts every token runs (DeepSeekMoE)
        moe_d_ff: int | None = None             # one expert's SwiGLU width (None: d_ff)

        def __post_init__(self):
            super().__post_init__()
            if self.moe_experts:
                from .moe_cost import check_moe
                check_moe(self)


_LLAMA3 = _MODEL_PRESETS["llama3-8b"]
PRESETS: dict[str, dict] = {
    "mixtral-8x7b": dict(arch="llama", vocab_size=32000, seq_len=32768, n_layer=32,
                         n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, norm_eps=1e-5,
                         rope_theta=1e6, dtype="bfloat16", moe_experts=8, moe_topk=2),
    "llama3-8b-128k": dict(_MODEL_PRESETS["llama3-8b"], seq_len=131072),
    "llama3-70b-128k": dict(_MODEL_PRESETS["llama3-70b"], seq_len=131072),
}


def get_config(preset: str, **overrides):
    """The named preset: one of :data:`PRESETS` or of ``models.config.PRESETS``, with
    ``overrides`` applied."""
    if preset in PRESETS:
        return Config(**{**PRESETS[preset], **overrides})
    if preset in _MODEL_PRESETS:
        if any(k in _MOE_FIELDS for k in overrides):
            return Config(**{**_MODEL_PRESETS[preset], **overrides})
        return _model_config(preset, **overrides)
    raise ValueError(f"unknown preset {preset!r}; use one of "
                     f"{list(_MODEL_PRESETS) + list(PRESETS)}")
