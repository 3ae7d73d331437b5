"""zero1tp: a user's read of ``p.grad`` after ``loss.backward()`` and before ``opt.step()``
under ``ZeroRedundancyOptimizer(partition="chunks")`` (ZeRO-1; ZeRO-2 with
``overlap_comm``), over tensor parallelism (dp 2 x tp 2) and on plain data parallelism
(dp 4), held to one device's gradient, or to a raise naming ``opt.clip_grad_norm_``.

Found and fixed (each test failed before):

1. ZeRO-1: each replica's ``p.grad`` is its own dp rank's un-reduced gradient (step()
   reduce-scatters them) under placements that said ``Replicate`` over dp, so every read
   was dp rank 0's share, silently: the first weight's ``p.grad.full().norm()`` 0.2533
   where one device's is 0.3791 (``sum()`` 0.0738 for 0.2003; plain dp 4: norm 0.1369),
   the four gradients' total norm 0.4689 for 0.7516.  Now ``p.grad`` is
   ``Partial("sum")`` over dp (each rank's share; their sum is what step() applies:
   :meth:`.grad_replicas.GradReplicas._replica_grad`), so a read reduces (one all-reduce,
   on the trace, only when a user reads) and an in-place write (``mul_``, ``clamp_``)
   reaches the step exactly.  The same held for ``DistributedDataParallel`` over tensor
   parallelism inside ``no_sync()`` (the module's ``p.grad``: 0.2533 for 0.3791, now one
   device's accumulated gradient).  torch's ``clip_grad_norm_`` / ``clip_grad_value_``
   still refuse there (they would scale each rank's share by the rank's own norm).
2. ZeRO-2 (and ZeRO-1 once ``opt.clip_grad_norm_`` reduced the gradients): ``p.grad``
   was None (the gradient lives in the optimizer's flat shards, as DeepSpeed's), so a
   gradient log over ``model.parameters()`` read nothing and ``if p.grad is not None``
   loops silently skipped every parameter; now it raises naming
   ``opt.clip_grad_norm_(max_norm)`` (``zero_optimizer_dist.GradInShard``).

Under torch.distributed (gloo, 2 x 2): tests/dist_scripts/zero1tp_check.py, a part of the
shared 4-process launch.  Before: ``p.grad.full().norm()`` [0.2533, 0.1381, 0.2643,
0.2584] for [0.3791, 0.2095, 0.4240, 0.4444], and the processes disagreed.

FSDP / Zero3 / fully_shard over tensor parallelism: their reads before the step (and after
two micro-batches, ``set_requires_gradient_sync(False)`` on the first) were already one
device's: guards.
"""
import pytest
import torch
from torch import nn

import workbench as wb

from .test_habits11 import close
from .test_habits15 import Wrapped, assert_same_model, batches, mk, ref_backward

LAYOUTS = ["zero1_tp", "zero2_tp", "zero1_dp", "zero2_dp"]
REFUSE = r"opt\.clip_grad_norm_\(max_norm\)"


class Zero:
    """``ZeroRedundancyOptimizer(partition="chunks")`` over ``mk()``: on dp 2 x tp 2 (the
    module tensor-parallel, habits15's "zero_tp" / "zero2_tp") or on dp 4."""

    def __init__(self, layout):
        stage, where = layout.split("_")
        self.stage = int(stage[-1])
        if where == "tp":
            self.wr = Wrapped("zero_tp" if self.stage == 1 else "zero2_tp")
            self.m, self.mesh, self.opt = self.wr.m, self.wr.mesh, self.wr.optimizer()
            self.inp = self.wr.inp
        else:
            self.m, self.mesh = mk(), wb.Mesh.grid(4, ["dp"])
            wb.parallelize(self.m, self.mesh)
            self.opt = wb.ZeroRedundancyOptimizer(
                [p for _, p in wb.dist_parameters(self.m)], torch.optim.AdamW, self.mesh, "dp",
                partition="chunks", lr=1e-2, overlap_comm=self.stage == 2)
            self.inp = lambda x: wb.shard_tensor(x, self.mesh, [wb.Shard(0)])
        self.m.eval()

    def backward(self, x, y):
        out = self.m(self.inp(x))
        out = out.full() if isinstance(out, wb.DistTensor) else out
        ((out - y) ** 2).mean().backward()


