"""A write through any handle a wrapper gives out (its state dicts' values, its module's
parameters, an optimizer's state dict) reaches every simulated replica and shard, as the
same line run on every torchrun process does, or raises: each held to one device's
forward and to two steps of training after it."""
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import workbench as wb
from workbench.parallel.strategies.laid_out_whole import storage  # the rows (habits13)
from workbench.parallel.strategies.data_parallel import DataParallel
from workbench.parallel.strategies.zero3 import Zero3

X = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 2))


def _full(v):
    return v.full() if isinstance(v, wb.DistTensor) else v


def _ddp(mesh):
    w = wb.DistributedDataParallel(_mlp(), mesh)
    opt = torch.optim.SGD(w.parameters(), lr=0.1)
    return w, w.module, lambda: (opt.step(), opt.zero_grad())


def _fsdp(mesh):
    w = wb.FullyShardedDataParallel(_mlp(), mesh)
    opt = torch.optim.SGD(w.parameters(), lr=0.1)
    return w, w.module, lambda: (opt.step(), opt.zero_grad())


def _ddp_dist(mesh):
    m = _mlp()
    wb.parallelize(m, mesh, {})
    w = wb.DistributedDataParallel(m, mesh)
    opt = torch.optim.SGD(w.parameters(), lr=0.1)
    return w, m, lambda: (w.finish_gradient_synchronization(), opt.step(), opt.zero_grad())


def _zero3(mesh):
    m = _mlp()
    wb.parallelize(m, mesh, {})
    z = Zero3(m, mesh, "dp")
    opt = torch.optim.SGD(z.parameters(), lr=0.1)
    return z, m, lambda: (z.finish_gradient_synchronization(), opt.step(), opt.zero_grad())


def _data_parallel(zero):
    def build(mesh):
        m = _mlp()
        wb.parallelize(m, mesh, {})
        o = DataParallel(list(wb.dist_parameters(m)), mesh, "dp", zero=zero, lr=0.1)
        return m, m, o.step
    return build


WRAPPERS = {"ddp": _ddp, "fsdp": _fsdp, "ddp-disttensor": _ddp_dist, "zero3": _zero3,
            "dp-zero0": _data_parallel(0), "dp-zero1": _data_parallel(1),
            "dp-zero2": _data_parallel(2)}
REF_OPT = {"dp-zero0": "adamw", "dp-zero1": "adamw", "dp-zero2": "adamw"}


def _sd_key(sd, name):
    return next(k for k in sd if k == name or k.endswith("." + name))


def _wrapper_sd_copy(w, m, ref):
    sd = w.state_dict()
    sd[_sd_key(sd, "0.weight")].copy_(torch.ones(6, 4))
    ref[0].weight.data.fill_(1)


def _module_sd_mul(w, m, ref):
    sd = m.state_dict()
    sd["0.weight"].mul_(2)
    ref[0].weight.data.mul_(2)


def _module_sd_one_line(w, m, ref):
    m.state_dict()["2.bias"].add_(1)            # the dict is dropped at once
    ref[2].bias.data.add_(1)


def _wrapper_sd_init(w, m, ref):
    sd = w.state_dict()
    nn.init.constant_(sd[_sd_key(sd, "2.weight")], 0.25)
    nn.init.constant_(ref[2].weight, 0.25)


def _parameters_mul(w, m, ref):
    with torch.no_grad():
        for p in w.parameters():
            p.mul_(0.5)
        for p in ref.parameters():
            p.mul_(0.5)


def _submodule_fill(w, m, ref):
    with torch.no_grad():
        m[0].weight.fill_(1)
        ref[0].weight.fill_(1)


def _named_zero(w, m, ref):
    with torch.no_grad():
        dict(m.named_parameters())["2.bias"].zero_()
        ref[2].bias.zero_()


HANDLES = {"wrapper.state_dict()": _wrapper_sd_copy, "module.state_dict()": _module_sd_mul,
           "module.state_dict() one line": _module_sd_one_line,
           "nn.init on a state_dict() value": _wrapper_sd_init,
           "wrapper.parameters()": _parameters_mul, "module.<sub>.weight": _submodule_fill,
           "named_parameters()": _named_zero}
# Zero3's module holds templates (its values at wrapping): a write to them raises
REFUSED = {("zero3", "wrapper.parameters()"): None, ("zero3", "module.<sub>.weight"): "template",
           ("zero3", "named_parameters()"): "template"}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("handle", list(HANDLES))
