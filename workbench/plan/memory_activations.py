"""Activations saved for backward: one layer's (:func:`layer_activation_bytes`; with a
MoE's own dispatch, :func:`_dense_moe`; sequence-parallel inputs re-gathered or kept,
:func:`_regather`), the embedding's and the head's (:func:`_edge_activation_bytes`) and
the micro-batches a schedule holds at once (:func:`in_flight`).  "Module docstring"
below: :mod:`.memory`'s."""
from __future__ import annotations

from .layout import SCHEDULES
from .memory_states import _check, _is_int


def layer_activation_bytes(cfg, b: int, tp: int, sp: bool, recompute: str,
                           attention: str = "materialized", regather: bool = True,
                           dense_moe: "tuple[int, int] | None" = None) -> float:
    """Activation bytes one layer keeps for backward on one rank (module docstring).
    ``attention="flash"``: a fused kernel keeps no (s x s) matrices, only its fp32
    log-sum-exp per row (Dao et al. 2022), 4 a s b bytes, instead of 5as^2b.
    ``regather=False`` (torchtitan's DTensor sequence parallelism keeps the all-gathered
    input of each column-parallel group, no re-gather in backward:
    ``llama_layer.backward_ops``): without recompute those inputs count whole, 2 s b h
    each, not 2 s b h / t."""
    fn = "layer_activation_bytes"
    _check(fn, "recompute", recompute, recompute in ("none", "selective", "full", "op"),
           "use 'none', 'selective', 'full' or 'op'")
    _check(fn, "attention", attention, attention in ("materialized", "flash"),
           "use 'materialized' or 'flash'")
    _check(fn, "b", b, _is_int(b, 1), "give the micro-batch, an int >= 1")
    _check(fn, "tp", tp, _is_int(tp, 1), "give the tensor-parallel ranks, an int >= 1")
    _check(fn, "sp", sp, isinstance(sp, bool), "give True or False")
    _check(fn, "regather", regather, isinstance(regather, bool), "give True or False")
    if getattr(cfg, "moe_experts", 0):
        from .moe_cost import activation_bytes as moe_activation_bytes
        return moe_activation_bytes(cfg, b, tp, sp, recompute, regather, dense_moe)
    if cfg.arch == "llama":
        from .llama_layer import activation_bytes
        return activation_bytes(cfg, b, tp, sp, recompute, regather)
    s, h, a, f = cfg.seq_len, cfg.d_model, cfg.n_head, cfg.d_ff
    drop = cfg.dropout > 0
    t = tp
    if recompute == "op":
        raise ValueError("layer_activation_bytes: recompute='op' (torchtitan's op-level "
                         "selective checkpointing) is modeled for Llama blocks only")
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    # Table 2's pieces (f = 4h): inside the TP region: Q, K 4sbh, V 2sbh, the output
    # projection's input 2sbh, the MLP's GeLU input and fc2 input 4sbf; outside: the
    # QKV and fc1 inputs 2sbh each, two LayerNorm inputs 4sbh, two dropout masks sbh each.
    inside = 8 * s * b * h + 4 * s * b * f
    outside = (8 + (2 if drop else 0)) * s * b * h
    gathered = 0.0
    if sp and t > 1 and not regather:        # the QKV and fc1 inputs kept gathered
        outside -= 4 * s * b * h
        gathered = 4 * s * b * h
    if recompute == "selective":
        core = 0.0
    elif attention == "flash":
        core = 4 * a * s * b
    else:
        core = (5 if drop else 2) * a * s * s * b     # softmax out, dropout mask + out
    return (inside + core) / t + outside / (t if sp else 1) + gathered


def _regather(cfg, lay) -> bool:
    """Whether a layer's sequence-parallel inputs are re-gathered in backward (Megatron-LM,
    this library's recipe) or kept gathered: torchtitan's DTensor TP
    (``framework="fsdp"``, ``llama_layer.backward_ops``), a MoE block's attention as a
    dense block's (``moe_cost.activation_bytes``)."""
    return lay.engine != "fsdp"


