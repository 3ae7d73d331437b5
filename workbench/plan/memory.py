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

The parts live beside this module, which keeps :func:`stage_memory` (with its cache of
the last layout's answers, ``_LAST``), :func:`stage_workspace_terms` and
:func:`memory_margin`, and their import path: the model states and parameter counts
(:mod:`.memory_states`), ZeRO-3's and FSDP2's buffers (:mod:`.memory_buffers`), the
activations (:mod:`.memory_activations`) and the workspace (:mod:`.memory_workspace`).
"""
from __future__ import annotations

from . import bf16_optimizer as _bf16
from . import deepspeed_pipe_memory as _ds_pipe
from . import context_cost as _cc
from . import ep_cp as _ep_cp
from . import in_flight_peak as _peak
from . import recompute_chunks as _chunks
from .comm_memory import comm_buffer_bytes
from .frameworks import grad_buffer_extra_bytes, loss_extra_bytes
from .layout import Cluster, Layout, attention_for, check_layout
from ..sim_mesh.profiles import get_profile
from .memory_states import (K_ADAM, _check, _is_int, _is_number, layer_params,  # noqa: F401
                            model_state_bytes, stage_params)
from .memory_buffers import (_fsdp_buffers, _fsdp_units, _gathered_numel,  # noqa: F401
                             zero3_gathered_numel, zero3_modules, _zero3_unreduced_grad_numel)
from .memory_activations import (_dense_moe, _edge_activation_bytes, in_flight,  # noqa: F401
                                 layer_activation_bytes, _regather)
from .memory_workspace import (_first_weight_grad_numel, _fresh_gradients,  # noqa: F401
                               _live_gradient_bytes, _remat_bytes, workspace_assumptions,
                               workspace_bytes, workspace_terms)


__all__ = ["memory_margin", "model_state_bytes", "workspace_bytes", "workspace_terms",
           "stage_workspace_terms", "workspace_assumptions",
           "zero3_gathered_numel",
           "zero3_modules", "stage_params", "layer_activation_bytes", "in_flight",
           "stage_memory", "K_ADAM"]


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


def memory_margin(prof) -> str:
    """What ``Profile.usable_memory`` keeps back, in words (both are assumptions, cited
    in the profile)."""
    rt = prof.runtime_memory
    if not rt:
        return f"all {prof.memory_bytes / 1e9:.4g} GB of the device (no runtime margin given)"
    return (f"{prof.memory_bytes / 1e9:.4g} GB less {rt['fragmentation']:.0%} fragmentation and "
            f"{rt['context_bytes'] / 1e9:.2f} GB context, ASSUMED")
