"""A PyTorch user's habits on the wrappers, round 15 (habits15): a user's ordinary loop on
composed wrappers, each held to one device's plain PyTorch (or a raise naming the fix).

The sweep: {DDP, FSDP, fully_shard, DDP + ZeroRedundancyOptimizer} on 4 simulated dp
ranks and {DDP, FSDP, fully_shard, ZeroRedundancyOptimizer(partition="chunks") (ZeRO-1, and
ZeRO-2 with ``overlap_comm``), Zero3} over tensor parallelism on 2 x 2, times the habits: ``zero_grad`` (both
``set_to_none``), ``clip_grad_norm_``, gradient accumulation (plain, ``no_sync`` /
``set_requires_gradient_sync(False)``), ``state_dict`` -> ``torch.save`` -> ``load_state_dict``
into a fresh model, the optimizer's ``state_dict`` round trip, in-place init, freezing a
parameter with ``requires_grad_(False)``, ``train()`` / ``eval()`` (a Dropout).

Found and fixed (each test failed before):

1. ``model.zero_grad(set_to_none=False)`` on ``fully_shard`` over tensor parallelism
   raised torch's "Can't detach views in-place" (the module's loop detached the shards'
   gradients in place, torch detaches only a gradient with history);
2. ``FullyShardedDataParallel`` and ``Zero3`` over tensor parallelism on simulated ranks:
   ``p.numel()`` / ``p.mean()`` / ``p.grad.mean()`` / ``p.grad.abs().min()`` read the flat
   chunks' storage with its padding (``sum(p.numel())`` 52 for 45, ``abs().min()`` 0), as
   ``fully_shard``'s did before habits14: now the module's.

``fully_shard``'s ``set_requires_gradient_sync(False)`` (plain and over tensor
parallelism): ``p.grad`` stays None between the micro-batches, as FSDP2's sharded ``.grad``
(torch 2.13 ``_fsdp_param_group.py`` ``post_backward``: without ``reduce_grads`` it only
reshards and keeps the unsharded gradient in ``unsharded_param.grad`` /
``unsharded_accumulated_grad``, off ``model.parameters()``); after the syncing backward it
is one device's accumulated gradient (a guard: it passed before).

Under torch.distributed (gloo, 2 x 2), ``DistributedDataParallel`` over tensor parallelism:
a user's ``p`` / ``p.grad`` reads were this process's tensor-parallel shard ``(1, 1, 3, 3)``
(measured, ``Linear(3, 6), GELU, Linear(6, 3)``: ``numel`` [9, 3, 9, 3] for [18, 6, 18,
3], ``shape`` [1, 1, 3, 3], ``dim`` 4, the weight's ``p.sum()`` -0.2671 for -0.9782,
``p.grad.sum()`` 0.4200 for 0.2003, ``p[0]`` a storage row), and ``p.grad.norm()`` /
``clip_grad_norm_`` raised: now the module's, gathered over tp, as on simulated ranks
(habits13, habits14); a view raises naming the copy to take it of.
"""
import copy
import io

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.strategies.zero3 import Zero3

from .test_habits11 import close

PLAIN = ["ddp", "fsdp", "fully_shard", "zero"]
OVER_TP = ["ddp_tp", "fsdp_tp", "fully_shard_tp", "zero_tp", "zero2_tp", "zero3_tp"]
KINDS = PLAIN + OVER_TP
TP_PLAN = {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()}


