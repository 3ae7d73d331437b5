"""An ordinary training loop's habits on every wrapper and on a parallelized module,
on simulated ranks, each held to one device (the same model and data on a plain
nn.Module): state_dict / load_state_dict round trips and strict keys, zero_grad,
requires_grad_, .double() / .float() / .half(), torch's clip_grad_norm_ and
clip_grad_value_ (wb's for DistTensors), and sum losses as torch DDP averages them."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.parallel.strategies.laid_out_whole import storage  # the rows (habits13)
from tests.dist_scripts.wrappers_model import data, loss_fn, make


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))


TP_PLAN = {"0": "colwise", "2": "rowwise"}


def tp_model(mesh):
    return wb.parallelize(mlp(), mesh, TP_PLAN, mesh_dim="tp")


def tp_step(m, mesh, x):
    return m(wb.shard_tensor(x, mesh, ["R"] * mesh.ndim)).pow(2).sum()


# ---- tensor parallel: wb.parallelize ----------------------------------------------------------
@pytest.fixture
def tp():
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    return mesh, tp_model(mesh), mlp()


def test_parallelized_state_dict_holds_distensors_and_loads_a_full_one(tp):
    mesh, m, ref = tp
    sd = m.state_dict()
    assert list(sd) == list(ref.state_dict())
    assert all(isinstance(v, wb.DistTensor) for v in sd.values())
    assert str(sd["0.weight"].placements[1]) == "S(0)"
    assert str(sd["2.weight"].placements[1]) == "S(1)"
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k].full(), v)
    other = mlp(seed=1)
    res = m.load_state_dict(other.state_dict())               # a full state dict copies in
    assert not res.missing_keys and not res.unexpected_keys
    for k, v in other.state_dict().items():
        assert torch.equal(m.state_dict()[k].full(), v), k
    assert m.load_state_dict(sd) is not None                  # its own (sharded) dict too
    keep = {k: v.full().clone() for k, v in m.state_dict().items()}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0.bias"'):
        m.load_state_dict({"0.weight": torch.zeros(8, 6), "2.weight": torch.zeros(6, 8),
                           "2.bias": torch.zeros(6)})
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
        m.load_state_dict({**ref.state_dict(), "extra": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="size mismatch for 0.weight"):
        m.load_state_dict({**ref.state_dict(), "0.weight": torch.zeros(6, 8)}, strict=False)
    for k, v in m.state_dict().items():                       # a failed load copied nothing
        assert torch.equal(v.full(), keep[k]), k
    res = m.load_state_dict({"0.weight": ref[0].weight}, strict=False)
    assert res.missing_keys == ["0.bias", "2.weight", "2.bias"]
    assert repr(m) == repr(ref)                               # the class keeps its name


def test_parallelized_zero_grad_and_requires_grad_reach_the_sharded_weights(tp):
    mesh, m, _ = tp
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    tp_step(m, mesh, x).backward()
    assert all(p.grad is not None for p in m.parameters())
    m.zero_grad(set_to_none=False)
    assert all(float(p.grad.full().abs().sum()) == 0.0 for p in m.parameters())
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    tp_step(m, mesh, x).backward()
    w = m[0].weight
    m.requires_grad_(False)
    assert not any(p.requires_grad for p in m.parameters())
    assert m[0].weight is w and w.grad is not None         # torch keeps the gradient
    m.zero_grad()
    assert not tp_step(m, mesh, x).requires_grad
    m.requires_grad_(True)
    tp_step(m, mesh, x).backward()
    assert all(p.grad is not None for p in m.parameters())


def test_parallelized_double_float_half_convert_every_shard(tp):
    mesh, m, ref = tp
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    w = m[0].weight
    assert m.double() is m and m[0].weight is w               # the same DistTensor, as torch
    assert all(p.dtype == torch.float64 and p.requires_grad for p in m.parameters())
    got = m(wb.shard_tensor(x.double(), mesh, ["R", "R"])).full()
    close(got, ref.double()(x.double()), 1e-12)
    m.float()
    tp_step(m, mesh, x).backward()
    m.half()
    assert {p.dtype for p in m.parameters()} == {torch.float16}
    assert {p.grad.dtype for p in m.parameters()} == {torch.float16}   # torch converts grads too
    m.to(torch.float32)
    assert {p.dtype for p in m.parameters()} == {torch.float32}


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_parallelized_clip_grad_norm_is_one_devices(tp, norm_type):
    mesh, m, ref = tp
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    tp_step(m, mesh, x).backward()
    ref(x).pow(2).sum().backward()
    with wb.trace() as tr:
        got = wb.clip_grad_norm_(m.parameters(), 0.5, norm_type)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
    close(got, want, 1e-5)
    assert got > 0.5                                          # it did clip
    for p, q in zip(m.parameters(), ref.parameters()):
        close(p.grad.full(), q.grad, 1e-5)
    # one scalar all-reduce per sharded gradient (0.weight, 0.bias, 2.weight), no gather
    events = [(e.name, e.label, e.ranks) for e in tr.collectives()]
    # on each of the two tp groups (one per dp rank): ranks (0, 1) and (2, 3)
    assert sorted(events) == sorted([("all_reduce", "clip_grad norm", (0, 1)),
                                     ("all_reduce", "clip_grad norm", (2, 3))] * 3)


def test_parallelized_clip_grad_value_and_torchs_own_clip_error(tp):
    mesh, m, ref = tp
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    tp_step(m, mesh, x).backward()
    ref(x).pow(2).sum().backward()
    wb.clip_grad_value_(m.parameters(), 0.3)
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.3)
    for p, q in zip(m.parameters(), ref.parameters()):
        close(p.grad.full(), q.grad, 1e-5)
    # torch's function on DistTensors: wb's (parallel/clip_grad_torch.py), one device's norm
    close(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0),
          torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0), 1e-5)
    for p, q in zip(m.parameters(), ref.parameters()):
        close(p.grad.full(), q.grad, 1e-5)
    with pytest.raises(TypeError, match=r"\(name, parameter\) pair"):
        wb.clip_grad_norm_(wb.dist_parameters(m), 1.0)
    with pytest.raises(AttributeError, match=r"wb.clip_grad_norm_\(model.parameters"):
        torch.nn.utils.clip_grad_norm_(wb.dist_parameters(m), 1.0)
    assert dict(wb.dist_parameters(m))["0.weight"] is m[0].weight     # still pairs


# ---- DistributedDataParallel (+ ZeroRedundancyOptimizer) ------------------------------------
def ddp_setup(n=4, **kw):
    mesh = wb.Mesh.grid(n, ["dp"])
    kw.setdefault("find_unused_parameters", True)   # the toy's unused parameter, as torch's
    return mesh, wb.DistributedDataParallel(make(), mesh, **kw), make()


def backward_both(w, ref, mesh, step=0):
    ids, y = data(step + 1)[step]
    loss_fn(w(wb.shard_tensor(ids, mesh, ["S(0)"])), wb.shard_tensor(y, mesh, ["S(0)"])) \
        .backward()
    loss_fn(ref(ids), y).backward()


@pytest.mark.parametrize("norm_type,foreach", [(2.0, None), (math.inf, None), (3.0, True)])
def test_ddp_torch_clip_grad_norm_is_one_devices(norm_type, foreach):
    mesh, ddp, ref = ddp_setup()
    backward_both(ddp, ref, mesh)
    got = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05, norm_type, foreach=foreach)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type, foreach=foreach)
    close(got, want)                                          # not sqrt(4) times it
    assert want > 0.05
    for (n, p), q in zip(ddp.named_parameters(), ref.parameters()):
        if q.grad is not None:
            for k in range(4):
                close(storage(p.grad)[k], q.grad)
    torch.nn.utils.clip_grad_value_(ddp.parameters(), 1e-3)
    torch.nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
    for p, q in zip(ddp.parameters(), ref.parameters()):
        if q.grad is not None:
            close(storage(p.grad)[1], q.grad)


@pytest.mark.parametrize("zero", [False, True])
def test_ddp_clip_then_step_is_one_devices_step(zero):
    mesh, ddp, ref = ddp_setup()
    if zero:
        opt = wb.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, mesh, lr=1e-2)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        opt.zero_grad()
        ropt.zero_grad()
        backward_both(ddp, ref, mesh, step)
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        ropt.step()
    got = ddp.full_state_dict()
    for k, v in ref.state_dict().items():
        close(got[k], v)


def test_ddp_clip_inside_no_sync_raises_naming_the_cause():
    mesh, ddp, ref = ddp_setup()
    with ddp.no_sync():
        backward_both(ddp, ref, mesh)
    with pytest.raises(RuntimeError, match="no_sync"):
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)


def test_ddp_state_dict_has_torchs_keys_and_round_trips():
    mesh, ddp, ref = ddp_setup()
    sd = ddp.state_dict()
    assert list(sd) == ["module." + k for k in ref.state_dict()]
    for k, v in ref.state_dict().items():
        assert torch.equal(sd["module." + k], v)              # one rank's tensor, its shape
    assert not ddp.load_state_dict(sd).missing_keys           # its own keys load
    other = make(seed=3)
    ddp.load_state_dict({"module." + k: v for k, v in other.state_dict().items()})
    for (n, p), q in zip(ddp.named_parameters(), other.parameters()):
        assert all(torch.equal(storage(p)[k], q) for k in range(4)), n  # every rank's copy
    ddp.check_replicas()
    keep = ddp.full_state_dict()
    with pytest.raises(RuntimeError, match=r'Missing key\(s\).*"module.emb.weight"'):
        ddp.load_state_dict(ref.state_dict())                 # torch DDP wants the prefix
    with pytest.raises(RuntimeError, match="size mismatch for module.hid.bias"):
        ddp.load_state_dict({**sd, "module.hid.bias": torch.zeros(3)}, strict=False)
    assert all(torch.equal(v, keep[k]) for k, v in ddp.full_state_dict().items())
    plain = make(seed=5)                                      # and into the plain model
    plain.load_state_dict({k[len("module."):]: v for k, v in ddp.state_dict().items()})
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in keep.items())


def test_ddp_zero_grad_requires_grad_and_double():
    mesh, ddp, ref = ddp_setup()
    backward_both(ddp, ref, mesh)
    ddp.zero_grad()
    ref.zero_grad()
    assert all(p.grad is None for p in ddp.parameters())
    ddp.requires_grad_(False)
    ids, y = data(1)[0]
    assert not ddp(wb.shard_tensor(ids, mesh, ["S(0)"])).requires_grad
    with pytest.raises(ValueError, match=r"\['frozen'\].*before wrapping"):
        ddp.requires_grad_(True)                # 'frozen' was frozen when DDP was built
    for n, p in ddp.named_parameters():
        p.requires_grad_(n != "module.frozen")          # torch DDP's names
    assert ddp.double() is ddp
    ref.double()
    assert {p.dtype for p in ddp.parameters()} == {torch.float64}
    opt, ropt = (torch.optim.SGD(w.parameters(), lr=0.1) for w in (ddp, ref))
    backward_both(ddp, ref, mesh)
    opt.step()
    ropt.step()
    got = ddp.full_state_dict()
    for k, v in ref.state_dict().items():
        close(got[k], v, 1e-12)


class SumLoss(nn.Module):
    """Returns its own summed loss, as a model with a loss head does."""

    def __init__(self):
        super().__init__()
        self.net = make()

    def forward(self, ids, y):
        return F.cross_entropy(self.net(ids).reshape(-1, 12), y.reshape(-1), reduction="sum")


def test_ddp_averages_the_ranks_sum_losses_as_torch_ddp():
    """torch DDP averages each rank's gradient of its own loss: with a summed loss, the
    gradient is 1/N of the summed global batch's (tests/test_module_habits_torchrun.py
    holds torchrun to the same)."""
    n = 4
    mesh = wb.Mesh.grid(n, ["dp"])
    torch.manual_seed(0)
    w = SumLoss()
    ref = copy.deepcopy(w)
    ddp = wb.DistributedDataParallel(w, mesh)
    ids, y = data(1)[0]
    loss = ddp(wb.shard_tensor(ids, mesh, ["S(0)"]), wb.shard_tensor(y, mesh, ["S(0)"]))
    loss.backward()
    # one device: each rank's own loss, backward, gradients averaged
    for k in range(n):
        ref(ids.chunk(n)[k], y.chunk(n)[k]).div(n).backward()
    close(loss.full(), sum(ref(ids.chunk(n)[k], y.chunk(n)[k]) for k in range(n)).div(n).detach())
    for (name, p), q in zip(ddp.named_parameters(), ref.parameters()):
        if q.grad is not None:
            close(storage(p.grad)[0], q.grad, 1e-5)


# ---- FullyShardedDataParallel ----------------------------------------------------------------
def fsdp_setup(n=4, **kw):
    mesh = wb.Mesh.grid(n, ["dp"])
    return mesh, wb.FullyShardedDataParallel(make(), mesh, **kw), make()


@pytest.mark.parametrize("units", [None, {nn.Linear}])
def test_fsdp_torch_clip_then_step_is_one_devices(units):
    mesh, f, ref = fsdp_setup(units=units)
    opt = torch.optim.AdamW(f.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        backward_both(f, ref, mesh, step)
        got = torch.nn.utils.clip_grad_norm_(f.parameters(), 0.05)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        close(got, want)
        opt.step()
        ropt.step()
        f.zero_grad()
        ref.zero_grad()
        assert all(p.grad is None for p in f.parameters())
    got = f.full_state_dict()
    for k, v in ref.state_dict().items():
        close(got[k], v)


def test_fsdp_state_dict_is_shard0_disttensors_and_round_trips():
    mesh, f, ref = fsdp_setup()
    sd = f.state_dict()
    assert list(sd) == list(ref.state_dict())                 # own names, as FSDP2
    for k, v in ref.state_dict().items():
        # Shard(0) where 4 ranks divide dim 0 (unused: 3 elements, Replicate)
        assert isinstance(sd[k], wb.DistTensor), k
        assert str(sd[k].placements[0]) == ("R" if k == "unused" else "S(0)"), k
        assert torch.equal(sd[k].full(), v)
    other = make(seed=3)
    assert not f.load_state_dict(other.state_dict()).missing_keys   # a full state dict
    assert all(torch.equal(f.full_state_dict()[k], v) for k, v in other.state_dict().items())
    f.load_state_dict(sd)                                     # its own sharded one
    assert all(torch.equal(f.full_state_dict()[k], v) for k, v in ref.state_dict().items())
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "module.hid.bias"'):
        f.load_state_dict({**sd, "module.hid.bias": torch.zeros(8)})
    with pytest.raises(RuntimeError, match="size mismatch for hid.weight"):
        f.load_state_dict({**sd, "hid.weight": torch.zeros(8, 9)})


def test_fsdp_double_and_requires_grad():
    mesh, f, ref = fsdp_setup()
    f.double()
    ref.double()
    assert {p.dtype for p in f.parameters()} == {torch.float64}
    opt, ropt = (torch.optim.SGD(w.parameters(), lr=0.1) for w in (f, ref))
    backward_both(f, ref, mesh)
    opt.step()
    ropt.step()
    got = f.full_state_dict()
    for k, v in ref.state_dict().items():
        close(got[k], v, 1e-12)
    f.requires_grad_(False)
    ids, _ = data(1)[0]
    assert not f(wb.shard_tensor(ids, mesh, ["S(0)"])).requires_grad


# ---- ZeroRedundancyOptimizer's state dict ------------------------------------------------------
def opt_diff(a, b):
    """The largest difference between two optimizers' state dicts (same format)."""
    assert [{k: v for k, v in g.items() if k != "params"} for g in a["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in b["param_groups"]]
    assert sorted(a["state"]) == sorted(b["state"])
    return max((a["state"][i][n].float() - b["state"][i][n].float()).abs().max().item()
               for i in b["state"] for n in b["state"][i])


def test_zero_state_dict_is_the_unsharded_optimizers_and_loads_back():
    mesh, ddp, ref = ddp_setup()
    opt = wb.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, mesh, lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def step(i, o, ro):
        o.zero_grad()
        ro.zero_grad()
        backward_both(ddp, ref, mesh, i)
        o.step()
        ro.step()

    for i in range(2):
        step(i, opt, ropt)
    sd = opt.state_dict()
    assert opt_diff(sd, ropt.state_dict()) < 1e-6
    # a fresh ZeRO over the same parameters takes it (each rank its own share), and the
    # next step is one device's next step
    opt2 = wb.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, mesh, lr=0.5)
    opt2.load_state_dict(copy.deepcopy(sd))
    assert opt2.param_groups[0]["lr"] == 1e-2
    step(2, opt2, ropt)
    got = ddp.full_state_dict()
    for k, v in ref.state_dict().items():
        close(got[k], v)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        opt2.load_state_dict({"state": {}, "param_groups": []})


@pytest.mark.parametrize("first_no_sync", [False, True])
def test_ddp_accumulates_gradients_over_backwards_as_torch_ddp(first_no_sync):
    """Two backwards without zero_grad: the sum of the two steps' averaged gradients,
    whether the first was averaged already or accumulated inside no_sync()."""
    mesh, ddp, ref = ddp_setup()
    if first_no_sync:
        with ddp.no_sync():
            backward_both(ddp, ref, mesh, 0)
    else:
        backward_both(ddp, ref, mesh, 0)
    backward_both(ddp, ref, mesh, 1)
    for (n, p), q in zip(ddp.named_parameters(), ref.parameters()):
        if q.grad is not None:
            for k in range(4):
                close(storage(p.grad)[k], q.grad)
    close(torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0),
          torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))


