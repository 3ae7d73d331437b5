"""Megatron-LM's layer of 2021 (``plan.megatron_2021``): the TP input-gradient all-reduce
on the critical path (before ``--async-tensor-model-parallel-allreduce``) and the gradient
accumulation outside the weight-gradient GEMM (before ``--gradient-accumulation-fusion``),
each held to a hand computation from the profile's cited figures."""
import pytest

import workbench as wb
from workbench.plan import megatron_2021 as M
from workbench.plan import megatron_hook_add as HA
from workbench.plan.layer_cost import layer_ops, layer_times
from workbench.plan.memory import stage_params
from workbench.sim_mesh import cost
from workbench.sim_mesh.profiles import get_profile

A100 = get_profile("a100")
# one layer of the 530B (Narayanan Table 1, MT-NLG): h 20480, 128 heads, tp 8, fp16
BIG = dict(h=20480, a=128, s=2048, b=1, tp=8, recompute="full", dtype="float16",
           profile="a100")


def _ops(**kw):
    return {(o.phase, o.name): o for o in layer_ops(**{**BIG, **kw})}


def test_sync_allreduce_is_exposed_at_nccl_price():
    sync, asyn = _ops(async_allreduce=False), _ops()
    ar = cost.price("all_reduce", 2 * 2048 * 20480, list(range(8)), A100)
    for n in ("tp_grad_fc1", "tp_grad_qkv"):
        assert sync[("backward", n)].exposed == pytest.approx(ar)   # on the critical path
        assert sync[("backward", n)].overlaps == ""
        assert asyn[("backward", n)].exposed == 0.0                  # beside its wgrad GEMM
    # the wgrad GEMMs run on all the SMs (no NCCL kernel beside them): the plain GEMM price
    for g in ("fc1_wgrad", "qkv_wgrad"):
        plain = sync[("backward", g)].seconds
        assert asyn[("backward", g)].seconds > plain
    stretch = sum(asyn[("backward", g)].seconds - sync[("backward", g)].seconds
                  for g in ("fc1_wgrad", "qkv_wgrad"))
    d = layer_times(**BIG, async_allreduce=False).backward - layer_times(**BIG).backward
    assert d == pytest.approx(2 * ar - stretch, rel=1e-9)
    assert 2 * ar > 1.3e-3            # 84 MB twice over NVLink: about 1.36 ms per layer
    # the forward is the same code in both
    assert layer_times(**BIG, async_allreduce=False).forward == layer_times(**BIG).forward


def test_sequence_parallel_reduce_scatter_stays_beside_its_gemm():
    # Megatron-LM issues SP's reduce-scatter with async_op=True whatever the flag
    # (core/tensor_parallel/layers.py c2ea914f7d: the flag and SP are exclusive)
    kw = dict(BIG, recompute="selective", sp=True)
    assert layer_times(**kw, async_allreduce=False) == layer_times(**kw)


def test_bad_async_argument_refused():
    with pytest.raises(ValueError, match="async_allreduce"):
        layer_times(**BIG, async_allreduce="no")
    # a Llama block without the async all-reduce is priced (Megatron-DeepSpeed's, under
    # DeepSpeed): tests/test_review_revE.py


def _lay(engine=None, pp=35, dp=8, zero=0, m_batch=1920):
    return wb.plan.Layout(dp=dp, tp=8, pp=pp, recompute="full", micro_batch=1,
                          global_batch=m_batch, zero=zero, framework=engine)


def _cfg(dtype="float16"):
    return wb.models.ModelConfig(arch="gpt", vocab_size=51200, seq_len=2048, n_layer=105,
                                 n_head=128, d_model=20480, dtype=dtype, tie_embeddings=True)


