"""optim8: ``torch.optim.<any>(model.parameters())`` over a tensor-parallel model's
DistTensor parameters steps as PyTorch DTensor's does (``workbench/parallel/optim_dist.py``):
every torch 2.13 optimizer held to one device (same seed, same steps; ``foreach`` None and
True), its states DistTensors with the parameter's placements, ``state_dict()`` keyed by
index as torch's (was a KeyError), ``load_state_dict`` / ``torch.save`` / ``torch.load``
round trips, clip / schedulers / ``GradScaler`` / ``zero_grad``, a sequence-parallel and
vocabulary-parallel model trained as one device, PyTorch DTensor's state placements as the
oracle; and what is refused (fused, differentiable, SparseAdam, LBFGS, a Partial gradient,
one device's state into the parallel optimizer and back) before anything changes.
(Before: every DistTensor parameter was refused, tests/test_optim_refusal.py, removed.)
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.dtensor_support import LocalTensorMode, oracle  # noqa: F401

R, S = wb.Replicate, wb.Shard
O = torch.optim
PLAN = {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()}

# one setting each that exercises the optimizer's options (torch 2.13's signatures)
OPTIMIZERS = {
    "SGD": (O.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "SGD-damp-max": (O.SGD, dict(lr=0.1, momentum=0.9, dampening=0.5, maximize=True)),
    "Adam-amsgrad": (O.Adam, dict(lr=1e-2, amsgrad=True)),
    "AdamW": (O.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Adamax": (O.Adamax, dict(lr=1e-2)),
    "NAdam": (O.NAdam, dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1,
                            momentum_decay=0.005)),
    "RAdam": (O.RAdam, dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1)),
    "Adagrad": (O.Adagrad, dict(lr=1e-2, lr_decay=0.01)),
    "Adadelta": (O.Adadelta, dict(lr=0.5)),
    "RMSprop": (O.RMSprop, dict(lr=1e-2, centered=True, momentum=0.5)),
    "ASGD": (O.ASGD, dict(lr=1e-2, t0=1)),
    "Rprop": (O.Rprop, dict(lr=1e-2)),
    "Adafactor": (O.Adafactor, dict(lr=1e-2)),
}


def _mk(h=12):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, h), nn.ReLU(), nn.Linear(h, 8))


def _pair(tp=2, h=12):
    ref, m = _mk(h), _mk(h)
    mesh = wb.Mesh.grid(tp, ["tp"])
    wb.parallelize_module(m, mesh, PLAN)
    return ref, m, mesh


def _steps(m, ref, opt, ro, mesh, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        opt.zero_grad()
        ro.zero_grad()
        ((m(wb.shard_tensor(x, mesh, [R()])).full() - y) ** 2).mean().backward()
        ((ref(x) - y) ** 2).mean().backward()
        opt.step()
        ro.step()


def _same_params(m, ref, tol=1e-6):
    for (n, a), b in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.full_tensor(), b.detach(), rtol=tol, atol=tol, msg=n)


def _full(v):
    return v.full_tensor() if isinstance(v, wb.DistTensor) else v


# ---- every optimizer, foreach None and True -------------------------------------------------

@pytest.mark.parametrize("foreach, tp", [(None, 2), (True, 2), (None, 4)])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_steps_as_one_device(name, foreach, tp):
    """tp 4: 10 hidden features, uneven shards (3, 3, 3, 1: torch.chunk's)."""
    cls, kw = OPTIMIZERS[name]
    ref, m, mesh = _pair(tp, h=10 if tp == 4 else 12)
    opt = cls(m.parameters(), foreach=foreach, **kw)
    ro = cls(ref.parameters(), foreach=foreach, **kw)
    _steps(m, ref, opt, ro, mesh)
    _same_params(m, ref)
    sd, rsd = opt.state_dict(), ro.state_dict()
    assert sd["param_groups"] == rsd["param_groups"]
    assert list(sd["state"]) == list(rsd["state"]) == [0, 1, 2, 3]     # indices, as torch
    for i, p in enumerate(m.parameters()):
        assert list(sd["state"][i]) == list(rsd["state"][i])
        for k, v in sd["state"][i].items():
            want = rsd["state"][i][k]
            torch.testing.assert_close(_full(v), want, rtol=1e-5, atol=1e-6, msg=f"{i} {k}")
            if want.shape == p.shape and want.dim():        # a state of the parameter's shape
                assert isinstance(v, wb.DistTensor) and v.placements == p.placements, (i, k)
            elif not isinstance(v, wb.DistTensor):          # step, eta, mu: plain, as DTensor's
                assert want.dim() == 0


def test_tensor_lr_and_betas_step_as_one_device():
    """``lr`` / ``betas`` as 0-d tensors (torch reads them as numbers in ``addcdiv_``'s
    ``value=``): raised "Tensor.item() cannot be called on meta tensors" from the
    DistTensor ops' meta checks."""
    ref, m, mesh = _pair()
    kw = dict(lr=torch.tensor(1e-2), betas=(torch.tensor(0.9), torch.tensor(0.99)))
    opt, ro = O.AdamW(m.parameters(), **kw), O.AdamW(ref.parameters(), **kw)
    _steps(m, ref, opt, ro, mesh)
    _same_params(m, ref)


def test_adafactor_factored_states_are_replicated_and_exact():
    """Adafactor's row / column variances (``p.grad.new_zeros``) of a sharded weight:
    Replicate, their values one device's (held above); pinned so a layout change is seen."""
    ref, m, mesh = _pair()
    opt, ro = O.Adafactor(m.parameters(), lr=1e-2), O.Adafactor(ref.parameters(), lr=1e-2)
    _steps(m, ref, opt, ro, mesh, n=2)
    st = opt.state[m[0].weight]
    assert st["row_var"].placements == st["col_var"].placements == (R(),)


# ---- refused: what torch cannot step exactly here -------------------------------------------

@pytest.mark.parametrize("cls", [O.SGD, O.Adam, O.AdamW, O.Adagrad])
def test_fused_is_refused_naming_foreach(cls):
    _, m, _ = _pair()
    with pytest.raises(RuntimeError, match=r"fused=True\) over DistTensor parameters.*"
                                           r"pass foreach=True or leave foreach=None"):
        cls(m.parameters(), lr=0.1, fused=True)


@pytest.mark.parametrize("cls", [O.SGD, O.Adam, O.RMSprop])
def test_differentiable_is_refused(cls):
    _, m, _ = _pair()
    with pytest.raises(RuntimeError, match=r"differentiable=True\) over DistTensor"):
        cls(m.parameters(), lr=0.1, differentiable=True)


@pytest.mark.parametrize("cls, why", [(O.SparseAdam, "sparse gradients"),
                                      (O.LBFGS, r"flattens every gradient")])
def test_sparse_adam_and_lbfgs_are_refused(cls, why):
    _, m, _ = _pair()
    with pytest.raises(TypeError, match=rf"torch.optim.{cls.__name__} over DistTensor "
                                        rf"parameters: .*{why}.*use another torch.optim"):
        cls(m.parameters())
    O.LBFGS(_mk().parameters())         # plain parameters: torch's own


def test_capturable_on_cpu_raises_as_one_device():
    ref, m, mesh = _pair()
    errs = []
    for mod in (m, ref):
        opt = O.Adam(mod.parameters(), lr=1e-2, capturable=True)
        x = torch.randn(2, 8)
        out = mod(wb.shard_tensor(x, mesh, [R()]) if mod is m else x)
        _full(out).sum().backward()
        with pytest.raises(AssertionError) as e:
            opt.step()
        errs.append(str(e.value))
    assert errs[0] == errs[1] and "capturable=True" in errs[0]


# ---- add_param_group: torch's checks --------------------------------------------------------

def test_add_param_group_keeps_torchs_checks():
    _, m, _ = _pair()
    ps = list(m.parameters())
    named = O.AdamW(m.named_parameters(), lr=1e-2)
    assert named.param_groups[0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert named.state_dict()["param_groups"][0]["param_names"][0] == "0.weight"
    gen = O.SGD([{"params": m.parameters()}], lr=0.1)  # a generator in a group
    gen.add_param_group({"params": (q for q in [_mk()[0].weight])})
    assert gen.param_groups[0]["params"] == ps and len(gen.param_groups[1]["params"]) == 1
    one = O.SGD([{"params": ps[0]}], lr=0.1)            # a single DistTensor in a group
    assert one.param_groups[0]["params"] == [ps[0]] and one.param_groups[0]["momentum"] == 0
    with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
        O.SGD(ps[0], lr=0.1)                            # torch's refusal of one tensor
    with pytest.warns(UserWarning, match="duplicate parameters"):
        O.SGD([ps[0], ps[0]], lr=0.1)
    opt = O.SGD(ps[:2], lr=0.1)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [ps[1], ps[2]]})
    with pytest.raises(ValueError, match="with/without names"):
        opt.add_param_group({"params": [("2.weight", ps[2])]})
    with pytest.raises(TypeError, match="ordered collections"):
        opt.add_param_group({"params": {ps[2]}})
    with pytest.raises(ValueError, match="non-leaf"):
        O.SGD([ps[0] * 2], lr=0.1)
    assert len(opt.param_groups) == 1                   # the refused groups left no trace
    opt.add_param_group({"params": ps[2:], "lr": 0.01})
    assert opt.param_groups[1]["lr"] == 0.01 and opt.param_groups[1]["momentum"] == 0


