"""DualPipe (DeepSeek-V3 report, Table 2) and ZB-V (Qi et al. 2024): validated, simulated,
held to the published columns, and executed to one device's gradients."""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.schedules import (Schedule, ScheduleError, dualpipe, dualpipe_costs,
                                          formula_bubble, one_f_one_b, simulate, transfers,
                                          validate, zb_h1, zb_v)
from workbench.parallel.schedules.execute import run_pipeline
from tests.test_pipeline_execute import make, single_device

PM = [(2, 4), (4, 8), (4, 12), (6, 12), (8, 16), (8, 24)]


@pytest.mark.parametrize("p,m", PM)
def test_dualpipe_table2_activations_and_parameters(p, m):
    s = validate(dualpipe(p, m))
    r = simulate(s, f=1.0, b=1.0, w=1.0)
    # Table 2: activations PP + 1 micro-batches (1F1B: PP), on every rank
    assert r.peak_inflight == (p + 1,) * p
    assert max(simulate(one_f_one_b(p, m), f=1, b=2).peak_inflight) == p
    # parameters 2x: every stage has two copies, on rank s and rank p - 1 - s
    assert sorted(s.slot(rk, c) for rk in range(p) for c in (0, 1)) == list(range(2 * p))
    assert {s.stage(rk, 1) for rk in range(p)} == set(range(p))
    # both ends start at once: ranks 0 and p - 1 run a forward at time 0
    assert r.starts[0][0] == 0 and r.starts[p - 1][0] == 0


@pytest.mark.parametrize("p,m", PM + [(10, 20)])
@pytest.mark.parametrize("c", [1.0, 0.5, 3.0])
def test_dualpipe_bubble_is_table2(p, m, c):
    # F&B pairs run as one block (both outputs at the pair's end), F = B = W = c
    s = dualpipe(p, m)
    r = simulate(s, **dualpipe_costs(s, c, c, c))
    table = formula_bubble(s, c, c, c)      # (p/2 - 1)(F&B + B - 3W), F&B = 3c, B = 2c
    assert table.bubble_time == pytest.approx((p / 2 - 1) * (3 * c + 2 * c - 3 * c))
    assert r.bubble_time == pytest.approx((table.bubble_time,) * p)
    assert r.peak_inflight == (p + 1,) * p
    # 1F1B's row of Table 2, (p - 1)(F + B), on the same costs: DualPipe's is below
    assert simulate(one_f_one_b(p, m), f=c, b=c, w=c).bubble_time[0] == \
        pytest.approx((p - 1) * (c + 2 * c))


def test_simulate_reads_a_dualpipe_cost_list_per_stage():
    # rank 0 runs stage 0 for micro-batches 0, 1 and stage 1 (copy 1) for 2, 3: a list of
    # p costs is per stage there (it was read per rank: rank 0 priced stage 1 at stage 0's)
    r = simulate(dualpipe(2, 4), f=[1.0, 3.0], b=1.0, w=1.0)
    assert r.busy == pytest.approx((2 * 1 + 2 * 3 + 8,) * 2)


def test_dualpipe_costs_bad_input():
    with pytest.raises(ValueError, match="dualpipe"):
        dualpipe_costs(zb_h1(2, 4))
    for kw in (dict(f="a"), dict(w=-1.0), dict(fb=float("nan")), dict(b=True)):
        with pytest.raises(ValueError, match=f"dualpipe_costs\\({next(iter(kw))}="):
            dualpipe_costs(dualpipe(2, 4), **kw)


@pytest.mark.parametrize("p,m", PM)
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (2, 1, 1), (3, 2, 1), (1, 1, 0.5), (2, 2, 1)])
def test_dualpipe_bubble_unfused(p, m, f, b, w):
    r = simulate(dualpipe(p, m), f=f, b=b, w=w)
    measured = (p / 2 - 1) * (f + b - w)     # F then B in sequence (formulas.py), b <= f
    assert r.bubble_time == pytest.approx((measured,) * p)
    table = formula_bubble(dualpipe(p, m), f, b, w)
    # Table 2 with F&B = f + b + w (no overlap): (p/2 - 1)(F&B + B - 3W), B = b + w
    assert table.bubble_time == pytest.approx((p / 2 - 1) * (f + 2 * b - w))
    assert r.bubble_time[0] <= table.bubble_time + 1e-12
    # ... and below 1F1B's (p - 1)(F + B) and ZB-H1's (p - 1)(F + B - 2W) (Table 2's rows)
    assert r.bubble_time[0] <= (p - 1) * (f + b - w) + 1e-12
    assert r.bubble_time[0] < simulate(one_f_one_b(p, m), f=f, b=b, w=w).bubble_time[0]


def test_dualpipe_bad_input():
    with pytest.raises(ValueError, match="even number of ranks"):
        dualpipe(3, 6)
    with pytest.raises(ValueError, match="m >= 8"):
        dualpipe(4, 6)
    bad = dualpipe(2, 4).actions
    with pytest.raises(ScheduleError, match="runs on chunk 0 only"):
        validate(Schedule(2, 4, 2, (bad[0][:1] + (bad[0][1].__class__("F", 0, 1),)
                                    + bad[0][2:], bad[1]), split_backward=True,
                          layout="dualpipe"))


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 12), (5, 10), (6, 12), (8, 16),
                                 (8, 24)])
