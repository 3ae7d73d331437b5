"""The optimizer step each framework runs, as its source code runs it: every pass over
parameter-sized memory between the last backward and the next forward, in bytes per
parameter, summed here for ``plan.estimate`` and ``plan.dry_run`` alike.

Each pass is a memory-bound kernel (or a loop of them): its bytes are the tensor bytes
it reads plus those it writes per parameter element, over either every parameter of the
rank (``over="psi"``: gradient buffers are whole on every rank) or only the rank's
partition (``over="shard"``: psi / dp under ZeRO-1/2/3, else psi), priced on the
roofline by ``sim_mesh.cost.compute_time`` with one launch per pass, or one per
parameter tensor where the source loops over tensors (``per_tensor``).  The Adam update
(``Pass.kernel = "adamw_fused_fp32"``) moves at the rate the profile measured for it where
it has one (the H100's: ``torch.optim.AdamW(fused=True)``, a multi_tensor_apply kernel,
2,459.8 GB/s, 0.815 of the card's plain copy, ``sim_mesh/measurements/h100-sxm-80gb.json``;
FusedAdam and torch's foreach AdamW, multi_tensor_apply kernels too, ASSUMED at that
rate); every other pass, and Adam on a profile without the measurement, at the profile's
memory rate (``memory_bandwidth x memory_efficiency``, a plain copy's).  Communication
(the DP reduction, the distributed optimizer's all-gather) is priced elsewhere.

Megatron-LM (``Float16OptimizerWithFloat16Params``; apex / Transformer Engine
``FusedAdam``, ``multi_tensor_adam``: read p, g, m, v and write p, m, v in fp32, 28 bytes).
Three codes, chosen by the layout (:func:`era`):

- 2021, Narayanan et al. SC'21 (50a4b5fa02, scripts de7dc40f88: ``--fp16 --loss-scale
  8192``; ``gradient_accumulation_fusion=False`` selects it).  ``train_step`` calls
  ``optimizer.zero_grad()`` (``set_to_none=True``: no kernel, ``training.py:360``,
  ``optimizer.py:283``).  Local DDP without contiguous buffers (the pipeline rows,
  ``--DDP-impl local``) all-reduces through a flattened copy
  (``model/distributed.py:212-218``: ``_flatten_dense_tensors`` 2 + 2, ``/= dp`` 2 + 2,
  the copy back 2 + 2, a ``copy_`` per tensor); torch DDP (the pp = 1 rows:
  ``overlap_grad_reduce``) reduces in its own buckets (not priced here: ASSUMPTION).
  Then ``step``: ``main_param.grad = model_param.grad.float()`` (``optimizer.py:304/307``,
  read 2 write 4, a kernel per tensor), ``_amp_foreach_non_finite_check_and_unscale_``
  (``:330``, read and write the fp32 gradient, 8), ``multi_tensor_l2norm``
  (``clip_grads.py:90``, read 4), FusedAdam (``optimizer/__init__.py:16``,
  ``optimizer.py:410``, 28), ``_copy_main_params_to_model_params`` (``:356``, read 4
  write 2: a ``copy_`` per tensor, as with bf16, since ``_multi_tensor_copy_this_to_that``
  tests ``if overflow_buf:`` (``:53``) and fp16's ``IntTensor([0])`` is False, so apex's
  ``multi_tensor_scale`` never runs).
  bf16 forces fp32 contiguous buffers (``arguments.py:141-155``): as 2022 below.
- 2022, Korthikanti et al. (2e90a342f5; the default Megatron with ZeRO 0): local DDP
  with contiguous buffers (on by default, ``arguments.py:700``), fp32 for bf16
  (``:161``).  ``zero_grad_buffer`` (``training.py:412``, ``model/distributed.py:185``:
  write g, the buffer's bytes per element), ``allreduce_gradients``' ``buffer_.data /=
  dp`` (``distributed.py:200``, read and write g, run even at dp = 1), then ``step``:
  ``main_grad.float()`` (``optimizer.py:316``: a copy only for a 16-bit buffer,
  ``Tensor.float`` returns an fp32 tensor itself), unscale only with a loss scaler
  (fp16; bf16 has none, ``optimizer/__init__.py``), the norm (``clip_grads.py:92``),
  FusedAdam (``optimizer.py:436``), the copy to the model's weights (``:382``; bf16
  has no apex kernel, ``_dummy_overflow_buf = None``: a ``copy_`` per tensor, ``:61``).
- 2024, the distributed optimizer (f2e5db402c, ZeRO-1: ``zero=1``, at dp x cp = 1 too:
  ``get_megatron_optimizer`` builds it whatever the data-parallel size,
  ``core/optimizer/__init__.py:256``; ``search`` lists ZeRO-0 only there).
  Per step on the
  whole fp32 buffer (``megatron/core/distributed/param_and_grad_buffer.py``):
  ``grad_data.zero_()`` (``:508``, from ``training/training.py:585``), before each
  bucket's reduce-scatter the NaN check ``grad_data.norm(p=2)`` (``:111-118``;
  ``--check-for-nan-in-loss-and-grad`` on by default, ``training/arguments.py:1016``,
  off for fp16 with a dynamic loss scale, ``:292-295``: fp16 priced with it off,
  ASSUMPTION) and ``grad_data *= 1/dp`` (``:122-123``, ``distributed_data_parallel.py:
  156-157``: ``get_data_parallel_world_size()`` without cp, so only when dp > 1).  On
  the rank's shard (``core/optimizer/distrib_optimizer.py``): ``shard_model_grad.float()``
  (``:1520``, a copy only for a 16-bit buffer), unscale with fp16 (``optimizer.py:348``),
  the norm (``clip_grads.py:98``), Adam (``optimizer.py:406``; Transformer Engine's
  FusedAdam, ``optimizer/__init__.py:8``), the copy into the bf16 parameter buffer
  (``distrib_optimizer.py:1552``, a ``copy_`` per tensor).

Clipping (``multi_tensor_scale`` of the gradients, ``clip_grads.py:113`` / ``:114`` /
``:147``)
runs only when the norm exceeds ``--clip-grad``: not priced (ASSUMPTION, as
``plan.bf16_optimizer``); nor ``--log-num-zeros-in-grad`` (off by default).

DeepSpeed (``"deepspeed"``, ``"deepspeed-0.3"``): ``plan.optimizer_step_deepspeed``.

FSDP2 as torchtitan runs it (9dec370ad2): ``clip_grad_norm_(..., foreach=True)``
(``train.py:311``) over the fp32 gradient shards: ``torch._foreach_norm`` (read 4) and
an unconditional ``torch._foreach_mul_`` by the clamped coefficient (read 4 write 4;
``torch/nn/utils/clip_grad.py``, torch 2.13, "avoids a ``if clip_coef < 1:``
conditional"), then ``torch.optim.AdamW`` with ``foreach=True`` (``--optimizer.fused``
off by default, ``config_manager.py:194``, ``optimizer.py:137-138``) and weight decay
0.1: ``sim_mesh.optimizer_cost.adam_kernels``' 20 fp32 accesses in 8 kernels (torch
2.13's ``_multi_tensor_adam``, taken for the late-2024 torch that release ran:
ASSUMPTION); ``zero_grad`` sets gradients to None.

``"workbench"`` (this library's recipe, the dry run's): ``sim_mesh.optimizer_cost.
MIXED_ADAMW_BYTES`` on the rank's updated parameters, one kernel.
"""
from __future__ import annotations

