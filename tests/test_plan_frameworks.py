"""Frameworks as they run (``wb.plan.frameworks``): which one a layout runs, the gradient
dtype each reduces in, and memory that keeps ZeRO's partitioned states apart from the
framework's buffers."""
import pytest

import workbench.plan as P
from workbench.models.config import get_config
from workbench.plan import bf16_optimizer as BF
from workbench.plan.memory import model_state_bytes, stage_params
from workbench.sim_mesh.cost import price

GPT3 = get_config("gpt3-175b")


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
    (dict(framework="fsdp"), r"framework='fsdp' with zero=0.*use zero=3"),
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
    # DeepSpeed's bf16 pipeline runs BF16_Optimizer (plan.bf16_optimizer): its whole fp32
    # gradient buffer (4 bytes a parameter), all-reduced in bf16, then the bf16 all-gather
    ds = P.estimate(GPT3, lay.replace(framework="deepspeed"), cl)
    assert ds.memory["buffers"] == pytest.approx(4 * psi, rel=1e-12)
    assert ds.details["dp_sync"] == pytest.approx(
        BF.dp_sync(psi, lay, cl.profile, 0), rel=1e-12)
    assert "buffers" in est.explain() and "megatron" == est.details["framework"]


def test_dry_run_runs_the_library_recipe_only():
    cfg = get_config("gpt3-175b", n_layer=2, d_model=256, n_head=4, seq_len=128)
    with pytest.raises(ValueError, match=r"framework='megatron'.*framework='workbench'"):
        P.dry_run(cfg, P.Layout(dp=2, framework="megatron"), P.Cluster("a100", 2))


def test_fits_leaves_the_context_and_fragmentation():
    """``fits`` compares with the usable memory: the device's less the runtime's context
    and the allocator's fragmentation, both ASSUMPTIONS the profile cites and the
    explanation prints."""
    import dataclasses
    from workbench.sim_mesh.profiles import get_profile
    a100 = get_profile("a100")
    assert a100.usable_memory() == pytest.approx(a100.memory_bytes * 0.95 - 0.78e9)
    assert "ASSUMPTION" in a100.citations["runtime_memory.fragmentation"]
    cfg, cl = get_config("gpt-22b"), P.Cluster("a100", 8)
    lay = P.Layout(dp=1, tp=8, sp=True, recompute="selective", micro_batch=4, global_batch=4)
    est = P.estimate(cfg, lay, cl)
    assert est.fits and "usable" in est.explain() and "ASSUMED" in est.explain()
    # a device just larger than the layout's bytes: fits only without the margin
    tight = dataclasses.replace(a100, name="tight", memory_bytes=int(est.memory["total"]) + 1)
    bare = dataclasses.replace(tight, name="bare", runtime_memory={})
    assert not P.estimate(cfg, lay, P.Cluster(tight, 8)).fits
    assert P.estimate(cfg, lay, P.Cluster(bare, 8)).fits
    with pytest.raises(ValueError, match="fragmentation"):
        dataclasses.replace(a100, runtime_memory={"context_bytes": 0.0, "fragmentation": 1.0})


def test_estimate_says_what_it_assumed():
    cl = P.Cluster("a100", 64)
    cfg = get_config("gpt-22b")
    lay = P.Layout(dp=8, tp=8, recompute="selective", sp=True, global_batch=16)
    est = P.estimate(cfg, lay, cl)
    got = est.assumptions()
    assert got[0].startswith("Megatron-LM: gradients in a fp32 buffer")
    assert any("unfused core" in a for a in got)
    marked = [k for k, v in cl.profile.citations.items() if "ASSUMPTION" in v]
    profile_line = next(a for a in got if a.startswith("profile a100's figures"))
    assert marked and all(k in profile_line for k in marked)
    assert any(a.startswith("communication buffers ") for a in got)   # plan.comm_memory
    assert got[-1].startswith("collectives priced by NCCL")   # sim_mesh.nccl_tuning
    # the last line of explain() (each wrapped at 100 characters, continuations indented)
    lines = [ln for ln in est.explain().splitlines() if not ln.startswith(" " * 4)]
    assert lines[-1].startswith("  assumed: Megatron-LM")
    ds = P.estimate(cfg, lay.replace(zero=3, framework="deepspeed"), cl, attention="flash",
                    overlap=False)
    assert ds.assumptions()[0].startswith("DeepSpeed") and \
        "not overlapped" in " ".join(ds.assumptions())
    assert "ZeRO-3 gathers module by module" in ds.assumptions()[0]
    # ZeRO-1 (MT-NLG, BLOOM) and no ZeRO: the line names the stage, not ZeRO-3's gathers
    for z in (0, 1):
        line = P.estimate(cfg, lay.replace(zero=z, framework="deepspeed"), cl).assumptions()[0]
        assert "ZeRO-3" not in line and line.endswith(f"ZeRO-{z}" if z else "no ZeRO"), line


def test_close_step_times_are_a_tie():
    from workbench.plan.search import TIE, Ranking
    cfg, cl = get_config("gpt-22b"), P.Cluster("a100", 64)
    a = P.Layout(dp=8, tp=8, recompute="selective", sp=True, global_batch=16)
    ea, eb = P.estimate(cfg, a, cl), P.estimate(cfg, a.replace(recompute="full"), cl)
    assert ea.step_time < eb.step_time
    far = Ranking([(a, ea), (eb.layout, eb)]).explain()[0]
    assert far.startswith("#1 beats #2 by") == (eb.step_time - ea.step_time
                                                >= TIE * eb.step_time)
    import dataclasses
    near = dataclasses.replace(eb, step_time=ea.step_time * (1 + TIE / 2))
    line = Ranking([(a, ea), (eb.layout, near)]).explain()[0]
    assert line.startswith("#1 and #2 tie: ") and "under the 1%" in line


