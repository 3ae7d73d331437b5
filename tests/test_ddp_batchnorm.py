"""BatchNorm in training mode under the simulated-rank DistributedDataParallel, held to
torch DDP's semantics: each rank normalizes by its own batch shard's statistics, the
buffers are broadcast from rank 0 before each forward (``broadcast_buffers=True``), so the
running statistics are rank 0's, and the gradient is the average of the ranks'."""
import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import workbench as wb


def cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def reference_step(ref, opt, x, y, n):
    """torch DDP by hand: rank 0's buffers to every rank, each rank's forward on its
    shard (torch.chunk, as Shard(0) splits), gradients averaged; each rank's loss is its
    share of the global batch's mean (the loss the test takes over the whole output)."""
    start = copy.deepcopy(ref.state_dict())
    shards = list(zip(torch.chunk(x, n), torch.chunk(y, n)))
    grads, outs, rank0 = None, [], None
    for k, (xs, ys) in enumerate(shards):
        ref.load_state_dict(start)                         # broadcast of rank 0's buffers
        ref.zero_grad()
        out = ref(xs)
        (nn.functional.cross_entropy(out, ys, reduction="sum") * n / len(x)).backward()
        outs.append(out.detach())
        g = [p.grad.clone() for p in ref.parameters()]
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        if k == 0:
            rank0 = copy.deepcopy(ref.state_dict())
    ref.load_state_dict(rank0)
    for p, g in zip(ref.parameters(), grads):
        p.grad = g / len(shards)
    opt.step()
    return torch.cat(outs)


@pytest.mark.parametrize("make,shape,n,batch", [(cnn, (2, 4, 4), 2, 8), (cnn, (2, 4, 4), 3, 8),
                                                (mlp, (5,), 3, 10), (mlp, (5,), 4, 14)])
def test_plain_batchnorm_trains_as_torch_ddp(make, shape, n, batch):
    ref, m = make(), make()
    mesh = wb.Mesh.grid(n, ["dp"])
    w = wb.DistributedDataParallel(m, mesh)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(w.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn((batch,) + shape, generator=g)
        y = torch.randint(0, 2, (batch,), generator=g)
        want = reference_step(ref, opt_ref, x, y, n)
        opt.zero_grad()
        out = w(wb.shard_tensor(x, mesh, [wb.Shard(0)]))
        loss = nn.functional.cross_entropy(out, wb.shard_tensor(y, mesh, [wb.Shard(0)]))
        loss.backward()
        opt.step()
        assert_close(out.full_tensor(), want)
        sd, want_sd = w.module.state_dict(), ref.state_dict()
        assert list(sd) == list(want_sd)
        for k in want_sd:
            assert_close(sd[k], want_sd[k], msg=k)


def test_sync_batchnorm_still_raises_on_simulated_ranks():
    m = nn.SyncBatchNorm.convert_sync_batchnorm(mlp())
    mesh = wb.Mesh.grid(2, ["dp"])
    w = wb.DistributedDataParallel(m, mesh)
    with pytest.raises(NotImplementedError, match=r"\(SyncBatchNorm\) takes its statistics over every rank.*DistTensor"):
        w(wb.shard_tensor(torch.randn(4, 5), mesh, [wb.Shard(0)]))


def test_broadcast_buffers_false_raises_naming_the_argument():
    with pytest.raises(NotImplementedError, match="broadcast_buffers=False"):
        wb.DistributedDataParallel(mlp(), wb.Mesh.grid(2, ["dp"]), broadcast_buffers=False)
    w = wb.DistributedDataParallel(mlp(), wb.Mesh.grid(2, ["dp"]), broadcast_buffers=True)
    assert w.broadcast_from == 0