def test_zero_steps_after_double():
    mesh, ddp, ref = ddp_setup()
    opt = wb.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, mesh, lr=0.1)
    ddp.double()
    ref.double()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    backward_both(ddp, ref, mesh)
    opt.step()
    ropt.step()
    got = ddp.full_state_dict()
    for k, v in ref.state_dict().items():
        close(got[k], v, 1e-12)


def test_a_parameter_unfrozen_after_wrapping_is_refused_not_left_unaveraged():
    mesh, ddp, ref = ddp_setup()
    ddp.module.frozen.requires_grad_(True)            # DDP built no hook for it
    with pytest.raises(RuntimeError, match=r"\['frozen'\] received gradients"):
        backward_both(ddp, ref, mesh)
    # (ZeroRedundancyOptimizer.add_param_group works as torch's now: tests/test_habits6.py)


def test_rank_rows_norm_takes_ord_by_keyword_and_passes_nan_on():
    """torch._foreach_norm(..., ord=1) over simulated DDP rows is one rank's 1-norm (a tuple,
    as torch's); a NaN gradient gives a NaN norm, as on one device, not a "rows differ"."""
    from workbench.parallel.strategies.rank_grads import as_rank_rows
    r = as_rank_rows(torch.tensor([[3., -4.], [3., -4.]]))
    out = torch._foreach_norm([r], ord=1.0)
    assert isinstance(out, tuple) and float(out[0]) == 7.0
    nan = as_rank_rows(torch.tensor([[float("nan"), 1.], [float("nan"), 1.]]))
    assert torch.isnan(torch.linalg.vector_norm(nan))


