"""A PyTorch user's habits on the wrappers, round 18 (habits18): more of a user's ordinary
loop on habits15's sweep, each held to one device's plain PyTorch (or a raise naming the fix).
"""
import copy
import io

import pytest
import torch
from torch import nn

import workbench as wb

from .test_habits11 import close
from .test_habits15 import (KINDS, Wrapped, assert_same_model, batches, clip_as_one_device,
                            full_state, mk, pair, ref_backward)

SGD = torch.optim.SGD


def sgd_pair(kind, lr=1.0, **kw):
    """habits15's pair with SGD (lr 1: the weights move by the gradient itself, so a wrong
    gradient shows in the weights, which Adam's normalized first step would hide)."""
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    return ref, wr, SGD(ref.parameters(), lr=lr, **kw), wr.optimizer(cls=SGD, lr=lr, **kw)


def train_step(wr, opt, ref, ro, x, y):
    opt.zero_grad()
    ro.zero_grad()
    wr.backward(x, y)
    ref_backward(ref, x, y)
    opt.step()
    ro.step()


# ---- LR schedulers -------------------------------------------------------------------------
SCHEDS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (e + 1)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=4),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sched", list(SCHEDS))
def test_lr_scheduler_reaches_the_step(kind, sched):
    ref, wr, ro, opt = pair(kind)
    rs, ws = SCHEDS[sched](ro), SCHEDS[sched](opt)
    for x, y in batches(3):
        train_step(wr, opt, ref, ro, x, y)
        rs.step()
        ws.step()
        for a, b in zip(opt.param_groups, ro.param_groups):
            assert a["lr"] == b["lr"] and a["betas"] == b["betas"]
        assert ws.get_last_lr() == rs.get_last_lr()
    assert_same_model(wr, ref)


# ---- torch.amp -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_autocast_bf16_forward_and_backward(kind):
    ref, wr, ro, opt = sgd_pair(kind)
    x, y = batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, r = wr.out(x), ref(x)
    assert o.dtype == r.dtype == torch.bfloat16
    torch.testing.assert_close(o, r, rtol=2e-2, atol=2e-2)
    ((o.float() - y) ** 2).mean().backward()
    ((r.float() - y) ** 2).mean().backward()
    opt.step()
    ro.step()
    got, want = full_state(wr.m.state_dict()), ref.state_dict()
    for k in want:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], want[k], rtol=2e-2, atol=2e-2)


