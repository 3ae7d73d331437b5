"""DeepSpeed's pipeline engine in the planner (``plan.deepspeed_pipe``,
``plan.deepspeed_step``): the TrainSchedule's instructions as its source orders them,
their timing with blocking transfers held to hand-computed timelines and to 1F1B, and
each engine term against its hand-computed price."""
import random

import pytest

import workbench as wb
from workbench.models import get_config
from workbench.parallel.schedules import one_f_one_b, simulate as simulate_1f1b
from workbench.plan import deepspeed_pipe as D
from workbench.plan import deepspeed_step as DS
from workbench.sim_mesh.cost import compute_time, price
from workbench.sim_mesh.profiles import get_profile

A100 = get_profile("a100")


def test_train_schedule_two_stages_two_micro_batches_by_hand():
    """TrainSchedule.steps for p=2, m=2, worked by hand from schedule.py's step arithmetic:
    6 steps; even stage forwards on even steps."""
    s0 = [[("forward", 0)], [("send_act", 0)], [("forward", 1)],
          [("send_act", 1), ("recv_grad", 0), ("backward", 0)], [],
          [("recv_grad", 1), ("backward", 1), ("reduce_tied_grads", None),
           ("reduce_grads", None), ("optimizer_step", None)]]
    s1 = [[], [("recv_act", 0), ("forward", 0)], [("backward", 0)],
          [("recv_act", 1), ("send_grad", 0), ("forward", 1)], [("backward", 1)],
          [("send_grad", 1), ("reduce_tied_grads", None), ("reduce_grads", None),
           ("optimizer_step", None)]]
    assert D.train_schedule(2, 2, 0) == s0
    assert D.train_schedule(2, 2, 1) == s1


@pytest.mark.parametrize("p,m", [(1, 3), (3, 1), (4, 6), (5, 12)])
def test_train_schedule_runs_every_micro_batch_once_each_way(p, m):
    for s in range(p):
        flat = [c for step in D.train_schedule(p, m, s) for c in step]
        fwd = [mb for name, mb in flat if name == "forward"]
        bwd = [mb for name, mb in flat if name == "backward"]
        assert fwd == list(range(m)) and bwd == list(range(m))
        # a micro-batch's backward after its forward; at most p - s + 1 in flight
        # (num_pipe_buffers)
        pos = {c: i for i, c in enumerate(flat)}
        assert all(pos[("forward", j)] < pos[("backward", j)] for j in range(m))
        assert sum(n == "send_act" for n, _ in flat) == (m if s < p - 1 else 0)
        assert sum(n == "recv_grad" for n, _ in flat) == (m if s < p - 1 else 0)
        assert sum(n == "recv_act" for n, _ in flat) == (m if s > 0 else 0)
    # the streams pair up: simulate raises on a mismatch or a deadlock
    assert len(D.simulate([1.0] * p, [2.0] * p, m, 0.1)) == p


def test_simulate_by_hand():
    # p=2, m=1, f=1, b=3, crossing 0.5: stage 0 F 0-1; the activation crosses 1-1.5;
    # stage 1 F 1.5-2.5, B 2.5-5.5; the gradient crosses 5.5-6; stage 0 B 6-9
    assert D.simulate([1, 1], [3, 3], 1, 0.5) == [9.0, 6.0]
    # p=2, m=4, no transfer time: (m + p - 1)(f + b) = 20 on stage 0, as 1F1B
    assert D.simulate([1, 1], [3, 3], 4, 0.0) == [20.0, 17.0]


@pytest.mark.parametrize("p,m,seed", [(3, 5, 0), (4, 9, 1), (6, 6, 2)])
def test_simulate_matches_one_f_one_b_without_transfer_time(p, m, seed):
    """With free transfers the rendezvous streams end when Megatron-style 1F1B does
    (parallel.schedules), for unequal stages too: the step parity is an order, not a
    lock-step."""
    rng = random.Random(seed)
    f = [rng.uniform(0.5, 1.5) for _ in range(p)]
    b = [rng.uniform(1.0, 4.0) for _ in range(p)]
    ds = D.simulate(f, b, m, 0.0)
    ref = simulate_1f1b(one_f_one_b(p, m), f=f, b=b)
    assert max(ds) == pytest.approx(ref.makespan, rel=1e-12)


