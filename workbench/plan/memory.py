"""Bytes on each rank of a layout: model states by ZeRO stage, activations by case.

Model states (Rajbhandari et al. 2020, "ZeRO", sec. 3.1 and 5): mixed-precision Adam
keeps 2 bytes of 16-bit weights, 2 of 16-bit gradients and K = 12 of optimizer state
(fp32 master weights, momentum, variance) per parameter; ZeRO stage 1 splits the
optimizer state over the N_d data-parallel ranks, stage 2 also the gradients, stage 3
also the weights:  (4 + K) psi,  4 psi + K psi / N_d,  2 psi + (2 + K) psi / N_d,
(4 + K) psi / N_d: ``params``, ``grads`` and ``optimizer`` are exactly these (ZeRO
Table 1).  What a framework holds beyond them is ``buffers``: at stage 3 the working
copies (the gathered 16-bit weights of the module computing and of those prefetched
after it, :func:`zero3_gathered_numel`, and the 16-bit gradient of one layer before
its reduce-scatter, an assumption not measured); Megatron-LM's fp32 gradient buffer
for bf16 models, 2 bytes per parameter beyond ZeRO's 16-bit gradients
(``frameworks.grad_buffer_extra_bytes``).  Here psi is the
parameters a rank holds after tensor and pipeline parallelism (Megatron's split:
column-parallel matrices and their biases / t, row-parallel biases and LayerNorms
replicated; vocabulary-parallel embedding V h / t on the first stage, learned positions
s h whole; the tied head's copy of the word embedding, V h / t, on the last stage when
pp > 1, as Megatron-LM does).

Activations per layer (Korthikanti et al. 2022, Table 2, 16-bit values, derived in
their sec. 4.1): sbh(34 + 5as/h) without parallelism; sbh(10 + 24/t + 5as/(ht)) with
tensor parallelism; sbh(34/t + 5as/(ht)) with sequence parallelism too; selective
recompute drops the 5as/h term; full recompute keeps the layer input, 2 sbh
(2 sbh / t with sequence parallelism, whose layer input is sequence-sharded).  The same
accounting with d_ff = f instead of 4h (the MLP's 19 sbh is 3 sbh + 4 sbf) and
without dropout (no 1-byte masks, no separate dropout output: 34 -> 32 sbh,
5as^2b -> 2as^2b) gives :func:`layer_activation_bytes`.  Times the micro-batches a
stage holds at once (:func:`in_flight`), plus the first stage's embedding dropout
mask (and the input of its LayerNorm with ``cfg.embed_norm``, BLOOM's, 2 sbh) and the
last stage's final-LayerNorm and head inputs (2 sbh each) and fp32 logits for the loss
(4 s b V / t), counted the same way; DeepSpeed's pipeline engine also
keeps each in-flight micro-batch's output as a 1/t partition, 2 sbh / t, and on the
first and last stages the loaded inputs of each of its pipe buffers
(``plan.deepspeed_pipe_memory``).

``comm_buffers``: the communication library's device buffers for the communicators
the layout creates (NCCL's per channel and peer, HCCL's per communicator:
``comm_memory``), given the hardware's profile.

``workspace``: what is live at a rank's peak beyond the saved activations and the
buffers (:func:`workspace_bytes`, its terms :func:`workspace_terms`): the loss's fp32
working copies on the last stage, or the layers' backward at a layer's first weight
gradient (the layer a recompute re-runs, the gradients live then that the states do not
hold, less the head's tensors its backward freed); ``total`` counts it, so ``fits`` asks
for the peak, not only the resident states and saved tensors.

A Llama (``arch="llama"``): its block's parameters and activations are
``llama_layer``'s (GQA's narrower k and v, SwiGLU's three matrices, no biases, RMSNorm
weights only); no position table on the first stage, a final RMSNorm of h and the
untied head's V h / t on the last.
"""
from __future__ import annotations

from functools import lru_cache

from . import bf16_optimizer as _bf16
from . import deepspeed_pipe_memory as _ds_pipe
from . import context_cost as _cc
from . import ep_cp as _ep_cp
from . import in_flight_peak as _peak
from . import recompute_chunks as _chunks
from .comm_memory import comm_buffer_bytes
from .frameworks import grad_buffer_extra_bytes, loss_extra_bytes
from .layout import SCHEDULES, Cluster, Layout, attention_for, check_layout
from ..sim_mesh.profiles import get_profile

__all__ = ["memory_margin", "model_state_bytes", "workspace_bytes", "workspace_terms",
           "stage_workspace_terms", "workspace_assumptions",
           "zero3_gathered_numel",
           "zero3_modules", "stage_params", "layer_activation_bytes", "in_flight",
           "stage_memory", "K_ADAM"]

K_ADAM = 12          # bytes of optimizer state per parameter (ZeRO sec. 3.1)


def _check(fn, name, v, ok, fix):
    """A clear error for an argument these public functions were given (a typo here
    read as another case: recompute="Full" as "none", zero=4 as 3, stage=-1 as a
    stage)."""
    if not ok:
        raise ValueError(f"{fn}: {name}={v!r}; {fix}")