def test_accumulation_by_autograd_hand_computed():
    # fp16, no contiguous buffers: AccumulateGrad's in-place add on micro-batches 2..m,
    # read two fp16 tensors and write one (6 bytes per parameter) at the A100's measured
    # 0.88 of 2,039 GB/s, one launch (1 us) per parameter tensor
    cfg, lay = _cfg(), _lay()
    psi = 3 * 12 * 20480 ** 2 / 8
    one = 6 * psi / (2039e9 * 0.88) + 36 * 1e-6
    got = M.accumulate_seconds(cfg, lay, psi, 3, A100, fusion=False)
    assert got == pytest.approx((lay.m - 1) / lay.m * one, rel=1e-6)
    assert 6.0e-3 < one < 6.6e-3                 # 3.8 GB a stage of the 530B: ~6.3 ms
    assert M.accumulate_seconds(cfg, lay, psi, 3, A100, fusion=True) == 0.0
    # one micro-batch per step: autograd keeps the gradient, nothing is added
    single = _lay(pp=35, m_batch=8)
    assert single.m == 1
    assert M.accumulate_seconds(cfg, single, psi, 3, A100, fusion=False) == 0.0


def test_accumulation_into_contiguous_buffers_every_micro_batch():
    # bf16 forces Megatron's fp32 main_grad buffer: main_grad.add_(grad) each micro-batch,
    # read 2 + read 4 + write 4 bytes per parameter
    cfg, lay = _cfg("bfloat16"), _lay()
    psi = 1e9
    want = 10 * psi / (2039e9 * 0.88) + 36 * 1e-6
    assert M.accumulate_seconds(cfg, lay, psi, 3, A100, fusion=False) == \
        pytest.approx(want, rel=1e-6)
    # DeepSpeed's bf16 pipeline engine accumulates in its BF16_Optimizer (priced there)
    assert M.accumulate_seconds(cfg, _lay("deepspeed"), psi, 3, A100, fusion=False) == 0.0


def test_resolve_by_framework():
    assert M.resolve(_lay(), None, None) == (True, True)         # Megatron-LM today
    assert M.resolve(_lay(), False, None) == (False, True)
    assert M.resolve(_lay("deepspeed"), None, None) == (False, False)   # Megatron-DeepSpeed
    with pytest.raises(ValueError, match="Megatron-DeepSpeed"):
        M.resolve(_lay("deepspeed"), True, None)
    zero3 = wb.plan.Layout(dp=64, zero=3, recompute="full", micro_batch=1, global_batch=64,
                           framework="fsdp")
    assert M.resolve(zero3, None, None) == (True, True)
    with pytest.raises(ValueError, match="gradient_accumulation_fusion"):
        M.resolve(zero3, None, False)
    with pytest.raises(ValueError, match="True, False or None"):
        M.resolve(_lay(), 0, None)


def test_estimate_adds_both_terms_to_the_stage():
    cfg, lay = _cfg(), _lay()
    cl = wb.plan.Cluster("a100", lay.dp * lay.tp * lay.pp)
    new = wb.plan.estimate(cfg, lay, cl)
    old = wb.plan.estimate(cfg, lay, cl, async_tensor_model_parallel_allreduce=False,
                           gradient_accumulation_fusion=False)
    lt_new = layer_times(**BIG)
    lt_old = layer_times(**BIG, async_allreduce=False)
    psi = stage_params(cfg, 8, 35, 17, 3)
    acc = M.accumulate_seconds(cfg, lay, psi, 3, A100, fusion=False)
    mid_new, mid_old = new.details["stages"]["middle"], old.details["stages"]["middle"]
    # with the fusion, Megatron's hook still adds the norms' and biases' gradients
    # (plan.megatron_hook_add, tests/test_megatron_hook_add.py)
    hook = HA.hook_add_seconds(cfg, lay, 17, 3, A100, fusion=True)
    want = 3 * (lt_old.combined - lt_new.combined) + acc - hook
    assert mid_old["time"] - mid_new["time"] == pytest.approx(want, rel=1e-6)
    assert old.step_time > new.step_time
    assert any("gradient accumulation outside the GEMM" in a for a in old.assumptions())
    assert not any("83b1e42f30" in a for a in new.assumptions())


