"""Megatron-LM's data-parallel sync on pipeline stages (``wb.plan.stage_sync``) and
Megatron-core's one-bucket-ahead parameter gather, each against the source's rule."""
import pytest

import workbench.plan as P
from workbench.models.config import get_config
from workbench.plan import costs as C
from workbench.plan import stage_sync as S
from workbench.plan.memory import stage_params

GPT3 = get_config("gpt3-175b")
A100 = P.Cluster("a100", 1024)


def test_slacks_sum_the_stages_before():
    assert S.slacks(0, [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == (0.0, 0.0)
    assert S.slacks(2, [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == (3.0, 9.0)
    with pytest.raises(ValueError, match="stage=0"):
        S.after_flush(1e9, P.Layout(dp=2, pp=2), A100.profile, 0, 2, 0.0, 0.0, False)


def test_sync_after_the_flush_shows_past_the_pipeline_slack():
    """2021 Megatron-LM: each stage all-reduces its whole 16-bit buffer when its own last
    backward is done; the last stage is done (p - 1) backward-times before stage 0, so its
    all-reduce (more parameters: the tied word embedding) shows only past that."""
    cfg = GPT3.replace(dtype="float16")
    lay = P.Layout(dp=8, tp=8, pp=16, recompute="full", global_batch=1536)
    est = P.estimate(cfg, lay, A100)
    st = est.details["stages"]
    first, last = st["first"], st["last"]
    ar = lambda s, psi: C.group_price("all_reduce", 2 * psi, tuple(lay.dp_ranks(0, s)),  # noqa
                                      A100.profile)
    psi_last = stage_params(cfg, 8, 16, 15)
    assert psi_last == last["psi"]
    slack_b = (first["time"] - first["forward"]) + 14 * (st["middle"]["time"]
                                                        - st["middle"]["forward"])
    assert last["dp"] == pytest.approx(max(0.0, ar(15, psi_last) - slack_b), abs=1e-12)
    assert first["dp"] == pytest.approx(ar(0, first["psi"]), rel=1e-12)   # no slack
    assert est.details["dp_sync"] == pytest.approx(max(d["dp"] for d in st.values()))
    # no slack at all: the full all-reduce
    assert S.after_flush(psi_last, lay, A100.profile, 15, 2, 0.0, 0.0, False) == \
        pytest.approx(ar(15, psi_last), rel=1e-12)


def test_megatron_core_gathers_one_bucket_ahead():
    """--overlap-param-gather (f2e5db402c): the first bucket's gather is dispatched at
    zero_grad, just before the forward, so it is exposed whole; the next waits for it.
    With all gathers issued at once the exposure could only be less or equal."""
    from workbench.plan import zero_cost as Z
    from workbench.plan.edge_cost import edge_times
    from workbench.sim_mesh.cost import overlap_rate
    cfg, cl = get_config("gpt-22b"), P.Cluster("a100", 64)
    lay = P.Layout(dp=8, tp=8, sp=True, zero=1, recompute="selective", global_batch=64)
    est = P.estimate(cfg, lay, cl, overlap_grad_reduce=True)
    prof, ranks = cl.profile, tuple(lay.dp_ranks(0, 0))
    layer = C.layer_cost(cfg, 1, 8, True, "selective", prof)
    from workbench.plan import megatron_buckets as MB
    blocks = Z.stage_blocks(cfg, lay, 0, layer, C.head_cost(cfg, 1, 8, True, prof),
                            edge_times(cfg, 1, 8, True, prof))
    blocks = MB.buckets(cfg, lay, 0, blocks)          # Megatron-core's DP buckets
    gather = lambda n: C.group_price("all_gather", 2 * n, ranks, prof)  # noqa: E731
    g32 = lambda n: C.group_price("reduce_scatter", 4 * n, ranks, prof)  # noqa: E731
    r = overlap_rate(prof, ranks)
    fwd1, _ = Z.zero_exposed(blocks, 3, gather, lambda n: 0.0, prefetch_numel=1, rate=r)
    fwd_all, _ = Z.zero_exposed(blocks, 3, gather, lambda n: 0.0,
                                prefetch_numel=float("inf"), rate=r)
    _, bwd = Z.zero_exposed(blocks, 2, gather, g32, rate=r)
    assert est.details["dp_sync"] == pytest.approx(bwd + fwd1, rel=1e-12)
    assert fwd1 >= gather(blocks[0].numel) and fwd_all <= fwd1
