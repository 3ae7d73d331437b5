"""What the tensor-parallel backward all-reduce hides behind, as Megatron-LM runs it.

``LinearWithGradAccumulationAndAsyncCommunication.backward`` (NVIDIA/Megatron-LM
``megatron/core/tensor_parallel/layers.py``; since 16c90445e7, 2021-09): the column-parallel
linear's input gradient (dgrad), then its all-reduce launched async, then THAT linear's
weight gradient (wgrad), then the wait.  The row-parallel linear's wgrad ran before the
all-reduce was issued; the next block needs the all-reduced gradient.  Held here by hand
on a small layer, on the multi-copy layer's clock (notebook 10) and the planner's layer
(``plan.layer_cost``), and the two against each other.
"""
import pytest

import workbench as wb
from workbench.parallel.strategies.overlap_multicopy import multi_copy_estimate
from workbench.plan.layer_cost import layer_ops
from workbench.sim_mesh import cost
from workbench.sim_mesh.profiles import Link, Profile

PEAK = 1e14
# one copy of T = 1024 tokens, H = 1024, 8 heads, FFN 4H, tp = 4, bf16
B, S, H, HEADS, F, P, E = 1, 1024, 1024, 8, 4096, 4, 2
T = B * S


def flat(link):
    """No launch, no latency, (almost) infinite memory bandwidth, no SM figures: a GEMM
    takes 2 m k n / PEAK, a ring all-reduce 2 (p - 1) / p n / link."""
    return Profile(name="flat", description="test profile",
                   peak_flops={"float32": PEAK, "bfloat16": PEAK, "float16": PEAK},
                   memory_bandwidth=1e18, memory_bytes=10 ** 12, devices_per_node=64,
                   intra_node=Link("test link", link, 0.0), inter_node=Link("test link", link, 0.0))


def gemm(m, k, n):
    return 2 * m * k * n / PEAK


