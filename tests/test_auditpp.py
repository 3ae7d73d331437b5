"""Audit of pipeline parallelism (auditpp): schedule orders against PyTorch's, per-stage
activation peaks against Megatron's formulas, the pipelined step against one device in
float64 for every schedule, DualPipe's second copy of the model, and ``stage_sizes``.

Oracle for the orders: ``torch.distributed.pipelining.schedules`` at torch 2.13, whose
order tables are built here without a process group (``object.__new__`` plus the few
attributes ``_calculate_single_rank_operations`` / ``_get_pipeline_order`` read).
"""
import pytest
import torch
import torch.distributed.pipelining.schedules as TS

import workbench as wb
from workbench.models import build_model, get_batch, get_config
from workbench.parallel.schedules import (gpipe, interleaved_1f1b, one_f_one_b, simulate,
                                          zb_h1)
from workbench.recipes.hybrid import Hybrid

_KIND = {TS._ComputationType.FORWARD: "F", TS._ComputationType.FULL_BACKWARD: "B",
         TS._ComputationType.BACKWARD_INPUT: "B", TS._ComputationType.BACKWARD_WEIGHT: "W"}


def _ours(sched):
    return [[(a.kind, a.mb, a.chunk) for a in row] for row in sched.actions]


def _torch_rows(ops, p):
    """torch's actions of one rank, idle steps and gradient reductions left out, as
    (kind, micro-batch, chunk) with chunk = stage // p (the interleaved placement)."""
    return [(_KIND[a.computation_type], a.microbatch_index, a.stage_index // p)
            for a in ops if a is not None and a.computation_type in _KIND]


def _torch_multi(cls, p, m, v):
    """ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble's per-rank orders."""
    s = object.__new__(cls)
    s.pp_group_size, s.n_local_stages, s._n_microbatches = p, v, m
    s.number_of_rounds = max(1, m // p)
    s.microbatches_per_round = m // s.number_of_rounds
    return [_torch_rows(s._calculate_single_rank_operations(r), p) for r in range(p)]


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 2), (2, 3), (4, 3)])
@pytest.mark.parametrize("rounds", [2, 3])
def test_interleaved_order_is_torch_pipelinings(p, v, rounds):
    # m = 2p, 3p: Megatron's and torch's rule (warm-up (v-1)p + 2(p-1-r), micro-batches in
    # groups of p per chunk).  At m == p Megatron runs every forward first
    # (forward_backward_pipelining_with_interleaving: num_microbatches ==
    # pipeline_parallel_size -> all warm-up), which torch does not: not compared.
    m = rounds * p
    assert _ours(interleaved_1f1b(p, m, v)) == _torch_multi(TS.ScheduleInterleaved1F1B, p, m, v)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8), (4, 9)])
def test_zb_h1_order_is_torch_pipelinings_zero_bubble(p, m):
    # torch's ScheduleInterleavedZeroBubble on one chunk per rank is ZB-H1 (Qi et al. 2023
    # Fig. 3): warm-up p-1-r forwards, r steps whose W waits, then F B W, then B W, then W
    assert _ours(zb_h1(p, m)) == _torch_multi(TS.ScheduleInterleavedZeroBubble, p, m, 1)


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 4), (3, 2), (4, 8), (4, 5)])
def test_1f1b_order_is_torch_get_1f1b_rank_ops(p, m):
    # torch's runtime (Schedule1F1B._step_microbatches) warms up min(m, p - r) forwards,
    # then 1B1F: warm-up p-1-r and 1F1B in _get_1f1b_rank_ops' terms
    want = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        ops = TS._get_1f1b_rank_ops(1, p, warm, m - warm, warm, r, lambda k, r=r: r,
                                    lambda k, r=r: r)
        want.append(_torch_rows(ops, p))
    assert _ours(one_f_one_b(p, m)) == want


@pytest.mark.parametrize("p,m", [(1, 2), (2, 3), (4, 8)])
def test_gpipe_order_is_torch_pipelinings(p, m):
    s = object.__new__(TS.ScheduleGPipe)
    s._num_stages, s._n_microbatches = p, m
    order = s._get_pipeline_order()
    assert _ours(gpipe(p, m)) == [_torch_rows(order[r], p) for r in range(p)]


@pytest.mark.parametrize("p,m,v", [(4, 8, 1), (4, 2, 1), (3, 7, 1), (1, 3, 1), (4, 8, 2),
                                   (4, 4, 2), (2, 6, 3)])
