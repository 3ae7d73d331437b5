"""Review revJ of the optstep merge (plan/optimizer_step.py): each defect found against the
cited framework source, held by a test that fails on the code before the fix.

- Megatron-LM 50a4b5fa02 / 2e90a342f5 ``_multi_tensor_copy_this_to_that`` (optimizer.py:48-62)
  runs apex's ``multi_tensor_scale`` only ``if overflow_buf:``; fp16's ``_dummy_overflow_buf``
  is ``torch.cuda.IntTensor([0])`` (:215 / :222), whose truth value is False: the fp32 -> fp16
  copy is a ``copy_`` per tensor in fp16 as in bf16 (was priced as one launch).
- f2e5db402c ``gradient_scaling_factor = 1.0 / get_data_parallel_world_size()``
  (distributed_data_parallel.py:156-157, without context parallelism) and
  ``if self.gradient_scaling_factor != 1.0`` (param_and_grad_buffer.py:122): dp = 1, cp > 1
  runs no multiply (was priced 8 B per parameter).
- f2e5db402c's NaN check (param_and_grad_buffer.py:111-113) is off only for fp16 with a
  dynamic loss scale (training/arguments.py:292-295): fp32 runs it (was bf16 only).
- ``--use-distributed-optimizer`` at dp x cp = 1: ``get_megatron_optimizer`` builds the
  DistributedOptimizer whatever the data-parallel size (core/optimizer/__init__.py:256);
  was priced as the 2022 non-distributed code (its /= dp pass included).
- DeepSpeed 38327e07f stage_1_and_2.py:1896 / stage3.py:1898 ``.to(fp32)`` of an fp32
  flat partition returns it (torch ``Tensor.to`` with the same dtype): no copy (was 8 B).
"""
from __future__ import annotations

import pytest
import torch

from workbench.models import get_config
from workbench.plan import Layout
from workbench.plan import optimizer_step as OS
from workbench.sim_mesh.cost import compute_time
from workbench.sim_mesh.profiles import get_profile

A100 = get_profile("a100")
PSI = 1.3e9


def _cfg(dtype):
    return get_config("gpt3-175b", n_layer=8, d_model=1024, n_head=8, seq_len=512, dtype=dtype)


def _split(table):
    return (sum(p.nbytes for p in table if p.over == "psi"),
            sum(p.nbytes for p in table if p.over == "shard"))


def test_the_falsy_overflow_buffer_is_what_megatron_tests():
    # torch's truth value of a one-element zero tensor, the test apex's path depends on
    assert not bool(torch.tensor([0], dtype=torch.int32))


@pytest.mark.parametrize("fusion,overlap,lay", [(False, False, Layout(dp=4, tp=2, pp=2)),
                                                (False, True, Layout(dp=4, tp=2)),
                                                (True, False, Layout(dp=2, tp=4))])
def test_megatron_fp16_copy_to_model_params_is_a_copy_per_tensor(fusion, overlap, lay):
    table = OS.passes(_cfg("float16"), lay, fusion, overlap)
    copy = [p for p in table if "16-bit params" in p.name]
    assert len(copy) == 1 and copy[0].per_tensor and copy[0].nbytes == 6
    full, shard = _split(table)
    launches = sum(96 * p.kernels if p.per_tensor else p.kernels for p in table)
    assert OS.step_seconds(table, PSI, PSI, A100, tensors=96) == pytest.approx(
        compute_time(0.0, (full + shard) * PSI, A100, "float32", launches=launches),
        rel=1e-12)
    # .float() and the copy per tensor; local DDP without buffers: its copy back too
    looped = 3 if not (fusion or overlap) else 2
    assert launches == looped * 96 + sum(p.kernels for p in table if not p.per_tensor)


def test_local_ddp_copy_back_is_a_copy_per_tensor():
    # 50a4b5fa02 model/distributed.py:216-218: for buf, synced in zip(...): buf.copy_(synced)
    table = OS.passes(_cfg("float16"), Layout(dp=4, tp=2, pp=2), False, False)
    ddp = [p for p in table if p.name.startswith("allreduce_gradients")]
    assert [(p.nbytes, p.over, p.per_tensor, p.kernels) for p in ddp] == [
        (8, "psi", False, 2), (4, "psi", True, 1)]


@pytest.mark.parametrize("fw,zero,dtype,per_tensor_kernels,flat_kernels", [
    ("deepspeed-0.3", 3, "float16", 2 + 2, 2 + 1 + 1 + 1),   # float+sum, double+norm
    ("deepspeed", 1, "float16", 7 + 2, 2 + 1 + 1 + 1),       # _has_inf_or_nan's 7, norm 2
    ("deepspeed", 3, "float16", 2, 6 + 2 + 1 + 1 + 1),       # flat isinf/isnan checks: 6
    ("deepspeed", 2, "bfloat16", 2, 2 + 1 + 1 + 1)])
def test_per_tensor_loops_launch_each_kernel_per_tensor(fw, zero, dtype, per_tensor_kernels,
                                                        flat_kernels):
    table = OS.passes(_cfg(dtype), Layout(dp=8, zero=zero, framework=fw))
    full, shard = _split(table)
    assert OS.step_seconds(table, PSI, PSI / 8, A100, tensors=50) == pytest.approx(
        compute_time(0.0, shard * PSI / 8, A100, "float32",
                     launches=50 * per_tensor_kernels + flat_kernels), rel=1e-12)