def _scaled_step(wr, opt, scaler, x, y, clip):
    loss = ((wr.out(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    clip()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaler_unscale_clip_step_update(kind):
    ref, wr, ro, opt = sgd_pair(kind, lr=0.5, momentum=0.9)
    rsc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    wsc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    data = batches(3)
    data[1] = (data[1][0].clone(), data[1][1])
    data[1][0][3, 1] = float("inf")          # an overflow: that step is skipped, scale halves
    for x, y in data:
        ro.zero_grad()
        opt.zero_grad()
        rsc_loss = ((ref(x) - y) ** 2).mean()
        rsc.scale(rsc_loss).backward()
        rsc.unscale_(ro)
        want = nn.utils.clip_grad_norm_(ref.parameters(), 0.1)

        def clip():
            if wr.kind in ("zero_tp", "zero2_tp"):
                got = opt.clip_grad_norm_(0.1)
            else:
                got = nn.utils.clip_grad_norm_(wr.params(), 0.1)
            if torch.isfinite(want):
                close(got, want)
            else:
                assert not torch.isfinite(got)
        _scaled_step(wr, opt, wsc, x, y, clip)
        rsc.step(ro)
        rsc.update()
        assert wsc.get_scale() == rsc.get_scale()
        assert_same_model(wr, ref)
    assert rsc.get_scale() == 2.0 ** 9


# ---- copies and casts after wrapping ---------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_of_the_wrapped_model_as_an_ema(kind):
    ref, wr, ro, opt = pair(kind)
    ema_ref, ema = copy.deepcopy(ref), copy.deepcopy(wr.w)
    data = batches(3)
    for x, y in data[:2]:
        train_step(wr, opt, ref, ro, x, y)
        with torch.no_grad():
            for e, p in zip(ema_ref.parameters(), ref.parameters()):
                e.lerp_(p, 0.25)
            for e, p in zip(ema.parameters(), wr.w.parameters()):
                e.lerp_(p, 0.25)
    x = data[2][0]
    with torch.no_grad():
        o = ema(wr.inp(x))
        o = o.full() if isinstance(o, wb.DistTensor) else o
        close(o, ema_ref(x))
        close(wr.out(x), ref(x))


CASTS = {"double": (lambda m: m.double(), torch.float64),
         "to_bf16": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
         "half": (lambda m: m.half(), torch.float16)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cast", list(CASTS))
def test_a_cast_after_wrapping_is_one_devices(kind, cast):
    ref, wr, ro, opt = sgd_pair(kind, lr=0.1)
    fn, dt = CASTS[cast]
    fn(ref)
    fn(wr.w)
    assert all(p.dtype == dt for p in wr.params())
    x, y = (t.to(dt) for t in batches(1)[0])
    tol = dict(rtol=0, atol=1e-12) if dt == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        o = wr.out(x)
        assert o.dtype == dt
        torch.testing.assert_close(o, ref(x), **tol)
    if dt != torch.float64:
        return
    wr.backward(x, y)
    ref_backward(ref, x, y)
    opt.step()
    ro.step()
    got, want = full_state(wr.m.state_dict()), ref.state_dict()
    for k in want:
        assert got[k].dtype == dt
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_requires_grad_off_then_on_trains_as_one_device(kind):
    ref, wr, ro, opt = pair(kind)
    x, y = batches(1)[0]
    wr.w.requires_grad_(False)
    assert not any(p.requires_grad for p in wr.params())
    assert not any(p.requires_grad for p in wr.m.parameters())
    with torch.no_grad():
        pass
    assert not wr.out(x).requires_grad
    wr.w.requires_grad_(True)
    assert all(p.requires_grad for p in wr.params())
    train_step(wr, opt, ref, ro, x, y)
    assert_same_model(wr, ref)


# ---- hooks, inference ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_forward_hook_that_changes_the_output(kind):
    ref, wr, ro, opt = sgd_pair(kind)
    seen = {}

    def hook(name):
        def h(mod, args, out):
            seen[name] = out
            return out * 2
        return h
    ref[0].register_forward_hook(hook("ref"))
    wr.m[0].register_forward_hook(hook("wr"))
    x, y = batches(1)[0]
    train_step(wr, opt, ref, ro, x, y)
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_a_full_backward_hook_that_scales_the_input_gradient(kind):
    ref, wr, ro, opt = sgd_pair(kind)
    seen = {}

    def hook(name):
        def h(mod, gin, gout):
            seen[name] = gout[0]
            return tuple(None if g is None else g * 0.5 for g in gin)
        return h
    ref[2].register_full_backward_hook(hook("ref"))
    wr.m[2].register_full_backward_hook(hook("wr"))
    x, y = batches(1)[0]
    train_step(wr, opt, ref, ro, x, y)
    assert "wr" in seen
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_no_grad_inference_in_eval(kind):
    ref, wr = mk(), Wrapped(kind)
    x = batches(1)[0][0]
    wr.w.eval()
    ref.eval()
    with torch.no_grad():
        o = wr.out(x)
        assert not o.requires_grad
        close(o, ref(x))
    assert all(p.grad is None for p in wr.params())


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_accumulation_dividing_the_loss(kind):
    ref, wr, ro, opt = pair(kind)
    data = batches(4)
    for s in range(2):
        opt.zero_grad()
        ro.zero_grad()
        for x, y in data[2 * s:2 * s + 2]:
            (((wr.out(x) - y) ** 2).mean() / 2).backward()
            (((ref(x) - y) ** 2).mean() / 2).backward()
        clip_as_one_device(wr, opt, ref, 1e9)
        opt.step()
        ro.step()
    assert_same_model(wr, ref)


# ---- checkpoints -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_optimizer_state_dict_after_two_steps_into_a_fresh_wrapper(kind):
    ref, wr, ro, opt = pair(kind)
    data = batches(3)
    for x, y in data[:2]:
        train_step(wr, opt, ref, ro, x, y)
    buf = io.BytesIO()
    torch.save({"model": wr.w.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    fresh = Wrapped(kind, mk(seed=5))
    fresh.w.eval()
    fresh.w.load_state_dict(ck["model"])
    opt2 = fresh.optimizer()
    opt2.load_state_dict(ck["opt"])
    train_step(fresh, opt2, ref, ro, *data[2])
    assert_same_model(fresh, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_saved_state_dict_loads_into_a_plain_torch_model(kind):
    ref, wr, ro, opt = pair(kind)
    train_step(wr, opt, ref, ro, *batches(1)[0])
    buf = io.BytesIO()
    torch.save(wr.w.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")
    plain = mk(seed=5)
    plain.load_state_dict(sd)
    for a, b in zip(plain.parameters(), ref.parameters()):
        close(a.detach(), b.detach())


# ---- names and parameter groups ----------------------------------------------------------------
def _named(wr):
    if wr.kind in ("zero_tp", "zero2_tp"):
        return list(wb.dist_parameters(wr.m))
    return list(wr.w.named_parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_named_parameters_and_weight_decay_groups(kind):
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    names = [n for n, _ in _named(wr)]
    want = [n for n, _ in ref.named_parameters()]
    print(kind, names)
    assert [n.removeprefix("module.") for n in names] == want

    def groups(named):
        return [{"params": [p for n, p in named if "bias" not in n], "weight_decay": 0.1},
                {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0}]
    ro = torch.optim.AdamW(groups(list(ref.named_parameters())), lr=1e-2)
    opt = wr.optimizer(groups(_named(wr)))
    for x, y in batches(2):
        train_step(wr, opt, ref, ro, x, y)
    assert_same_model(wr, ref)


# ---- manual gradient and weight edits -----------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_clip_grad_value(kind):
    ref, wr, ro, opt = sgd_pair(kind)
    x, y = batches(1)[0]
    wr.backward(x, y)
    ref_backward(ref, x, y)
    nn.utils.clip_grad_value_(ref.parameters(), 0.05)
    nn.utils.clip_grad_value_(wr.params(), 0.05)
    opt.step()
    ro.step()
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_manual_gradient_scaling(kind):
    ref, wr, ro, opt = sgd_pair(kind)
    x, y = batches(1)[0]
    wr.backward(x, y)
    ref_backward(ref, x, y)
    for p in wr.params():
        p.grad.data.mul_(0.25)
    for q in ref.parameters():
        q.grad.data.mul_(0.25)
    opt.step()
    ro.step()
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_manual_weight_load_with_data_copy(kind):
    ref, wr, ro, opt = sgd_pair(kind)
    src = mk(seed=7)
    with torch.no_grad():
        for q, s in zip(ref.parameters(), src.parameters()):
            q.data.copy_(s)
        for p, s in zip(wr.params(), src.parameters()):
            p.data.copy_(s)
    assert_same_model(wr, ref)
    train_step(wr, opt, ref, ro, *batches(1)[0])
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_parameters_to_vector(kind):
    ref, wr = mk(), Wrapped(kind)
    v = nn.utils.parameters_to_vector(wr.params())
    close(v.detach(), nn.utils.parameters_to_vector(ref.parameters()).detach())