def test_planners_in_flight_is_the_simulated_peak_on_every_stage(p, m, v):
    # the planner's activation memory (plan.memory.in_flight, micro-batches of a stage's
    # layers) against what the schedule simulation counts (chunks of 1/v of them)
    from workbench.plan.memory import in_flight
    cases = [("gpipe", gpipe(p, m)), ("1f1b", one_f_one_b(p, m))] if v == 1 else \
        [("interleaved_1f1b", interleaved_1f1b(p, m, v))]
    for name, sched in cases:
        peak = simulate(sched).peak_inflight
        assert tuple(in_flight(name, p, m, v, s) * v for s in range(p)) == peak, name


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (2, 4, 3), (4, 12, 2), (4, 4, 2), (3, 6, 3)])
def test_interleaved_peak_is_megatrons_warmup_plus_one(p, m, v):
    # Megatron's warm-up 2 (p - s - 1) + (v - 1) p chunk forwards, plus the steady state's
    # one: the chunk activations held at once (all m v when m == p: all warm-up)
    r = simulate(interleaved_1f1b(p, m, v), f=1 / v, b=2 / v)
    want = tuple(m * v if m == p else min(m * v, 2 * (p - s - 1) + (v - 1) * p + 1)
                 for s in range(p))
    assert r.peak_inflight == want
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


# ---- the pipelined step against one device, float64 ---------------------------------------
def _full(v):
    return v.full() if isinstance(v, wb.DistTensor) else v


def _f64_steps(kw, n_layer=4, batch=12, steps=2):
    """Loss, every gradient and every parameter of a float64 pipeline over ``steps`` SGD
    steps, against one device: the largest differences."""
    cfg = get_config("tiny").replace(n_layer=n_layer, dropout=0.0)
    ref = build_model(cfg, seed=0).train().double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    st = Hybrid(**kw)
    model = st.build_model(cfg, 0).double()
    opts = st.build_optimizer(model, 3e-3, 0.0)
    opt = torch.optim.SGD([q for o in opts for q in o.parameters()], lr=0.5)
    loss_d = grad_d = 0.0
    for step in range(steps):
        x, y = get_batch(cfg, batch, 0, step)
        want = ref(x, y)[1]
        want.backward()
        got = st.forward_backward(model, x, y)
        st.finish_gradient_synchronization(opts)
        loss_d = max(loss_d, abs(float(got) - want.item()) / want.item())
        grads = {n: _full(q.grad) for n, q in model.named_parameters()}
        for n, q in ref.named_parameters():
            assert grads[n].dtype == torch.float64, n
            grad_d = max(grad_d, (grads[n] - q.grad).abs().max().item())
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    state = {k: _full(v) for k, v in model.state_dict().items()}
    param_d = max((state[n] - q.detach()).abs().max().item() for n, q in ref.named_parameters())
    return loss_d, grad_d, param_d


