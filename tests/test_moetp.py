"""A MoE model under expert x tensor parallelism, planner against runtime (task moetp).

Megatron-Core splits each expert over an expert-tensor-parallel group whose size
defaults to the TP size, with sequence parallelism required (NVIDIA/Megatron-LM
d98e8a64dd megatron/core/model_parallel_config.py:130-133, 506-507; megatron/training/
arguments.py:587-588): the planner's default, unchanged.  This library's runtime
(``Hybrid(ep=, tp=)``) keeps the MoE MLP whole on every tp rank without sp: the planner
prices that layout by name, ``Layout(framework="workbench", sp=False)``, and the dry
run is held to it.  Both exchange the per-expert row counts once per MoE layer in the
forward (8 E bytes per rank over ep), which the planner now prices.
"""
import pytest

from workbench.models.config import get_config
from workbench.plan import Cluster, Layout, dry_run, estimate
from workbench.plan.moe_cost import rank_expert_params

# tests/test_dryrun_ep_cp.py's model: two GQA blocks (h = 1024, s = 1024), 8 SwiGLU
# experts of d_ff 2816, top-2
CFG = get_config("llama2-7b", n_layer=2, d_model=1024, n_head=16, n_kv_head=4, d_ff=2816,
                 seq_len=1024)
MOE = CFG.replace(moe_experts=8, moe_topk=2)
H, F, E, L = 1024, 2816, 8, 2


def _pair(lay):
    cl = Cluster("a100", lay.world)
    return dry_run(MOE, lay, cl), estimate(MOE, lay.replace(framework="workbench"), cl,
                                           attention="flash")


def _a2a_bytes_rank0(dr) -> int:
    return sum(e.bytes for e in dr.trace.events if e.name == "all_to_all" and 0 in e.ranks)


def test_megatron_default_splits_experts_over_tp_and_needs_sp():
    """The default framework (Megatron-LM) keeps its layout: experts split by t = 2, sp
    required; the runtime's layout is priced only when named."""
    assert rank_expert_params(MOE, 2, 2) == E // 2 * 3 * H * F / 2
    assert rank_expert_params(MOE, 2, 2, sp=False) == E // 2 * 3 * H * F
    cl = Cluster("a100", 4)
    with pytest.raises(ValueError, match=r"needs sp=True.*framework='workbench' with "
                                         r"sp=False"):
        estimate(MOE, Layout(dp=2, ep=2, tp=2, global_batch=2), cl)
    meg = estimate(MOE, Layout(dp=2, ep=2, tp=2, sp=True, global_batch=2), cl)
    own = estimate(MOE, Layout(dp=2, ep=2, tp=2, global_batch=2, framework="workbench"), cl)
    # experts whole on every tp rank: twice Megatron's expert parameters per rank
    dense = meg.memory["params"] - 2 * L * E // 2 * 3 * H * F / 2
    assert own.memory["params"] == pytest.approx(dense + 2 * L * E // 2 * 3 * H * F)


@pytest.mark.parametrize("lay", [Layout(dp=2, ep=2, tp=2, global_batch=2),
                                 Layout(dp=4, ep=2, tp=2, zero=1, global_batch=4)],
                         ids=lambda l: l.short())
def test_dry_run_ep_x_tp_agrees_with_the_runtime_layout_estimate(lay):
    """Before: the dry run refused a MoE with tp > 1.  Now: expert states per rank equal,
    all-to-all bytes equal, step within the MoE dry runs' 10% (measured 0.939x, 0.937x)."""
    dr, est = _pair(lay)
    for k in ("params", "grads", "optimizer", "buffers"):
        assert dr.memory[k] == pytest.approx(est.memory[k], abs=1), k
    per_layer = est.details["ep_cp"]["a2a_bytes"]
    assert _a2a_bytes_rank0(dr) == pytest.approx(L * per_layer * lay.m, abs=1)
    assert dr.step_time == pytest.approx(est.step_time, rel=0.10)


def test_dry_run_ep_x_tp_activations_agree():
    """Before (task savedtp): 0.72x (the estimate plus the un-permute's surplus; the
    strict xfail's 0.75x of the estimate): the dry run's activation count (plan/meta_run.py
    SavedCounter.add) split a saved tensor without mesh lead axes over every rank, and
    the expert-parallel internals, one plain tensor per (edp, ep) group computed once for
    the tp copies, are held whole by each tp rank.  Now each such tensor is split over the
    axes its inputs vary along (``_Provenance.axes``): 1.0006x."""
    lay = Layout(dp=2, ep=2, tp=2, global_batch=2)
    dr, est = _pair(lay)
    surplus = 2 * 2 * MOE.seq_len * H * L        # the un-permute's R x h, test_dryrun_ep_cp
    assert dr.memory["activations"] == pytest.approx(est.memory["activations"] + surplus,
                                                     rel=0.05)


def test_count_exchange_is_priced_as_the_runtime_records_it():
    """Before: the estimate sent 32 bytes per layer fewer than the dry run (the runtime's
    count all-to-all: 8 E bytes, (ep - 1) / ep of them leave the rank, forward only)."""
    lay = Layout(dp=2, ep=2, global_batch=2)
    dr, est = _pair(lay)
    counts = [e for e in dr.trace.events if e.label == "EP counts (forward)" and 0 in e.ranks]
    assert [e.bytes for e in counts] == [8 * E // 2] * L
    assert _a2a_bytes_rank0(dr) == pytest.approx(L * est.details["ep_cp"]["a2a_bytes"], abs=1)
    from workbench.plan.ep_cp import layer_cost
    from workbench.plan.costs import group_price
    prof = Cluster("a100", 2).profile
    c = group_price("all_to_all", 8 * E, (0, 1), prof)
    assert 0 < c < 20e-6                          # latency-bound: 64 bytes
    assert counts[0].duration == pytest.approx(c, rel=1e-9)
    rc = layer_cost(MOE, lay.replace(recompute="full"), prof, "flash")
    nr = layer_cost(MOE, lay, prof, "flash")
    assert rc.bwd_comm - nr.bwd_comm == pytest.approx(nr.fwd_comm, rel=1e-9)  # recomputed


def test_runtime_layout_refuses_what_it_does_not_price():
    cl = Cluster("a100", 4)
    with pytest.raises(ValueError, match=r"moe_shared_experts=1 is not priced"):
        estimate(MOE.replace(moe_shared_experts=1),
                 Layout(dp=2, ep=2, tp=2, global_batch=2, framework="workbench"), cl)
    with pytest.raises(ValueError, match=r"tp=2 and sp=True.*sp=False"):
        dry_run(MOE, Layout(dp=2, ep=2, tp=2, sp=True, global_batch=2), cl)


def test_train_cli_dry_runs_ep_x_tp(capsys):
    """``python -m workbench train --dry-run`` with --ep 2 --tp 2 (before: refused)."""
    import json

    from workbench.cli import main
    rc = main(["train", "--preset", "tiny", "--dry-run", "--batch-size", "2",
               "--moe-experts", "4", "--ep", "2", "--dp", "1", "--tp", "2"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    rec = json.loads(out.out.strip().splitlines()[-1])
    assert rec["dry_run"] is True and rec["modeled_ms"] > 0 and rec["fits"] is True
