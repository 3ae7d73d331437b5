"""One data-parallel family: the three wrappers over DistTensor parameters (dp beside tensor
parallelism over tp, PyTorch's 2-D layout): DistributedDataParallel, FullyShardedDataParallel
(ZeRO-3) and ZeroRedundancyOptimizer(partition="chunks") (ZeRO-1/2) each give one device's
losses and parameters with a torch.optim optimizer on (2, 2) ranks, their collectives counted
on the dp groups; DataParallel and Zero3 run on them."""
import math

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.strategies.laid_out_whole import storage_shape
from workbench.parallel.strategies.data_parallel import DataParallel
from workbench.parallel.strategies.ddp_dist import DistTensorDDP, GradReplicas

PLAN = {"0": "colwise", "2": "rowwise"}          # Megatron's MLP over tp


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def mesh2d():
    return wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])


def one_device(steps):
    m, (x, y) = mlp(), batch()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, m.state_dict()


def dp_tp(steps, bucket=None):
    mesh = mesh2d()
    model = wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")
    ddp = wb.DistributedDataParallel(model, mesh, "dp", bucket_bytes=bucket)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    x, y = batch()
    xd = wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()])
    yd = wb.shard_tensor(y, mesh, [wb.Shard(0), wb.Replicate()])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with wb.trace() as tr:
            loss = ((ddp(xd) - yd) ** 2).mean()
            loss.backward()
            ddp.finish_gradient_synchronization()
        opt.step()
        losses.append(loss.full().item())
    return losses, ddp, tr


def test_dp_over_tp_gives_one_devices_losses_and_parameters():
    ref_losses, ref = one_device(3)
    losses, ddp, _ = dp_tp(3)
    assert isinstance(ddp, wb.DistributedDataParallel) and isinstance(ddp, DistTensorDDP)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=1e-6)
    got = ddp.full_state_dict()
    assert list(got) == list(ref)                   # the module's own names
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    ddp.check_replicas()                            # every dp replica took the same step


# bucket_bytes=1: one per tensor; None: torch DDP's default, whose first step is one bucket
# per dtype (tests/test_ddp_buckets_default.py); inf: one buffer
@pytest.mark.parametrize("bucket,count", [(1, 4), (None, 1), (math.inf, 1)])
def test_gradients_all_reduced_over_dp_once_per_tensor_or_bucket(bucket, count):
    _, ddp, tr = dp_tp(1, bucket)
    ev = [e for e in tr.collectives() if e.label in ("dp grad", "dp bucket")]
    # one collective per dp group (2 groups: tp rank 0 and tp rank 1) and tensor / bucket
    assert len(ev) == 2 * count
    assert {tuple(e.ranks) for e in ev} == {(0, 2), (1, 3)}
    assert all(e.name == "all_reduce" for e in ev)
    # each tp rank reduces its own shard: 16*32/2 + 32/2 + 32*16/2 + 16 (rowwise bias whole)
    per_group = sum(e.args["buffer_bytes"] for e in ev) // 2
    assert per_group == 4 * (256 + 16 + 256 + 16)


def test_the_replicas_are_the_optimizers_parameters_one_per_rank():
    mesh = mesh2d()
    model = wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")
    ddp = wb.DistributedDataParallel(model, mesh, "dp")
    names = [n for n, _ in ddp.named_parameters()]
    assert names == ["module.0.weight", "module.0.bias", "module.2.weight",
                     "module.2.bias"]                       # torch DDP's names
    w = dict(ddp.named_parameters())["module.0.weight"]
    assert w.is_leaf and w.requires_grad and storage_shape(w) == (2, 2, 16, 16)  # dp, tp, 32/2, 16
    assert w.shape == (32, 16)          # a user's: the module parameter's (habits13)
    assert type(wb.DistributedDataParallel(mlp(), wb.Mesh.grid(2, ["dp"]))) is \
        wb.DistributedDataParallel                  # a plain module: the per-rank wrapper


def test_data_parallel_runs_on_the_same_engine_and_sends_the_same_messages():
    x, y = batch()
    traces = []
    for kind in ("ddp", "dataparallel"):
        mesh = mesh2d()
        model = wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")
        if kind == "ddp":
            sync = wb.DistributedDataParallel(model, mesh, "dp", bucket_bytes=1024)
            assert isinstance(sync.replicas, GradReplicas)
            finish = sync.finish_gradient_synchronization
        else:
            dp = DataParallel(list(wb.dist_parameters(model)), mesh, "dp", bucket_bytes=1024)
            assert isinstance(dp.replicas, GradReplicas)
            finish = dp.finish_gradient_synchronization
        xd = wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()])
        yd = wb.shard_tensor(y, mesh, [wb.Shard(0), wb.Replicate()])
        with wb.trace() as tr:          # DDP's sum runs at the end of backward (torch's)
            ((model(xd) - yd) ** 2).mean().backward()
            finish()
        traces.append([(e.name, e.label, tuple(e.ranks), e.args["buffer_bytes"])
                       for e in tr.collectives()])
    assert traces[0] == traces[1]
    assert len([t for t in traces[0] if t[1] == "dp bucket"]) == 2 * 2  # 2 buckets x 2 groups


