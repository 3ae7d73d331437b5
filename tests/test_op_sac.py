"""``recompute="op"`` in the course's Llama (``models.op_sac``): torchtitan's op-level
selective checkpointing through PyTorch's ``create_selective_checkpoint_contexts``.
Held to no recompute (the same loss and gradients, bit for bit), to the tensors the
policy names (q's, v's, w1's and w2's GEMM outputs, the attention kernel's output and
log-sum-exp), and to PyTorch's memory tracker (the bytes kept per block)."""
import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from workbench.models import Llama, get_config
from workbench.models import op_sac
from workbench.models.data import get_batch
from workbench.parallel.module import dist_parameters
from workbench.recipes.hybrid import Hybrid
from workbench.sim_mesh.trace import trace
from workbench.train import train

CFG = get_config("tiny", n_layer=2, d_model=128, n_head=4, n_kv_head=2, seq_len=64)


def _loss_and_grads(cfg, seed=0):
    model = Llama(cfg, seed=seed).train()
    x, y = get_batch(cfg, 2, seed=1)
    torch.manual_seed(123)                                        # dropout, if any
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_op_gives_the_same_loss_and_gradients(dropout):
    cfg = CFG.replace(dropout=dropout)
    loss0, g0 = _loss_and_grads(cfg)
    loss1, g1 = _loss_and_grads(cfg.replace(recompute="op"))
    assert torch.equal(loss0, loss1)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, sp=True), dict(dp=2, zero=3),
                                    dict(tp=2, pp=2)],
                         ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_simulated_layouts_give_the_losses_of_no_recompute(layout):
    """On the simulated mesh (a linear runs as one mm or a rank-stacked bmm) with keyed
    attention dropout (the explicit attention core, whose GEMMs the policy leaves alone)."""
    kw = dict(steps=2, seed=0, timing=False, n_layer=2, dropout=0.1)
    want = [r["loss"] for r in train("tiny", strategy=Hybrid(**layout), **kw)]
    orig, regions = op_sac.context_fn, []

    def context_fn():
        regions.append(1)
        return orig()
    try:
        op_sac.context_fn = context_fn
        got = [r["loss"] for r in train("tiny", strategy=Hybrid(**layout), recompute="op",
                                        **kw)]
    finally:
        op_sac.context_fn = orig
    assert got == want
    assert len(regions) == 2 * 2 * (4 if layout.get("pp") else 1)   # steps x blocks (x m)


def _tp_sp_step(recompute):
    """One forward-backward of the tp = 2, sp model: (loss, gradients, the reduce-scatters
    of g (Partial -> Shard) rank 0 took part in)."""
    cfg, s = CFG.replace(recompute=recompute), Hybrid(tp=2, sp=True)
    model = s.build_model(cfg, 0)
    x, y = get_batch(cfg, 2, seed=1)
    with trace() as tr:
        loss = s.forward_backward(model, x, y)
    grads = {n: p._local.grad for n, p in dist_parameters(model)}
    rs = sum(e.name == "reduce_scatter" and e.label.startswith("P(sum)")
             for e in tr.collectives() if 0 in e.ranks)
    return loss, grads, rs


def test_sequence_parallel_reduce_scatter_is_saved_not_rerun():
    """torchtitan saves ``reduce_scatter_tensor``'s output, so its recompute never
    communicates it again; the simulator's reduce-scatter (``torch.ops.workbench.
    reduce_scatter``) is saved alike: the step runs the reduce-scatters of no recompute
    (two per block, was four with op: the recompute re-ran them), full recompute re-runs
    one per block; loss and gradients are no recompute's, bit for bit."""
    loss0, g0, rs0 = _tp_sp_step("none")
    loss1, g1, rs1 = _tp_sp_step("op")
    _, _, rs_full = _tp_sp_step("full")
    assert rs1 == rs0 == 2 * CFG.n_layer
    assert rs_full == rs0 + CFG.n_layer
    assert torch.equal(loss0, loss1)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def _block_regions(cfg, b=2):
    """Run one forward of a bf16 model with op SAC, keeping each region's forward
    context: [saved tensors per block]."""
    model = Llama(cfg.replace(recompute="op", dtype="bfloat16"), seed=0)
    kept = []

    orig = op_sac.context_fn

    def context_fn():
        fwd, rec = orig()
        kept.append(fwd)
        return fwd, rec
    x, y = get_batch(cfg, b, seed=1)
    try:
        op_sac.context_fn = context_fn            # what the blocks call (models.llama)
        model(x, y)
    finally:
        op_sac.context_fn = orig
    return [op_sac.saved_outputs(f) for f in kept]


