"""Megatron-LM's --tp-comm-overlap (``workbench.plan.tp_overlap``): the chunked pipelines
against hand-computed timelines, their limits, the layer and the estimate with the flag,
and what is refused."""
import pytest

import workbench as wb
from workbench.plan import Cluster, Layout, estimate
from workbench.plan import tp_overlap as T
from workbench.plan.costs import layer_cost
from workbench.plan.layer_cost import layer_ops
from workbench.sim_mesh import cost
from workbench.sim_mesh.profiles import get_profile


# ring exchange: copies back to back from 0; GEMM chunk i starts at max(end of i-1, i c)
@pytest.mark.parametrize("g, c, n, want", [
    (2.0, 1.0, 4, (8.0, 0.0)),     # copies faster than the GEMM: nothing shows, no fill
    (2.0, 2.0, 4, (8.0, 0.0)),     # equal: chunk i starts exactly as copy i lands
    (1.0, 3.0, 4, (4.0, 6.0)),     # 1 | wait to 3, 4 | wait to 6, 7 | wait to 9, 10
    (2.0, 3.0, 3, (6.0, 2.0)),     # 2 | 3..5 | 6..8: (n - 1)(c - g)
    (5.0, 9.0, 1, (5.0, 0.0)),     # one chunk: no copy
])
def test_ring_exchange_timeline(g, c, n, want):
    assert T.ring_exchange(g, c, n) == pytest.approx(want)


def test_ring_exchange_limits():
    busy, exposed = T.ring_exchange(1.0, 1e-6, 8)          # comm << gemm: all hidden
    assert busy == 8.0 and exposed == 0.0
    busy, exposed = T.ring_exchange(1e-6, 1.0, 8)          # comm >> gemm: comm-bound
    assert busy + exposed == pytest.approx(7.0 + 1e-6)     # 7 copies, then the last chunk


# pipeline: RS chunk i starts when GEMM chunk i and RS i-1 are done
@pytest.mark.parametrize("g, c, n, rate, want", [
    (2.0, 1.0, 4, 1.0, (8.0, 1.0)),    # comm << gemm: only the last chunk's RS shows
    (1.0, 3.0, 4, 1.0, (4.0, 9.0)),    # RS 1..4, 4..7, 7..10, 10..13: comm-bound, 1 + 4c
    # chunk 0: 0..2; RS 0: 2..3 beside chunk 1, at half speed: 0.5 done by 3, 1.5 more
    # alone: 4.5; RS 1: 4.5..5.5
    (2.0, 1.0, 2, 0.5, (4.5, 1.0)),
])
def test_pipeline_timeline(g, c, n, rate, want):
    assert T.pipeline(g, c, n, rate) == pytest.approx(want)


def test_pipeline_limits():
    busy, exposed = T.pipeline(1.0, 1e-6, 4)               # only the drain chunk shows
    assert busy == pytest.approx(4.0) and exposed == pytest.approx(1e-6)
    busy, exposed = T.pipeline(1e-6, 1.0, 4)               # comm-bound: g + n c
    assert busy + exposed == pytest.approx(4.0 + 1e-6)


@pytest.mark.parametrize("g, c, rate, want", [
    (10.0, 4.0, 0.5, (12.0, 0.0)),     # r C < G: the GEMM takes G + (1 - r) C
    (1.0, 4.0, 0.5, (2.0, 2.0)),       # r C >= G: the GEMM ends at G / r, C - G / r shows
    (3.0, 2.0, 1.0, (3.0, 0.0)),       # no SMs held: max(G, C)
])
def test_bulk(g, c, rate, want):
    assert T.bulk(g, c, rate) == pytest.approx(want)


def test_sm_rate_from_te_default():
    h100 = get_profile("h100")
    assert T.UB_COMM_SMS == 16 and T.PIPELINE_SPLITS == 4
    assert T.sm_rate(h100) == pytest.approx((132 - 16) / 132)
    # a GEMM shape: the tile waves on 116 SMs over those on 132
    shape = (1, 4096, 7168)
    assert T.sm_rate(h100, 16, shape) == pytest.approx(
        cost.gemm_efficiency(shape, h100, 116) / cost.gemm_efficiency(shape, h100))


