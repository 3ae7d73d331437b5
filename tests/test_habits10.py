"""A PyTorch user's habits on the wrappers, round 10 (habits10): ``p.grad`` / ``p.data`` /
``p.detach()`` met with the user's own tensors, ``state_dict(keep_vars=True)``, and the
optimizers and schedules a user writes, on habits15's sweep (DDP, FSDP, fully_shard, DDP +
ZeroRedundancyOptimizer on 4 simulated dp ranks; DDP, FSDP, fully_shard, ZeRO-1/2 and Zero3
over tensor parallelism on 2 x 2), each held to one device's plain PyTorch, or a raise
naming the fix.

Found and fixed (each test failed before; measured on habits15's ``Linear(3, 6), GELU,
Linear(6, 3)``):

1. ``p.grad`` met with a tensor of the user's own ran on the storage: on DDP (and DDP +
   ZeRO) ``p.grad - g`` was ``(4, 6, 3)`` for ``(6, 3)``, silently (torch broadcast ``g``
   over the rank rows), so were ``p.grad == g``, ``torch.where``, ``p.grad @ w``,
   ``p.grad * t``, ``p.grad.numpy()`` / ``numpy.asarray``, ``p.grad.clone() - g``;
   ``parameters_to_vector([p.grad ...])`` held 180 elements for 45 (FSDP / fully_shard 52:
   the padding, silently); on FSDP / fully_shard and over tensor parallelism the same ops
   raised torch's "The size of tensor a (5) must match the size of tensor b (3)", and so
   did ``acc.add_(p.grad)`` / ``ema.copy_(p.grad)`` into a plain tensor and (FSDP)
   ``p.grad.add_(noise)``.  Now one device's (``laid_out_grad_reads``), or, where the module
   gradient is a gathered copy (over tensor parallelism), a view / a write into it raises
   naming ``p.grad.full_tensor()``; DDP's parameter over tensor parallelism (``p - w``,
   ``p.data - w``, ``p.detach() - w``) the same.  ``vector_to_parameters(v, grads)`` set
   nothing the step read (silently, every laid-out wrapper); ``p.grad = g`` of the
   module's shape raised torch's size error naming the storage: now one device's.
2. ``state_dict(keep_vars=True)`` over tensor parallelism gave DistTensors or gathered
   copies, not the parameters: ``requires_grad`` False on FSDP / fully_shard / Zero3 (a
   LoRA "save what trains" filter kept nothing, silently), ``.grad`` None.  Now the
   ``named_parameters()`` objects (``parallel/keep_vars.py``); the module inside FSDP /
   Zero3 over tensor parallelism (templates of the shards) raises naming the wrapper's;
   such a dict loads into another wrapper and ``torch.save``s as module-shaped
   parameters (it raised RecursionError / PicklingError).
3. The optimizers and schedules a user writes: one device's (guards), except LBFGS, which
   every wrapper refuses naming an elementwise optimizer (DDP over tensor parallelism
   raised AttributeError, Zero3 over it torch's stride error, before).
"""
import numpy as np
import pytest
import torch
from torch import nn

import workbench as wb

from .test_habits11 import close
from .test_habits15 import (KINDS, OVER_TP, Wrapped, batches, full_state, mk, ref_backward)
from .test_habits18 import train_step

def same_model(wr, ref):
    """The wrapper's model (gathered) equals one device's, entry by entry (``close``)."""
    got, want = full_state(wr.m.state_dict()), ref.state_dict()
    for k in want:
        close(got[k], want[k])


# over tensor parallelism the module gradient is gathered from the shards: no view of it
GATHERED = ("ddp_tp", "fsdp_tp", "fully_shard_tp", "zero3_tp")


def backward_pair(kind):
    """(one device's model, the wrapped one) after one backward on the same batch."""
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    x, y = batches(1)[0]
    wr.backward(x, y)
    ref_backward(ref, x, y)
    return ref, wr


def plain(t):
    if isinstance(t, wb.DistTensor):
        return t.full()
    if type(t) is not torch.Tensor and hasattr(t, "full_tensor"):
        return t.full_tensor()
    return t


