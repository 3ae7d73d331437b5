"""gradscaler: ``torch.amp.GradScaler`` on ``ZeroRedundancyOptimizer(partition="chunks")``,
a user's ordinary AMP loop, unchanged::

    scaler.scale(loss).backward(); scaler.unscale_(opt); norm = opt.clip_grad_norm_(c)
    scaler.step(opt); scaler.update()

held to one device's loop (the unscaled norm, the step, a skipped step on an inf, the
scale) on ZeRO-1 and ZeRO-2 over dp 4 and dp 2 x tp 2, and on the hybrid recipe's ZeRO-1/2
with sequence parallelism's partial norm gradients.

Found (each failed before): ZeRO-1 sums the gradients inside ``step``, so ``unscale_`` (which
unscales the gradients of ``opt.param_groups``: the optimizer's shards) found none and
unscaled nothing; ``opt.clip_grad_norm_`` then returned the SCALED norm (0.7516 x 1024 at
scale 2**10), silently, and ``scaler.step`` raised torch's "No inf checks were recorded for
this optimizer".  ZeRO-2 reduces in backward, but not sequence parallelism's partial norm
gradients (summed at step): those were left scaled (the hybrid recipe's norm weights).
Now a shard's ``.grad`` read reduces what is pending first
(``zero_optimizer_dist.ShardParameter``): one reduce-scatter per step, as before.  Under
torchrun with torch's ShardedGradScaler: tests/test_readsync.py (one launch for both).
"""
import pytest
import torch
from torch import nn

import workbench as wb

from .test_habits11 import close
from .test_habits15 import batches
from .test_habits18 import sgd_pair
from .test_zero1tp import setup

SCALE = 2.0 ** 10


def _data(n=3):
    data = batches(n)
    data[1] = (data[1][0].clone(), data[1][1])
    data[1][0][3, 1] = float("inf")          # the second step's loss is not finite
    return data


def _ref_step(ref, ro, sc, x, y, max_norm):
    ro.zero_grad()
    sc.scale(((ref(x) - y) ** 2).mean()).backward()
    sc.unscale_(ro)
    norm = nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    sc.step(ro)
    sc.update()
    return norm


def _same_norm(got, want):
    if torch.isfinite(want):
        close(got, want)
    else:
        assert not torch.isfinite(got)


@pytest.mark.parametrize("layout", ["zero1_dp", "zero2_dp", "zero1_tp", "zero2_tp"])
def test_the_amp_loop_is_one_devices(layout):
    """AdamW, clip at 0.1 (it clips), three steps, the second with an inf: the unscaled
    norms, the skipped step, the scale (2**10 -> 2**9) and the weights are one device's."""
    ref, z, ro = setup(layout)
    rsc, wsc = (torch.amp.GradScaler("cpu", init_scale=SCALE) for _ in range(2))
    for x, y in _data():
        want = _ref_step(ref, ro, rsc, x, y, 0.1)
        z.opt.zero_grad()
        out = z.m(z.inp(x))
        out = out.full() if isinstance(out, wb.DistTensor) else out
        wsc.scale(((out - y) ** 2).mean()).backward()
        wsc.unscale_(z.opt)
        _same_norm(z.opt.clip_grad_norm_(0.1), want)
        wsc.step(z.opt)
        wsc.update()
        assert wsc.get_scale() == rsc.get_scale()
        for p, q in zip(z.m.parameters(), ref.parameters()):
            close(p.full() if isinstance(p, wb.DistTensor) else p, q)
    assert wsc.get_scale() == SCALE / 2


@pytest.mark.parametrize("kind", ["zero_tp", "zero2_tp"])
def test_unscale_then_the_norm_is_not_the_scaled_one(kind):
    """The found defect in one figure: after ``unscale_`` the optimizer's norm is the
    unscaled gradient's (0.7516 here), not 1024x it (769.64)."""
    ref, wr, ro, opt = sgd_pair(kind)
    x, y = batches(1)[0]
    sc = torch.amp.GradScaler("cpu", init_scale=SCALE)
    sc.scale(((wr.out(x) - y) ** 2).mean()).backward()
    sc.unscale_(opt)
    got = opt.grad_norm()
    ((ref(x) - y) ** 2).mean().backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    close(got, want)
    assert float(got) < 1.0 < float(want) * SCALE / 2


