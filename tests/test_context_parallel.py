"""Context parallelism: ring attention equals one device's attention, forward and backward
(fp32, 1e-5), GQA and MHA, causal (load-balanced or contiguous) and full; the K/V ring's
communication counted and overlapped on the clock; the step-by-step record; bad input."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import workbench as wb
from workbench.parallel.strategies import context_parallel as cp
from workbench.parallel.validate import validate

MESHES = [((2,), ["cp"]), ((4,), ["cp"]), ((2, 2), ["dp", "cp"]), ((2, 2), ["cp", "tp"]),
          ((3,), ["cp"])]


def _layout(mesh):
    ps = [wb.Replicate()] * mesh.ndim
    ps[mesh.dim("cp")] = wb.Shard(2)
    for name, d in (("dp", 0), ("tp", 1)):
        if name in mesh.dim_names:
            ps[mesh.dim(name)] = wb.Shard(d)
    return ps


def _qkv(seed, B, Hq, Hkv, S, D):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, D, generator=g).requires_grad_() for h in (Hq, Hkv, Hkv)]


def _run_both(mesh, q, k, v, causal, balanced):
    """(one device's output and grads, the ring's output and grads in original order)."""
    p = mesh.shape[mesh.dim("cp")]
    g = torch.randn(q.shape[:3] + (v.shape[3],), generator=torch.Generator().manual_seed(9))
    ref = wb.ops.flash_attention(q, k, v, causal=causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    ps = _layout(mesh)
    dist = [wb.shard_tensor(cp.ring_order(t, p, 2, balanced), mesh, ps) for t in (q, k, v)]
    out = cp.ring_attention(*dist, "cp", causal=causal, balanced=balanced)
    gd = wb.shard_tensor(cp.ring_order(g, p, 2, balanced), mesh, ps)
    (out * gd).sum().backward()
    grads = [t.grad for t in (q, k, v)]
    inv = torch.argsort(cp.slot_positions(q.shape[2], p, balanced))
    return (ref, ref_grads), (out.full()[:, :, inv], grads), out


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mesh_i=st.integers(0, len(MESHES) - 1), chunks=st.integers(1, 3),
       seed=st.integers(0, 2**16), gqa=st.booleans(), mask=st.sampled_from(
           ["balanced", "contiguous", "full", "full, balanced layout"]))
def test_ring_attention_equals_one_device_forward_and_backward(mesh_i, chunks, seed, gqa, mask):
    shape, names = MESHES[mesh_i]
    mesh = wb.Mesh.grid(shape, names)
    p = mesh.shape[mesh.dim("cp")]
    S = 2 * p * chunks                          # 2p chunks for load balancing
    q, k, v = _qkv(seed, 2, 4, 2 if gqa else 4, S, 8)      # Llama's GQA or GPT's MHA
    causal, balanced = not mask.startswith("full"), mask.endswith("balanced") or \
        mask == "full, balanced layout"
    (ref, ref_g), (out, grads), d = _run_both(mesh, q, k, v, causal, balanced)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert d.placements == tuple(_layout(mesh))


def test_the_k_v_ring_is_counted_and_overlapped_with_the_block_compute():
    mesh = wb.Mesh.grid(4, ["cp"])
    q, k, v = _qkv(0, 1, 4, 2, 16, 8)
    dist = [wb.shard_tensor(cp.ring_order(t, 4, 2), mesh, [wb.Shard(2)]) for t in (q, k, v)]
    block = 2 * (1 * 2 * 4 * 8 * 4)             # K and V: (1, 2 heads, 16/4 rows, 8) fp32
    with wb.trace("a100") as tr:
        out = cp.ring_attention(*dist, "cp")
    sends = [e for e in tr.events if e.name == "send_recv"]
    assert len(sends) == 3 and all(e.bytes == block for e in sends)     # p-1 steps
    assert tr.bytes_per_rank("send_recv") == {r: 3 * block for r in range(4)}  # 2(p-1) tensors
    steps = [e for e in tr.events if e.name == "ring_attention_step"]
    assert len(steps) == 4
    for s, c in zip(sends, steps):              # step t's send runs beside step t's block
        assert s.start < c.end and c.start < s.end
    # backward (torch's ring, tests/test_ringbwd.py): K/V round again, p-1 sends, and the
    # float32 dK/dV with them, p sends (fp32 inputs: the same size)
    with wb.trace("a100") as tr2:
        out.sum().backward()
    back = [e for e in tr2.events if e.name == "send_recv"]
    assert len(back) == 3 + 4 and all(e.bytes == block for e in back)
    assert sum("dK/dV" in e.label for e in back) == 4
    steps_b = [e for e in tr2.events if e.name == "ring_attention_step"]
    assert any(s.start < c.end and c.start < s.end for s in back for c in steps_b)   # beside


def test_the_owner_waits_for_its_dk_dv_in_backward():
    """Tiny blocks (one token per chunk): the sends outlast the blocks' backward, so the
    clock shows K/V's owner waiting for the last dK/dV to come home."""
    mesh = wb.Mesh.grid(4, ["cp"])
    g = torch.Generator().manual_seed(0)
    d = [wb.shard_tensor(cp.ring_order(torch.randn(1, 1, 8, 1024, generator=g), 4, 2), mesh,
                         [wb.Shard(2)]).requires_grad_() for _ in range(3)]
    with wb.trace("a100") as tr:
        cp.ring_attention(*d, "cp").sum().backward()
    back = [e for e in tr.events if "dK/dV" in e.label]
    last_compute = max(e.end for e in tr.events if e.stream == "compute")
    assert len(back) == 4 and back[-1].end > last_compute
    assert all(tr.now(r) == back[-1].end for r in range(4))


