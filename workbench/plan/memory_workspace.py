"""The transient peak beyond the activations and the buffers: the two instants and their
terms (:func:`workspace_bytes`, :func:`workspace_terms`), what a recompute makes again
(:func:`_remat_bytes`), the gradients live at a layer's first weight gradient
(:func:`_live_gradient_bytes`, :func:`_fresh_gradients`) and the assumption a term
without a source carries (:func:`workspace_assumptions`)."""
from __future__ import annotations

from . import bf16_optimizer as _bf16
from . import deepspeed_pipe_memory as _ds_pipe
from . import recompute_chunks as _chunks
from .frameworks import loss_extra_bytes
from .memory_activations import (_dense_moe, _edge_activation_bytes, _regather,
                                 layer_activation_bytes)
from .memory_buffers import _fsdp_units


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