def user_tensor(shape, seed=5):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---- 1. p.grad met with the user's own tensors ----------------------------------------------
MEETS = {           # (g: a gradient, t: the user's tensor of its shape)
    "sub": lambda g, t: g - t, "rsub": lambda g, t: t - g, "mul": lambda g, t: g * t,
    "gt": lambda g, t: (g > t).float(), "where": lambda g, t: torch.where(g > 0, g, t),
    "matmul": lambda g, t: g @ t.T if g.dim() == 2 else g @ t,
    "cat": lambda g, t: torch.cat([g, t]), "stack": lambda g, t: torch.stack([g, t]),
    "clone_sub": lambda g, t: g.clone() - t, "abs_sub": lambda g, t: g.abs() - t,
    "data_sub": lambda g, t: g.data - t, "detach_sub": lambda g, t: g.detach() - t,
    "numpy": lambda g, t: torch.from_numpy(g.numpy().copy()),
    "asarray": lambda g, t: torch.as_tensor(np.asarray(g)),
    "copy_into": lambda g, t: t.clone().copy_(g), "add_into": lambda g, t: t.clone().add_(g),
    "lerp_into": lambda g, t: t.clone().lerp_(g, 0.1),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", list(MEETS))
def test_a_gradient_met_with_a_users_tensor_is_one_devices(kind, op):
    """Each op of a gradient and a tensor of its shape is one device's: the value and the
    shape.  Before: DDP's (4, 6, 3) for (6, 3) (silently), FSDP's torch size error.  A
    DistTensor's gradient (ZeRO-1/2 over tensor parallelism) written into a plain tensor
    raises naming ``.full()``, as DTensor refuses mixing."""
    ref, wr = backward_pair(kind)
    for i, (p, r) in enumerate(zip(wr.params(), ref.parameters())):
        t = user_tensor(r.shape, seed=i)
        want = MEETS[op](r.grad, t)
        if kind in ("zero_tp", "zero2_tp") and op.endswith("_into"):
            with pytest.raises(RuntimeError, match=r"t\.copy_\(d\.full\(\)\)"):
                MEETS[op](p.grad, t)
            continue
        got = plain(MEETS[op](p.grad, t))
        assert got.shape == want.shape, (op, got.shape, want.shape)
        close(got.to(want.dtype), want)


@pytest.mark.parametrize("kind", KINDS)
def test_assert_close_and_total_norm_of_the_gradients_are_one_devices(kind):
    """``torch.testing.assert_close(p.grad, ref.grad)`` passes and fails as one device's
    (before, DDP's: "The values for attribute 'shape' do not match: torch.Size([4, 6, 3])
    != torch.Size([6, 3])")."""
    ref, wr = backward_pair(kind)
    grads = [plain(p.grad) if kind in ("zero_tp", "zero2_tp") else p.grad
             for p in wr.params()]
    for g, r in zip(grads, ref.parameters()):
        torch.testing.assert_close(g, r.grad, rtol=1e-6, atol=1e-6)
        # a mismatch's report flattens the tensors: over tensor parallelism no view of the
        # gathered gradient exists, so it names p.grad.full_tensor() (raised all the same)
        with pytest.raises(AssertionError if kind not in GATHERED else RuntimeError):
            torch.testing.assert_close(g, r.grad + 1e-3)
    close(nn.utils.get_total_norm(grads), nn.utils.get_total_norm(
        [r.grad for r in ref.parameters()]))


@pytest.mark.parametrize("kind", KINDS)
def test_parameters_to_vector_of_the_gradients_is_one_devices_or_raises(kind):
    """Before: 180 elements for 45 (DDP's rows), 52 (FSDP's padding), silently; over
    tensor parallelism torch's stride error."""
    ref, wr = backward_pair(kind)
    want = nn.utils.parameters_to_vector([r.grad for r in ref.parameters()])
    if kind in GATHERED:
        with pytest.raises(NotImplementedError, match=r"p\.grad\.full_tensor\(\)"):
            nn.utils.parameters_to_vector([p.grad for p in wr.params()])
        got = nn.utils.parameters_to_vector([p.grad.full_tensor() for p in wr.params()])
    else:
        got = plain(nn.utils.parameters_to_vector([p.grad for p in wr.params()]))
    assert got.shape == want.shape
    close(got, want)


WRITES = {"add_": lambda g, t: g.add_(t), "copy_": lambda g, t: g.copy_(t),
          "mul_": lambda g, t: g.mul_(t), "addcmul_": lambda g, t: g.addcmul_(t, t, value=0.5)}


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fully_shard", "zero", "zero_tp"] +
                         list(GATHERED))