def test_the_policy_keeps_q_v_w1_w2_and_the_attention_kernel():
    """Seven GEMMs per block, every second one re-run (k, o, w3): the saved GEMM outputs
    are q's (T, a d), v's (T, g d), w1's (T, f), w2's (T, h); the attention kernel's
    output (B, a, s, d) and fp32 log-sum-exp (B, a, s)."""
    cfg, b = CFG, 2
    T, h, f, a, g, d, s = b * cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.n_head, \
        cfg.n_kv_head, cfg.head_dim, cfg.seq_len
    regions = _block_regions(cfg, b)
    assert len(regions) == cfg.n_layer
    for saved in regions:
        shapes = sorted((tuple(t.shape), t.dtype) for t in saved)
        want = sorted([((T, a * d), torch.bfloat16), ((T, g * d), torch.bfloat16),
                       ((T, f), torch.bfloat16), ((T, h), torch.bfloat16),
                       ((b, a, s, d), torch.bfloat16), ((b, a, s), torch.float32)])
        assert shapes == want


def _activation_bytes(cfg, b):
    model = Llama(cfg, seed=0)
    x, y = get_batch(cfg, b, seed=1)
    mt = MemTracker()
    mt.track_external(model)
    with mt:
        _, loss = model(x, y)
        snap = mt.get_tracker_snapshot("current")
        loss.backward()
    (dev,) = snap
    return next(v for k, v in snap[dev].items() if "ACT" in str(k))


def test_memory_tracker_measures_what_the_policy_keeps():
    """PyTorch's MemTracker, after the forward: per block, op SAC keeps beyond full
    recompute (the block input) exactly the six tensors of the policy, in 16 bit
    2 T (a d + g d + a d + f + h) bytes and the 4 b a s of the log-sum-exp; and less than
    no recompute."""
    cfg, b = CFG.replace(dtype="bfloat16"), 2
    T, h, f, a, s = b * cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.n_head, cfg.seq_len
    hq, hk = a * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    act = {m: _activation_bytes(cfg.replace(recompute=m), b) for m in ("none", "full", "op")}
    per_block = (act["op"] - act["full"]) / cfg.n_layer
    assert per_block == 2 * T * (2 * hq + hk + f + h) + 4 * b * a * s
    assert act["full"] < act["op"] < act["none"]


def test_gpt_and_moe_refuse_op():
    with pytest.raises(ValueError, match="recompute='op'.*dense Llama.*arch='gpt'"):
        get_config("gpt-tiny", recompute="op")
    with pytest.raises(ValueError, match="recompute='op'.*with experts"):
        get_config("tiny", moe_experts=4, recompute="op")
    from workbench.models import build_model
    gpt = build_model(get_config("gpt-tiny"))
    with pytest.raises(ValueError, match="recompute='op'"):
        gpt.set_recompute("op")
    assert all(blk.recompute == "none" for blk in gpt.layers)      # left untouched


def test_modeled_clock_prices_only_what_reruns():
    """On simulated ranks the recompute of a saved GEMM or attention kernel is not priced
    again: op-level recompute lands between none and full on the modeled clock."""
    kw = dict(steps=1, seed=0, n_layer=2, strategy=Hybrid(tp=2))
    ms = {rc: train("tiny", recompute=rc, **kw)[0]["modeled_ms"]
          for rc in ("none", "op", "full")}
    assert ms["none"] < ms["op"] < ms["full"]
