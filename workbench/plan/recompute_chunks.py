"""Full recompute in chunks of k layers: ``Layout(recompute="full", recompute_num_layers=k)``.

What the frameworks do (read at the commits named):

- Megatron-LM, ``--recompute-granularity full --recompute-method uniform
  --recompute-num-layers k``: ``TransformerBlock._checkpointed_forward``
  (NVIDIA/Megatron-LM a7c9e8c44a, ``megatron/core/transformer/transformer_block.py``
  :546-566) checkpoints ``custom(layer_idx, min(layer_idx + k, num_layers_per_pipeline_
  rank))``, layer_idx stepping by k: one checkpointed input per chunk of k layers, the
  last chunk shorter when k does not divide the block's layers (a model chunk's layers
  with the interleaved schedule: each virtual stage is its own block).  Its config
  (d98e8a64dd ``transformer_config.py``:1919-1931) asks k "between 1 and
  num_layers_per_pipeline_rank" for granularity full and k = None for selective.
- Megatron-LM-v1.1.5-ZeRO3 with DeepSpeed (DeepSpeedExamples 44be774aad),
  ``--checkpoint-num-layers k`` (``megatron/arguments.py``:237-238, default 1; the ZeRO-3
  example ``examples/ds_pretrain_gpt2-zero3.sh``:47 ``chkp_layers=2``, passed at :114-116):
  ``ParallelTransformer._checkpointed_forward`` (``megatron/model/transformer.py``:949-969)
  calls ``mpu.checkpoint(custom(l, l + k), hidden_states, attention_mask)`` for l = 0, k,
  2k, ...; ``mpu.checkpoint`` is DeepSpeed's (``megatron/initialize.py``:119), configured
  with ``num_checkpoints`` = ceil(num_layers / k) (:105-106).  DeepSpeed v0.3.13
  (12a53b4383) ``activation_checkpointing/checkpointing.py``: ``CheckpointFunction.
  forward`` keeps (with ``partition_activations``) a partition of each tensor argument
  but the last (:441-455) and frees the input in its place (``arg.data = inp.data``,
  :538); ``backward`` gathers the input back (``get_full_inputs``, :629-631) and re-runs
  the whole chunk with autograd on (``ctx.run_function(*detached_inputs)``, :660) before
  ``torch.autograd.backward`` (:686).  NOT priced: when k does not divide the layers,
  v1.1.5's ``custom`` runs ``self._get_layer(index)`` for index up to l + k - 1, which
  ``_get_layer_index`` (:938-943, ``--param-sharing-style`` default 'grouped',
  arguments.py:166) takes modulo the layers: the last chunk runs layer 0 again (at 105
  layers and k = 2: 106 layers run, 1% more layer work); this module prices Megatron-LM
  core's shorter last chunk.

So, per micro-batch on a stage of ``nl`` layers (in ``v`` model chunks of nl / v):
``saved_inputs`` = v ceil(nl / (v k)) layer inputs kept instead of nl, and during a
chunk's backward the activations of its (up to) k layers are live at once (the recompute
re-runs them all before the first backward of them); the FLOPs are those of recompute
"full" (each layer's forward once more).  Refused: k != 1 with any recompute but "full"
(Megatron-LM's rule), with ``framework="workbench"`` (the course's blocks checkpoint one
block each: ``models.gpt.Block``'s ``recompute``; the dry run could not agree) and with
``framework="fsdp"`` (torchtitan's activation checkpointing wraps each TransformerBlock:
chunks of k are not what it runs)."""
from __future__ import annotations

__all__ = ["check_field", "check_layout", "chunk_sizes", "saved_inputs", "largest_chunk"]


def check_field(lay) -> None:
    """Raise ValueError unless ``lay.recompute_num_layers`` is an int >= 1 that the
    layout's recompute and framework run (module docstring)."""
    k = lay.recompute_num_layers
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"Layout: recompute_num_layers={k!r} must be an int >= 1 (the "
                         f"layers of one full-recompute chunk; 1: each layer its own)")
    if k == 1:
        return
    if lay.recompute != "full":
        raise ValueError(f"Layout: recompute_num_layers={k} with recompute="
                         f"{lay.recompute!r}: chunks of layers are checkpointed by full "
                         f"recompute only (Megatron-LM asks recompute_num_layers=None for "
                         f"selective); use recompute='full' or recompute_num_layers=1")
    engine = lay.engine
    if engine == "workbench":
        raise ValueError(f"Layout: recompute_num_layers={k} with framework='workbench': the "
                         f"course's blocks checkpoint one block each (ModelConfig.recompute), "
                         f"so neither its runtime nor the dry run holds chunks of {k} layers; "
                         f"use recompute_num_layers=1, or framework='megatron' / "
                         f"'deepspeed' to estimate it")
    if engine == "fsdp":
        raise ValueError(f"Layout: recompute_num_layers={k} with framework='fsdp': "
                         f"torchtitan checkpoints each TransformerBlock on its own; use "
                         f"recompute_num_layers=1")


def check_layout(model, lay) -> None:
    """Raise ValueError when k exceeds the layers of one stage's model chunk (Megatron-LM:
    "between 1 and num_layers_per_pipeline_rank")."""
    k = lay.recompute_num_layers
    if k == 1:
        return
    most = max(lay.stage_layers(model.n_layer)) // lay.v
    if k > most:
        raise ValueError(f"Layout: recompute_num_layers={k} exceeds the {most} layers of a "
                         f"stage's model chunk (n_layer={model.n_layer}, pp={lay.pp}, "
                         f"v={lay.v}); use recompute_num_layers between 1 and {most}")


def chunk_sizes(layers: int, k: int) -> list[int]:
    """The chunks' layers over ``layers`` layers of one block: k each, the last the rest
    (Megatron-LM's ``min(layer_idx + k, num_layers)``)."""
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise ValueError(f"chunk_sizes: layers={layers!r} must be an int >= 0")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"chunk_sizes: k={k!r} must be an int >= 1")
    return [min(k, layers - i) for i in range(0, layers, k)]


def saved_inputs(layers: int, v: int, k: int) -> int:
    """Checkpointed layer inputs one micro-batch keeps over a stage's ``layers`` layers
    in ``v`` model chunks: v ceil(layers / (v k))."""
    return v * len(chunk_sizes(layers // v, k)) if layers else 0


def largest_chunk(layers: int, v: int, k: int) -> int:
    """Layers of the largest chunk (live at once in its backward): min(k, layers / v)."""
    return max(chunk_sizes(layers // v, k), default=0)
