"""Gradients summed over two mesh dims at once (dp x cp, Megatron-Core's data-parallel
group with context parallelism): one all-reduce per bucket over the merged group, the
sum one device's; the replicas checked on every such dim; non-adjacent dims refused."""
import pytest
import torch

import workbench as wb
from workbench.parallel.strategies.laid_out_whole import storage  # the replicas (habits13)
from workbench.parallel.strategies.flat_dims import flatten_dims


def test_ddp_over_dp_and_cp_sums_once_and_checks_every_replica():
    mesh = wb.Mesh.grid((2, 2), ["dp", "cp"])
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    m = torch.nn.Linear(4, 3)
    m.load_state_dict(ref.state_dict())
    wb.parallelize(m, mesh, {}, mesh_dim="cp")
    ddp = wb.DistributedDataParallel(m, mesh, ("dp", "cp"), bucket_bytes=float("inf"))
    x = torch.randn(4, 6, 4)
    ref(x).square().sum().backward()
    xd = wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Shard(1)])   # batch on dp, tokens on cp
    with wb.trace("a100") as tr:
        ddp(xd).square().sum().backward()
        ddp.finish_gradient_synchronization()
    red = [e for e in tr.events if e.name == "all_reduce"]
    assert [(e.ranks, e.args["mesh_dim"], e.label) for e in red if e.label.startswith("dp")] \
        == [((0, 1, 2, 3), "dp_cp", "dp bucket")]
    # nothing else: the Partial loss seeds each rank's part (no all-reduce, as torch), and
    # no all-reduce per use of a weight ("linear input"): its replicas are real on both dims
    assert {e.label for e in red} == {"dp bucket"}
    w, b = ddp.parameters()
    for got, want in ((w.grad, ref.weight.grad), (b.grad, ref.bias.grad)):
        torch.testing.assert_close(got.sum(0), want.sum(0), rtol=1e-5, atol=1e-5)   # a user's
        for i in range(2):          # every replica's copy: the storage (habits14: p.grad's
            for j in range(2):      # reads are the module gradient's)
                torch.testing.assert_close(storage(got)[i, j], want, rtol=1e-5, atol=1e-5)
    ddp.check_replicas()
    with torch.no_grad():
        storage(w)[:, 1, 0, 0] += 1.0           # cp rank 1 drifts on every dp rank
    with pytest.raises(RuntimeError, match="replicas of 'weight' differ"):
        ddp.check_replicas()


def test_flatten_dims_merges_adjacent_dims_and_refuses_others():
    mesh = wb.Mesh.grid((2, 3, 2), ["dp", "cp", "tp"])
    flat, axis = flatten_dims(mesh, ("cp", "dp"))
    assert (flat.shape, flat.dim_names, axis) == ((6, 2), ("dp_cp", "tp"), 0)
    assert flat.groups(0) == [(0, 2, 4, 6, 8, 10), (1, 3, 5, 7, 9, 11)]
    assert flatten_dims(mesh, ("tp",)) == (mesh, 2)
    with pytest.raises(ValueError, match=r"\['dp', 'tp'\].*not adjacent"):
        flatten_dims(mesh, ("dp", "tp"))


def test_refusals_leave_the_parameters_untouched():
    from workbench.parallel.strategies.data_parallel import DataParallel
    mesh = wb.Mesh.grid((2, 1, 2), ["dp", "tp", "cp"])
    m = torch.nn.Linear(4, 3)
    wb.parallelize(m, mesh, {}, mesh_dim="cp")
    params = [p for _, p in wb.dist_parameters(m)]
    before = [p._local for p in params]
    # (ZeRO 1-2 over several dims is built now: tests/test_zerocp.py; not over these)
    for zero in (0, 1, 2):
        with pytest.raises(ValueError, match="not adjacent"):
            DataParallel(params, mesh, ("dp", "cp"), zero=zero)
    assert all(p._local is b for p, b in zip(params, before))
