"""Review of today's planner change plan.megatron_2021 and its hooks (reviewer revE).

Each test named for a defect failed before its fix (named in its docstring)."""
import pytest

import workbench as wb
from workbench.plan.layer_cost import layer_ops, layer_times
from workbench.sim_mesh import cost

# a small Llama block (GQA, fused attention), tp 2, fp16
LL = dict(h=1024, a=16, s=2048, b=1, tp=2, dtype="float16", profile="a100",
          attention="flash", kv_heads=4)


def _llama(n_layer=8):
    return wb.models.ModelConfig(arch="llama", vocab_size=32000, seq_len=2048,
                                 n_layer=n_layer, n_head=16, n_kv_head=4, d_model=1024,
                                 dtype="float16")


def test_llama_on_deepspeed_pipeline_estimates():
    """framework='deepspeed' with pp > 1 resolves to the layer without the async TP
    all-reduce; a Llama model there (tp > 1) raised ``layer_times: async_allreduce=False
    ... give async_allreduce=True``, an argument estimate() does not have (it priced
    before today's change)."""
    lay = wb.plan.Layout(dp=1, tp=2, pp=2, micro_batch=1, global_batch=4,
                         framework="deepspeed")
    est = wb.plan.estimate(_llama(), lay, wb.plan.Cluster("a100", 4))
    assert est.step_time > 0
    assert any("16c90445e7" in a for a in est.assumptions())


def test_llama_block_input_gradient_allreduce_on_the_critical_path():
    """Megatron-DeepSpeed runs its Llama blocks without the async all-reduce too
    (microsoft/Megatron-DeepSpeed f4157bea ``megatron/arguments.py``: ``if args.deepspeed:
    args.async_tensor_model_parallel_allreduce = False``): each column-parallel group's
    input-gradient all-reduce is then exposed at the collective's price, after its GEMMs."""
    sync = {(o.phase, o.name): o for o in layer_ops(**LL, async_allreduce=False)}
    asyn = {(o.phase, o.name): o for o in layer_ops(**LL)}
    ar = cost.price("all_reduce", 2 * 2048 * 1024, [0, 1], "a100")
    for n in ("tp_grad_attn", "tp_grad_mlp"):
        assert sync[("backward", n)].overlaps == ""
        assert sync[("backward", n)].exposed == pytest.approx(ar)
        assert asyn[("backward", n)].overlaps != ""
    assert layer_times(**LL, async_allreduce=False).forward == layer_times(**LL).forward
    assert layer_times(**LL, async_allreduce=False).backward > layer_times(**LL).backward
    # sequence parallelism: the reduce-scatter stays beside its GEMM whatever the flag
    assert layer_times(**LL, sp=True, async_allreduce=False) == layer_times(**LL, sp=True)


def test_megatron_llama_without_async_allreduce_estimates():
    """estimate(..., async_tensor_model_parallel_allreduce=False) on a Llama model raised
    with a message naming layer_times' ``async_allreduce`` (not estimate's argument)."""
    lay = wb.plan.Layout(dp=1, tp=2, pp=2, micro_batch=1, global_batch=4)
    cl = wb.plan.Cluster("a100", 4)
    new = wb.plan.estimate(_llama(), lay, cl)
    old = wb.plan.estimate(_llama(), lay, cl, async_tensor_model_parallel_allreduce=False)
    assert old.step_time > new.step_time


def test_context_parallel_refusal_names_the_fix():
    """estimate(..., async_tensor_model_parallel_allreduce=False) with cp > 1 is refused
    (plan.ep_cp prices the async layer only); the message named no fix."""
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=32000, seq_len=4096, n_layer=4,
                                n_head=16, d_model=1024, dtype="bfloat16")
    lay = wb.plan.Layout(dp=1, tp=2, cp=2, micro_batch=1, global_batch=2)
    cl = wb.plan.Cluster("a100", 4)
    wb.plan.estimate(cfg, lay, cl, attention="flash")          # the async layer: priced
    with pytest.raises(ValueError, match="async_tensor_model_parallel_allreduce=False.*"
                                         "leave it None"):
        wb.plan.estimate(cfg, lay, cl, attention="flash",
                         async_tensor_model_parallel_allreduce=False)
