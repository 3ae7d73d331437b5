"""A PyTorch user's habits on the wrappers, round 18 (habits18): more of a user's ordinary
loop on habits15's sweep (DDP, FSDP, fully_shard, DDP + ZeroRedundancyOptimizer on 4
simulated dp ranks; the same, ZeRO-1/2 (``partition="chunks"``) and Zero3 over tensor
parallelism on 2 x 2), each held to one device's plain PyTorch, or a raise naming the fix.

Habits: LR schedulers (StepLR, LambdaLR, OneCycleLR), ``torch.autocast('cpu', bfloat16)``,
``torch.amp.GradScaler('cpu')`` with ``unscale_`` before the clip, ``copy.deepcopy`` of
the wrapped model (an EMA), ``.double()`` / ``.to(bfloat16)`` / ``.half()`` after wrapping,
``requires_grad_(False)`` then True, forward hooks and ``register_full_backward_hook``,
``no_grad`` + ``eval`` inference, accumulation over ``loss / accum_steps``, checkpoints
after two steps into a fresh wrapper and into a plain torch model, weight-decay groups by
``named_parameters`` names, ``clip_grad_value_``, ``p.grad.data.mul_``, ``p.data.copy_``,
``parameters_to_vector``.

Found and fixed (each test failed before; measured on habits15's 45-parameter MLP):

1. ZeRO-1 over DistTensors: ``p.grad`` (a DistTensor) said Replicate over dp while each dp
   rank's copy held its own share of the gradient (summed only in ``step``):
   ``p.grad.sum()`` 0.0738 for 0.2003 (dp rank 0's share), and ``p.grad.mul_(0.25)`` (or
   ``p.grad.data.mul_``: manual gradient scaling) wrote rank 0's share over every rank's,
   so the step used 2x rank 0's gradient, silently.  Now Partial("sum") over dp until the
   wrapper sums it (``DistTensor._grad_placements``; DDP under ``no_sync`` the same);
2. ``register_full_backward_hook`` (and ``_pre_hook``, ``register_backward_hook``) on a
   module over tensor parallelism, or on DDP / FSDP / Zero3 over it: the hook never ran
   (torch only warns "module output should be a Tensor"; a hook that halves a gradient
   left one device's gradient unhalved).  Now the registration raises naming the fix, and
   parallelize / parallelize_module refuse a module that already has one;
3. ``torch.amp.GradScaler`` on ZeRO-2 over DistTensors: ``unscale_`` unscaled nothing (the
   optimizer's shards held no gradient), ``opt.clip_grad_norm_`` returned the scaled norm
   (769.64 for 0.7516, 1024x at scale 2**10), then ``scaler.step`` raised torch's "No inf
   checks were recorded".  Now a reduced gradient shard is its shard's ``.grad``: one
   device's unscale, clip, inf skip and scale; ZeRO-1 (which reduces in ``step``) too,
   since gradscaler: reading a shard's ``.grad`` reduces first (tests/test_gradscaler.py);
4. ``p.data.copy_(w)`` (a manual weight load) of a module-shaped ``w``: Zero3 over tensor
   parallelism raised an internal AttributeError ('_LaidOutData' ... '_wb_store'), DDP
   over it torch's broadcast error; now one device's load (FSDP's was);
5. ``parameters_to_vector`` on DDP over tensor parallelism raised torch's stride error
   "Use .reshape(...)" (a contiguous storage would have given its replicas' elements): now
   the view refusal naming ``model.<name>.full()``.

Raises kept as they are, each naming the fix: deepcopy of a wrapper (deepcopy the module
before wrapping, or a plain copy from ``full_state_dict()``), a cast of FSDP / Zero3 /
fully_shard over tensor parallelism once its shards are built, a cast after ZeRO-1/2's
optimizer was built, a state dict of DistTensors into a plain module
(``wb.checkpoint.set_model_state_dict``), ``clip_grad_value_`` before ZeRO-1/2's sum.
OneCycleLR on ZeroRedundancyOptimizer raises torch's own "optimizer must support momentum
or beta1" (torch's ZeroRedundancyOptimizer keeps its kwargs as ``defaults``, torch 2.13
``zero_redundancy_optimizer.py`` ``Optimizer.__init__(self, params, defaults)``; ours
likewise, test_habits6): passing ``betas`` makes them ``defaults``.
"""
import copy
import io

