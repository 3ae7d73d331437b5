"""The optimizer step DeepSpeed runs, for ``plan.optimizer_step`` (its conventions:
bytes read + written per parameter element, ``Pass``).

DeepSpeed: its fp16 pipeline engine's ``FP16_Optimizer`` (``plan.deepspeed_step.
FP16_OPTIMIZER_BYTES``) and its bf16 one's ``BF16_Optimizer`` (``plan.bf16_optimizer``)
as read there.  Spring 2021's ZeRO-3 (``"deepspeed-0.3"``; v0.3.16
``deepspeed/runtime/zero/stage3.py``, the same step in v0.3.13), on the rank's partition:
``has_overflow_partitioned_grads_serial`` (``:2857``) runs ``float(x.float().sum())``
(``:2899``, read 2 write 4 read 4) on each fp16 gradient partition, ``get_grad_norm_
direct`` ``g.data.double().norm(2)`` (``:2449``, read 2 write 8 read 8), each with a host
sync per tensor (not priced); ``_prepare_fp32_grad_for_sub_group`` flattens them and casts
to fp32 (``:2578``, 2 + 2 then 2 + 4); ``unscale_and_clip_grads`` always multiplies by
1 / the loss scale (``:2841``, 8); FusedAdam (``:1577``, 28); the fp32 partition copied to
the fp16 one (``:1581``, 4 + 2): 80 bytes.  DeepSpeed of today without a pipeline
(``"deepspeed"``, pp = 1, ZeRO 1-3; 38327e07f, v0.16.4+, 2025-02), on the partition, 16-bit
gradients (e = 2 bytes): ``stage_1_and_2.py`` ``step`` checks overflow only for fp16
(``has_overflow_partitioned_grads_serial``, ``_has_inf_or_nan``: ``x.float()``, ``isnan``,
``isinf``, ``logical_or``, ``.float()``, ``max`` per tensor, ``:2003``, ``:2032-2036``,
28 bytes), ``get_grad_norm_direct`` takes ``vector_norm(g.double())`` per tensor
(``:1699``, e + 8 + 8), flattens and casts the partition (``:1896``, e + e + e + 4;
fp32's ``.to`` returns the buffer itself: e + e),
``unscale_and_clip_grads`` multiplies by a clamped factor, always (``:1985``, 8), FusedAdam
(``:1820``, 28) and copies the fp32 partition into the 16-bit one (``:1920``, 4 + e): 70
bytes with bf16, 98 with fp16; ``stage3.py`` the same, but its fp16 check is
``isinf`` / ``isnan(...).any()`` on the flat gradient buffer (``:2212-2213``, 2 (e + 2))
and its lines ``:1797``, ``:1898``, ``:2187``, ``:987``, ``:2071``: 70 with bf16, 78 with
fp16.  With a pipeline and ZeRO-1 in fp16 (the 2021 engine) Adam alone, 28 bytes per
partitioned parameter (ASSUMPTION: that release's ZeRO-1 step not read).
"""
from __future__ import annotations

from . import bf16_optimizer as BF
from . import deepspeed_pipe as D
from . import deepspeed_step as DS
from .optimizer_pass import ADAM, ADAM_KERNEL, Pass

__all__ = ["DEEPSPEED", "passes"]

DEEPSPEED = "microsoft/DeepSpeed 38327e07f (v0.16.4+, 2025-02)"


