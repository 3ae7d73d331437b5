"""``wb.fully_shard``: FSDP2's API (blocks first, then the root) on simulated ranks trains
as one device (loss, gradients, parameters), matches ``FullyShardedDataParallel``'s
numbers in mixed precision, keeps the training loop's habits (state_dict, zero_grad,
clip_grad_norm_), accumulates gradients without communication, counts one collective
per unit and phase, and refuses what it cannot honour."""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import workbench as wb

V, W = 10, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.norm = nn.LayerNorm(W)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


class Net(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.emb = nn.Embedding(V, W)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(W, V, bias=False)

    def forward(self, ids):                              # (B, T) -> (B, T, V)
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make(seed=0):
    torch.manual_seed(seed)
    return Net()


def batches(k=2, b=6, t=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (b, t), generator=g), torch.randint(0, V, (b, t), generator=g))
            for _ in range(k)]


def loss_of(out, y):
    out = out.full() if isinstance(out, wb.DistTensor) else out
    return F.cross_entropy(out.float().reshape(-1, V), y.reshape(-1))


def sharded(n, mp=None, **kw):
    mesh = wb.Mesh.grid(n, ["dp"])
    m = make()
    mp = mp or wb.MixedPrecisionPolicy()
    for b in m.blocks:
        wb.fully_shard(b, mesh=mesh, mp_policy=mp, **kw)
    return wb.fully_shard(m, mesh=mesh, mp_policy=mp, **kw), mesh


def full_grads(m, ref):
    """{name: the full gradient} from the shards' (N, chunk) rows."""
    return {name: p.grad.reshape(-1)[:r.numel()].view(r.shape)
            for (name, p), r in zip(m.named_parameters(), ref.parameters())}


def step(m, mesh, opt, ids, y):
    opt.zero_grad()
    loss = loss_of(m(wb.shard_tensor(ids, mesh, ["S(0)"])), y)
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("n", [2, 3, 4])
def test_blocks_then_root_train_as_one_device(n):
    m, mesh = sharded(n)
    assert type(m).__name__ == "FSDPNet" and isinstance(m, Net) and isinstance(m, wb.FSDPModule)
    assert all(type(b).__name__ == "FSDPBlock" for b in m.blocks)
    ref = make()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)   # built after
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for ids, y in batches():
        loss = step(m, mesh, opt, ids, y)
        ropt.zero_grad()
        rloss = loss_of(ref(ids), y)
        rloss.backward()
        got = full_grads(m, ref)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
        ropt.step()
        torch.testing.assert_close(loss, rloss, rtol=1e-6, atol=1e-6)
    sd = m.state_dict()
    assert list(sd) == list(ref.state_dict())
    for name, t in ref.state_dict().items():
        assert isinstance(sd[name], wb.DistTensor) and sd[name].shape == t.shape
        torch.testing.assert_close(sd[name].full(), t, rtol=1e-5, atol=1e-6, msg=name)
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def run(m, mesh, steps=2):
    """The fsdp collectives of each step: (kind, phase, unit)."""
    out = []
    for ids, y in batches(steps):
        with wb.trace() as tr:
            loss_of(m(wb.shard_tensor(ids, mesh, ["S(0)"])), y).backward()
        out.append([(e.name, *e.label.split(" ")[1:]) for e in tr.collectives()
                    if e.label.startswith("fsdp")])
    return out


AG, RS = "all_gather", "reduce_scatter"
FWD = [(AG, "params", "root"), (AG, "params", "blocks.0"), (AG, "params", "blocks.1")]


