"""Defects fixed by helper fixlist12: the planner's ZeRO-3 buffers over dp x cp, cp=1 in
ContextParallel, Hybrid(sp, zero=3) outside measure_activations, and the cp recipe's
activation bytes. Small shapes, simulated ranks only."""
import pytest

from workbench.models.config import get_config

# ---- 1. ZeRO-3's working copies exist whenever the sharding group dp x cp > 1 ------------
PLAN_CFG = get_config("llama2-7b", n_layer=2, d_model=1024, n_head=16, n_kv_head=4,
                      d_ff=2816, seq_len=1024)      # tests/test_dryrun_ep_cp.py's blocks


def _allow_zero3_with_cp(monkeypatch):
    """Layout and dry_run refuse zero=3 with cp (the estimate's step is not held to the
    runtime's); the memory accounting below them is what this checks, so lift the two
    refusals for this layout only."""
    import workbench.plan.dryrun_ep_cp as dec
    import workbench.plan.ep_cp as ec
    fields, check = ec.check_fields, dec.check
    monkeypatch.setattr(ec, "check_fields",
                        lambda lay: None if lay.zero == 3 and lay.cp > 1 else fields(lay))
    monkeypatch.setattr(dec, "check",
                        lambda m, lay: None if lay.zero == 3 and lay.cp > 1 else check(m, lay))


def test_zero3_buffers_at_dp1_cp2_are_priced_over_the_cp_group(monkeypatch):
    """Was: dryrun.py and plan/memory.py tested ``lay.dp > 1`` for ZeRO-3's gathered
    weights and unreduced gradients, while ZeRO shards over dp x cp: at dp 1, cp 2, zero 3
    (parameters sharded 2 ways, the recipe's ledger measuring its gathers) both gave 0
    buffers (measured 0 and 0; dp 2, cp 2 gave 198719488 each). Now both count them."""
    from workbench.plan import Cluster, Layout, dry_run, estimate
    _allow_zero3_with_cp(monkeypatch)
    got = {}
    for dp in (1, 2):
        lay = Layout(dp=dp, cp=2, zero=1, global_batch=2 * dp, framework="workbench")
        object.__setattr__(lay, "zero", 3)
        cl = Cluster("a100", lay.world)
        dr = dry_run(PLAN_CFG, lay, cl)
        est = estimate(PLAN_CFG, lay, cl, attention="flash")
        assert dr.memory["buffers"] == pytest.approx(est.memory["buffers"], rel=0.01)
        assert dr.memory["total"] == pytest.approx(est.memory["total"], rel=0.01)
        got[dp] = dr.memory["buffers"]
    assert got[1] > 0
    # the same block gathered whole on every rank, whatever splits the 4 or 2 ranks' group
    assert got[1] == pytest.approx(got[2], rel=0.01)


# ---- 2. ContextParallel(cp=1) refuses at construction, naming the recipe that runs it ----
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_context_parallel_cp1_is_refused_with_the_fix(zero):
    """Was: ContextParallel(cp=1) built, then every zero stage raised in attention (the
    ring context refusing a query replicated on the 1-rank cp dim), after the model and
    optimizer were built. Now the constructor refuses and names Hybrid."""
    from workbench.recipes.context_parallel import ContextParallel
    with pytest.raises(ValueError, match=r"ContextParallel\(cp=1\).*use cp >= 2.*"
                                         rf"Hybrid\(dp=2, tp=1, sp=False, zero={zero}\)"):
        ContextParallel(cp=1, dp=2, zero=zero)
    ContextParallel(cp=2, dp=1, zero=zero)          # cp >= 2 still builds
