"""The dry run (``wb.plan.dry_run``): the real GPT under the Hybrid recipe on meta tensors.

Held to the analytic planner (``wb.plan.estimate``, with the fused attention the model
runs): memory within 5%, step time within 10%; to the bytes a model holds; and it must
allocate nothing and run a 1,024-rank mesh.
"""
import json
import resource

import pytest
import torch

import workbench as wb
from workbench.models.config import get_config
from workbench.plan import Cluster, Layout, estimate
from workbench.plan import dry_run

# small enough to dry-run in about a second: two layers, but shapes where the roofline
# is in its bandwidth- and FLOP-bound regimes as at scale (h = 1024, s = 1024)
CFG = get_config("gpt3-175b", n_layer=2, d_model=1024, n_head=16, seq_len=1024)

LAYOUTS = [
    Layout(dp=1, tp=1, pp=1, global_batch=1),
    Layout(dp=2, tp=1, pp=1, global_batch=4, recompute="selective"),
    Layout(dp=1, tp=1, pp=2, global_batch=8),
    Layout(dp=2, tp=1, pp=2, global_batch=8, recompute="full", zero=1),
    Layout(dp=1, tp=1, pp=2, global_batch=8, schedule="gpipe"),
    # TP, SP, interleaved: within 10% since the recipe all-reduces DP gradients as one
    # buffer, as Megatron-LM does (dp2 x tp2 was 16% slower per tensor)
    Layout(dp=2, tp=2, pp=1, global_batch=4),
    Layout(dp=1, tp=4, pp=1, global_batch=2, sp=True),
    Layout(dp=1, tp=2, pp=2, global_batch=8, schedule="interleaved_1f1b", v=2,
           recompute="full"),
    # ZeRO-2 as DeepSpeed: reduce-scatter every micro-batch, waited for at the end of each
    # backward; the tied word embedding's gradient completes last and is that wait
    Layout(dp=2, tp=1, pp=1, global_batch=4, zero=2),
    Layout(dp=2, tp=1, pp=1, global_batch=8, zero=2, recompute="full"),
    # ZeRO-3: the backward's gathers prefetched from the end of the forward, the forward's
    # order reversed (strategies/zero3.py), as the estimate does from the backward's start
    # (DeepSpeed); they started after the tied head's backward and the run was 12% slower
    Layout(dp=2, tp=1, pp=1, global_batch=4, zero=3),
    # ZeRO-2 with TP: a weight gradient's reduce-scatter after the all-reduce of its
    # layer's input gradient, as Megatron issues them (it was recorded first and delayed
    # that all-reduce, which the compute waits for: 8.8% slower, the ZeRO effect 6% off)
    Layout(dp=2, tp=2, pp=1, global_batch=4, zero=2),
    # ZeRO with TP: the tp and dp groups' collectives each on their own comm stream (as
    # ProcessGroupNCCL), so ZeRO-3's prefetch queue does not hold up the tp all-reduces
    # (13% slower when they shared one; ZeRO-2 + SP 5.8%)
    Layout(dp=2, tp=2, pp=1, global_batch=4, zero=3),
    Layout(dp=2, tp=2, pp=1, global_batch=4, zero=2, sp=True),
]


def _pair(lay):
    cl = Cluster("a100", lay.world)
    cfg = CFG.replace(n_layer=2 * lay.pp * lay.v) if lay.v > 1 else CFG   # whole chunks
    # the dry run runs this library's recipe: the estimate of the same framework
    return dry_run(cfg, lay, cl), estimate(cfg, lay.replace(framework="workbench"), cl,
                                           attention="flash")


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda l: l.short())
def test_memory_agrees_with_estimate(lay):
    dr, est = _pair(lay)
    assert set(dr.memory) == set(est.memory) == {"params", "grads", "optimizer", "buffers",
                                                 "comm_buffers", "activations", "workspace",
                                                 "total"}
    # the workspace (the loss's fp32 copies, a recomputed layer) is priced by the same
    # plan.memory.workspace_bytes on both sides: only the total holds it here
    for k in ("params", "grads", "optimizer", "buffers", "total"):
        assert dr.memory[k] == pytest.approx(est.memory[k], rel=0.05), k
    assert dr.memory["activations"] == pytest.approx(est.memory["activations"], rel=0.05)
    assert dr.fits == est.fits


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda l: l.short())
def test_step_time_agrees_with_estimate(lay):
    dr, est = _pair(lay)
    assert dr.step_time == pytest.approx(est.step_time, rel=0.10)


