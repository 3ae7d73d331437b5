"""A PyTorch user's habits on the wrappers, round 13b (habits13b; tests/test_habits13.py is an
earlier round's): the optimizer's side of an ordinary loop, found by
``benchmarks/habits_probe.py`` (32 idioms x 11 wrappers on simulated ranks, each held to one
device: 267 equal / 52 raised / 33 wrong of 352 before, 308 / 44 / 0 after).  Each test
failed before its fix (but the two guards).

1. ``opt.state_dict()`` of ``ZeroRedundancyOptimizer(partition="chunks")`` (ZeRO-1/2 over
   tensor parallelism) and of a user's ``torch.optim`` over ``Zero3``'s shards held the
   flat chunks' storage: Adam's ``exp_avg`` ``(2, 2, 5)`` for ``(6, 3)`` (a one-device
   optimizer could not take it); over Zero3 an SGD momentum buffer (a gradient's clone)
   made ``copy.deepcopy(opt.state_dict())`` raise torch's "__deepcopy__() for non-wrapper
   subclasses" (an lr-scheduler resume).  Now one device's shapes and values, loading
   back into the wrapper or into a plain optimizer;
2. ZeRO-1/2 over tensor parallelism: ``loss.backward(); opt.zero_grad(); opt.step()``
   raised "no parameter has a gradient; call loss.backward() first" (torch's step skips
   every None gradient: a no-op); ``zero_grad(set_to_none=False)`` after a step left
   ``p.grad`` None where torch's is zeros;
3. ``opt.state[p]["exp_avg"]`` (a user logging Adam's moments) of a ``torch.optim``
   optimizer over DDP / FSDP / fully_shard parameters (and over tensor parallelism) read
   the storage: ``(4, 6, 3)`` rows for ``(6, 3)`` on DDP, padded chunks ``(4, 5)`` on FSDP,
   its norm 2x (DDP); now the module's (SGD's momentum already was).
"""
import copy

import pytest
import torch

from .test_habits11 import close
from .test_habits15 import Wrapped, batches, mk, ref_backward

ZERO12 = ["zero_tp", "zero2_tp"]
LAID_OUT = ["ddp", "fsdp", "fully_shard", "ddp_tp", "fsdp_tp", "fully_shard_tp", "zero3_tp"]


def pair(kind, cls=torch.optim.Adam, **kw):
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    return ref, wr, cls(ref.parameters(), lr=1e-2, **kw), wr.optimizer(cls=cls, **kw)


def train(ref, wr, ro, opt, data):
    for x, y in data:
        ro.zero_grad()
        opt.zero_grad()
        ref_backward(ref, x, y)
        wr.backward(x, y)
        ro.step()
        opt.step()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") and type(t) is not torch.Tensor \
        else t.detach().clone()


def same_weights(wr, ref):
    for p, q in zip(wr.params(), ref.parameters()):
        close(full(p), q.detach())


def same_state_dict(got, want):
    """Two optimizers' state dicts: the same keys, shapes and values (one device's)."""
    assert sorted(got["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        assert sorted(got["state"][i]) == sorted(st)
        for k, v in st.items():
            g = got["state"][i][k]
            assert type(g) is torch.Tensor and g.shape == v.shape, (i, k, type(g), g.shape)
            close(g, v)


# ---- 1. the optimizer's state dict over ZeRO-1/2 and Zero3 shards ---------------------------
@pytest.mark.parametrize("kind", ZERO12 + ["zero3_tp"])
@pytest.mark.parametrize("cls,kw", [(torch.optim.Adam, {"amsgrad": True}),
                                    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True})],
                         ids=["adam_amsgrad", "sgd_nesterov"])
def test_the_optimizer_state_dict_is_one_devices_and_loads_anywhere(kind, cls, kw):
    """Before: ``exp_avg`` / ``momentum_buffer`` ``(2, 2, 5)`` for ``(6, 3)``; Zero3's SGD
    state dict did not deepcopy."""
    ref, wr, ro, opt = pair(kind, cls, **kw)
    data = batches(3)
    train(ref, wr, ro, opt, data[:2])
    sd = copy.deepcopy(opt.state_dict())
    same_state_dict(sd, ro.state_dict())
    # into a plain one-device optimizer: it goes on as the reference
    plain = mk()
    plain.eval()
    with torch.no_grad():
        for a, p in zip(plain.parameters(), wr.params()):
            a.copy_(full(p))
    po = cls(plain.parameters(), lr=1e-2, **kw)
    po.load_state_dict(copy.deepcopy(ro.state_dict()))
    # and into the wrapper's fresh optimizer: one device's state dict (before: refused
    # naming the shapes on ZeRO-1/2 / Zero3)
    opt2 = wr.optimizer(cls=cls, **kw)
    opt2.load_state_dict(copy.deepcopy(ro.state_dict()))
    x, y = data[2]
    for m, o in ((ref, ro), (plain, po)):
        o.zero_grad()
        ref_backward(m, x, y)
        o.step()
    opt2.zero_grad()
    wr.backward(x, y)
    opt2.step()
    same_weights(wr, ref)
    for a, q in zip(plain.parameters(), ref.parameters()):
        close(a.detach(), q.detach())