import pytest
import torch
from torch import nn

import workbench as wb

from .test_habits11 import close
from .test_habits15 import (KINDS, OVER_TP, Wrapped, assert_same_model, batches,
                            clip_step_and_compare, full_state, mk, pair, ref_backward)

SGD = torch.optim.SGD
ZERO_CHUNKS = ("zero_tp", "zero2_tp")
DIST_STATE = ("fsdp", "fully_shard") + tuple(OVER_TP)     # state_dict() of DistTensors
FLAT_TP = ("fsdp_tp", "fully_shard_tp", "zero3_tp")


def sgd_pair(kind, lr=1.0, **kw):
    """habits15's pair with SGD (lr 1: the weights move by the gradient itself, so a wrong
    gradient shows, which Adam's normalized first step would hide)."""
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


def full_weights(wr) -> dict:
    return full_state(wr.m.state_dict())


# ---- LR schedulers -------------------------------------------------------------------------
SCHEDS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (e + 1)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=4),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sched", list(SCHEDS))
def test_an_lr_scheduler_reaches_the_step(kind, sched):
    """The scheduler's lr (and OneCycleLR's beta1) in ``opt.param_groups`` after each
    ``scheduler.step()``, and three steps of it, are one device's."""
    ref, wr, ro, opt = pair(kind)
    if sched == "OneCycleLR" and kind in ("zero",) + ZERO_CHUNKS:
        with pytest.raises(ValueError, match="optimizer must support momentum or beta1"):
            SCHEDS[sched](opt)                  # torch's ZeroRedundancyOptimizer's too
        opt = wr.optimizer(betas=(0.9, 0.999))  # the fix: betas in its defaults
    rs, ws = SCHEDS[sched](ro), SCHEDS[sched](opt)
    for x, y in batches(3):
        train_step(wr, opt, ref, ro, x, y)
        rs.step()
        ws.step()
        for a, b in zip(opt.param_groups, ro.param_groups):
            assert a["lr"] == b["lr"] and a["betas"] == b["betas"]
        assert ws.get_last_lr() == rs.get_last_lr()
    assert ro.param_groups[0]["lr"] != 1e-2
    assert_same_model(wr, ref)


# ---- torch.amp -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_autocast_bf16_forward_and_backward_are_one_devices(kind):
    """Under ``torch.autocast('cpu', bfloat16)``: a bfloat16 output, one device's to
    bfloat16's precision; the float32 weights after an SGD step too (a sum in another
    order rounds otherwise, so not bitwise)."""
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
    got, want = full_weights(wr), ref.state_dict()
    for k in want:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], want[k], rtol=2e-2, atol=2e-2)


def _clip(wr, opt, max_norm):
    if wr.kind in ZERO_CHUNKS:
        return opt.clip_grad_norm_(max_norm)
    return nn.utils.clip_grad_norm_(wr.params(), max_norm)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaler_unscale_clip_step_update_is_one_devices(kind):
    """``scaler.scale(loss).backward(); scaler.unscale_(opt); clip; scaler.step(opt);
    scaler.update()`` with SGD + momentum, a batch with an inf in the middle: the unscaled
    clip norms, the skipped step, the scale (2**10 -> 2**9) and the weights are one
    device's.  ZeRO-1 sums in ``step``: ``unscale_``'s read of its shards sums first.
    Before: ZeRO-2's clip norm 769.64 for 0.7516, then torch's assertion."""
    ref, wr, ro, opt = sgd_pair(kind, lr=0.5, momentum=0.9)
    rsc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    wsc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    data = batches(3)
    data[1] = (data[1][0].clone(), data[1][1])
    data[1][0][3, 1] = float("inf")
    for x, y in data:
        ro.zero_grad()
        opt.zero_grad()
        rsc.scale(((ref(x) - y) ** 2).mean()).backward()
        rsc.unscale_(ro)
        want = nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        rsc.step(ro)
        rsc.update()
        wsc.scale(((wr.out(x) - y) ** 2).mean()).backward()
        wsc.unscale_(opt)
        got = _clip(wr, opt, 0.1)
        if torch.isfinite(want):
            close(got, want)
        else:
            assert not torch.isfinite(got)
        wsc.step(opt)
        wsc.update()
        assert wsc.get_scale() == rsc.get_scale()
        assert_same_model(wr, ref)
    assert rsc.get_scale() == 2.0 ** 9


