"""Megatron-LM's DDP hook adding the unfused gradients into main_grad every micro-batch
(``plan.megatron_hook_add``), held to a hand computation from the profile's cited figures
(the H100 datasheet's 3.35 TB/s at the measured copy efficiency 0.901, 1 us per launch)
and to the parameters the planner counts."""
import pytest

import workbench as wb
from workbench.plan import megatron_hook_add as HA
from workbench.plan.memory import layer_params, stage_params
from workbench.sim_mesh.profiles import get_profile

H100 = get_profile("h100")
BW = 3.35e12 * 0.901            # profile h100: memory_bandwidth x memory_efficiency


def _cfg(h=2048, a=16, n_layer=24, dtype="bfloat16", tie=False, arch="gpt", **kw):
    return wb.models.ModelConfig(arch=arch, vocab_size=131072, seq_len=4096, n_layer=n_layer,
                                 n_head=a, d_model=h, dtype=dtype, tie_embeddings=tie, **kw)


def _lay(tp=1, pp=1, dp=48, framework=None, gbs=192):
    return wb.plan.Layout(dp=dp, tp=tp, pp=pp, sp=tp > 1, zero=1, recompute="none",
                          micro_batch=1, global_batch=gbs, framework=framework)


def test_elements_are_the_parameters_no_fused_gemm_accumulates():
    # a GPT layer's unfused tensors: what layer_params counts beyond the four weight
    # matrices (q, k, v, o: 4 h^2; fc1, fc2: 2 h f) that the fused wgrad GEMMs accumulate
    for tp in (1, 2, 8):
        cfg = _cfg(h=7168, a=56, n_layer=48)
        h, f = cfg.d_model, cfg.d_ff
        n, k = HA.hook_elements(cfg, tp, 2, 1, 5)         # a last stage of 5 layers
        assert n == pytest.approx(5 * (layer_params(cfg, tp) - (4 * h * h + 2 * h * f) / tp)
                                  + 2 * h)                 # + the final LayerNorm (w, b)
        assert k == 5 * 8 + 2
        # the first stage of pp = 1 (untied): every parameter but the fused matrices and
        # the (fused) output layer
        n, k = HA.hook_elements(cfg, tp, 1, 0, 48)
        fused = 48 * (4 * h * h + 2 * h * f) / tp + cfg.vocab_size * h / tp
        assert n == pytest.approx(stage_params(cfg, tp, 1, 0, 48) - fused)
        assert k == 48 * 8 + 2 + 2                         # + word and position tables


def test_llama_block_adds_its_two_norms():
    cfg = _cfg(h=4096, a=32, n_layer=32, arch="llama", n_kv_head=8, d_ff=14336)
    n, k = HA.hook_elements(cfg, 2, 1, 0, 32)
    assert n == pytest.approx(32 * 2 * 4096 + 131072 * 4096 / 2 + 4096)  # no position table
    assert k == 32 * 2 + 1 + 1


def test_seconds_hand_computed_bf16_and_fp16():
    # bf16: read the 2-byte gradient, read and write the fp32 main_grad: 10 B per element
    cfg, lay = _cfg(), _lay()
    n = 24 * (6 * 2048 + 3 * 2048 + 8192) + 131072 * 2048 + 4096 * 2048 + 2 * 2048
    k = 24 * 8 + 2 + 2
    want = 10 * n / BW + k * 1e-6
    got = HA.hook_add_seconds(cfg, lay, 0, 24, H100, fusion=True)
    assert got == pytest.approx(want, rel=1e-9)
    assert 0.85e-3 < got < 1.2e-3          # the 1.7B's 268M-entry word embedding: ~0.9 ms
    # fp16 (fusion into a 16-bit main_grad, Megatron-LM 07916bf245 on): 6 B per element
    c16 = _cfg(dtype="float16")
    assert HA.hook_add_seconds(c16, lay, 0, 24, H100, fusion=True) == \
        pytest.approx(6 * n / BW + k * 1e-6, rel=1e-9)


def test_nothing_without_the_fusion_or_outside_megatron():
    cfg = _cfg()
    assert HA.hook_add_seconds(cfg, _lay(), 0, 24, H100, fusion=False) == 0.0
    for fw in ("workbench", "deepspeed"):
        assert HA.hook_add_seconds(cfg, _lay(framework=fw), 0, 24, H100, fusion=True) == 0.0
    assert HA.assumption(_lay(framework="workbench"), True) == ()
    assert HA.assumption(_lay(), False) == ()
    assert "main_grad" in HA.assumption(_lay(), True)[0]
    assert "ASSUMPTION" not in HA.assumption(_lay(), True, _cfg())[0]
    moe = _cfg(moe_experts=8)
    assert "MoE layers counted as the dense layer" in HA.assumption(_lay(), True, moe)[0]


def test_bad_arguments_refused():
    cfg, lay = _cfg(), _lay(pp=1)
    with pytest.raises(ValueError, match="stage=1"):
        HA.hook_add_seconds(cfg, lay, 1, 24, H100, fusion=True)
    with pytest.raises(ValueError, match="layers=-1"):
        HA.hook_add_seconds(cfg, lay, 0, -1, H100, fusion=True)


def test_estimate_adds_it_to_each_micro_batch():
    cfg, lay = _cfg(), _lay()
    cl = wb.plan.Cluster("h100", 48)
    kw = dict(attention="flash", overlap_grad_reduce=True)
    on = wb.plan.estimate(cfg, lay, cl, **kw)
    off = wb.plan.estimate(cfg, lay, cl, gradient_accumulation_fusion=False, **kw)
    hook = HA.hook_add_seconds(cfg, lay, 0, 24, H100, fusion=True)
    assert on.details["grad_accumulation"] == pytest.approx(hook)
    stage = next(iter(on.details["stages"].values()))
    assert stage["grad_accumulation"] == pytest.approx(hook)
    assert any("megatron_hook_add" in a for a in on.details["assumptions"])
    # without the fusion every parameter is added (plan.megatron_2021), the hook's share
    # included: more than the hook alone
    assert off.details["grad_accumulation"] > hook
    # this library's recipe (framework="workbench") has no such hook
    wl = lay.replace(framework="workbench")
    est = wb.plan.estimate(cfg, wl, cl, **kw)
    assert not any("megatron_hook_add" in a for a in est.details["assumptions"])
