"""A split backward (ZB-H1, ZB-V, DualPipe) prices each backward kernel once: B the input
gradients, W the weight-gradient GEMMs, B + W one backward (Qi et al. 2023, "Zero Bubble
Pipeline Parallelism", arXiv 2401.10241, sec. 2), so a stage's compute on the modeled
clock is 1F1B's (the same work in another order) and only the order changes the step."""
import collections

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.models import get_batch, get_config
from workbench.recipes.hybrid import Hybrid
from workbench.sim_mesh.trace import trace

S = wb.schedules


def _step(cfg, batch=8, **kw):
    torch.manual_seed(0)
    st = Hybrid(**kw)
    model = st.build_model(cfg, 0)
    st.build_optimizer(model, 3e-3, 0.01)            # (zero=3: the shards W reaches)
    x, y = get_batch(cfg, batch, 0, 0)
    with trace() as tr:
        loss = st.forward_backward(model, x, y)
    return float(loss), tr, model


def _per_rank(tr):
    """rank -> (compute seconds, FLOPs, bytes, kernels; comm events by (name, bytes)); a
    kernel's seconds alone (``alone``: not stretched by a collective beside it, which
    depends on the order)."""
    out = collections.defaultdict(lambda: [0.0, 0, 0, 0, collections.Counter()])
    for e in tr.events:
        for r in e.ranks:
            a = out[r]
            if e.stream == "compute":
                a[0] += e.args.get("alone", e.duration)
                a[1] += e.flops
                a[2] += e.bytes
                a[3] += 1
            else:
                a[4][(e.name, e.bytes)] += 1
    return dict(out)


def _same(a, b):
    assert a[1:] == b[1:]                              # FLOPs, bytes, kernels, comm
    assert a[0] == pytest.approx(b[0], rel=1e-9)       # seconds (summed in another order)


@pytest.mark.parametrize("kw", [dict(), dict(tp=2, sp=True), dict(dp=2, zero=3)],
                         ids=["pp2", "pp2-tp2-sp", "pp2-dp2-zero3"])
def test_zb_h1_prices_each_stage_as_1f1b(kw):
    """pp2-tp2-sp failed before: the last stage's lm_head weight, replicated over tp and
    read per rank, has one gradient way made in the first micro-batch's forward; ZB-H1's W
    of micro-batches 2-4 took it for B's, walked again, and recorded its all-reduce over
    tp (19,200 B) once per step where 1F1B records it once per micro-batch (4), the
    reduction that runs as each micro-batch's gradient passes (gradients equal)."""
    cfg = get_config("tiny").replace(n_layer=2)
    l1, t1, _ = _step(cfg, pp=2, microbatches=4, **kw)
    lz, tz, _ = _step(cfg, pp=2, microbatches=4, schedule="zb-h1", **kw)
    assert lz == l1                                    # exact: same work, same sums
    a, b = _per_rank(t1), _per_rank(tz)
    assert a.keys() == b.keys()
    for r in a:
        _same(b[r], a[r])


def test_zb_v_prices_each_stage_as_1f1b_on_four_ranks():
    """ZB-V on 2 ranks runs stages 0 and 3 on rank 0, 1 and 2 on rank 1 (the V): each
    rank's compute is that of its two stages under 1F1B on 4 ranks."""
    cfg = get_config("tiny").replace(n_layer=4)
    l1, t1, _ = _step(cfg, pp=4, microbatches=4)
    lz, tz, _ = _step(cfg, pp=2, microbatches=4, schedule="zb-v")
    assert lz == pytest.approx(l1, rel=1e-6)
    a, b = _per_rank(t1), _per_rank(tz)

    def both(x, y):
        return [x[0] + y[0], x[1] + y[1], x[2] + y[2], x[3] + y[3]]
    for r, (s, t) in {0: (0, 3), 1: (1, 2)}.items():
        got, want = b[r][:4], both(a[s], a[t])
        assert got[1:] == want[1:]
        assert got[0] == pytest.approx(want[0], rel=1e-9)