def test_grad_scaler_on_zero1_under_an_explicit_reduce_grads_is_the_same():
    """The fix habits18 asked for (``opt.reduce_grads_()`` before ``unscale_``) still gives
    one device's step: the read then finds nothing pending."""
    ref, wr, ro, opt = sgd_pair("zero_tp")
    sc, rsc = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2))
    x, y = batches(1)[0]
    sc.scale(((wr.out(x) - y) ** 2).mean()).backward()
    opt.reduce_grads_()
    sc.unscale_(opt)
    sc.step(opt)
    rsc.scale(((ref(x) - y) ** 2).mean()).backward()
    rsc.unscale_(ro)
    rsc.step(ro)
    assert_same_model(wr, ref)


# ---- copies and casts after wrapping ---------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_as_an_ema_is_one_devices_or_raises_naming_the_fix(kind):
    """``ema = copy.deepcopy(model)``, then ``ema_p.lerp_(p, 0.25)`` after each step: one
    device's EMA.  A wrapper refuses the deepcopy naming the fix (as FSDP2 refuses);
    the fix, a plain module given the wrapper's full weights, is one device's EMA."""
    ref, wr, ro, opt = pair(kind)
    ema_ref = copy.deepcopy(ref)
    if kind in ZERO_CHUNKS:                     # the user's module: copied
        ema = copy.deepcopy(wr.w)
    else:
        with pytest.raises(NotImplementedError, match=r"copy\.deepcopy.*(before wrapping|"
                           r"before fully_shard)"):
            copy.deepcopy(wr.w)
        ema = copy.deepcopy(ref)                # the fix: a plain copy, the full weights
        ema.load_state_dict(full_weights(wr))
    data = batches(3)
    for x, y in data[:2]:
        train_step(wr, opt, ref, ro, x, y)
        with torch.no_grad():
            for e, p in zip(ema_ref.parameters(), ref.parameters()):
                e.lerp_(p, 0.25)
            if kind in ZERO_CHUNKS:
                for e, p in zip(ema.parameters(), wr.w.parameters()):
                    e.lerp_(p, 0.25)
            else:
                full = full_weights(wr)
                for (n, e) in ema.named_parameters():
                    e.lerp_(full[n], 0.25)
    x = data[2][0]
    with torch.no_grad():
        o = ema(wr.inp(x)) if kind in ZERO_CHUNKS else ema(x)
        close(o.full() if isinstance(o, wb.DistTensor) else o, ema_ref(x))
        close(wr.out(x), ref(x))                # the model itself: untouched by the copy