def test_model_states_are_the_sharded_parameters():
    """Model states counted from the meta shards: 2 + 2 + 12 bytes per parameter a rank
    holds (ZeRO's K = 12), the parameters of build_model split by tp, tied head once."""
    lay = Layout(dp=1, tp=2, pp=1, global_batch=1)
    dr = dry_run(CFG, lay, Cluster("a100", 2))
    n = wb.models.param_count(CFG).module
    h, V, s = CFG.d_model, CFG.vocab_size, CFG.seq_len
    replicated = CFG.n_layer * (6 * h) + 2 * h + s * h        # o/fc2 biases, LNs, positions
    per_rank = (n - replicated) // 2 + replicated
    assert dr.memory["params"] == 2 * per_rank
    assert dr.memory["optimizer"] == 12 * per_rank
    assert V * h // 2 < per_rank


def test_timeline_and_trace_are_plain_data():
    lay = Layout(dp=1, tp=1, pp=2, global_batch=8)
    dr = dry_run(CFG, lay, Cluster("a100", 2))
    assert sorted(dr.timeline) == [0, 1]
    for r, tl in dr.timeline.items():
        assert len(tl["times"]) == len(tl["bytes"])
        assert max(tl["bytes"]) == dr.per_rank[r]["activations"]
        assert tl["bytes"][-1] == 0                  # every micro-batch freed by the end
    # 1F1B: stage 0 holds p = 2 micro-batches at its peak, stage 1 one
    assert dr.per_rank[0]["activations"] == 2 * dr.stages[0]["activation_bytes"]
    assert dr.per_rank[1]["activations"] == dr.stages[1]["activation_bytes"]
    names = {e.name for e in dr.trace.events}
    assert {"linear", "flash_attention", "send_recv"} <= names
    assert dr.step_time >= dr.pipeline.makespan > 0


def test_allocates_nothing():
    """GPT-3's layer shape (h = 12288): two layers' weights and Adam states would be
    about 12 GB; the dry run's peak resident memory grows by far less."""
    cfg = get_config("gpt3-175b", n_layer=2)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dr = dry_run(cfg, Layout(dp=2, tp=8, pp=1, global_batch=2), Cluster("a100", 16))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert dr.memory["params"] + dr.memory["optimizer"] > 5e9     # what a rank would hold
    assert grown < 0.5e9


def test_1024_ranks():
    """dp 8 x tp 8 x pp 16 = 1,024 simulated ranks: three distinct stages run for real."""
    cfg = get_config("gpt3-175b", n_layer=16, d_model=256, n_head=8, seq_len=256,
                     vocab_size=1024)
    lay = Layout(dp=8, tp=8, pp=16, global_batch=256)
    dr = dry_run(cfg, lay, Cluster("a100", 1024))
    assert sorted(dr.stages) == [0, 1, 15]
    assert len(dr.per_rank) == 16
    assert dr.pipeline.schedule.m == lay.m == 32
    assert max(r for e in dr.trace.events for r in e.ranks) == 1023


def test_bad_layout_names_the_fix():
    with pytest.raises(ValueError, match="devices=8"):
        dry_run(CFG, Layout(dp=2, tp=2, pp=1, global_batch=4), Cluster("a100", 8))
    with pytest.raises(ValueError, match="n_head"):
        dry_run(CFG, Layout(dp=1, tp=3, pp=1), Cluster("a100", 3))