@pytest.mark.parametrize("kw", [
    dict(pp=1), dict(pp=2, schedule="gpipe", microbatches=3), dict(pp=4, microbatches=2),
    dict(pp=2, microbatches=1), dict(pp=3, microbatches=6, stage_sizes=(1, 2, 1)),
    dict(pp=2, schedule="interleaved", microbatches=2),
    dict(pp=4, schedule="zb-h1", microbatches=3), dict(pp=2, schedule="zb-v", microbatches=4),
    dict(pp=2, schedule="dualpipe", microbatches=4)],
    ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_every_schedule_in_float64_is_one_device(kw):
    # m < p (pp=4, m=2 or 3), m = 1, p = 1, uneven stages: the gradients to float64's
    # rounding; the loss is float32 (the model's cross-entropy returns float32)
    loss_d, grad_d, param_d = _f64_steps(kw)
    assert loss_d < 1e-6
    assert grad_d < 1e-12
    assert param_d < 1e-12


# ---- DualPipe's second copy follows the model ----------------------------------------------
def test_dualpipe_in_place_init_reaches_the_second_copy():
    # was: the in-place change reached copy 0 only; the micro-batches fed from rank pp - 1
    # ran on the old weights: loss 4.3056 for one device's 4.3100, silently
    cfg = get_config("tiny").replace(n_layer=2, dropout=0.0)
    ref = build_model(cfg, seed=0).train()
    st = Hybrid(pp=2, schedule="dualpipe", microbatches=4)
    model = st.build_model(cfg, 0)
    opts = st.build_optimizer(model, 1e-3, 0.0)
    with torch.no_grad():
        for mod in (model, ref):
            for q in mod.parameters():
                q.mul_(0.5)
    x, y = get_batch(cfg, 8, 0, 0)
    want = ref(x, y)[1]
    want.backward()
    got = st.forward_backward(model, x, y)
    assert float(got) == pytest.approx(want.item(), rel=1e-6)
    st.finish_gradient_synchronization(opts)
    grads = {n: _full(q.grad) for n, q in model.named_parameters()}
    for n, q in ref.named_parameters():
        torch.testing.assert_close(grads[n], q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_dualpipe_model_double_converts_the_second_copy():
    # was: model.double() left copy 1 in float32: half the micro-batches ran in float32 and
    # summing the copies' gradients raised "assign a gradient with dtype 'double' to a
    # tensor with grad_dtype 'Float'"
    cfg = get_config("tiny").replace(n_layer=2, dropout=0.0)
    st = Hybrid(pp=2, schedule="dualpipe", microbatches=4)
    model = st.build_model(cfg, 0).double()
    assert {q.dtype for q in st._twin[1].parameters()} == {torch.float64}
    opts = st.build_optimizer(model, 1e-3, 0.0)
    x, y = get_batch(cfg, 8, 0, 0)
    st.forward_backward(model, x, y)
    st.finish_gradient_synchronization(opts)
    assert all(_full(q.grad).dtype == torch.float64 for q in model.parameters())


# ---- stage_sizes -----------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", ["13", (-1, 5), (2.0, 2.0), (True, 3)])
def test_bad_stage_sizes_named_at_construction(sizes):
    # was: "13" (two characters, pp=2) passed Hybrid() and failed in the step with
    # "unsupported operand type(s) for +: 'int' and 'str'"; the others were named
    # "sizes=" (models/split.py's word) only once the model was built
    with pytest.raises(ValueError, match=r"Hybrid\(stage_sizes=.*ints >= 0"):
        Hybrid(pp=2, stage_sizes=sizes)


def test_an_empty_stage_is_one_device():
    # a stage of 0 layers (only the embedding, or only the head) is allowed and exact
    cfg = get_config("tiny").replace(n_layer=2, dropout=0.0)
    x, y = get_batch(cfg, 4, 0, 0)
    want = build_model(cfg, seed=0).train()(x, y)[1].item()
    for sizes in ((0, 2), (2, 0)):
        st = Hybrid(pp=2, microbatches=2, stage_sizes=sizes)
        assert float(st.forward_backward(st.build_model(cfg, 0), x, y)) == \
            pytest.approx(want, rel=1e-6)


# ---- point-to-point messages of one pipelined step --------------------------------------------
@pytest.mark.parametrize("kw,edges", [
    (dict(pp=2), 1), (dict(pp=2, schedule="gpipe"), 1), (dict(pp=4, microbatches=4), 3),
    (dict(pp=2, schedule="interleaved", microbatches=4), 3),    # p v - 1 stage edges
    (dict(pp=2, schedule="zb-h1", microbatches=4), 1),          # W sends nothing
    (dict(pp=2, schedule="zb-v", microbatches=4), 2),           # the V's turn is on one rank
    (dict(pp=2, schedule="dualpipe", microbatches=4), 1),       # each copy m/2, p - 1 edges
    (dict(pp=2, tp=2, microbatches=2), 1), (dict(pp=2, tp=2, sp=True, microbatches=2), 1)],
    ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()) if isinstance(a, dict) else str(a))
def test_p2p_messages_and_bytes_per_step(kw, edges):
    # one activation and one gradient per micro-batch per cross-rank stage edge, on every
    # tp rank; each (B / m) x seq x d_model float32 values (a 1/tp sequence shard with sp)
    from workbench.sim_mesh.trace import trace
    cfg = get_config("tiny").replace(n_layer=4, dropout=0.0)
    x, y = get_batch(cfg, 8, 0, 0)
    st = Hybrid(**kw)
    model = st.build_model(cfg, 0)
    with trace() as tr:
        st.forward_backward(model, x, y)
    sends = [e for e in tr.collectives() if e.name == "send_recv"]
    assert len(sends) == 2 * st.m * edges * st.tp
    want = (8 // st.m) * cfg.seq_len * cfg.d_model * 4 // (st.tp if st.sp else 1)
    assert {e.bytes for e in sends} == {want}
