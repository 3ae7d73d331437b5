"""Four planner truths (branch planfix), each held to its source:

1. ``details["reserved_memory"]`` is the caching allocator's reserved peak only where
   ``plan.allocator`` models it (DeepSpeed's BF16_Optimizer pipelines); elsewhere None,
   not the live peak presented as what nvidia-smi reads.
2. torchtitan (``framework="fsdp"``: FSDP2 + DTensor TP) keeps the all-gathered input of
   its column-parallel linears, as torch 2.13's ``ColwiseParallel`` / ``PrepareModuleInput``
   do: no backward re-gather, the gathered input in its activations.
3. The planner's Llama block places each sequence-parallel re-gather beside the first
   input-gradient GEMM autograd runs in its group (v's, w3's), as the recipe does
   (``parallel.ops_table.linear_regather``), held to the recipe's own trace.
4. Notebook 06's exercise 1 counts f and g only; an answer with the backward re-gathers
   gets a hint, not a pass.
"""
import pytest

import workbench as wb
from workbench.exercises.feedback import CheckError
from workbench.plan import allocator as AL
from workbench.plan import llama_layer as L
from workbench.plan.layer_cost import layer_ops
from workbench.plan.memory import layer_activation_bytes, stage_memory


# ---- 1. reserved memory: None where the allocator is not modelled -----------------------

def _gpt_small(dtype="bfloat16"):
    return wb.models.get_config("gpt3-175b", n_layer=8, d_model=1024, n_head=8, seq_len=512,
                                dtype=dtype, vocab_size=8192)


@pytest.mark.parametrize("framework,zero", [("megatron", 1), ("workbench", 1), ("fsdp", 3),
                                            ("deepspeed", 1)])
def test_reserved_memory_is_none_where_the_allocator_is_not_modelled(framework, zero):
    """Before: every framework's ``reserved_memory`` equalled its live peak (and
    ``allocator_cache`` 0), presented as nvidia-smi's reading though only DeepSpeed's
    BF16_Optimizer pipeline is modelled (FSDP, Megatron-LM: no source read)."""
    cfg = _gpt_small()
    # DeepSpeed without a pipe: no BF16_Optimizer; FSDP: ZeRO-3, no pipe
    pp = 1 if framework in ("deepspeed", "fsdp") else 2
    lay = wb.plan.Layout(dp=2, tp=2, pp=pp, zero=zero, recompute="full", global_batch=8,
                         framework=framework)
    est = wb.plan.estimate(cfg, lay, wb.plan.Cluster("a100", lay.world))
    assert not AL.modelled(cfg, lay)
    assert est.details["reserved_memory"] is None
    for d in est.details["stages"].values():
        assert d["reserved_memory"] is None and d["allocator_cache"] is None
    assert "reserved" not in est.explain()
    assert not any("caching allocator" in a for a in est.assumptions())


def test_reserved_memory_stays_for_bf16_optimizer_pipelines():
    cfg = _gpt_small()
    lay = wb.plan.Layout(dp=2, tp=2, pp=4, zero=1, recompute="full", global_batch=16,
                         framework="deepspeed")
    est = wb.plan.estimate(cfg, lay, wb.plan.Cluster("a100", lay.world))
    assert AL.modelled(cfg, lay)
    r = est.details["reserved_memory"]
    assert r is not None and r >= est.memory["total"]
    assert any("caching allocator" in a for a in est.assumptions())


# ---- 2. torchtitan: no backward re-gather, the gathered input kept ----------------------

def _llama(**kw):
    return wb.plan.presets.get_config("llama3-8b", **{**dict(seq_len=1024, n_layer=2), **kw})


