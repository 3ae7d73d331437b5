"""Megatron-LM's gradient hook on the parameters its fused weight-gradient GEMMs skip.

With gradient accumulation fusion (Megatron-LM 83b1e42f30, 2022-02, on by default) a
linear layer's weight-gradient GEMM adds into the fp32 ``main_grad`` itself and no
16-bit gradient is written for that weight (``plan.megatron_2021`` prices the code
before it, where every parameter is added so).  The other parameters still get an
autograd gradient, and Megatron's data-parallel wrapper adds it into ``main_grad`` after
every micro-batch's backward, in one kernel per parameter tensor:

- NVIDIA/Megatron-LM f2e5db402c (2024-07-15, the README's H100 table)
  ``megatron/core/distributed/distributed_data_parallel.py`` ``_make_param_hook``
  (lines 215-225): ``if param.grad is not None and (not param.grad_added_to_main_grad or
  zero_out_wgrad): param.main_grad.add_(param.grad.data)``, then ``param.grad = None``;
  under ``no_sync`` as well (the hook only defers the reduce-scatter to the last
  micro-batch).  ``grad_added_to_main_grad`` is set only by the fused weight-gradient
  paths (``megatron/core/tensor_parallel/layers.py`` lines 503-522; Transformer
  Engine's linears with ``fuse_wgrad_accumulation``), never for an embedding lookup, a
  LayerNorm or a bias.  The same hook at 2e90a342f5 (2022-05, Korthikanti et al.'s
  code; ``megatron/model/distributed.py``) adds every non-None ``param.grad``.
- So per micro-batch, on a rank: the word embedding's V h / t and the learned position
  table's s h (first stage; with ``cfg.embed_norm`` BLOOM's embedding LayerNorm's
  weight and bias too, a LayerNorm like the layers'), each layer's LayerNorm weights and biases and its linear
  biases (a GPT layer: two LayerNorms' weight and bias, the QKV, projection, fc1 and fc2
  biases: 8 tensors; a Llama block: its two RMSNorm weights), and the final norm (last
  stage).  The untied output layer is a fused ``ColumnParallelLinear``: nothing.  A tied
  output layer on the embedding's own stage gets a dummy zeroed weight gradient
  (``zero_out_wgrad``, ``megatron/core/models/common/language_module/language_module.py``
  lines 63-67; ``layers.py`` lines 507-513), which autograd sums with the lookup's
  (a write of V h / t 16-bit zeros and a sum): NOT priced, as 2e90a342f5's fused path
  returns no weight gradient at all (``grad_weight = None``) and the planner does not
  tell the two commits apart (under 0.1 ms per micro-batch for Korthikanti's 22B).
- Each ``add_`` reads the 16-bit gradient and reads and writes the ``main_grad``
  buffer: 2 + 2 g bytes per element, g = 4 for bf16 (Megatron-LM forces
  ``accumulate_allreduce_grads_in_fp32`` for bf16: ``megatron/training/arguments.py``
  lines 299-307 at f2e5db402c), else the model's 2; priced as memory-bound kernels on
  the profile's roofline (``cost.compute_time``, op class "elementwise", one launch per
  tensor), as ``plan.megatron_2021`` prices the same hook before the fusion.

Not priced here: the embedding lookup's own backward (``edge_cost``), the once-per-step
passes over the buffer (``plan.optimizer_step``).  A MoE layer is counted as the dense
GPT layer (ASSUMPTION: its router weight and any expert biases, a few tensors of at most
h x experts elements, not counted; microseconds per micro-batch).
"""
from __future__ import annotations

from ..sim_mesh.cost import compute_time

__all__ = ["SOURCE", "hook_elements", "hook_add_seconds", "assumption"]

SOURCE = ("NVIDIA/Megatron-LM f2e5db402c megatron/core/distributed/"
          "distributed_data_parallel.py:215-225 (param.main_grad.add_(param.grad.data) after "
          "each micro-batch's backward for parameters the fused wgrad GEMM skips)")


def hook_elements(cfg, tp: int, pp: int, stage: int, layers: int) -> tuple[float, int]:
    """(elements added, tensors) by the hook on a rank of pipeline ``stage`` holding
    ``layers`` layers, per micro-batch (module docstring)."""
    h, V, s, f = cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.d_ff
    llama = cfg.arch == "llama"
    if llama:
        per_layer, tensors = 2 * h, 2                       # two RMSNorm weights
    else:   # LayerNorm 1 and 2 (w, b); QKV, projection, fc1, fc2 biases
        per_layer, tensors = 4 * h + 3 * h / tp + h + f / tp + h, 8
    n, k = layers * per_layer, layers * tensors
    if stage == 0:
        n, k = n + V * h / tp, k + 1                        # the word embedding
        if not llama:
            n, k = n + s * h, k + 1                         # the learned position table
        if getattr(cfg, "embed_norm", False):
            n, k = n + 2 * h, k + 2                         # BLOOM's LayerNorm (w, b)
    if stage == pp - 1:
        n, k = n + (h if llama else 2 * h), k + (1 if llama else 2)   # final norm
    return n, k


def hook_add_seconds(cfg, lay, stage: int, layers: int, prof, fusion: bool) -> float:
    """Seconds per micro-batch of the hook's ``main_grad.add_`` on a rank of pipeline
    ``stage`` (``layers`` layers) of a Megatron-LM layout whose weight-gradient GEMMs
    accumulate into ``main_grad`` (``fusion``); 0 for other frameworks and without the
    fusion (``plan.megatron_2021.accumulate_seconds`` prices every parameter then)."""
    if not fusion or lay.engine != "megatron":
        return 0.0
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < lay.pp:
        raise ValueError(f"hook_add_seconds: stage={stage!r} must be an int in "
                         f"[0, {lay.pp})")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise ValueError(f"hook_add_seconds: layers={layers!r} must be an int >= 0")
    e = cfg.torch_dtype.itemsize
    g = 4 if cfg.dtype == "bfloat16" else e                 # fp32 main_grad for bf16
    n, k = hook_elements(cfg, lay.tp, lay.pp, stage, layers)
    if n <= 0:
        return 0.0
    return compute_time(0.0, (e + 2 * g) * n, prof, cfg.dtype, "elementwise", launches=k)


def assumption(lay, fusion: bool, cfg=None) -> tuple:
    """The line ``Estimate.assumptions`` carries where the hook is priced (``cfg``: a MoE
    model's layers are counted as dense, said so)."""
    if not fusion or lay.engine != "megatron":
        return ()
    moe = ("; MoE layers counted as the dense layer, router and expert biases left out "
           "(ASSUMPTION)" if getattr(cfg, "moe_experts", 0) else "")
    return ("Megatron-LM's DDP hook adds the 16-bit gradients of the embeddings, norms and "
            "biases into main_grad after every micro-batch (plan.megatron_hook_add: "
            + SOURCE + "), memory bound" + moe,)
