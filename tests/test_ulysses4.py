"""DeepSpeed-Ulysses (``cp_comm="a2a"``) with tensor parallelism, as Megatron-LM runs
``--cp-comm-type a2a`` beside tp: each tp rank's heads split further over cp by one
all-to-all per tensor over the cp ranks (``strategies.context_parallel_a2a``).

Held to one device: attention forward and backward (float64, exact), and the recipe's loss
and every parameter after two AdamW steps (dp 1 and 2 x cp 2 x tp 2, sequence parallelism
on and off); the all-to-alls counted with the bytes of (b, s / cp, H / tp, d) blocks by
hand, priced as the planner prices them; the dry run within 10% of the estimate; search
tries the layout; the head check names the tp-local heads and the fix; under torchrun
(gloo) the losses and bytes are the simulator's. Before: ContextParallel(cp_comm='a2a',
tp > 1) raised NotImplementedError, ulysses_attention refused heads sharded on tp, dry_run
refused the layout and search skipped it on the runtime's engine.
"""

import pytest
import torch

import workbench as wb
from tests.torchrun_support import four_proc, json_rows
from workbench.models.config import build_model, get_config
from workbench.models.data import get_batch
from workbench.ops.adamw import AdamW
from workbench.parallel.module import dist_parameters
from workbench.parallel.strategies import context_parallel as cp
from workbench.parallel.strategies.context_parallel_a2a import ulysses_attention
from workbench.plan import Cluster, Layout, dry_run, estimate
from workbench.plan import context_cost as X
from workbench.recipes.context_parallel import ContextParallel, cp_mesh
from workbench.sim_mesh.cost import price
from workbench.sim_mesh.profiles import get_profile
from workbench.train import train


def _placements(mesh):
    """q, k, v after the column-parallel QKV projection: batch on dp, sequence on cp,
    heads on tp."""
    ps = [wb.Replicate()] * mesh.ndim
    for name, p in (("dp", wb.Shard(0)), ("cp", wb.Shard(2)), ("tp", wb.Shard(1))):
        if name in mesh.dim_names:
            ps[mesh.dim(name)] = p
    return ps


def _qkv(Hq, Hkv, B=2, S=16, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, D, generator=g, dtype=dtype).requires_grad_()
            for h in (Hq, Hkv, Hkv)]


def _dist(mesh, ts, balanced):
    p = mesh.shape[mesh.dim("cp")]
    return [wb.shard_tensor(cp.ring_order(t, p, 2, balanced), mesh, _placements(mesh))
            for t in ts]


@pytest.mark.parametrize("dp,Hq,Hkv,balanced", [(1, 8, 4, True), (1, 4, 4, False),
                                                (2, 8, 4, True)])
def test_attention_with_heads_on_tp_equals_one_device_float64(dp, Hq, Hkv, balanced):
    """Before: refused ("needs whole heads ... off the cp dim")."""
    mesh = cp_mesh(dp, 2, 2)
    q, k, v = _qkv(Hq, Hkv)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    ref = wb.ops.flash_attention(q, k, v, causal=True)
    ref_g = torch.autograd.grad(ref, (q, k, v), go)
    out = ulysses_attention(*_dist(mesh, (q, k, v), balanced), "cp", balanced=balanced)
    assert out.placements == tuple(_placements(mesh))
    (out * _dist(mesh, [go], balanced)[0]).sum().backward()
    inv = torch.argsort(cp.slot_positions(16, 2, balanced))
    torch.testing.assert_close(out.full()[:, :, inv], ref, rtol=0, atol=1e-12)
    for t, r in zip((q, k, v), ref_g):
        torch.testing.assert_close(t.grad, r, rtol=0, atol=1e-12)