@pytest.mark.parametrize("fn, args", [(T.ring_exchange, (-1.0, 1.0, 2)),
                                      (T.ring_exchange, (1.0, 1.0, 0)),
                                      (T.pipeline, (1.0, 1.0, 4, 0.0)),
                                      (T.pipeline, (1.0, float("nan"), 4)),
                                      (T.bulk, (1.0, 1.0, 1.5)),
                                      (T.bulk, (True, 1.0))])
def test_bad_arguments_raise(fn, args):
    with pytest.raises(ValueError):
        fn(*args)


# one GPT layer, H100, tp 8, sp (the shape of Megatron-LM's 2024 "32B" row, small s)
_LAYER = dict(h=1024, a=16, s=2048, b=1, tp=8, sp=True, profile="h100", attention="flash")


def _by_name(ops):
    out = {}
    for o in ops:
        out.setdefault((o.phase, o.name), []).append(o)
    return out


def test_layer_with_overlap_hides_what_the_chunks_allow():
    off, on = layer_ops(**_LAYER), layer_ops(**_LAYER, tp_comm_overlap=True)
    assert [(o.phase, o.name) for o in off] == [(o.phase, o.name) for o in on]
    prof, ranks = get_profile("h100"), tuple(range(8))
    b_off, b_on = _by_name(off), _by_name(on)
    # forward QKV: TE's ring exchange in 8 chunks, one launch more per chunk
    ag, gemm = b_on[("forward", "sp_all_gather_1")][0], b_on[("forward", "qkv_gemm")][0]
    g = (b_off[("forward", "qkv_gemm")][0].seconds + 7 * prof.compute_path("bfloat16")[3]) / 8
    c = cost.choose("send_recv", ag.bytes / 8, ranks[:2], prof).seconds
    assert (gemm.seconds, ag.exposed) == pytest.approx(T.ring_exchange(g, c, 8))
    assert ag.algorithm == "userbuffers ring_exchange (qkv_fprop)"
    # forward proj: the 4-chunk pipeline, the RS at a quarter of NCCL's whole price
    rs, gemm = b_on[("forward", "tp_out_1")][0], b_on[("forward", "proj_gemm")][0]
    g = (b_off[("forward", "proj_gemm")][0].seconds + 3 * prof.compute_path("bfloat16")[3]) / 4
    assert (gemm.seconds, rs.exposed) == pytest.approx(
        T.pipeline(g, rs.seconds / 4, 4, 116 / 132))
    # every collective: exposed <= its own time, and less than without the flag in forward
    for key, ops in b_on.items():
        for o, o0 in zip(ops, b_off[key]):
            if o.op_class in cost.KINDS:
                assert 0 <= o.exposed <= o.seconds
                assert o.seconds == o0.seconds            # same NCCL price of the buffer
                if key[0] == "forward":
                    assert o.exposed < o0.exposed
    fwd = lambda ops: sum(o.exposed for o in ops if o.phase == "forward")
    assert fwd(on) < fwd(off)


def test_layer_cost_reports_exposed_communication():
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=512, seq_len=2048, n_layer=2,
                                n_head=16, d_model=1024, dtype="bfloat16")
    prof = get_profile("h100")
    lc = layer_cost(cfg, 1, 8, True, "none", prof, "flash", False, True)
    ops = layer_ops(**_LAYER, ffn=cfg.d_ff, tp_comm_overlap=True, dropout=cfg.dropout > 0)
    comm = lambda fwd: sum(o.exposed for o in ops if o.op_class in cost.KINDS
                           and (o.phase == "forward") == fwd)
    assert lc.fwd_comm == pytest.approx(comm(True)) and lc.bwd_comm == pytest.approx(comm(False))
    total = sum(o.exposed for o in ops)
    assert lc.total == pytest.approx(total)
    plain = layer_cost(cfg, 1, 8, True, "none", prof, "flash")
    assert lc.comm_bytes == plain.comm_bytes and lc.total < plain.total