# The CLI runs in this process (``python -m workbench`` is ``sys.exit(main())``, run as a
# process by the torchrun tests, tests/test_distributed_engine.py): no second interpreter
# and torch import per test
def test_train_cli_prints_one_json_line(capsys):
    from workbench.cli import main
    assert main(["train", "--preset", "gpt-tiny", "--dry-run", "--dp", "2", "--tp", "2",
                 "--pp", "2", "--batch-size", "8", "--profile", "h100"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["loss"] is None and rec["dry_run"] is True and rec["profile"] == "h100"
    assert {"step", "tokens", "lr", "modeled_ms", "comm_bytes", "state_bytes", "ms",
            "peak_bytes_per_rank", "fits", "device_memory_bytes"} <= set(rec)
    assert len(rec["peak_bytes_per_rank"]) == 2 and rec["fits"] is True


def test_train_cli_refuses_an_unknown_schedule(capsys):
    from workbench.cli import main
    assert main(["train", "--preset", "gpt-tiny", "--dry-run", "--pp", "2", "--schedule",
                 "zb-h1", "--batch-size", "8"]) == 2
    assert "--schedule zb-h1" in capsys.readouterr().err


def test_meta_attention_keeps_what_flash_attention_keeps():
    """On meta, flash attention keeps Q, K, V, O and an fp32 log-sum-exp per row (FA2),
    nothing of size S x S."""
    from workbench.plan.meta_run import SavedCounter
    q = torch.empty(1, 2, 8, 4, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k, v = (torch.empty_like(q).requires_grad_() for _ in range(2))
    c = SavedCounter(wb.Mesh([[0]], ["dp", "tp"]))
    with c.counting():
        wb.ops.flash_attention(q, k, v, causal=True, dropout_p=0.1)
    got = sorted((str(dt), b) for b, _, dt, _ in c.items)
    assert got == sorted([("torch.bfloat16", 128)] * 4 + [("torch.float32", 64)])


def test_dry_run_flags_refused_without_dry_run(capsys):
    from workbench.cli import main
    assert main(["train", "--preset", "tiny", "--steps", "1", "--micro-batch", "2"]) == 2
    assert "--micro-batch applies to --dry-run only" in capsys.readouterr().err
    assert main(["train", "--preset", "gpt-tiny", "--dry-run", "--dp", "3",
                 "--batch-size", "8"]) == 2
    assert "--batch-size 8 does not divide into --dp 3 x 1" in capsys.readouterr().err


# what ZeRO's per-micro-batch collectives change in the step (ZeRO-k minus the same layout
# with ZeRO-0), dry run against estimate: the overlap of the recipe's collectives held to
# DeepSpeed's (plan.zero_cost) apart from how compute is priced; within 2% of the step
# (ZeRO-3 was 6.4% off when its backward prefetch started after the tied head's backward,
# ZeRO-2 with TP 6.1% when its reduce-scatters went before the TP all-reduces)
ZERO_EFFECT = [Layout(dp=2, tp=1, pp=1, global_batch=4, zero=2),
               Layout(dp=2, tp=1, pp=1, global_batch=4, zero=3),
               Layout(dp=2, tp=2, pp=1, global_batch=4, zero=2),
               Layout(dp=2, tp=2, pp=1, global_batch=4, zero=3),
               Layout(dp=2, tp=2, pp=1, global_batch=4, zero=2, sp=True)]


@pytest.mark.parametrize("lay", ZERO_EFFECT, ids=lambda l: l.short())
def test_zero_changes_the_step_as_the_estimate_says(lay):
    import dataclasses
    dr, est = _pair(lay)
    dr0, est0 = _pair(dataclasses.replace(lay, zero=0))
    assert dr.step_time - dr0.step_time == pytest.approx(est.step_time - est0.step_time,
                                                         abs=0.02 * est0.step_time)


def test_zero3_working_copies_are_the_ledgers_peak(monkeypatch):
    """ZeRO-3's gathered copies in the dry run are what the recipe's own ledger measured
    (Zero3.live), and the planner's rule gives the same: on this small GPT every module at
    once (the rest is under one prefetch of 5e7 elements after the tied embedding)."""
    import workbench.plan.dryrun as D
    from workbench.plan.memory import zero3_gathered_numel, zero3_modules
    got, orig = [], D.Hybrid.build_optimizer
    monkeypatch.setattr(D.Hybrid, "build_optimizer",
                        lambda self, *a, **k: got.append(orig(self, *a, **k)) or got[-1])
    lay = Layout(dp=2, tp=1, pp=1, global_batch=4, zero=3)
    dr = dry_run(CFG, lay, Cluster("a100", 2))
    zero3 = got[0][0]
    assert dr.gathered == {0: zero3.live}
    ledger = zero3.live
    assert ledger.peak == max(b for _, b in ledger.timeline) > 0
    assert ledger.timeline[-1][1] == 0                 # every copy released by the end
    h, V, s, f = CFG.d_model, CFG.vocab_size, CFG.seq_len, CFG.d_ff
    layer = 2 * 2 * h + 4 * (h * h + h) + (h * f + f) + (f * h + h)
    assert ledger.peak == 2 * (V * h + s * h + CFG.n_layer * layer + 2 * h)
    # the dry run's params: the shards' 16-bit weights (ZeRO Table 1); the ledger's peak
    # is a working buffer, beside one layer's 16-bit gradient
    shards = zero3.memory(mixed_precision=True).params
    assert dr.memory["params"] == shards
    assert dr.memory["buffers"] == ledger.peak + 2 * layer
    assert 2 * zero3_gathered_numel(zero3_modules(CFG, 1, 1, 0, 2), 50_000_000) \
        == ledger.peak