def test_four_all_to_alls_over_cp_of_tp_local_blocks_bytes_by_hand_and_priced():
    """Forward: q, k, v in and the output back, one all-to-all each per cp group (one
    group per tp rank), nothing on tp; backward the same four. A rank sends (cp-1)/cp of
    each (b, H / tp, s / cp, d) block: by hand below. Each priced as the clock prices an
    all-to-all of the block on its group, which is the planner's ``a2a_times``."""
    B, Hq, Hkv, S, D, e, c, t = 1, 8, 4, 32, 8, 4, 2, 2
    mesh = cp_mesh(1, c, t)
    q, k, v = _qkv(Hq, Hkv, B=B, S=S, D=D, dtype=torch.float32, seed=3)
    # leaves of their own (a plain leaf's gradient would be gathered back to it)
    d = [t.requires_grad_() for t in _dist(mesh, [t.detach() for t in (q, k, v)], True)]
    with wb.trace("a100") as fwd:
        out = ulysses_attention(*d, "cp")
    g = _dist(mesh, [torch.ones(q.shape)], True)[0]
    with wb.trace("a100") as bwd:
        out.backward(g)
    qb = B * (Hq // t) * (S // c) * D * e          # one rank's q (and output) block
    kvb = B * (Hkv // t) * (S // c) * D * e        # one rank's k (and v) block
    assert (qb, kvb) == (2048, 1024)                # 4 and 2 heads x 16 tokens x 8 x fp32
    per_rank = (2 * qb + 2 * kvb) * (c - 1) // c   # 3072 B forward, as many backward
    groups = {(0, 2), (1, 3)}                       # cp ranks of tp rank 0, of tp rank 1
    for tr in (fwd, bwd):
        coll = tr.collectives()
        assert {ev.name for ev in coll} == {"all_to_all"}
        assert {ev.args["mesh_dim"] for ev in coll} == {"cp"}
        assert {tuple(ev.ranks) for ev in coll} == groups and len(coll) == 8
        assert tr.bytes_per_rank("all_to_all") == {r: per_rank for r in range(4)}
        for ev in coll:
            block = ev.args["buffer_bytes"]
            assert block in (qb, kvb)
            assert ev.duration == pytest.approx(price("all_to_all", block, list(ev.ranks),
                                                      "a100"))
    cfg = get_config("llama2-7b", n_layer=1, d_model=Hq * D, n_head=Hq, n_kv_head=Hkv,
                     d_ff=4 * Hq * D, seq_len=S).replace(dtype="float32")
    u = X.a2a_times(cfg, Layout(cp=c, tp=t, global_batch=1, cp_comm="a2a"),
                    get_profile("a100"))
    assert u.blocks == (qb, kvb, kvb, qb) and u.sent_forward == per_rank
    assert u.forward == pytest.approx(sum(ev.duration for ev in fwd.collectives()
                                          if tuple(ev.ranks) == (0, 2)))


# ---- the recipe: two AdamW steps held to one device --------------------------------------
CFG = get_config("tiny", seq_len=16, n_layer=1, d_model=32, n_head=8, n_kv_head=4, d_ff=64)
B, LR, WD = 4, 1e-2, 0.1


@pytest.fixture(scope="module")
def one_device():
    torch.manual_seed(0)
    model = build_model(CFG, seed=0).train()
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(2):
        x, y = get_batch(CFG, B, 0, step)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dp,sp", [(1, False), (1, True), (2, False), (2, True)],
                         ids=["cp2tp2", "cp2tp2-sp", "dp2cp2tp2", "dp2cp2tp2-sp"])
def test_recipe_gives_one_devices_loss_and_parameters(dp, sp, one_device):
    """Before: ContextParallel(cp_comm='a2a', tp=2) raised NotImplementedError. fp32
    rounding only (a head on the wrong rank, or a gradient summed twice, is off by ~lr)."""
    want_losses, want = one_device
    s = ContextParallel(cp=2, tp=2, dp=dp, sp=sp, cp_comm="a2a")
    torch.manual_seed(0)
    s.check(CFG, B)
    model = s.build_model(CFG, 0)
    opts = s.build_optimizer(model, LR, WD)
    losses = []
    for step in range(2):
        x, y = get_batch(CFG, B, 0, step)
        with s.measure_activations():
            losses.append(float(s.forward_backward(model, x, y).detach()))
        s.optimizer_step(opts)
    assert losses == pytest.approx(want_losses, rel=1e-6)
    got = {n: p.full().detach() for n, p in dist_parameters(model)}
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=2e-5, atol=5e-6, msg=name)
    init = dict(build_model(CFG, seed=0).named_parameters())
    assert max((want[n] - init[n]).abs().max() for n in init) > 1e-2


def test_head_check_names_the_tp_local_heads_and_the_fix():
    """Transformer Engine's condition on the tp-local heads (context_parallel.py:4246):
    8 query and 4 K/V heads over tp 2 leave 2 K/V heads a tp rank, which cp 4 cannot
    split. Before: NotImplementedError at construction, whatever the heads."""
    cfg = CFG.replace(seq_len=32)
    with pytest.raises(ValueError, match=r"ContextParallel\(cp=4, tp=2\).*each tp rank's "
                       r"key/value heads \(4 / tp=2 = 2; q 8 / 2 = 4, k/v 4 / 2 = 2\) do not "
                       r"divide by 4\. Fix: use cp_comm='p2p'.*per-tp-rank head counts "
                       r"\(\[2\]\), or a smaller tp"):
        ContextParallel(cp=4, tp=2, cp_comm="a2a").check(cfg, B)
    ContextParallel(cp=2, tp=2, cp_comm="a2a").check(cfg, B)          # 2 K/V heads, cp 2
    # the attention itself: 6 query heads on tp 2 are 3 a rank; inputs left untouched
    mesh = cp_mesh(1, 2, 2)
    d = _dist(mesh, _qkv(6, 6), True)
    before = [t.full().clone() for t in d]
    with pytest.raises(ValueError, match=r"each tp rank's query heads \(6 / tp=2 = 3"):
        ulysses_attention(*d, "cp")
    assert all(torch.equal(t.full(), b) for t, b in zip(d, before))
    with pytest.raises(ValueError, match=r"key/value heads \(2; q 8, k/v 2\) do not divide "
                                         r"by 4"):
        ulysses_attention(*_dist(cp_mesh(1, 4, 1), _qkv(8, 2), True), "cp")