def setup(layout):
    ref = mk()
    ref.eval()
    return ref, Zero(layout), torch.optim.AdamW(ref.parameters(), lr=1e-2)


def num(v) -> torch.Tensor:
    return v.full() if isinstance(v, wb.DistTensor) else v


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grad_reads_before_step_are_one_devices_or_raise(layout):
    """After backward: ZeRO-1's ``p.grad`` is one device's gradient however it is read
    (``full()``, ``norm()``, ``sum()``, a log over ``[p.grad for p in
    model.parameters()]``), ``Partial("sum")`` over dp; ZeRO-2's raises naming the
    optimizer's clip; torch's and wb's clips refuse both; ``opt.clip_grad_norm_`` gives
    one device's norm, after it ``p.grad`` raises, and the step is one device's."""
    ref, z, ro = setup(layout)
    x, y = batches(1)[0]
    z.backward(x, y)
    ref_backward(ref, x, y)
    dp = z.mesh.dim("dp")
    if z.stage == 1:
        grads = [p.grad for p in z.m.parameters()]          # a user's gradient log
        for p, g, q in zip(z.m.parameters(), grads, ref.parameters()):
            assert g.placements[dp] == wb.Partial("sum")
            assert all(a == b for i, (a, b) in enumerate(zip(g.placements, p.placements))
                       if i != dp)
            close(g.full(), q.grad)
            close(num(g.norm()), q.grad.norm())
            close(num(g.sum()), q.grad.sum())
            close(num(g.abs().max()), q.grad.abs().max())
        total = torch.linalg.vector_norm(torch.stack([g.full().norm() for g in grads]))
        close(total, torch.linalg.vector_norm(torch.stack([q.grad.norm()
                                                           for q in ref.parameters()])))
    else:
        for p in z.m.parameters():
            with pytest.raises(RuntimeError, match=REFUSE):
                p.grad
        with pytest.raises(RuntimeError, match=REFUSE):
            [p.grad for p in z.m.parameters()]
    for clip in (lambda ps: nn.utils.clip_grad_norm_(ps, 0.1),
                 lambda ps: nn.utils.clip_grad_value_(ps, 0.01),
                 lambda ps: wb.clip_grad_norm_(ps, 0.1)):
        with pytest.raises(RuntimeError, match=REFUSE):
            clip(list(z.m.parameters()))
    close(z.opt.clip_grad_norm_(0.1), nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
    with pytest.raises(RuntimeError, match=REFUSE):       # now in the optimizer's shards
        z.m[0].weight.grad
    z.opt.step()
    ro.step()
    assert_same_model(type("W", (), {"m": z.m})(), ref)
    assert all(p.grad is None for p in z.m.parameters())     # step() frees them


@pytest.mark.parametrize("layout", ["zero1_tp", "zero1_dp"])
@pytest.mark.parametrize("write", ["mul_", "clamp_", "none"])
def test_in_place_writes_to_the_grad_reach_the_step(layout, write):
    """ZeRO-1's ``Partial("sum")`` gradient takes a user's writes before the step as one
    device's: ``p.grad.mul_(0.5)`` (linear: each share scaled), ``p.grad.clamp_(-0.05,
    0.05)`` (not linear: reduced, then written back as one share), ``p.grad = None`` on
    one parameter (not stepped); two steps, then the model is one device's."""
    ref, z, ro = setup(layout)
    ops = {"mul_": lambda g: g.mul_(0.5), "clamp_": lambda g: g.clamp_(-0.05, 0.05)}
    for x, y in batches(2):
        z.opt.zero_grad()
        ro.zero_grad()
        z.backward(x, y)
        ref_backward(ref, x, y)
        with torch.no_grad():
            if write == "none":
                z.m[2].bias.grad = None
                ref[2].bias.grad = None
            else:
                for p, q in zip(z.m.parameters(), ref.parameters()):
                    ops[write](p.grad)
                    ops[write](q.grad)
                    close(p.grad.full(), q.grad)
        z.opt.step()
        ro.step()
    assert_same_model(type("W", (), {"m": z.m})(), ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_steps_communication_is_unchanged_by_the_reads(layout):
    """The step's collectives (one reduce-scatter of the gradients, ZeRO-2's in backward,
    one all-gather of the parameters, per dp group) are the same whether the user read ``p.grad`` before it or
    not; a read's reduction is its own all-reduce, recorded where it runs."""
    def step_trace(read):
        _, z, _ = setup(layout)
        z.backward(*batches(1)[0])
        if read and z.stage == 1:
            with wb.trace() as tr:
                float(z.m[0].weight.grad.full().norm())
            assert tr.counts()["all_reduce"] >= 1        # the shares summed over dp
        with wb.trace() as tr:
            z.opt.step()
        return tr.counts(), tr.total_bytes()
    plain, read = step_trace(False), step_trace(True)
    assert read == plain
    groups = 2 if layout.endswith("tp") else 1
    if layout.startswith("zero1"):
        assert plain[0] == {"reduce_scatter": groups, "all_gather": groups}
    else:       # ZeRO-2's reduce-scatters ran in backward, before the step's trace
        assert plain[0] == {"all_gather": groups}


# ---- the other data-parallel wrappers over tensor parallelism: guards --------------------
@pytest.mark.parametrize("kind,how", [(k, "plain") for k in ("ddp_tp", "fsdp_tp",
                                                              "fully_shard_tp", "zero3_tp")] +
                         [("ddp_tp", "no_sync"), ("fully_shard_tp", "no_sync")])
def test_other_wrappers_grad_reads_before_step_are_one_devices(kind, how):
    """DDP / FSDP / fully_shard / Zero3 over tp, two micro-batches: the module's ``p.grad``
    after each backward is one device's accumulated gradient (norm and sum), or None
    inside fully_shard's ``set_requires_gradient_sync(False)`` (FSDP2's); DDP inside
    ``no_sync()`` was dp rank 0's share (norm 0.2533 for 0.3791), now ``Partial("sum")``.
    FSDP / Zero3 have no ``no_sync`` over DistTensors (habits15)."""
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    for k, (x, y) in enumerate(batches(2)):
        if k == 0 and how == "no_sync":
            with wr.no_sync():
                wr.backward(x, y)
        else:
            wr.backward(x, y)
        ref_backward(ref, x, y)
        for p, q in zip(wr.m.parameters(), ref.parameters()):
            g = p.grad
            if k == 0 and how == "no_sync" and kind == "fully_shard_tp":
                assert g is None
                continue
            close(num(g.norm()), q.grad.norm())
            close(num(g.sum()), q.grad.sum())


# ---- the hybrid recipe: sequence parallelism's partial norm gradients too ----------------
@pytest.mark.parametrize("zero", [0, 1])
def test_hybrid_sp_grad_reads_before_the_sum_are_what_the_step_applies(zero):
    """``Hybrid(dp=2, tp=2, sp=True)`` on ``tiny``, after ``forward_backward``: every
    parameter's ``p.grad.full()`` read before the gradients are summed is the summed one
    (``DataParallel(zero=0)``: what ``finish_gradient_synchronization()`` leaves, the norm
    weights Partial over dp and tp, their partial sums over the sequence shards; ZeRO-1:
    the total norm is ``opt.clip_grad_norm_``'s).  Before: every one of the 21 read dp
    rank 0's share (and the norm weights tp rank 0's), the norm weight's 0.0104 for 0.0195,
    ZeRO-1's total 1.1736 for 1.7652."""
    from workbench.models.config import get_config
    from workbench.recipes.hybrid import Hybrid
    cfg = get_config("tiny")
    st = Hybrid(dp=2, tp=2, sp=True, zero=zero)
    model = st.build_model(cfg, 0)
    (opt,) = st.build_optimizer(model, 1e-3, 0.0)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (4, 16), generator=g) for _ in range(2))
    st.forward_backward(model, x, y)
    sp = {id(p) for ps in st._sp_norms.values() for p in ps}
    assert sp
    before = {}
    for name, p in model.named_parameters():
        gr = p.grad
        want = [wb.Partial("sum")] * 2 if id(p) in sp else [wb.Partial("sum")]
        assert list(gr.placements[:len(want)]) == want, name
        before[name] = gr.full().clone()
    if zero == 0:
        opt.finish_gradient_synchronization()
        for name, p in model.named_parameters():
            assert p.grad.placements[0] == wb.Replicate()
            close(before[name], p.grad.full())
    else:
        close(torch.linalg.vector_norm(torch.stack([v.norm() for v in before.values()])),
              opt.clip_grad_norm_(1e9))


