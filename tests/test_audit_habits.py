"""A user's ordinary training loop on the data-parallel wrappers (DDP, FSDP, DDP +
ZeroRedundancyOptimizer) on simulated ranks, held to plain single-process PyTorch on
the same seeded model and data: each test pins a defect the audit found (a silent
no-op, a silently wrong number, or an unhelpful error) and its fix."""
import contextlib
import io

import pytest
import torch
from torch import nn

import workbench as wb

KINDS = ["ddp", "fsdp", "zero"]


def mlp(seed=0, *extra):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), *extra, nn.Tanh(), nn.Linear(8, 5))


def batches(steps=3, batch=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randn(batch, 5, generator=g))
            for _ in range(steps)]


def wrap(kind, m, n=3):
    mesh = wb.Mesh.grid(n, ["dp"])
    w = wb.FullyShardedDataParallel(m, mesh) if kind == "fsdp" else \
        wb.DistributedDataParallel(m, mesh)
    return w, mesh


def optimizer(kind, w, mesh):
    if kind == "zero":
        return wb.ZeroRedundancyOptimizer(w.parameters(), torch.optim.SGD, mesh, lr=0.1,
                                          momentum=0.9)
    return torch.optim.SGD(w.parameters(), lr=0.1, momentum=0.9)


def train(model, opt, data, mesh=None):
    for x, y in data:
        if mesh is not None:
            x, y = (wb.shard_tensor(t, mesh, [wb.Shard(0)]) for t in (x, y))
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def assert_same(w, ref):
    got, want = w.full_state_dict(), ref.state_dict()
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=k)


# ---- the wrapper's modules(), apply(), children(), buffers(): the module's ----------------
def _init(m):
    if isinstance(m, nn.Linear):
        nn.init.constant_(m.weight, 0.05)
        nn.init.zeros_(m.bias)


@pytest.mark.parametrize("kind", KINDS)
def test_apply_and_modules_reach_the_wrapped_module(kind):
    ref = mlp()
    w, mesh = wrap(kind, mlp())
    # DDP's names are torch DDP's (the module its child "module"), FSDP's the module's own
    pre = "module." if kind != "fsdp" else ""
    want = [""] + [pre + n for n, _ in ref.named_modules()][1:] if pre else \
        [n for n, _ in ref.named_modules()]
    if pre:
        want.insert(1, "module")
    assert [n for n, _ in w.named_modules()] == want
    assert [n for n, _ in w.named_children()] == \
        (["module"] if pre else [n for n, _ in ref.named_children()])
    assert sum(isinstance(m, nn.Linear) for m in w.modules()) == 2
    assert w.get_submodule(pre + "0") is w.module[0]   # was an AttributeError
    assert w.get_parameter(pre + "2.bias") is w.module[2].bias
    assert w.apply(_init) is w                   # was a silent no-op: no child to visit
    ref.apply(_init)
    with torch.no_grad():                        # the habit over modules() too
        for m in w.modules():
            if isinstance(m, nn.Linear):
                m.bias.add_(0.01)
        for m in ref.modules():
            if isinstance(m, nn.Linear):
                m.bias.add_(0.01)
    data = batches()
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), data)
    train(w, optimizer(kind, w, mesh), data, mesh)
    assert_same(w, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_buffers_are_listed_and_double_converts_once(kind):
    ref = mlp(0, nn.BatchNorm1d(8))
    w, _ = wrap(kind, mlp(0, nn.BatchNorm1d(8)))
    pre = "module." if kind != "fsdp" else ""       # torch DDP's names
    assert [n for n, _ in w.named_buffers()] == [pre + n for n, _ in ref.named_buffers()]
    assert w.double() is w
    assert all(b.dtype == torch.float64 for n, b in w.named_buffers() if "num_batches" not in n)
    assert all(p.dtype == torch.float64 for p in w.parameters())


# ---- BatchNorm and buffers written in forward --------------------------------------------
@pytest.mark.parametrize("kind", ["fsdp"])   # DDP: tests/test_ddp_batchnorm.py
def test_batchnorm_in_training_mode_raises_naming_the_layer(kind):
    w, mesh = wrap(kind, mlp(0, nn.BatchNorm1d(8)))
    before = w.module[1].running_mean.clone()
    x = wb.shard_tensor(torch.randn(6, 6), mesh, [wb.Shard(0)])
    with pytest.raises(NotImplementedError, match=r"1 \(BatchNorm1d\).*eval"):
        w(x)
    assert torch.equal(w.module[1].running_mean, before)
    w.module[1].track_running_stats = False      # batch statistics even in eval mode
    w.module[1].running_mean = w.module[1].running_var = None
    w.eval()
    with pytest.raises(NotImplementedError, match="batch statistics"):
        w(x)


def test_batchnorm_on_one_rank_trains_as_one_device():
    ref = mlp(0, nn.BatchNorm1d(8))
    w, mesh = wrap("ddp", mlp(0, nn.BatchNorm1d(8)), n=1)
    data = batches()
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), data)
    train(w, optimizer("ddp", w, mesh), data, mesh)
    assert_same(w, ref)                          # running statistics too


