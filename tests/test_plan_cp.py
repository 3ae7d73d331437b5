"""The planner with context parallelism (``plan.context_cost``, ``plan.ep_cp``): ring
attention's time, about max(half block, K/V hop) per step (the block stretched beside the
hop as the runtime's clock does), the K/V bytes by hand, the
causal balancing's pairs, activations at s / cp, optimizer states over dp x cp, the
gradient reduction over dp x cp ranks, the search over cp, and errors naming the fix."""
import pytest
import torch

from workbench.plan import Cluster, Layout, ep_cp_search, estimate, search
from workbench.plan.context_cost import kv_block_bytes, ring_times
from workbench.plan.costs import group_price
from workbench.plan.ep_cp import layer_cost
from workbench.plan.layer_cost import layer_ops
from workbench.plan.memory import layer_activation_bytes, stage_memory
from workbench.plan.presets import get_config
from workbench.sim_mesh.cost import AttentionShape, compute_time, overlap

# Llama 3 8B's layer shape at 32K tokens, 2 layers: priced in milliseconds
CFG = get_config("llama3-8b", n_layer=2, seq_len=32768, vocab_size=32000)
A100 = Cluster("a100", 8).profile


def test_kv_block_bytes_by_hand():
    lay = Layout(dp=1, tp=2, cp=4, sp=True)
    # K and V of s / cp tokens, g / t key/value heads of d, 2 bytes: 2 b s_l (g/t) d e
    assert kv_block_bytes(CFG, lay) == 2 * 1 * (32768 // 4) * (8 // 2) * 128 * 2


def test_ring_step_is_max_of_half_block_and_hop():
    lay = Layout(dp=1, tp=1, cp=4)
    r = ring_times(CFG, lay, A100)
    s_l, a, d, e = 32768 // 4, 32, 128, 2
    pairs = a * s_l * s_l / 2                  # causal balancing: half a block per step
    nq, nk, lse = a * s_l * d, 8 * s_l * d, 4 * a * s_l
    # a half block is full attention (no mask inside) at s_l tokens: the fused kernel's
    # rate for that shape (the a100 profile's attention_table, sim_mesh.fa2_a100)
    half = compute_time(4 * pairs * d, e * (2 * nq + 2 * nk) + lse, A100, "bfloat16",
                        "attention", gemm=AttentionShape(a, s_l, d, False, False)) + \
        compute_time(6 * nq, 3 * e * nq + 3 * lse, A100, "bfloat16", "elementwise")
    hop = group_price("send_recv", kv_block_bytes(CFG, lay), (0, 1), A100)
    assert r.steps == 3 and r.half_forward == half and r.hop == hop
    # each step: the half block beside the hop, stretched by the copy's SMs (cost.overlap:
    # the ring's group, ranks 0 .. 3 inside one node, 24 SMs)
    attn, ring = half - r.merge, (0, 1, 2, 3)
    run, out = overlap(attn, hop, A100, ranks=ring)
    assert r.forward == 3 * (run + r.merge + out)
    assert 3 * max(half, hop) <= r.forward < 3 * (half + hop)   # about max(half, hop)
    acc = r.half_backward - compute_time(10 * pairs * d, e * (4 * nq + 4 * nk) + lse, A100,
                                         "bfloat16", "attention",
                                         gemm=AttentionShape(a, s_l, d, False, True))
    # backward as torch's ring runs it (tests/test_ringbwd.py): dQ, dK, dV added in fp32
    # each step; steps 1, 2 beside the previous step's fp32 dK/dV and this step's K/V,
    # step 3 beside the dK/dV alone; the owner waits for its block's dK/dV at the end
    assert acc == pytest.approx(r.accumulate, rel=1e-12)
    assert r.accumulate == compute_time(nq + 2 * nk, 3 * 4 * (nq + 2 * nk), A100,
                                        "bfloat16", "elementwise")
    grad = group_price("send_recv", 2 * kv_block_bytes(CFG, lay), (0, 1), A100)
    assert r.hop_grad == grad
    run_b, out_b = overlap(r.half_backward - acc, grad + hop, A100, ranks=ring)
    run_l, out_l = overlap(r.half_backward - acc, grad, A100, ranks=ring)
    assert r.backward == pytest.approx(2 * (run_b + acc + out_b) + run_l + acc + out_l
                                       + acc + grad, rel=1e-12)
    assert r.backward_exposed_comm == pytest.approx(2 * out_b + out_l + grad, rel=1e-12)
    n = kv_block_bytes(CFG, lay)
    assert r.sent_backward == 3 * n + 4 * 2 * n           # K/V again, fp32 dK/dV home
    assert r.forward_exposed_comm == 0.0 and hop < half        # 8K-token blocks hide it
    # short blocks across nodes do not (ring ranks 0, 8, ..: one per node): the transfer
    # grows as s_l, the attention as s_l^2
    short = ring_times(CFG.replace(seq_len=8192), Layout(dp=1, tp=8, cp=8, sp=True), A100)
    assert short.hop > short.half_forward and short.forward_exposed_comm > 0


def test_balanced_ring_attends_the_causal_pairs_over_cp():
    # step 0: the fused causal kernel at s_l (the layer's own op), then cp - 1 halves of
    # s_l^2: s_l (s_l + 1) / 2 + (cp - 1) s_l^2 / 2 = s (s + 1) / (2 cp) per head, the
    # causal pairs of the whole sequence shared evenly by the cp ranks
    s, a, d = 32768, 32, 128
    for cp in (2, 4, 8):
        s_l = s // cp
        ops = layer_ops(4096, a, s_l, 1, 1, False, "none", 14336, "bfloat16", A100, [0],
                        "flash", kv_heads=8)
        diag = next(o.flops for o in ops if o.name == "flash_attention") / (4 * d)
        r = ring_times(CFG, Layout(dp=1, cp=cp), A100)
        assert diag + r.steps * r.pairs == a * s * (s + 1) / (2 * cp)


def test_layer_time_is_the_block_at_s_over_cp_plus_the_ring():
    for rc in ("none", "selective", "full"):
        lay = Layout(dp=1, tp=2, cp=4, sp=True, recompute=rc)
        ops = layer_ops(4096, 32, 32768 // 4, 1, 2, True, rc, 14336, "bfloat16", A100,
                        [0, 1], "flash", kv_heads=8)
        fwd = sum(o.exposed for o in ops if o.phase == "forward")
        bwd = sum(o.exposed for o in ops if o.phase != "forward")
        r = ring_times(CFG, lay, A100)
        lc = layer_cost(CFG, lay, A100, "flash")
        rings = 1 + (rc != "none")               # the forward, and its recompute
        assert lc.fwd_compute + lc.fwd_comm == pytest.approx(fwd + r.forward, rel=1e-12)
        assert lc.bwd_compute + lc.bwd_comm == pytest.approx(
            bwd + (rings - 1) * r.forward + r.backward, rel=1e-12)


def test_activations_are_the_model_at_s_over_cp_and_states_shard_over_dp_cp():
    lay = Layout(dp=2, tp=1, cp=4, zero=1, global_batch=2)
    mem = stage_memory(CFG, lay, 0, "flash")
    short = CFG.replace(seq_len=32768 // 4)
    assert mem["activations"] == stage_memory(short, Layout(dp=2, zero=1, global_batch=2), 0,
                                              "flash")["activations"]
    assert layer_activation_bytes(short, 1, 1, False, "none", "flash") * 2 < \
        mem["activations"]                       # two layers and the head's
    full = stage_memory(CFG, Layout(dp=2, zero=1, global_batch=2), 0, "flash")
    assert mem["params"] == full["params"]       # every cp rank holds the whole weights
    assert mem["optimizer"] == pytest.approx(full["optimizer"] / 4, rel=1e-12)


def test_gradients_reduce_over_dp_times_cp():
    cl = Cluster("a100", 8)
    lay = Layout(dp=2, tp=1, cp=4, global_batch=2)
    assert lay.grad_ranks() == [0, 1, 2, 3, 4, 5, 6, 7] and lay.world == 8
    assert lay.rank(0, 1, 0, 2) == 6          # t + tp (c + cp (d + dp s))
    est = estimate(CFG, lay, cl)
    psi = est.memory["params"] / 2
    want = group_price("all_reduce", 4 * psi, tuple(range(8)), cl.profile)   # fp32 grads
    assert est.details["dp_sync"] == pytest.approx(want, rel=1e-12)
    assert "ring attention over cp=4" in est.explain()


def test_128k_llama_on_256_a100s_uses_cp(monkeypatch):
    cfg, cl = get_config("llama3-8b-128k"), Cluster("a100", 256)
    r = search(cfg, cl, global_batch=32, top=3)
    assert r and all(lay.cp > 1 for lay, _ in r)
    assert " cp" in r.table().splitlines()[0]
    e = r[0][1]
    assert e.fits and any(a.startswith("CP: ring attention") for a in e.assumptions())
    assert "note: MFU and HFU count attention" in str(r)
    # why: without cp, 131,072 tokens' activations fit only with full recompute
    monkeypatch.setattr(ep_cp_search, "CP_MIN_TOKENS", 10 ** 9)
    monkeypatch.setattr(ep_cp_search, "CP_A2A_MIN_SEQ", 10 ** 9)     # nor the all-to-all
    no_cp = search(cfg, cl, global_batch=32, top=3)
    assert all(lay.cp == 1 and lay.recompute == "full" for lay, _ in no_cp)
    assert r[0][0].recompute != "full" and e.step_time < no_cp[0][1].step_time


def test_bad_input_names_the_fix():
    cl = Cluster("a100", 8)
    with pytest.raises(ValueError, match=r"cp=3 does not divide the sequence.*use a cp in"):
        estimate(CFG, Layout(dp=1, tp=2, cp=3, pp=1), Cluster("a100", 6))
    with pytest.raises(ValueError, match=r"attention='flash'"):
        estimate(get_config("gpt-tiny", seq_len=64, dtype="bfloat16"), Layout(dp=2, cp=4,
                 global_batch=2), cl, attention="materialized")
    with pytest.raises(ValueError, match=r"dp x tp x pp x cp = 2 x 1 x 1 x 2 = 4 but the "
                                         r"cluster has devices=8"):
        estimate(CFG, Layout(dp=2, cp=2, global_batch=2), cl)
    with pytest.raises(ValueError, match=r"cp=0 must be an int >= 1"):
        Layout(cp=0)
    with pytest.raises(ValueError, match=r"zero=3 with ep=1, cp=2.*use zero<=1"):
        Layout(dp=2, cp=2, zero=3)


def test_cp_ranks_alone_reduce_gradients_and_may_overlap_them():
    # dp = 1: the cp ranks still hold the same weights, so they reduce the gradients
    cl = Cluster("a100", 4)
    lay = Layout(dp=1, cp=4, zero=1)
    flushed = estimate(CFG, lay, cl)
    overlapped = estimate(CFG, lay, cl, overlap_grad_reduce=True)
    assert 0 < overlapped.details["dp_sync"] < flushed.details["dp_sync"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_step_and_hop_are_the_cp_runtimes_clock(dtype):
    # the ring on DistTensors (strategies.context_parallel) traced on the A100's clock: each
    # later step's block and each K/V send against the planner's half block and hop
    import workbench as wb
    from workbench.models.config import ModelConfig
    from workbench.parallel.strategies import context_parallel as cp
    p, H, S, D = 4, 8, 4096, 64
    cfg = ModelConfig(arch="llama", d_model=H * D, n_head=H, seq_len=S, vocab_size=100,
                      n_layer=1, dtype=str(dtype).split(".")[1])
    r = ring_times(cfg, Layout(dp=1, cp=p), A100)
    torch.manual_seed(0)
    qkv = [wb.shard_tensor(cp.ring_order(torch.randn(1, H, S, D, dtype=dtype), p, 2),
                           wb.Mesh([0, 1, 2, 3], dim_names=["cp"]), [wb.Shard(2)])
           for _ in range(3)]
    with wb.trace(profile="a100") as tr:
        cp.ring_attention(*qkv, "cp")
    steps = [e for e in tr.events if e.name == "ring_attention_step"][1:]
    sends = [e.duration for e in tr.events if e.name == "send_recv"]
    assert len(sends) == p - 1 and all(s == pytest.approx(r.hop, rel=1e-9) for s in sends)
    for e in steps:                # half a block each, as balanced (alone: without a send)
        assert e.args.get("alone", e.duration) == pytest.approx(r.half_forward - r.merge,
                                                                rel=1e-6)
    # beside a send the clock stretches the block on the SMs the copy leaves: as planned
    # (the ring's group, one node: 24 SMs)
    run, _ = overlap(r.half_forward - r.merge, r.hop, A100, ranks=(0, 1, 2, 3))
    assert all(e.duration == pytest.approx(run, rel=1e-6) for e in steps[:-1])