def test_collectives_per_unit_and_reshard_after_forward():
    # default (None): the blocks re-gather in backward, the root keeps its weights
    m, mesh = sharded(2)
    assert run(m, mesh) == [FWD + [
        (AG, "re-gather", "blocks.1"), (RS, "grad", "blocks.1"),
        (AG, "re-gather", "blocks.0"), (RS, "grad", "blocks.0"), (RS, "grad", "root")]] * 2
    # True everywhere: the root re-gathers too (the head's weight, saved for backward)
    m, mesh = sharded(2, reshard_after_forward=True)
    got = run(m, mesh, 1)[0]
    assert got[:4] == FWD + [(AG, "re-gather", "root")]
    assert [c for c in got if c[1] == "re-gather"] == [
        (AG, "re-gather", "root"), (AG, "re-gather", "blocks.1"), (AG, "re-gather", "blocks.0")]
    # False everywhere: nothing gathered in backward; one reduce-scatter per unit
    m, mesh = sharded(2, reshard_after_forward=False)
    assert run(m, mesh, 1)[0] == FWD + [(RS, "grad", "blocks.1"), (RS, "grad", "blocks.0"),
                                        (RS, "grad", "root")]
    # changed at runtime (FSDP2's set_reshard_after_forward), recursively
    m.set_reshard_after_forward(True)
    assert len([c for c in run(m, mesh, 1)[0] if c[1] == "re-gather"]) == 3
    m.blocks[0].set_reshard_after_forward(False, recurse=False)
    assert [c[2] for c in run(m, mesh, 1)[0] if c[1] == "re-gather"] == ["root", "blocks.1"]


def test_reshard_after_forward_false_trains_as_true():
    a, mesh = sharded(3, reshard_after_forward=False)
    b, _ = sharded(3, reshard_after_forward=True)
    oa, ob = (torch.optim.AdamW(x.parameters(), lr=1e-2) for x in (a, b))
    for ids, y in batches():
        assert torch.equal(step(a, mesh, oa, ids, y), step(b, mesh, ob, ids, y))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("torch_policy", [False, True])
def test_bf16_policy_matches_the_wrappers_compute_dtype(torch_policy):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    mp = (TorchMP if torch_policy else wb.MixedPrecisionPolicy)(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.bfloat16)
    m, mesh = sharded(4, mp)
    f = wb.FullyShardedDataParallel(make(), mesh, compute_dtype=torch.bfloat16, units={Block})
    om, of = (torch.optim.AdamW(x.parameters(), lr=1e-2) for x in (m, f))
    for ids, y in batches():
        lm, lf = step(m, mesh, om, ids, y), step(f, mesh, of, ids, y)
        assert torch.equal(lm, lf)
    assert all(p.dtype == torch.float32 for p in m.parameters())      # fp32 master shards
    full = f.full_state_dict()
    for name, t in m.state_dict().items():
        assert torch.equal(t.full(), full[name]), name


def test_output_dtype_and_per_module_input_cast():
    seen = []
    mesh, m = wb.Mesh.grid(2, ["dp"]), make()
    mp = wb.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for b in m.blocks:
        wb.fully_shard(b, mesh=mesh, mp_policy=mp)
    wb.fully_shard(m, mesh=mesh, mp_policy=wb.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, output_dtype=torch.float32))
    m.blocks[1].register_forward_pre_hook(lambda mod, a: seen.append(a[0].dtype))
    # the root hands block 1 a float32 activation: its own pre-forward casts it to bf16
    m.blocks[0].register_forward_hook(lambda mod, a, o: o.float())
    ids, _ = batches(1)[0]
    out = m(wb.shard_tensor(ids, mesh, ["S(0)"]))
    assert out.dtype == torch.float32                         # output_dtype on the root
    assert seen == [torch.bfloat16, torch.bfloat16]           # per rank, after the cast


def test_state_dict_round_trip_and_strict_load():
    m, mesh = sharded(2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ids, y = batches(1)[0]
    step(m, mesh, opt, ids, y)
    sd = m.state_dict()
    assert sd["blocks.0.lin.weight"].placements == (wb.Shard(0),)
    other, _ = sharded(2)
    before = [p.detach().clone() for p in other.parameters()]
    bad = dict(sd)
    bad.pop("head.weight")
    with pytest.raises(RuntimeError, match="Missing key"):
        other.load_state_dict(bad)
    assert all(torch.equal(p, q) for p, q in zip(other.parameters(), before))  # untouched
    other.load_state_dict(sd)
    assert all(torch.equal(p, q) for p, q in zip(other.parameters(), m.parameters()))
    # one device's plain state dict loads too, and a block's state dict is its own entries
    plain = make(seed=5)
    other.load_state_dict(plain.state_dict())
    for name, t in plain.state_dict().items():
        assert torch.equal(other.state_dict()[name].full(), t), name
    assert list(other.blocks[1].state_dict()) == list(plain.blocks[1].state_dict())
    torch.testing.assert_close(other.blocks[1].state_dict()["lin.bias"].full(),
                               plain.blocks[1].lin.bias.detach())


def test_clip_grad_norm_is_one_devices():
    m, mesh = sharded(3)
    ref = make()
    ids, y = batches(1)[0]
    loss_of(m(wb.shard_tensor(ids, mesh, ["S(0)"])), y).backward()
    loss_of(ref(ids), y).backward()
    for ord_ in (2.0, float("inf")):
        got = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1, norm_type=ord_)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type=ord_)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grads = full_grads(m, ref)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("n", [2, 3])