# by hand: the weight gradients of the four linears and the input gradient's all-reduce
W_QKV, W_O = gemm(H, T, 3 * H // P), gemm(H // P, T, H)
W_1, W_2 = gemm(H, T, F // P), gemm(F // P, T, H)
LINK = 2 * (P - 1) / P * T * H * E / (W_QKV + W_O / 2)   # all-reduce: W_QKV + W_O / 2


def ar_seconds(link):
    return 2 * (P - 1) / P * T * H * E / link


def events(rep):
    return {(e.stream, e.label): e for e in rep.events}


def run(wgrad, link=LINK, copies=1):
    return multi_copy_estimate(B, S, H, HEADS, F, wb.Mesh.grid(P, ("tp",)), "tp",
                               copies=copies, profile=flat(link), wgrad=wgrad)


def test_the_all_reduce_runs_beside_its_own_linears_weight_gradient():
    ar = ar_seconds(LINK)
    assert W_QKV < ar < W_QKV + W_O and ar < W_1          # the case the two modes differ on
    r = run("per_linear")
    ev = events(r.backward)
    for blk, row, col in (("ffn", "w2", "w1"), ("attention", "wo", "wqkv")):
        comm, dx = ev["comm", f"{blk} dX A"], ev["compute", f"{blk} dX A"]
        dw, rows = ev["compute", f"{col} dW A"], ev["compute", f"{row} dX dW A"]
        assert comm.duration == pytest.approx(ar, rel=1e-12)
        assert comm.start == dx.end == dw.start           # issued after the dgrad, beside dW
        assert rows.end <= dx.start                       # the row-parallel dW ran before it
        assert rows.duration == pytest.approx(
            {"wo": gemm(T, H, H // P) + W_O, "w2": gemm(T, H, F // P) + W_2}[row], rel=1e-12)
    assert ev["compute", "wqkv dW A"].duration == pytest.approx(W_QKV, rel=1e-12)
    assert ev["compute", "w1 dW A"].duration == pytest.approx(W_1, rel=1e-12)
    # the attention block's backward waits for the FFN's all-reduced input gradient
    assert ev["compute", "wo dX dW A"].start == pytest.approx(
        max(ev["comm", "ffn dX A"].end, ev["compute", "w1 dW A"].end))
    want = max(0.0, ar - W_QKV) + max(0.0, ar - W_1)
    assert want > 0 and r.backward.exposed == pytest.approx(want, rel=1e-9)
    assert r.wgrad == "per_linear"


def test_the_block_idealization_is_named_and_hides_more():
    ar = ar_seconds(LINK)
    r = run("block")
    ev = events(r.backward)
    for blk in ("ffn", "attention"):
        comm = ev["comm", f"{blk} dX A"]
        assert comm.start == ev["compute", f"{blk} dX A"].end == \
            ev["compute", f"{blk} dW A"].start
    assert ev["compute", "attention dW A"].duration == pytest.approx(W_QKV + W_O, rel=1e-12)
    want = max(0.0, ar - W_QKV - W_O) + max(0.0, ar - W_1 - W_2)
    assert r.backward.exposed == pytest.approx(want, abs=1e-15)
    assert r.backward.exposed < run("per_linear").backward.exposed
    # the same kernels, the same values: only the order of the backward differs
    per = run("per_linear")
    assert r.backward.compute == pytest.approx(per.backward.compute, rel=1e-12)
    assert r.forward.total == per.forward.total


def test_bad_wgrad_refused():
    with pytest.raises(ValueError, match=r"wgrad='deferred'.*'per_linear'.*'block'"):
        run("deferred")


def _planner(profile, sp=False):
    return {o.name: o for o in layer_ops(h=1024, a=8, s=2048, b=2, tp=8, sp=sp,
                                         dtype="bfloat16", profile=profile, main_grad=False)
            if o.phase == "backward"}


def test_planner_pairs_each_collective_with_its_own_linear():
    for sp in (False, True):
        ops = _planner("ascend-910b", sp)
        pairs = {o.name: o.overlaps for o in ops.values() if o.op_class in cost.KINDS}
        want = {"tp_grad_qkv": "qkv_wgrad", "tp_grad_fc1": "fc1_wgrad"}
        if sp:
            want.update(sp_regather_qkv="qkv_dgrad", sp_regather_fc1="fc1_dgrad",
                        sp_grad_all_gather="")
        assert pairs == want
        # no SM figures on the 910B: exposed = max(0, collective - its GEMM), by hand
        for c, g in want.items():
            if g:
                assert ops[c].exposed == pytest.approx(
                    max(0.0, ops[c].seconds - ops[g].seconds), rel=1e-12)
        assert ops["tp_grad_qkv"].exposed > 0            # small layer: the all-reduce shows


@pytest.mark.parametrize("profile", ["ascend-910b", "a100", "h100"])
def test_planner_and_clock_agree(profile):
    """The planner's GPT layer and the multi-copy layer's clock (one copy, the same
    shapes, weight gradients written in 16 bits) price the column-parallel weight
    gradients and the all-reduces alike, and expose the same time.  (The planner
    stretches a GEMM by its tile waves on the SMs NCCL leaves, the clock by the SM
    share: the same here, each GEMM fits one wave on either SM count.)"""
    ops = _planner(profile)
    r = multi_copy_estimate(2, 2048, 1024, 8, 4096, wb.Mesh.grid(8, ("tp",)), "tp",
                            copies=1, profile=profile)
    ev = events(r.backward)
    for blk, col, comm, g in (("ffn", "w1", "tp_grad_fc1", "fc1_wgrad"),
                              ("attention", "wqkv", "tp_grad_qkv", "qkv_wgrad")):
        ar, dw = ev["comm", f"{blk} dX A"], ev["compute", f"{col} dW A"]
        assert ar.duration == pytest.approx(ops[comm].seconds, rel=1e-12)
        assert dw.start == ar.start and ops[comm].overlaps == g
        assert dw.duration == pytest.approx(ops[g].seconds, rel=1e-9)   # stretched alike
        nxt = min((e.start for e in r.backward.events if e.stream == "compute"
                   and e.start >= dw.end), default=ar.end)
        exposed = max(0.0, max(nxt, ar.end) - dw.end)
        assert exposed == pytest.approx(ops[comm].exposed, rel=1e-9)
    assert r.backward.exposed == pytest.approx(
        ops["tp_grad_qkv"].exposed + ops["tp_grad_fc1"].exposed, rel=1e-9)
    assert r.backward.exposed > 0


@pytest.mark.parametrize("async_allreduce", [True, False])
def test_the_layer_cost_charges_what_is_exposed(async_allreduce):
    """``costs.layer_cost``'s communication is the TP collectives' exposed time, its compute
    the rest of the layer: the backward's all-reduces beside their wgrad GEMMs are compute
    time where hidden; before 2021-09 (``async_allreduce=False``) all of each is charged."""
    from workbench.models import get_config
    from workbench.plan import costs
    from workbench.plan.layer_cost import layer_times
    from workbench.sim_mesh.profiles import get_profile
    cfg = get_config("gpt-22b")
    prof = get_profile("a100")
    kw = dict(h=cfg.d_model, a=cfg.n_head, s=cfg.seq_len, b=1, tp=8, recompute="none",
              ffn=cfg.d_ff, dtype=cfg.dtype, profile=prof, tp_ranks=list(range(8)),
              async_allreduce=async_allreduce)
    ops = layer_ops(**kw)
    lt = layer_times(**kw)
    c = costs.layer_cost(cfg, 1, 8, False, "none", prof, async_allreduce=async_allreduce)
    one = costs.group_price("all_reduce", 2 * cfg.seq_len * cfg.d_model, tuple(range(8)), prof)
    bwd = [o for o in ops if o.phase == "backward" and o.op_class == "all_reduce"]
    assert [o.seconds for o in bwd] == pytest.approx([one, one], rel=1e-12)
    assert c.fwd_comm == pytest.approx(2 * one, rel=1e-12)
    assert c.bwd_comm == pytest.approx(sum(o.exposed for o in bwd), rel=1e-12)
    assert c.bwd_compute + c.bwd_comm == pytest.approx(lt.backward, rel=1e-12)
    if async_allreduce:
        assert c.bwd_comm < 2 * one                        # hidden beside fc1's, qkv's wgrad
    else:
        assert c.bwd_comm == pytest.approx(2 * one, rel=1e-12)