def test_torchtitan_layer_has_no_backward_regather():
    """Before: an FSDP2 layout with tp > 1 and sp was priced with Megatron's
    ``sp_regather_*`` all-gathers in backward, which DTensor's sequence parallelism does not
    send (torch 2.13: the Redistribute autograd function's backward only redistributes the
    gradient; ``aten.mm`` saves the gathered input)."""
    cfg = _llama()
    cl = wb.plan.Cluster("h100", 8)
    fsdp = wb.plan.Layout(dp=2, tp=4, sp=True, zero=3, recompute="op", micro_batch=1,
                          global_batch=4, framework="fsdp")
    ops = layer_ops(cfg.d_model, cfg.n_head, cfg.seq_len, 1, 4, True, "op", cfg.d_ff,
                    kv_heads=cfg.n_kv_head, attention="flash", regather=False)
    assert not [o for o in ops if o.name.startswith("sp_regather")]
    with_rg = layer_ops(cfg.d_model, cfg.n_head, cfg.seq_len, 1, 4, True, "op", cfg.d_ff,
                        kv_heads=cfg.n_kv_head, attention="flash")
    assert {o.name for o in with_rg if o.name.startswith("sp_regather")} == {
        "sp_regather_attn", "sp_regather_mlp"}
    # the estimate prices the block so (on the profile FSDP2's SDPA runs on, plan.fsdp2_cost)
    from workbench.plan import costs as C
    from workbench.plan import fsdp2_cost as FS
    prof = FS.sdpa_profile(cl.profile)
    want = C.layer_cost(cfg, 1, 4, True, "op", prof, "flash", regather=False)
    megatron_way = C.layer_cost(cfg, 1, 4, True, "op", prof, "flash")
    layer = wb.plan.estimate(cfg, fsdp, cl).details["layer"]
    assert layer == want
    # the re-gathers hide beside their dgrads, but slow them (the SMs they take)
    assert want.bwd_compute + want.bwd_comm < megatron_way.bwd_compute + megatron_way.bwd_comm
    assert (want.fwd_compute, want.fwd_comm) == (megatron_way.fwd_compute,
                                                 megatron_way.fwd_comm)
    # with the eager kernels too (plan.titan_eager): the same collectives
    eager = wb.plan.estimate(cfg, fsdp, cl, torchtitan_eager="rmsnorm").details["layer"]
    assert eager.bwd_comm == want.bwd_comm
    assert eager.bwd_compute < megatron_way.bwd_compute + wb.plan.estimate(
        cfg, fsdp, cl, torchtitan_eager="rmsnorm").details["torchtitan_eager"]["backward"]
    # Megatron-LM keeps its re-gathers
    meg = wb.plan.estimate(cfg, fsdp.replace(framework="megatron", zero=1), cl)
    assert meg.details["layer"] == C.layer_cost(cfg, 1, 4, True, "op", cl.profile, "flash")


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_kept_gathered_input_counts_in_activations(arch):
    """DTensor keeps the two column-parallel inputs whole: 2 x 2 s b h (1 - 1/t) more per
    layer than Megatron's shards without recompute (notebook 06 sec. 5); op-level SAC and
    full recompute re-run the all-gather, so they keep the same.  Before: the same bytes
    for torchtitan as for Megatron-LM."""
    cfg = _llama() if arch == "llama" else _gpt_small()
    s, h, b, t = cfg.seq_len, cfg.d_model, 2, 4
    extra = 2 * 2 * s * b * h * (1 - 1 / t)
    for rc in ("none", "selective"):
        kept = layer_activation_bytes(cfg, b, t, True, rc, "flash", regather=False)
        shard = layer_activation_bytes(cfg, b, t, True, rc, "flash")
        assert kept - shard == pytest.approx(extra)
        # without sequence parallelism there is no gather to keep or repeat
        assert layer_activation_bytes(cfg, b, t, False, rc, "flash", regather=False) == \
            layer_activation_bytes(cfg, b, t, False, rc, "flash")
    for rc in ("full",) + (("op",) if arch == "llama" else ()):
        assert layer_activation_bytes(cfg, b, t, True, rc, "flash", regather=False) == \
            layer_activation_bytes(cfg, b, t, True, rc, "flash")
    if arch == "llama":        # the estimate reads it for framework="fsdp" only
        lay = wb.plan.Layout(dp=2, tp=t, sp=True, zero=3, recompute="selective",
                             micro_batch=b, global_batch=8, framework="fsdp")
        titan = stage_memory(cfg, lay, 0, "flash")
        recipe = stage_memory(cfg, lay.replace(framework="workbench"), 0, "flash")
        assert titan["activations"] - recipe["activations"] == pytest.approx(
            cfg.n_layer * extra)


