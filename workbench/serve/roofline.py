"""Prefill and decode on the roofline, as plain data: why decoding is memory-bound.

    step_cost(cfg, batch=1, new_tokens=512, context=0)      # prefill a 512-token prompt
    step_cost(cfg, batch=1, new_tokens=1, context=512)      # one decode step after it
    step_cost(cfg, batch=1, new_tokens=1, context=512, weight_bits=4)   # int4 weights

One forward step of ``batch`` sequences, each adding ``new_tokens`` after ``context``
cached ones (Pope et al. 2022, "Efficiently Scaling Transformer Inference", sec. 2-3;
Kaplan et al. 2020, Table 1, for 2 FLOPs per weight per token):

    FLOPs  = 2 P tokens                                  every linear (P = their weights,
                                                         lm head included), tokens = B x new
           + 4 n_layer n_head hd x pairs                 q k^T and p v, 2 FLOPs per
                                                         multiply-add; pairs = B x (new x
                                                         context + new (new + 1) / 2), causal
           + 2 P (quantized weights only)                dequantize: one multiply and one
                                                         convert per weight per step
    bytes  = P x bits / 8 + scales                       every weight read once per step
           + B x context x kv_bytes_per_token            the cache read
           + B x new x kv_bytes_per_token                the new keys and values written
    time   = workbench.sim_mesh.cost.compute_time(FLOPs, bytes, profile, dtype, "matmul")

Activations (B x new x h per layer) and launch overheads are left out: at decode they
are small against the weights, and a CUDA-graph / graph-mode server hides launches; say
so where a number is shown.  Prefill's intensity grows with B x new (every weight read
once serves every token), decode's with B only: one token per sequence reads all P
weights and the whole cache, about 2 B FLOPs per weight byte in bf16, far under the
ridge of any accelerator (``ridge("h100")``: 269 FLOP/B for bf16 matmuls).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..sim_mesh.cost import explain_compute
from ..sim_mesh.profiles import get_profile
from .kv_cache import kv_bytes_per_token

__all__ = ["StepCost", "step_cost", "decode_vs_prefill", "linear_weights", "resident_weights",
           "resident_scales", "ridge"]


def _linear_shapes(cfg) -> list[tuple[int, int]]:
    from ..models.config import build_model
    if cfg.moe_experts:
        raise NotImplementedError(
            f"serve pricing of a mixture of experts (moe_experts={cfg.moe_experts}): the "
            "experts are not nn.Linear modules, so the weights counted here would leave them "
            "out (and a token multiplies by only moe_topk of them); price the dense model, "
            "or plan the MoE with `python -m workbench plan`")
    with torch.device("meta"):
        model = build_model(cfg)
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)]


def linear_weights(cfg) -> int:
    """P: the weights of every linear a token's forward multiplies by (the lm head
    included, tied or not), counted on the model built on the meta device."""
    return sum(o * i for o, i in _linear_shapes(cfg))


def resident_weights(cfg) -> tuple[int, int]:
    """(quantizable, other): the parameters a server holds, each tensor once, counted on
    the model built on the meta device.  Quantizable: every ``nn.Linear`` weight but a
    head tied to the embedding (``quantize.quantize_model``'s choice); other: everything
    else (embedding tables, the tied head with them, norms, biases, a position table).
    Their sum is ``param_count(cfg).module``."""
    from ..models.config import build_model
    _linear_shapes(cfg)                 # the same refusal of a mixture of experts
    with torch.device("meta"):
        model = build_model(cfg)
    tied = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
            for p in m.parameters()}
    lin = {id(m.weight): m.weight.numel() for m in model.modules()
           if isinstance(m, nn.Linear) and id(m.weight) not in tied}
    seen, other = set(lin), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            other += p.numel()
    return sum(lin.values()), other


def resident_scales(cfg, bits: int, group_size: int = 32) -> int:
    """The scales ``quantize.quantize_model(bits, group_size)`` stores beside the
    quantizable weights of :func:`resident_weights` (each in the weight's dtype): int8 one
    per output row, int4 one per row and group of ``group_size`` inputs (``quantize``)."""
    from ..models.config import build_model
    if bits not in (8, 4):
        raise ValueError(f"resident_scales(bits={bits!r}): give 8 or 4")
    with torch.device("meta"):
        model = build_model(cfg)
    tied = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
            for p in m.parameters()}
    shapes = {id(m.weight): m.weight.shape for m in model.modules()
              if isinstance(m, nn.Linear) and id(m.weight) not in tied}
    return sum(o if bits == 8 else o * (i // group_size) for o, i in shapes.values())


def ridge(profile="h100", dtype="bfloat16") -> float:
    """FLOPs per byte where a matmul kernel turns from memory- to compute-bound on the
    profile: its effective peak over its effective bandwidth."""
    p = get_profile(profile)
    t = explain_compute(1.0, 1.0, p, dtype, "matmul", launches=0)
    return t["memory"] / t["compute"]


@dataclass(frozen=True)
class StepCost:
    """One forward step (module docstring), plain data."""
    phase: str                      # "decode" (1 new token after a context) or "prefill"
    batch: int
    new_tokens: int
    context: int
    weight_bits: int
    flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    bytes: float
    intensity: float                # FLOPs per byte
    seconds: float                  # on the profile's roofline
    bound: str                      # "compute" or "memory"
    profile: str

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / (self.batch * self.new_tokens)

    def to_dict(self) -> dict:
        return asdict(self)


def step_cost(cfg, *, batch: int, new_tokens: int, context: int, weight_bits: int | None = None,
              group_size: int = 32, profile="h100", dtype="bfloat16",
              kv_dtype=None) -> StepCost:
    """One step's FLOPs, bytes and time (module docstring).  ``dtype``: what the matmuls
    run in; ``weight_bits`` the bits a weight is stored in: None the width of ``dtype``
    (16 for bf16, 32 for float32), 16 or 32 (unquantized), 8 (int8, a bf16 scale per
    output row) or 4 (int4, a bf16 scale per ``group_size``); ``kv_dtype`` the cache's
    (None: ``dtype``)."""
    from ..models.config import get_config
    from .kv_cache import _dtype_bytes
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    for name, v in (("dtype", dtype), ("kv_dtype", kv_dtype)):
        try:
            width = 8 * _dtype_bytes(v)
        except (AttributeError, TypeError):
            raise ValueError(f"step_cost({name}={v!r}): give a torch dtype name, e.g. "
                             "'bfloat16' or 'float32'") from None
    width = 8 * _dtype_bytes(dtype)
    if weight_bits is None and width not in (16, 32):
        # 8 would price int8 weight-only quantization (scales, dequantize), 64 no weights
        raise ValueError(f"step_cost(dtype={dtype!r}): weights stored in {width} bits are not "
                         "priced by default; give weight_bits (32, 16, 8 for int8 with a "
                         "bf16 scale per row, 4 for int4 with a scale per group_size)")
    weight_bits = width if weight_bits is None else weight_bits
    for name, v, least in (("batch", batch, 1), ("new_tokens", new_tokens, 1),
                           ("context", context, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"step_cost: {name}={v!r}; give an int >= {least}")
    if isinstance(weight_bits, bool) or weight_bits not in (32, 16, 8, 4):
        raise ValueError(f"weight_bits={weight_bits!r}: 32 (float32), 16 (bf16), 8 (int8) or "
                         "4 (int4), or None for the width of dtype")
    if context + new_tokens > cfg.seq_len:
        raise ValueError(f"step_cost: context {context} + new_tokens {new_tokens} = "
                         f"{context + new_tokens} > seq_len={cfg.seq_len}, the model's longest "
                         "context; price fewer tokens, or a model with a longer seq_len")
    shapes = _linear_shapes(cfg)
    P = sum(o * i for o, i in shapes)
    tokens = batch * new_tokens
    pairs = batch * (new_tokens * context + new_tokens * (new_tokens + 1) // 2)
    flops = 2 * P * tokens + 4 * cfg.n_layer * cfg.n_head * cfg.head_dim * pairs
    if weight_bits >= 16:                    # unquantized: no dequantize, no scales
        wbytes = P * weight_bits // 8
    else:
        flops += 2 * P
        scales = sum(o if weight_bits == 8 else o * -(-i // group_size) for o, i in shapes)
        wbytes = P * weight_bits / 8 + 2 * scales                           # bf16 scales
    per_tok = kv_bytes_per_token(cfg, kv_dtype)
    kv_read, kv_write = batch * context * per_tok, tokens * per_tok
    nbytes = wbytes + kv_read + kv_write
    p = get_profile(profile)
    t = explain_compute(float(flops), float(nbytes), p, dtype, "matmul", launches=0)
    # one new token after a context is a decode step; anything else a prompt (or a chunk of
    # one, chunked prefill) being prefilled
    phase = "decode" if new_tokens == 1 and context > 0 else "prefill"
    return StepCost(phase, batch, new_tokens, context,
                    weight_bits, float(flops), float(wbytes), float(kv_read), float(kv_write),
                    float(nbytes), flops / nbytes, t["seconds"], t["bound"], p.name)


def decode_vs_prefill(cfg, *, batch: int = 1, prompt: int = 512, profile="h100",
                      weight_bits: int | None = None) -> list[StepCost]:
    """Prefill of ``prompt`` tokens, then the first decode step after it."""
    return [step_cost(cfg, batch=batch, new_tokens=prompt, context=0, profile=profile,
                      weight_bits=weight_bits),
            step_cost(cfg, batch=batch, new_tokens=1, context=prompt, profile=profile,
                      weight_bits=weight_bits)]