def test_gradient_accumulation_without_sync(n):
    m, mesh = sharded(n)
    ref = make()
    micro = batches(3)
    for i, (ids, y) in enumerate(micro):
        last = i == len(micro) - 1
        m.set_requires_gradient_sync(last)
        with wb.trace() as tr:
            loss_of(m(wb.shard_tensor(ids, mesh, ["S(0)"])), y).backward()
        rs = [e.label for e in tr.collectives() if e.name == RS]
        if not last:                       # nothing reduced, the shards' gradients untouched
            assert rs == [] and all(p.grad is None for p in m.parameters())
            assert m._wb_fully_shard.wrapper.unsynced_bytes() > 0
        else:                              # one reduce-scatter per unit, of the sum
            assert rs == ["fsdp grad blocks.1", "fsdp grad blocks.0", "fsdp grad root"]
            assert m._wb_fully_shard.wrapper.unsynced_bytes() == 0
        loss_of(ref(ids), y).backward()
    got = full_grads(m, ref)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_block_alone_is_its_own_root():
    mesh = wb.Mesh.grid(2, ["dp"])
    torch.manual_seed(0)
    b, ref = Block(), None
    ref = copy.deepcopy(b)
    wb.fully_shard(b, mesh=mesh)
    x = torch.randn(4, W)
    out = b(wb.shard_tensor(x, mesh, ["S(0)"]))
    out.full().square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(out.full(), ref(x))
    for (name, p), r in zip(b.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.reshape(-1)[:r.numel()].view(r.shape), r.grad,
                                   msg=name)


# ---- what cannot be honoured raises, naming the argument ---------------------------------
MESH = wb.Mesh.grid(2, ["dp"])


@pytest.mark.parametrize("kw, err, match", [
    (dict(reshard_after_forward=2, mesh=wb.Mesh.grid(4, ["dp"])), NotImplementedError,
     "reshard_after_forward=2"),                 # a smaller world: torch's int, not built
    (dict(reshard_after_forward=3), ValueError, "factor of 2, not 3"),      # torch's errors
    (dict(reshard_after_forward="yes"), ValueError, "a bool or an int.*not 'yes'"),
    (dict(shard_placement_fn=lambda p: None), NotImplementedError, "shard_placement_fn"),
    (dict(ignored_params={nn.Parameter(torch.ones(1))}), NotImplementedError, "ignored_params"),
    (dict(dp_mesh_dims=("dp",)), NotImplementedError, "dp_mesh_dims"),
    (dict(mesh="cpu"), TypeError, "mesh='cpu'.*workbench Mesh"),
    (dict(mesh=wb.Mesh.grid((2, 2), ["dp", "tp"])), NotImplementedError, "HSDP"),
    (dict(mp_policy=torch.bfloat16), TypeError, "mp_policy=torch.bfloat16"),
    (dict(mp_policy=wb.MixedPrecisionPolicy(param_dtype=torch.int8)), TypeError, "param_dtype"),
])
def test_bad_arguments_are_named_and_leave_the_module_alone(kw, err, match):
    m = make()
    kw.setdefault("mesh", MESH)
    with pytest.raises(err, match=match):
        wb.fully_shard(m, **kw)
    assert type(m) is Net and all(type(p) is nn.Parameter for p in m.parameters())


def test_torch_offload_policy_refused_default_accepted():
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    with pytest.raises(NotImplementedError, match="offload_policy=CPUOffloadPolicy"):
        wb.fully_shard(make(), mesh=MESH, offload_policy=CPUOffloadPolicy())
    assert isinstance(wb.fully_shard(make(), mesh=MESH, offload_policy=OffloadPolicy()),
                      wb.FSDPModule)


