"""The planner (workbench.plan): memory and FLOP formulas against the published ones,
the pipeline model against the schedule simulator, and errors on bad input."""
import pytest

import workbench.plan as P
from workbench.models import get_config, param_count
from workbench.parallel.schedules import gpipe, interleaved_1f1b, one_f_one_b, simulate
from workbench.plan.costs import model_and_hardware_flops
from workbench.plan.memory import (in_flight, layer_activation_bytes, model_state_bytes,
                                   stage_params)
from workbench.sim_mesh import estimates as E
from workbench.sim_mesh.cost import price

GPT3 = get_config("gpt3-175b")
A100 = P.Cluster("a100", 1024)


def _lay(**kw):
    base = dict(dp=8, tp=8, pp=16, recompute="full", micro_batch=1, global_batch=1536)
    return P.Layout(**{**base, **kw})


# ---- memory -------------------------------------------------------------------------------

def test_zero_figure_1_exactly():
    # Rajbhandari et al. 2020, Figure 1: psi = 7.5e9, N_d = 64 (published.md)
    got = [sum(model_state_bytes(7.5e9, 64, z).values()) for z in range(4)]
    assert got == [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    assert [round(g / 1e9, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]
    for z in range(4):
        assert got[z] == E.zero_model_state_bytes(7.5e9, 64, z)


def test_stage_params_add_up_to_the_module():
    for name in ("gpt-tiny", "gpt3-175b"):
        cfg = get_config(name)
        module = param_count(cfg).module
        assert stage_params(cfg, 1, 1, 0) == module
        h, V = cfg.d_model, cfg.vocab_size
        for pp in (p for p in (2, 4) if cfg.n_layer % p == 0):    # + tied copy on the last
            total = sum(stage_params(cfg, 1, pp, s) for s in range(pp))
            assert total == module + V * h
    # TP: matrices and their column-parallel biases split, o/fc2 biases and LayerNorms not
    cfg = GPT3
    h = cfg.d_model
    one = stage_params(cfg, 1, 96, 1)
    assert 8 * stage_params(cfg, 8, 96, 1) - one == 7 * 6 * h


def test_estimate_model_states_are_16_bytes_per_parameter():
    cfg = get_config("gpt-22b")
    est = P.estimate(cfg, P.Layout(dp=1), P.Cluster("a100", 1))
    n = param_count(cfg).module
    assert est.memory["params"] == 2 * n and est.memory["grads"] == 2 * n
    assert est.memory["optimizer"] == 12 * n
    assert not est.fits and est.memory["total"] > 80e9


# Korthikanti et al. 2022 Table 2 (published.md), on their 22B GPT layer
@pytest.mark.parametrize("tp, sp, rc, case", [
    (1, False, "none", "none"), (8, False, "none", "tp"), (8, True, "none", "tp+sp"),
    (8, False, "selective", "tp+selective"), (8, True, "selective", "tp+sp+selective"),
    (8, False, "full", "full"), (4, False, "none", "tp"), (2, True, "none", "tp+sp")])
def test_activations_are_table_2(tp, sp, rc, case):
    cfg = get_config("gpt-22b")
    s, h, a, b = cfg.seq_len, cfg.d_model, cfg.n_head, 4
    assert layer_activation_bytes(cfg, b, tp, sp, rc) == pytest.approx(
        E.activation_bytes_per_layer(s, b, h, a, tp, case), rel=1e-12)


def test_activations_without_dropout_and_with_flash_attention():
    cfg = get_config("gpt-22b")
    s, h, a, b = cfg.seq_len, cfg.d_model, cfg.n_head, 1
    nodrop = cfg.replace(dropout=0.0)
    assert layer_activation_bytes(nodrop, b, 1, False, "none") == s * b * h * 32 + 2 * a * s * s * b
    flash = layer_activation_bytes(cfg, b, 8, True, "none", attention="flash")
    assert flash == 34 * s * b * h / 8 + 4 * a * s * b / 8


@pytest.mark.parametrize("p, m", [(4, 8), (4, 4), (4, 2), (8, 16)])
def test_in_flight_matches_the_schedule_simulator(p, m):
    for name, build in (("1f1b", one_f_one_b), ("gpipe", gpipe)):
        peak = simulate(build(p, m)).peak_inflight
        assert [in_flight(name, p, m, 1, s) for s in range(p)] == list(peak)
    for v in (2, 3):
        if m % p == 0:
            peak = simulate(interleaved_1f1b(p, m, v)).peak_inflight       # in chunks
            assert [in_flight("interleaved_1f1b", p, m, v, s) * v for s in range(p)] == \
                list(peak)


def test_interleaved_first_stage_is_korthikanti_4_2_3():
    L, p, v, m = 96, 8, 3, 64
    layers = in_flight("interleaved_1f1b", p, m, v, 0) * L / p
    assert layers == pytest.approx(L * (1 + (p - 1) / (p * v)))


def test_memory_orders_and_fits():
    base = P.estimate(GPT3, _lay(recompute="none"), A100)
    sel = P.estimate(GPT3, _lay(recompute="selective"), A100)
    full = P.estimate(GPT3, _lay(recompute="full"), A100)
    sp = P.estimate(GPT3, _lay(recompute="selective", sp=True), A100)
    acts = [e.memory["activations"] for e in (base, sel, sp, full)]
    assert acts == sorted(acts, reverse=True)
    z1 = P.estimate(GPT3, _lay(zero=1), A100)
    assert z1.memory["optimizer"] == pytest.approx(full.memory["optimizer"] / 8)
    for e in (base, sel, full, sp, z1):
        assert e.fits == (e.memory["total"] <= 80e9 * 0.95 - 0.78e9)   # usable memory
        parts = ("params", "grads", "optimizer", "buffers", "comm_buffers", "activations",
                 "workspace")
        assert e.memory["total"] == pytest.approx(sum(e.memory[k] for k in parts))


# ---- time ---------------------------------------------------------------------------------

def test_flops_are_eq_7_and_eq_3():
    B, c = 1536, GPT3
    model, hw = model_and_hardware_flops(c, B, "full")
    assert model == pytest.approx(E.model_flops(B, c.seq_len, c.n_layer, c.d_model,
                                                c.vocab_size), rel=1e-12)
    assert hw == pytest.approx(E.megatron_flops(B, c.seq_len, c.n_layer, c.d_model,
                                                c.vocab_size), rel=1e-12)
    assert model_and_hardware_flops(c, B, "none") == (model, model)
    est = P.estimate(c, _lay(), A100)
    assert est.mfu == pytest.approx(E.mfu(model, est.step_time, 312e12, 1024), rel=1e-12)
    assert est.hfu == pytest.approx(est.mfu * hw / model, rel=1e-12)
    assert est.tflops_per_device == pytest.approx(est.hfu * 312, rel=1e-12)
    assert est.step_time == pytest.approx(sum(est.breakdown.values()), rel=1e-12)


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2),
                                         ("interleaved_1f1b", 3)])