import math

from ..sim_mesh.cost import compute_time
from ..sim_mesh.optimizer_cost import MIXED_ADAMW_BYTES, adam_kernels
from . import optimizer_step_deepspeed as DSO
from .optimizer_pass import ADAM, ADAM_KERNEL, Pass

__all__ = ["Pass", "MEGATRON", "ERAS", "era", "passes", "step_bytes", "step_seconds",
           "assumption"]

_M21, _M22, _M24 = ("NVIDIA/Megatron-LM 50a4b5fa02 (2021-04)",
                    "NVIDIA/Megatron-LM 2e90a342f5 (2022-05)",
                    "NVIDIA/Megatron-LM f2e5db402c (2024-07)")
MEGATRON = {"2021": _M21, "2022": _M22, "2024": _M24}
ERAS = tuple(MEGATRON)


def era(lay, fusion: bool) -> str:
    """Which Megatron-LM code a Megatron layout runs (module docstring): the distributed
    optimizer's with ZeRO-1 (``--use-distributed-optimizer``), Narayanan et al.'s
    without gradient accumulation fusion (``plan.megatron_2021``), else Korthikanti et
    al.'s.  At dp x cp = 1 ZeRO-1 still runs the distributed optimizer's code (f2e5db402c
    ``megatron/core/optimizer/__init__.py:256`` has no data-parallel condition), its
    partition the whole; ``search`` lists ZeRO-0 only there."""
    if lay.zero == 1:
        return "2024"
    return "2021" if not fusion else "2022"


