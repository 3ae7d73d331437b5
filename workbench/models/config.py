"""Model configuration: one dataclass, a table of named presets, parameter counts.

    from workbench.models.config import ModelConfig, PRESETS, get_config, param_count
    cfg = get_config("tiny")                     # trains a step in milliseconds on a CPU
    big = get_config("gpt3-175b")                # for estimates, built on the meta device
    print(param_count(big).explain())            # module count beside Megatron's eq. 2

Two architectures (``arch``):

- "llama" (the default; Touvron et al. 2023): RMSNorm without bias, rotary
  positions (no position table), SwiGLU MLP with three matrices, no biases,
  optionally grouped-query attention (Ainslie et al. 2023);
- "gpt" (Megatron-LM's GPT, Shoeybi et al. 2019; Radford et al. 2019): LayerNorm
  with bias, biases on every linear, a GeLU MLP of width d_ff = 4h, learned
  position embeddings, lm head tied to the token embedding (``tie_embeddings``),
  optionally a LayerNorm on the embeddings (``embed_norm``: BLOOM's).

Megatron's closed form (Narayanan et al. 2021, eq. 2) counts the GPT.
:func:`param_count` counts the real module and lists, term by term, why it
differs from eq. 2 (for "gpt": only the final LayerNorm, which eq. 2 omits);
nothing is fudged.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["ModelConfig", "PRESETS", "get_config", "param_count", "ParamCount", "DTYPES",
           "RECOMPUTE", "ARCHS", "build_model"]

DTYPES = ("float32", "bfloat16", "float16")
ARCHS = ("llama", "gpt")
RECOMPUTE = ("none", "full", "selective", "op")   # "op": Llama only (models/op_sac.py)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer, Llama or GPT (``arch``).  Frozen: change it with
    ``cfg.replace(...)``."""
    vocab_size: int = 75            # tokens in the vocabulary (the character set of models.data)
    seq_len: int = 64               # longest context T; rotary tables are built for it
    n_layer: int = 2                # transformer blocks
    n_head: int = 4                 # query heads; head dim = d_model / n_head
    n_kv_head: int | None = None    # key/value heads (GQA); None = n_head (MHA), 1 = MQA
    d_model: int = 64               # hidden size h (the residual stream width)
    d_ff: int | None = None         # MLP hidden size; None: llama 8/3 d_model rounded up to
                                    # 64 (SwiGLU), gpt 4 d_model (GeLU)
    norm_eps: float = 1e-5          # RMSNorm epsilon (Llama 2 uses 1e-5)
    rope_theta: float = 10000.0     # RoPE base: pair i turns at theta^(-2i/hd) rad per position
    dropout: float = 0.0            # on embeddings, attention weights and residual branches
    tie_embeddings: bool = False    # lm head shares the embedding matrix (GPT-2/3); Llama: no
    dtype: str = "float32"          # parameters and activations: float32 | bfloat16 | float16
    recompute: str = "none"         # per block: none | full (whole block) | selective (attention)
                                    # | op (torchtitan's op-level policy, dense Llama: op_sac.py)
    init_std: float = 0.02          # normal init std; residual outputs get / sqrt(2 n_layer)
    arch: str = "llama"             # "llama" | "gpt" (module docstring)
    # mixture of experts (models/moe.py): 0 experts = the dense MLP in every block
    moe_experts: int = 0            # routed experts per MoE layer (E); each an MLP of d_ff
    moe_topk: int = 2               # experts each token is routed to (k <= E)
    moe_capacity_factor: float | None = None  # slots per expert = ceil(cf S k / E) per
                                    # sequence, overflow dropped; None: no drops (dropless)
    moe_shared_experts: int = 0     # always-on experts (DeepSeek-V3): one dense MLP of
                                    # moe_shared_experts x d_ff beside the routed ones
    moe_gating: str = "softmax"     # "softmax" (Mixtral, GShard) | "sigmoid" (DeepSeek-V3)
    moe_aux_loss_coef: float = 0.01  # alpha of the load-balancing loss (Switch: 1e-2)
    moe_norm_topk: bool = True      # the k gates renormalised to sum 1 (Mixtral, DeepSeek-V3);
                                    # False: the router's own p_i (Switch's top-1 gate)
    embed_norm: bool = False        # gpt: a LayerNorm on the embeddings, before their dropout
                                    # (BLOOM's word_embeddings_layernorm; Megatron-DeepSpeed
                                    # --embed-layernorm); here on token + position, where
                                    # --embed-layernorm normalises the token embedding before
                                    # a position table is added (BLOOM, ALiBi, has none)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"ModelConfig: arch={self.arch!r}; use one of {ARCHS}")
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            _positive_int(name, getattr(self, name))
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model if self.arch == "gpt"
                               else 64 * math.ceil(8 * self.d_model / 3 / 64))
        _positive_int("n_kv_head", self.n_kv_head)
        _positive_int("d_ff", self.d_ff)
        if self.d_model % self.n_head:
            divisors = [n for n in range(1, self.d_model + 1) if self.d_model % n == 0]
            raise ValueError(f"ModelConfig: n_head={self.n_head} must divide d_model="
                             f"{self.d_model} (head dim = d_model / n_head); choose n_head in "
                             f"{divisors[:12]}")
        if self.arch == "gpt" and self.n_kv_head != self.n_head:
            raise ValueError(f"ModelConfig: arch='gpt' has multi-head attention, so "
                             f"n_kv_head={self.n_kv_head} must equal n_head={self.n_head}; "
                             f"leave n_kv_head=None (grouped-query heads are arch='llama')")
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(f"ModelConfig: head dim d_model / n_head = {self.head_dim} is odd; "
                             "rotary embedding rotates pairs of features, so it must be even")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"ModelConfig: n_kv_head={self.n_kv_head} must divide n_head="
                             f"{self.n_head} (each key/value head serves n_head / n_kv_head "
                             "query heads)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig: dropout={self.dropout!r} must be in [0, 1)")
        for name in ("norm_eps", "rope_theta", "init_std"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"ModelConfig: {name}={v!r} must be a number > 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig: dtype={self.dtype!r}; use one of {DTYPES}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"ModelConfig: recompute={self.recompute!r}; use one of {RECOMPUTE}")
        if self.recompute == "op" and (self.arch != "llama" or self.moe_experts):
            raise ValueError(op_recompute_error(self))
        _check_moe(self)
        if not isinstance(self.embed_norm, bool):
            raise ValueError(f"ModelConfig: embed_norm={self.embed_norm!r} must be True or False")
        if self.embed_norm and self.arch != "gpt":
            raise ValueError(f"ModelConfig: embed_norm=True is a LayerNorm on the GPT's "
                             f"embeddings (BLOOM); arch={self.arch!r} has none: use "
                             f"arch='gpt' or embed_norm=False")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def op_recompute_error(cfg) -> str:
    """Why ``recompute="op"`` is refused for ``cfg`` (a GPT or a mixture of experts)."""
    what = f"arch={cfg.arch!r}" + (" with experts" if cfg.moe_experts else "")
    return (f"recompute='op' (torchtitan's op-level selective checkpointing, "
            f"workbench.models.op_sac) is built for the dense Llama block, not {what}; use "
            f"'none', 'selective' or 'full'")


def _check_moe(cfg) -> None:
    """The mixture-of-experts fields (models/moe.py): a clear error naming the fix."""
    for name in ("moe_experts", "moe_shared_experts"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"ModelConfig: {name}={v!r} must be an int >= 0 (0: none)")
    if not cfg.moe_experts:
        return
    _positive_int("moe_topk", cfg.moe_topk)
    if cfg.moe_topk > cfg.moe_experts:
        raise ValueError(f"ModelConfig: moe_topk={cfg.moe_topk} > moe_experts="
                         f"{cfg.moe_experts}: each token picks k distinct experts; lower "
                         f"moe_topk to at most {cfg.moe_experts} or add experts")
    cf = cfg.moe_capacity_factor
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))
                           or not 0 < cf < math.inf):
        raise ValueError(f"ModelConfig: moe_capacity_factor={cf!r} must be a number > 0 "
                         "(e.g. 1.25), or None for no token dropping")
    if cfg.moe_gating not in ("softmax", "sigmoid"):
        raise ValueError(f"ModelConfig: moe_gating={cfg.moe_gating!r}; use 'softmax' or "
                         "'sigmoid'")
    if not isinstance(cfg.moe_norm_topk, bool):
        raise ValueError(f"ModelConfig: moe_norm_topk={cfg.moe_norm_topk!r}; give True (the "
                         "k gates renormalised to sum 1) or False (the router's own "
                         "probabilities, Switch's top-1 gate)")
    a = cfg.moe_aux_loss_coef
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a < math.inf:
        raise ValueError(f"ModelConfig: moe_aux_loss_coef={a!r} must be a number >= 0 "
                         "(e.g. 0.01; 0 turns the load-balancing loss off)")