CASTS = {"double": (lambda m: m.double(), torch.float64),
         "to_bf16": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
         "half": (lambda m: m.half(), torch.float16)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cast", list(CASTS))
def test_a_cast_after_wrapping_is_one_devices_or_raises_naming_the_fix(kind, cast):
    """``model.double()`` / ``.to(torch.bfloat16)`` / ``.half()`` after wrapping (the
    optimizer built before it, as torch allows): the forward in that dtype is one
    device's, and a float64 SGD step.  FSDP / Zero3 / fully_shard over tensor parallelism
    (shards built) refuse naming the fix, converting before wrapping, which is one
    device's; ZeRO-1/2's optimizer, built over float32 shards, refuses its step naming the
    fix, building it after the conversion."""
    ref, wr, ro, opt = sgd_pair(kind, lr=0.1)
    fn, dt = CASTS[cast]
    fn(ref)
    if kind in FLAT_TP:
        with pytest.raises(NotImplementedError, match=r"(before wrapping|before wb\."
                           r"parallelize)"):
            fn(wr.w)
        wr = Wrapped(kind, fn(mk()))           # the fix: convert, then wrap
        wr.w.eval()
        opt = wr.optimizer(cls=SGD, lr=0.1)
    else:
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
    if kind in ZERO_CHUNKS:
        with pytest.raises(RuntimeError, match="build the optimizer after converting"):
            opt.step()
        opt = wr.optimizer(cls=SGD, lr=0.1)
        wr.backward(x, y)                       # (its gradients: the old optimizer's hooks)
        opt.zero_grad()
        wr.backward(x, y)
    opt.step()
    ro.step()
    got, want = full_weights(wr), ref.state_dict()
    for k in want:
        assert got[k].dtype == dt
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_requires_grad_off_then_on_trains_as_one_device(kind):
    """``model.requires_grad_(False)``: every parameter frozen, a forward without history;
    ``requires_grad_(True)``: a step is one device's."""
    ref, wr, ro, opt = pair(kind)
    x, y = batches(1)[0]
    wr.w.requires_grad_(False)
    assert not any(p.requires_grad for p in wr.params())
    assert not any(p.requires_grad for p in wr.m.parameters())
    assert not wr.out(x).requires_grad
    wr.w.requires_grad_(True)
    assert all(p.requires_grad for p in wr.params())
    assert all(p.requires_grad for p in wr.m.parameters())
    train_step(wr, opt, ref, ro, x, y)
    assert_same_model(wr, ref)


# ---- hooks, inference ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_forward_hook_that_changes_a_submodules_output(kind):
    """``model[0].register_forward_hook`` returning ``out * 2``: the step is one
    device's.  On plain modules the hook runs once per simulated rank (4: each rank's
    forward, as each torchrun process calls it), over DistTensors once."""
    ref, wr, ro, opt = sgd_pair(kind)
    calls = []

    def hook(mod, args, out):
        calls.append(1)
        return out * 2
    ref[0].register_forward_hook(hook)
    wr.m[0].register_forward_hook(hook)
    train_step(wr, opt, ref, ro, *batches(1)[0])
    assert len(calls) == 1 + (1 if kind in OVER_TP else 4)
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_a_full_backward_hook_is_one_devices_or_raises_naming_the_fix(kind):
    """``model[2].register_full_backward_hook`` halving its input gradient: the step is
    one device's on plain modules.  Over tensor parallelism the module's inputs and
    outputs are DistTensors, which torch's backward hooks do not see: the registration
    raises (before: the hook never ran, torch only warned, the gradient one device's
    without the hook's change), on the wrapper too."""
    ref, wr, ro, opt = sgd_pair(kind)
    seen = []

    def hook(mod, gin, gout):
        seen.append(1)
        return tuple(None if g is None else g * 0.5 for g in gin)
    ref[2].register_full_backward_hook(hook)
    if kind in OVER_TP:
        for mod in (wr.m[2], wr.w):
            for how in ("register_full_backward_hook", "register_full_backward_pre_hook",
                        "register_backward_hook"):
                with pytest.raises(NotImplementedError, match=r"DistTensors.*never run"):
                    getattr(mod, how)(lambda *a: None)
            assert not mod._backward_hooks and not mod._backward_pre_hooks
        return
    wr.m[2].register_full_backward_hook(hook)
    train_step(wr, opt, ref, ro, *batches(1)[0])
    assert len(seen) == 1 + 4                   # one device's, and each simulated rank's
    assert_same_model(wr, ref)


def test_parallelize_refuses_a_module_with_a_backward_hook_and_changes_nothing():
    """A backward hook registered before ``parallelize_module`` / ``parallelize`` would
    stop running: refused, the module untouched."""
    m = mk()
    h = m[2].register_full_backward_hook(lambda *a: None)
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    want = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(NotImplementedError, match=r"'2' has a backward hook.*handle\.remove"):
        wb.parallelize_module(m, mesh, {"0": wb.ColwiseParallel()})
    with pytest.raises(NotImplementedError, match=r"'2' has a backward hook"):
        wb.parallelize(m, mesh)
    assert all(type(p) is nn.Parameter for p in m.parameters())
    assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
    h.remove()
    wb.parallelize_module(m, mesh, {"0": wb.ColwiseParallel()})      # the fix


@pytest.mark.parametrize("kind", KINDS)
def test_no_grad_inference_in_eval_is_one_devices(kind):
    """``model.eval()`` and ``torch.no_grad()``: one device's output, no history, no
    gradient left on any parameter."""
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
def test_gradient_accumulation_over_a_divided_loss_is_one_devices(kind):
    """Two micro-batches a step, each ``(loss / 2).backward()`` (no no_sync), two steps:
    the accumulated gradient's norm and the weights are one device's."""
    ref, wr, ro, opt = pair(kind)
    data = batches(4)
    for s in range(2):
        opt.zero_grad()
        ro.zero_grad()
        for x, y in data[2 * s:2 * s + 2]:
            (((wr.out(x) - y) ** 2).mean() / 2).backward()
            (((ref(x) - y) ** 2).mean() / 2).backward()
        clip_step_and_compare(wr, opt, ref, ro)


# ---- checkpoints -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_after_two_steps_trains_on_in_a_fresh_wrapper_as_one_device(kind):
    """``torch.save({'model': ..., 'opt': opt.state_dict()})`` after two steps, loaded
    into a fresh wrapper of other weights and a fresh optimizer: the third step is one
    device's third step."""
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
def test_a_saved_state_dict_loads_into_a_plain_torch_model_or_raises_naming_the_fix(kind):
    """``torch.save(model.state_dict())``, ``torch.load``, the ``module.`` prefix taken off
    (torch's ``consume_prefix_in_state_dict_if_present``), into a plain module: the trained
    values.  A state dict of DistTensors (FSDP's, fully_shard's, any over tensor
    parallelism: FSDP2's DTensors likewise) refuses naming the fix, which loads them."""
    ref, wr, ro, opt = pair(kind)
    train_step(wr, opt, ref, ro, *batches(1)[0])
    buf = io.BytesIO()
    torch.save(wr.w.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")
    plain = mk(seed=5)
    if kind in DIST_STATE:
        before = {k: v.clone() for k, v in plain.state_dict().items()}
        with pytest.raises(RuntimeError, match=r"set_model_state_dict"):
            plain.load_state_dict(sd)
        assert all(torch.equal(v, before[k]) for k, v in plain.state_dict().items())
        wb.checkpoint.set_model_state_dict(plain, sd)
    else:
        plain.load_state_dict(sd)
    for a, b in zip(plain.parameters(), ref.parameters()):
        close(a.detach(), b.detach())


# ---- names and parameter groups ----------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_named_parameters_and_weight_decay_groups_by_name_are_one_devices(kind):
    """``named_parameters()`` names as torch's wrappers give them (DDP's ``module.``
    prefix; FSDP's, fully_shard's and the module's own: the module's names), and an AdamW
    of two groups built from them (weight decay 0.1 but on biases) steps as one device."""
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    named = list(wr.w.named_parameters())
    want = [n for n, _ in ref.named_parameters()]
    prefix = "module." if kind in ("ddp", "zero", "ddp_tp") else ""
    assert [n for n, _ in named] == [prefix + n for n in want]
    if kind in ZERO_CHUNKS:
        assert [id(p) for _, p in named] == [id(p) for p in wr.params()]

    def groups(named):
        return [{"params": [p for n, p in named if "bias" not in n], "weight_decay": 0.1},
                {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0}]
    ro = torch.optim.AdamW(groups(list(ref.named_parameters())), lr=1e-2)
    opt = wr.optimizer(groups(named))
    for x, y in batches(2):
        train_step(wr, opt, ref, ro, x, y)
    assert_same_model(wr, ref)


# ---- manual gradient and weight edits -----------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_clip_grad_value_is_one_devices_or_raises_naming_the_fix(kind):
    """``clip_grad_value_(params, 0.05)`` then an SGD step: one device's.  ZeRO-1/2 sum
    the gradients inside ``step``: refused, naming the optimizer's clip."""
    ref, wr, ro, opt = sgd_pair(kind)
    x, y = batches(1)[0]
    wr.backward(x, y)
    ref_backward(ref, x, y)
    nn.utils.clip_grad_value_(ref.parameters(), 0.05)
    if kind in ZERO_CHUNKS:
        with pytest.raises(RuntimeError, match=r"inside step\(\).*opt\.clip_grad_norm_"):
            nn.utils.clip_grad_value_(wr.params(), 0.05)
        return
    nn.utils.clip_grad_value_(wr.params(), 0.05)
    opt.step()
    ro.step()
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_manual_gradient_scaling_is_one_devices(kind):
    """``p.grad.data.mul_(0.25)`` over the optimizer's parameters, then an SGD step: one
    device's.  Before, ZeRO-1 over DistTensors: every dp rank's gradient became rank 0's
    (Partial read as Replicate), the step off by 100% (0.028 in the weight).  ZeRO-2
    keeps only the reduced shards (as DeepSpeed's): reading ``p.grad`` raises naming the
    optimizer (zero1tp: was None, so ``if p.grad is not None: p.grad.mul_(s)`` skipped
    every parameter silently); the optimizer's parameters (the shards) carry them."""
    ref, wr, ro, opt = sgd_pair(kind)
    x, y = batches(1)[0]
    wr.backward(x, y)
    ref_backward(ref, x, y)
    if kind == "zero_tp":
        p = wr.params()[0]
        assert p.grad.placements[0] == wb.Partial("sum")
        close(p.grad.sum().full(), ref[0].weight.grad.sum())
    if kind == "zero2_tp":
        for p in wr.params():
            with pytest.raises(RuntimeError, match="opt.clip_grad_norm_"):
                p.grad
        ps = [s for g in opt.param_groups for s in g["params"]]
    else:
        ps = wr.params()
    for p in ps:
        p.grad.data.mul_(0.25)
    for q in ref.parameters():
        q.grad.data.mul_(0.25)
    opt.step()
    ro.step()
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_a_manual_weight_load_with_data_copy_is_one_devices(kind):
    """``p.data.copy_(w)`` of another model's module-shaped weights over the optimizer's
    parameters: one device's weights and step.  Before: Zero3 over tensor parallelism an
    internal AttributeError, DDP over it torch's broadcast error."""
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
def test_parameters_to_vector_is_one_devices_or_raises_naming_the_fix(kind):
    """``parameters_to_vector``: one device's vector (DistTensors': a DistTensor of it, as
    DTensor's); a storage that holds no view of the parameter refuses naming
    ``.full()`` / ``.full_tensor()``.  Before, DDP over tensor parallelism: torch's
    "view size is not compatible ... Use .reshape(...)" (contiguous: the replicas')."""
    ref, wr = mk(), Wrapped(kind)
    want = nn.utils.parameters_to_vector(ref.parameters()).detach()
    if kind in ("ddp_tp",) + FLAT_TP:
        with pytest.raises(NotImplementedError, match=r"\.full(_tensor)?\(\)"):
            nn.utils.parameters_to_vector(wr.params())
        return
    v = nn.utils.parameters_to_vector(wr.params()).detach()
    close(v.full() if isinstance(v, wb.DistTensor) else v, want)
