"""``recompute="op"``: torchtitan's op-level selective activation checkpointing, priced
for Llama blocks (``plan.llama_layer``): what it keeps, what it re-runs, what it refuses."""
import pytest

import workbench as wb
from workbench.models.config import get_config
from workbench.plan import Cluster, Layout, dry_run, estimate
from workbench.plan.costs import model_and_hardware_flops
from workbench.plan.layer_cost import layer_ops
from workbench.plan.llama_layer import activation_bytes

L8B = wb.plan.presets.get_config("llama3-8b", seq_len=8192)


def test_kept_bytes_follow_the_policy():
    """Every second mm recomputed (k, o, w3); q's, v's, w1's, w2's outputs, the attention
    output with its log-sum-exp and the block input kept: on one rank, tp = 1."""
    cfg, b = L8B, 2
    T, h, f, a, s = cfg.seq_len * b, cfg.d_model, cfg.d_ff, cfg.n_head, cfg.seq_len
    hk = cfg.n_kv_head * cfg.head_dim
    want = 2 * T * (h + h + hk + h + f + h) + 4 * b * a * s
    assert activation_bytes(cfg, b, 1, False, "op") == want
    # between full recompute (the input alone) and none
    assert activation_bytes(cfg, b, 1, False, "full") < want \
        < activation_bytes(cfg, b, 1, False, "none")
    # tensor parallel with sequence parallelism: the inside splits by t, the input and the
    # two reduce-scattered branch outputs are sequence-sharded, w2's partial sum is whole
    t = 8
    got = activation_bytes(cfg, b, t, True, "op")
    assert got == 2 * T * (2 * h / t + hk / t + f / t) + 4 * b * a * s / t + 2 * T * h \
        + 3 * 2 * T * h / t


def test_backward_reruns_the_recomputed_ops_only():
    prof = wb.sim_mesh.profiles.get_profile("h100")
    ops = layer_ops(4096, 32, 8192, 1, 1, False, "op", 14336, "bfloat16", prof, (0,),
                    "flash", kv_heads=8)
    again = [o.name for o in ops if o.phase == "recompute"]
    assert {"k_gemm", "o_gemm", "w3_gemm"} <= set(again)
    assert not {"q_gemm", "v_gemm", "w1_gemm", "w2_gemm", "flash_attention"} & set(again)
    fwd = sum(o.seconds for o in ops if o.phase == "forward")
    re = sum(o.seconds for o in ops if o.phase == "recompute")
    assert 0.2 * fwd < re < 0.6 * fwd          # three of seven GEMMs and the cheap ops
    # the step pays for it: between no recompute and full recompute
    cl, times = Cluster("h100", 8), {}
    for rc in ("none", "op", "full"):
        lay = Layout(dp=8, zero=3, recompute=rc, micro_batch=1, framework="fsdp")
        times[rc] = estimate(L8B, lay, cl).step_time
    assert times["none"] < times["op"] < times["full"]


def test_hardware_flops_count_the_recomputed_gemms():
    cfg, B = L8B, 4
    model, hw = model_and_hardware_flops(cfg, B, "op")
    h, f, s = cfg.d_model, cfg.d_ff, cfg.seq_len
    hk = cfg.n_kv_head * cfg.head_dim
    assert hw - model == pytest.approx(cfg.n_layer * 2 * B * s * (h * hk + h * h + h * f))


def test_refused_where_it_is_not_modeled():
    gpt = get_config("gpt3-175b", n_layer=2, d_model=256, n_head=4, seq_len=128)
    with pytest.raises(ValueError, match="recompute='op'.*Llama"):
        estimate(gpt, Layout(recompute="op"), Cluster("a100", 1))
    with pytest.raises(ValueError, match="recompute='op'.*Llama"):
        dry_run(gpt, Layout(recompute="op"), Cluster("a100", 1))
    moe = L8B.replace(n_layer=2, d_model=256, n_head=4, n_kv_head=2, d_ff=512,
                      vocab_size=512, seq_len=128, moe_experts=4)
    with pytest.raises(ValueError, match="recompute='op'.*with experts"):
        dry_run(moe, Layout(recompute="op"), Cluster("a100", 1))
    with pytest.raises(ValueError, match="recompute="):
        Layout(recompute="ops")


def test_search_proposes_op_for_a_dense_llama_only():
    from workbench.plan.search import candidate_layouts
    small = L8B.replace(n_layer=4, seq_len=1024)
    cl = Cluster("h100", 8)
    modes = {lay.recompute for lay in candidate_layouts(small, cl, 16)}
    assert modes == {"none", "selective", "full", "op"}
    gpt = get_config("gpt3-175b", n_layer=4, seq_len=1024)
    assert "op" not in {lay.recompute for lay in candidate_layouts(gpt, cl, 16)}
    moe = small.replace(moe_experts=8)
    assert "op" not in {lay.recompute for lay in candidate_layouts(moe, cl, 16)}
    r = wb.plan.search(small, cl, global_batch=16, top=200)
    assert any(lay.recompute == "op" for lay, _ in r)      # estimated, ranked