@pytest.mark.parametrize("kind", ["zero_tp", "zero2_tp"])
def test_the_steps_communication_is_unchanged_by_the_scaler(kind):
    """From backward to the step's end, the same collectives and bytes with the scaler's
    ``unscale_`` before the clip as without a scaler: the read reduces what step() would
    have (ZeRO-1: one reduce-scatter per dp group), step() then reduces nothing more."""
    got = []
    for enabled in (False, True):
        _, wr, _, opt = sgd_pair(kind)
        x, y = batches(1)[0]
        sc = torch.amp.GradScaler("cpu", init_scale=SCALE, enabled=enabled)
        with wb.trace() as tr:
            sc.scale(((wr.out(x) - y) ** 2).mean()).backward()
            sc.unscale_(opt)
            opt.clip_grad_norm_(1.0)
            sc.step(opt)
            sc.update()
        got.append((tr.counts(), tr.total_bytes()))
    assert got[0] == got[1]
    assert got[1][0]["reduce_scatter"] >= 2        # (ZeRO-2's in backward, per parameter)


@pytest.mark.parametrize("zero", [1, 2])
def test_hybrid_sp_norm_gradients_are_unscaled_too(zero):
    """``Hybrid(dp=2, tp=2, sp=True, zero=k)`` on ``tiny``, its loss scaled by the user:
    ``scaler.unscale_`` of its ZeRO optimizer then the recipe's clip gives the norm of the
    same step without a scaler, the norm weights (sequence parallelism's partial gradients,
    which ZeRO-2's backward hooks leave for step) included."""
    from workbench.models.config import get_config
    from workbench.recipes.hybrid import Hybrid
    cfg = get_config("tiny")
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (4, 16), generator=g) for _ in range(2))
    norms = []
    for enabled in (False, True):
        st = Hybrid(dp=2, tp=2, sp=True, zero=zero)
        model = st.build_model(cfg, 0)
        (opt,) = st.build_optimizer(model, 1e-3, 0.0)
        assert st._sp_norms
        mesh = st.meshes[0]
        loss = st._loss(st._stage(model, 0, st._batch(x, mesh)), st._batch(y, mesh))
        sc = torch.amp.GradScaler("cpu", init_scale=SCALE, enabled=enabled)
        sc.scale(loss.full()).backward()    # (a DistTensor: GradScaler.scale iterates it)
        sc.unscale_(opt.optimizer)
        norms.append(opt.clip_grad_norm_(1e9))
    close(norms[1], norms[0])


def test_scaling_a_disttensor_loss_names_the_fix():
    """``scaler.scale(loss)`` with a DistTensor loss: torch's GradScaler multiplies only
    torch.Tensors and iterates the rest ("iteration over a 0-d tensor", naming nothing);
    now the error names ``scaler.scale(loss.full())``, whose gradients are one device's."""
    ref, wr, ro, opt = sgd_pair("zero_tp")
    x, y = batches(1)[0]
    sc = torch.amp.GradScaler("cpu", init_scale=SCALE)
    out = wr.m(wr.inp(x))
    assert isinstance(out, wb.DistTensor)
    loss = ((out - wb.distribute_tensor(y, out.mesh, out.placements)) ** 2).mean()
    assert isinstance(loss, wb.DistTensor) and loss.ndim == 0
    with pytest.raises(TypeError, match=r"scaler\.scale\(loss\.full\(\)\)"):
        sc.scale(loss)
    sc.scale(loss.full()).backward()
    sc.unscale_(opt)
    got = opt.grad_norm()
    ((ref(x) - y) ** 2).mean().backward()
    close(got, torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()])))


def test_the_optimizer_and_its_shards_still_save_and_copy():
    """The shards (now ``ShardParameter``, holding a weak link to their optimizer) save
    with ``torch.save`` and load as the plain parameters they are; ``copy.deepcopy`` too."""
    import copy
    import io
    _, wr, _, opt = sgd_pair("zero_tp")
    for obj in (opt.shards[0], opt.optimizer):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=False)
        copy.deepcopy(obj)
    assert type(back).__name__ == type(opt.optimizer).__name__
    torch.testing.assert_close(back.param_groups[0]["params"][0].detach(),
                               opt.shards[0].detach())