def test_zb_h1_step_not_longer_than_1f1b_when_w_can_fill_the_bubble():
    """Qi et al. sec. 3: 1F1B's bubble is (p-1)(T_F + T_B + T_W), ZB-H1's (p-1)(T_F + T_B
    - T_W): shorter whenever the stages' W take time (T_W > 0) and the stages are alike
    (each T_F, T_B, T_W the same within a small p2p time), as here: 2 stages of 2 layers,
    the weight-gradient GEMMs each a share of the backward."""
    cfg = get_config("tiny").replace(n_layer=4)
    l1, t1, _ = _step(cfg, pp=2, microbatches=4)
    lz, tz, _ = _step(cfg, pp=2, microbatches=4, schedule="zb-h1")
    assert lz == l1
    wgrad = sum(e.duration for e in tz.events if e.args.get("part") == "wgrad")
    assert wgrad > 0
    assert tz.time() < t1.time()


def _linear_pipeline(sched, m=4):
    """Two stages of one linear layer each (8 x 8): stage 1's B runs the dgrad GEMM only
    and its W the wgrad GEMM (with the bias's sum) only."""
    g = torch.Generator().manual_seed(0)
    meshes = [wb.Mesh([r], ["pp"]) for r in range(2)]
    params, stages = [], []
    for s in range(2):
        w = wb.shard_tensor(torch.randn(8, 8, generator=g), meshes[s], [wb.Replicate()])
        b = wb.shard_tensor(torch.randn(8, generator=g), meshes[s], [wb.Replicate()])
        w.requires_grad_(), b.requires_grad_()
        params.append([w, b])
        stages.append(lambda x, w=w, b=b: F.linear(x, w, b))
    xs = [wb.shard_tensor(torch.randn(4, 8, generator=g), meshes[0], [wb.Replicate()])
          for _ in range(m)]
    with wb.trace() as tr:
        run = S.run_pipeline(sched, stages, meshes, xs, lambda out, i: out.pow(2).mean(),
                             params=params)
    return run, tr, params


def test_split_backward_b_runs_the_dgrad_w_the_wgrad_of_a_linear():
    r1, t1, p1 = _linear_pipeline(S.one_f_one_b(2, 4))
    rz, tz, pz = _linear_pipeline(S.zb_h1(2, 4))
    assert rz.loss == r1.loss
    for a, b in zip(p1, pz):
        for x, y in zip(a, b):
            torch.testing.assert_close(y.grad.full(), x.grad.full(), rtol=0, atol=0)

    def parts(tr, rank):
        return collections.Counter(e.args.get("part") for e in tr.events
                                   if e.stream == "compute" and rank in e.ranks
                                   and e.args.get("phase") == "backward"
                                   and e.name == "linear")
    # stage 1's linear: a dgrad (its input is stage 0's output), a wgrad and its bias's sum
    # per micro-batch; stage 0's reads data: no dgrad -- under either schedule
    assert parts(t1, 1) == parts(tz, 1) == {"dgrad": 4, "wgrad": 4, "bias": 4}

    def work(tr, rank):       # the GEMMs read the output gradient once: the dgrad, in B
        return [sum(getattr(e, k) for e in tr.events if rank in e.ranks and e.name == "linear"
                    and e.args.get("phase") == "backward") for k in ("flops", "bytes")]
    assert work(tz, 1) == work(t1, 1) and work(tz, 0) == work(t1, 0)
    assert parts(t1, 0) == parts(tz, 0) == {"wgrad": 4, "bias": 4}
    # under ZB-H1 each B on stage 1 is one dgrad, each W one wgrad and the bias's sum (a
    # weight's gradient too): in the order ran
    seq = [e.args["part"] for e in sorted(tz.events, key=lambda e: e.start)
           if 1 in e.ranks and e.name == "linear" and e.args.get("phase") == "backward"]
    W = ["wgrad", "bias"]
    assert seq == ["dgrad", "dgrad", *W, "dgrad", *W, "dgrad", *W, *W]


def test_dualpipe_prices_the_work_of_1f1b():
    """DualPipe runs half the micro-batches through each model copy: over all ranks the
    same kernels as 1F1B on the same layers and batch."""
    cfg = get_config("tiny").replace(n_layer=2)
    l1, t1, _ = _step(cfg, pp=2, microbatches=4)
    ld, td, _ = _step(cfg, pp=2, microbatches=4, schedule="dualpipe")
    assert ld == l1
    a, b = _per_rank(t1), _per_rank(td)
    tot = [[sum(v[i] for v in d.values()) for i in range(4)] for d in (a, b)]
    assert tot[1][1:] == tot[0][1:]
    assert tot[1][0] == pytest.approx(tot[0][0], rel=1e-9)