def _positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"ModelConfig: {name}={v!r} must be an int >= 1")


# Named presets.  tiny: the course's model (vocab = the 75 characters of models.data);
# small: nanoGPT's "baby GPT" shape for Shakespeare-char, with GQA; gpt-tiny: tiny's
# shape as Megatron's GPT.  The large GPTs are the shapes of Korthikanti et al. 2022,
# Table 3 (22B, 175B = GPT-3, Brown et al. 2020 Table 2.1; 530B, 1T), with Megatron-LM's
# default dropout 0.1 on attention and hidden states (megatron/training/arguments.py,
# --attention-dropout / --hidden-dropout), which Table 2's activation counts assume;
# built on the meta device for estimates and the planner.
_GPT_BIG = dict(arch="gpt", vocab_size=51200, seq_len=2048, tie_embeddings=True,
                dtype="bfloat16", dropout=0.1)
_LLAMA2 = dict(arch="llama", vocab_size=32000, seq_len=4096, dtype="bfloat16", norm_eps=1e-5)
_LLAMA3 = dict(arch="llama", vocab_size=128256, seq_len=8192, dtype="bfloat16", norm_eps=1e-5,
               rope_theta=500000.0)
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=75, seq_len=64, n_layer=2, n_head=4, d_model=64, d_ff=192),
    "small": dict(vocab_size=75, seq_len=256, n_layer=6, n_head=8, n_kv_head=4, d_model=384,
                  d_ff=1024, dropout=0.1),
    "gpt-tiny": dict(arch="gpt", vocab_size=75, seq_len=64, n_layer=2, n_head=4, d_model=64,
                     tie_embeddings=True),
    "gpt-22b": dict(_GPT_BIG, n_layer=48, n_head=64, d_model=6144),
    "gpt3-175b": dict(_GPT_BIG, n_layer=96, n_head=96, d_model=12288),
    "gpt-530b": dict(_GPT_BIG, n_layer=105, n_head=128, d_model=20480),
    "gpt-1t": dict(_GPT_BIG, n_layer=128, n_head=160, d_model=25600),
    # Llama 2 (Touvron et al. 2023, "Llama 2", Table 1: context 4096, GQA for 70B; shapes
    # from each model's params.json, meta-llama/llama on GitHub: dim, n_layers, n_heads,
    # n_kv_heads, vocab 32000, norm_eps 1e-5; the MLP width by llama/model.py's rule,
    # 256 * ceil(ffn_dim_multiplier * 2/3 * 4 dim / 256), multiplier 1.3 for 70B with
    # multiple_of 4096: 11008, 13824, 28672, as the Hugging Face configs'
    # intermediate_size) and Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models",
    # Table 3: 8B 32 layers, h 4096, FFN 14336, 32 heads, 8 key/value heads; 70B 80
    # layers, h 8192, FFN 28672, 64 heads, 8 key/value heads; vocabulary 128,000 ->
    # 128256 with the special tokens, RoPE base 500,000; context 8192 as pre-trained,
    # meta-llama/Meta-Llama-3-8B config.json).  bf16, no dropout, untied head.
    "llama2-7b": dict(_LLAMA2, n_layer=32, n_head=32, d_model=4096, d_ff=11008),
    "llama2-13b": dict(_LLAMA2, n_layer=40, n_head=40, d_model=5120, d_ff=13824),
    "llama2-70b": dict(_LLAMA2, n_layer=80, n_head=64, n_kv_head=8, d_model=8192, d_ff=28672),
    "llama3-8b": dict(_LLAMA3, n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336),
    "llama3-70b": dict(_LLAMA3, n_layer=80, n_head=64, n_kv_head=8, d_model=8192,
                       d_ff=28672),
}