@pytest.mark.parametrize("zero", [0, 1])
def test_context_parallel_grad_reads_before_the_sum_are_one_devices(zero):
    """``ContextParallel(cp=2, dp=2)`` (replicas on dp and cp, summed over both by one
    collective: ``flat_dims``), after ``forward_backward``: every ``p.grad.full()`` is
    one device's gradient, Partial over dp and cp.  Before: 12 of 12 read one rank's
    share (``tok_emb.weight`` off by 0.10)."""
    from workbench.models.config import build_model, get_config
    from workbench.models.data import get_batch
    from workbench.recipes.context_parallel import ContextParallel
    cfg = get_config("tiny", seq_len=16, n_layer=1, d_model=32, n_head=4, d_ff=64)
    ref = build_model(cfg, seed=0).train()
    x, y = get_batch(cfg, 4, 0, 0)
    ref(x, y)[1].backward()
    want = dict(ref.named_parameters())
    st = ContextParallel(cp=2, dp=2, zero=zero)
    model = st.build_model(cfg, 0)
    st.build_optimizer(model, 1e-2, 0.1)
    st.forward_backward(model, x, y)
    for name, p in wb.dist_parameters(model):
        g = p.grad
        assert list(g.placements) == [wb.Partial("sum")] * 2, name
        close(g.full(), want[name].grad)


