"""Uneven pipeline stages (``Layout(stages=...)``): the layers of each stage as a list,
the embedding and the head weighing on the first and last stage as they do."""
import pytest

import workbench.plan as P
from workbench.models.config import get_config
from workbench.plan import megatron_hook_add as HA
from workbench.plan.memory import stage_params

GPT3 = get_config("gpt3-175b")
A100 = P.Cluster("a100", 1024)
BASE = P.Layout(dp=8, tp=8, pp=16, recompute="full", global_batch=1536)


def test_even_stages_given_as_a_list_change_nothing():
    even, listed = (P.estimate(GPT3, lay, A100)
                    for lay in (BASE, BASE.replace(stages=[6] * 16)))
    assert listed.step_time == pytest.approx(even.step_time, rel=1e-12)
    assert listed.memory == pytest.approx(even.memory, rel=1e-12)
    assert listed.layout.stages == (6,) * 16 and "stages[6," in listed.layout.short()


def test_uneven_stages_price_each_stage_and_the_simulator_agrees():
    lay = BASE.replace(stages=[5] + [6] * 14 + [7])
    est = P.estimate(GPT3, lay, A100)
    st = est.details["stages"]
    assert len(st) == 16 and {"first", "last", "stage 1"} <= set(st)
    per = {k: v["time"] for k, v in st.items()}
    one = per["stage 1"]                                  # a middle stage: 6 layers
    # the first stage lost a layer, the last gained one: one layer's time each
    # (and Megatron's hook adding that layer's norm and bias gradients, megatron_hook_add)
    hook = HA.hook_add_seconds(GPT3, BASE, 1, 7, A100.profile, True) - \
        HA.hook_add_seconds(GPT3, BASE, 1, 6, A100.profile, True)
    layer = est.details["layer"].total + hook
    even_st = P.estimate(GPT3, BASE, A100).details["stages"]
    assert per["last"] - even_st["last"]["time"] == pytest.approx(layer, rel=1e-9)
    assert even_st["first"]["time"] - per["first"] == pytest.approx(layer, rel=1e-9)
    assert one == pytest.approx(even_st["middle"]["time"], rel=1e-12)
    assert per["first"] < one < per["last"]
    sim = est.pipeline()
    assert lay.m * max(per.values()) + est.breakdown["bubble"] == pytest.approx(
        sim.makespan, rel=1e-9)
    # memory: the first stage holds one layer fewer than with even stages
    even = P.estimate(GPT3, BASE, A100)
    assert stage_params(GPT3, 8, 16, 0, 5) == stage_params(GPT3, 8, 16, 0) - \
        (stage_params(GPT3, 8, 16, 1, 6) - stage_params(GPT3, 8, 16, 1, 5))
    assert est.memory != even.memory


def test_a_heavy_head_wants_fewer_layers_on_its_stage():
    """With a 256k vocabulary the head outweighs a layer: moving a layer off the last
    stage shortens the slowest stage and the step."""
    cfg = get_config("gpt-22b").replace(vocab_size=256000)
    cl = P.Cluster("a100", 32)
    lay = P.Layout(dp=1, tp=8, pp=4, sp=True, recompute="selective", global_batch=32)
    n = cfg.n_layer // 4
    even = P.estimate(cfg, lay, cl)
    lighter = P.estimate(cfg, lay.replace(stages=[n + 1, n, n, n - 1]), cl)
    assert lighter.step_time < even.step_time


@pytest.mark.parametrize("kw, match", [
    (dict(stages=[6] * 15), r"stages=.* must list the layers of each of the pp=16"),
    (dict(stages=[6] * 15 + [-1]), r"ints >= 0"),
    (dict(stages=[7] * 16), r"hold 112 layers but the model has n_layer=96"),
])
def test_stage_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        P.estimate(GPT3, BASE.replace(**kw), A100)


def test_uneven_stages_need_a_plain_schedule():
    with pytest.raises(ValueError, match="interleaved_1f1b.*not modeled"):
        P.Layout(dp=8, tp=8, pp=16, global_batch=1536, schedule="interleaved_1f1b", v=2,
                 stages=[6] * 16)


# the dry run splits the recipe's pipeline as ``stages`` says (Hybrid(stage_sizes=...)) and
# runs every stage; the estimate agrees as on even layouts (tests/test_dryrun.py): step
# 0.97-0.98 of the estimate, memory within 0.3% on these
UNEVEN = [P.Layout(dp=1, tp=1, pp=2, global_batch=8, stages=(1, 3)),
          P.Layout(dp=1, tp=2, pp=3, global_batch=6, stages=(1, 2, 1), schedule="gpipe"),
          P.Layout(dp=2, tp=1, pp=3, global_batch=12, stages=(2, 2, 0), recompute="full",
                   zero=1)]


@pytest.mark.parametrize("lay", UNEVEN, ids=lambda l: l.short())
def test_uneven_stages_dry_run_agrees_with_estimate(lay):
    cfg = get_config("gpt3-175b", n_layer=4, d_model=1024, n_head=16, seq_len=1024)
    cl = P.Cluster("a100", lay.world)
    dr = P.dry_run(cfg, lay, cl)
    est = P.estimate(cfg, lay.replace(framework="workbench"), cl, attention="flash")
    assert sorted(dr.stages) == list(range(lay.pp))          # every stage run
    assert [len(dr.per_rank)] == [lay.pp]
    for k in ("params", "optimizer", "activations", "total"):
        assert dr.memory[k] == pytest.approx(est.memory[k], rel=0.05), k
    assert dr.step_time == pytest.approx(est.step_time, rel=0.10)