def test_fsdp_prices_fully_shard_per_block():
    """FSDP2 as torchtitan runs it (``plan.frameworks``): one all-gather of a block's
    16-bit parameters before its forward and again before its backward (not the root's,
    nor torchtitan's last block's: they stay gathered), one block prefetched, its
    gradients reduce-scattered in fp32 every micro-batch; on the same stream model as
    ZeRO-3 (``zero_cost``), so the exposure is what that model gives for those
    collectives and units, and the bytes sent are those gathers + 1 fp32
    reduce-scatter per micro-batch."""
    from workbench.plan import costs as C, fsdp2_cost as FS, fsdp2_root as FR, zero_cost as Z
    from workbench.plan.edge_cost import edge_times
    from workbench.sim_mesh.cost import overlap_rate, wire_bytes
    cfg = get_config("gpt3-175b", n_layer=8)
    cl = P.Cluster("a100", 64)
    lay = P.Layout(dp=8, tp=8, zero=3, recompute="full", global_batch=16, framework="fsdp")
    est = P.estimate(cfg, lay, cl)
    assert est.details["grad_reduce_bytes"] == 4 and est.details["framework"] == "fsdp"
    assert "FSDP2" in " ".join(est.assumptions())
    layer = C.layer_cost(cfg, 1, 8, False, "full", cl.profile)
    head = C.head_cost(cfg, 1, 8, False, cl.profile)
    blocks = Z.stage_blocks(cfg, lay, 0, layer, head, edge_times(cfg, 1, 8, False,
                                                                 cl.profile))
    assert len(blocks) == 8 + 2                       # embeddings, 8 blocks, norm + head
    ranks = tuple(lay.dp_ranks(0, 0))
    # FSDP2's copies (plan.fsdp2_cost): on the blocks' compute, and in series with the
    # gathers and reduce-scatters on the comm stream
    cp = FS.stage_copies(blocks, 8, True, True, 8, lay.m, cl.profile)
    assert cp["stay"] == (0, 8, 9)     # the root (embeddings; norm + head), the last block
    # the root's parameters one unit, gathered first, reduce-scattered last
    # (plan.fsdp2_root): at index 0, the embedding's and head's units now empty
    blocks, stay = FR.root_unit(cp["blocks"], cp["stay"], True, True, 8, cl.profile)
    assert stay == (0, 1, 9, 10)
    fwd, bwd = Z.zero_exposed(
        blocks, 3, lambda n: C.group_price("all_gather", 2 * n, ranks, cl.profile)
        + cp["gather_extra"](n),
        lambda n: C.group_price("reduce_scatter", 4 * n, ranks, cl.profile)
        + cp["reduce_extra"](n),
        prefetch_numel=1, rate=overlap_rate(cl.profile, ranks), stay=stay)
    assert est.details["dp_sync"] == pytest.approx(lay.m * (fwd + bwd), rel=1e-12)
    psi = stage_params(cfg, 8, 1, 0)
    kept = blocks[0].numel + blocks[9].numel
    sent = lay.m * (wire_bytes("all_gather", 2 * psi, 8)
                    + wire_bytes("all_gather", 2 * (psi - kept), 8)
                    + wire_bytes("reduce_scatter", 4 * psi, 8))
    assert est.details["stages"]["only"]["dp_sent"] == pytest.approx(sent, rel=1e-12)
    # one block ahead exposes more than DeepSpeed-style 5e7-element prefetch would
    wide = Z.zero_exposed(
        blocks, 3, lambda n: C.group_price("all_gather", 2 * n, ranks, cl.profile)
        + cp["gather_extra"](n),
        lambda n: C.group_price("reduce_scatter", 4 * n, ranks, cl.profile)
        + cp["reduce_extra"](n),
        rate=overlap_rate(cl.profile, ranks), stay=stay)
    assert sum(wide) <= fwd + bwd


def test_fsdp_memory_states_and_unit_buffers():
    """ZeRO-3's states exactly (FSDP2's fp32 parameter shards are the master copy: 16
    bytes per parameter / dp in all), and the buffers: two gathered 16-bit units (the
    largest adjacent pair) and one unit's 16-bit
    gradient with its fp32 copy for the reduce-scatter; GPT-3's block (12 h^2 / 8) is
    the largest unit, so two adjacent blocks are the gathered peak."""
    from workbench.plan.memory import layer_params
    cfg = get_config("gpt3-175b", n_layer=4)
    lay = P.Layout(dp=8, tp=8, zero=3, recompute="full", global_batch=8, framework="fsdp")
    est = P.estimate(cfg, lay, P.Cluster("a100", 64))
    psi = stage_params(cfg, 8, 1, 0)
    states = model_state_bytes(psi, 8, 3)
    assert {k: est.memory[k] for k in states} == pytest.approx(states, rel=1e-12)
    h, V, s = cfg.d_model, cfg.vocab_size, cfg.seq_len
    emb, blk = V * h / 8 + s * h, layer_params(cfg, 8)
    assert blk > emb
    assert est.memory["buffers"] == pytest.approx(2 * (2 * blk) + 6 * blk, rel=1e-12)
    with pytest.raises(ValueError, match=r"framework='fsdp' with zero=1"):
        P.Layout(dp=8, zero=1, framework="fsdp")