def test_bad_arguments_name_the_fix():
    mesh = mesh2d()
    with pytest.raises(NotImplementedError, match="overlap_grad_reduce=True"):
        wb.DistributedDataParallel(wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp"), mesh,
                                   overlap_grad_reduce=True)
    with pytest.raises(ValueError, match="pass that mesh"):
        wb.DistributedDataParallel(wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp"),
                                   wb.Mesh.grid(4, ["dp"]))
    with pytest.raises(ValueError, match="replicated there"):   # sharded on dp: not DDP's
        wb.DistributedDataParallel(wb.parallelize(mlp(), mesh, {"0": "colwise"},
                                                  mesh_dim="dp"), mesh)
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        wb.DistributedDataParallel(wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp"), mesh,
                                   bucket_bytes=0)
    ddp = wb.DistributedDataParallel(wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp"), mesh)
    with pytest.raises(NotImplementedError, match="assign=False"):   # (state_dict works:
        ddp.load_state_dict(ddp.state_dict(), assign=True)          # test_dp_family_habits)


# ---- FullyShardedDataParallel over DistTensor parameters (ZeRO-3 over dp x TP over tp) ----

def fsdp_dp_tp(steps, prefetch=False):
    mesh = mesh2d()
    model = wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")
    fsdp = wb.FullyShardedDataParallel(model, mesh, "dp", prefetch=prefetch)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    x, y = batch()
    xd = wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()])
    yd = wb.shard_tensor(y, mesh, [wb.Shard(0), wb.Replicate()])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with wb.trace() as tr:
            loss = ((fsdp(xd) - yd) ** 2).mean()
            loss.backward()
            fsdp.finish_gradient_synchronization()
        opt.step()
        losses.append(loss.full().item())
    return losses, fsdp, tr


def test_fsdp_over_tp_gives_one_devices_losses_and_parameters():
    from workbench.parallel.strategies.fsdp_dist import DistTensorFSDP
    from workbench.parallel.strategies.zero3 import Zero3
    ref_losses, ref = one_device(3)
    losses, fsdp, tr = fsdp_dp_tp(3)
    assert isinstance(fsdp, wb.FullyShardedDataParallel) and isinstance(fsdp, DistTensorFSDP)
    assert issubclass(Zero3, wb.FullyShardedDataParallel)      # the course's name for it
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=1e-6)
    got = fsdp.full_state_dict()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    # each rank keeps chunk k of its tp shard: (dp, tp, 16*32/2/2) for the first weight
    # (the storage; a user's p.shape is the module's, habits15)
    from workbench.parallel.strategies.laid_out_whole import storage_shape
    w0 = dict(fsdp.named_parameters())["0.weight"]
    assert tuple(storage_shape(w0)) == (2, 2, 128) and w0.shape == (32, 16)
    # ZeRO-3 per step on each of the 2 dp groups: one all-gather per module in forward and
    # in backward, one reduce-scatter per gradient: 3 x (p-1)/p of the tp shard's bytes
    ev = [e for e in tr.collectives() if e.label.startswith("zero-3") and e.ranks == (0, 2)]
    kinds = sorted(e.name for e in ev)
    assert kinds == ["all_gather"] * 4 + ["reduce_scatter"] * 4
    shard_bytes = 4 * (256 + 16 + 256 + 16)                    # one tp rank's parameters
    assert sum(e.bytes for e in ev) == 3 * shard_bytes // 2


def test_fsdp_over_distensors_refuses_what_it_does_not_build():
    mesh = mesh2d()
    make = lambda: wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")   # noqa: E731
    with pytest.raises(NotImplementedError, match="compute_dtype"):
        wb.FullyShardedDataParallel(make(), mesh, compute_dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="reshard_after_forward=False"):
        wb.FullyShardedDataParallel(make(), mesh, reshard_after_forward=False)
    with pytest.raises(ValueError, match="pass that mesh"):
        wb.FullyShardedDataParallel(make(), wb.Mesh.grid(4, ["dp"]))
    with pytest.raises(ValueError, match="prefetch=-1"):
        wb.FullyShardedDataParallel(make(), mesh, prefetch=-1)
    fsdp = wb.FullyShardedDataParallel(make(), mesh)
    with pytest.raises(NotImplementedError):        # (state_dict: test_dp_family_habits)
        fsdp.to(torch.float64)