# ---- 3. the re-gather beside the first dgrad autograd runs ------------------------------

def test_llama_regather_beside_the_first_dgrad_autograd_runs():
    """Before: the attention's re-gather was priced beside q's dgrad and the MLP's beside
    w1's, the LAST input-gradient GEMMs of their groups; the recipe issues it with the
    first (v's, w3's: autograd runs the linears on one input last-created first)."""
    ops = L.backward_ops(64, 4, 2, 16, 2, 2, True, 192, 2, False, "none")
    beside = {o[0]: o[3] for o in ops if o[0].startswith("sp_regather")}
    assert beside == {"sp_regather_attn": "v_dgrad", "sp_regather_mlp": "w3_dgrad"}
    dgrads = [o[0] for o in ops if o[0].endswith("_dgrad")]
    assert dgrads == ["w2_dgrad", "w3_dgrad", "w1_dgrad", "o_dgrad", "v_dgrad", "k_dgrad",
                      "q_dgrad"]


def test_llama_regather_placement_matches_the_recipes_trace():
    """The recipe's own trace (``Hybrid(tp=2, sp=True)`` on the course's Llama): each
    re-gather starts with the n-th input-gradient GEMM of the backward; the planner's
    ``beside`` is the n-th dgrad of its backward too."""
    from workbench.models.config import get_config
    from workbench.models.data import get_batch
    from workbench.recipes.hybrid import Hybrid
    cfg = get_config("tiny", dropout=0.0, n_layer=1)
    x, y = get_batch(cfg, 4, 0, 0)
    h = Hybrid(tp=2, sp=True)
    h.check(cfg, 4)
    model = h.build_model(cfg, 0)
    with wb.trace("a100") as tr:
        h.forward_backward(model, x, y)
    dgrads = [e for e in tr.events if e.name == "linear" and 0 in e.ranks
              and e.args.get("phase") == "backward" and e.args.get("part") == "dgrad"]
    again = [e for e in tr.events if e.label == "f: re-gather" and 0 in e.ranks]
    traced = [next(i for i, e in enumerate(dgrads) if e.start == ag.start) for ag in again]
    ops = L.backward_ops(cfg.d_model, cfg.n_head, cfg.n_kv_head or cfg.n_head, cfg.seq_len,
                         4, 2, True, cfg.d_ff, 4, False, "none")
    names = [o[0] for o in ops if o[0].endswith("_dgrad")]
    planned = [names.index(o[3]) for o in ops if o[0].startswith("sp_regather")]
    # the LM head's dgrad, on the last stage, runs first in the trace: offset by it
    head = len(dgrads) - len(names)
    assert traced == [head + i for i in planned]


# ---- 4. notebook 06 exercise 1: f and g only ---------------------------------------------

def test_tp_sp_exercise_counts_f_and_g_only(capsys):
    """Before: the docstring and the success message said SP's 4 all-gathers + 4
    reduce-scatters were all it sends ("both ways"), with no word of the backward
    re-gathers, and an answer with them got a generic hint."""
    n, t = 2048 * 12288 * 2, 8
    tp, sp = 4 * 2 * (t - 1) * n // t, 8 * ((t - 1) * n // t)
    doc = wb.exercises.check_tp_sp_layer_bytes.__doc__
    assert "f and g only" in doc and "re-gather" in doc
    with pytest.raises(CheckError, match="re-gathers"):
        wb.exercises.check_tp_sp_layer_bytes(tp, sp + 2 * ((t - 1) * n // t))
    wb.exercises.check_tp_sp_layer_bytes(tp, sp)
    assert "counting f and g" in capsys.readouterr().out