def test_parallelize_refusing_a_plan_leaves_the_module_as_it_was():
    mesh = wb.Mesh.grid(2, ["tp"])
    m = nn.Sequential(nn.Linear(4, 4))
    cls = type(m)
    with pytest.raises(ValueError, match="match no module"):
        wb.parallelize(m, mesh, {"nope": "colwise"})
    assert type(m) is cls and all(type(p) is nn.Parameter for p in m.parameters())
    with pytest.raises(ValueError):
        wb.parallelize(m, mesh, {"0.weight": ["S(2)"]})         # a 2-d weight
    assert type(m) is cls and all(type(p) is nn.Parameter for p in m.parameters())


def test_parallelize_keeps_a_tied_weight_one_or_refuses_two_placements():
    mesh = wb.Mesh.grid(2, ["tp"])

    def tied():
        s = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        s[1].weight = s[0].weight
        return s
    s = tied()
    with pytest.raises(ValueError, match="tied"):
        wb.parallelize(s, mesh, {"0.weight": ["S(0)"], "1.weight": ["S(1)"]})
    assert type(s[0].weight) is nn.Parameter
    s = wb.parallelize(tied(), mesh, {"0.weight": ["S(0)"], "1.weight": ["S(0)"]})
    assert s[0].weight is s[1].weight and len(list(s.parameters())) == 1


def test_total_norm_of_bf16_dist_gradients_is_bf16_as_torch():
    mesh = wb.Mesh.grid(2, ["tp"])
    g = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)).bfloat16()
    d = wb.shard_tensor(g, mesh, [wb.Shard(0)])
    mine, ref = wb.parallel.get_total_norm([d]), torch.nn.utils.get_total_norm([g])
    assert mine.dtype == ref.dtype == torch.bfloat16 and torch.equal(mine, ref)