def passes(cfg, lay) -> list[Pass]:
    """The optimizer step's passes of DeepSpeed's engine ``lay.engine`` (module docstring)."""
    if lay.engine == "deepspeed-0.3":    # stage3.py's step (module docstring), fp16
        if cfg.dtype != "float16":      # v0.3.16's runtime has no bfloat16 at all
            raise ValueError(f"framework='deepspeed-0.3' with model dtype={cfg.dtype!r}: "
                             f"DeepSpeed v0.3.13-0.3.16 trained in fp16 only (its runtime "
                             f"has no bfloat16); use model.replace(dtype='float16'), or "
                             f"framework='deepspeed' for today's ZeRO-3 in {cfg.dtype}")
        src = "microsoft/DeepSpeed v0.3.16 deepspeed/runtime/zero/stage3.py"
        return [Pass("overflow check, float(x.float().sum()) per gradient partition",
                     2 + 4 + 4, "shard", f"{src}:2857/2899", per_tensor=True, kernels=2),
                Pass("gradient norm, g.data.double().norm(2) per partition", 2 + 8 + 8,
                     "shard", f"{src}:2449", per_tensor=True, kernels=2),
                Pass("flatten the fp16 partitions, .to(fp32)", (2 + 2) + (2 + 4), "shard",
                     f"{src}:2578", kernels=2),
                Pass("unscale and clip, mul_(1 / combined_scale)", 4 + 4, "shard",
                     f"{src}:2841"),
                Pass("FusedAdam: p, g, m, v read; p, m, v written", ADAM, "shard",
                     f"{src}:1577", kernel=ADAM_KERNEL),
                Pass("fp32 partition copied to the fp16 one", 4 + 2, "shard", f"{src}:1581")]
    if lay.pp > 1 and cfg.dtype == "float16" and lay.zero == 0:
        src = f"{D.SOURCE} runtime/fp16/fused_optimizer.py (plan.deepspeed_step)"
        return [Pass(name, b, "psi", src) for name, b in DS.FP16_OPTIMIZER_BYTES]
    if lay.pp == 1 and lay.zero >= 1:     # today's ZeRO optimizers (module docstring)
        return _zero_today(cfg.dtype, lay.zero)
    adam = Pass("Adam on the partition (the planner's 28 B: ASSUMPTION)", ADAM, "shard",
                "sim_mesh.optimizer_cost.MIXED_ADAMW_BYTES", kernel=ADAM_KERNEL)
    if BF.applies(cfg, lay):
        src = BF.SOURCE
        return [Pass("gradient norm, fp32 gradients", BF.FP32_GRAD_BYTES, "psi", src),
                adam,
                Pass("update_lp_params, fp32 partition -> bf16", BF.PARTITION_BYTES,
                     "shard", src),
                Pass("clear_hp_grads, zero the fp32 buffer", BF.FP32_GRAD_BYTES, "psi", src)]
    return [adam]


def _zero_today(dtype: str, zero: int) -> list[Pass]:
    e = 2 if dtype in ("bfloat16", "float16") else 4     # the 16-bit gradient partitions
    if zero == 3:
        src, at = f"{DEEPSPEED} deepspeed/runtime/zero/stage3.py", (
            "2212-2213", "1797", "1898", "2187", "987", "2071")
        check = Pass("overflow check, isinf / isnan(flat buffer).any()", 2 * (e + 1 + 1),
                     "shard", f"{src}:{at[0]}", kernels=6)     # isinf any or_, isnan any or_
    else:
        src, at = f"{DEEPSPEED} deepspeed/runtime/zero/stage_1_and_2.py", (
            "2003/2032-2036", "1699", "1896", "1985", "1820", "1920")
        check = Pass("overflow check, x.float() isnan isinf logical_or float max",
                     (e + 4) + 2 * (4 + 1) + 3 + (1 + 4) + 4, "shard", f"{src}:{at[0]}",
                     per_tensor=True, kernels=7)   # the six, and += into the count
    out = [check] if dtype == "float16" else []      # bf16: no loss scaler, no check
    return out + [
        Pass("gradient norm, g.double() then its norm, per partition", e + 8 + 8, "shard",
             f"{src}:{at[1]}", per_tensor=True, kernels=2),     # .double(), the norm
        # .to(fp32) of an fp32 flat buffer returns it: no copy (fp32 runs: e = 4)
        Pass("flatten the partitions, .to(fp32)", (e + e) + ((e + 4) if e != 4 else 0),
             "shard", f"{src}:{at[2]}", kernels=2 if e != 4 else 1),
        Pass("unscale and clip, mul_(1 / combined_scale), always", 4 + 4, "shard",
             f"{src}:{at[3]}"),
        Pass("FusedAdam: p, g, m, v read; p, m, v written", ADAM, "shard", f"{src}:{at[4]}",
             kernel=ADAM_KERNEL),
        Pass("fp32 partition copied to the 16-bit one", 4 + e, "shard", f"{src}:{at[5]}")]