@pytest.mark.parametrize("how", list(WRITES))
def test_a_write_of_a_users_tensor_into_the_gradient_steps_as_one_device(kind, how):
    """``p.grad.add_(noise)`` (gradient noise), ``p.grad.copy_(g)``: one device's step
    (before, FSDP raised torch's size error); over tensor parallelism (the module gradient
    a gathered copy) it raises naming the fix, the gradient untouched."""
    ref, wr = backward_pair(kind)
    ro = torch.optim.SGD(ref.parameters(), lr=1.0)
    wo = wr.optimizer(cls=torch.optim.SGD, lr=1.0)
    pairs = list(zip(wr.params(), ref.parameters()))
    if kind in GATHERED:
        p, r = pairs[0]
        before = p.grad.full_tensor()
        with pytest.raises(RuntimeError, match=r"would not reach.*p\.grad\.full_tensor\(\)"):
            WRITES[how](p.grad, user_tensor(r.shape))
        close(p.grad.full_tensor(), before)
        return
    for i, (p, r) in enumerate(pairs):
        t = user_tensor(r.shape, seed=i)
        WRITES[how](p.grad, t)
        WRITES[how](r.grad, t)
    wo.step()
    ro.step()
    same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_vector_to_parameters_over_the_gradients_steps_as_one_device_or_raises(kind):
    """``vector_to_parameters(v, [p.grad ...])`` (a flat gradient written back, as
    meta-learning and hand-written second-order code do): one device's step.  Before:
    silently wrong on every laid-out wrapper (``p.grad.data = t`` of the module's shape
    set nothing the step read); over tensor parallelism (a gathered copy) it raises
    naming the fix, as does ZeRO-1/2's DistTensor ``.data``."""
    ref, wr = backward_pair(kind)
    ro = torch.optim.SGD(ref.parameters(), lr=1.0)
    wo = wr.optimizer(cls=torch.optim.SGD, lr=1.0)
    vec = user_tensor((45,), seed=9)
    if kind in GATHERED or kind in ("zero_tp", "zero2_tp"):
        with pytest.raises((RuntimeError, TypeError), match=r"full_tensor\(\)|d\.copy_\(t\)"):
            nn.utils.vector_to_parameters(vec, [p.grad for p in wr.params()])
        return
    nn.utils.vector_to_parameters(vec, [r.grad for r in ref.parameters()])
    nn.utils.vector_to_parameters(vec, [p.grad for p in wr.params()])
    wo.step()
    ro.step()
    same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_assigning_a_gradient_of_the_modules_shape_steps_as_one_device_or_raises(kind):
    """``p.grad = g`` (a gradient set by hand) with ``g`` of ``p``'s shape: one device's
    step on DDP / FSDP / fully_shard (and FSDP / fully_shard over tensor parallelism).
    Before: torch's "attempting to assign a gradient of size '[6, 3]' to a tensor of size
    '[4, 6, 3]'", naming the storage's size; Zero3 over tensor parallelism named the
    fix, now (habits13b: its shards laid out as FSDP's) one device's step too; DDP over it
    keeps torch's refusal, ZeRO-1/2 their own."""
    ref, wr = backward_pair(kind)
    ro = torch.optim.SGD(ref.parameters(), lr=1.0)
    wo = wr.optimizer(cls=torch.optim.SGD, lr=1.0)
    pairs = list(zip(wr.params(), ref.parameters()))
    if kind in ("ddp_tp", "zero_tp", "zero2_tp"):
        with pytest.raises((RuntimeError, ValueError), match="grad"):
            pairs[0][0].grad = user_tensor(pairs[0][1].shape)
        return
    for i, (p, r) in enumerate(pairs):
        t = user_tensor(r.shape, seed=i)
        p.grad = t.clone()
        r.grad = t.clone()
        close(plain(p.grad.full_tensor() if kind in GATHERED else p.grad), t)
    wo.step()
    ro.step()
    same_model(wr, ref)