def test_pipeline_time_matches_the_schedule_simulator(schedule, v):
    cfg = get_config("gpt-22b")
    lay = P.Layout(dp=2, tp=8, pp=4, recompute="selective", micro_batch=1, global_batch=16,
                   schedule=schedule, v=v)
    est = P.estimate(cfg, lay, P.Cluster("a100", 64))
    st = est.details["stages"]
    per_rank = [st["first"]["time"]] + [st["middle"]["time"]] * 2 + [st["last"]["time"]]
    assert st["last"]["time"] > st["middle"]["time"]          # the head: unequal stages
    sim = est.pipeline()                                      # simulate(), from the estimate
    assert sim.schedule.name == schedule and sim.schedule.p == 4 and sim.schedule.m == lay.m
    assert list(sim.busy) == pytest.approx([lay.m * t for t in per_rank], rel=1e-12)
    ours = lay.m * max(per_rank) + est.breakdown["bubble"]
    assert ours == pytest.approx(sim.makespan, rel=1e-9)
    # fewer micro-batches for a figure: the same bubble (m >= p)
    few = est.pipeline(m=lay.pp)
    assert few.schedule.m == lay.pp
    assert few.makespan - lay.pp * max(per_rank) == pytest.approx(est.breakdown["bubble"],
                                                                  rel=1e-9)
    with pytest.raises(ValueError, match="pipeline"):
        est.pipeline(m=0)


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 4, 8, 1), ("gpipe", 8, 8, 1),
                                           ("interleaved_1f1b", 4, 8, 2)])
