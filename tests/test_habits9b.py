"""A PyTorch user's habits on the wrappers, habits9's second sweep (habits9b; the file
test_habits9.py holds the first).  habits15's sweep (DDP, FSDP, fully_shard, DDP +
ZeroRedundancyOptimizer on 4 simulated dp ranks; the same, ZeRO-1/2 and Zero3 over tensor
parallelism on 2 x 2), each habit held to one device's plain PyTorch, or a raise naming
the fix.  Each test failed before its fix.

1. A module reached under two names (``nn.Sequential(l, act, l)``, a shared layer) on
   simulated DDP: the second forward raised "the module's parameter '0.weight' was
   assigned after wrapping", the user having assigned nothing (torch's ``functional_call``
   left the shared module holding rank N-1's row: ``ranks._restore_places``);
2. ``p.register_hook(fn)`` on a wrapped parameter: ``fn`` got the storage's gradient
   (DDP ``(4, 6, 3)``, FSDP / fully_shard ``(4, 5)``): a gradient-centralization hook
   0.060 (DDP) / 0.120 (FSDP) off one device's after two steps, silently; now the
   module's gradient, once a backward, and its return goes back through the wrapper's
   reduction (``laid_out_hooks``);
3. ``p.register_post_accumulate_grad_hook(fn)`` (torch's optimizer-step-in-backward
   recipe): FSDP / fully_shard's ``p.grad`` read as the storage ``(4, 5)`` inside ``fn``;
   now the module's (an AdamW step per parameter in the hook: one device's model);
4. hooks registered on the module's parameters before wrapping were dropped with the
   parameters the wrapper replaced (count 0, a halving hook 0.018 off one device's after
   two steps, every wrapper): ``register_hook`` now moves to the wrapper's parameter,
   ``register_post_accumulate_grad_hook`` raises naming the fix (its ``fn(p)`` would get a
   parameter the user's code does not hold), and ``parallelize_module`` / ``parallelize``
   refuse both;
5. over tensor parallelism: DDP's replica storage took the hook and gave it ``(2, 2, 3,
   3)`` (a clamping hook 0.010 off after two steps, silently), a DistTensor's
   ``register_hook`` raised the dispatcher's NoRuleError advising
   ``allow_replicate_fallback``, under which the hook went on a gathered copy and never
   ran: each now raises naming the fix;
6. a ``register_hook`` with FSDP's ``no_sync()`` / fully_shard's
   ``set_requires_gradient_sync(False)``: the hook got None inside the first backward
   (the gradients are held unsharded, reduced summed at the synced backward, where the
   hook would run once on the sum): now the block raises naming the fix, before it runs;
7. ``weight_norm`` / ``spectral_norm`` on a layer after wrapping raised naming the wrong
   fix (``p.full_tensor().requires_grad_()``; "tie before wrapping"): now "register the
   parametrization before wrapping", which trains as one device.
"""
import pytest
import torch
from torch import nn

import workbench as wb

from .test_habits15 import OVER_TP, PLAIN, Wrapped, batches, close, full_state, mk


def mse(o, y):
    return ((o - y) ** 2).mean()


def pair(kind, m=None, ref=None):
    ref, wr = (mk() if ref is None else ref), Wrapped(kind, m)
    ref.eval()
    wr.w.eval()
    return ref, wr


def train(ref, wr, opt=None, ro=None, n=2):
    ro = ro or torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = opt or wr.optimizer(cls=torch.optim.SGD, lr=0.1)
    for x, y in batches(n):
        ro.zero_grad()
        opt.zero_grad()
        mse(ref(x), y).backward()
        mse(wr.out(x), y).backward()
        ro.step()
        opt.step()


def assert_same(wr, ref):
    got, want = full_state(wr.m.state_dict()), ref.state_dict()
    assert list(got) == list(want)
    for k in want:
        close(got[k], want[k])


# ---- 1. a shared module on simulated DDP ---------------------------------------------------
def _shared():
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    return nn.Sequential(lin, nn.Tanh(), lin)


@pytest.mark.parametrize("kind", ["ddp", "zero", "fsdp", "fully_shard"])
def test_a_shared_module_trains_as_one_device(kind):
    """Before (DDP, DDP + ZeroRedundancyOptimizer): the second forward raised "parameter
    '0.weight' was assigned after wrapping"; FSDP / fully_shard pinned (they passed)."""
    mesh = wb.Mesh.grid(4, ["dp"])
    ref, m = _shared(), _shared()
    w = {"ddp": lambda: wb.DistributedDataParallel(m, mesh),
         "zero": lambda: wb.DistributedDataParallel(m, mesh),
         "fsdp": lambda: wb.FullyShardedDataParallel(m, mesh),
         "fully_shard": lambda: wb.fully_shard(m, mesh=mesh)}[kind]()
    ro = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = wb.ZeroRedundancyOptimizer(w.parameters(), torch.optim.SGD, mesh, lr=0.1) \
        if kind == "zero" else torch.optim.SGD(w.parameters(), lr=0.1)
    held = list(w.parameters())
    assert len(held) == 2
    for x, y in batches(3):
        ro.zero_grad()
        opt.zero_grad()
        mse(ref(x), y).backward()
        mse(w(x), y).backward()
        ro.step()
        opt.step()
        assert m[0].weight is m[2].weight and any(m[0].weight is p for p in held)
    got = full_state(m.state_dict())
    assert list(got) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        close(got[k], v)
    assert not torch.equal(ref[0].weight, _shared()[0].weight)     # it trained