PARAM_MEETS = {"sub": lambda p, t: p - t, "data_sub": lambda p, t: p.data - t,
               "detach_sub": lambda p, t: p.detach() - t,
               "copy_into": lambda p, t: t.clone().copy_(p.detach())}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", list(PARAM_MEETS))
def test_a_parameter_met_with_a_users_tensor_is_one_devices(kind, op):
    """``p - w``, ``p.data - w``, ``p.detach() - w``: one device's (DDP over tensor
    parallelism raised torch's size error before)."""
    ref, wr = backward_pair(kind)
    for i, (p, r) in enumerate(zip(wr.params(), ref.parameters())):
        t = user_tensor(r.shape, seed=i)
        if kind in ("zero_tp", "zero2_tp") and op == "copy_into":   # DTensor's refusal too
            with pytest.raises(RuntimeError, match=r"t\.copy_\(d\.full\(\)\)"):
                PARAM_MEETS[op](p, t)
            continue
        got = plain(PARAM_MEETS[op](p, t))
        want = PARAM_MEETS[op](r, t)
        assert got.shape == want.shape
        close(got.detach(), want.detach())


# ---- 2. state_dict(keep_vars=True): the parameters themselves --------------------------------
TEMPLATES = ("fsdp_tp", "zero3_tp")     # their inner module holds templates of the shards


@pytest.mark.parametrize("kind", KINDS)
def test_keep_vars_values_are_the_parameters_and_say_which_train(kind):
    """The wrapper's ``state_dict(keep_vars=True)`` values are the objects
    ``named_parameters()`` gives (torch's); LoRA's filter by ``requires_grad`` and a
    logger's ``sd[k].grad`` are one device's.  Before, over tensor parallelism: other
    objects (DistTensors, copies), ``requires_grad`` False on FSDP / fully_shard / Zero3
    (the filter kept nothing, silently), ``.grad`` None."""
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    ref[0].bias.requires_grad_(False)
    for n, p in wr.w.named_parameters():
        if n.removeprefix("module.") == "0.bias":
            p.requires_grad_(False)
    x, y = batches(1)[0]
    wr.backward(x, y)
    ref_backward(ref, x, y)
    sd = wr.w.state_dict(keep_vars=True)
    params = dict(wr.w.named_parameters())
    for k, p in params.items():
        assert sd[k] is p, k
    want = [k for k, v in ref.state_dict(keep_vars=True).items() if v.requires_grad]
    assert [k.removeprefix("module.") for k, v in sd.items() if v.requires_grad] == want
    for k in want:
        v = sd[k if kind not in ("ddp", "zero", "ddp_tp") else "module." + k]
        close(plain(v.grad) if kind in ("zero_tp", "zero2_tp") else v.grad,
              ref.get_parameter(k).grad)