# ---- the planner --------------------------------------------------------------------------
PLAN = get_config("llama2-7b", n_layer=2, d_model=1024, n_head=16, n_kv_head=4, d_ff=2816,
                  seq_len=1024)           # tests/test_dryrun_ep_cp.py's two GQA blocks


@pytest.mark.parametrize("lay", [Layout(cp=2, tp=2, global_batch=1, cp_comm="a2a"),
                                 Layout(cp=2, tp=2, sp=True, global_batch=1, cp_comm="a2a")],
                         ids=lambda x: x.short())
def test_dry_run_agrees_with_the_estimate(lay):
    """Before: dry_run refused cp_comm='a2a' with tp=2. Measured dry run / estimate: step
    1.032x (1.037x with sp), memory total 1.000x; the all-to-all bytes a rank sends are
    the planner's per layer, forward and backward."""
    cl = Cluster("a100", lay.world)
    dr = dry_run(PLAN, lay, cl)
    est = estimate(PLAN, lay.replace(framework="workbench"), cl, attention="flash")
    assert dr.step_time == pytest.approx(est.step_time, rel=0.10)
    for k in ("params", "grads", "optimizer", "activations", "total"):
        assert dr.memory[k] == pytest.approx(est.memory[k], rel=0.05, abs=1), k
    u = est.details["ep_cp"]["cp_a2a"]
    s_l, e = 1024 // 2, 2
    assert u.blocks == (s_l * 8 * 64 * e, s_l * 2 * 64 * e, s_l * 2 * 64 * e,
                        s_l * 8 * 64 * e)   # (b, s / cp, H / tp, d): 16 / 2 and 4 / 2 heads
    sent = sum(e.bytes for e in dr.trace.events if e.name == "all_to_all" and 0 in e.ranks)
    assert sent == PLAN.n_layer * (u.sent_forward + u.sent_backward)


def test_search_tries_the_all_to_all_with_tp_on_the_runtimes_engine():
    """Before: ep_cp_search skipped cp_comm='a2a' with tp > 1 where the layout runs on this
    library's runtime (framework 'workbench'); now as on Megatron-LM's."""
    from workbench.plan import ep_cp_search
    from workbench.plan.search import candidate_layouts

    def ours(*a, **k):
        for lay in candidate_layouts(*a, **k):
            if lay.zero <= 1:
                yield lay.replace(framework="workbench")
    long = PLAN.replace(seq_len=8192)
    lays = list(ep_cp_search.candidates(long, Cluster("a100", 8), 8, 16, "flash", ours))
    a2a = [lay for lay in lays if lay.cp_comm == "a2a" and lay.tp > 1]
    assert a2a and all(lay.engine == "workbench" for lay in a2a)
    assert all((16 // lay.tp) % lay.cp == 0 and (4 // lay.tp) % lay.cp == 0 for lay in a2a)
    assert {(lay.tp, lay.cp) for lay in a2a} == {(2, 2)}
    lay = a2a[0]
    assert estimate(long, lay, Cluster("a100", 8), attention="flash").step_time > 0


# ---- torch.distributed (gloo): one launch, both runs ---------------------------------------
DIST = [["--cp", "2", "--tp", "2", "--cp-comm", "a2a"],
        ["--cp", "2", "--tp", "2", "--sp", "--cp-comm", "a2a"]]


@pytest.fixture(scope="module")
def torchrun_a2a(tmp_path_factory):
    """Both runs, in the session's one launch of every 4-process part (FOUR_PROC)."""
    texts = []
    for flags in DIST:
        out, text = four_proc(tmp_path_factory, " ".join(
            ["-m", "workbench", "train", "--preset", "tiny", "--seed", "0", "--steps", "2",
             "--backend", "torch", *flags]))
        assert out.returncode == 0, out.stderr[-3000:]
        texts.append(text)
    return texts


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_torchrun_gives_the_simulators_losses_and_bytes(sp, torchrun_a2a):
    rows = json_rows(torchrun_a2a[int(sp)])
    sim = train("tiny", steps=2, seed=0, timing=False,
                strategy=ContextParallel(cp=2, tp=2, sp=sp, cp_comm="a2a"))
    one = [r["loss"] for r in train("tiny", steps=2, seed=0, timing=False)]
    assert [r["step"] for r in rows] == [0, 1]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in sim], rel=1e-6)
    assert [r["loss"] for r in rows] == pytest.approx(one, rel=1e-6)
    assert [r["comm_bytes"] for r in rows] == [r["comm_bytes"] for r in sim]