def mk(seed=0):
    """45 parameters; on 2 dp ranks over 2 tp ranks every local weight's chunks are padded."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3), nn.Dropout(0.5))


class Wrapped:
    """One composed wrapper as a user holds it: ``w`` (what they call), ``m`` (their
    module), ``params()`` (what their optimizer takes), ``optimizer()``, ``inp(x)``."""

    def __init__(self, kind, m=None):
        m = mk() if m is None else m
        self.kind, self.m = kind, m
        if kind in OVER_TP:
            self.mesh = mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
            wb.parallelize_module(m, mesh, TP_PLAN)
            if kind != "fully_shard_tp":
                wb.parallelize(m, mesh)
        else:
            self.mesh = mesh = wb.Mesh.grid(4, ["dp"])
        self.w = {
            "ddp": lambda: wb.DistributedDataParallel(m, mesh),
            "zero": lambda: wb.DistributedDataParallel(m, mesh),
            "fsdp": lambda: wb.FullyShardedDataParallel(m, mesh),
            "fully_shard": lambda: (wb.fully_shard(m[0], mesh=mesh),
                                    wb.fully_shard(m, mesh=mesh))[1],
            "ddp_tp": lambda: wb.DistributedDataParallel(m, mesh, dim="dp"),
            "fsdp_tp": lambda: wb.FullyShardedDataParallel(m, mesh, "dp"),
            "fully_shard_tp": lambda: wb.fully_shard(m, mesh=mesh["dp"]),
            "zero_tp": lambda: m,
            "zero2_tp": lambda: m,
            "zero3_tp": lambda: Zero3(m, mesh, "dp"),
        }[kind]()

    def params(self):
        if self.kind in ("zero_tp", "zero2_tp"):
            return [p for _, p in wb.dist_parameters(self.m)]
        return list(self.w.parameters())

    def optimizer(self, params=None, cls=torch.optim.AdamW, **kw):
        """``cls(params, lr=1e-2, **kw)`` as this wrapper's user builds it (AdamW unless
        told)."""
        params = self.params() if params is None else params
        kw = {"lr": 1e-2, **kw}
        if self.kind == "zero":
            return wb.ZeroRedundancyOptimizer(params, cls, self.mesh, **kw)
        if self.kind in ("zero_tp", "zero2_tp"):       # ZeRO-1, ZeRO-2 (overlap_comm)
            return wb.ZeroRedundancyOptimizer(params, cls, self.mesh, "dp",
                                              partition="chunks",
                                              overlap_comm=self.kind == "zero2_tp", **kw)
        return cls(params, **kw)

    def inp(self, x):
        if self.kind in OVER_TP:
            return wb.shard_tensor(x, self.mesh, [wb.Shard(0), wb.Replicate()])
        return x

    def out(self, x):
        o = self.w(self.inp(x))
        return o.full() if isinstance(o, wb.DistTensor) else o

    def backward(self, x, y):
        ((self.out(x) - y) ** 2).mean().backward()

    def no_sync(self):
        """DDP's / FSDP's ``no_sync()``, fully_shard's ``set_requires_gradient_sync``."""
        w = self.w
        if not hasattr(w, "set_requires_gradient_sync"):
            return w.no_sync()

        class _Off:
            def __enter__(self):
                w.set_requires_gradient_sync(False)

            def __exit__(self, *exc):
                w.set_requires_gradient_sync(True)
        return _Off()


def batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def ref_backward(ref, x, y):
    ((ref(x) - y) ** 2).mean().backward()


def full_state(sd) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, wb.DistTensor):
            v = v.full()
        elif type(v) is not torch.Tensor and hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k.removeprefix("module.")] = v.detach().clone()
    return out


def assert_same_model(wr, ref):
    got, want = full_state(wr.m.state_dict()), ref.state_dict()
    assert list(got) == list(want)
    for k in want:
        close(got[k], want[k])


def pair(kind):
    """(one device's model, its wrapped copy, their optimizers), in eval mode (Dropout off)."""
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    return ref, wr, torch.optim.AdamW(ref.parameters(), lr=1e-2), wr.optimizer()


def clip_as_one_device(wr, opt, ref, max_norm=0.1):
    """torch's clip_grad_norm_ over the wrapped parameters: one device's total norm, or
    (ZeRO-1/2 over DistTensors, whose gradients are reduce-scattered inside step()) a raise
    naming the optimizer's own clip, which gives it."""
    want = nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    if wr.kind in ("zero_tp", "zero2_tp"):
        with pytest.raises(RuntimeError, match=r"inside step\(\).*opt\.clip_grad_norm_"):
            nn.utils.clip_grad_norm_(wr.params(), max_norm)
        close(opt.clip_grad_norm_(max_norm), want)
    else:
        close(nn.utils.clip_grad_norm_(wr.params(), max_norm), want)


