"""Follow-ups to DeepSpeed-Ulysses (``cp_comm="a2a"``) in the planner: the refusal of an
unfused kernel names the cp method in use; ``search`` tries the all-to-all where the heads
allow it (``plan.ep_cp_search``)."""
import pytest

from workbench.models.config import get_config
from workbench.plan import Cluster, Layout, estimate

# tests/test_ulysses.py's two GQA blocks (16 heads, 4 K/V heads, s = 1024), as a GPT: the
# default attention a GPT is priced with is the unfused one
GPT = get_config("gpt-22b", n_layer=2, d_model=1024, n_head=16, d_ff=4096,
                 seq_len=1024)


@pytest.mark.parametrize("comm,says,not_says", [("a2a", "all-to-all (DeepSpeed-Ulysses)", "ring"),
                                                 ("p2p", "ring attention", "Ulysses")])
def test_unfused_attention_refusal_names_the_cp_method(comm, says, not_says):
    """Before: cp_comm='a2a' was refused with "runs ring attention"."""
    lay = Layout(cp=2, global_batch=1, cp_comm=comm)
    with pytest.raises(ValueError) as e:
        estimate(GPT, lay, Cluster("a100", 2), attention="materialized")
    msg = str(e.value)
    assert says in msg and not_says not in msg and "attention='flash'" in msg
    assert f"cp_comm={comm!r}" in msg
    estimate(GPT, lay, Cluster("a100", 2), attention="flash")       # the fix runs


# test_ulysses.py's blocks at 8K tokens: the ring tried at cp 2 (4,096 tokens a rank), the
# all-to-all wherever each tp rank's 16 query and 4 K/V heads divide by cp
LONG = get_config("llama2-7b", n_layer=2, d_model=1024, n_head=16, n_kv_head=4, d_ff=2816,
                  seq_len=8192)


def _candidates(cfg, n):
    from workbench.plan import ep_cp_search
    from workbench.plan.search import candidate_layouts
    return list(ep_cp_search.candidates(cfg, Cluster("a100", n), n, 16, "flash",
                                        candidate_layouts))


def test_search_tries_the_all_to_all_where_the_heads_allow():
    """Before: search never tried cp_comm='a2a' (no candidate had it)."""
    lays = _candidates(LONG, 8)
    a2a = [lay for lay in lays if lay.cp_comm == "a2a"]
    assert a2a and all(lay.cp > 1 for lay in a2a)
    for lay in a2a:             # legal: every tp rank's heads divide by cp
        assert (16 // lay.tp) % lay.cp == 0 and (4 // lay.tp) % lay.cp == 0
    # the all-to-all has no per-rank floor (it hides nothing): cp 4 (2,048 tokens a rank)
    # by all-to-all only; every ring layout at cp 2 has its all-to-all twin where legal
    assert {lay.cp for lay in a2a} == {2, 4}
    assert all(lay.cp_comm == "a2a" for lay in lays if lay.cp == 4)
    ring = {lay for lay in lays if lay.cp == 2 and lay.cp_comm == "p2p"}
    twins = {lay.replace(cp_comm="p2p") for lay in a2a if lay.cp == 2}
    assert twins == {lay for lay in ring if (4 // lay.tp) % 2 == 0} and twins
    # each one estimates (none refused)
    for lay in a2a[:: max(1, len(a2a) // 6)]:
        assert estimate(LONG, lay, Cluster("a100", 8), attention="flash").step_time > 0
    # GQA with 2 K/V heads: cp 4 cannot split them, so no cp 4 at all (2,048 tokens a rank
    # is under the ring's floor); short sequences: no all-to-all
    assert not [lay for lay in _candidates(LONG.replace(n_kv_head=2), 8) if lay.cp == 4]
    assert not [lay for lay in _candidates(LONG.replace(seq_len=4096), 8)
                if lay.cp_comm == "a2a"]


def test_ranking_marks_the_all_to_all():
    """The table's cp cell reads 2a for cp_comm='a2a' (before: the same "2" as the ring, two
    rows alike), the legend says so, and explain names the change of cp_comm."""
    from workbench.plan.search import Ranking
    cl = Cluster("a100", 4)
    lays = [Layout(dp=2, cp=2, global_batch=2, cp_comm=c, framework="megatron")
            for c in ("a2a", "p2p")]
    r = Ranking([(lay, estimate(LONG, lay, cl, attention="flash")) for lay in lays],
                cluster=cl)
    rows = r.table().splitlines()
    assert rows[0].split()[5] == "cp" and rows[1].split()[5] == "2a"
    assert rows[2].split()[5] == "2"
    assert "cp Na: N ranks by all-to-all" in r.table()
    assert "cp_comm p2p -> a2a" in r.explain()[0]


def test_a2a_exercise_refuses_the_typical_slips(capsys):
    """Notebook 14's exercise 4: one rank's forward all-to-all bytes, Llama 3 8B at 128K on
    cp 8. The right value (and a 3-digit rounding) passes; each slip gets its hint."""
    from workbench.exercises import checks_experts as C

    from .exercise_helpers import fails, passes
    unit = 131072 // 8 * 128 * 2                  # one head of a rank's block, bytes
    want = 7 / 8 * unit * (32 + 8 + 8 + 32) / 1e6
    passes(capsys, C.check_a2a_mb, want)
    passes(capsys, C.check_a2a_mb, round(want))
    fails("keeps the 1 / cp", C.check_a2a_mb, want * 8 / 7)
    fails("the output goes back too", C.check_a2a_mb, 7 / 8 * unit * 48 / 1e6)
    fails("k and v travel too", C.check_a2a_mb, 7 / 8 * unit * 64 / 1e6)
    fails("grouped-query.*ring's cp - 1 K/V hops", C.check_a2a_mb, 7 / 8 * unit * 128 / 1e6)
    fails("q and the output have the query heads", C.check_a2a_mb, 7 / 8 * unit * 32 / 1e6)
    fails("s / cp tokens", C.check_a2a_mb, want * 8)
    fails("in MiB", C.check_a2a_mb, want * 1e6 / 2 ** 20)
    fails("all 32 layers", C.check_a2a_mb, want * 32)
    fails("backward's four", C.check_a2a_mb, want * 2)
    fails("bytes, not values", C.check_a2a_mb, want / 2)
    fails("128,000", C.check_a2a_mb, want * (128000 // 8) / (131072 // 8))
    fails("rounded too far", C.check_a2a_mb, want * 0.985)
    # where the ring's bytes differ from the all-heads slip (MHA), the ring is named alone
    fails("that is the ring's", C.check_a2a_mb, 3 * 2 * 131072 // 4 * 8 * 128 * 2 / 1e6,
          cp=4, heads=8)


def test_a2a_exercise_formula_is_the_planners():
    """The check's hand formula (it must not call the library) is what the planner prices."""
    import io
    from contextlib import redirect_stdout

    from workbench.exercises import checks_experts as C
    from workbench.exercises.feedback import reset_tries
    from workbench.plan.context_cost import a2a_times
    from workbench.plan.presets import get_config as plan_config
    from workbench.sim_mesh.profiles import get_profile
    for s, p in ((131072, 8), (32768, 4), (16384, 2)):
        cfg = plan_config("llama3-8b", seq_len=s)
        mb = a2a_times(cfg, Layout(cp=p, cp_comm="a2a"), get_profile("a100")).sent_forward / 1e6
        reset_tries()
        with redirect_stdout(io.StringIO()) as out:
            C.check_a2a_mb(mb, seq_len=s, cp=p)
        assert out.getvalue().startswith("Correct")
    reset_tries()