# ---- ZeRO-1/2 over tensor parallelism under torch.distributed (gloo, 2 x 2) -------------------
@pytest.mark.slow
def test_zero_over_tp_grad_reads_on_gloo_are_one_devices(tmp_path_factory):
    """tests/dist_scripts/zero1tp_check.py (a part of the shared 4-process launch): after
    one backward, ZeRO-1's ``p.grad`` is ``Partial("sum")`` over dp, its ``full().norm()``
    / ``norm()`` / ``sum()`` / ``full().abs().max()`` one device's on every process,
    torch's clip refuses naming the optimizer's, and the step is one device's.  Before:
    ``Replicate``, ``full().norm()`` [0.2533, 0.1381, 0.2643, 0.2584] for [0.3791, 0.2095,
    0.4240, 0.4444], different on each process.  ZeRO-2's ``p.grad`` refuses as on
    simulated ranks, where backward reduce-scattered it (gloo's calls block, so there the
    gradient waits for step's reduce-scatter; it read exactly there, and raised here:
    readsync made the two one program), and the step is one device's."""
    from tests.torchrun_support import json_rows, tp_2x2
    out, text = tp_2x2(tmp_path_factory, "zero1tp_check.py")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["case"]: r for r in json_rows(text)}
    assert len(rows) == 14
    for stage in ("zero1", "zero2"):
        assert "opt.clip_grad_norm_(max_norm)" in rows[f"{stage}_clip"]["wb"]
        reads = ("full_norm", "norm", "sum", "full_abs_max") if stage == "zero1" else ()
        for c in reads + ("after_step",):
            r = rows[f"{stage}_{c}"]
            assert r["same"], r                 # every process read the same
            assert r["wb"] == pytest.approx(r["one"], abs=1e-5), r
    assert all(pl.startswith("(Partial(reduce_op='sum'), ")
               for pl in rows["zero1_placements"]["wb"])
    for c in ("placements", "full_norm", "norm", "sum", "full_abs_max"):
        r = rows[f"zero2_{c}"]
        assert r["same"] and all("already reduce-scattered" in v and "opt.grad_norm()" in v
                                 for v in r["wb"]), r
