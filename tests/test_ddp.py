"""DistributedDataParallel on simulated ranks: one device's parameters with any
torch.optim optimizer; the all-reduces asynchronous in the trace, averaged, bucketed;
frozen, unused and tied parameters handled as PyTorch's DDP does."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.strategies.laid_out_whole import storage, storage_shape  # habits13
from tests.dist_scripts.wrappers_model import data, loss_fn, make, one_device, wrapped


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("n,bucket", [(2, None), (4, None), (2, 1), (4, 64)])
def test_five_steps_give_one_devices_parameters(n, bucket, opt):
    got = wrapped("ddp", opt, wb.Mesh.grid(n, ["dp"]), bucket_bytes=bucket)
    ref = one_device(opt)
    assert list(got) == list(ref)                       # the module's own names, no prefix
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-6, msg=name)
    assert torch.equal(got["frozen"], ref["frozen"])    # frozen stays frozen
    assert torch.equal(got["unused"], ref["unused"])    # unused: no grad, no weight decay


def test_parameters_are_the_modules_own_and_every_rank_has_a_copy():
    m = make()
    names = [n for n, _ in m.named_parameters()]
    ddp = wb.DistributedDataParallel(m, wb.Mesh.grid(4, ["dp"]))
    assert [n for n, _ in ddp.named_parameters()] == ["module." + n for n in names]   # torch's
    assert all(isinstance(p, nn.Parameter) and storage_shape(p)[0] == 4
               for p in ddp.parameters())
    assert m.head.weight is m.emb.weight                # still tied
    assert not m.frozen.requires_grad


def test_gradients_are_all_reduced_once_each_asynchronously_and_averaged():
    mesh = wb.Mesh.grid(4, ["dp"])
    ddp = wb.DistributedDataParallel(make(), mesh, bucket_bytes=1)     # one per parameter
    ids, y = data(1)[0]
    with wb.trace() as tr:
        loss_fn(ddp(wb.shard_tensor(ids, mesh, ["S(0)"])), wb.shard_tensor(y, mesh, ["S(0)"])) \
            .backward()
    grads = [e for e in tr.collectives() if e.label == "ddp grad"]
    # emb.weight (tied with head.weight: reduced once), hid.weight, hid.bias, and unused's
    # bucket (zeros: torch's reducer all-reduces every bucket, find_unused_parameters=True);
    # not frozen
    assert len(grads) == 4
    assert sorted(e.args["buffer_bytes"] for e in grads) == \
        sorted([12 * 8 * 4, 8 * 8 * 4, 8 * 4, 3 * 4])
    # launched from the hooks while backward runs: each on the comm stream, not blocking
    assert all(e.stream == "comm" for e in grads)
    # the average of the ranks' local-batch gradients = the gradient of the whole batch
    ref = make()
    loss_fn(ref(ids), y).backward()
    for (name, p), q in zip(ddp.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, name
            continue
        for k in range(4):
            torch.testing.assert_close(storage(p.grad)[k], q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_buckets_are_fewer_larger_messages():
    mesh = wb.Mesh.grid(2, ["dp"])
    ids, y = data(1)[0]
    counts = {}
    for bucket in (1, 10**6, None):
        ddp = wb.DistributedDataParallel(make(), mesh, bucket_bytes=bucket)
        with wb.trace() as tr:
            loss_fn(ddp(wb.shard_tensor(ids, mesh, ["S(0)"])),
                    wb.shard_tensor(y, mesh, ["S(0)"])).backward()
        ev = [e for e in tr.collectives() if e.label.startswith("ddp")]
        counts[bucket] = (len(ev), sum(e.args["buffer_bytes"] for e in ev))
    # every trainable parameter's bytes, the unused one's too (its zeros travel in its
    # bucket, as in torch's reducer)
    assert counts[1] == (4, (96 + 64 + 8 + 3) * 4)      # one all-reduce per parameter
    assert counts[10**6] == (1, (96 + 64 + 8 + 3) * 4)  # one bucket: the same bytes
    assert counts[None] == (1, (96 + 64 + 8 + 3) * 4)  # torch's first step: one per dtype


def test_broadcast_from_gives_every_rank_that_ranks_weights():
    mesh = wb.Mesh.grid(2, ["dp"])
    with wb.trace() as tr:
        ddp = wb.DistributedDataParallel(make(), mesh, broadcast_from=1)
    assert tr.counts()["broadcast"] == 1
    for p in ddp.parameters():
        assert torch.equal(storage(p)[0], storage(p)[1])


def test_no_sync_accumulates_then_reduces_the_sum():
    mesh = wb.Mesh.grid(2, ["dp"])
    (ids, y), (ids2, y2) = data(2)
    ddp = wb.DistributedDataParallel(make(), mesh)
    sh = lambda t: wb.shard_tensor(t, mesh, ["S(0)"])  # noqa: E731
    with ddp.no_sync():
        loss_fn(ddp(sh(ids)), sh(y)).backward()
    loss_fn(ddp(sh(ids2)), sh(y2)).backward()
    ref = make()
    (loss_fn(ref(ids), y) + loss_fn(ref(ids2), y2)).backward()
    torch.testing.assert_close(storage(ddp.module.hid.weight.grad)[1], ref.hid.weight.grad,
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kw,msg", [(dict(bucket_bytes=0), "bucket_bytes=0"),
                                    (dict(broadcast_from=2), "broadcast_from=2"),
                                    (dict(dim="tp"), "not in dim_names")])
def test_bad_arguments_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        wb.DistributedDataParallel(make(), wb.Mesh.grid(2, ["dp"]), **kw)


def test_mesh_none_without_torch_distributed_says_how_to_start_it():
    with pytest.raises(RuntimeError, match="wb.distributed.init"):
        wb.DistributedDataParallel(make())


def test_a_module_is_wrapped_once():
    m = make()
    wb.DistributedDataParallel(m, wb.Mesh.grid(2, ["dp"]))
    with pytest.raises(ValueError, match="already wrapped"):
        wb.FullyShardedDataParallel(m, wb.Mesh.grid(2, ["dp"]))


def test_check_replicas_finds_a_rank_that_drifted():
    ddp = wb.DistributedDataParallel(make(), wb.Mesh.grid(2, ["dp"]))
    ddp.check_replicas()
    with torch.no_grad():
        storage(ddp.module.hid.bias)[1, 0] += 1.0     # rank 1's copy only
    with pytest.raises(RuntimeError, match="'hid.bias' differ"):
        ddp.check_replicas()