@pytest.mark.parametrize("which", list(WRAPPERS))
def test_a_write_reaches_every_replica(which, handle, n):
    mesh = wb.Mesh.grid(n, ["dp"])
    w, m, step = WRAPPERS[which](mesh)
    ref = _mlp()
    key = (which, handle)
    if REFUSED.get(key):
        with pytest.raises(RuntimeError, match=REFUSED[key]):
            HANDLES[handle](w, m, ref)
        return
    HANDLES[handle](w, m, ref)
    xs = wb.shard_tensor(X, mesh, [wb.Shard(0)])
    torch.testing.assert_close(_full(w(xs)), ref(X))            # the next forward
    ro = (torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.0)
          if REF_OPT.get(which) == "adamw" else torch.optim.SGD(ref.parameters(), lr=0.1))
    for _ in range(2):                                          # and two steps after it
        (w(xs) ** 2).mean().backward()
        step()
        ro.zero_grad()
        (ref(X) ** 2).mean().backward()
        ro.step()
    torch.testing.assert_close(_full(w(xs)), ref(X), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_write_before_the_step_is_one_devices(n):
    # written between backward and step: the step's update lands on the written value
    mesh = wb.Mesh.grid(n, ["dp"])
    w, ref = wb.DistributedDataParallel(_mlp(), mesh), _mlp()
    opt = torch.optim.AdamW(w.parameters(), lr=0.1)
    ro = torch.optim.AdamW(ref.parameters(), lr=0.1)
    xs = wb.shard_tensor(X, mesh, [wb.Shard(0)])
    (w(xs) ** 2).mean().backward()
    (ref(X) ** 2).mean().backward()
    w.state_dict()["module.2.weight"].add_(1)
    ref[2].weight.data.add_(1)
    opt.step()
    ro.step()
    torch.testing.assert_close(w(xs).full(), ref(X))
    for r in range(n):                                          # every replica
        torch.testing.assert_close(storage(w.module[2].weight)[r], ref[2].weight.detach())


def test_ddp_write_reaches_zero_redundancy_optimizer_partitions():
    # ZeRO steps each rank's partition from its own replica: a row-0 write was kept only
    # where rank 0 owned the partition
    mesh = wb.Mesh.grid(3, ["dp"])
    w, ref = wb.DistributedDataParallel(_mlp(), mesh), _mlp()
    opt = wb.ZeroRedundancyOptimizer(w.parameters(), torch.optim.SGD, mesh=mesh, lr=0.1)
    ro = torch.optim.SGD(ref.parameters(), lr=0.1)
    xs = wb.shard_tensor(X, mesh, [wb.Shard(0)])
    (w(xs) ** 2).mean().backward()
    (ref(X) ** 2).mean().backward()
    for k, v in w.module.state_dict().items():
        v.add_(1)
        ref.state_dict()[k].add_(1)
    opt.step()
    ro.step()
    torch.testing.assert_close(w(xs).full(), ref(X))


@pytest.mark.parametrize("wrapper, after", [("DistributedDataParallel", 2),
                                            ("FullyShardedDataParallel", 1)])
def test_optimizer_state_dict_write_reaches_every_replica_or_shard(wrapper, after):
    # torch's optimizer.state_dict() holds the state tensors themselves; ours gave DDP's
    # rank 0's rows of exp_avg (only rank 0's moments changed) and FSDP's copies
    mesh = wb.Mesh.grid(3, ["dp"])
    w, ref = getattr(wb, wrapper)(_mlp(), mesh), _mlp()
    opt = torch.optim.AdamW(w.parameters(), lr=0.1)
    ro = torch.optim.AdamW(ref.parameters(), lr=0.1)
    xs = wb.shard_tensor(X, mesh, [wb.Shard(0)])

    def step():
        opt.zero_grad()
        (w(xs) ** 2).mean().backward()
        opt.step()
        ro.zero_grad()
        (ref(X) ** 2).mean().backward()
        ro.step()
    step()
    opt.state_dict()["state"][0]["exp_avg"].mul_(3)
    ro.state_dict()["state"][0]["exp_avg"].mul_(3)
    for _ in range(after):
        step()
    torch.testing.assert_close(w(xs).full(), ref(X), rtol=1e-5, atol=1e-6)


def test_dcp_load_into_ddp_state_dict_reaches_every_replica(tmp_path):
    ref = _mlp(0)
    dcp.save({"model": ref.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    mesh = wb.Mesh.grid(3, ["dp"])
    w = wb.DistributedDataParallel(_mlp(1), mesh)
    dcp.load({"model": {k[len("module."):]: v for k, v in w.state_dict().items()}},
             checkpoint_id=tmp_path, no_dist=True)
    torch.testing.assert_close(w(wb.shard_tensor(X, mesh, [wb.Shard(0)])).full(), ref(X))
    w.check_replicas()


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_one_ranks_row_written_alone_still_raises(n):
    # not a handle any process has: a replica that drifted is reported, never averaged away
    mesh = wb.Mesh.grid(n, ["dp"])
    w = wb.DistributedDataParallel(_mlp(), mesh)
    with torch.no_grad():
        storage(w.module[0].weight)[1, 0, 0] += 1
    with pytest.raises(RuntimeError, match=r"replicas of '0.weight' differ.*rows \[1\]"):
        w(wb.shard_tensor(X, mesh, [wb.Shard(0)]))


@pytest.mark.parametrize("which", ["fsdp", "zero3"])
def test_a_state_dict_copy_written_after_a_step_raises(which):
    # FSDP's state_dict() values are gathered copies: written after the shards stepped,
    # writing the old copy back would undo the step, where torch's (the shards) would not
    mesh = wb.Mesh.grid(2, ["dp"])
    w, m, step = WRAPPERS[which](mesh)
    sd = w.state_dict()
    xs = wb.shard_tensor(X, mesh, [wb.Shard(0)])
    (w(xs) ** 2).mean().backward()
    step()
    before = {k: v.clone() for k, v in w.full_state_dict().items()}
    sd["0.weight"].fill_(1)
    with pytest.raises(RuntimeError, match="written after the model changed.*not applied"):
        w(xs)
    after = w.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    w(xs)                                   # told once: the model runs on
    sd2 = w.state_dict()                    # a fresh copy takes writes again
    sd2["0.weight"].fill_(1)
    assert torch.equal(w.full_state_dict()["0.weight"], torch.ones(6, 4))


@pytest.mark.parametrize("kw", [dict(dp=2), dict(dp=2, zero=3), dict(dp=2, tp=2, zero=3)],
                         ids=["dp2", "dp2-zero3", "dp2-tp2-zero3"])
def test_hybrid_state_dict_write_gives_one_devices_loss(kw):
    from workbench.models.config import build_model, get_config
    from workbench.models.data import get_batch
    from workbench.recipes.hybrid import Hybrid
    cfg = get_config("tiny")
    x, y = get_batch(cfg, 8, 0, 0)
    st = Hybrid(**kw)
    model, plain = st.build_model(cfg, 0), build_model(cfg, 0)
    model.state_dict()["tok_emb.weight"].mul_(30.0)
    plain.state_dict()["tok_emb.weight"].mul_(30.0)
    with torch.no_grad():
        want = float(plain(x, y)[1])
    assert float(st.forward_backward(model, x, y)) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("which", ["fsdp", "zero3"])
def test_a_written_state_dict_loaded_back_and_a_load_after_a_write(which):
    # sd[k].mul_(2); load_state_dict(sd): the write lands before the load (torch: at
    # once), not flagged as a stale copy; a load after a write wins, as in torch
    mesh = wb.Mesh.grid(2, ["dp"])
    w, m, step = WRAPPERS[which](mesh)
    ref = _mlp()
    xs = wb.shard_tensor(X, mesh, [wb.Shard(0)])
    sd = w.state_dict()
    sd["0.weight"].mul_(2)
    ref[0].weight.data.mul_(2)
    w.load_state_dict(sd)
    torch.testing.assert_close(_full(w(xs)), ref(X))
    other = _mlp(3)
    sd2 = w.state_dict()
    sd2["2.bias"].fill_(5)
    w.load_state_dict(other.state_dict())
    torch.testing.assert_close(_full(w(xs)), other(X))


def test_ddp_state_dict_write_then_a_write_to_the_parameters():
    # both before the next forward: every row written alike after one row alone read as
    # "every row changed, not alike" and raised; each process runs both lines in order
    mesh = wb.Mesh.grid(2, ["dp"])
    w, ref = wb.DistributedDataParallel(_mlp(), mesh), _mlp()
    write_then_scale_matches(w, ref, X, mesh)


def write_then_scale_matches(w, ref, x, mesh):
    """A state-dict write of the first weight, then every parameter scaled in place: the
    wrapper's output equals the plain module's under the same two writes."""
    w.state_dict()["module.0.weight"].fill_(1)
    ref[0].weight.data.fill_(1)
    with torch.no_grad():
        for p in w.parameters():
            p.mul_(0.5)
        for p in ref.parameters():
            p.mul_(0.5)
    torch.testing.assert_close(w(wb.shard_tensor(x, mesh, [wb.Shard(0)])).full(), ref(x))
