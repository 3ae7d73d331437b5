"""Frameworks as they run (``wb.plan.frameworks``): which one a layout runs, the gradient
dtype each reduces in, and memory that keeps ZeRO's partitioned states apart from the
framework's buffers."""
import pytest

import workbench.plan as P
from workbench.models.config import get_config
from workbench.plan.memory import model_state_bytes, stage_params
from workbench.sim_mesh.cost import price

GPT3 = get_config("gpt3-175b")


def test_model_states_are_zero_table_1_exactly():
    # Rajbhandari et al. 2020, Figure 1 / Table 1: psi = 7.5B, N_d = 64, K = 12:
    # 120, 31.4, 16.6, 1.88 GB for baseline, P_os, P_os+g, P_os+g+p
    got = [sum(model_state_bytes(7.5e9, 64, z).values()) for z in range(4)]
    assert got == [120e9, 31.40625e9, 16.640625e9, 1.875e9]


@pytest.mark.parametrize("zero, want", [(0, "megatron"), (1, "megatron"),
                                        (2, "deepspeed"), (3, "deepspeed")])
def test_default_framework_by_zero_stage(zero, want):
    lay = P.Layout(dp=8, zero=zero)
    assert lay.framework is None and lay.engine == want
    assert lay.replace(zero=3).engine == "deepspeed"   # replace keeps framework=None
    assert "megatron" not in lay.short() and "deepspeed" not in lay.short()
    assert P.Layout(dp=8, zero=zero, framework="workbench").short().endswith(" workbench")


@pytest.mark.parametrize("kw, match", [
    (dict(zero=3, framework="megatron"), r"framework='megatron' with zero=3.*ZeRO-1"),
    (dict(framework="fsdp"), r"framework='fsdp' is not priced yet"),
    (dict(framework="colossal"), r"framework='colossal'; use one of"),
])
def test_framework_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        P.Layout(dp=8, **kw)


def test_megatron_bf16_reduces_and_holds_fp32_gradients():
    cl = P.Cluster("a100", 1024)
    lay = P.Layout(dp=8, tp=8, pp=16, recompute="full", global_batch=1536, zero=1)
    est = P.estimate(GPT3, lay, cl)
    psi = stage_params(GPT3, 8, 16, 0)
    ranks = lay.dp_ranks(0, 0)
    # distributed optimizer: reduce-scatter the fp32 gradients, all-gather 16-bit weights
    want = price("reduce_scatter", 4 * psi, ranks, "a100") + \
        price("all_gather", 2 * psi, ranks, "a100")
    assert est.details["dp_sync"] == pytest.approx(want, rel=1e-12)
    # ZeRO-1's states exactly, and the whole fp32 buffer beside them
    states = model_state_bytes(psi, 8, 1)
    assert {k: est.memory[k] for k in states} == pytest.approx(states, rel=1e-12)
    assert est.memory["buffers"] == 2 * psi
    ds = P.estimate(GPT3, lay.replace(framework="deepspeed"), cl)
    assert ds.details["dp_sync"] < est.details["dp_sync"] and ds.memory["buffers"] == 0
    assert "buffers" in est.explain() and "megatron" == est.details["framework"]


def test_dry_run_runs_the_library_recipe_only():
    cfg = get_config("gpt3-175b", n_layer=2, d_model=256, n_head=4, seq_len=128)
    with pytest.raises(ValueError, match=r"framework='megatron'.*framework='workbench'"):
        P.dry_run(cfg, P.Layout(dp=2, framework="megatron"), P.Cluster("a100", 2))