def test_plain_parameters_are_torchs_as_before():
    opt = O.SGD(_mk().parameters(), lr=0.1)
    assert len(opt.param_groups[0]["params"]) == 4
    with pytest.raises(TypeError, match="optimizer can only optimize Tensors"):
        O.SGD([1.0], lr=0.1)
    with pytest.raises(TypeError, match="optimizer can only optimize Tensors, but one of the "
                                        "params is float"):
        O.SGD([wb.distribute_tensor(torch.ones(2), wb.Mesh.grid(2, ["tp"])), 1.0], lr=0.1)


def test_mixed_groups_and_a_group_added_later_train_as_one_device():
    """A plain parameter beside DistTensors in one group, and the tensor-parallel
    layer's parameters added as a second group after the first step."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
            self.mlp = _mk()

        def forward(self, x):
            return self.mlp(x) * self.scale

    torch.manual_seed(0)
    ref = M()
    m, mesh = copy.deepcopy(ref), wb.Mesh.grid(2, ["tp"])
    wb.parallelize_module(m.mlp, mesh, PLAN)
    assert type(m.scale) is nn.Parameter
    ps, qs = list(m.parameters()), list(ref.parameters())    # scale, then the MLP's
    opt = O.Adam([ps[0], ps[1]], lr=1e-2)
    ro = O.Adam([qs[0], qs[1]], lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        if step == 1:
            opt.add_param_group({"params": ps[2:], "lr": 3e-2})
            ro.add_param_group({"params": qs[2:], "lr": 3e-2})
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        opt.zero_grad()
        ro.zero_grad()
        ((_full(m(wb.shard_tensor(x, mesh, [R()]))) - y) ** 2).sum().backward()
        ((ref(x) - y) ** 2).sum().backward()
        opt.step()
        ro.step()
    for a, b in zip(ps, qs):
        torch.testing.assert_close(_full(a).detach(), b.detach(), rtol=1e-6, atol=1e-6)
    assert list(opt.state_dict()["state"]) == list(ro.state_dict()["state"]) == list(range(5))


# ---- gradients: never a partial sum stepped as the gradient ---------------------------------

def test_a_partial_gradient_is_refused_before_anything_changes():
    """Under ``DistributedDataParallel.no_sync()`` a DistTensor parameter's gradient is
    Partial over dp (each rank's share); torch.optim over ``ddp.module.parameters()``
    stepped it unreduced before (SGD with momentum raised a shape error, Adam summed)."""
    torch.manual_seed(0)
    m, mesh = _mk(), wb.Mesh.grid((2, 2), ["dp", "tp"])
    wb.parallelize_module(m, mesh, PLAN)
    ddp = wb.DistributedDataParallel(m, mesh, dim="dp")
    opt = O.SGD(ddp.module.parameters(), lr=0.1, momentum=0.9)
    before = [p.full_tensor().clone() for p in m.parameters()]
    with ddp.no_sync():
        ddp(wb.shard_tensor(torch.randn(4, 8), mesh, [S(0), R()])).full().sum().backward()
    assert m[0].weight.grad.placements[0].is_partial()
    with pytest.raises(RuntimeError, match=r"SGD.step\(\): parameter 0's gradient is "
                                           r".*Partial over \['dp'\].*outside no_sync"):
        opt.step()
    assert not opt.state
    for p, b in zip(m.parameters(), before):
        assert torch.equal(p.full_tensor(), b)


def test_the_ddp_way_trains_as_one_device():
    """The way the refusal used to name still works: DDP over (1, tp), torch.optim over
    ``ddp.parameters()``."""
    ref, m = _mk(), _mk()
    mesh = wb.Mesh.grid((1, 2), ["dp", "tp"])
    wb.parallelize_module(m, mesh, PLAN)
    ddp = wb.DistributedDataParallel(m, mesh, dim="dp")
    opt, ro = O.AdamW(ddp.parameters(), lr=1e-2), O.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    for _ in range(3):
        opt.zero_grad()
        ro.zero_grad()
        ((ddp(wb.shard_tensor(x, mesh, [R(), R()])).full() - y) ** 2).mean().backward()
        ((ref(x) - y) ** 2).mean().backward()
        opt.step()
        ro.step()
    _same_params(m, ref)


# ---- a sequence-parallel, vocabulary-parallel model: clip, schedulers, zero_grad ------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.norm, self.w1, self.w2 = nn.LayerNorm(6), nn.Linear(6, 8), nn.Linear(8, 6)
        self.norm2 = nn.LayerNorm(6)

    def forward(self, ids):
        return self.norm2(self.w2(F.relu(self.w1(self.norm(self.emb(ids))))))


SP_PLAN = {"emb": wb.RowwiseParallel(input_layouts=R(), output_layouts=S(1)),
           "norm": wb.SequenceParallel(), "w1": wb.ColwiseParallel(input_layouts=S(1)),
           "w2": wb.RowwiseParallel(output_layouts=S(1)), "norm2": wb.SequenceParallel()}


@pytest.mark.parametrize("sched, set_to_none", [("StepLR", True), ("OneCycleLR", False)])
def test_sequence_and_vocab_parallel_training_equals_one_device(sched, set_to_none):
    torch.manual_seed(7)
    ref = Block()
    m = wb.parallelize_module(copy.deepcopy(ref), wb.Mesh.grid(2, ["tp"]), SP_PLAN)
    foreach = not set_to_none           # zero_grad(set_to_none=False) by torch._foreach_zero_
    opt = O.AdamW(m.parameters(), lr=1e-2, foreach=foreach)
    ro = O.AdamW(ref.parameters(), lr=1e-2, foreach=foreach)
    mk = {"StepLR": lambda o: O.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
          "OneCycleLR": lambda o: O.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=8)}
    s, rs = mk[sched](opt), mk[sched](ro)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids, w = torch.randint(0, 10, (2, 4), generator=g), torch.randn(2, 4, 6, generator=g)
        opt.zero_grad(set_to_none=set_to_none)
        ro.zero_grad(set_to_none=set_to_none)
        (m(ids).full() * w).sum().backward()
        (ref(ids) * w).sum().backward()
        # a norm's Replicate weight: its gradient is summed over tp in backward here
        # (DTensor leaves it Partial and sums it inside the step's ops)
        assert m.norm.weight.grad.placements == (R(),)
        n = nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        rn = nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(_full(n), rn)
        opt.step()
        ro.step()
        s.step()
        rs.step()
    assert opt.param_groups[0]["lr"] == ro.param_groups[0]["lr"]
    _same_params(m, ref)
    if not set_to_none:
        opt.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.full_tensor().any() for p in m.parameters())


# ---- state_dict, load_state_dict, torch.save / torch.load -----------------------------------

def test_state_dict_save_load_resumes_as_one_device():
    ref, m, mesh = _pair()
    opt, ro = O.Adam(m.parameters(), lr=1e-2, amsgrad=True), O.Adam(ref.parameters(), lr=1e-2,
                                                                    amsgrad=True)
    _steps(m, ref, opt, ro, mesh, n=2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)                                # weights_only=True, torch's default
    assert isinstance(sd["state"][0]["exp_avg"], wb.DistTensor)
    assert sd["state"][0]["exp_avg"].placements == m[0].weight.placements
    fresh = O.Adam(m.parameters(), lr=0.5)              # lr comes back from the dict
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["lr"] == 1e-2 and fresh.param_groups[0]["amsgrad"]
    assert fresh.state[m[2].weight]["max_exp_avg_sq"].placements == (S(1),)
    _steps(m, ref, fresh, ro, mesh, n=2, seed=5)
    _same_params(m, ref)


@pytest.mark.parametrize("kind", ["Adam-amsgrad", "Adafactor", "ASGD"])
def test_one_devices_state_loads_into_the_parallel_optimizer_and_back(kind):
    """PyTorch DTensor loads either as it is and its next step raises ("got mixed
    torch.Tensor and DTensor"); here one device's states are laid out as the DistTensor
    parameters (Adafactor's factored ones replicated, 0-d ones plain) and a parallel
    optimizer's are gathered for plain parameters: both go on as one device."""
    cls, kw = OPTIMIZERS[kind]
    ref, m, mesh = _pair()
    opt, ro = cls(m.parameters(), **kw), cls(ref.parameters(), **kw)
    _steps(m, ref, opt, ro, mesh, n=2)
    saved_ref, saved_par = copy.deepcopy(ro.state_dict()), copy.deepcopy(opt.state_dict())
    m2, ref2 = copy.deepcopy(ref), copy.deepcopy(ref)       # both at the same 2 steps
    wb.parallelize_module(m2, mesh, PLAN)
    into_par, into_ref = cls(m2.parameters(), **kw), cls(ref2.parameters(), **kw)
    into_par.load_state_dict(saved_ref)
    into_ref.load_state_dict(saved_par)
    assert isinstance(saved_ref["state"][0]["exp_avg" if "Adam" in kind else "step"],
                      torch.Tensor)                         # the input is left as it was
    for p in m2.parameters():
        for k, v in into_par.state[p].items():
            assert isinstance(v, wb.DistTensor) == (v.dim() > 0), k
            if v.dim() and v.shape == p.shape:
                assert v.placements == p.placements, k
    assert not any(isinstance(v, wb.DistTensor) for st in into_ref.state.values()
                   for v in st.values())
    _steps(m2, ref, into_par, ro, mesh, n=2, seed=9)     # parallel from one device's state
    _same_params(m2, ref)
    _steps(m, ref2, opt, into_ref, mesh, n=2, seed=9)    # one device from the parallel one
    _same_params(m, ref2)


def test_checkpoint_helpers_move_the_state_between_one_device_and_tensor_parallel():
    """wb.checkpoint's get/set_optimizer_state_dict (torch.distributed.checkpoint.
    state_dict's): a fresh optimizer gets its states (``_init_optim_state``, which set
    ``p.grad`` and raised for DistTensors); a one-device optimizer's full states load into
    the tensor-parallel one, laid out as its parameters (were refused: plain states)."""
    from workbench.checkpoint import (StateDictOptions, get_optimizer_state_dict,
                                      set_optimizer_state_dict)
    ref, m, mesh = _pair()
    opt, ro = O.AdamW(m.parameters(), lr=1e-2), O.AdamW(ref.parameters(), lr=1e-2)
    fresh = get_optimizer_state_dict(m, opt)
    get_optimizer_state_dict(ref, ro)               # torch's: one step at lr 0 on both
    assert fresh["state"]["0.weight"]["exp_avg"].placements == (S(0),)
    assert not fresh["state"]["0.weight"]["exp_avg"].full_tensor().any()
    _same_params(m, ref)
    _steps(m, ref, opt, ro, mesh, n=2)
    full = get_optimizer_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))
    rsd = get_optimizer_state_dict(ref, ro)
    for fqn, st in rsd["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(full["state"][fqn][k], v, rtol=1e-5, atol=1e-7)
    m2 = copy.deepcopy(ref)
    wb.parallelize_module(m2, mesh, PLAN)
    o2 = O.AdamW(m2.parameters(), lr=0.5)
    set_optimizer_state_dict(m2, o2, copy.deepcopy(rsd))    # one device's, into TP
    assert o2.state[m2[2].weight]["exp_avg"].placements == (S(1),)
    _steps(m2, ref, o2, ro, mesh, n=2, seed=4)
    _same_params(m2, ref)


def test_wb_checkpoint_moves_the_optimizer_from_tp2_to_tp4(tmp_path):
    """``wb.checkpoint.save`` of ``get_state_dict`` over tp 2, ``load`` into tp 4's, then
    ``set_state_dict``: training goes on as one device."""
    from workbench.checkpoint import get_state_dict, set_state_dict
    ref, m, mesh = _pair()
    opt, ro = O.AdamW(m.parameters(), lr=1e-2), O.AdamW(ref.parameters(), lr=1e-2)
    _steps(m, ref, opt, ro, mesh, n=2)
    msd, osd = get_state_dict(m, opt)
    wb.checkpoint.save(tmp_path / "c", {"model": msd, "optim": osd})
    m4, mesh4 = _mk(), wb.Mesh.grid(4, ["tp"])
    wb.parallelize_module(m4, mesh4, PLAN)
    o4 = O.AdamW(m4.parameters(), lr=0.5)
    m4sd, o4sd = get_state_dict(m4, o4)
    wb.checkpoint.load(tmp_path / "c", {"model": m4sd, "optim": o4sd})
    set_state_dict(m4, o4, model_state_dict=m4sd, optim_state_dict=o4sd)
    assert o4.state[m4[0].weight]["exp_avg"].placements == (S(0),)
    assert m4[0].weight.mesh == mesh4 and float(o4.state[m4[0].weight]["step"]) == 2
    _steps(m4, ref, o4, ro, mesh4, n=2, seed=6)
    _same_params(m4, ref)


# ---- torch.amp.GradScaler -------------------------------------------------------------------

def test_grad_scaler_loop_equals_one_device():
    """unscale_ (torch asserted the parameters are torch.Tensors), clip, step, update; the
    third step's scale overflows the gradients to inf: skipped on both, scale halved."""
    ref, m, mesh = _pair()
    opt, ro = O.SGD(m.parameters(), lr=0.1, momentum=0.9), O.SGD(ref.parameters(), lr=0.1,
                                                                 momentum=0.9)
    sc, rsc = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2))
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        if step == 2:
            x = x * 1e30                                    # scaled gradients overflow
        for mod, o, s, inp in ((m, opt, sc, wb.shard_tensor(x, mesh, [R()])),
                               (ref, ro, rsc, x)):
            o.zero_grad()
            s.scale(((_full(mod(inp)) - y) ** 2).mean()).backward()
            s.unscale_(o)
            nn.utils.clip_grad_norm_(mod.parameters(), 1.0)
            s.step(o)
            s.update()
        assert sc.get_scale() == rsc.get_scale()
        _same_params(m, ref)
    assert sc.get_scale() == 2.0 ** 9