def _is_int(v, lo):
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _is_number(v):
    """A real number that is not a bool (nan fails every comparison, so ``>= 0`` too)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def model_state_bytes(psi: float, dp: int, zero: int, k: int = K_ADAM) -> dict:
    """{"params", "grads", "optimizer"} bytes per rank for ``psi`` parameters under ZeRO
    ``zero`` over ``dp`` ranks (ZeRO Figure 1: psi=7.5e9, N_d=64 -> 120, 31.4, 16.6,
    1.875 GB for stages 0-3)."""
    _check("model_state_bytes", "zero", zero, zero in (0, 1, 2, 3) and _is_int(zero, 0),
           "ZeRO stages are 0, 1, 2 or 3")
    _check("model_state_bytes", "dp", dp, _is_int(dp, 1), "give the data-parallel ranks, "
           "an int >= 1")
    _check("model_state_bytes", "psi", psi, _is_number(psi) and psi >= 0,
           "give the parameters, a number >= 0")
    _check("model_state_bytes", "k", k, _is_number(k) and k >= 0,
           f"give the optimizer's bytes per parameter, a number >= 0 (Adam: {K_ADAM})")
    return {"params": 2 * psi / (dp if zero >= 3 else 1),
            "grads": 2 * psi / (dp if zero >= 2 else 1),
            "optimizer": k * psi / (dp if zero >= 1 else 1)}


def layer_params(cfg, tp: int) -> float:
    """Parameters of one layer on one tensor-parallel rank (Llama: ``llama_layer``; a MoE:
    all but its routed experts, which ``ep_cp.expert_states`` counts over ep)."""
    _check("layer_params", "tp", tp, _is_int(tp, 1), "give the tensor-parallel ranks, an "
           "int >= 1")
    if getattr(cfg, "moe_experts", 0):
        from .moe_cost import dense_layer_params
        return dense_layer_params(cfg, tp)
    if cfg.arch == "llama":
        from .llama_layer import layer_params as llama_params
        return llama_params(cfg, tp)
    h, f = cfg.d_model, cfg.d_ff
    sharded = 4 * h * h + 2 * h * f + 3 * h + f      # q,k,v,o; fc1, fc2; q,k,v and fc1 bias
    return sharded / tp + 6 * h                       # o and fc2 bias, 2 LayerNorms (w, b)


def zero3_gathered_numel(numels, prefetch: int) -> int:
    """Peak elements of gathered parameters ZeRO-3 holds over one forward and backward
    of modules of ``numels`` elements (forward order): the module computing and the ones
    after it (before it, in backward) whose gathers were issued while fewer than
    ``prefetch`` elements were ahead: DeepSpeed's ``PartitionedParameterCoordinator.
    fetch_sub_module`` (deepspeed/runtime/zero/partitioned_param_coordinator.py) pops
    its trace's parameter queue while ``numel_prefetching`` < min(stage3_max_live_
    parameters - available, ``stage3_prefetch_bucket_size``), the latter 5e7 elements by
    default (deepspeed/runtime/zero/config.py); as ``strategies.zero3``'s ledger counts.
    The tied embedding counts wherever it is gathered."""
    return _gathered_numel(tuple(numels), prefetch)


@lru_cache(maxsize=256)
def _gathered_numel(numels: tuple, prefetch) -> int:
    """:func:`zero3_gathered_numel` (cached: a search asks it for every ZeRO-3 candidate,
    whose modules differ only in tp, dp and the stage)."""
    best = 0
    for seq in (list(numels), list(numels)[::-1]):
        k = len(seq)
        for i, n in enumerate(seq):
            tot, ahead = n, 0
            for j in range(i + 1, k):       # by index: a slice would copy the rest each time
                if ahead >= prefetch:
                    break
                m = seq[j]
                tot += m
                ahead += m
            best = max(best, tot)
    return best


def zero3_modules(cfg, tp: int, pp: int, stage: int, dp: int,
                  layers: "int | None" = None) -> list[int]:
    """Elements of each module ZeRO-3 gathers on a rank of ``stage``, forward order (GPT:
    word and position embeddings (and their LayerNorm, ``embed_norm``); per layer LN, q,
    k, v, o, LN, fc1, fc2; final LN; the head's tied copy when pp > 1 or an untied head),
    each padded to a multiple of dp."""
    h, f, V, s = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len
    llama = cfg.arch == "llama"
    qkv = h * h // tp + h // tp
    if llama:          # Llama: no position table, no biases, RMSNorm weights only
        from .llama_layer import zero3_layer
        layer = zero3_layer(cfg, tp)
    else:
        layer = [2 * h, qkv, qkv, qkv, h * h // tp + h, 2 * h, h * f // tp + f // tp,
                 f * h // tp + h]
    mods = []
    if stage == 0:
        mods += [V * h // tp] + ([] if llama else [s * h])
        mods += [2 * h] if getattr(cfg, "embed_norm", False) else []   # BLOOM's LN
    mods += layer * (cfg.n_layer // pp if layers is None else layers)
    if stage == pp - 1:
        mods.append(h if llama else 2 * h)
        if pp > 1 or not cfg.tie_embeddings:
            mods.append(V * h // tp)
    return [-(-n // dp) * dp for n in mods]


def stage_params(cfg, tp: int, pp: int, stage: int, layers: "int | None" = None) -> float:
    """Parameters on a rank of pipeline ``stage`` (0 .. pp-1): its n_layer / pp layers
    (``layers``: that many), plus the embeddings on the first stage and the final
    LayerNorm and head on the last (Llama: no position table, an RMSNorm of h)."""
    _check("stage_params", "tp", tp, _is_int(tp, 1), "give the tensor-parallel ranks, an "
           "int >= 1")
    _check("stage_params", "pp", pp, _is_int(pp, 1), "give the pipeline stages, an int >= 1")
    _check("stage_params", "stage", stage, _is_int(stage, 0) and stage < pp,
           f"give a pipeline stage in 0 .. pp - 1 = {pp - 1}")
    _check("stage_params", "layers", layers, layers is None or _is_int(layers, 0),
           "give the stage's layers, an int >= 0, or None (n_layer / pp)")
    h, V, s = cfg.d_model, cfg.vocab_size, cfg.seq_len
    llama = cfg.arch == "llama"
    n = (cfg.n_layer // pp if layers is None else layers) * layer_params(cfg, tp)
    if stage == 0:
        n += V * h / tp + (0 if llama else s * h)
        n += 2 * h if getattr(cfg, "embed_norm", False) else 0    # BLOOM's embedding LN
    if stage == pp - 1:
        n += h if llama else 2 * h
        if pp > 1 or not cfg.tie_embeddings:
            n += V * h / tp                            # tied copy (pp > 1) or untied head
    return n


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


# the last layout's answers: ``search`` asks a candidate's memory on its first, a middle
# and its last stage, then ``estimate`` asks the same again for the candidates that fit.
# Kept by the arguments' identity (frozen dataclasses, held here so that no other object
# takes their ids); what is read of the profile (``comm_memory``) is immutable too.  One
# tuple, replaced whole: a caller keeps writing to the answers of its own arguments.
_LAST: list = [(None, None, None, None, {})]    # (cfg, layout, attention, profile, answers)


def stage_memory(cfg, layout, stage: int, attention: "str | None" = None,
                 profile=None, fusion: "bool | None" = None) -> dict:
    """{"params", "grads", "optimizer", "buffers", "comm_buffers", "activations",
    "workspace", "total"} bytes on a rank of ``stage`` of ``layout`` (a
    :class:`~workbench.plan.layout.Layout`): the first three ZeRO's partitioned model
    states, ``buffers`` the framework's working copies beyond them, ``comm_buffers`` the
    communication library's (NCCL / HCCL, ``comm_memory``; only with a ``profile``, the
    hardware's: without one the key is absent and ``total`` leaves them out),
    ``activations`` what is saved for backward, ``workspace`` the transient peak beyond
    it (:func:`workspace_bytes`) (module docstring).  ``attention``: as
    ``plan.estimate``'s (None: "materialized" for a GPT, "flash" for a Llama, whose
    block is modeled with the fused kernel only); ``profile``: a Profile or its name;
    ``fusion``: Megatron-LM's gradient accumulation fusion (``plan.megatron_2021``; None:
    on, its default since 2022-02), which decides whether its weight gradients are fresh
    tensors (:func:`_fresh_gradients`)."""
    _check("stage_memory", "fusion", fusion, fusion is None or isinstance(fusion, bool),
           "give True, False or None (Megatron-LM's default: on)")
    if isinstance(profile, str):         # a profile's name, as Cluster takes it
        profile = get_profile(profile)
    attention = attention_for(cfg, attention)    # a Llama's "materialized": refused
    if type(stage) is not int or type(attention) is not str:    # _stage_memory says why
        return _stage_memory(cfg, layout, stage, attention, profile, fusion)
    last = _LAST[0]
    if not (last[1] is layout and last[0] is cfg and last[3] is profile
            and last[2] == attention):
        last = _LAST[0] = (cfg, layout, attention, profile, {})
    key = stage if fusion is None else (stage, fusion)
    mem = last[4].get(key)
    if mem is None:
        mem = last[4][key] = _stage_memory(cfg, layout, stage, attention, profile, fusion)
        last[4][("terms", key)] = _TERMS[0]      # stage_workspace_terms reads them
    return dict(mem)        # a copy: callers keep what they get


def _stage_memory(cfg, layout, stage: int, attention: str = "materialized",
                  profile=None, fusion: "bool | None" = None) -> dict:
    """:func:`stage_memory`, computed."""
    lay = layout
    _check("stage_memory", "layout", layout, isinstance(layout, Layout),
           "give a workbench.plan.Layout")
    _check("stage_memory", "stage", stage, _is_int(stage, 0) and stage < lay.pp,
           f"give a pipeline stage in 0 .. pp - 1 = {lay.pp - 1}")
    # the estimate's checks of the model against the layout (16-bit weights; tp dividing
    # the heads, d_ff and the vocabulary; pp x v the layers): tp=5 on 96 heads was priced
    # as 19.2 heads a rank, pp=5 on 96 layers dropped one, a float32 model as 16-bit
    check_layout(cfg, lay, Cluster("a100" if profile is None else profile, lay.world))
    nl = lay.stage_layers(cfg.n_layer)[stage]
    psi = stage_params(cfg, lay.tp, lay.pp, stage, nl)
    mem = model_state_bytes(psi, lay.dp * lay.cp, lay.zero)     # cp ranks shard it too
    unreduced = 0.0
    # Megatron-LM's fp32 main_grad buffer (bf16): whole, even under its ZeRO-1
    mem["buffers"] = grad_buffer_extra_bytes(lay.engine, cfg.dtype) * psi
    if _bf16.applies(cfg, lay):       # DeepSpeed's BF16_Optimizer: its whole fp32 gradients
        mem["buffers"] += _bf16.state_bytes(psi)
    for k, v in _ep_cp.expert_states(cfg, lay, nl, grad_buffer_extra_bytes(
            lay.engine, cfg.dtype)).items():             # a MoE's experts over ep
        mem[k] += v
    if lay.zero == 3 and lay.dp * lay.cp > 1 and lay.engine != "fsdp":   # over dp x cp
        # working copies ZeRO-3 gathers: the whole 16-bit weights of the module computing
        # and of those prefetched (zero3_gathered_numel, the rule the recipe's ledger
        # follows), and the gradients not yet reduce-scattered (DeepSpeed: its bucket and
        # the largest parameter's; this library's recipe: one layer's,
        # _zero3_unreduced_grad_numel)
        from .zero_cost import PREFETCH_NUMEL
        mods = zero3_modules(cfg, lay.tp, lay.pp, stage, lay.dp * lay.cp, nl)
        bucket, grads = _zero3_unreduced_grad_numel(cfg, lay, mods)
        unreduced = 2 * grads       # transient whole gradients; the bucket stays allocated
        gathered = zero3_gathered_numel(mods, PREFETCH_NUMEL)
        if lay.engine == "workbench" and lay.recompute in ("full", "op") and nl:
            # this library's recipe: a recompute gathers each module of the block as it
            # re-runs, without prefetch, and keeps it for that module's backward
            # (``strategies.zero3_clock``: ``_gather_hook`` in a backward, freed by the
            # module's last reduce-scatter), so the whole block is gathered at once
            layer = zero3_modules(cfg, lay.tp, 3, 1, lay.dp * lay.cp, 1)   # a middle layer
            gathered = max(gathered, sum(layer))
        if lay.engine == "deepspeed-0.3":     # v0.3.13's own terms (zero3_2021), below
            unreduced = 0.0
        else:
            mem["buffers"] += 2 * gathered + 2 * (bucket + grads)
    if lay.engine == "fsdp" and lay.dp > 1:
        fsdp, unreduced = _fsdp_buffers(cfg, lay, stage, nl)
        mem["buffers"] += fsdp
    if profile is not None:
        mem["comm_buffers"] = comm_buffer_bytes(cfg, lay, stage, profile)["point"]
    held = in_flight(lay.schedule, lay.pp, lay.m, lay.v, stage)
    tcfg = _ep_cp.token_cfg(cfg, lay)                  # s / cp tokens on a rank
    per_layer = layer_activation_bytes(tcfg, lay.micro_batch, lay.tp, lay.sp, lay.recompute,
                                       attention, _regather(cfg, lay), _dense_moe(tcfg, lay))
    # full recompute in chunks of k layers keeps one input per chunk (recompute_chunks)
    saved = nl if lay.recompute_num_layers == 1 else \
        _chunks.saved_inputs(nl, lay.v, lay.recompute_num_layers)
    layers = per_layer * saved + (_cc.a2a_saved_bytes(cfg, lay)       # a2a: output twice
                                  + _cc.ring_op_saved_bytes(cfg, lay)) * nl   # ring, "op"
    if lay.v > 1:
        # interleaved: the embedding's tensors ride on rank 0's first chunk, the head's on
        # the last rank's last chunk, and Megatron's order does not hold an even mix of
        # chunks at the peak: walk it (in_flight_peak), as the dry run walks its schedule
        def edge(emb, head):
            return _edge_activation_bytes(tcfg, lay.micro_batch, lay.tp, lay.sp, stage,
                                          lay.pp, emb, head, lay.engine)
        first, last = edge(1, 0), edge(0, 1)
        chunk = [layers / lay.v + (first if stage == 0 and c == 0 else 0.0)
                 + (last if stage == lay.pp - 1 and c == lay.v - 1 else 0.0)
                 for c in range(lay.v)]
        act = _peak.peak_bytes(lay.schedule, lay.pp, lay.m, lay.v, stage, chunk)
    else:
        act = layers * held
        act += _edge_activation_bytes(tcfg, lay.micro_batch, lay.tp, lay.sp, stage, lay.pp,
                                      held, lay.m if lay.schedule == "gpipe" else 1,
                                      lay.engine)
    if nl:
        act += _cc.rope_table_bytes(cfg, lay) * held    # cp: the ring-ordered RoPE tables
    act += _ds_pipe.partitioned_output_bytes(tcfg, lay, stage, held)   # its 1/t outputs
    act += _ds_pipe.loaded_input_bytes(tcfg, lay, stage)   # its buffers' loaded inputs
    act += _ds_pipe.receive_buffer_bytes(tcfg, lay, stage)   # pipe_recv_buf, grad_layer
    act += _ds_pipe.kept_input_bytes(tcfg, lay, stage, held)   # tp = 1: inputs twice
    mem["activations"] = act
    terms = workspace_terms(tcfg, lay, stage, attention, unreduced, fusion)
    mem["workspace"] = terms["workspace"]
    if lay.engine == "deepspeed-0.3" and lay.zero == 3 and lay.dp > 1:
        # DeepSpeed v0.3.13 (tp = pp = 1): the head's tensors are not live at the layers'
        # backward peak; the recompute's, the gradients' and the gathered parameters' as
        # its source holds them (zero3_2021.backward_peak_bytes)
        from .zero3_2021 import backward_peak_bytes
        edge = [_edge_activation_bytes(tcfg, lay.micro_batch, lay.tp, lay.sp, stage, lay.pp,
                                       held, n) for n in (1, 0)]
        head = edge[0] - edge[1]          # pp = 1: the head's tensors of one micro-batch
        loss = loss_extra_bytes(lay.engine, lay.tp) * cfg.seq_len * lay.micro_batch \
            * cfg.vocab_size / lay.tp
        remat = max(0.0, _remat_bytes(tcfg, lay, stage, attention)) \
            if lay.recompute != "none" else 0.0
        z = backward_peak_bytes(tcfg, lay, remat, head, loss)
        mem["buffers"] += z["buffers"]
        mem["activations"] = act - head
        mem["workspace"] = z["workspace"]
    if _bf16.applies(cfg, lay):       # its fp32 cast of a gradient; its bf16 copy for the sync
        during, sync = _bf16.transient_bytes(psi, _bf16.largest_numel(cfg, lay.tp, lay.pp,
                                                                      stage, nl))
        # the cast runs in update_hp_grads, before the engine frees the micro-batch's
        # restored output and gradients (deepspeed_pipe_memory.backward_held_bytes)
        during += _ds_pipe.backward_held_bytes(tcfg, lay, stage)["update"]
        # the sync copy once the pipeline has drained: only what the engine's buffers still
        # hold stays of the activations (deepspeed_pipe_memory.after_pipeline_bytes)
        mem["workspace"] = max(mem["workspace"], during,
                               sync + _ds_pipe.after_pipeline_bytes(tcfg, lay, stage) - act)
    mem["total"] = sum(mem.values())
    if mem["workspace"] != terms["workspace"]:      # a framework's own peak set it
        terms = dict(terms, workspace=mem["workspace"])
    _TERMS[0] = terms
    return mem


_TERMS: list = [None]      # the workspace terms of the last stage _stage_memory computed


def stage_workspace_terms(cfg, layout, stage: int, attention: "str | None" = None,
                          profile=None, fusion: "bool | None" = None) -> dict:
    """:func:`workspace_terms` of a rank of ``stage`` of ``layout`` as
    :func:`stage_memory` counts it (its ``unreduced``: the gradients its ``buffers``
    hold); "workspace" is ``stage_memory``'s (where a framework's own term sets it:
    DeepSpeed v0.3's backward peak, BF16_Optimizer's copies, that figure)."""
    if isinstance(profile, str):
        profile = get_profile(profile)
    mem = stage_memory(cfg, layout, stage, attention, profile, fusion)   # checks; cached
    key = ("terms", stage if fusion is None else (stage, fusion))
    terms = _LAST[0][4].get(key) if _LAST[0][1] is layout else None
    if terms is None:           # not cached (an argument stage_memory does not cache)
        _stage_memory(cfg, layout, stage, attention_for(cfg, attention), profile, fusion)
        terms = _TERMS[0]
    return dict(terms, workspace=mem["workspace"])


def workspace_bytes(cfg, lay, stage: int, attention: str = "materialized",
                    unreduced: float = 0.0, fusion: "bool | None" = None) -> float:
    """Transient bytes on a rank of ``stage`` at its peak beyond what is saved for
    backward (``activations``) and the ``buffers``: the larger of two instants
    (:func:`workspace_terms` names their terms), at least 0:
    - the loss, on the last stage: ``frameworks.loss_extra_bytes`` per logit of one
      micro-batch (s b V / t), the fp32 working copies the framework's cross-entropy
      holds beside the saved softmax (Megatron-LM's in-place kernel 2 bytes, PyTorch's
      ``F.cross_entropy`` on upcast logits 8), and in DeepSpeed's pipeline engine the
      earlier micro-batches' fp32 logits its output buffers keep
      (``deepspeed_pipe_memory.backward_held_bytes``);
    - the layers' backward, at a layer's first weight gradient (the MLP's output
      projection, fc2 / w2): what a recompute made again (a recomputed layer saves,
      during its backward, what it would have kept without recompute: torch.utils.
      checkpoint and Megatron-LM's ``CheckpointFunction`` re-run the forward with
      autograd on, one layer at a time: ``--recompute-num-layers 1``, torchtitan's
      per-block checkpoint; full recompute: one layer's activations beyond its kept
      input; ``recompute_num_layers`` = k: the largest chunk's k layers, less the
      chunk's input that ``activations`` keeps, ``recompute_chunks``; selective: the
      attention core, Korthikanti et al. 2022 sec. 5, re-run after the MLP's backward,
      so beside no fresh weight gradient), plus the gradients live then that the
      states do not hold (:func:`_live_gradient_bytes`: that weight gradient whole, a
      tied head's gradient autograd holds, FSDP2's previous reduce-scatter input;
      DeepSpeed's pipeline engine: the micro-batch's restored output and rebuilt
      received gradient, on the last stage the fp32 logits its buffers keep,
      ``deepspeed_pipe_memory.backward_held_bytes``), less
      ``unreduced`` (the whole gradients ``buffers`` already counts: live here only as
      far as the terms before say), less the head's saved tensors of one micro-batch on
      the last stage (final norm and head inputs, fp32 logits: the head's backward,
      before any layer's, released them; measured, tests/test_i21mem3.py).
    Not counted: a layer backward's activation-gradient temporaries (e.g. the MLP
    input's gradient, 2 s b h), cuBLAS / cuDNN workspaces (part of the context
    assumption)."""
    return workspace_terms(cfg, lay, stage, attention, unreduced, fusion)["workspace"]


def workspace_terms(cfg, lay, stage: int, attention: str = "materialized",
                    unreduced: float = 0.0, fusion: "bool | None" = None) -> dict:
    """The terms of :func:`workspace_bytes` (bytes): "recompute", the fresh
    "weight gradient", the "tied head gradient", FSDP2's "previous reduce-scatter
    input", DeepSpeed's pipeline "engine's output and gradient" (the last stage: its
    buffers' logits through the backward) and "engine's kept logits" (at the loss),
    "counted in buffers" (``unreduced``), "head freed", the two instants
    "layers' backward" and "loss", and "workspace", the larger of them and 0."""
    b = lay.micro_batch
    remat = 0.0
    if lay.recompute != "none":
        remat = max(0.0, _remat_bytes(cfg, lay, stage, attention))
    live = _live_gradient_bytes(cfg, lay, stage, fusion)
    first = live["weight gradient"]
    # the full (op-level, chunked) recompute re-runs the block as its backward starts, so
    # the first weight gradient is allocated with all of it live (measured: fc2's whole
    # gradient beside the recompute, tests/test_i21mem3.py); Megatron's selective
    # recompute re-runs the attention core after the MLP's backward
    core = max(remat, first) if lay.recompute == "selective" else remat + first
    head = 0.0
    if stage == lay.pp - 1:     # one micro-batch's head tensors, freed by the head's backward
        head = (_edge_activation_bytes(cfg, b, lay.tp, lay.sp, stage, lay.pp, 0.0, 1)
                - _edge_activation_bytes(cfg, b, lay.tp, lay.sp, stage, lay.pp, 0.0, 0))
    # DeepSpeed's pipeline engine: the restored output and the rebuilt received gradient
    # live through the micro-batch's backward (deepspeed_pipe_memory.backward_held_bytes)
    held = _ds_pipe.backward_held_bytes(cfg, lay, stage)
    engine = held["backward"]
    layers = (core + live["tied head gradient"] + live["previous reduce-scatter input"]
              + engine - unreduced - head)
    loss = 0.0
    if stage == lay.pp - 1:
        loss = loss_extra_bytes(lay.engine, lay.tp) * cfg.seq_len * b * cfg.vocab_size / lay.tp
        loss += held["loss"]          # DeepSpeed's engine: earlier micro-batches' logits
    return {"recompute": remat, **live, "engine's output and gradient": engine,
            "engine's kept logits": held["loss"],
            "counted in buffers": float(unreduced),
            "head freed": head, "layers' backward": layers, "loss": loss,
            "workspace": max(0.0, layers, loss)}


def _fresh_gradients(cfg, lay, fusion: "bool | None" = None) -> bool:
    """Whether the weight gradient autograd computes is a tensor of its own beside the
    gradient states ``grads`` counts (and so live, whole, until the framework's hook or
    AccumulateGrad takes it):
    - Megatron-LM with ``gradient_accumulation_fusion`` (``fusion`` None or True, its
      default since 83b1e42f30, 2022-02: ``plan.megatron_2021``): no; its linear layers'
      weight-gradient GEMM adds into the resident ``main_grad`` buffer
      (``megatron/core/tensor_parallel/layers.py``, LinearWithGradAccumulationAndAsync
      Communication.backward, ``wgrad_gemm_accum_fp32``), the tied output layer's
      included (2e90a342f5 returns ``grad_weight = None``; f2e5db402c hands autograd a
      dummy zeroed V h / t gradient for a tied head on the embedding's stage,
      ``zero_out_wgrad``, ``plan.megatron_hook_add``: NOT counted, as there; Megatron
      sets ``zero_out_wgrad`` only with pipeline size 1, ``megatron/core/models/common/
      language_module/language_module.py`` ``setup_embeddings_and_output_layer``: a last
      stage of a pipeline holds a real copy of the table instead, zeroed then
      all-reduced from the first stage, counted with the parameters, fixlist16);
      without it (``fusion=False``, Narayanan et al.'s 2021 code): yes, autograd's
      16-bit gradient, which the DDP hook adds into ``main_grad`` and frees;
    - ZeRO-2/3 (DeepSpeed, this library's recipe) and FSDP2: yes, autograd's gradient,
      reduce-scattered and freed by the framework's hook after it is complete;
    - DeepSpeed's BF16_Optimizer (``plan.bf16_optimizer``): no; ``clear_lp_grads`` sets
      the bf16 ``.grad`` to None before each micro-batch's backward, so AccumulateGrad
      steals autograd's gradient as ``.grad``, which ``grads`` counts;
    - ZeRO-0/1 of the others: only when a micro-batch adds to the gradient the earlier
      ones left (PyTorch's AccumulateGrad adds the new tensor into ``.grad``,
      ``variable_grad += new_grad``; the first micro-batch's is stolen as ``.grad``): m >
      1 (DeepSpeed's fp16 pipeline engine, this library's recipe: ``plan.megatron_2021``)."""
    if lay.engine == "megatron":
        return fusion is False
    if _bf16.applies(cfg, lay):
        return False
    return lay.zero >= 2 or lay.engine == "fsdp" or lay.m > 1


def workspace_assumptions(cfg, terms: dict) -> tuple:
    """The line ``Estimate.assumptions`` carries for a workspace term without a source
    (``terms``: :func:`workspace_terms`' of the busiest stage)."""
    if getattr(cfg, "moe_experts", 0) and terms.get("weight gradient"):
        return (f"workspace: a MoE layer's first weight gradient at the layers' backward "
                f"counted as a dense MLP's output projection, d_ff x d_model / tp "
                f"({terms['weight gradient'] / 1e9:.2f} GB, ASSUMPTION: its experts' own "
                f"gradients not modeled apart; memory.workspace_terms)",)
    return ()


def _first_weight_grad_numel(cfg, tp: int) -> float:
    """Elements of the first weight gradient a layer's backward allocates: the MLP's
    output projection (GPT: fc2's weight and bias; Llama: w2), f h / t (a MoE: the same
    with its ``d_ff``, an ASSUMPTION: its experts' first gradients are not modeled
    apart)."""
    h, f = cfg.d_model, cfg.d_ff
    return h * f / tp + (0 if cfg.arch == "llama" else h)


def _live_gradient_bytes(cfg, lay, stage: int, fusion: "bool | None" = None) -> dict:
    """16-bit gradients live at a layer's first weight gradient beyond the states
    (:func:`workspace_bytes`):
    - "weight gradient": that gradient, whole (:func:`_fresh_gradients`);
    - "tied head gradient": with the word embedding and its tied head on one stage
      (pp = 1), the head's gradient of the shared weight waits in autograd's input
      buffer of the leaf until the embedding's backward adds its own (one leaf, two
      uses: the engine runs AccumulateGrad once all its inputs arrived), all through
      the layers' backward (measured, tests/test_i21mem.py and test_i21mem3.py), V h / t;
      where fresh gradients are (Megatron-LM's fused accumulation writes the head's
      into ``main_grad``: not);
    - "previous reduce-scatter input": FSDP2 keeps the previous unit's fp32
      reduce-scatter input (``FSDPCommContext.reduce_scatter_state(s)``) until the next
      unit's ``post_backward`` waits for it (torch/distributed/fsdp/_fully_shard/
      _fsdp_param_group.py ``post_backward``: torch 2.5-2.7 ``reduce_scatter_state``,
      2.13 ``reduce_scatter_states`` with ``reduce_scatter_max_input_buffers`` 1; measured
      on a one-rank gloo group, tests/test_i21mem3.py): during a block's backward the
      unit before it in backward order holds ``FSDP_REDUCE_BYTES`` per element (the
      largest unit when m > 1: the previous micro-batch's last unit too)."""
    out = {"weight gradient": 0.0, "tied head gradient": 0.0,
           "previous reduce-scatter input": 0.0}
    if not _fresh_gradients(cfg, lay, fusion):
        return out
    out["weight gradient"] = 2 * _first_weight_grad_numel(cfg, lay.tp)
    if lay.pp == 1 and cfg.tie_embeddings:
        out["tied head gradient"] = 2 * cfg.vocab_size * cfg.d_model / lay.tp
    if lay.engine == "fsdp" and lay.dp > 1:
        from .frameworks import FSDP_REDUCE_BYTES
        units = _fsdp_units(cfg, lay, stage, lay.stage_layers(cfg.n_layer)[stage])
        before = units if lay.m > 1 or stage > 0 else units[1:]
        out["previous reduce-scatter input"] = FSDP_REDUCE_BYTES * max(before, default=0.0)
    return out


def _remat_bytes(cfg, lay, stage: int, attention: str) -> float:
    """What a recompute makes again beyond what it kept (:func:`workspace_bytes`): the
    largest chunk's layers of activations, less the layer's kept part."""
    b, tp, sp, rc = lay.micro_batch, lay.tp, lay.sp, lay.recompute
    rg = _regather(cfg, lay)
    k = lay.recompute_num_layers
    live = 1 if k == 1 else _chunks.largest_chunk(
        lay.stage_layers(cfg.n_layer)[stage], lay.v, k)
    dm = _dense_moe(cfg, lay)
    return (live * layer_activation_bytes(cfg, b, tp, sp, "none", attention, rg, dm)
            - layer_activation_bytes(cfg, b, tp, sp, rc, attention, rg, dm))


def _dense_moe(tcfg, lay) -> "tuple[int, int] | None":
    """A MoE run by the model's own dispatch: its (sequences, tokens each) on a rank
    (``moe_cost.dense_groups``; ``tcfg`` the model at s / cp), else None."""
    from .moe_cost import dense_groups
    return dense_groups(tcfg, lay)


def _zero3_unreduced_grad_numel(cfg, lay, mods) -> tuple[float, float]:
    """(bucket, gradients): 16-bit elements a ZeRO-3 rank holds before their
    reduce-scatter.  DeepSpeed (``stage3.py``, ``contiguous_gradients``): the reduce
    bucket, a buffer of ``reduce_bucket_size`` elements allocated once (v0.3.13's 6.7e7 of
    DeepSpeedExamples' config, ``zero3_2021``; today's default 5e8, ``zero_cost``), into
    which each parameter's gradient is copied and then freed; a parameter above the
    bucket's size is reduced as its own bucket: the largest parameter's gradient whole.
    This library's recipe: no bucket, one layer's whole gradient (an assumption, the dry
    run's)."""
    if lay.engine in ("deepspeed", "deepspeed-0.3"):
        from .zero_cost import REDUCE_BUCKET_NUMEL
        from .zero3_2021 import REDUCE_BUCKET_NUMEL as BUCKET_2021
        bucket = BUCKET_2021 if lay.engine == "deepspeed-0.3" else REDUCE_BUCKET_NUMEL
        return float(bucket), float(max(mods))
    return 0.0, float(layer_params(cfg, lay.tp))


def _fsdp_units(cfg, lay, stage: int, nl: int) -> list:
    """Parameters of FSDP2's units on a rank of ``stage``, forward order (``frameworks``:
    one unit per block, the embedding and the final norm with the head their own)."""
    h, V, s, tp = cfg.d_model, cfg.vocab_size, cfg.seq_len, lay.tp
    llama = cfg.arch == "llama"
    units = [V * h / tp + (0 if llama else s * h)
             + (2 * h if getattr(cfg, "embed_norm", False) else 0)] if stage == 0 else []
    units += [layer_params(cfg, tp)] * nl
    if stage == lay.pp - 1:
        units.append((h if llama else 2 * h)
                     + (V * h / tp if lay.pp > 1 or not cfg.tie_embeddings else 0.0))
    return units


def _fsdp_buffers(cfg, lay, stage: int, nl: int) -> tuple[float, float]:
    """(buffers, of which gradients): FSDP2's working buffers on a rank: the gathered
    16-bit parameters of the unit computing and of the one prefetched (the peak over the
    forward and backward orders, ``zero3_gathered_numel`` with one unit ahead), and the
    unit's unsharded 16-bit gradient with its fp32 copy that the reduce-scatter reads
    (``foreach_reduce`` casts to ``reduce_dtype`` into one flat input buffer), the
    second figure (what :func:`workspace_bytes` takes as ``unreduced``)."""
    from .frameworks import FSDP_PREFETCH_UNITS, FSDP_REDUCE_BYTES
    units = _fsdp_units(cfg, lay, stage, nl)
    gathered = zero3_gathered_numel(units, FSDP_PREFETCH_UNITS)
    grads = (2 + FSDP_REDUCE_BYTES) * max(units)
    return 2 * gathered + grads, grads


def memory_margin(prof) -> str:
    """What ``Profile.usable_memory`` keeps back, in words (both are assumptions, cited
    in the profile)."""
    rt = prof.runtime_memory
    if not rt:
        return f"all {prof.memory_bytes / 1e9:.4g} GB of the device (no runtime margin given)"
    return (f"{prof.memory_bytes / 1e9:.4g} GB less {rt['fragmentation']:.0%} fragmentation and "
            f"{rt['context_bytes'] / 1e9:.2f} GB context, ASSUMED")