def test_order_of_calls_as_torch():
    m = make()
    wb.fully_shard(m.blocks[0], mesh=MESH)
    with pytest.raises(RuntimeError, match="already applied"):
        wb.fully_shard(m.blocks[0], mesh=MESH)
    with pytest.raises(NotImplementedError, match="fully_shard\\(\\[module"):
        wb.fully_shard([m.blocks[1], m.head], mesh=MESH)
    with pytest.raises(ValueError, match="same mesh"):      # the root on another mesh
        wb.fully_shard(m, mesh=wb.Mesh.grid(4, ["dp"]))
    assert type(m) is Net                                      # ... left as it was
    with pytest.raises(NotImplementedError, match="same param_dtype"):
        wb.fully_shard(m, mesh=MESH,
                       mp_policy=wb.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    wb.fully_shard(m, mesh=MESH)
    with pytest.raises(RuntimeError, match="bottom-up"):     # a child after its root
        wb.fully_shard(m.blocks[1], mesh=MESH)
    with pytest.raises(RuntimeError, match="bottom-up"):     # any module below the root
        wb.fully_shard(m.blocks[1].norm, mesh=MESH)
    with pytest.raises(TypeError, match="nn.Module instance"):
        wb.fully_shard(Net, mesh=MESH)


def test_a_block_sharded_after_its_sibling_ran_is_refused():
    m = make()
    wb.fully_shard(m.blocks[0], mesh=MESH)
    ids, _ = batches(1)[0]
    m.blocks[0](wb.shard_tensor(torch.randn(4, W), MESH, ["S(0)"]))
    with pytest.raises(RuntimeError, match="before the first forward"):
        wb.fully_shard(m, mesh=MESH)


def test_what_is_not_built_raises():
    m, mesh = sharded(2)
    with pytest.raises(RuntimeError, match="outside its root's forward"):
        m.blocks[0](wb.shard_tensor(torch.randn(4, W), mesh, ["S(0)"]))
    with pytest.raises(NotImplementedError, match="unshard"):
        m.unshard()
    with pytest.raises(NotImplementedError, match="set_reshard_after_backward\\(False\\)"):
        m.set_reshard_after_backward(False)
    with pytest.raises(NotImplementedError, match="prefetch"):
        m.set_modules_to_forward_prefetch([m.blocks[1]])
    with pytest.raises(NotImplementedError, match="prefetch"):
        m.set_modules_to_backward_prefetch([m.blocks[0]])
    with pytest.raises(NotImplementedError, match="set_gradient_divide_factor"):
        m.set_gradient_divide_factor(2.0)
    with pytest.raises(NotImplementedError, match="load through the root"):
        m.blocks[0].load_state_dict(m.blocks[0].state_dict())
    with pytest.raises(NotImplementedError, match="deepcopy"):
        copy.deepcopy(m)
    with pytest.raises(TypeError, match="set_requires_gradient_sync\\(1\\)"):
        m.set_requires_gradient_sync(1)
    m.reshard()                              # the parameters are the shards already
    m.set_reshard_after_backward(True)
    m.set_requires_all_reduce(False)
    m.set_is_last_backward(True)


def test_other_wrappers_are_refused():
    mesh = wb.Mesh.grid(2, ["dp"])
    m = make()
    wb.DistributedDataParallel(m, mesh)
    with pytest.raises(ValueError, match="already laid out by another wrapper"):
        wb.fully_shard(m, mesh=mesh)


# ---- after tensor parallelism: torchtitan's order ------------------------------------------
class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(W, 2 * W)
        self.down = nn.Linear(2 * W, W)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class TPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, W)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(2))
        self.head = nn.Linear(W, V, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def tp_model(seed=0):
    torch.manual_seed(seed)
    return TPNet()


def wrap_tp_fsdp(m, mesh, **fully_shard_kwargs):
    """torchtitan's order on a TPNet: the TP plan, then fully_shard on each block and the
    root (over mesh["dp"], with ``fully_shard_kwargs`` each)."""
    wb.parallelize_module(m, mesh, {"blocks.*.up": wb.ColwiseParallel(),
                                    "blocks.*.down": wb.RowwiseParallel()})
    wb.parallelize(m, mesh)
    for b in m.blocks:
        wb.fully_shard(b, mesh=mesh["dp"], **fully_shard_kwargs)
    wb.fully_shard(m, mesh=mesh["dp"], **fully_shard_kwargs)
    return m


def test_tensor_parallel_then_fully_shard_trains_as_one_device():
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    m, ref = tp_model(), tp_model()
    wb.parallelize_module(m, mesh, {"blocks.*.up": wb.ColwiseParallel(),
                                    "blocks.*.down": wb.RowwiseParallel()})
    with pytest.raises(NotImplementedError, match="'emb.weight' .*wb.parallelize"):
        wb.fully_shard(m, mesh=mesh["dp"])
    wb.parallelize(m, mesh)                  # the rest: replicated DistTensors
    for b in m.blocks:
        wb.fully_shard(b, mesh=mesh["dp"])
    wb.fully_shard(m, mesh=mesh["dp"])
    names = [n for n, _ in m.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in m.blocks[0].named_parameters()] == ["up.weight", "up.bias",
                                                              "down.weight", "down.bias"]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for ids, y in batches():
        opt.zero_grad()
        ropt.zero_grad()
        with wb.trace() as tr:
            loss = loss_of(m(wb.shard_tensor(ids, mesh, ["S(0)", "R"])), y)
            loss.backward()
        rloss = loss_of(ref(ids), y)
        rloss.backward()
        torch.testing.assert_close(loss, rloss, rtol=1e-5, atol=1e-6)
        got = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
        torch.testing.assert_close(got, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9),
                                   rtol=1e-5, atol=1e-6)
        assert any(e.label == "zero-3 params" and e.name == RS for e in tr.collectives())
        opt.step()
        ropt.step()
    sd = m.state_dict()
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(sd[name].full(), t, rtol=1e-5, atol=1e-6, msg=name)
    assert sd["blocks.0.up.weight"].placements == (wb.Replicate(), wb.Shard(0))
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    # (set_requires_gradient_sync(False) over DistTensors is built on simulated ranks:
    # test_audit_tp_fsdp.py)
    with pytest.raises(RuntimeError, match="bottom-up"):
        wb.fully_shard(m.blocks[0].up, mesh=mesh["dp"])