def clip_step_and_compare(wr, opt, ref, ro):
    """The step's end as a user writes it (clip, both optimizers' steps), then the
    wrapped model held to the reference."""
    clip_as_one_device(wr, opt, ref, 1e9)
    opt.step()
    ro.step()
    assert_same_model(wr, ref)


# ---- the sweep ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("who", ["optimizer", "module"])
def test_zero_grad_then_train_is_one_devices(kind, set_to_none, who):
    """``zero_grad`` (the optimizer's or the module's, either ``set_to_none``): None or
    zeros as torch's, and three clipped AdamW steps as one device's.  Before: the module's
    ``zero_grad(set_to_none=False)`` on fully_shard over tensor parallelism raised
    "Can't detach views in-place"."""
    ref, wr, ro, opt = pair(kind)
    for i, (x, y) in enumerate(batches(3)):
        for z in ((ro, opt) if who == "optimizer" else (ref, wr.m)):
            z.zero_grad(set_to_none=set_to_none)
        for p, q in zip(wr.params(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None
            elif p.grad is not None:        # ZeRO-1/2 over DistTensors: step() frees them
                assert float(p.grad.detach().abs().sum()) == 0.0
        wr.backward(x, y)
        ref_backward(ref, x, y)
        clip_as_one_device(wr, opt, ref)
        opt.step()
        ro.step()
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["plain", "no_sync"])
def test_gradient_accumulation_is_one_devices(kind, how):
    """Two micro-batches a step (the first in ``no_sync()`` /
    ``set_requires_gradient_sync(False)``, or both plain), two steps: the accumulated
    gradient's norm and the trained weights are one device's.  ``no_sync`` on FSDP /
    Zero3 over DistTensors raises naming the plain loop; ZeRO-1/2 has no ``no_sync``."""
    ref, wr, ro, opt = pair(kind)
    data = batches(4)
    for s in range(2):
        opt.zero_grad()
        ro.zero_grad()
        (x1, y1), (x2, y2) = data[2 * s], data[2 * s + 1]
        if how == "no_sync" and kind in ("fsdp_tp", "zero3_tp"):
            with pytest.raises(NotImplementedError, match=r"accumulate over micro-batches "
                               r"without it"):
                with wr.no_sync():
                    pass
            return
        if how == "no_sync" and kind in ("zero_tp", "zero2_tp"):
            assert not hasattr(wr.w, "no_sync")
            return
        if how == "no_sync":
            with wr.no_sync():
                wr.backward(x1, y1)
            if kind.startswith("fully_shard"):      # FSDP2's sharded .grad: untouched
                assert all(p.grad is None for p in wr.params())
        else:
            wr.backward(x1, y1)
        ref_backward(ref, x1, y1)
        wr.backward(x2, y2)
        ref_backward(ref, x2, y2)
        clip_step_and_compare(wr, opt, ref, ro)


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_saved_and_loaded_into_a_fresh_model_is_one_devices(kind):
    """``torch.save(model.state_dict())`` after a step, ``torch.load`` and
    ``load_state_dict`` into a fresh wrapped model of other weights: its weights and
    forward are the trained ones; the plain module takes the saved values too."""
    ref, wr, ro, opt = pair(kind)
    (x, y), _, (x3, _) = batches(3)
    wr.backward(x, y)
    ref_backward(ref, x, y)
    opt.step()
    ro.step()
    buf = io.BytesIO()
    torch.save(wr.w.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    fresh = Wrapped(kind, mk(seed=5))
    fresh.w.eval()
    fresh.w.load_state_dict(sd)
    assert_same_model(fresh, ref)
    with torch.no_grad():
        close(fresh.out(x3), ref(x3))
    plain = mk(seed=5)
    plain.load_state_dict(full_state(wr.m.state_dict()))
    for a, b in zip(plain.parameters(), ref.parameters()):
        close(a.detach(), b.detach())


@pytest.mark.parametrize("kind", KINDS)
def test_optimizer_state_dict_round_trip_trains_on_as_one_device(kind):
    """After a step, the model's and the optimizer's state dicts loaded into a fresh
    wrapped model and optimizer: the next step is one device's second step."""
    ref, wr, ro, opt = pair(kind)
    data = batches(2)
    wr.backward(*data[0])
    ref_backward(ref, *data[0])
    opt.step()
    ro.step()
    resumed_step_is_one_devices(kind, wr, opt, ref, ro, data[1])


def resumed_step_is_one_devices(kind, wr, opt, ref, ro, batch):
    """``wr``'s model and optimizer state dicts (after a step) loaded into a fresh wrapped
    model and optimizer: its step on ``batch`` is one device's (``ref`` / ``ro``) next."""
    msd, osd = copy.deepcopy(wr.w.state_dict()), copy.deepcopy(opt.state_dict())
    fresh = Wrapped(kind, mk(seed=5))
    fresh.w.eval()
    fresh.w.load_state_dict(msd)
    opt2 = fresh.optimizer()
    opt2.load_state_dict(osd)
    ro.zero_grad()
    fresh.backward(*batch)
    ref_backward(ref, *batch)
    opt2.step()
    ro.step()
    assert_same_model(fresh, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_in_place_init_after_wrapping_is_one_devices_or_raises(kind):
    """``nn.init.constant_`` / ``zeros_`` on the module's attributes, ``p.data.mul_`` and
    ``p.mul_`` over the optimizer's parameters: one device's forward and step.  FSDP /
    Zero3 over DistTensors refuse a write to the module's attribute (a template), naming
    load_state_dict; the optimizer's parameters take it."""
    ref, wr, ro, opt = pair(kind)
    x, y = batches(1)[0]

    def module_init(m):
        m[0].weight.mul_(0.5)
        nn.init.constant_(m[2].bias, 0.1)
        nn.init.zeros_(m[0].bias)
        m[2].weight.data.mul_(2.0)
    with torch.no_grad():
        module_init(ref)
        if kind in ("fsdp_tp", "zero3_tp"):
            with pytest.raises(RuntimeError, match=r"template.*load_state_dict"):
                module_init(wr.m)
            wr.w.load_state_dict(ref.state_dict())
        else:
            module_init(wr.m)
        for p in wr.params():
            p.mul_(0.5)
        for q in ref.parameters():
            q.mul_(0.5)
        close(wr.out(x), ref(x))
    wr.backward(x, y)
    ref_backward(ref, x, y)
    opt.step()
    ro.step()
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("when", ["before_optimizer", "after_optimizer"])
def test_a_frozen_parameter_stays_and_the_rest_trains_as_one_device(kind, when):
    """``model[0].bias.requires_grad_(False)``: its wrapped parameter is frozen (no
    gradient, not stepped); the others train as one device."""
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    opts = []
    if when == "after_optimizer":
        opts = [torch.optim.AdamW(ref.parameters(), lr=1e-2), wr.optimizer()]
    ref[0].bias.requires_grad_(False)
    wr.m[0].bias.requires_grad_(False)
    assert [p.requires_grad for p in wr.params()] == [True, False, True, True]
    if when == "before_optimizer":
        opts = [torch.optim.AdamW([q for q in ref.parameters() if q.requires_grad], lr=1e-2),
                wr.optimizer([p for p in wr.params() if p.requires_grad])]
    x, y = batches(1)[0]
    wr.backward(x, y)
    ref_backward(ref, x, y)
    assert wr.params()[1].grad is None
    for o in opts:
        o.step()
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_train_and_eval_reach_every_module(kind):
    """``eval()`` on the wrapper turns the Dropout off (one device's output), ``train()``
    on again; ``eval()`` on the user's own module too."""
    ref, wr = mk(), Wrapped(kind)
    x = batches(1)[0][0]
    ref.eval()
    wr.w.eval()
    assert not any(m.training for m in wr.m.modules())
    with torch.no_grad():
        close(wr.out(x), ref(x))
    wr.w.train()
    assert all(m.training for m in wr.m.modules())
    wr.m.eval()
    assert not any(m.training for m in wr.m.modules())
    with torch.no_grad():
        close(wr.out(x), ref(x))


# ---- reads of FSDP / Zero3 over tensor parallelism (simulated ranks) ---------------------
READS = {
    "numel": lambda t: t.numel(), "shape": lambda t: tuple(t.shape), "dim": lambda t: t.dim(),
    "sum": lambda t: t.sum(), "mean": lambda t: t.mean(), "abs_min": lambda t: t.abs().min(),
    "std": lambda t: t.std(), "norm_0": lambda t: torch.linalg.vector_norm(t, 0),
}


@pytest.mark.parametrize("kind", ["fsdp_tp", "zero3_tp", "fully_shard_tp"])
@pytest.mark.parametrize("read", list(READS))
def test_fsdp_over_tp_parameter_and_gradient_reads_are_one_devices(kind, read):
    """Before (FSDP / Zero3 over 2 x 2, simulated): the flat chunks' storage, padding
    included: ``sum(p.numel())`` 52 for 45, ``shape`` (2, 2, 5), the weight's ``p.mean()``
    -0.0489 for -0.0543, ``p.grad.abs().min()`` 0 (fully_shard's: a guard, habits14)."""
    ref, wr, _, _ = pair(kind)
    x, y = batches(1)[0]
    wr.backward(x, y)
    ref_backward(ref, x, y)
    if read == "numel":
        assert sum(p.numel() for p in wr.params()) == 45
    for p, q in zip(wr.params(), ref.parameters()):
        for a, b in ((p, q), (p.grad, q.grad)):
            with torch.no_grad():
                got, want = READS[read](a), READS[read](b)
            if isinstance(want, torch.Tensor):
                close(got, want)
            else:
                assert got == want


# ---- DDP over tensor parallelism under torch.distributed (gloo, 2 x 2) ---------------------
@pytest.mark.slow
def test_ddp_over_tp_reads_on_gloo_are_one_devices(tmp_path_factory):
    """tests/dist_scripts/habits15_check.py (a part of the shared 4-process launch): every
    read of the parameters and of their gradients after one backward, the clipped total
    norm and a user's loop (``loop``: its clip norms and the weights after a state dict
    round trip) are one device's; ``p[0]`` / ``p.grad[0]`` raise naming the copy.  Before:
    this process's shard's (numel [9, 3, 9, 3] for [18, 6, 18, 3], p.sum() -0.2671 for
    -0.9782 ...), the gradient norms raised."""
    from tests.torchrun_support import json_rows, tp_2x2
    from .test_habits13 import _flat
    out, text = tp_2x2(tmp_path_factory, "habits15_check.py")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["case"]: r for r in json_rows(text)}
    assert rows["p_numel"]["wb"] == rows["g_numel"]["wb"] == [18, 6, 18, 3]
    assert rows["p_shape"]["wb"] == [[6, 3], [6], [3, 6], [3]]
    assert "p.grad.full_tensor()" in rows["g_row"]["wb"]
    assert "model.<name>.full()" in rows["p_row"]["wb"]
    assert len(rows) == 34          # 33 reads, and a user's loop (zero_grad(False), torch's
    #                                 clip, two AdamW steps, the state dict round trip)
    for c, r in rows.items():
        if c in ("p_row", "g_row"):
            continue
        one, mine = _flat(r["one"]), _flat(r["wb"])
        assert all(isinstance(v, (int, float)) for v in mine), r      # no error text
        assert mine == pytest.approx(one, abs=1e-5), r