def test_equal_stages_give_the_published_bubble(name, p, m, v):
    from workbench.parallel.schedules import formula_bubble
    from workbench.plan.estimate import pipeline_bubble
    build = {"1f1b": one_f_one_b, "gpipe": gpipe}.get(name)
    sched = build(p, m) if build else interleaved_1f1b(p, m, v)
    f, b = 0.01, 0.02                                    # per chunk action
    want = formula_bubble(sched, f, b).bubble_time        # (p-1)(f+b), f, b per chunk
    assert pipeline_bubble([v * (f + b)] * p, v) == pytest.approx(want, rel=1e-12)


def test_explain_shows_the_terms():
    est = P.estimate(GPT3, _lay(), A100)
    text = est.explain()
    b = est.breakdown
    assert f"{est.step_time:.3f} s = compute {b['compute']:.3f}" in text
    assert f"x m = {est.layout.m}" in text and "fits" in text and "MFU" in text


def test_dp_sync_is_priced_on_the_dp_group():
    est = P.estimate(GPT3, _lay(), A100)
    lay = est.layout
    psi = stage_params(GPT3, 8, 16, 0)                  # the first stage has the most
    # Megatron-LM reduces a bf16 model's gradients in fp32 (arguments.py), 4 bytes each
    assert GPT3.dtype == "bfloat16" and lay.engine == "megatron"
    want = price("all_reduce", 4 * psi, lay.dp_ranks(0, 0), "a100")
    assert lay.dp_ranks(0, 0) == [0, 8, 16, 24, 32, 40, 48, 56]       # one per node
    assert est.details["dp_sync"] == pytest.approx(want, rel=1e-12)
    assert est.details["grad_reduce_bytes"] == 4
    # fp16 (Megatron's buffer in the parameters' dtype) and this library's recipe: 2 bytes
    half = P.estimate(GPT3.replace(dtype="float16"), _lay(), A100)
    ours = P.estimate(GPT3, _lay(framework="workbench"), A100)
    for e in (half, ours):
        assert e.details["dp_sync"] == pytest.approx(
            price("all_reduce", 2 * psi, lay.dp_ranks(0, 0), "a100"), rel=1e-12)
    # its fp32 buffer: 2 bytes per parameter beyond ZeRO's 16-bit gradients
    assert est.memory["buffers"] == 2 * psi and est.memory["grads"] == 2 * psi
    assert half.memory["buffers"] == ours.memory["buffers"] == 0
    one = P.estimate(GPT3, _lay(dp=1, global_batch=192), P.Cluster("a100", 128))
    assert one.details["dp_sync"] == 0.0


# ---- search -------------------------------------------------------------------------------

def test_search_ranks_fitting_layouts_and_explains():
    cfg, cl = get_config("gpt-22b"), P.Cluster("a100", 64)
    best = P.search(cfg, cl, global_batch=64, top=4)
    assert len(best) == 4 and best.fitting <= best.tried
    times = [e.step_time for _, e in best]
    assert times == sorted(times)
    assert all(e.fits and e.layout == lay for lay, e in best)
    hand = P.estimate(cfg, P.Layout(dp=8, tp=8, pp=1, recompute="selective", micro_batch=1,
                                    global_batch=64), cl)
    assert hand.fits and best[0][1].step_time <= hand.step_time
    why = best.explain()
    assert len(why) == 3 and why[0].startswith("#1 beats #2")
    assert "#" in str(best) and "MFU" in best.table()


def test_explain_names_the_framework_each_layout_runs():
    """A layout left at framework=None runs its ZeRO stage's default (Layout.engine): the
    explanation names that framework, never None, and lists no change where two layouts
    resolve to the same one."""
    from workbench.plan.search import Ranking
    cfg, cl = get_config("gpt-22b"), P.Cluster("a100", 64)
    lays = [P.Layout(dp=8, tp=8, zero=z, recompute="selective", micro_batch=1,
                     global_batch=64, framework=f)
            for z, f in ((1, None), (1, "megatron"), (2, "workbench"))]
    assert [lay.engine for lay in lays] == ["megatron", "megatron", "workbench"]
    ranked = Ranking([(lay, P.estimate(cfg, lay, cl)) for lay in lays])
    why = ranked.explain()
    assert "framework" not in why[0]                      # None and "megatron": the same
    assert "framework workbench -> megatron" in why[1]
    assert "None" not in " ".join(why)