def test_tensor_parallel_refusals():
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    m = tp_model()
    wb.parallelize_module(m, mesh, {"blocks.*.up": wb.ColwiseParallel()})
    wb.parallelize(m, mesh)
    with pytest.raises(ValueError, match="mesh=world_mesh\\['dp'\\]"):
        wb.fully_shard(m, mesh=wb.Mesh.grid(2, ["dp"]))
    # (mixed precision over DistTensors is built on simulated ranks: test_audit_tp_fsdp.py)
    # (reshard_after_forward=False over DistTensors is built on simulated ranks:
    # test_audit_tp_fsdp.py)
    assert not isinstance(m, wb.FSDPModule)
    wb.fully_shard(m, mesh=mesh["dp"])
    with pytest.raises(RuntimeError, match="already applied"):
        wb.fully_shard(m, mesh=mesh["dp"])
    with pytest.raises(RuntimeError, match="bottom-up"):     # before the state is built too
        wb.fully_shard(m.blocks[0], mesh=mesh["dp"])


def test_tensor_parallel_root_after_a_block_ran_is_refused():
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    m = tp_model()
    wb.parallelize_module(m, mesh, {"blocks.*.up": wb.ColwiseParallel()})
    wb.parallelize(m, mesh)
    wb.fully_shard(m.blocks[0], mesh=mesh["dp"])
    m.blocks[0](wb.shard_tensor(torch.randn(4, W), mesh, ["S(0)", "R"]))
    with pytest.raises(RuntimeError, match="before the first forward"):
        wb.fully_shard(m, mesh=mesh["dp"])


@pytest.mark.slow
def test_on_torch_distributed_processes(tmp_path_factory):
    """The same API on gloo processes (mesh=None): one device's parameters, with and
    without gradient accumulation, one reduce-scatter per unit per step."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "fully_shard_check.py")   # one launch: 2-process parts
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert [r["micro"] for r in rows] == [1, 3]
    for r in rows:
        assert r["one_device"] < 1e-6 and r["reduce_scatters"] == [3, 3], r