# ---- 2. Tensor.register_hook on a wrapped parameter ---------------------------------------
def centralized(g):
    """Gradient centralization (Yong et al. 2020, "Gradient Centralization", ECCV): a
    weight's gradient less its mean over every dim but the first, as a parameter hook."""
    return g - g.mean(dim=tuple(range(1, g.dim())), keepdim=True) if g.dim() > 1 else g


@pytest.mark.parametrize("kind", PLAIN)
def test_a_parameters_gradient_hook_sees_one_devices_gradient(kind):
    """Before: the hook got the storage's gradient (DDP (4, 6, 3), FSDP (4, 5)): the
    centralized model 0.060 (DDP) / 0.120 (FSDP, fully_shard) off one device's after two
    SGD steps, silently."""
    ref, wr = pair(kind)
    seen = {"r": [], "w": []}

    def hook(key):
        def fn(g):
            seen[key].append((tuple(g.shape), g.norm().item()))
            return centralized(g)
        return fn
    for p in ref.parameters():
        p.register_hook(hook("r"))
    for p in wr.params():
        p.register_hook(hook("w"))
    train(ref, wr)
    assert len(seen["w"]) == len(seen["r"]) == 8          # once a backward per parameter
    for (sw, nw), (sr, nr) in zip(sorted(seen["w"]), sorted(seen["r"])):
        assert sw == sr
        assert abs(nw - nr) < 1e-6
    assert_same(wr, ref)


@pytest.mark.parametrize("kind", PLAIN)
def test_a_gradient_hook_returning_a_wrong_shape_raises(kind):
    ref, wr = pair(kind)
    wr.params()[0].register_hook(lambda g: g.reshape(-1))
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"returned shape \(18,\).*\(6, 3\)"):
        mse(wr.out(x), y).backward()


# ---- 3. register_post_accumulate_grad_hook: an optimizer step in backward ----------------
@pytest.mark.parametrize("kind", PLAIN)
def test_an_optimizer_step_in_backward_is_one_devices(kind):
    """torch's "optimizer step in backward" recipe (an AdamW per parameter, stepped in
    the parameter's post-accumulate hook).  Before (FSDP / fully_shard): ``p.grad`` read
    as the storage in the hook, (4, 5) for (6, 3).  DDP's bucket may not be all-reduced
    yet when torch runs the hook: a norm of ``p.grad`` there raises (rank_grads), the
    step is one device's (pinned)."""
    ref, wr = pair(kind)
    shapes = {"r": [], "w": []}
    norm = kind not in ("ddp", "zero")

    def in_backward(params, key):
        opts = {p: torch.optim.AdamW([p], lr=1e-2) for p in params}

        def fn(p):
            shapes[key].append((tuple(p.grad.shape),
                                round(p.grad.norm().item(), 5) if norm else None))
            opts[p].step()
            opts[p].zero_grad()
        for p in params:
            p.register_post_accumulate_grad_hook(fn)
    in_backward(list(ref.parameters()), "r")
    in_backward(wr.params(), "w")
    for x, y in batches(3):
        mse(ref(x), y).backward()
        mse(wr.out(x), y).backward()
    assert sorted(shapes["w"]) == sorted(shapes["r"]) and len(shapes["r"]) == 12
    assert_same(wr, ref)
    assert not torch.equal(ref[0].weight, mk()[0].weight)


# ---- 4. hooks registered before wrapping --------------------------------------------------
@pytest.mark.parametrize("kind", PLAIN)
def test_a_gradient_hook_registered_before_wrapping_still_runs(kind):
    """Before: count 0 and 0.018 off one device's (the hook halved nothing)."""
    count = {"r": 0, "w": 0}

    def halve(key):
        def fn(g):
            count[key] += 1
            return g * 0.5
        return fn
    m, r = mk(), mk()
    r[0].weight.register_hook(halve("r"))
    m[0].weight.register_hook(halve("w"))
    ref, wr = pair(kind, m, r)
    train(ref, wr)
    assert count == {"r": 2, "w": 2}
    assert_same(wr, ref)


