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
