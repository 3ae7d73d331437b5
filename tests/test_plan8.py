"""plan8: the planner's user-facing answers probed (layout checks, estimate against the
dry run, search, memory reports, the CLI); each test failed before its fix."""
import pytest

import workbench.plan as P
from workbench.models import get_config

SMALL_GPT = get_config("gpt3-175b", n_layer=8, d_model=1024, n_head=16, seq_len=1024,
                       vocab_size=1024)


@pytest.mark.parametrize("stages", [(4, 0, 4), (2, 0, 2, 4)], ids=str)
def test_an_empty_middle_stage_is_priced_as_the_dry_run_runs_it(stages):
    """Was refused by Layout ("middle stage 1 holds no layer"), though Hybrid(stage_sizes=
    [2, 0, 2]) trains it (tests/test_pipe7.py), and the dry run then raised "2 optimizer
    groups for 3 stages".  The empty stage holds no state and still passes the
    activations on: measured dry run / estimate 1.012-1.013 (step), 1.000 (memory)."""
    pp = len(stages)
    lay, cl = P.Layout(pp=pp, dp=2, zero=1, stages=stages, global_batch=4 * pp), \
        P.Cluster("a100", 2 * pp)
    est = P.estimate(SMALL_GPT, lay.replace(framework="workbench"), cl, attention="flash")
    dr = P.dry_run(SMALL_GPT, lay, cl)
    assert dr.step_time == pytest.approx(est.step_time, rel=0.10)
    assert dr.memory["total"] == pytest.approx(est.memory["total"], rel=0.05)
    empty = dr.per_rank[1]
    assert empty["params"] == empty["grads"] == empty["optimizer"] == empty["activations"] == 0
    assert dr.stages[1]["send"] > 0                     # it still sends the activations on
    assert empty == pytest.approx(P.memory.stage_memory(
        SMALL_GPT, lay.replace(framework="workbench"), 1, "flash", profile="a100"), rel=1e-9)


ODD_SEQ = get_config("gpt3-175b", n_layer=4, d_model=1024, n_head=16, seq_len=1023,
                     vocab_size=1024)


def test_sequence_parallel_needs_the_sequence_not_s_times_b_to_divide_by_tp():
    """Was: seq_len 1023, micro_batch 2, tp 2, sp estimated (s x b = 2046 divides), while
    the dry run's recipe refused it ("sp: seq_len=1023 does not divide by tp=2"), as
    Megatron-LM splits [s, b, h] along s."""
    lay, cl = P.Layout(tp=2, sp=True, micro_batch=2, global_batch=2), P.Cluster("a100", 2)
    for run in (P.estimate, P.dry_run):
        with pytest.raises(ValueError, match=r"Layout: sp=True with tp=2 .* seq_len = 1023 "
                           r"tokens .*use a tp dividing 1023 .*or sp=False"):
            run(ODD_SEQ, lay, cl)
    assert P.estimate(ODD_SEQ, lay.replace(sp=False), cl).step_time > 0


def test_search_with_an_odd_sequence_lists_no_sequence_parallel_layout():
    """Was: ValueError "layer_times: sp=True splits s*b=1023 tokens over tp=2 ranks" from
    inside search (its candidates offered sp whatever the sequence)."""
    r = P.search(ODD_SEQ, P.Cluster("a100", 4), global_batch=8)
    assert r.fitting > 0 and not any(lay.sp for lay, _ in r)


def _forward_events(dr, name):
    return sum(1 for e in dr.trace.events if e.name == name and e.label == "forward"
               and 0 in e.ranks)


LONG = get_config("llama3-8b", n_layer=1, d_model=1024, n_head=8, n_kv_head=8, d_ff=3584,
                  seq_len=8192, vocab_size=1024)


def test_selective_recompute_prices_the_attention_kernel_it_re_runs():
    """Was: the dry run priced selective recompute as none (flash attention's forward
    once), though checkpoint(attention_core) re-runs the kernel: PyTorch's early stop
    ended the recompute on the kernel's saved outputs, before the dispatcher recorded
    its event.  Dry run / estimate at 8K tokens: 0.925 before, 1.005 now (none: 1.006);
    at Mixtral's shape, 32K, dense: 0.918 -> 1.002."""
    from workbench.plan import agree
    cl = P.Cluster("h100", 1)
    none = agree.compare(LONG, P.Layout(), cl)
    sel = agree.compare(LONG, P.Layout(recompute="selective"), cl)
    assert _forward_events(none.dry_run, "flash_attention") == 1
    assert _forward_events(sel.dry_run, "flash_attention") == 2
    assert sel.step_ratio == pytest.approx(none.step_ratio, abs=0.01)
    assert sel.agrees and sel.dry_run.step_time > none.dry_run.step_time


def test_full_recompute_of_an_expert_parallel_layer_prices_its_experts_again():
    """Was: the EP layer put its exchange and expert GEMMs on the clock after the
    un-permutation, whose product with the gates is the layer's last saved tensor, so a
    full recompute (stopped there) re-ran them unpriced: dry run / estimate 0.789 (none:
    0.904) here, Mixtral's shape at ep 4 0.823 (none 0.955); then 0.891 and 0.951, and
    1.002 with the experts' SwiGLU and permutes priced too (tests/test_moeclk8.py)."""
    from workbench.plan import agree
    moe = LONG.replace(seq_len=2048, moe_experts=4, moe_topk=2)
    cl = P.Cluster("h100", 2)
    lay = P.Layout(dp=2, ep=2, global_batch=2)
    none = agree.compare(moe, lay, cl)
    full = agree.compare(moe, lay.replace(recompute="full"), cl)
    dispatch = [sum(1 for e in a.dry_run.trace.events if e.label == "EP dispatch (forward)"
                    and 0 in e.ranks) for a in (none, full)]
    assert dispatch == [1, 2]
    assert full.step_ratio == pytest.approx(none.step_ratio, abs=0.03)


def test_compare_takes_a_layout_only_the_recipe_runs():
    """Was: compare(ZeRO-3 over dp x cp, framework='workbench') raised "zero=3 with ep=1,
    cp=2 is not modeled ... use framework='workbench'" (it had been given): the dry run
    was handed the layout at framework=None, which Layout refuses there."""
    from workbench.plan import agree
    cfg = LONG.replace(seq_len=4096)
    lay = P.Layout(dp=2, cp=2, zero=3, framework="workbench", global_batch=2)
    a = agree.compare(cfg, lay, P.Cluster("h100", 4))
    assert a.agrees, a.problems()
    assert a.framework_gap == {}