@pytest.mark.parametrize("kind", PLAIN)
def test_a_post_accumulate_hook_registered_before_wrapping_raises(kind):
    """Before: never called, silently (an optimizer stepped in it: nothing trained)."""
    m = mk()
    m[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(RuntimeError, match="register_post_accumulate_grad_hook.*Register "
                       r"it after wrapping"):
        Wrapped(kind, m)
    assert all(type(p) is nn.Parameter for p in m.parameters())     # nothing replaced
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("kind", OVER_TP)
@pytest.mark.parametrize("how", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_hook_before_tensor_parallelism_raises(kind, how):
    """Before: dropped with the parameter parallelize_module replaced, silently."""
    m = mk()
    getattr(m[0].weight, how)(lambda a: None)
    with pytest.raises(NotImplementedError, match=r"parallelize_module: parameter '0\.weight' "
                       r"has a gradient hook.*never run.*p\.grad"):
        Wrapped(kind, m)


# ---- 5. hooks over tensor parallelism -----------------------------------------------------
@pytest.mark.parametrize("kind", OVER_TP)
@pytest.mark.parametrize("how", ["register_hook", "register_post_accumulate_grad_hook"])
@pytest.mark.parametrize("fallback", [False, True])
def test_a_hook_on_a_tensor_parallel_parameter_raises_naming_the_fix(kind, how, fallback):
    """Before: DDP over DistTensors ran the hook on the replicas' storage (2, 2, 3, 3)
    (a clamp 0.010 off one device's); a DistTensor raised NoRuleError advising
    allow_replicate_fallback, under which the hook never ran (ZeRO-1/2)."""
    ref, wr = pair(kind)
    p = wr.params()[0]
    with pytest.raises((RuntimeError, NotImplementedError),
                       match=r"loss\.backward\(\).*p\.grad.*optimizer\.step\(\)"):
        if fallback:
            with wb.allow_replicate_fallback():
                getattr(p, how)(lambda a: None)
        else:
            getattr(p, how)(lambda a: None)
    train(ref, wr)                          # the loop goes on as one device's
    assert_same(wr, ref)


# ---- 6. a gradient hook with accumulation without communication --------------------------
@pytest.mark.parametrize("kind", PLAIN)
def test_a_gradient_hook_with_no_sync_is_one_devices_or_raises(kind):
    """DDP's ``no_sync()``: the hook runs on each micro-batch's gradient, one device's
    (pinned: it held before).  FSDP's ``no_sync()`` / fully_shard's
    ``set_requires_gradient_sync(False)`` hold the micro-batches' gradients and reduce
    their sum at the synced backward, where the hook would run once on the sum: raises
    naming the fix before the block (before: the hook got None inside the first backward,
    an AttributeError from the user's own code)."""
    ref, wr = pair(kind)
    for p in ref.parameters():
        p.register_hook(lambda g: g.clamp(-0.01, 0.01))
    for p in wr.params():
        p.register_hook(lambda g: g.clamp(-0.01, 0.01))
    ro = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = wr.optimizer(cls=torch.optim.SGD, lr=0.1)
    bs = batches(3)
    for x, y in bs:
        mse(ref(x), y).backward()
    if kind in ("fsdp", "fully_shard"):
        with pytest.raises(RuntimeError, match=r"gradient hook.*once on the micro-batches' "
                           r"summed gradient.*synchronization on"):
            with wr.no_sync():
                pass
        assert all(p.grad is None for p in wr.params())
        return
    with wr.no_sync():
        for x, y in bs[:2]:
            mse(wr.out(x), y).backward()
    mse(wr.out(bs[2][0]), bs[2][1]).backward()
    ro.step()
    opt.step()
    assert_same(wr, ref)


# ---- 7. weight_norm / spectral_norm on a wrapped layer -----------------------------------
PARAMETRIZATIONS = {"weight_norm": nn.utils.parametrizations.weight_norm,
                    "spectral_norm": nn.utils.parametrizations.spectral_norm}


@pytest.mark.parametrize("kind", PLAIN)
@pytest.mark.parametrize("how", list(PARAMETRIZATIONS))
def test_a_parametrization_after_wrapping_raises_naming_before(kind, how):
    """Before: weight_norm raised "requires_grad_() of a detached alias ... take
    p.full_tensor().requires_grad_()", spectral_norm's next forward "parameter '0.weight'
    was assigned after wrapping ... weight tying": neither the fix."""
    ref, wr = pair(kind)
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="parametriz.*Register the parametrization "
                       "before wrapping"):
        PARAMETRIZATIONS[how](wr.m[0])
        wr.out(x)


@pytest.mark.parametrize("kind", PLAIN)
@pytest.mark.parametrize("how", list(PARAMETRIZATIONS))
def test_a_parametrization_before_wrapping_trains_as_one_device(kind, how):
    """The fix the error names (a pin: it held before); spectral_norm's power-iteration
    buffers too (torch.manual_seed: its u, v start from a draw)."""
    m, r = mk(), mk()
    torch.manual_seed(3)
    PARAMETRIZATIONS[how](m[0])
    torch.manual_seed(3)
    PARAMETRIZATIONS[how](r[0])
    ref, wr = pair(kind, m, r)
    train(ref, wr)
    assert_same(wr, ref)