@pytest.mark.parametrize("kind", KINDS)
def test_an_in_place_write_into_keep_vars_values_trains_as_one_device(kind):
    """An EMA-style in-place update of the keep_vars values reaches the parameters the
    optimizer steps, as torch's; the dict saves (``torch.save``) as module-shaped
    parameters and another wrapper loads it (before: pickling raised; over tensor
    parallelism the load of the parameters themselves failed torch's size check)."""
    import io
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    with torch.no_grad():
        for v in wr.w.state_dict(keep_vars=True).values():
            v.mul_(0.5)
        for v in ref.state_dict(keep_vars=True).values():
            v.mul_(0.5)
    ro, opt = torch.optim.SGD(ref.parameters(), lr=0.5), wr.optimizer(cls=torch.optim.SGD,
                                                                     lr=0.5)
    steps(wr, opt, ref, ro, n=2)
    same_model(wr, ref)
    want = ref.state_dict()
    # (ZeRO-1/2 over TP included: a DistTensor pickles its values, not the optimizer's
    # hook, as torch pickles a Parameter; inplace11)
    buf = io.BytesIO()
    torch.save(wr.w.state_dict(keep_vars=True), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    for k, v in saved.items():
        close(plain(v).detach(), want[k.removeprefix("module.")])
    other = Wrapped(kind, mk(seed=3))
    other.w.load_state_dict(wr.w.state_dict(keep_vars=True))
    got = full_state(other.m.state_dict())
    for k in want:
        close(got[k], want[k])


@pytest.mark.parametrize("kind", TEMPLATES)
def test_keep_vars_of_the_module_inside_fsdp_over_tp_raises_naming_the_wrapper(kind):
    """Its parameters are templates of the flat shards (their writes raise, the optimizer
    steps the shards): no keep_vars value could be a parameter that trains; the values
    (``state_dict()``) stay one device's."""
    ref, wr = mk(), Wrapped(kind)
    with pytest.raises(NotImplementedError, match=r"on the wrapper"):
        wr.m.state_dict(keep_vars=True)
    got = full_state(wr.m.state_dict())
    for k, v in ref.state_dict().items():
        close(got[k], v)


# ---- 3. the optimizers and schedules a user writes ------------------------------------------
O = torch.optim
OPTIMIZERS = {
    "sgd_momentum": (O.SGD, dict(lr=0.1, momentum=0.9)),
    "sgd_nesterov": (O.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam_amsgrad": (O.Adam, dict(lr=1e-2, amsgrad=True)),
    "adagrad": (O.Adagrad, dict(lr=0.1)),
    "rmsprop_centered": (O.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
}


def steps(wr, opt, ref, ro, n=3, each=None):
    for i, (x, y) in enumerate(batches(n)):
        if each is not None:
            each(i)
        train_step(wr, opt, ref, ro, x, y)


def assert_one_device(wr, ref):
    got, want = full_state(wr.m.state_dict()), ref.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def eval_pair(kind):
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    return ref, wr


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_users_optimizer_trains_as_one_device(kind, name):
    """A guard (passed before): momentum, nesterov + weight decay, amsgrad's max, Adagrad's
    sum, centered RMSprop: three steps one device's."""
    cls, kw = OPTIMIZERS[name]
    ref, wr = eval_pair(kind)
    steps(wr, wr.optimizer(cls=cls, **kw), ref, cls(ref.parameters(), **kw))
    assert_one_device(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_lbfgs_with_a_closure_raises_naming_the_fix_before_any_step(kind):
    """LBFGS reads every parameter whole (one flat gradient): each wrapper refuses it
    before its first step, naming an elementwise optimizer; the parameters untouched.
    Before: DDP over tensor parallelism raised AttributeError ('ReplicaStorage' object
    has no attribute '_wb_layout'), Zero3 over it torch's stride error."""
    ref, wr = eval_pair(kind)
    before = full_state(wr.m.state_dict())
    x, y = batches(1)[0]
    with pytest.raises((NotImplementedError, ValueError),
                       match=r"(?i)elementwise|SGD, Adam"):
        opt = wr.optimizer(cls=O.LBFGS, lr=0.5, max_iter=3)

        def closure():
            opt.zero_grad()
            loss = ((wr.out(x) - y) ** 2).mean()
            loss.backward()
            return loss
        opt.step(closure)
    after = full_state(wr.m.state_dict())
    for k in before:
        assert torch.equal(after[k], before[k]), k


@pytest.mark.parametrize("kind", KINDS)
def test_add_param_group_and_per_group_lr_are_one_devices_or_raise(kind):
    """Groups with their own lr and weight decay, an lr halved by hand each step, a
    group added after the first step: one device's; ZeRO-1/2 over tensor parallelism
    (its buffers laid out over the parameters it was built with) refuse
    ``add_param_group`` naming the fix (groups at construction)."""
    ref, wr = eval_pair(kind)
    rp, wp = list(ref.parameters()), wr.params()
    ro = O.AdamW([{"params": rp[:2]}, {"params": rp[2:3], "lr": 1e-3, "weight_decay": 0.0}],
                 lr=1e-2)
    opt = wr.optimizer([{"params": wp[:2]}, {"params": wp[2:3], "lr": 1e-3,
                                             "weight_decay": 0.0}])

    if kind in ("zero_tp", "zero2_tp"):
        with pytest.raises(NotImplementedError, match="build a new one"):
            opt.add_param_group({"params": wp[3:], "lr": 5e-3})
        return

    def each(i):
        for o in (opt, ro):
            o.param_groups[0]["lr"] *= 0.5
        if i == 1:
            ro.add_param_group({"params": rp[3:], "lr": 5e-3})
            opt.add_param_group({"params": wp[3:], "lr": 5e-3})
    steps(wr, opt, ref, ro, each=each)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ro.param_groups]
    assert_one_device(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_reduce_lr_on_plateau_with_the_loss_read_on_each_rank(kind):
    """``ReduceLROnPlateau.step(loss)`` (the tensor, or ``loss.item()``): the same lr
    cuts as one device's (the loss is one device's on every rank)."""
    ref, wr = eval_pair(kind)
    ro, opt = O.SGD(ref.parameters(), lr=0.1), wr.optimizer(cls=O.SGD, lr=0.1)
    # threshold 1: no loss counts as an improvement, so each step after the first cuts
    rs = O.lr_scheduler.ReduceLROnPlateau(ro, patience=0, factor=0.5, threshold=1.0)
    ws = O.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=1.0)
    x, y = batches(1)[0]
    lrs = []
    for i in range(4):
        opt.zero_grad()
        ro.zero_grad()
        wl = ((wr.out(x) - y) ** 2).mean()
        rl = ((ref(x) - y) ** 2).mean()
        wl.backward()
        rl.backward()
        opt.step()
        ro.step()
        ws.step(wl.detach() if i % 2 else wl.item())
        rs.step(rl.detach() if i % 2 else rl.item())
        lrs.append(ro.param_groups[0]["lr"])
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ro.param_groups]
    assert lrs[-1] < 0.1        # the schedule did cut (a test that can fail)
    assert_one_device(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaler_fp16_autocast_skips_the_overflowing_step_as_one_device(kind):
    """``torch.autocast('cpu', float16)`` + ``torch.amp.GradScaler``: a step whose loss
    overflows (a target of 1e30) is skipped and the scale halved, as on one device; the
    other steps' weights one device's to fp16's precision."""
    ref, wr = eval_pair(kind)
    ro, opt = O.SGD(ref.parameters(), lr=0.1), wr.optimizer(cls=O.SGD, lr=0.1)
    rs, ws = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), \
        torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scales = []
    for i, (x, y) in enumerate(batches(3)):
        opt.zero_grad()
        ro.zero_grad()
        y = y * (1e30 if i == 1 else 1.0)
        with torch.autocast("cpu", dtype=torch.float16):
            wo, r = wr.out(x), ref(x)
        ws.scale(((wo.float() - y) ** 2).mean()).backward()
        rs.scale(((r.float() - y) ** 2).mean()).backward()
        ws.step(opt)
        rs.step(ro)
        ws.update()
        rs.update()
        scales.append((ws.get_scale(), rs.get_scale()))
    assert [a for a, _ in scales] == [b for _, b in scales]
    assert scales[1][1] < scales[0][1]          # the overflow was skipped (scale halved)
    got, want = full_state(wr.m.state_dict()), ref.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-2, atol=1e-2, msg=k)


class Counted(nn.Module):
    """A forward that updates buffers in place (a call counter, a decaying scale)."""

    def __init__(self):
        super().__init__()
        self.lin, self.act, self.out = nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        self.calls += 1
        with torch.no_grad():
            self.scale.mul_(0.5)
        return self.out(self.act(self.lin(x))) * self.scale


def counted(seed=0):
    torch.manual_seed(seed)
    return Counted()


@pytest.mark.parametrize("kind", KINDS)
def test_buffers_updated_in_forward_are_one_devices(kind):
    """A guard: a call counter and a scale halved in each forward, three SGD steps: the
    buffers and weights one device's."""
    ref = counted()
    m = counted()
    if kind in OVER_TP:
        mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
        wb.parallelize_module(m, mesh, {"lin": wb.ColwiseParallel(),
                                        "out": wb.RowwiseParallel()})
        if kind != "fully_shard_tp":
            wb.parallelize(m, mesh)
    wr = Wrapped.__new__(Wrapped)
    wr.kind, wr.m = kind, m
    wr.mesh = mesh if kind in OVER_TP else wb.Mesh.grid(4, ["dp"])
    from workbench.parallel.strategies.zero3 import Zero3
    wr.w = {"ddp": lambda: wb.DistributedDataParallel(m, wr.mesh),
            "zero": lambda: wb.DistributedDataParallel(m, wr.mesh),
            "fsdp": lambda: wb.FullyShardedDataParallel(m, wr.mesh),
            "fully_shard": lambda: wb.fully_shard(m, mesh=wr.mesh),
            "ddp_tp": lambda: wb.DistributedDataParallel(m, wr.mesh, dim="dp"),
            "fsdp_tp": lambda: wb.FullyShardedDataParallel(m, wr.mesh, "dp"),
            "fully_shard_tp": lambda: wb.fully_shard(m, mesh=wr.mesh["dp"]),
            "zero_tp": lambda: m, "zero2_tp": lambda: m,
            "zero3_tp": lambda: Zero3(m, wr.mesh, "dp")}[kind]()
    opt, ro = wr.optimizer(cls=O.SGD, lr=0.1), O.SGD(ref.parameters(), lr=0.1)
    steps(wr, opt, ref, ro)
    got = full_state(m.state_dict())
    assert int(got["calls"]) == 3
    assert_one_device(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_manual_seed_makes_two_training_runs_with_dropout_identical(kind):
    """Dropout on (train mode), two runs from the same ``torch.manual_seed``: the same
    losses and weights, bit for bit."""
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        wr = Wrapped(kind)
        wr.w.train()
        opt = wr.optimizer()
        torch.manual_seed(7)
        losses = []
        for x, y in batches(3):
            opt.zero_grad()
            loss = ((wr.out(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        runs.append((losses, full_state(wr.m.state_dict())))
    (l0, s0), (l1, s1) = runs
    assert l0 == l1
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k


@pytest.mark.parametrize("kind", KINDS)
def test_freezing_a_submodule_mid_training_is_one_devices_or_raises(kind):
    """``model[0].requires_grad_(False)`` after the first step: the frozen layer stays,
    the rest trains as one device (SGD momentum); DDP (its reducer built over every
    parameter) raises torch DDP's own error naming ``find_unused_parameters``, as torch's."""
    ref, wr = eval_pair(kind)
    opt = wr.optimizer(cls=O.SGD, lr=0.1, momentum=0.9)
    ro = O.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def each(i):
        if i == 1:
            ref[0].requires_grad_(False)
            (wr.w.module if kind in ("ddp", "zero", "ddp_tp") else wr.m)[0].requires_grad_(False)
    if kind in ("ddp", "zero", "ddp_tp"):
        with pytest.raises(RuntimeError, match="find_unused_parameters"):
            steps(wr, opt, ref, ro, each=each)
        return
    steps(wr, opt, ref, ro, each=each)
    assert_one_device(wr, ref)


NO_DEEPCOPY = ("fully_shard", "fsdp_tp", "fully_shard_tp", "zero3_tp")


@pytest.mark.parametrize("kind", KINDS)
def test_an_averaged_model_ema_of_the_module_is_one_devices_or_raises(kind):
    """``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))`` of the user's
    module, updated after each step: one device's EMA; where the module's parameters live
    in flat shards (deepcopy refuses, as FSDP2's) the error names the fix."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    ref, wr = eval_pair(kind)
    if kind in NO_DEEPCOPY:
        with pytest.raises(NotImplementedError, match="deepcopy the module before"):
            AveragedModel(wr.m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        return
    rema = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    wema = AveragedModel(wr.m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    steps(wr, wr.optimizer(cls=O.SGD, lr=0.1), ref, O.SGD(ref.parameters(), lr=0.1),
          each=lambda i: (wema.update_parameters(wr.m), rema.update_parameters(ref)))
    for a, b in zip(wema.module.parameters(), rema.module.parameters()):
        torch.testing.assert_close(plain(a).detach(), b.detach(), rtol=1e-5, atol=1e-6)