def in_flight(schedule: str, pp: int, m: int, v: int, stage: int) -> float:
    """Micro-batches of a stage's activations held at once, in units of one micro-batch
    through all of the stage's n_layer / pp layers.

    GPipe: m (Huang et al. 2019).  1F1B: min(pp - stage, m) (Narayanan et al. 2021, sec.
    2.2.1: stage s warms up with pp - s - 1 forwards, then runs one more before its first
    backward).  Interleaved with v chunks (Megatron-LM's
    ``forward_backward_pipelining_with_interleaving``): 2 (pp - stage - 1) + (v - 1) pp
    warm-up chunk forwards plus one, at most the m v there are (all of them when m ==
    pp), each chunk 1/v of the stage's layers; on the first stage that is pp + (pp - 1)
    / v micro-batches, Korthikanti et al. 2022 sec. 4.2.3's L (1 + (p - 1) / (p v))
    layers of activations."""
    _check("in_flight", "schedule", schedule, schedule in SCHEDULES, f"use one of {SCHEDULES}")
    for name, v in (("pp", pp), ("m", m), ("v", v)):
        _check("in_flight", name, v, _is_int(v, 1), "give an int >= 1")
    _check("in_flight", "stage", stage, _is_int(stage, 0) and stage < pp,
           f"give a pipeline stage in 0 .. pp - 1 = {pp - 1}")
    _check("in_flight", "v", v, (v > 1) == (schedule == "interleaved_1f1b"),
           "v > 1 model chunks per device with schedule='interleaved_1f1b' only, v = 1 "
           "with '1f1b' or 'gpipe' (as Layout)")
    if schedule == "interleaved_1f1b" and m % pp:
        _check("in_flight", "m", m, False, f"interleaved 1F1B needs m a multiple of "
               f"pp={pp} (Megatron-LM's rule, as Layout)")
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b":
        chunks = m * v if m == pp else min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v)
        return chunks / v
    return float(min(pp - stage, m))


def _edge_activation_bytes(cfg, b: int, tp: int, sp: bool, stage: int, pp: int,
                           held: float, head_held: int, engine: "str | None" = None) -> float:
    s, h, V = cfg.seq_len, cfg.d_model, cfg.vocab_size
    t_sp = tp if sp else 1
    out = 0.0
    if stage == 0:
        # the lookups' saved indices: the word embedding's int64 token ids (F.embedding
        # keeps them; with tp > 1 Megatron-LM's VocabParallelEmbedding looks up a masked
        # copy and zeroes the out-of-range rows in place, keeping their bool mask:
        # megatron/core/tensor_parallel/layers.py, VocabParallelEmbedding.forward), and a
        # GPT's learned position table its int64 position ids: (b, s) laid out as the ids
        # by this library's recipes (``engine`` "workbench": models.gpt.stage_forward's
        # ``positions``), one row of s elsewhere (Megatron-LM's get_ltor_masks_and_
        # position_ids expands one arange over the batch).  17 KB of the toy GPT's 214 KB
        # a micro-batch at tp 8, sp (s 512, b 2), which the dry run counted (stage 0
        # 1.089x the estimate)
        pos = 0 if cfg.arch == "llama" else 8 * s * (b if engine == "workbench" else 1)
        out += (8 * s * b + (s * b if tp > 1 else 0) + pos) * held
    if stage == 0 and cfg.dropout > 0:
        out += s * b * h / t_sp * held                 # embedding dropout mask, 1 byte
    if stage == 0 and getattr(cfg, "embed_norm", False):
        out += 2 * s * b * h / t_sp * held             # the embedding LayerNorm's input
    if stage == pp - 1:
        # final-LN input, head input, fp32 logits, for each micro-batch between its
        # forward and backward through the head: 1 with 1F1B schedules, m with GPipe
        out += (4 * s * b * h / t_sp + 4 * s * b * V / tp) * head_held
    return out


def _dense_moe(tcfg, lay) -> "tuple[int, int] | None":
    """A MoE run by the model's own dispatch: its (sequences, tokens each) on a rank
    (``moe_cost.dense_groups``; ``tcfg`` the model at s / cp), else None."""
    from .moe_cost import dense_groups
    return dense_groups(tcfg, lay)