def test_distributed_optimizer_scales_by_dp_not_dp_times_cp():
    names = lambda lay: [p.name for p in OS.passes(_cfg("bfloat16"), lay)]  # noqa: E731
    assert "grad_data *= 1/dp" not in names(Layout(dp=1, cp=2, tp=4, zero=1))
    assert "grad_data *= 1/dp" in names(Layout(dp=2, cp=2, tp=2, zero=1))
    assert _split(OS.passes(_cfg("bfloat16"), Layout(dp=1, cp=2, tp=4, zero=1))) == (8, 38)


def test_distributed_optimizer_nan_check_runs_in_fp32():
    table = OS.passes(_cfg("float32"), Layout(dp=8, zero=1))
    assert any(p.name.startswith("NaN check") for p in table)
    assert _split(table) == (4 + 4 + 8, 4 + 28)          # no 16-bit copies in fp32
    fp16 = OS.passes(_cfg("float16"), Layout(dp=8, zero=1))   # dynamic scale: off
    assert not any(p.name.startswith("NaN check") for p in fp16)


def test_zero1_at_one_data_parallel_rank_runs_the_distributed_optimizer():
    lay = Layout(dp=1, tp=8, zero=1)
    assert OS.era(lay, True) == OS.era(lay, False) == "2024"
    table = OS.passes(_cfg("bfloat16"), lay, True)
    assert all("f2e5db402c" in p.source for p in table)
    assert _split(table) == (4 + 4, 4 + 28 + 6)           # zero, NaN check; no 1/dp
    # ZeRO-0 stays the 2022 code (its /= dp runs even at dp = 1)
    assert _split(OS.passes(_cfg("bfloat16"), Layout(tp=8), True)) == (12, 38)
    a = OS.assumption(lay, table)
    assert "f2e5db402c" in a and "46 B per parameter" in a


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_deepspeed_fp32_partition_is_not_cast(zero):
    table = OS.passes(_cfg("float32"), Layout(dp=8, zero=zero, framework="deepspeed"))
    flat = [p for p in table if p.name.startswith("flatten")]
    assert len(flat) == 1 and flat[0].nbytes == 4 + 4 and flat[0].kernels == 1
    # norm of g.double() 4+8+8, flatten 4+4, unscale 8, Adam 28, copy 4+4
    assert _split(table) == (0, 20 + 8 + 8 + 28 + 8)
    g = torch.ones(3)
    assert g.to(torch.float32) is g                       # the no-op the count relies on


def test_deepspeed_0_3_refuses_bf16_naming_the_fix():
    import workbench as wb
    lay = Layout(dp=8, zero=3, global_batch=8, framework="deepspeed-0.3")
    with pytest.raises(ValueError, match=r"dtype='bfloat16'.*model.replace\(dtype='float16'\)"):
        OS.passes(_cfg("bfloat16"), lay)
    with pytest.raises(ValueError, match="deepspeed-0.3"):
        wb.plan.estimate(_cfg("bfloat16"), lay, wb.plan.Cluster("a100", 8))
    assert _split(OS.passes(_cfg("float16"), lay)) == (0, 80)


def test_deepspeed_assumption_names_the_stage_it_did_not_read():
    for zero, want in ((0, "non-ZeRO optimizer step"), (1, "ZeRO-1 optimizer step")):
        lay = Layout(dp=2, pp=2, zero=zero, framework="deepspeed") if zero else \
            Layout(dp=2, zero=0, framework="deepspeed")
        cfg = _cfg("float16" if zero else "bfloat16")
        table = OS.passes(cfg, lay)
        assert len(table) == 1 and want in OS.assumption(lay, table)


@pytest.mark.parametrize("lay", [
    Layout(dp=2, tp=1, pp=2, global_batch=8, recompute="full", zero=1),
    Layout(dp=2, tp=2, pp=1, global_batch=4, zero=3),
    Layout(dp=1, tp=4, pp=1, global_batch=2, sp=True)], ids=lambda l: l.short())
def test_dry_run_and_estimate_price_the_same_step(lay):
    # the dry run prices the recipe's update with the estimate's framework "workbench"
    # table (plan.optimizer_step); both read the same parameters per rank
    import workbench as wb
    cfg = get_config("gpt3-175b", n_layer=2, d_model=1024, n_head=16, seq_len=1024)
    cl = wb.plan.Cluster("a100", lay.world)
    dr = wb.plan.dry_run(cfg, lay, cl)
    est = wb.plan.estimate(cfg, lay.replace(framework="workbench"), cl, attention="flash")
    assert _split(est.details["optimizer_passes"]) == (0, 28)
    assert dr.breakdown["optimizer"] == pytest.approx(est.details["optimizer"], rel=1e-9)


def test_fp16_distributed_optimizer_states_its_nan_check_assumption():
    lay = Layout(dp=8, zero=1)
    fp16 = OS.passes(_cfg("float16"), lay)
    assert "static --loss-scale runs it: ASSUMPTION" in OS.assumption(lay, fp16)
    bf16 = OS.passes(_cfg("bfloat16"), lay)
    assert "static --loss-scale" not in OS.assumption(lay, bf16)
    old = OS.passes(_cfg("float16"), Layout(dp=8), True)           # 2022: no such check
    assert "static --loss-scale" not in OS.assumption(Layout(dp=8), old)
