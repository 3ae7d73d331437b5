"""The training clock prices the loss as the planner does: on a profile that measured it
(the H100's file: the 16-bit logits' cast and the fp32 cross-entropy, forward and
backward, ``sim_mesh.measured.cross_entropy_rate``), the trace's cast and cross-entropy
take the measured time of the pair; on the A100 the H100's rate scaled by the HBM
bandwidths (the profile's kernel_bandwidth); elsewhere the roofline of the op table's entry
(``parallel.ops_table.loss_pricing.cross_entropy_times``, also used by
``plan.edge_cost``)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.ops_table import loss_pricing
from workbench.parallel.ops_table.table import entry
from workbench.plan.edge_cost import _meta, _price, edge_times
from workbench.models.config import get_config
from workbench.sim_mesh import cost, measured
from workbench.sim_mesh.profiles import get_profile

MESH2 = wb.Mesh.grid(2, ["tp"])
ROWS, VOCAB = 4096, 32768       # the file's tokens, a vocabulary it measured (16,384 and more)
CAST = ("float", "to")


def _loss_events(profile, vocab=VOCAB, tp_shard=False):
    """The forward and backward events of a 16-bit logits' cast and cross-entropy, as the
    models compute the loss (``logits.float()`` then ``F.cross_entropy``), on meta
    tensors (the dry run's: shapes only)."""
    logits = torch.empty(ROWS, vocab, dtype=torch.bfloat16, device="meta")
    targets = torch.empty(ROWS, dtype=torch.int64, device="meta")
    x = wb.shard_tensor(logits, MESH2, ["S(1)" if tp_shard else "R"]).requires_grad_()
    t = wb.shard_tensor(targets, MESH2, ["R"])
    with wb.trace(profile=profile) as tr:
        F.cross_entropy(x.float(), t).backward()
    ev = [e for e in tr.events if e.stream == "compute" and 0 in e.ranks]
    got = {("cast" if e.name in CAST else e.name, e.args["phase"]): e.duration for e in ev}
    return got, (ROWS, vocab // (2 if tp_shard else 1))


@pytest.mark.parametrize("tp_shard", [False, True], ids=["replicated", "vocab-parallel"])
def test_h100_cast_and_loss_take_the_measured_time(tp_shard):
    got, (rows, vt) = _loss_events("h100", tp_shard=tp_shard)
    assert set(got) == {("cast", "forward"), ("cast", "backward"),
                        ("cross_entropy", "forward"), ("cross_entropy", "backward")}
    rate = measured.cross_entropy_rate(get_profile("h100").measured["file"])
    assert sum(got.values()) == pytest.approx(rows * vt / rate, rel=1e-9)
    want = loss_pricing.cross_entropy_times(rows, vt, "h100")
    assert (got[("cross_entropy", "forward")], got[("cross_entropy", "backward")]) == \
        pytest.approx(want, rel=1e-12)
    # slower than the roofline's price of the same kernel (the reason to measure it)
    c = entry("cross_entropy").cost([torch.empty(rows, vt, device="meta"),
                                     torch.empty(rows, dtype=torch.int64, device="meta")],
                                    [torch.empty((), device="meta")])
    roof = cost.compute_time(c.flops, c.bytes, "h100", torch.float32, "reduction")
    assert got[("cross_entropy", "forward")] > 1.5 * roof


@pytest.mark.parametrize("name", ["a100", "a100-jeanzay"])
def test_a100_carries_the_h100_loss_rate_scaled_by_hbm_bandwidth(name):
    """No A100 measured the loss: the profiles carry the H100's measured rate of the pair
    times 2,039 / 3,350 (datasheet HBM bandwidths; kernel_bandwidth's citation).  Before,
    the A100 priced it by the one-pass roofline, 3.9x faster than that."""
    h100 = measured.cross_entropy_rate(get_profile("h100").measured["file"])
    rate = loss_pricing.cross_entropy_rate(name)
    assert rate == pytest.approx(h100 * 2039 / 3350, rel=1e-4)
    assert get_profile(name).kernel_bandwidth[loss_pricing.KERNEL] == pytest.approx(4 * rate)
    got, (rows, vt) = _loss_events(name)
    assert sum(got.values()) == pytest.approx(rows * vt / rate, rel=1e-9)
    c = entry("cross_entropy").cost([torch.empty(rows, vt, device="meta"),
                                     torch.empty(rows, dtype=torch.int64, device="meta")],
                                    [torch.empty((), device="meta")])
    roof = cost.compute_time(c.flops, c.bytes, name, torch.float32, "reduction")
    assert got[("cross_entropy", "forward")] > 1.5 * roof


def test_a_profile_without_a_loss_rate_prices_it_by_the_roofline():
    a100 = get_profile("a100")
    bare = dataclasses.replace(a100, kernel_bandwidth={
        k: v for k, v in a100.kernel_bandwidth.items() if k != loss_pricing.KERNEL})
    assert loss_pricing.cross_entropy_rate(bare) is None
    assert loss_pricing.cross_entropy_times(ROWS, VOCAB, bare) is None
    got, (rows, vt) = _loss_events(bare)
    c = entry("cross_entropy").cost([torch.empty(rows, vt, device="meta"),
                                     torch.empty(rows, dtype=torch.int64, device="meta")],
                                    [torch.empty((), device="meta")])
    assert got[("cross_entropy", "forward")] == pytest.approx(
        cost.compute_time(c.flops, c.bytes, bare, torch.float32, "reduction"), rel=1e-12)


def test_a_small_vocabulary_never_beats_the_roofline():
    """75 entries (the course's tiny model): the measured rate would price the pair below
    its launches; the cross-entropy keeps its roofline price."""
    rows, v = 512, 75
    fwd, bwd = loss_pricing.cross_entropy_times(rows, v, "h100")
    c = entry("cross_entropy").cost([torch.empty(rows, v, device="meta"),
                                     torch.empty(rows, dtype=torch.int64, device="meta")],
                                    [torch.empty((), device="meta")])
    roof = cost.compute_time(c.flops, c.bytes, "h100", torch.float32, "reduction")
    assert fwd == pytest.approx(roof, rel=1e-12) and bwd > 0


def test_planner_prices_the_loss_as_the_clock():
    """``plan.edge_cost``'s last stage is the final norm, the cast and the loss, the
    loss from the same function as the trace's (tp = 2: half the vocabulary a rank)."""
    cfg = get_config("llama2-7b", n_layer=2, d_model=1024, n_head=16, n_kv_head=4,
                     d_ff=2816, seq_len=1024)
    bf, f32 = torch.bfloat16, torch.float32
    for tp in (1, 2):
        n, vt, h = cfg.seq_len, cfg.vocab_size // tp, cfg.d_model
        ln = _price("rms_norm", [_meta(1, n, h, dtype=bf), _meta(h, dtype=bf)],
                    [_meta(1, n, h, dtype=bf)], "h100", bf, normalized_shape=(h,),
                    eps=cfg.norm_eps)
        cast = _price("to", [_meta(n, vt, dtype=bf)], [_meta(n, vt, dtype=f32)], "h100", f32)
        ce = loss_pricing.cross_entropy_times(n, vt, "h100")
        got = edge_times(cfg, 1, tp, False, "h100")["last"]
        assert got == pytest.approx(tuple(a + b + c for a, b, c in zip(ln, cast, ce)),
                                    rel=1e-12)


@pytest.mark.parametrize("level,profile", [("O1", "h100"), ("O2", "a100")])
def test_a_compiled_program_prices_the_loss_as_it_runs(level, profile):
    """``wb.compile``'s schedule priced the loss by the roofline while the run's trace took
    the profile's rate (h100, vocabulary 8,192 on 2 x 2 ranks: 4.09 against 4.90 us at O1;
    at O2 the run also kept the host launch the graph sink drops): both now price the
    measured kernel alike (``compile.kernels.op_kernels``, ``pricing._unlaunched``)."""
    from workbench.models import build_model
    vocab = 8192
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    ids, tg = (torch.randint(0, vocab, (4, 32), generator=g) for _ in range(2))
    x = wb.shard_tensor(ids, mesh, [wb.Shard(0), wb.Replicate()])
    y = wb.shard_tensor(tg, mesh, [wb.Shard(0), wb.Replicate()])
    m = build_model(get_config("tiny", vocab_size=vocab), seed=0)
    wb.parallelize(m, mesh, m.tp_plan(2), mesh_dim="tp")
    prog = wb.compile(m, x, y, level=level, profile=profile, method="trace")
    with wb.trace(profile=profile) as tr:
        _, loss = prog(x, y)
        loss.backward()
    ran = [e.duration for e in tr.events
           if e.stream == "compute" and 0 in e.ranks and e.name == "cross_entropy"]
    n_sunk = sum(1 for e in tr.events if e.stream == "compute" and 0 in e.ranks and
                 e.name == "cross_entropy" and e.args.get("sunk"))
    priced = [e.duration for e in prog.step().trace.events
              if e.stream == "compute" and 0 in e.ranks and e.name.startswith("cross_entropy")]
    assert len(ran) == len(priced) == 2
    assert sum(ran) == pytest.approx(sum(priced), rel=1e-9)
    # the loss at the profile's rate, not the roofline: 64 tokens (4 x 32 over dp 2) x the
    # vocabulary rank 0 holds (the whole, or a tp shard where the search keeps the logits
    # vocabulary-parallel, Megatron's vocab-parallel cross-entropy: which one depends on the
    # search's choice); O2's graph sink drops the host launch of a kernel inside it (the
    # events say which: ``sunk``)
    launch = get_profile(profile).compute_path(torch.float32)[3]
    assert level == "O2" or n_sunk == 0
    want = [sum(loss_pricing.cross_entropy_times(64, v, profile)) - n_sunk * launch
            for v in (vocab, vocab // 2)]
    assert any(sum(ran) == pytest.approx(w, rel=1e-9) for w in want), (sum(ran), want)
