"""A PyTorch user's habits on the wrappers, third sweep (habits7): each test holds a habit
to plain PyTorch on one device (or torch's documented semantics) and failed before its fix.

1. ``p.detach().normal_()`` / ``.uniform_()`` / ``nn.init.*_(p.detach())`` on a wrapped
   parameter (DDP's rows, FSDP's / fully_shard's chunks, fully_shard over DistTensors)
   drew each rank's row or chunk on its own, silently (``p.data`` was guarded, ``detach``
   was not); now as ``p.data``: one device's draw for ``nn.init.normal_``, else the error;
2. ``ZeroRedundancyOptimizer.step(closure)`` raised NotImplementedError (torch's calls it
   once and returns its loss), in both partition modes;
3. ``ddp.state_dict(keep_vars=True)`` gave row views, not the parameters (torch: the
   very objects ``ddp.parameters()`` gives);
4. ``model.get_parameter("0.weight")`` on a ``parallelize``d model raised "not an
   nn.Parameter" (its parameters are DistTensors);
5. ``torch.autograd.grad(loss, ddp.parameters())`` on simulated ranks returned each rank's
   own gradient / N (torch DDP documents it does not support autograd.grad): raises.
"""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.strategies.laid_out_whole import storage  # the rows (habits13)

from .test_habits6 import (batches, close, full, mlp, mse,  # noqa: F401  (the same tiny
                           wrap)                          # MLP, data and wrappers)


def dist(x, mesh):
    return wb.shard_tensor(x, mesh, [wb.Shard(0)])


