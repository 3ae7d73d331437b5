"""Weight-only quantization of the linear layers: int8 per output channel, int4 in groups.

    q = quantize_model(model, bits=8)            # a copy; every nn.Linear -> QuantizedLinear
    weight_bytes(model), weight_bytes(q)         # measured from the tensors
    quantization_error(model, q, idx, targets)   # loss / perplexity / logits change

Symmetric, round to nearest, scales in the weight's dtype (LLM.int8()'s vector-wise
absmax, Dettmers et al. 2022, sec. 3.1, without its outlier decomposition; grouped int4
as GPTQ / AWQ store it, Frantar et al. 2023, Lin et al. 2024, without their
error-compensating search):

    int8, per output row r:     s_r = max_j |W_rj| / 127,   q = round(W / s_r) in [-127, 127]
    int4, per row and group g:  s_rg = max_{j in g} |W_rj| / 7,  q in [-7, 7], two per byte

so |W - s q| <= s / 2 elementwise (the rounding), the bound the tests hold.  The
matmul is the reference one: dequantize the whole weight, then ``F.linear`` (the
arithmetic a fused kernel does tile by tile; what it saves is reading W from memory
in 1 or 1/2 byte per weight instead of 2 or 4: ``roofline.decode_step``).
Only weights are quantized; activations, the KV cache, norms and embeddings are not.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["QuantizedWeight", "quantize_weight", "dequantize", "QuantizedLinear",
           "quantize_model", "weight_bytes", "quantization_error", "BITS"]

BITS = (8, 4)


@dataclass
class QuantizedWeight:
    """A (out, in) weight as integers and scales."""
    data: torch.Tensor              # int8 (out, in); int4: uint8 (out, in / 2), two per byte
    scale: torch.Tensor             # (out, 1) for int8; (out, in / group_size) for int4
    bits: int
    group_size: int | None          # int4's group along the input features
    shape: tuple
    dtype: torch.dtype              # what dequantize returns

    @property
    def nbytes(self) -> int:
        """Bytes held: the integers and the scales."""
        return self.data.nbytes + self.scale.nbytes


def quantize_weight(w: torch.Tensor, bits: int = 8, group_size: int = 32) -> QuantizedWeight:
    """Quantize a (out, in) weight (module docstring)."""
    if bits not in BITS:
        raise ValueError(f"bits={bits!r}: weight-only quantization here is int8 (bits=8) or "
                         "grouped int4 (bits=4)")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_weight: a 2-d floating weight (out, in), got "
                         f"{tuple(w.shape)} {w.dtype}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"quantize_weight: the {tuple(w.shape)} weight holds inf or nan; its "
                         "absmax scale would turn every integer of the row into nan")
    out, inp = w.shape
    wf = w.detach().float()
    if bits == 8:
        scale = _stored_scale(wf.abs().amax(1, keepdim=True) / 127, w.dtype)  # (out, 1)
        q = torch.round(wf / scale.float()).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(q, scale, 8, None, (out, inp), w.dtype)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 \
            or group_size % 2 or inp % group_size:
        ok = [g for g in range(2, min(inp, 128) + 1, 2) if inp % g == 0]
        hint = f"e.g. {max((g for g in ok if g <= 32), default=ok[0])}" if ok else \
            "none exists: int4 packs two weights a byte, so in_features must be even; " \
            "quantize this layer with bits=8 (or skip it)"
        raise ValueError(f"group_size={group_size!r}: give an even int dividing the "
                         f"{inp} input features ({hint})")
    g = wf.view(out, inp // group_size, group_size)                         # (out, G, gs)
    scale = _stored_scale(g.abs().amax(-1) / 7, w.dtype)                    # (out, G)
    q = torch.round(g / scale.float()[..., None]).clamp(-7, 7).to(torch.int16) + 8   # 1..15
    q = q.view(out, inp).to(torch.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)                                 # (out, in / 2)
    return QuantizedWeight(packed, scale, 4, group_size, (out, inp), w.dtype)


def _stored_scale(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The absmax scale ``s`` (computed in float32) as stored, in ``dtype``: rounded UP to
    the next value ``dtype`` holds, never down, and at least its smallest positive value.
    Rounded to nearest, a scale below absmax / qmax puts the row's largest weight past
    qmax, where the clamp cuts it by more than s / 2; and in float16 the scale of a row
    of weights below 127 x 6.1e-5 is subnormal (down to 0 for a row below 3.8e-6, which
    quantized every weight to 0).  Measured on 300 seeded random weights (float16, bfloat16,
    float32; int8, int4; magnitudes 1e-7 .. 1e4): |W - s q| up to 43 s and 817 nonzero
    weights under a scale of 0 before, at most s / 2 and none now (tests/test_serve12.py
    holds the bound)."""
    ct = torch.promote_types(dtype, torch.float32)
    s = s.to(ct)
    low = s.to(dtype)
    up = torch.where(low.to(ct) < s, torch.nextafter(low, torch.full_like(low, math.inf)), low)
    fi = torch.finfo(dtype)
    return up.clamp_min(fi.tiny * fi.eps)       # the smallest subnormal: s > 0, q finite


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The (out, in) weight the integers and scales stand for, in ``qw.dtype`` (computed
    in float32, or float64 for float64 scales), on the integers' device."""
    out, inp = qw.shape
    ct = torch.promote_types(qw.scale.dtype, torch.float32)
    if qw.bits == 8:
        return (qw.data.to(ct) * qw.scale.to(ct)).to(qw.dtype)
    q = torch.empty(out, inp, dtype=torch.int16, device=qw.data.device)
    q[:, 0::2] = (qw.data & 0xF).to(torch.int16)
    q[:, 1::2] = (qw.data >> 4).to(torch.int16)
    g = (q - 8).to(ct).view(out, inp // qw.group_size, qw.group_size)
    return (g * qw.scale.to(ct)[..., None]).view(out, inp).to(qw.dtype)


class QuantizedLinear(nn.Module):
    """``nn.Linear`` with a quantized weight: y = x dequantize(W)^T + b (the reference
    dequantize-matmul).  Inference only: the weight is not a parameter.  The integers
    (``qdata``) and the scales (``scale``) are buffers, so ``state_dict()`` holds them and
    ``.to(device)`` / ``.to(dtype)`` / ``.double()`` move and cast them as torch does a
    module's buffers (the integers keep their dtype; the scales, and so the dequantized
    weight, take the new floating dtype)."""

    def __init__(self, linear: nn.Linear, bits: int = 8, group_size: int = 32):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qw = quantize_weight(linear.weight, bits, group_size)
        self.bits, self.group_size = qw.bits, qw.group_size
        self.register_buffer("qdata", qw.data)
        self.register_buffer("scale", qw.scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                   requires_grad=False)

    @property
    def qweight(self) -> QuantizedWeight:
        """The weight as integers and scales (the buffers, in their current dtype)."""
        return QuantizedWeight(self.qdata, self.scale, self.bits, self.group_size,
                               (self.out_features, self.in_features), self.scale.dtype)

    def forward(self, x):
        return F.linear(x, dequantize(self.qweight), self.bias)

    def extra_repr(self) -> str:
        q = self.qweight
        g = f", group_size={q.group_size}" if q.group_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"int{q.bits}{g}"


def quantize_model(model: nn.Module, bits: int = 8, group_size: int = 32,
                   skip=()) -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` (but those named in ``skip`` and a
    head tied to the embedding, whose table the embedding also reads) quantized."""
    from ..parallel.dist_tensor import DistTensor
    if any(isinstance(p, DistTensor) for p in model.parameters()):
        raise TypeError("quantize_model: the model holds DistTensors; quantize the one-device "
                        "model, then lay it out")
    skip = (skip,) if isinstance(skip, str) else tuple(skip)
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    unknown = [n for n in skip if n not in names]
    if unknown:
        raise ValueError(f"quantize_model(skip={list(skip)!r}): {unknown} name no nn.Linear of "
                         f"the model; give names from {sorted(names)[:6]}...")
    q = copy.deepcopy(model).eval()
    tied = {id(p) for n, m in q.named_modules() if isinstance(m, nn.Embedding)
            for p in m.parameters()}
    # nn.MultiheadAttention reads its out_proj's .weight itself (F.multi_head_attention_
    # forward), so that Linear stays float, as torch.ao.quantization leaves it
    # (NonDynamicallyQuantizableLinear)
    keep = (nn.modules.linear.NonDynamicallyQuantizableLinear,)
    for name, mod in list(q.named_modules()):
        if isinstance(mod, nn.Linear) and not isinstance(mod, keep) and name not in skip \
                and id(mod.weight) not in tied:
            parent, _, leaf = name.rpartition(".")
            try:
                ql = QuantizedLinear(mod, bits, group_size)
            except ValueError as e:
                raise ValueError(f"quantize_model: layer {name!r}: {e}") from None
            setattr(q.get_submodule(parent) if parent else q, leaf, ql)
    return q


def weight_bytes(model: nn.Module) -> dict:
    """Bytes of the linear layers' weights, measured on the tensors: {"linear": ...,
    "other": every other parameter, "total": ...}."""
    lin = other = 0
    seen = set()
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            lin += mod.qweight.nbytes
            seen.add(id(mod.qweight))
        elif isinstance(mod, nn.Linear):
            lin += mod.weight.nbytes
            seen.add(id(mod.weight))
    for p in model.parameters():
        if id(p) not in seen:
            other += p.nbytes
            seen.add(id(p))
    return {"linear": lin, "other": other, "total": lin + other}


@torch.no_grad()
def quantization_error(model: nn.Module, qmodel: nn.Module, idx, targets) -> dict:
    """Measured on one batch: each model's loss and perplexity, their change, and the
    logits' largest absolute and relative (to the largest logit) error."""
    modes = model.training, qmodel.training
    model.eval()
    qmodel.eval()
    try:
        z, loss = model(idx, targets)
        zq, loss_q = qmodel(idx, targets)
    finally:
        model.train(modes[0])
        qmodel.train(modes[1])
    err = (zq - z).abs().max().item()
    return {"loss": loss.item(), "loss_quantized": loss_q.item(),
            "loss_delta": loss_q.item() - loss.item(),
            "perplexity": math.exp(loss.item()), "perplexity_quantized": math.exp(loss_q.item()),
            "logits_max_abs_error": err, "logits_rel_error": err / z.abs().max().item(),
            "argmax_agreement": (zq.argmax(-1) == z.argmax(-1)).float().mean().item()}