def test_deepspeed_pipeline_runs_megatron_deepspeed_layers():
    # framework="deepspeed" with pp > 1 is Megatron-DeepSpeed on DeepSpeed's engine: its
    # layers without the async all-reduce, the fp16 gradients accumulated by autograd
    cfg, lay = _cfg(), _lay("deepspeed")
    cl = wb.plan.Cluster("a100", 2240)
    est = wb.plan.estimate(cfg, lay, cl)
    same = wb.plan.estimate(cfg, lay, cl, async_tensor_model_parallel_allreduce=False,
                            gradient_accumulation_fusion=False)
    assert est.step_time == same.step_time
    assert est.details["layer"].bwd_compute == pytest.approx(
        layer_times(**BIG, async_allreduce=False, dropout=cfg.dropout > 0).backward
        - est.details["layer"].bwd_comm)
    with pytest.raises(ValueError, match="neither"):
        wb.plan.estimate(cfg, lay, cl, gradient_accumulation_fusion=True)


def test_estimate_reports_the_accumulation_per_micro_batch():
    cfg, lay = _cfg(), _lay()
    cl = wb.plan.Cluster("a100", lay.dp * lay.tp * lay.pp)
    old = wb.plan.estimate(cfg, lay, cl, gradient_accumulation_fusion=False)
    slow = old.details["stages"]
    name = [k for k, d in slow.items() if d["stage"] == old.details["slowest_stage"]][0]
    assert old.details["grad_accumulation"] == slow[name]["grad_accumulation"] > 0
    # with the fusion only the hook's unfused tensors (plan.megatron_hook_add) remain
    new = wb.plan.estimate(cfg, lay, cl)
    s = new.details["slowest_stage"]
    n_layers = lay.stage_layers(cfg.n_layer)[s]
    assert new.details["grad_accumulation"] == pytest.approx(
        HA.hook_add_seconds(cfg, lay, s, n_layers, A100, fusion=True))
    assert 0 < new.details["grad_accumulation"] < old.details["grad_accumulation"] / 100


def test_published_table1_rows_run_the_2021_layer():
    # benchmarks/published.py prices Narayanan's Table 1 as its code ran (50a4b5fa02):
    # the 530B row, tp 8, with the 2021 layer is slower than with today's
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "published.py"
    spec = importlib.util.spec_from_file_location("published_for_plan21", path)
    P = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(P)
    row = next(r for r in P.ROWS if r["source"] == "narayanan" and r["name"] == "GPT 530B")
    assert row["megatron_args"] == dict(async_tensor_model_parallel_allreduce=False,
                                        gradient_accumulation_fusion=False)
    cfg, lay, cl = P.build(row)
    then = P.predict(row)["estimate"]
    now = wb.plan.estimate(cfg, lay, cl)
    assert then.step_time > now.step_time
    assert any("16c90445e7" in a for a in then.assumptions())


def test_deepspeed_without_pipeline_runs_megatron_deepspeed_layer_synchronously():
    """DeepSpeed at pp = 1 with tp > 1 runs Megatron-DeepSpeed's layer, whose arguments turn
    the async TP all-reduce off under DeepSpeed (f4157bea megatron/arguments.py): the
    input-gradient all-reduces sit on the critical path, as at pp > 1; tp = 1 has none."""
    from workbench.plan import megatron_2021
    ds = wb.plan.Layout(dp=2, tp=2, pp=1, zero=1, framework="deepspeed")
    assert megatron_2021.resolve(ds, None, None) == (False, True)
    ds1 = wb.plan.Layout(dp=4, tp=1, pp=1, zero=1, framework="deepspeed")
    assert megatron_2021.resolve(ds1, None, None) == (True, True)
    mg = wb.plan.Layout(dp=2, tp=2, pp=1, zero=1)
    assert megatron_2021.resolve(mg, None, None) == (True, True)