def _megatron(dtype: str, lay, when: str, overlap_grad_reduce: bool) -> list[Pass]:
    src = MEGATRON[when]
    bf16, fp16 = dtype == "bfloat16", dtype == "float16"
    g = 2 if fp16 else 4              # the gradient buffer's element (frameworks.py)
    out = []
    if when == "2024":
        dist = "megatron/core/distributed/param_and_grad_buffer.py"
        out.append(Pass("zero the fp32/16-bit grad buffer (grad_data.zero_())", g, "psi",
                        f"{src} {dist}:508"))
        if not fp16:                  # fp16 here: dynamic loss scale, check off (bf16, fp32: on)
            out.append(Pass("NaN check, grad_data.norm(p=2)", g, "psi", f"{src} {dist}:111-118"))
        if lay.dp > 1:                # the factor is 1 / dp without cp (:156-157): 1.0 skips
            out.append(Pass("grad_data *= 1/dp", 2 * g, "psi", f"{src} {dist}:122-123"))
        opt = "megatron/core/optimizer/distrib_optimizer.py"
        copy_in, copy_out = f"{src} {opt}:1520", f"{src} {opt}:1552"
        unscale = f"{src} megatron/core/optimizer/optimizer.py:348"
        norm = f"{src} megatron/core/optimizer/clip_grads.py:98"
        adam = f"{src} megatron/core/optimizer/optimizer.py:406"
    else:
        contiguous = bf16 or when == "2022"     # 2021: forced only by bf16
        dist = "megatron/model/distributed.py"
        if contiguous:
            out += [Pass("zero_grad_buffer, buffer_.zero()", g, "psi",
                         f"{src} {dist}:185"),
                    Pass("allreduce_gradients: buffer_.data /= dp", 2 * g, "psi",
                         f"{src} {dist}:{200 if when == '2022' else 193}")]
        elif not overlap_grad_reduce:  # local DDP, no contiguous buffers
            out += [Pass("allreduce_gradients: flatten, /= dp", 2 * 2 * g, "psi",
                         f"{src} {dist}:212-213", kernels=2),      # a cat, a div_ per dtype
                    Pass("allreduce_gradients: copy back, buf.copy_ per tensor", 2 * g,
                         "psi", f"{src} {dist}:216-218", per_tensor=True)]
        line = {"2021": ("304/307", 330, 90, 410, 356),
                "2022": ("316", 356, 92, 436, 382)}[when]
        opt = "megatron/optimizer/optimizer.py"
        copy_in, copy_out = f"{src} {opt}:{line[0]}", f"{src} {opt}:{line[4]}"
        unscale = f"{src} {opt}:{line[1]}"
        norm = f"{src} megatron/optimizer/clip_grads.py:{line[2]}"
        adam = f"{src} {opt}:{line[3]}"
    if g == 2:                        # a 16-bit buffer: .float() copies
        out.append(Pass("model grads to fp32 main grads, .float()", 2 + 4, "shard",
                        copy_in, per_tensor=True))
    if fp16:                          # fp16's loss scaler
        out.append(Pass("unscale + inf check (_amp_foreach_non_finite_check_and_unscale_)",
                        4 + 4, "shard", unscale))
    out += [Pass("gradient norm (multi_tensor_l2norm)", 4, "shard", norm),
            Pass("FusedAdam (multi_tensor_adam): p, g, m, v read; p, m, v written", ADAM,
                 "shard", adam, kernel=ADAM_KERNEL)]
    if bf16 or fp16:                  # fp32 (FP32Optimizer): no main copy
        # a copy_ per tensor in every era: 2021/2022's _multi_tensor_copy_this_to_that
        # tests ``if overflow_buf:``, and fp16's IntTensor([0]) is False (optimizer.py:53)
        out.append(Pass("fp32 main params to 16-bit params", 4 + 2, "shard", copy_out,
                        per_tensor=True))
    return out