class Counter(nn.Module):
    """Writes its buffers in forward: a step count and a running mean of its input."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x):
        out = x + self.calls                     # every rank reads the step's value
        self.calls += 1
        return out


@pytest.mark.parametrize("kind", KINDS)
def test_buffers_written_in_forward_change_once_a_step_and_eval_batchnorm_trains(kind):
    def model():
        return mlp(0, Counter(), nn.BatchNorm1d(8))
    ref = model()
    with torch.no_grad():
        ref[2].running_mean.uniform_(-1, 1)
    m = model()
    m[2].load_state_dict(ref[2].state_dict())
    w, mesh = wrap(kind, m)
    ref[2].eval()                                # frozen statistics: one device's answer
    w.module[2].eval()
    data = batches()
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), data)
    train(w, optimizer(kind, w, mesh), data, mesh)
    assert w.module[1].calls.item() == ref[1].calls.item() == 3      # was 3 per rank
    assert_same(w, ref)


# ---- the wrapped module's own state_dict (torch.save(ddp.module.state_dict())) -------------
@pytest.mark.parametrize("kind", KINDS)
def test_the_modules_own_state_dict_has_its_shapes_and_loads_back(kind):
    ref = mlp()
    w, mesh = wrap(kind, mlp())
    data = batches()
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), data)
    train(w, optimizer(kind, w, mesh), data, mesh)
    sd = w.module.state_dict()
    assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in ref.state_dict().items()}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    plain = mlp(seed=5)
    plain.load_state_dict(torch.load(buf))       # a plain model takes the checkpoint
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[k], v, rtol=1e-6, atol=1e-6)
    other = mlp(seed=7)
    w.module.load_state_dict(other.state_dict())  # and the wrapped module takes a plain one
    for k, v in other.state_dict().items():
        assert torch.equal(w.full_state_dict()[k], v), k
    with pytest.raises(RuntimeError, match="size mismatch"):
        w.module.load_state_dict({**other.state_dict(), "0.bias": torch.zeros(3)})


# ---- in-place writes of the module's shape after wrapping ------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_copy_of_a_module_shaped_tensor_after_wrapping_is_trained(kind):
    src = mlp(seed=3)
    ref = mlp()
    w, mesh = wrap(kind, mlp())
    with torch.no_grad():
        for (_, p), (_, q), (_, s) in zip(w.named_parameters(), ref.named_parameters(),
                                          src.named_parameters()):
            p.copy_(s)                            # FSDP: was a broadcasting error
            q.copy_(s)
    data = batches()
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), data)
    train(w, optimizer(kind, w, mesh), data, mesh)
    assert_same(w, ref)


def test_another_in_place_op_with_a_module_shaped_tensor_raises_on_fsdp_chunks():
    w, _ = wrap("fsdp", mlp())
    p = w.module[0].weight
    before = p.detach().clone()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"module's shape \(8, 6\).*copy_"):
        p.mul_(torch.full((8, 6), 2.0))
    assert torch.equal(p.detach(), before)


# ---- accumulation, checkpoints ------------------------------------------------------------
# (FullyShardedDataParallel.no_sync() raised "not built": built, FSDP1's, held to one
# device in tests/test_habits5.py)


def test_fsdp_sharded_state_dict_loads_with_torch_load_defaults():
    w, mesh = wrap("fsdp", mlp())
    sd = w.state_dict()
    sd["uneven"] = wb.shard_tensor(torch.arange(5.0), mesh, [wb.Shard(0)])   # Cells storage
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf)                       # weights_only=True: was an UnpicklingError
    for k, v in sd.items():
        assert isinstance(back[k], wb.DistTensor) and back[k].placements == v.placements
        assert torch.equal(back[k].full(), v.full()), k
    w.load_state_dict({k: v for k, v in back.items() if k != "uneven"})


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_of_a_wrapper_raises_and_a_plain_copy_takes_its_weights(kind):
    import copy
    w, mesh = wrap(kind, mlp())
    with pytest.raises(NotImplementedError, match="deepcopy the module before wrapping"):
        copy.deepcopy(w)                         # was a copy that trained wrongly / crashed
    plain = mlp(seed=4)
    plain.load_state_dict(w.full_state_dict())
    for k, v in mlp().state_dict().items():
        assert torch.equal(plain.state_dict()[k], v)


def _gpt2_init(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
        nn.init.zeros_(m.bias)


@pytest.mark.parametrize("kind", KINDS)
def test_normal_init_after_wrapping_is_one_devices_draw(kind):
    ref = mlp()
    w, mesh = wrap(kind, mlp())
    torch.manual_seed(11)
    ref.apply(_gpt2_init)
    torch.manual_seed(11)
    w.apply(_gpt2_init)                          # was a RuntimeError (refused)
    after = torch.rand(())                       # the generator advanced as on one device
    torch.manual_seed(11)
    ref.apply(_gpt2_init)
    assert torch.equal(after, torch.rand(()))
    data = batches()
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), data)
    train(w, optimizer(kind, w, mesh), data, mesh)
    assert_same(w, ref)
    # reset_parameters: was refused (a fan read from the storage); now one device's draw,
    # its fans the module's (habits12)
    torch.manual_seed(12)
    ref[0].reset_parameters()
    torch.manual_seed(12)
    w.module[0].reset_parameters()
    assert_same(w, ref)


# ---- DDP over DistTensor parameters (beside tensor parallelism) ----------------------------
def test_dist_ddp_step_before_the_gradients_are_summed_raises_and_after_is_one_devices():
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    data = batches(2)

    def run(finish, unsynced=False):
        model = wb.parallelize(mlp(), mesh, {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
        ddp = wb.DistributedDataParallel(model, mesh, "dp")
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
        for x, y in data:
            x, y = (wb.shard_tensor(t, mesh, [wb.Shard(0), wb.Replicate()]) for t in (x, y))
            opt.zero_grad()
            with ddp.no_sync() if unsynced else contextlib.nullcontext():
                ((ddp(x) - y) ** 2).mean().backward()
            if finish:
                ddp.finish_gradient_synchronization()
            # without finish: summed at the end of backward, as torch DDP (habits5);
            # unsummed (a backward inside no_sync): was a silent drift, raises
            opt.step()
        return ddp

    before = {k: v.full().clone() for k, v in run(True).module.state_dict().items()}
    plain = {k: v.full().clone() for k, v in run(False).module.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\).*finish_gradient_synchronization"):
        run(False, unsynced=True)
    ref = mlp()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    train(ref, ropt, data)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(before[k], v, rtol=1e-6, atol=1e-6, msg=k)
        torch.testing.assert_close(plain[k], v, rtol=1e-6, atol=1e-6, msg=k)


@pytest.mark.parametrize("norm_type", [float("-inf"), 0.0, 0.5])
def test_fsdp_clip_of_any_order_skips_the_chunks_padding(norm_type):
    ref = mlp()
    w, mesh = wrap("fsdp", mlp())                # 3 ranks: a bias of 8 -> 3 x 3, 1 padding
    x, y = batches(1)[0]
    ((ref(x) - y) ** 2).mean().backward()
    ((w(wb.shard_tensor(x, mesh, [wb.Shard(0)])) - wb.shard_tensor(y, mesh, [wb.Shard(0)]))
     ** 2).mean().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type)
    got = torch.nn.utils.clip_grad_norm_(w.parameters(), 1e-3, norm_type)
    torch.testing.assert_close(got, want)        # -inf: was 0.0, the padding's |g|
    for k, v in w.full_state_dict().items():
        assert torch.equal(v, mlp().state_dict()[k])
    full = {n: p.grad.reshape(-1)[:q.numel()].view_as(q)
            for (n, p), q in zip(w.named_parameters(), ref.parameters())}
    for (n, q) in ref.named_parameters():
        torch.testing.assert_close(full[n], q.grad, rtol=1e-5, atol=1e-7)


# ---- optimizer states across a wrapper and one device --------------------------------------
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                                    (torch.optim.SGD, dict(lr=0.1, momentum=0.9))])
def test_optimizer_states_move_between_one_device_and_any_rank_count(kind, cls, kw):
    data = batches(6)
    ref = mlp()
    train(ref, cls(ref.parameters(), **kw), data)
    # 2 steps on one device -> 2 on 3 ranks -> 2 on 2 ranks -> back on one device
    one = mlp()
    opt = cls(one.parameters(), **kw)
    train(one, opt, data[:2])
    ck = {"model": one.state_dict(), "opt": opt.state_dict()}
    for n, part in ((3, data[2:4]), (2, data[4:5])):
        w, mesh = wrap(kind, mlp(seed=9), n)
        wopt = cls(w.parameters(), **kw)
        w.module.load_state_dict(ck["model"])
        wopt.load_state_dict(ck["opt"])        # was a shape error in step (or a broadcast)
        train(w, wopt, part, mesh)
        buf = io.BytesIO()
        torch.save({"model": w.module.state_dict(), "opt": wopt.state_dict()}, buf)
        buf.seek(0)
        ck = torch.load(buf)
        shapes = {i: tuple(s["exp_avg" if "exp_avg" in s else "momentum_buffer"].shape)
                  for i, s in ck["opt"]["state"].items()}
        assert shapes == {i: tuple(p.shape) for i, p in enumerate(ref.parameters())}
    last = mlp(seed=9)
    last.load_state_dict(ck["model"])
    lopt = cls(last.parameters(), **kw)
    lopt.load_state_dict(ck["opt"])
    train(last, lopt, data[5:])
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(last.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)


class Scaled(nn.Module):
    """A 0-d parameter beside a Linear (a logit scale, a temperature)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(6, 5)
        self.t = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return self.lin(x) * self.t


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_0d_parameters_states_go_to_one_device_too(kind):
    data = batches(4)
    ref = Scaled()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data)
    w, mesh = wrap(kind, Scaled())
    opt = torch.optim.AdamW(w.parameters(), lr=1e-2)
    train(w, opt, data[:2], mesh)
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].shape == ()          # t; was (3,) / (3, 1): the storage
    plain = Scaled(seed=3)
    plain.load_state_dict(w.module.state_dict())
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    popt.load_state_dict(sd)
    train(plain, popt, data[2:])
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)