# ---- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("make, words", [
    (lambda: P.estimate(GPT3, _lay(dp=4), A100), ["dp x tp x pp", "512", "devices=1024"]),
    (lambda: P.estimate(GPT3, _lay(tp=64, dp=1), A100), ["tp=64", "n_head=96"]),
    (lambda: P.estimate(GPT3, _lay(pp=64, tp=2), A100), ["pp x v", "n_layer=96"]),
    (lambda: _lay(global_batch=1004), ["global_batch=1004", "micro_batch x dp", "8"]),
    (lambda: P.Cluster("b200", 8), ["profile='b200'", "a100"]),
    (lambda: _lay(schedule="zb"), ["schedule='zb'", "1f1b"]),
    (lambda: _lay(schedule="interleaved_1f1b"), ["v=1", "v >= 2"]),
    (lambda: _lay(v=2), ["v=2", "interleaved_1f1b"]),
    (lambda: _lay(zero=2), ["zero=2", "pp=16"]),
    (lambda: _lay(sp=True, tp=1, dp=64), ["sp=True", "tp=1"]),
    (lambda: _lay(recompute="some"), ["recompute='some'"]),
    (lambda: _lay(schedule="interleaved_1f1b", v=2, global_batch=8 * 24),
     ["m=24", "pp=16"]),
    (lambda: P.estimate("gpt3", P.Layout(), P.Cluster("a100", 1)),
     ["model='gpt3'", "arch='llama'", "arch='gpt'"]),
    (lambda: P.estimate(get_config("tiny"), P.Layout(), P.Cluster("a100", 1)),
     ["dtype='float32'", "bfloat16"]),
    (lambda: P.estimate(get_config("gpt-tiny"), P.Layout(), P.Cluster("a100", 1)),
     ["dtype='float32'", "bfloat16"]),
    (lambda: P.search(GPT3, A100, global_batch=0), ["global_batch=0"]),
])
def test_bad_input_names_argument_value_and_fix(make, words):
    with pytest.raises(ValueError) as e:
        make()
    for w in words:
        assert w in str(e.value), str(e.value)


def test_schedule_names_as_the_course_writes_them():
    assert _lay(schedule="1F1B").schedule == "1f1b"
    assert _lay(schedule="GPipe").schedule == "gpipe"
    assert _lay(schedule="Interleaved 1F1B", v=2).schedule == "interleaved_1f1b"
    assert _lay(schedule="interleaved", v=3).schedule == "interleaved_1f1b"