def test_load_balancing_gives_every_rank_the_same_work_and_skips_masked_chunks():
    p = 4
    bal = cp.ring_schedule(p)
    for t in range(p):
        works = {r["work"] for r in bal if r["step"] == t}
        assert works == {0.5}      # step 0: two diagonals + one full of 4; then half blocks
    skipped = sum(kind == "skipped" for r in bal for *_, kind in r["pairs"])
    assert skipped == 4 * 1 + 12 * 2     # of 64 chunk pairs: 1 per rank at step 0, 2 after
    contiguous = cp.ring_schedule(p, balanced=False)
    last = [r["work"] for r in contiguous if r["rank"] == p - 1]
    first = [r["work"] for r in contiguous if r["rank"] == 0]
    assert sum(last) == p - 0.5 and sum(first) == 0.5                  # p - 1/2 : 1/2
    row = next(r for r in bal if r["step"] == 1 and r["rank"] == 0)
    assert row["kv_from"] == 3 and row["send_to"] == 1 and row["q_chunks"] == (0, 7)
    assert row["kv_chunks"] == (3, 4)
    assert ("full" in {k for *_, k in row["pairs"]}) and row["work"] == 0.5
    # the clock's FLOPs follow the skips: a step after the first costs half a block
    mesh = wb.Mesh.grid(p, ["cp"])
    q = torch.randn(1, 1, 16, 8)
    dist = [wb.shard_tensor(q, mesh, [wb.Shard(2)])] * 3
    with wb.trace() as tr:
        for t in range(p):
            wb.parallel.ops_table.ring_attention.ring_attention_step(*dist, ring=p, step=t)
    flops = [e.flops for e in tr.events if e.name == "ring_attention_step"]
    c = 16 // (2 * p)
    assert flops[1:] == [2 * (2 * c * c) * 16] * (p - 1)          # 2c x c pairs, 2(D+Dv)
    assert flops[0] == 2 * (2 * c * (c + 1) // 2 + c * c) * 16     # two diagonals + one full


def test_context_parallel_routes_model_attention_to_the_ring():
    mesh = wb.Mesh.grid((2, 2), ["dp", "cp"])
    q, k, v = _qkv(3, 2, 4, 4, 8, 8)
    ps = _layout(mesh)
    ps[mesh.dim("cp")] = wb.Replicate()     # to_ring_layout records the order (seq_order.py)
    dist = [cp.to_ring_layout(wb.shard_tensor(t, mesh, ps), "cp", 2) for t in (q, k, v)]
    ref = cp.ring_order(wb.ops.flash_attention(q, k, v, causal=True), 2, 2)
    with cp.context_parallel(mesh, "cp"), wb.trace() as tr:
        a = wb.ops.flash_attention(*dist, causal=True)
        b = F.scaled_dot_product_attention(*dist, is_causal=True)
    for o in (a, b):
        torch.testing.assert_close(o.full(), ref, rtol=1e-5, atol=1e-5)
    assert tr.counts()["send_recv"] == 2 * 2     # 2 calls x 2 rings (one per dp rank)
    assert not tr.counts().get("all_gather")
    with cp.context_parallel(mesh, "cp"):
        with pytest.raises(ValueError, match="cannot be load-balanced.*causal=True"):
            wb.ops.flash_attention(*dist, mask=torch.ones(8, 8, dtype=torch.bool))
        with pytest.raises(ValueError, match="dropout_p=0.1.*dropout"):
            F.scaled_dot_product_attention(*dist, is_causal=True, dropout_p=0.1)


def test_ring_layout_round_trip_and_bfloat16():
    mesh = wb.Mesh.grid((2, 2), ["dp", "cp"])
    X = torch.randn(2, 8, 3)
    x = wb.shard_tensor(X, mesh, [wb.Shard(0), wb.Replicate()])
    y = cp.to_ring_layout(x, "cp")
    assert y.placements == (wb.Shard(0), wb.Shard(1))
    assert torch.equal(y.local(0), X[:1, [0, 1, 6, 7]])        # cp rank 0: chunks 0 and 3
    assert torch.equal(y.local(1), X[:1, [2, 3, 4, 5]])        # cp rank 1: chunks 1 and 2
    back = cp.from_ring_layout(y, "cp")
    assert torch.equal(back.full(), X) and back.placements == (wb.Shard(0), wb.Replicate())
    q, k, v = (t.detach().bfloat16() for t in _qkv(2, 2, 2, 2, 8, 4))
    d = [wb.shard_tensor(cp.ring_order(t, 2, 2), mesh, _layout(mesh)[:1] + [wb.Shard(2)])
         for t in (q, k, v)]
    out = cp.ring_attention(*d, "cp")
    ref = cp.ring_order(wb.ops.flash_attention(q.float(), k.float(), v.float(), causal=True), 2, 2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.full().float(), ref, rtol=1e-2, atol=1e-2)


def test_bad_input_names_the_fix():
    mesh = wb.Mesh.grid(2, ["cp"])
    q = wb.shard_tensor(torch.randn(1, 2, 6, 4), mesh, [wb.Shard(2)])
    with pytest.raises(ValueError, match=r"6 does not divide by 4.*2 x cp.*multiple of 4"):
        cp.ring_attention(q, q, q, "cp")
    r = wb.shard_tensor(torch.randn(1, 2, 8, 4), mesh, [wb.Replicate()])
    with pytest.raises(ValueError, match=r"Shard\(2\), on mesh dim 'cp'"):
        cp.ring_attention(r, r, r, "cp")
    with pytest.raises(TypeError, match="DistTensors"):
        cp.ring_attention(torch.randn(1, 1, 4, 4), r, r, "cp")
    with pytest.raises(ValueError, match="ring_schedule: p=0"):
        cp.ring_schedule(0)


def test_validator_checks_every_candidate_of_the_step_rule():
    rep = validate(["ring_attention_step"], meshes=((2,),), max_layouts=6)
    assert rep.ops == ["ring_attention_step"] and rep.runs > 20 and not rep.wrong, rep.format()
    # an odd ring (3 ranks, the last step): slots of 2 chunks of 2 tokens, GQA
    from workbench.parallel.ops_table.ring_attention import ring_attention_step
    from workbench.parallel.ops_table.samples import Sample
    q, k, v = _qkv(5, 1, 2, 1, 12, 4)
    odd = Sample(ring_attention_step, (q.detach(), k.detach(), v.detach()),
                 {"ring": 3, "step": 2})
    rep = validate(["ring_attention_step"], meshes=((3,),), max_layouts=8,
                   table={"ring_attention_step": [odd]})
    assert rep.runs > 20 and not rep.wrong, rep.format()


def test_cp_vs_sp_formulas_match_what_the_simulator_counts():
    from workbench.parallel.strategies.context_parallel_cost import cp_vs_sp, cp_vs_sp_sweep
    # the ring's bytes: one layer, S=16 over p=4, h = 4 heads x 8, GQA with 2 K/V heads, fp32
    r = cp_vs_sp(16, 32, 4, "a100", n_head=4, n_kv_head=2, dtype="float32")
    mesh = wb.Mesh.grid(4, ["cp"])
    q, k, v = _qkv(1, 1, 4, 2, 16, 8)
    dist = [wb.shard_tensor(cp.ring_order(t, 4, 2), mesh, [wb.Shard(2)]) for t in (q, k, v)]
    with wb.trace("a100") as tr:
        cp.ring_attention(*dist, "cp")
    assert r["cp"]["bytes_per_rank"] == tr.bytes_per_rank("send_recv")[0] == 2 * 3 * 4 * 16 * 4
    assert r["sp"]["bytes_per_rank"] == 4 * 3 * 16 * 32 * 4 // 4        # 4 (p-1)/p b S h e
    # forward and backward: the K/V blocks out, again in backward, and the dK/dV (as the
    # simulator counts them)
    d = [t.detach().requires_grad_() for t in dist]
    with wb.trace("a100") as tr2:
        cp.ring_attention(*d, "cp").sum().backward()
    assert r["cp"]["step_bytes_per_rank"] == tr2.bytes_per_rank("send_recv")[0]
    assert r["cp"]["step_bytes_per_rank_te"] == 3 * r["cp"]["bytes_per_rank"]
    # long sequences: the ring hides behind attention, SP's gathers do not
    long = cp_vs_sp_sweep([1024, 131072], 4096, 8, "h100", n_head=32, n_kv_head=8)
    assert long[1]["cp"]["exposed_s"] == 0 < long[0]["cp"]["exposed_s"]
    assert long[1]["S"] // 8 > long[1]["cp"]["min_tokens_per_rank"] > long[0]["S"] // 8
    assert all(x["winner"] == "cp" and x["sp"]["exposed_s"] > 0 for x in long)
    with pytest.raises(ValueError, match="S=10 does not divide by p=4"):
        cp_vs_sp(10, 32, 4)
    # causal: half a block per step holds only on the balanced ring (2p chunks)
    with pytest.raises(ValueError, match="12 does not divide by 8.*multiple of 8"):
        cp_vs_sp(12, 32, 4, n_head=4)
    assert cp_vs_sp(12, 32, 4, n_head=4, causal=False)["cp"]["bytes_per_rank"] > 0


def test_ring_record_renders_as_text_and_a_figure():
    from workbench.viz.ring import draw_ring, render_ring_text
    text = render_ring_text(cp.ring_schedule(2))
    assert text.splitlines()[2:] == [
        "               step 0            step 1",
        "rank 0 q(0,3)  kv(0,3) D.FD ->1  kv(1,2) ..FF",
        "rank 1 q(1,2)  kv(1,2) D.FD ->0  kv(0,3) F.F."]
    # ranks down, steps across: p = 4, the notebook's ring, fits 90 characters (a step per
    # line ran to 180 and wrapped in JupyterLab); the rows are the ranks' query chunks
    wide = render_ring_text(cp.ring_schedule(4)).splitlines()
    assert max(map(len, wide)) <= 90 and len(wide) == 2 + 1 + 4
    assert wide[3].startswith("rank 0 q(0,7)  kv(0,7) D.FD ->1  kv(3,4) ..FF ->1")
    import doctest
    import workbench.viz.ring as ring_viz
    assert doctest.testmod(ring_viz).failed == 0
    fig = draw_ring(cp.ring_schedule(3))
    assert len(fig.axes[0].patches) == 3 * 3 * 4


def test_cp_vs_sp_sequence_parallel_bytes_match_what_the_simulator_counts():
    """Korthikanti et al.'s SP volume per layer (2 all-gathers + 2 reduce-scatters of the
    (b, S, h) activation forward, their mirror backward, and the 2 all-gathers again of the
    column-parallel inputs' kept shards) against Megatron SP as the hybrid recipe runs it:
    one more layer adds exactly step_bytes_per_rank to rank 0's traffic."""
    from workbench.models.config import get_config
    from workbench.models.data import get_batch
    from workbench.parallel.strategies.context_parallel_cost import cp_vs_sp
    from workbench.recipes.hybrid import Hybrid

    def sp_bytes(n_layer):
        cfg = get_config("gpt-tiny").replace(n_layer=n_layer, dropout=0.0)
        s = Hybrid(tp=2, sp=True)
        s.check(cfg, 2)
        model = s.build_model(cfg, 0)
        x, y = get_batch(cfg, 2, 0, 0)
        with wb.trace("a100") as tr:
            s.forward_backward(model, x, y)
        return cfg, sum(e.bytes for e in tr.events
                        if e.name in ("all_gather", "reduce_scatter") and 0 in e.ranks)
    cfg, one = sp_bytes(1)
    _, two = sp_bytes(2)
    r = cp_vs_sp(cfg.seq_len, cfg.d_model, 2, n_head=cfg.n_head, batch=2, dtype="float32")
    assert two - one == r["sp"]["step_bytes_per_rank"] == \
        2 * r["sp"]["bytes_per_rank"] + r["sp"]["regather_bytes_per_rank"]
    assert r["sp"]["regather_bytes_per_rank"] == r["sp"]["bytes_per_rank"] // 2
