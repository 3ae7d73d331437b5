"""A PyTorch user's ordinary loop on the wrappers, second sweep (habits6): each test holds
a habit to plain PyTorch on one device (or torch's documented semantics) and failed
before its fix.

1. a forward under ``torch.inference_mode()`` between training steps (evaluation) on
   simulated ranks raised ``AttributeError: 'NoneType' object has no attribute
   '_sequence_nr'`` (DDP, FSDP, fully_shard, DDP + ZeroRedundancyOptimizer);
   and the output's ``is_inference()`` had no rule;
2. ``loss.backward(retain_graph=True); loss.backward()`` through FSDP / fully_shard
   left the gradient of the first backward only (the second reduced nothing, silently);
3. ``ZeroRedundancyOptimizer``: its ``param_groups`` lacked the optimizer's hyperparameters
   (``betas``...) and ``add_param_group`` raised, where torch's takes both;
4. ``ZeroRedundancyOptimizer(partition="chunks")`` refused parameter groups (dicts) with a
   misleading error;
5. ``DataParallel`` / ``Zero3`` (the hybrid recipe's stage optimizers): ``dp.lr = x`` was a
   copy no step read (silently the first lr: 0.0127 off one device after 3 steps) and
   ``param_groups`` (nanoGPT's schedule) did not exist.
"""
import copy

import pytest
import torch
from torch import nn

import workbench as wb


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))


def batches(k=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g))
            for _ in range(k)]


def mse(out, y):
    return ((out - y) ** 2).mean()


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def wrap(kind, model, n=4):
    """(mesh, the wrapped model) on n simulated data-parallel ranks."""
    mesh = wb.Mesh.grid(n, ["dp"])
    if kind in ("ddp", "zero"):
        return mesh, wb.DistributedDataParallel(model, mesh)
    if kind == "fsdp":
        return mesh, wb.FullyShardedDataParallel(model, mesh)
    if kind == "fsdp_units":
        return mesh, wb.FullyShardedDataParallel(model, mesh, units={nn.Linear})
    assert kind == "fully_shard"
    wb.fully_shard(model[0], mesh=mesh)
    return mesh, wb.fully_shard(model, mesh=mesh)


def optimizer(kind, w, mesh, cls=torch.optim.SGD, params=None, **kw):
    params = w.parameters() if params is None else params
    if kind == "zero":
        return wb.ZeroRedundancyOptimizer(params, cls, mesh, **kw)
    return cls(params, **kw)


def full(w) -> dict:
    """The wrapped model's weights as one device's state dict (module's own names)."""
    out = {}
    for k, v in w.state_dict().items():
        v = v.full() if isinstance(v, wb.DistTensor) else v
        out[k.removeprefix("module.")] = v.detach().clone()
    return out


def assert_same_model(w, ref):
    got, want = full(w), ref.state_dict()
    assert list(got) == list(want)
    for k in want:
        close(got[k], want[k])


def dist(x, mesh):
    return wb.shard_tensor(x, mesh, [wb.Shard(0)])


KINDS = ["ddp", "zero", "fsdp", "fsdp_units", "fully_shard"]


# ---- 1. an inference_mode forward between steps ----------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_an_inference_mode_forward_between_steps_is_one_devices(kind):
    ref = mlp()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    mesh, w = wrap(kind, mlp())
    opt = optimizer(kind, w, mesh, lr=0.1, momentum=0.9)
    for x, y in batches():
        ropt.zero_grad()
        mse(ref(x), y).backward()
        ropt.step()
        opt.zero_grad()
        mse(w(dist(x, mesh)), dist(y, mesh)).backward()
        opt.step()
        with torch.inference_mode():
            want = ref(x)
            got = w(dist(x, mesh))           # raised AttributeError (_sequence_nr)
        assert not got.requires_grad
        assert got.is_inference() and want.is_inference()   # NoRuleError: no SPMD rule
        close(got.full(), want)
    assert_same_model(w, ref)
    if kind.startswith("fsdp") or kind == "fully_shard":
        wrapper = w if kind != "fully_shard" else w._wb_fully_shard.wrapper
        assert wrapper.gathered.alive() == 0     # nothing kept for a backward that won't come