@pytest.mark.parametrize("c", [1.0, 0.25])
def test_zb_v_is_zero_bubble_at_1f1b_memory(p, m, c):
    s = validate(zb_v(p, m))
    assert s.layout == "v" and s.stage(0, 0) == 0 and s.stage(0, 1) == 2 * p - 1
    r = simulate(s, f=c, b=c, w=c)
    # published (t_F = t_B = t_W): bubble 0, counted from each rank's first action ...
    fb = formula_bubble(s, c, c, c)
    assert fb.measure == "span" and fb.bubble_time == 0.0
    assert r.span_bubble == pytest.approx((0.0,) * p, abs=1e-12)
    # ... at 1F1B's activation memory: p micro-batches = 2p half-stage chunks, every rank
    assert r.peak_inflight == (2 * p,) * p
    # ZB-H1 on the same model (a stage = two chunks) keeps (p-1)(F+B-W) on every rank
    h1 = simulate(zb_h1(p, m), f=2 * c, b=2 * c, w=2 * c)
    assert h1.span_bubble[0] == pytest.approx((p - 1) * 2 * c)
    assert r.bubble_fraction < h1.bubble_fraction
    # the V: a micro-batch goes down the ranks and back up, twice the messages of 1F1B
    assert len(transfers(s)) == 2 * len(transfers(one_f_one_b(p, m)))


@pytest.mark.parametrize("f,b,w", [(1, 2, 1), (2, 1, 1), (1, 1, 0.5), (1, 2, 2)])
def test_zb_v_other_costs_beat_zb_h1(f, b, w):
    p, m = 4, 8
    s = validate(zb_v(p, m, f, b, w))           # the order built for these costs
    r = simulate(s, f=f, b=b, w=w)
    h1 = simulate(zb_h1(p, m), f=2 * f, b=2 * b, w=2 * w)
    assert max(r.peak_inflight) == 2 * p
    assert r.span_bubble_fraction < h1.span_bubble_fraction
    assert formula_bubble(s, f, b, w) is None     # no closed form (formulas.py)


def test_zb_v_bad_input():
    with pytest.raises(ValueError, match="m >= p"):
        zb_v(4, 2)
    with pytest.raises(ValueError, match="v=3"):
        Schedule(2, 2, 3, ((), ()), layout="v")
    with pytest.raises(ValueError, match="w=0"):
        zb_v(2, 4, w=0)


@pytest.mark.parametrize("name,p,m", [("zb_v", 2, 4), ("zb_v", 3, 3), ("dualpipe", 2, 4),
                                      ("dualpipe", 4, 8)])
def test_executor_gives_one_device_gradients(name, p, m):
    s = zb_v(p, m) if name == "zb_v" else dualpipe(p, m)
    n = s.stages                              # zb_v: 2p stages; dualpipe: p, two copies
    weights = make(n)
    X, T = torch.randn(4 * m, 8), torch.randn(4 * m, 8)
    ref_loss, ref_grads = single_device(weights, X, T)
    meshes = [wb.Mesh([r], ["pp"]) for r in range(p)]
    params, stages = [None] * (2 * p), [None] * (2 * p)
    for r in range(p):
        for c in (0, 1):
            st, slot = s.stage(r, c), s.slot(r, c)
            w, b = weights[st]
            dw = wb.shard_tensor(w, meshes[r], [wb.Replicate()]).requires_grad_()
            db = wb.shard_tensor(b, meshes[r], [wb.Replicate()]).requires_grad_()
            params[slot] = [dw, db]
            last = st == n - 1
            stages[slot] = (lambda x, dw=dw, db=db, last=last:
                            F.linear(x, dw, db) if last else torch.tanh(F.linear(x, dw, db)))
    first = [meshes[s.placement(0, i)[0]] for i in range(m)]
    xs = [wb.shard_tensor(c, first[i], [wb.Replicate()]) for i, c in enumerate(X.chunk(m))]
    ts = T.chunk(m)
    loss_fn = lambda out, i: ((out - wb.shard_tensor(ts[i], out.mesh, [wb.Replicate()])) ** 2).mean()
    with wb.trace():
        run = run_pipeline(s, stages, meshes, xs, loss_fn, params=params)
    assert run.loss == pytest.approx(ref_loss.item(), rel=1e-5)
    for st in range(n):
        # DualPipe's two copies of stage st (slots st and p + st): it sums their gradients
        slots = [st, p + st] if name == "dualpipe" else [st]
        gw = sum(params[sl][0].grad.full() for sl in slots)
        gb = sum(params[sl][1].grad.full() for sl in slots)
        torch.testing.assert_close(gw, ref_grads[st][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gb, ref_grads[st][1], rtol=1e-5, atol=1e-6)


def test_train_with_zb_v_gives_one_devices_losses():
    """The hybrid recipe places ZB-V's 2p stages in a V (rank r: stages r and 2p-1-r)."""
    from workbench.recipes.hybrid import Hybrid
    from workbench.train import train
    one = [r["loss"] for r in train("tiny", steps=2, seed=0, timing=False, n_layer=4)]
    got = [r["loss"] for r in train("tiny", steps=2, seed=0, timing=False, n_layer=4,
                                    strategy=Hybrid(dp=2, pp=2, schedule="zb-v"))]
    assert got == pytest.approx(one, rel=1e-5)
    with pytest.raises(ValueError, match="two chunks per rank"):
        Hybrid(pp=2, schedule="zb-v", virtual=3)


def test_cli_refuses_zb_v_that_cannot_split_the_model(capsys):
    from workbench.cli import main
    assert main(["train", "--preset", "tiny", "--pp", "2", "--schedule", "zb-v"]) == 2
    assert "4 stages do not divide n_layer=2" in capsys.readouterr().err