def test_tp1_overlap_changes_nothing():
    one = dict(_LAYER, tp=1, sp=False)
    assert layer_ops(**one, tp_comm_overlap=True) == layer_ops(**one)
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=512, seq_len=512, n_layer=2,
                                n_head=4, d_model=256, dtype="bfloat16")
    lay = Layout(dp=4, tp=1, zero=1, global_batch=8)
    a = estimate(cfg, lay, Cluster("h100", 4), tp_comm_overlap=True)
    b = estimate(cfg, lay, Cluster("h100", 4))
    assert a.step_time == b.step_time and a.assumptions() == b.assumptions()


def _gpt():
    return wb.models.ModelConfig(arch="gpt", vocab_size=512, seq_len=512, n_layer=2,
                                 n_head=8, d_model=512, dtype="bfloat16")


def test_estimate_with_overlap_is_faster_and_says_so():
    # large enough GEMMs to hide the copies (a tiny layer's latency-bound copies can cost
    # more in 8 chunks than one NCCL all-gather: the chunked pipeline is not free)
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=512, seq_len=2048, n_layer=2,
                                n_head=32, d_model=4096, dtype="bfloat16")
    lay = Layout(dp=1, tp=8, sp=True, zero=1, global_batch=4)
    a = estimate(cfg, lay, Cluster("h100", 8), tp_comm_overlap=True)
    b = estimate(cfg, lay, Cluster("h100", 8))
    assert a.step_time < b.step_time
    assert any("--tp-comm-overlap" in x for x in a.assumptions())
    assert not any("--tp-comm-overlap" in x for x in b.assumptions())
    r = wb.plan.estimate_range(cfg, lay, Cluster("h100", 8), tp_comm_overlap=True)
    assert r.estimate.step_time == a.step_time


@pytest.mark.parametrize("kw, match", [
    (dict(layout=dict(tp=8, sp=False)), "sp=True"),
    (dict(layout=dict(tp=8, sp=True), tp_comm_overlap=1), "True or False"),
    (dict(layout=dict(tp=8, sp=True), fp8=True), "16 bits"),
    (dict(layout=dict(tp=8, sp=True, zero=2)), "framework"),
])
def test_estimate_refuses(kw, match):
    cfg = _gpt()
    lay = Layout(dp=1, global_batch=4, **{"zero": 1, **kw.pop("layout")})
    kw.setdefault("tp_comm_overlap", True)
    with pytest.raises(ValueError, match=match):
        estimate(cfg, lay, Cluster("h100", 8), **kw)


def test_layer_refuses_without_sp_and_for_llama():
    with pytest.raises(ValueError, match="sp=True"):
        layer_ops(**dict(_LAYER, sp=False), tp_comm_overlap=True)
    with pytest.raises(ValueError, match="GPT layer"):
        layer_ops(**_LAYER, kv_heads=8, tp_comm_overlap=True)


def test_search_with_overlap_keeps_sp_layouts():
    cfg = _gpt()
    r = wb.plan.search(cfg, Cluster("h100", 8), 8, top=50, tp_comm_overlap=True)
    assert len(r) > 0 and all(lay.sp or lay.tp == 1 for lay, _ in r)
    assert all(lay.engine == "megatron" for lay, _ in r)


def test_estimate_refuses_tp_across_nodes():
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=512, seq_len=512, n_layer=2,
                                n_head=16, d_model=512, dtype="bfloat16")
    lay = Layout(dp=1, tp=16, sp=True, zero=1, global_batch=4)
    estimate(cfg, lay, Cluster("h100", 16))                  # without the flag: priced
    with pytest.raises(ValueError, match="NVLink domain"):
        estimate(cfg, lay, Cluster("h100", 16), tp_comm_overlap=True)
    r = wb.plan.search(cfg, Cluster("h100", 16), 16, top=100, tp_comm_overlap=True)
    assert len(r) > 0 and all(lay.tp <= 8 for lay, _ in r)