@pytest.mark.parametrize("kind", ZERO12)
def test_a_storage_shaped_zero_state_dict_still_loads_and_another_shape_is_refused(kind):
    """An older save (this layout's chunks) loads as before; a state of neither shape is
    refused before anything changes (optim_layout)."""
    ref, wr, ro, opt = pair(kind)
    train(ref, wr, ro, opt, batches(1))
    inner = copy.deepcopy(opt.optimizer.state_dict())          # the chunks' own
    assert inner["state"][0]["exp_avg"].shape == opt.shards[0].shape
    opt2 = wr.optimizer(cls=torch.optim.Adam)
    opt2.load_state_dict(inner)
    same_state_dict(opt2.state_dict(), ro.state_dict())
    bad = copy.deepcopy(ro.state_dict())
    bad["state"][0]["exp_avg"] = torch.zeros(3, 6)
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter 0 has shape"):
        opt2.load_state_dict(bad)
    same_state_dict(opt2.state_dict(), before)


# ---- 2. ZeRO-1/2: a step with no gradient, zero_grad(set_to_none=False) ------------------------
@pytest.mark.parametrize("kind", ZERO12)
def test_a_step_after_zero_grad_is_a_no_op_as_torchs(kind):
    """``backward(); zero_grad(); step()``: nothing stepped (torch skips None gradients).
    Before: RuntimeError "no parameter has a gradient; call loss.backward() first"."""
    ref, wr, ro, opt = pair(kind, torch.optim.AdamW, weight_decay=0.1)
    data = batches(3)
    train(ref, wr, ro, opt, data[:1])
    for m, o, bw in ((ref, ro, lambda: ref_backward(ref, *data[1])),
                     (wr, opt, lambda: wr.backward(*data[1]))):
        bw()
        o.zero_grad()
        o.step()
    same_weights(wr, ref)
    train(ref, wr, ro, opt, data[2:])
    same_weights(wr, ref)


@pytest.mark.parametrize("kind", ZERO12)
def test_a_step_before_any_backward_still_raises_naming_it(kind):
    """A guard (it raised before too): ``step()`` of a fresh optimizer, no backward and no
    ``zero_grad`` since it was built, says to call backward first."""
    wr = Wrapped(kind)
    opt = wr.optimizer(cls=torch.optim.SGD)
    with pytest.raises(RuntimeError, match=r"no parameter has a gradient; call "
                       r"loss\.backward\(\) first"):
        opt.step()


@pytest.mark.parametrize("kind", ZERO12)
@pytest.mark.parametrize("who", ["optimizer", "module"])
def test_zero_grad_set_to_none_false_after_a_step_gives_zeros(kind, who):
    """Before: ``p.grad`` None after a step and ``zero_grad(set_to_none=False)`` (torch's:
    zeros); the next step is one device's either way."""
    ref, wr, ro, opt = pair(kind, torch.optim.SGD, momentum=0.9)
    data = batches(3)
    for x, y in data:
        for z in ((ro, opt) if who == "optimizer" else (ref, wr.m)):
            z.zero_grad(set_to_none=False)
        for p, q in zip(wr.params(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if q.grad is not None:
                assert full(p.grad).shape == q.grad.shape
                assert float(full(p.grad).abs().sum()) == 0.0
        ref_backward(ref, x, y)
        wr.backward(x, y)
        ro.step()
        opt.step()
    same_weights(wr, ref)


# ---- 3. opt.state[p] reads --------------------------------------------------------------------
@pytest.mark.parametrize("kind", LAID_OUT)
@pytest.mark.parametrize("cls,kw", [(torch.optim.Adam, {}), (torch.optim.Adagrad, {}),
                                    (torch.optim.RMSprop, {"momentum": 0.5, "centered": True})],
                         ids=["adam", "adagrad", "rmsprop"])
def test_a_users_read_of_the_optimizer_state_is_one_devices(kind, cls, kw):
    """``opt.state[p][k]``: the module's shape and values, its norm one device's; training
    goes on as one device.  Before (DDP): ``exp_avg`` ``(4, 6, 3)``, its norm 2x."""
    ref, wr, ro, opt = pair(kind, cls, **kw)
    data = batches(3)
    train(ref, wr, ro, opt, data[:2])
    for p, q in zip(wr.params(), ref.parameters()):
        want, got = ro.state[q], opt.state[p]
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            g = got[k]
            assert tuple(g.shape) == tuple(v.shape), (k, g.shape)
            close(full(g), v)
            if v.dim():
                close(g.norm(), v.norm())
                close(g.sum(), v.sum())
    train(ref, wr, ro, opt, data[2:])
    same_weights(wr, ref)
    same_state_dict(copy.deepcopy(opt.state_dict()), ro.state_dict())


# ---- the probe: no idiom wrong on any wrapper (a sample: the optimizer's) -----------------------
@pytest.mark.parametrize("idiom", ["optimizer_state_dict_round_trip", "optimizer_state_reads",
                                   "resume_a_one_device_checkpoint",
                                   "zero_grad_after_backward_then_step",
                                   "zero_grad_set_to_none_false", "lr_scheduler_StepLR"])
def test_the_probe_finds_no_wrong_answer(idiom):
    from benchmarks.habits_probe import run_one
    for kind in ["ddp", "fsdp", "zero_tp", "zero2_tp", "zero3_tp"]:
        res, _, why = run_one(idiom, kind)
        assert res != "wrong", (kind, why)
        if idiom != "optimizer_state_reads" or kind != "zero_tp" and kind != "zero2_tp":
            assert res == "equal", (kind, why)     # (ZeRO's opt.state: torch's, per rank)