# ---- ZeroRedundancyOptimizer(partition="chunks"): ZeRO-1/2 over dp x TP over tp ---------------

def zero_dp_tp(steps, overlap_comm):
    from workbench.parallel.strategies.zero_optimizer_dist import ChunkedZeroOptimizer
    mesh = mesh2d()
    model = wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")
    opt = wb.ZeroRedundancyOptimizer(wb.dist_parameters(model), torch.optim.AdamW, mesh, "dp",
                                     partition="chunks", overlap_comm=overlap_comm, lr=1e-2)
    assert isinstance(opt, ChunkedZeroOptimizer) and isinstance(opt, wb.ZeroRedundancyOptimizer)
    x, y = batch()
    xd = wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()])
    yd = wb.shard_tensor(y, mesh, [wb.Shard(0), wb.Replicate()])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with wb.trace() as tr:
            loss = ((model(xd) - yd) ** 2).mean()
            loss.backward()
            opt.step()
        losses.append(loss.full().item())
    return losses, model, opt, tr


@pytest.mark.parametrize("overlap_comm", [False, True])
def test_zero_chunks_over_tp_gives_one_devices_losses_and_sends_dps_bytes(overlap_comm):
    ref_losses, ref = one_device(3)
    losses, model, opt, tr = zero_dp_tp(3, overlap_comm)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=1e-6)
    for name, p in wb.dist_parameters(model):
        torch.testing.assert_close(p.full(), ref[name], rtol=1e-5, atol=1e-6, msg=name)
    # each rank holds the optimizer states of its chunk only: (dp, tp, chunk)
    assert opt.shards[0].shape == (2, 2, 128)
    assert opt.optimizer.state[opt.shards[0]]["exp_avg"].shape == (2, 2, 128)
    stage = 2 if overlap_comm else 1
    ev = [e for e in tr.collectives() if e.label.startswith(f"zero-{stage}")
          and e.ranks == (0, 2)]
    kinds = sorted(e.name for e in ev)
    # ZeRO-1: one reduce-scatter of one buffer; ZeRO-2: one per gradient, async in backward
    assert kinds == ["all_gather"] + ["reduce_scatter"] * (4 if overlap_comm else 1)
    # ZeRO-2's are launched from backward's hooks (async), ZeRO-1's by step()
    assert all(e.label.endswith("(async)") for e in ev if e.name == "reduce_scatter") \
        == overlap_comm
    shard_bytes = 4 * (256 + 16 + 256 + 16)          # one tp rank's parameters, all divide
    assert sum(e.bytes for e in ev) == 2 * shard_bytes // 2      # = DP's all-reduce


def test_zero_partition_is_checked():
    mesh = mesh2d()
    with pytest.raises(ValueError, match="partition='rows'"):
        wb.ZeroRedundancyOptimizer(mlp().parameters(), torch.optim.SGD, None, partition="rows",
                                   lr=0.1)
    with pytest.raises(ValueError, match="DistTensor parameters"):
        wb.ZeroRedundancyOptimizer(list(mlp().parameters()), torch.optim.SGD, mesh,
                                   partition="chunks", lr=0.1)


def test_zero_chunks_zero_grad_set_to_none_false_zeroes_in_place():
    # torch.optim's contract: set_to_none=False keeps a zero gradient instead of None,
    # and training continues exactly as with None
    from workbench.parallel.strategies.zero_optimizer_dist import ChunkedZeroOptimizer
    ref_losses, _ = one_device(3)
    mesh = mesh2d()
    model = wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")
    opt = wb.ZeroRedundancyOptimizer(wb.dist_parameters(model), torch.optim.AdamW, mesh, "dp",
                                     partition="chunks", lr=1e-2)
    assert isinstance(opt, ChunkedZeroOptimizer)
    x, y = batch()
    xd = wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()])
    yd = wb.shard_tensor(y, mesh, [wb.Shard(0), wb.Replicate()])
    losses = []
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        for p in opt.params:
            assert p._local.grad is None or not p._local.grad.any()
        loss = ((model(xd) - yd) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.full().item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=1e-6)
    # a backward thrown away by zero_grad(set_to_none=False): zero gradients kept, and
    # the next step sees only the next backward's (same parameters as a plain step)
    ((model(xd) - yd) ** 2).mean().backward()
    opt.zero_grad(set_to_none=False)
    kept = [p._local.grad for p in opt.params if p._local.grad is not None]
    assert kept and all(not g.any() for g in kept)
