"""Megatron-LM's layer before two of its 2021-22 changes, and which frameworks run it so.

The planner's layer (``layer_cost``) is Megatron-LM as Korthikanti et al. ran it in 2022
(NVIDIA/Megatron-LM 2e90a342f5, 2022-05-19).  Two things that code does were not in the
code of Narayanan et al. SC'21 (50a4b5fa02, 2021-04-08, and its scripts de7dc40f88,
2021-08-10), nor in Megatron-DeepSpeed, the Megatron that DeepSpeed's pipeline engine ran
(microsoft/Megatron-DeepSpeed acc3e9b5 of 2021-11-12, MT-NLG's time;
bigscience-workshop/Megatron-DeepSpeed 497aa1bf of 2022-03-11, BLOOM's): neither has the
commits below (``git merge-base --is-ancestor``; the Megatron-DeepSpeed ``mpu/layers.py``
of both still call ``copy_to_tensor_model_parallel_region``).  Nor does Megatron-DeepSpeed
later, under DeepSpeed (its Llama included): microsoft f4157bea (2024-12-24)
``megatron/arguments.py`` sets ``async_tensor_model_parallel_allreduce = False`` when
``args.deepspeed`` ("DeepSpeed seems to be incompatible"), and the fused accumulation in
``megatron/core/tensor_parallel/layers.py`` is commented out.

- ``async_tensor_model_parallel_allreduce`` (Megatron-LM 16c90445e7, 2021-09-02, on by
  default from 3f65246911 the same day, ``--no-async-tensor-model-parallel-allreduce``;
  both merged into main 2021-09-02, 6e1bde1e0f): the
  backward all-reduce of a column-parallel layer's input gradient runs beside its
  weight-gradient GEMM.  Before it, ``ColumnParallelLinear.forward`` passes its input
  through ``copy_to_tensor_model_parallel_region`` (``mpu/mappings.py``), whose backward
  ``_reduce`` all-reduces the gradient after autograd has run the linear's backward (both
  GEMMs) and before the LayerNorm's backward can start: on the critical path, two per
  layer and micro-batch (``layer_cost``'s ``async_allreduce=False``).
- ``gradient_accumulation_fusion`` (Megatron-LM 83b1e42f30, 2022-02-13, merged 2022-02-22;
  on by default, ``--no-gradient-accumulation-fusion``): the weight-gradient GEMM adds into
  ``main_grad`` itself (an fp32 one only until 07916bf245, 2022-09-27: before it
  ``megatron/arguments.py`` turned the fusion off unless gradients accumulate in fp32, as
  at 2e90a342f5, so fp16 runs of that code accumulate as below).  Before it, the GEMM writes a new 16-bit gradient and another
  kernel adds it, one per parameter tensor (a GPT layer's 12):

  - with Megatron's contiguous gradient buffers (``--use-contiguous-buffers-in-ddp``, forced
    by bf16's fp32 accumulation: ``megatron/arguments.py``; the distributed optimizer, ZeRO-1,
    always has them): ``DistributedDataParallel._make_param_hook``'s
    ``param.main_grad.add_(param.grad.data)`` after every micro-batch's backward
    (``megatron/model/distributed.py`` at 50a4b5fa02): read the 16-bit gradient, read and
    write the buffer: 2 + 2 g bytes per parameter (g = 4 for bf16's fp32 buffer, else the
    parameters' 2);
  - without them (fp16 with ``--DDP-impl local`` and no ``--use-contiguous-buffers-in-ddp``,
    as Narayanan's ``run_table_1.sh`` runs; ``--DDP-impl torch`` under ``no_sync``; DeepSpeed's
    fp16 pipeline engine): autograd's ``AccumulateGrad`` keeps the first micro-batch's
    gradient and adds each later one in place (``variable_grad += new_grad``, PyTorch
    ``torch/csrc/autograd/functions/accumulate_grad.h``): m - 1 passes per step reading two
    16-bit tensors and writing one, 6 bytes per parameter.

  DeepSpeed's bf16 pipeline engine adds each micro-batch's bf16 gradients into its own fp32
  buffer (``plan.bf16_optimizer``'s ``update_hp_grads``, priced there): nothing here.
  Each pass is priced by ``cost.compute_time`` on its bytes (memory-bound), one launch per
  parameter tensor.
"""
from __future__ import annotations

from ..sim_mesh.cost import compute_time

__all__ = ["SOURCE", "resolve", "accumulate_seconds", "assumption"]