def test_cli_plan(capsys):
    from workbench.cli import main
    assert main(["plan", "--model", "gpt-22b", "--devices", "64", "--global-batch", "64",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "step s" in out and "#1 beats #2" in out
    assert main(["plan", "--model", "gpt-22b", "--profile", "tpu", "--devices", "64"]) == 2
    assert "error: Cluster: --profile tpu is not known" in capsys.readouterr().err


def test_search_says_when_nothing_fits():
    none = P.search(GPT3, P.Cluster("a100", 8), global_batch=8)
    assert len(none) == 0 and none.tried > 0 and none.fitting == 0
    need, lay = none.least
    assert need > 80e9 and "none fits" in str(none) and lay.short() in str(none)


def test_zero3_overlap_hides_only_what_compute_covers():
    """Every micro-batch: each module's gather twice and its reduce-scatter once; with
    overlap, all but the embedding's first gather and its (tied) gradient's
    reduce-scatter can hide (``plan.zero_cost``)."""
    cfg, cl = get_config("gpt-22b"), P.Cluster("a100", 64)
    # this library's recipe: one gather per module, one reduce-scatter per parameter
    # (parallel.strategies.fsdp_dist; zero_cost.recipe_blocks)
    lay = P.Layout(dp=8, tp=8, zero=3, recompute="selective", micro_batch=1, global_batch=16,
                   framework="workbench")
    hidden, exposed = (P.estimate(cfg, lay, cl, overlap=o) for o in (True, False))
    assert exposed.comm_bytes == hidden.comm_bytes
    assert hidden.details["dp_sync"] < exposed.details["dp_sync"]
    L, h, s, V, f = cfg.n_layer, cfg.d_model, cfg.seq_len, cfg.vocab_size, cfg.d_ff
    col = (h * h / 8, h / 8)                       # q, k, v: column-parallel, with bias
    layer = [(h, h), col, col, col, (h * h / 8, h), (h, h), (h * f / 8, f / 8),
             (f * h / 8, h)]                       # LayerNorm, q, k, v, o, LayerNorm, fc1, fc2
    mods = [(V * h / 8,), (s * h,)] + layer * L + [(h, h)]   # embeddings; final LayerNorm
    assert sum(map(sum, mods)) == stage_params(cfg, 8, 1, 0)
    ranks = lay.dp_ranks()

    def ag(n):
        return price("all_gather", 2 * n, ranks, "a100")

    def rs(n):
        return price("reduce_scatter", 2 * n, ranks, "a100")
    whole = sum(2 * ag(sum(m)) + sum(rs(n) for n in m) for m in mods)
    assert exposed.details["dp_sync"] == pytest.approx(lay.m * whole)
    assert hidden.details["dp_sync"] >= lay.m * (ag(V * h / 8) + rs(V * h / 8))


def test_calibrated_layer_times_are_used_when_present(monkeypatch):
    """The clock's ``layer_cost.layer_times`` replaces the roofline (interface of issue 11)."""
    from collections import namedtuple

    from workbench.plan import costs
    LT = namedtuple("LayerTimes", "forward backward combined ops")
    seen = {}
    # the priced collectives: what each leaves exposed is the layer's communication, their
    # buffers the bytes it sends
    n = 2 * 2048 * 4 * 6144
    ops = ({"name": "tp_out_1", "phase": "forward", "op_class": "all_reduce", "exposed": 0.9e-3,
            "bytes": n},
           {"name": "fc1_gemm", "phase": "forward", "op_class": "matmul", "exposed": 2e-3,
            "bytes": 3 * n},
           {"name": "tp_grad_fc1", "phase": "backward", "op_class": "all_reduce",
            "exposed": 0.1e-3, "bytes": n})

    def fake(h, a, s, b, tp, sp=False, recompute="none", ffn=None, dtype="bfloat16",
             profile="a100", tp_ranks=None, dropout=None):
        seen.update(h=h, a=a, s=s, b=b, tp=tp, sp=sp, recompute=recompute, ffn=ffn,
                    tp_ranks=tp_ranks)
        return LT(7.7e-3, 11.9e-3, 19.6e-3, ops)
    monkeypatch.setattr(costs, "_layer_times", fake)
    costs.layer_cost.cache_clear()
    try:
        cfg = get_config("gpt-22b")
        c = costs.layer_cost(cfg, 4, 8, False, "none", A100.profile)
    finally:
        costs.layer_cost.cache_clear()
    assert seen == dict(h=6144, a=64, s=2048, b=4, tp=8, sp=False, recompute="none",
                        ffn=4 * 6144, tp_ranks=list(range(8)))
    assert c.fwd_compute + c.fwd_comm == pytest.approx(7.7e-3)
    assert c.bwd_compute + c.bwd_comm == pytest.approx(11.9e-3)
    assert (c.fwd_comm, c.bwd_comm) == (0.9e-3, 0.1e-3)
    assert c.comm_bytes == 2 * 2 * 7 * n // 8      # the two all-reduces' 2 (t - 1) / t n


def test_zero3_counts_its_working_copies():
    """The gathered 16-bit weights at their peak: the word embedding computing, and the
    position embedding and the first layer's modules prefetched up to fc1 (where 5e7
    elements ahead is first reached, DeepSpeed's stage3_prefetch_bucket_size)."""
    from workbench.plan.memory import layer_params
    cfg, cl = get_config("gpt-22b"), P.Cluster("a100", 64)
    lay = P.Layout(dp=8, tp=8, zero=3, recompute="full", micro_batch=1, global_batch=16)
    mem = P.estimate(cfg, lay, cl).memory
    psi, one = stage_params(cfg, 8, 1, 0), layer_params(cfg, 8)
    h, f, V, s = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len
    ahead = s * h + 2 * h + 3 * (h * h // 8 + h // 8) + (h * h // 8 + h) + 2 * h
    ahead += h * f // 8 + f // 8                      # fc1 takes it past 5e7
    assert ahead >= 5e7 > ahead - (h * f // 8 + f // 8)
    # ZeRO's partitioned states exactly (Table 1), the working copies as buffers
    assert mem["params"] == mem["grads"] == 2 * psi / 8
    assert mem["optimizer"] == 12 * psi / 8
    # and the gradients not yet reduced: DeepSpeed's reduce bucket (5e8 elements, its
    # own buffer with contiguous_gradients) beside the largest parameter's gradient (the
    # word embedding's V h / t), not a whole layer's
    assert V * h // 8 > h * f // 8 + f // 8 and one > V * h // 8
    unreduced = 500_000_000 + -(-(V * h // 8) // 8) * 8
    assert mem["buffers"] == pytest.approx(2 * (V * h // 8 + ahead) + 2 * unreduced)