def test_dry_run_prices_what_reruns_and_counts_what_the_policy_saves():
    """The dry run of the course's Llama with recompute='op' (PyTorch's selective
    checkpointing on the simulated ranks): its backward re-runs three of each block's
    seven GEMMs (k, o, w3) and not the attention kernel, on the clock; its activations
    are full recompute's plus, per block, the six tensors the policy saves."""
    cfg = L8B.replace(n_layer=2, d_model=256, n_head=4, n_kv_head=2, d_ff=512,
                      vocab_size=512, seq_len=128)
    cl, runs = Cluster("a100", 2), {}
    for rc in ("none", "full", "op"):
        dr = dry_run(cfg, Layout(tp=2, recompute=rc), cl)
        ev = [e for e in dr.trace.events if 0 in e.ranks and e.stream == "compute"
              and e.label == "forward"]
        runs[rc] = (dr, {c: sum(e.args.get("op_class") == c for e in ev)
                         for c in ("matmul", "attention")})
    none, op = runs["none"][1], runs["op"][1]
    assert op["matmul"] - none["matmul"] == 3 * cfg.n_layer
    assert op["attention"] == none["attention"] == cfg.n_layer
    # full recompute re-runs the block up to w2's GEMM, whose inputs are saved before it
    # runs: PyTorch's early stop (torch.utils.checkpoint) ends the recompute there
    full = runs["full"][1]
    assert full["matmul"] - none["matmul"] == 6 * cfg.n_layer
    T, h, f, a, d = cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.n_head, cfg.head_dim
    hq, hk, t = a * d, cfg.n_kv_head * d, 2
    saved = 2 * T * (2 * hq / t + hk / t + f / t + h) + 4 * a * T / t     # per block, rank
    got = runs["op"][0].memory["activations"] - runs["full"][0].memory["activations"]
    assert got == cfg.n_layer * saved


def test_dry_run_keeps_the_sequence_parallel_reduce_scatters():
    """Under tp + sp the policy saves the reduce-scatters of g (torchtitan's save list
    holds ``reduce_scatter_tensor``; the simulator's is ``torch.ops.workbench.reduce_scatter``):
    the backward's recompute communicates no more than no recompute does (full recompute
    re-runs each block's attention one), and each block keeps both reduce-scattered
    branch outputs, 2 T h / t bytes each, beside the six tensors of the policy, as the
    planner counts them (before: 0.86x its activations)."""
    cfg = L8B.replace(n_layer=2, d_model=256, n_head=4, n_kv_head=2, d_ff=512,
                      vocab_size=512, seq_len=128)
    cl, runs, rs = Cluster("a100", 2), {}, {}
    for rc in ("none", "full", "op"):
        runs[rc] = dry_run(cfg, Layout(tp=2, sp=True, recompute=rc), cl)
        rs[rc] = sum(e.name == "reduce_scatter" and e.label.startswith("P(sum)")
                     for e in runs[rc].trace.collectives() if 0 in e.ranks)
    assert rs["op"] == rs["none"] == 1 + 2 * cfg.n_layer       # embedding, 2 per block
    assert rs["full"] == rs["none"] + cfg.n_layer
    T, h, f, a, d = cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.n_head, cfg.head_dim
    hq, hk, t = a * d, cfg.n_kv_head * d, 2
    saved = 2 * T * (2 * hq / t + hk / t + f / t + h) + 4 * a * T / t + 2 * (2 * T * h / t)
    got = runs["op"].memory["activations"] - runs["full"].memory["activations"]
    assert got == cfg.n_layer * saved
    est = estimate(cfg, Layout(tp=2, sp=True, recompute="op", framework="workbench"), cl)
    assert runs["op"].memory["activations"] == pytest.approx(est.memory["activations"],
                                                             rel=0.03)


def test_the_search_tables_legend_says_what_rc_op_is():
    """Notebook 14's 128K Llama table showed rc 'op' with a legend naming only 'sel'."""
    from workbench.plan.search import Ranking
    cl = Cluster("h100", 8)
    rows = [(lay, estimate(L8B, lay, cl)) for lay in
            (Layout(dp=8, zero=3, recompute=rc, micro_batch=1, framework="fsdp")
             for rc in ("op", "full"))]
    def legend(r):
        return " ".join(r.table().split())          # as one line: the legend wraps at 100
    assert "op: op-level selective (torchtitan's)" in legend(Ranking(rows))
    assert "op-level" not in legend(Ranking(rows[1:]))