def get_config(preset: str = "tiny", **overrides) -> ModelConfig:
    """The named preset, with ``overrides`` (e.g. ``n_layer=4``) applied."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {list(PRESETS)}")
    return ModelConfig(**{**PRESETS[preset], **overrides})


def build_model(cfg: "ModelConfig | str", seed: int = 0):
    """The module for ``cfg.arch``: ``Llama(cfg, seed)`` or ``GPT(cfg, seed)`` (same call
    signature: ``model(idx, targets) -> (logits, loss)``)."""
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    if cfg.arch == "gpt":
        from .gpt import GPT
        return GPT(cfg, seed=seed)
    from .llama import Llama
    return Llama(cfg, seed=seed)


@dataclass(frozen=True)
class ParamCount:
    """Parameters of ``build_model(cfg)``: counted on the module, by formula, and by Megatron."""
    module: int                     # sum(p.numel()) over the real module built on "meta"
    terms: dict                     # our closed form, term by term (sums to ``module``)
    megatron: int                   # Narayanan et al. 2021 eq. 2 with the same l, h, V, s
    differences: dict               # why module - megatron is what it is (sums to it)

    def explain(self) -> str:
        lines = [f"module (meta device)   {self.module:>18,}",
                 f"Megatron eq. 2 (GPT)   {self.megatron:>18,}"]
        lines += [f"  {k:<36}{v:>+18,}" for k, v in self.differences.items() if v]
        return "\n".join(lines)


def param_count(cfg: ModelConfig | str) -> ParamCount:
    """Count ``build_model(cfg)``'s parameters three ways: the module itself (built on
    the meta device, so 175B parameters cost no memory), our closed form, and Megatron's
    eq. 2 for a GPT of the same shape, with the difference explained term by term."""
    import torch

    from ..sim_mesh.estimates import megatron_params

    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    with torch.device("meta"):
        model = build_model(cfg)
    module = sum(p.numel() for p in model.parameters())        # shared (tied) tensors once

    l, h, V, s, f = cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.d_ff
    megatron = round(megatron_params(l, h, V, s))
    untied = 0 if cfg.tie_embeddings else V * h
    if cfg.arch == "gpt":
        terms = {
            "embeddings (V h + s h)": V * h + s * h,
            "attention (l (4 h^2 + 4 h)), q k v o with biases": l * (4 * h * h + 4 * h),
            "GeLU MLP (l (2 h d_ff + d_ff + h))": l * (2 * h * f + f + h),
            "LayerNorms (l 4 h + 2 h)": l * 4 * h + 2 * h,
            "lm head (V h, untied)": untied,
        }
        differences = {
            "MLP: d_ff != 4h: l (2 h + 1)(d_ff - 4 h)": l * (2 * h + 1) * (f - 4 * h),
            "final LayerNorm (eq. 2 omits it): +2 h": 2 * h,
            "untied lm head: +V h": untied,
        }
        if cfg.embed_norm:                   # BLOOM's LayerNorm on the embeddings
            terms["embedding LayerNorm (2 h)"] = 2 * h
            differences["embedding LayerNorm (eq. 2 has none): +2 h"] = 2 * h
        if cfg.moe_experts:
            _moe_terms(cfg, terms, differences, "GeLU MLP (l (2 h d_ff + d_ff + h))",
                       "MLP: d_ff != 4h: l (2 h + 1)(d_ff - 4 h)",
                       lambda w: 2 * h * w + w + h, 8 * h * h + 5 * h)
        return ParamCount(module=module, terms=terms, megatron=megatron,
                          differences=differences)
    kv = cfg.n_kv_head * cfg.head_dim
    terms = {
        "embedding (V h)": V * h,
        "attention (l (2 h^2 + 2 h kv))": l * (2 * h * h + 2 * h * kv),   # q, o; k, v
        "SwiGLU MLP (l 3 h d_ff)": l * 3 * h * f,                          # w1, w3, w2
        "RMSNorm weights (l 2 h + h)": l * 2 * h + h,                      # 2 per block, final
        "lm head (V h, untied)": untied,
    }
    differences = {
        "attention: GQA k, v of width kv < h": l * 2 * h * (kv - h),
        "MLP: SwiGLU 3 h d_ff vs GPT 8 h^2": l * (3 * h * f - 8 * h * h),
        "no biases; RMSNorm has no bias: -11 l h": -11 * l * h,       # 13 l h -> 2 l h
        "final RMSNorm (eq. 2 omits it): +h": h,
        "no position table (RoPE): -s h": -s * h,
        "untied lm head: +V h": untied,
    }
    if cfg.moe_experts:
        _moe_terms(cfg, terms, differences, "SwiGLU MLP (l 3 h d_ff)",
                   "MLP: SwiGLU 3 h d_ff vs GPT 8 h^2", lambda w: 3 * h * w, 8 * h * h)
    return ParamCount(module=module, terms=terms, megatron=megatron, differences=differences)


def _moe_terms(cfg, terms, differences, mlp_term, mlp_diff, mlp_of_width, gpt_mlp) -> None:
    """A MoE block's feed-forward (models/moe.py) in place of the dense MLP's terms: the
    router h E, E experts of width d_ff, the shared experts one MLP of n_s d_ff."""
    l, h, f, E, ns = cfg.n_layer, cfg.d_model, cfg.d_ff, cfg.moe_experts, cfg.moe_shared_experts
    moe = h * E + E * mlp_of_width(f) + (mlp_of_width(ns * f) if ns else 0)
    del terms[mlp_term], differences[mlp_diff]
    terms["MoE (l (h E + E mlp(d_ff) + mlp(n_s d_ff)))"] = l * moe
    differences["MoE: router, E experts, shared vs eq. 2's MLP"] = l * (moe - gpt_mlp)