def train_as_one_device(kind, w, mesh, ref):
    opt = torch.optim.SGD(w.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches(2):
        for o, m, xx, yy in ((opt, w, dist(x, mesh), dist(y, mesh)), (ropt, ref, x, y)):
            o.zero_grad()
            loss = mse(m(xx), yy)
            loss.backward()
            o.step()
    got, want = full(w), ref.state_dict()
    for k in want:
        close(got[k], want[k])


# ---- 1. in-place init through p.detach() ------------------------------------------------
RANDOM_FILLS = {"normal_": lambda t: t.normal_(0.0, 0.2),
                "uniform_": lambda t: t.uniform_(-0.2, 0.2),
                "init.uniform_": lambda t: nn.init.uniform_(t, -0.2, 0.2),
                "init.kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t),
                "init.xavier_normal_": lambda t: nn.init.xavier_normal_(t),
                "init.trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.02)}


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fully_shard"])
@pytest.mark.parametrize("fill", list(RANDOM_FILLS))
def test_random_fill_through_detach_is_one_devices_draw(kind, fill):
    """Before: each rank's row / chunk its own draw, silently (DDP's replicas then differ,
    FSDP's model is not one device's init); then refused; now (habits12) one device's draw
    of the module's shape, its fans the module's, the generator advanced as far, the other
    parameters untouched."""
    mesh, w = wrap(kind, mlp())
    before = {n: p.detach().clone() for n, p in w.named_parameters()}
    name = [n for n in before if n.endswith("0.weight")][0]
    p = dict(w.named_parameters())[name]
    want = mlp()[0].weight.detach()
    for t in (want, p.detach()):
        torch.manual_seed(2)
        with torch.no_grad():
            RANDOM_FILLS[fill](t)
        after = torch.rand(())
    again = mlp()[0].weight.detach()       # (mlp seeds the generator itself)
    torch.manual_seed(2)
    RANDOM_FILLS[fill](again)
    assert torch.equal(torch.rand(()), after)
    got = full(w)
    assert torch.equal(got[name.removeprefix("module.")], want)
    for n, q in w.named_parameters():
        if n != name:
            assert torch.equal(q.detach(), before[n]), n


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fully_shard"])
def test_init_normal_and_elementwise_writes_through_detach_are_one_devices(kind):
    """GPT-2's init written through detach(): nn.init.normal_(p.detach()) is one device's
    draw (was each rank's own), zero_ / mul_ / copy_ of the module's shape as one device."""
    ref, (mesh, w) = mlp(), wrap(kind, mlp())
    src = mlp(seed=3).state_dict()
    for model in (w, ref):
        torch.manual_seed(5)
        for n, p in model.named_parameters():
            n = n.removeprefix("module.")
            if n == "0.bias":
                p.detach().zero_()
            elif n == "2.bias":
                p.detach().copy_(src[n])
            else:
                nn.init.normal_(p.detach(), std=0.2)
                p.detach().mul_(1.5)
    train_as_one_device(kind, w, mesh, ref)


def test_detach_of_fully_shard_over_dist_tensors_keeps_the_guard():
    """fully_shard over tensor-parallel DistTensors (torchtitan's order): the same (a
    random fill through detach() one device's draw)."""
    from tests.test_fixlist7 import _trains_as_one_device, _tp_fully_shard
    m, ref, mesh = _tp_fully_shard()
    params = dict(m.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    torch.manual_seed(1)              # habits12: one device's draw (was refused)
    params["blocks.0.up.weight"].detach().normal_(0.0, 0.2)
    torch.manual_seed(1)
    want = torch.empty(params["blocks.0.up.weight"].full_tensor().shape).normal_(0.0, 0.2)
    assert torch.equal(params["blocks.0.up.weight"].full_tensor(), want)
    for n, p in params.items():
        if n != "blocks.0.up.weight":
            assert torch.equal(p.detach(), before[n]), n
    for model in (m, ref):
        torch.manual_seed(5)
        for n, p in model.named_parameters():
            torch.nn.init.normal_(p.detach(), std=0.2)
    _trains_as_one_device(m, ref, mesh)


def test_detach_still_reads_and_trains_as_before():
    """A detached parameter still reads as its storage (an EMA copy, a norm), has no
    gradient history, and the wrapper's own state dicts stay plain tensors."""
    mesh, w = wrap("ddp", mlp())
    p = w.module[0].weight
    d = p.detach()
    assert not d.requires_grad and d.shape == p.shape
    ema = d.clone()
    # a copy: no parameter, no guard (habits11: it keeps the layout, so its reductions
    # read the module's values, as the parameter's do)
    assert not isinstance(ema, nn.Parameter) and torch.equal(ema, d)
    ema.normal_()
    assert all(type(v) is torch.Tensor for v in w.state_dict().values())
    assert all(type(v) is torch.Tensor for v in w.module.state_dict().values())


# ---- 2. ZeroRedundancyOptimizer.step(closure) ----------------------------------------------
def zero_setup(partition, n=2):
    if partition == "owners":
        mesh, w = wrap("ddp", mlp(), n)
        opt = wb.ZeroRedundancyOptimizer(w.parameters(), torch.optim.AdamW, mesh, lr=0.01)
        return mesh, w, opt, lambda t: dist(t, mesh)
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    w = wb.parallelize(mlp(), mesh, {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
    opt = wb.ZeroRedundancyOptimizer([p for _, p in wb.dist_parameters(w)],
                                     torch.optim.AdamW, mesh, "dp", partition="chunks",
                                     lr=0.01)
    return mesh, w, opt, lambda t: wb.shard_tensor(t, mesh, [wb.Shard(0), wb.Replicate()])


@pytest.mark.parametrize("partition", ["owners", "chunks"])
def test_zero_step_with_a_closure_is_torch_optims(partition):
    ref = mlp()
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    mesh, w, opt, put = zero_setup(partition)
    calls = [0]
    for x, y in batches():
        def rclosure():
            ropt.zero_grad()
            loss = mse(ref(x), y)
            loss.backward()
            return loss

        def closure():
            calls[0] += 1
            assert torch.is_grad_enabled()      # as torch.optim: the step enables grad
            opt.zero_grad()
            loss = mse(w(put(x)), put(y))
            loss.backward()
            return loss
        want = ropt.step(rclosure)
        got = opt.step(closure)             # raised NotImplementedError
        close(got.full() if isinstance(got, wb.DistTensor) else got, want)
    assert calls[0] == 3                    # once per step, as torch's
    got = full(w)
    for k, v in ref.state_dict().items():
        close(got[k], v)


def test_zero_step_without_closure_returns_none_as_torch():
    mesh, w, opt, put = zero_setup("owners")
    x, y = batches(1)[0]
    mse(w(put(x)), put(y)).backward()
    assert opt.step() is None


def test_zero_closure_with_lbfgs_raises_before_anything():
    mesh, w = wrap("ddp", mlp(), 2)
    opt = wb.ZeroRedundancyOptimizer(w.parameters(), torch.optim.LBFGS, mesh, lr=0.1)
    before = {k: v.clone() for k, v in full(w).items()}
    with pytest.raises(NotImplementedError, match="LBFGS"):
        opt.step(lambda: None)
    for k, v in full(w).items():
        assert torch.equal(v, before[k])


# ---- 3. ddp.state_dict(keep_vars=True) ---------------------------------------------------
def test_ddp_state_dict_keep_vars_gives_the_parameters_as_torch():
    mesh, w = wrap("ddp", mlp())
    sd = w.state_dict(keep_vars=True)
    params = dict(w.named_parameters())
    assert list(sd) == list(params)
    for k, p in params.items():
        assert sd[k] is p                   # was a view of one row
    # a keep_vars dict loads, as torch's (another wrapper's parameters: their values)
    _, w2 = wrap("ddp", mlp(seed=7))
    w2.load_state_dict(sd)
    for k, v in w2.state_dict().items():
        close(v, w.state_dict()[k])
    w.load_state_dict(w.state_dict(keep_vars=True))
    # keep_vars=False still gives one device's tensors, and a load still takes them
    ref = mlp(seed=4)
    w.load_state_dict({"module." + k: v for k, v in ref.state_dict().items()})
    for k, v in w.state_dict().items():
        close(v, ref.state_dict()[k.removeprefix("module.")])


# ---- 4. get_parameter on a parallelized model --------------------------------------------
def test_get_parameter_of_a_parallelized_model_is_named_parameters():
    mesh = wb.Mesh.grid(2, ["tp"])
    m = wb.parallelize(mlp(), mesh, {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
    params = dict(m.named_parameters())
    for name, p in params.items():
        assert m.get_parameter(name) is p   # raised "`weight` is not an nn.Parameter"
    assert m[0].get_parameter("weight") is params["0.weight"]
    with pytest.raises(AttributeError, match="has no attribute `nope`"):
        m.get_parameter("0.nope")
    m.register_buffer("scale", torch.ones(1))
    with pytest.raises(AttributeError, match="is not an nn.Parameter"):
        m.get_parameter("scale")


# ---- 5. torch.autograd.grad over simulated DDP -------------------------------------------
def test_autograd_grad_over_simulated_ddp_raises():
    """Before: each row its own rank's gradient / N (0.046 off one device's on row 0),
    not DDP's average; torch DDP documents it does not work with autograd.grad."""
    mesh, w = wrap("ddp", mlp())
    x, y = batches(1)[0]
    loss = mse(w(dist(x, mesh)), dist(y, mesh))
    with pytest.raises(RuntimeError, match="torch.autograd.grad.*DistributedDataParallel"
                       ".*loss.backward\\(\\)"):
        torch.autograd.grad(loss, list(w.parameters()))
    assert all(p.grad is None for p in w.parameters())
    loss.backward()                         # the graph is still there: the supported way
    ref = mlp()
    mse(ref(x), y).backward()
    for (n, p), q in zip(w.named_parameters(), ref.parameters()):
        close(storage(p.grad)[0], q.grad)


def test_get_parameter_of_fully_shard_over_dist_tensors_is_named_parameters():
    from tests.test_fixlist7 import _tp_fully_shard
    m, _, _ = _tp_fully_shard()
    for name, p in m.named_parameters():
        assert m.get_parameter(name) is p


@pytest.mark.slow
def test_zero_step_with_a_closure_on_gloo_is_torchs(tmp_path_factory):
    """The process-group path (one owner per process): the same parameters, losses and
    closure calls as torch's DDP + ZeroRedundancyOptimizer (raised NotImplementedError)."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "habits7_check.py")   # one launch: 2-process parts
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert len(rows) == 2 and not [r for r in rows if "raised" in r], rows
    for r in rows:
        assert r["params"] == 0.0 and r["losses_equal"] and r["calls"] == [3, 3], r