# ---- torch.distributed ------------------------------------------------------------------------

@pytest.mark.slow
def test_the_same_program_under_torchrun(tmp_path_factory):
    """tests/dist_scripts/optim8_check.py, 2 gloo processes of tp: AdamW (foreach None,
    True), SGD, the torch.save / torch.load resume, one device's state loaded, a
    GradScaler loop: one device's parameters (measured 4.5e-8 at most), the states laid
    out as the parameters."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "optim8_check.py")      # the shared launch
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        for key in ("adamw", "adamw_foreach", "sgd", "resumed", "from_one_device", "scaler"):
            assert r[key] < 1e-6, (key, r)
        assert r["adamw_placed"] and r["adamw_foreach_placed"] and r["sgd_placed"], r
        assert r["scales"] == [2.0 ** 9] * 2, r        # the overflow found on both sides


# ---- PyTorch DTensor as the oracle (last: its fake process group lives until the module
# ends, and wb.checkpoint.save reads an initialized group as torch.distributed) ----------

def test_state_placements_are_pytorch_dtensors(oracle):  # noqa: F811
    """PyTorch's own parallelize_module + AdamW on the same sequence-parallel block (without
    the embedding) under LocalTensorMode: the same state indices, keys and placements."""
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    from workbench.parallel.interop import to_dtensor_placements

    class B(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.w1, self.w2 = nn.LayerNorm(6), nn.Linear(6, 8), nn.Linear(8, 6)

        def forward(self, x):
            return self.w2(F.relu(self.w1(self.norm(x))))

    torch.manual_seed(0)
    ref, x = B(), torch.randn(2, 4, 6)
    with LocalTensorMode(2):
        from torch.distributed.tensor import distribute_tensor
        mesh = oracle.mesh((2,))
        theirs = parallelize_module(copy.deepcopy(ref), mesh, {
            "norm": SequenceParallel(), "w1": ColwiseParallel(input_layouts=DShard(1)),
            "w2": RowwiseParallel(output_layouts=DShard(1))})
        to = O.AdamW(theirs.parameters(), lr=1e-2)
        theirs(distribute_tensor(x, mesh, [DShard(1)])).sum().backward()
        to.step()
        want = {i: {k: tuple(getattr(v, "placements", ())) for k, v in st.items()}
                for i, st in to.state_dict()["state"].items()}
    ours = wb.parallelize_module(copy.deepcopy(ref), wb.Mesh.grid(2, ["tp"]), {
        "norm": wb.SequenceParallel(), "w1": wb.ColwiseParallel(input_layouts=S(1)),
        "w2": wb.RowwiseParallel(output_layouts=S(1))})
    opt = O.AdamW(ours.parameters(), lr=1e-2)
    ours(wb.shard_tensor(x, wb.Mesh.grid(2, ["tp"]), [S(1)])).full().sum().backward()
    opt.step()
    got = {i: {k: to_dtensor_placements(v.placements) if isinstance(v, wb.DistTensor) else ()
               for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
    assert got == want