def test_simulate_each_crossing_blocks_both_ends():
    # p=3, m=1, f=1, b=2, crossing 1: 0-1 F0; 1-2 cross; 2-3 F1; 3-4 cross; 4-5 F2,
    # 5-7 B2; 7-8 cross; 8-10 B1; 10-11 cross; 11-13 B0
    assert D.simulate([1, 1, 1], [2, 2, 2], 1, 1.0) == [13.0, 11.0, 8.0]


@pytest.mark.parametrize("kw,match", [
    (dict(forward=[1, 1], backward=[1], micro_batches=1, crossing=0.0), "one time per"),
    (dict(forward=[1, -1], backward=[1, 1], micro_batches=1, crossing=0.0), "forward"),
    (dict(forward=[1, 1], backward=[1, 1], micro_batches=0, crossing=0.0), "micro_batches"),
    (dict(forward=[1, 1], backward=[1, 1], micro_batches=1, crossing=-1.0), "crossing")])
def test_simulate_refuses_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        D.simulate(**kw)


N = 2 * 2048 * 1 * 20480            # bytes of one [s, b, h] fp16 activation, MT-NLG's


def _lay(**kw):
    return wb.plan.Layout(**{**dict(dp=2, tp=8, pp=4, recompute="full", global_batch=16,
                                    framework="deepspeed"), **kw})


def test_meta_and_crossing_by_hand():
    lay = _lay()
    assert DS.meta_bytes(8) == 8 * 15 == 120      # [3, s, b, h, 8, rank, 9 offsets]
    pair = [lay.rank(0, 0, 0), lay.rank(0, 0, 1)]
    assert pair == [0, 16]                          # the next stage's TP rank 0
    want = price("send_recv", 120, pair, A100) + price("send_recv", N / 8, pair, A100)
    assert DS.crossing(N, lay, A100) == pytest.approx(want, rel=1e-12)
    assert DS.crossing(N, _lay(tp=1), A100) == pytest.approx(
        price("send_recv", N, [0, 2], A100), rel=1e-12)


def test_stage_extras_by_hand():
    lay = _lay()
    cp = lambda nbytes: compute_time(0.0, nbytes, A100, "float16")     # noqa: E731
    ag = price("all_gather", N, list(range(8)), A100)
    full = cp(N) + cp(2 * N / 8) + cp(2 * N)        # zeros, own slice in, clone
    part = cp(2 * N / 8)
    mid = DS.stage_extras(1, N, lay, A100, "float16")
    assert mid["crossings"] == 4
    assert mid["fwd_copy"] == pytest.approx(2 * part + full + part, rel=1e-12)
    assert mid["fwd_comm"] == pytest.approx(ag, rel=1e-12)
    assert mid["bwd_copy"] == pytest.approx(part + 2 * full, rel=1e-12)
    assert mid["bwd_comm"] == pytest.approx(2 * ag, rel=1e-12)
    first, last = (DS.stage_extras(s, N, lay, A100, "float16") for s in (0, 3))
    assert (first["crossings"], last["crossings"]) == (2, 2)
    assert first["fwd_comm"] == 0 and first["bwd_comm"] == pytest.approx(2 * ag)
    assert last["bwd_comm"] == 0 and last["fwd_comm"] == pytest.approx(ag)
    one = DS.stage_extras(1, N, _lay(tp=1), A100, "float16")
    assert one["fwd_copy"] == pytest.approx(2 * cp(2 * N)) and one["bwd_copy"] == 0
    assert one["fwd_comm"] == one["bwd_comm"] == 0


def test_partitioned_checkpoint_by_hand():
    lay = _lay()
    cp = lambda nbytes: compute_time(0.0, nbytes, A100, "float16")     # noqa: E731
    copies, comm = DS.partitioned_checkpoint(3, N, lay, A100, "float16")
    assert copies == pytest.approx(3 * (cp(2 * N / 8) + cp(N) + cp(2 * N / 8)), rel=1e-12)
    assert comm == pytest.approx(3 * price("all_gather", N, list(range(8)), A100), rel=1e-12)
    assert DS.partitioned_checkpoint(3, N, _lay(tp=1), A100, "float16") == (0.0, 0.0)


