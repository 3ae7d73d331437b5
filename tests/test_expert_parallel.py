"""Expert parallelism (parallel/strategies/expert_parallel.py, recipes/moe.py): one device's
losses and gradients on every layout, the uneven all-to-all counted against the routing,
the chunked exchange overlapped with the experts on the clock, bad input refused."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import workbench as wb
from workbench.models import build_model, get_config
from workbench.models.moe import moe_layers
from workbench.parallel.module import parallelize
from workbench.parallel.strategies.expert_parallel import (expert_mesh, expert_parallel,
                                                           record_layer)
from workbench.parallel.strategies.overlap import OverlapReport
from workbench.recipes import Hybrid
from workbench.sim_mesh import collectives as C
from workbench.train import train

CFG = get_config("tiny", n_layer=1, d_model=32, n_head=2, d_ff=48, seq_len=16,
                 moe_experts=4, moe_topk=2)


def _ep_model(cfg, edp, ep, chunks=1):
    model = build_model(cfg)
    mesh = wb.Mesh([[i] for i in range(edp * ep)], ["dp", "tp"])
    em = expert_mesh(mesh, ep)
    for layer in moe_layers(model):
        layer.token_dispatcher = expert_parallel(layer.experts, em, chunks)
    parallelize(model, mesh, {})
    return model, mesh


def _full(t):
    return t.full() if hasattr(t, "full") else t


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), layout=st.sampled_from([(1, 2), (2, 2), (1, 4)]),
       per_rank=st.integers(1, 2), S=st.integers(2, 16), cf=st.sampled_from([None, 0.5, 1.25]),
       gating=st.sampled_from(["softmax", "sigmoid"]))
def test_ep_layer_equals_one_device_forward_and_backward(seed, layout, per_rank, S, cf, gating):
    edp, ep = layout
    cfg = CFG.replace(moe_capacity_factor=cf, moe_gating=gating)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 75, (edp * ep * per_rank, S), generator=g)
    ref = build_model(cfg)
    _, loss = ref(idx, idx)
    loss.backward()
    model, mesh = _ep_model(cfg, edp, ep)
    X = wb.shard_tensor(idx, mesh, [wb.Shard(0), wb.Replicate()])
    _, got = model(X, X)
    got.backward()
    torch.testing.assert_close(got.full(), loss, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(_full(q.grad), p.grad, rtol=1e-5, atol=1e-6, msg=name)
    # experts live on their ep rank: E / ep of them in each local shard
    w1 = model.layers[0].mlp.experts.w1
    assert w1.mesh.dim_names == ("edp", "ep", "tp") and w1.placements[1] == wb.Shard(0)
    assert w1.local(0).shape[0] == 4 // ep


def test_uneven_all_to_all_counted_against_the_routing():
    model, mesh = _ep_model(CFG, 1, 2)
    idx = torch.randint(0, 75, (4, 16), generator=torch.Generator().manual_seed(5))
    X = wb.shard_tensor(idx, mesh, [wb.Shard(0), wb.Replicate()])
    with wb.trace() as tr:
        model(X, X)
    layer = model.layers[0].mlp
    e, slot = layer._last[0][0].full(), layer._last[0][1].full()
    h = CFG.d_model
    want = [[0, 0], [0, 0]]
    for j in range(2):                          # rank j holds sequences 2j, 2j+1
        ej, sj = e[2 * j:2 * j + 2], slot[2 * j:2 * j + 2]
        for r in range(2):                      # rank r owns experts 2r, 2r+1
            want[j][r] = int(((ej // 2 == r) & (sj >= 0)).sum()) * h * 4
    ev = [x for x in tr.events if x.label == "EP dispatch (forward)"]
    assert len(ev) == 1 and ev[0].args["uneven"] and ev[0].args["send_bytes"] == want
    assert len({b for row in want for b in row}) > 1              # uneven indeed
    sent = [want[0][1], want[1][0]]
    assert ev[0].bytes == max(sent)
    dur, _ = C.all_to_all_v_time(want, (0, 1), tr.profile)
    assert ev[0].duration == pytest.approx(dur)
    combine = [x for x in tr.events if x.label == "EP combine (forward)"]
    assert combine[0].args["send_bytes"] == [list(r) for r in zip(*want)]
    assert [x.label for x in tr.events if x.label.startswith("EP counts")] == \
        ["EP counts (forward)"]


def test_all_to_all_v_moves_rows_and_gradients_back():
    mesh = wb.Mesh.grid(3, ["ep"])
    g = (0, 1, 2)
    send = [[torch.randn(n, 2, requires_grad=True) for n in row]
            for row in ([1, 0, 2], [3, 1, 0], [0, 2, 2])]
    with wb.trace() as tr:
        recv = C.all_to_all_v({g: send}, mesh, "ep", label="t")[g]
        sum((r * (i + 1)).sum() for row in recv for i, r in enumerate(row)).backward()
    for i in range(3):
        for j in range(3):
            assert recv[j][i].data_ptr() == send[i][j].data_ptr() or send[i][j].numel() == 0
            if send[i][j].numel():
                torch.testing.assert_close(send[i][j].grad, torch.full_like(send[i][j], i + 1))
    labels = [e.label for e in tr.events]
    assert labels == ["t counts", "t", "t (backward)"]
    back = tr.events[-1].args["send_bytes"]
    assert back == [[8 * n for n in col] for col in zip([1, 0, 2], [3, 1, 0], [0, 2, 2])]


def test_chunked_exchange_overlaps_the_experts_on_the_clock():
    # 8 ranks of one node: 32 MiB each way per rank pair, experts of 64 M weights
    g = tuple(range(8))
    mib = 2 ** 20
    matrix = [[0 if i == j else 32 * mib for j in range(8)] for i in range(8)]
    got = [7 * 32 * mib // 8192] * 8                         # rows received (8 KiB each)
    times, reports = {}, {}
    for chunks in (1, 4):
        with wb.trace("h100") as tr:
            record_layer(tr, [(g, matrix, got)], 64 * 2 ** 20, 2 ** 30, 8192, torch.bfloat16,
                         chunks, "forward")
        times[chunks] = tr.time()
        reports[chunks] = OverlapReport.from_events(tr.events, "EP", chunks)
        exps = [e for e in tr.events if e.name == "experts forward"]
        assert len(exps) == 8 * chunks
    assert times[4] < times[1]
    assert reports[1].hidden_share == 0.0 and reports[4].hidden_share > 0.3


def test_train_with_ep_gives_one_device_losses():
    cfg = CFG.replace(n_layer=2, moe_capacity_factor=1.0, moe_shared_experts=1)
    ref = [r["loss"] for r in train(cfg, steps=2, timing=False)]
    for kw in (dict(ep=2, dp=2), dict(ep=2, tp=2, zero=2), dict(ep=2, ep_chunks=2)):
        got = [r["loss"] for r in train(cfg, steps=2, timing=False, strategy=Hybrid(**kw))]
        assert got == pytest.approx(ref, abs=2e-5), kw


def test_gpt_with_ep_gives_one_device_losses():
    cfg = get_config("gpt-tiny", n_layer=1, moe_experts=4, moe_topk=1, tie_embeddings=False)
    ref = [r["loss"] for r in train(cfg, steps=2, timing=False)]
    got = [r["loss"] for r in train(cfg, steps=2, timing=False, strategy=Hybrid(ep=4))]
    assert got == pytest.approx(ref, abs=2e-5)


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="ep=3 does not divide moe_experts=4.*use ep in"):
        Hybrid(ep=3).check(CFG, 6)
    with pytest.raises(ValueError, match="ep=2 needs a mixture-of-experts model.*--moe-experts"):
        Hybrid(ep=2).check(get_config("tiny"), 8)
    with pytest.raises(NotImplementedError, match="zero=3.*use zero=1 or 2"):
        Hybrid(ep=2, zero=3)
    with pytest.raises(NotImplementedError, match="sp False"):
        Hybrid(ep=2, tp=2, sp=True)
    with pytest.raises(ValueError, match="ep_chunks=0"):
        Hybrid(ep=2, ep_chunks=0)
    with pytest.raises(ValueError, match="ep=0"):
        Hybrid(ep=0)
    model = build_model(CFG)
    mesh = wb.Mesh([[0], [1], [2]], ["dp", "tp"])
    with pytest.raises(ValueError, match="ep=3 does not divide moe_experts=4"):
        expert_parallel(model.layers[0].mlp.experts, expert_mesh(mesh, 3))
    with pytest.raises(ValueError, match="ep=2 does not divide the 3 data-parallel ranks"):
        expert_mesh(mesh, 2)


def test_exchange_report_draws_the_overlap_on_a_timeline():
    from workbench.parallel.strategies.expert_parallel import exchange_report
    from workbench.viz.timeline import render_text
    rows = [[0, 3000, 5000, 2000], [4000, 0, 1000, 3000], [2500, 2500, 0, 4000],
            [1000, 6000, 2000, 0]]                       # uneven, as a router makes them
    one, four = (exchange_report(rows, 8192, 3 * 4096 * 1792, 2, chunks=c, profile="h100")
                 for c in (1, 4))
    assert one.hidden_share == 0.0 and four.hidden_share > 0.3 and four.total < one.total
    text = render_text(four, width=60)
    assert "=" in text and text.count("rank ") == 8      # hidden comm drawn, 4 ranks x 2 rows
    busy = {e.ranks[0]: 0.0 for e in four.events if e.stream == "compute"}
    for e in four.events:
        if e.stream == "compute":
            busy[e.ranks[0]] += e.duration
    assert max(busy, key=busy.get) == 1                  # rank 1 receives the most tokens


def test_ep_with_interleaved_pipeline_zero1_and_full_recompute_gives_one_devices_losses():
    cfg = CFG.replace(n_layer=4, recompute="full", moe_capacity_factor=1.25,
                      moe_gating="sigmoid", dropout=0.1)
    ref = [r["loss"] for r in train(cfg, steps=2, timing=False)]
    got = [r["loss"] for r in train(cfg, steps=2, timing=False,
                                    strategy=Hybrid(ep=2, pp=2, schedule="interleaved",
                                                    zero=1))]
    assert got == pytest.approx(ref, abs=2e-5)