# ---- 2. a second backward through a retained graph -------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_second_backward_through_a_retained_graph_adds_its_gradient(kind):
    ref = mlp()
    mesh, w = wrap(kind, mlp())
    x, y = batches(1)[0]
    loss = mse(ref(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    loss = mse(w(dist(x, mesh)), dist(y, mesh))
    loss.backward(retain_graph=True)
    loss.backward()                          # FSDP: reduced nothing (a countdown used up)
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    optimizer(kind, w, mesh, lr=1.0).step()
    assert_same_model(w, ref)


# ---- 3. ZeroRedundancyOptimizer: torch's param groups, add_param_group ------------------
def test_zero_param_groups_hold_the_optimizers_hyperparameters_as_torchs():
    mesh, w = wrap("zero", mlp())
    opt = optimizer("zero", w, mesh, torch.optim.AdamW, lr=0.01)
    ref = torch.optim.AdamW(mlp().parameters(), lr=0.01)
    # torch's copies the local optimizer's groups in (betas, eps, weight_decay...)
    assert opt.param_groups[0].keys() == ref.param_groups[0].keys()     # KeyError: 'betas'
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert opt.defaults == {"lr": 0.01}                                   # torch's: the kwargs
    # a change to a group's hyperparameter reaches the ranks' optimizers at step
    opt.param_groups[0]["betas"] = (0.5, 0.9)
    x, y = batches(1)[0]
    mse(w(dist(x, mesh)), dist(y, mesh)).backward()
    opt.step()
    assert all(o.param_groups[0]["betas"] == (0.5, 0.9)
               for o in opt.optimizers.values() if o is not None)


def by_name(m) -> dict:
    return {k.removeprefix("module."): p for k, p in m.named_parameters()}


@pytest.mark.parametrize("n", [2, 4])
def test_zero_add_param_group_trains_the_new_group_as_one_device(n):
    """Fine-tuning's habit: the last layer trained first, the first added later with its
    own lr (torch's ZeroRedundancyOptimizer partitions the new group, 467-511)."""
    ref, (mesh, w) = mlp(), wrap("zero", mlp(), n)
    rp, wp = by_name(ref), by_name(w)
    first = ["2.weight", "2.bias"]
    ropt = torch.optim.SGD([rp[k] for k in first], lr=0.1, momentum=0.9)
    opt = optimizer("zero", w, mesh, params=[wp[k] for k in first], lr=0.1, momentum=0.9)
    bs = batches(4)
    for i, (x, y) in enumerate(bs):
        if i == 2:                          # raised NotImplementedError
            ropt.add_param_group({"params": [rp["0.weight"], rp["0.bias"]], "lr": 0.3})
            opt.add_param_group({"params": [wp["0.weight"], wp["0.bias"]], "lr": 0.3})
        ropt.zero_grad()
        mse(ref(x), y).backward()
        ropt.step()
        opt.zero_grad()
        mse(w(dist(x, mesh)), dist(y, mesh)).backward()
        opt.step()
    assert_same_model(w, ref)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.3]
    assert opt.param_groups[1]["momentum"] == 0.9
    got, want = opt.state_dict(), ropt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for i, st in want["state"].items():
        close(got["state"][i]["momentum_buffer"], st["momentum_buffer"])
    with pytest.raises(ValueError, match="more than one parameter group"):   # torch's check
        opt.add_param_group({"params": [wp["0.bias"]]})
    assert len(opt.param_groups) == 2
    # its state dict resumes on an optimizer built with both groups (another partition)
    _, w2 = wrap("zero", mlp(seed=5), n)
    w2.load_state_dict(w.state_dict())
    wp2 = by_name(w2)
    opt2 = optimizer("zero", w2, mesh, params=[{"params": [wp2[k] for k in first]},
                                               {"params": [wp2["0.weight"], wp2["0.bias"]]}],
                     lr=1.0, momentum=0.0)
    opt2.load_state_dict(got)
    for o in (ropt, opt2):
        o.zero_grad()
    x, y = batches(5)[4]
    mse(ref(x), y).backward()
    ropt.step()
    mse(w2(dist(x, mesh)), dist(y, mesh)).backward()
    opt2.step()
    assert_same_model(w2, ref)


# ---- 4. ZeroRedundancyOptimizer(partition="chunks"): parameter groups ---------------------
@pytest.mark.parametrize("overlap_comm", [False, True])
def test_zero_chunks_takes_parameter_groups_as_torch_optim(overlap_comm):
    ref = mlp()
    rp = by_name(ref)
    ropt = torch.optim.AdamW([{"params": [rp["0.weight"], rp["0.bias"]], "lr": 0.02,
                               "weight_decay": 0.5},
                              {"params": [rp["2.weight"], rp["2.bias"]]}], lr=0.01)
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    model = wb.parallelize(mlp(), mesh, {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
    wp = dict(wb.dist_parameters(model))
    opt = wb.ZeroRedundancyOptimizer(     # raised "needs evenly sharded DistTensor parameters"
        [{"params": [wp["0.weight"], wp["0.bias"]], "lr": 0.02, "weight_decay": 0.5},
         {"params": [wp["2.weight"], wp["2.bias"]]}], torch.optim.AdamW, mesh, "dp",
        partition="chunks", overlap_comm=overlap_comm, lr=0.01)
    assert [g["lr"] for g in opt.param_groups] == [0.02, 0.01]
    assert opt.param_groups[1]["weight_decay"] == 0.01      # AdamW's default, as torch's
    place = [wb.Shard(0), wb.Replicate()]
    for x, y in batches():
        ropt.zero_grad()
        mse(ref(x), y).backward()
        ropt.step()
        opt.zero_grad()
        mse(model(wb.shard_tensor(x, mesh, place)), wb.shard_tensor(y, mesh, place)).backward()
        opt.step()
    for k, v in ref.state_dict().items():
        close(model.state_dict()[k].full(), v)
    with pytest.raises(NotImplementedError, match="build a new one with every group"):
        opt.add_param_group({"params": [wp["0.bias"]]})       # was torch's TypeError
    assert len(opt.param_groups) == 2


# ---- 5. the course's optimizer-style objects: a learning-rate schedule reaches the step ----
def dp_setup(zero):
    from workbench.parallel.strategies.data_parallel import DataParallel
    from workbench.parallel.strategies.zero3 import Zero3
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    model = wb.parallelize(mlp(), mesh, {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
    if zero == 3:
        z = Zero3(model, mesh, "dp", lr=0.01, weight_decay=0.1)
        return mesh, model, z, z
    return mesh, model, model, DataParallel([p for _, p in wb.dist_parameters(model)], mesh,
                                            zero=zero, lr=0.01, weight_decay=0.1)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("how", ["param_groups", "attribute"])
def test_data_parallel_and_zero3_lr_changes_reach_the_step(zero, how):
    ref = mlp()
    ropt = wb.ops.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    mesh, model, run, opt = dp_setup(zero)
    place = [wb.Shard(0), wb.Replicate()]
    for i, (x, y) in enumerate(batches(3)):
        lr = 0.01 * 0.5 ** i                 # a decaying schedule (nanoGPT's loop sets it)
        for g in ropt.param_groups:
            g["lr"] = lr
        if how == "param_groups":            # AttributeError: no param_groups
            for g in opt.param_groups:
                g["lr"] = lr
        else:
            opt.lr = lr                      # a copy no step read: silently the first lr
        assert opt.lr == lr and opt.param_groups[0]["lr"] == lr
        ropt.zero_grad()
        mse(ref(x), y).backward()
        ropt.step()
        opt.zero_grad()
        mse(run(wb.shard_tensor(x, mesh, place)), wb.shard_tensor(y, mesh, place)).backward()
        opt.step()
    assert opt.wd == 0.1 and opt.betas == (0.9, 0.999)
    for k, v in ref.state_dict().items():
        close(model.state_dict()[k].full(), v)


def test_zero_chunks_built_after_backward_steps_as_one_device():
    """Built after the first backward, the chunked ZeroRedundancyOptimizer raised "build it
    before the first backward" (habits6); since fixlist8 the wrap keeps the gradients (as
    torch's optimizers never touch them), so its step is one device's SGD step."""
    ref = mlp()
    model0 = copy.deepcopy(ref)
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    model = wb.parallelize(model0, mesh, {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
    place = [wb.Shard(0), wb.Replicate()]
    x, y = batches(1)[0]
    mse(model(wb.shard_tensor(x, mesh, place)), wb.shard_tensor(y, mesh, place)).backward()
    opt = wb.ZeroRedundancyOptimizer([p for _, p in wb.dist_parameters(model)],
                                     torch.optim.SGD, mesh, "dp", partition="chunks", lr=0.1)
    opt.step()
    one = torch.optim.SGD(ref.parameters(), lr=0.1)
    mse(ref(x), y).backward()
    one.step()
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k].full(), v, rtol=0, atol=1e-6)
    assert any(not torch.equal(got[k].full(), v) for k, v in mlp().state_dict().items())


# ---- 6. FSDP1's no_sync: a zero_grad drops the held gradients ----------------------------
@pytest.mark.parametrize("kind", ["fsdp", "fsdp_units"])
@pytest.mark.parametrize("how", ["model", "optimizer", "optimizer_set_to_none_false"])
def test_fsdp_zero_grad_after_no_sync_drops_the_held_gradients(kind, how):
    """A micro-batch accumulated under no_sync, then discarded with zero_grad (a skipped
    batch): the next step is the next batch's alone, as one device and FSDP1 (whose
    zero_grad clears the unsharded .grad it accumulates in)."""
    ref = mlp()
    mesh, w = wrap(kind, mlp())
    opt = torch.optim.SGD(w.parameters(), lr=1.0)
    (x0, y0), (x1, y1) = batches(2)
    with w.no_sync():
        mse(w(dist(x0, mesh)), dist(y0, mesh)).backward()
    assert w.unsynced_bytes() > 0
    if how == "model":
        w.zero_grad()
    else:
        opt.zero_grad(set_to_none=how == "optimizer")
    mse(w(dist(x1, mesh)), dist(y1, mesh)).backward()  # added the held x0 gradients
    assert w.unsynced_bytes() == 0
    opt.step()
    mse(ref(x1), y1).backward()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    assert_same_model(w, ref)


def test_fsdp_no_sync_without_zero_grad_still_accumulates():
    ref = mlp()
    mesh, w = wrap("fsdp_units", mlp())
    opt = torch.optim.SGD(w.parameters(), lr=1.0)
    bs = batches(3)
    for i, (x, y) in enumerate(bs):
        if i < 2:
            with w.no_sync():
                mse(w(dist(x, mesh)), dist(y, mesh)).backward()
        else:
            mse(w(dist(x, mesh)), dist(y, mesh)).backward()
        mse(ref(x), y).backward()
    opt.step()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    assert_same_model(w, ref)