def passes(cfg, lay, fusion: bool = True, overlap_grad_reduce: bool = False) -> tuple:
    """The optimizer step's passes on a rank of ``lay`` (its ``engine``) for ``cfg``'s
    dtype (module docstring); ``fusion``: Megatron-LM's gradient accumulation fusion as
    ``estimate`` resolved it (False: the 2021 code)."""
    fw = lay.engine
    if fw == "megatron":
        return tuple(_megatron(cfg.dtype, lay, era(lay, fusion), overlap_grad_reduce))
    if fw in ("deepspeed", "deepspeed-0.3"):
        return tuple(DSO.passes(cfg, lay))
    if fw == "fsdp":
        k = adam_kernels(decoupled=True, weight_decay=0.1, fused=False, foreach=True)
        src = "pytorch/torchtitan 9dec370ad2 train.py:311; torch 2.13 "
        return (Pass("clip_grad_norm_: torch._foreach_norm", 4, "shard",
                     src + "torch/nn/utils/clip_grad.py"),
                Pass("clip_grad_norm_: torch._foreach_mul_ (unconditional)", 4 + 4, "shard",
                     src + "torch/nn/utils/clip_grad.py"),
                Pass(f"AdamW foreach, weight decay 0.1 ({k.accesses} fp32 accesses)",
                     4 * k.accesses, "shard", src + "torch/optim/adam.py", kernels=k.launches,
                     kernel=ADAM_KERNEL))
    if fw == "workbench":
        return (Pass("mixed-precision AdamW, one fused kernel", MIXED_ADAMW_BYTES, "shard",
                     "sim_mesh.optimizer_cost.MIXED_ADAMW_BYTES"),)
    raise ValueError(f"passes: layout framework={fw!r} has no optimizer step here; use "
                     f"one of 'megatron', 'deepspeed', 'deepspeed-0.3', 'fsdp', 'workbench'")


def _check(psi, updated, tensors):
    for name, v in (("psi", psi), ("updated", updated), ("tensors", tensors)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0:
            raise ValueError(f"{name}={v!r} must be a finite number >= 0")


def step_bytes(table, psi: float, updated: float) -> float:
    """Bytes the passes move on a rank holding ``psi`` parameters and updating
    ``updated`` of them (its partition: psi / dp under ZeRO, else psi)."""
    _check(psi, updated, 0)
    return sum(p.nbytes * (psi if p.over == "psi" else updated) for p in table)


def step_seconds(table, psi: float, updated: float, prof, tensors: int = 1) -> float:
    """Seconds of the passes on the roofline (``compute_time``), memory bound, on a rank
    of ``psi`` parameters in ``tensors`` tensors, ``updated`` of them its own: each
    pass at its kernel's measured rate where the profile has one (``Pass.kernel``: the
    Adam update at ``kernel_bandwidth["adamw_fused_fp32"]``), the others at the
    profile's memory rate (module docstring)."""
    _check(psi, updated, tensors)
    total = 0.0
    for kernel in dict.fromkeys(p.kernel for p in table):
        group = [p for p in table if p.kernel == kernel]
        launches = sum(tensors * p.kernels if p.per_tensor else p.kernels for p in group)
        total += compute_time(0.0, step_bytes(group, psi, updated), prof, "float32",
                              launches=int(launches), kernel=kernel)
    return total


def assumption(lay, table) -> str:
    """The line ``Estimate.assumptions`` carries: whose step, its bytes per parameter."""
    full = sum(p.nbytes for p in table if p.over == "psi")
    shard = sum(p.nbytes for p in table if p.over == "shard")
    codes = sorted({" ".join(p.source.split(" ")[:2]) for p in table})
    if lay.engine == "fsdp":
        clip = "; clipping's multiply priced (torch's clip_grad_norm_ always runs it)"
    elif any("clip" in p.name for p in table):        # FP16_Optimizer: with the unscale
        clip = "; unscale and clip priced as one multiply"
    elif lay.engine == "deepspeed" and len(table) == 1:
        clip = (f"; DeepSpeed's {f'ZeRO-{lay.zero}' if lay.zero else 'non-ZeRO'} optimizer "
                f"step beyond Adam not read (ASSUMPTION)")
    elif lay.engine == "workbench":
        clip = ""
    else:
        clip = ("; clipping's multiply not priced (it runs only when the norm exceeds "
                "the limit: ASSUMPTION)")
    if any(p.source.startswith(_M24) for p in table) and \
            any(p.name.startswith("unscale") for p in table):       # fp16 (module docstring)
        clip += ("; the NaN check grad_data.norm not priced (fp16 with a dynamic loss scale "
                 "turns it off; a static --loss-scale runs it: ASSUMPTION)")
    split = lay.zero >= 1 and lay.dp * lay.cp > 1  # a 1/dp partition to update
    if not split or not shard or not full:         # one figure per parameter
        size = f"{full + shard:g} B per {'partitioned ' if not full and split else ''}" \
               f"parameter"
    else:
        size = f"{full:g} B per parameter of the rank + {shard:g} B per parameter of its " \
               f"1/dp partition"
    return (f"optimizer step as {'; '.join(codes)} runs it (plan.optimizer_step): {size}, "
            f"memory bound{clip}")