def test_fp16_optimizer_and_step_collectives_by_hand():
    assert sum(b for _, b in DS.FP16_OPTIMIZER_BYTES) == 70
    psi = 1.9e9
    assert DS.fp16_optimizer(psi, A100) == pytest.approx(
        compute_time(0.0, 70 * psi, A100, "float32", launches=6), rel=1e-12)
    lay = _lay()
    mp = [lay.rank(t, 0, s) for s in range(4) for t in range(8)]
    dp = [lay.rank(0, d, 3) for d in range(2)]
    pipe = [0, 16, 32, 48]
    base = price("broadcast", 8, pipe, A100) + price("all_reduce", 4, dp, A100)
    assert DS.step_collectives(lay, A100, fp16=False) == pytest.approx(base, rel=1e-12)
    assert DS.step_collectives(lay, A100, fp16=True) == pytest.approx(
        base + price("all_reduce", 1, mp, A100) + price("all_reduce", 4, mp, A100)
        + price("all_reduce", 4, dp, A100), rel=1e-12)


def _small():
    return get_config("gpt3-175b", n_layer=8, d_model=1024, n_head=8, seq_len=512,
                      dtype="float16")


def test_estimate_runs_the_engine():
    cfg, cl = _small(), wb.plan.Cluster("a100", 64)
    lay = _lay()
    est = wb.plan.estimate(cfg, lay, cl)
    ds = est.details["deepspeed_pipe"]
    assert est.step_time == pytest.approx(sum(est.breakdown.values()), rel=1e-12)
    assert est.step_time == pytest.approx(ds["step"], rel=1e-12)
    assert all(v >= 0 for v in est.breakdown.values())
    rows = ds["stages"]
    # the simulated schedule of those stage times, then the step's tail
    assert ds["finish"] == D.simulate([r["forward"] for r in rows],
                                      [r["backward"] for r in rows], lay.m, ds["crossing"])
    assert max(ds["finish"]) >= lay.m * max(r["time"] for r in rows)
    meg = wb.plan.estimate(cfg, lay.replace(framework="megatron"), cl)
    assert "TrainSchedule" not in meg.explain() and meg.details["deepspeed_pipe"] is None
    # the engine's extra crossings, gathers and optimizer passes only add time here
    assert est.details["optimizer"] > meg.details["optimizer"]
    assert "TrainSchedule" in est.explain() and any(
        "DeepSpeed pipeline engine" in a for a in est.assumptions())


@pytest.mark.parametrize("kw,match", [(dict(schedule="gpipe"), "TrainSchedule"),
                                      (dict(sp=True), "sequence")])
def test_estimate_refuses_what_the_engine_did_not_run(kw, match):
    with pytest.raises(ValueError, match=match):
        wb.plan.estimate(_small(), _lay(**kw), wb.plan.Cluster("a100", 64))


def test_estimate_keeps_the_planner_optimizer_where_fp16_optimizer_does_not_run():
    # fp16 with ZeRO-1 (bf16 runs BF16_Optimizer: tests/test_published_bloom.py): Adam
    # alone on the partition, 28 B (plan.optimizer_step); Megatron's distributed
    # optimizer adds its passes over the whole gradient buffer and its copies
    cfg, cl = _small(), wb.plan.Cluster("a100", 64)
    lay = _lay(zero=1)
    ds = wb.plan.estimate(cfg, lay, cl)
    meg = wb.plan.estimate(cfg, lay.replace(framework="megatron"), cl)
    psi = max(d["psi"] for d in ds.details["stages"].values())
    assert ds.details["optimizer"] == pytest.approx(
        compute_time(0.0, 28 * psi / lay.dp, A100, "float32"), rel=1e-12)
    assert meg.details["optimizer"] > ds.details["optimizer"]
    assert not ds.details["deepspeed_pipe"]["fp16"]
    assert any("ZeRO-1's reduce_gradients" in a for a in ds.assumptions())