SOURCE = ("NVIDIA/Megatron-LM before 16c90445e7 (2021-09, async TP all-reduce) and 83b1e42f30 "
          "(2022-02, gradient accumulation fusion): Narayanan et al.'s 50a4b5fa02 / de7dc40f88; "
          "Megatron-DeepSpeed acc3e9b5 (2021-11) and bigscience 497aa1bf (2022-03)")
TENSORS_PER_LAYER = 12      # a GPT layer's weights and biases: one accumulation kernel each
_NAMES = ("async_tensor_model_parallel_allreduce", "gradient_accumulation_fusion")


def resolve(lay, async_tp, fusion) -> tuple[bool, bool]:
    """(async TP all-reduce, gradient accumulation fusion) that ``lay``'s framework runs:
    Megatron-LM's arguments as given (None: on, its default since 2021-09 / 2022-02, for
    fp16 gradients since 2022-09);
    DeepSpeed's pipeline engine (Megatron-DeepSpeed): neither; other frameworks price their
    gradients themselves (fusion: no term here), and the two arguments, Megatron-LM's, must
    be left None; DeepSpeed at pp = 1 and tp > 1 runs Megatron-DeepSpeed's layer without the
    async all-reduce."""
    given = dict(zip(_NAMES, (async_tp, fusion)))
    for name, v in given.items():
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{name}={v!r} must be True, False or None (the framework's own)")
    if lay.engine == "deepspeed" and lay.pp > 1:
        on = [n for n, v in given.items() if v]
        if on:
            raise ValueError(f"{on[0]}=True with framework='deepspeed' and pp={lay.pp}: "
                             f"DeepSpeed's pipeline engine runs Megatron-DeepSpeed's layers, "
                             f"which have neither (microsoft acc3e9b5, bigscience 497aa1bf): "
                             f"leave it None or give False")
        return False, False
    if lay.engine != "megatron":
        set_ = [n for n, v in given.items() if v is not None]
        if set_:
            raise ValueError(f"{set_[0]}={given[set_[0]]!r} is a Megatron-LM argument; "
                             f"framework={lay.engine!r} prices its own gradient handling: "
                             f"leave it None, or use framework='megatron'")
        # DeepSpeed without a pipeline still runs Megatron-DeepSpeed's layers when tp > 1,
        # whose arguments turn the async all-reduce off whenever DeepSpeed runs them
        # (microsoft/Megatron-DeepSpeed f4157bea, megatron/arguments.py: "if
        # args.deepspeed: args.async_tensor_model_parallel_allreduce = False")
        return not (lay.engine.startswith("deepspeed") and lay.tp > 1), True
    return (True if async_tp is None else async_tp, True if fusion is None else fusion)


def accumulate_seconds(cfg, lay, psi: float, layers: int, prof, fusion: bool) -> float:
    """Seconds per micro-batch (the step's passes over its ``lay.m`` micro-batches) of the
    gradient accumulation outside the weight-gradient GEMM on a rank holding ``psi``
    parameters in ``layers`` layers (module docstring); 0 with ``fusion``."""
    if fusion or lay.engine not in ("megatron", "deepspeed") or \
            (lay.engine == "deepspeed" and cfg.dtype == "bfloat16"):
        return 0.0
    e = cfg.torch_dtype.itemsize
    if lay.engine == "megatron" and (cfg.dtype == "bfloat16" or lay.zero == 1):
        g = 4 if cfg.dtype == "bfloat16" else e          # contiguous buffers' hook
        per, passes = e + 2 * g, lay.m
    else:                                                # autograd's AccumulateGrad
        per, passes = 3 * e, lay.m - 1
    if passes <= 0 or psi <= 0:
        return 0.0
    one = compute_time(0.0, per * psi, prof, cfg.dtype, "elementwise",
                       launches=TENSORS_PER_LAYER * max(layers, 1))
    return passes / lay.m * one


def assumption(cfg, lay, async_tp: bool, fusion: bool) -> tuple:
    """The line ``Estimate.assumptions`` carries when either change is off (else none)."""
    if async_tp and fusion:
        return ()
    parts = []
    if not async_tp:
        parts.append("TP input-gradient all-reduces on the critical path (no async "
                     "all-reduce)")
    if not fusion:
        how = ("bf16: BF16_Optimizer's own fp32 accumulation" if lay.engine == "deepspeed"
               and cfg.dtype == "bfloat16" else
               "main_grad.add_ every micro-batch (contiguous buffers)"
               if lay.engine == "megatron" and (cfg.dtype == "bfloat16" or lay.zero == 1)
               else "autograd's in-place add on micro-batches 2..m")
        parts.append(f"gradient accumulation outside the GEMM ({how})")
    return (f"layers as {SOURCE}: " + "; ".join(parts),)
