"""A PyTorch user's ordinary loop on the wrappers (habits5): each test holds a habit to
plain PyTorch on one device (or torch's documented semantics) and failed before its fix.

1. ``DistributedDataParallel`` over DistTensor parameters reduces at the end of backward,
   as torch DDP (``loss.backward(); opt.step()`` raised: "not summed yet");
2. ``FullyShardedDataParallel.no_sync()`` (FSDP1's: unsharded gradients kept, their sum
   reduce-scattered by the next synced backward) raised "not built";
3. ``fully_shard`` over DistTensors: a parameter attribute outside forward is one object.
"""
import pytest
import torch
from torch import nn

import workbench as wb

PLAN = {"0": "colwise", "2": "rowwise"}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def batches(k=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g))
            for _ in range(k)]


def mse(out, y):
    return ((out - y) ** 2).mean()


def ddp_dist(**kw):
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    model = wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")
    return mesh, model, wb.DistributedDataParallel(model, mesh, "dp", **kw)


def dist(x, mesh):
    return wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()])


def reductions(tr) -> list:
    """The gradient all-reduces over dp in a trace: one per bucket and dp group (two
    groups on the (2, 2) mesh, one per tp rank)."""
    return [e.label for e in tr.collectives() if e.name == "all_reduce" and
            e.label in ("dp bucket", "dp grad")]


ONE = ["dp bucket"] * 2          # one all-reduce of the one bucket, on each dp group


# ---- 1. DDP over DistTensors: reduced when backward returns ----------------------------
def test_ddp_dist_ordinary_loop_steps_as_one_device():
    ref = mlp()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    mesh, model, ddp = ddp_dist()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        ropt.zero_grad()
        mse(ref(x), y).backward()
        ropt.step()
        opt.zero_grad()
        mse(ddp(dist(x, mesh)), dist(y, mesh)).backward()
        opt.step()                           # raised: the gradients were not summed yet
    for n, p in ref.named_parameters():
        torch.testing.assert_close(ddp.full_state_dict()[n], p.detach(), msg=n)


def test_ddp_dist_reduces_once_per_synced_backward_finish_after_it_reduces_nothing():
    mesh, model, ddp = ddp_dist(bucket_bytes=float("inf"))   # one bucket: one all-reduce
    x, y = batches(2)[0]
    with wb.trace() as tr:
        mse(ddp(dist(x, mesh)), dist(y, mesh)).backward()
    assert reductions(tr) == ONE                         # was []: reduced in finish() only
    with wb.trace() as tr:
        ddp.finish_gradient_synchronization()            # still valid: nothing left to do
        ddp.finish_gradient_synchronization()
    assert reductions(tr) == []
    ddp.zero_grad()
    with wb.trace() as tr:                               # the next step: one again
        mse(ddp(dist(x, mesh)), dist(y, mesh)).backward()
    assert reductions(tr) == ONE


class _Boom(torch.autograd.Function):
    """Identity whose backward raises (a user's failing hook or op)."""

    @staticmethod
    def forward(ctx, t):
        return t * 1.0

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom")


def test_ddp_dist_reduces_again_after_a_backward_that_raised():
    # the failed backward queued its reduction (the last layer's weights had accumulated)
    # and never ran it; every later backward then reduced nothing, silently
    mesh, model, ddp = ddp_dist(bucket_bytes=float("inf"))
    (x, y), (x2, y2) = batches(2)
    mid = _Boom.apply(ddp.module[1](ddp.module[0](dist(x, mesh))))
    with pytest.raises(RuntimeError, match="boom"):
        mse(ddp.module[2](mid), dist(y, mesh)).backward()
    ddp.zero_grad()
    with wb.trace() as tr:
        mse(ddp(dist(x2, mesh)), dist(y2, mesh)).backward()
    assert reductions(tr) == ONE                         # was []


def test_ddp_dist_no_sync_then_a_synced_backward_reduces_the_sum_once():
    ref = mlp()
    data = batches(3)
    for x, y in data:
        mse(ref(x), y).backward()                        # one device accumulates 3
    mesh, model, ddp = ddp_dist(bucket_bytes=float("inf"))
    with wb.trace() as tr:
        with ddp.no_sync():
            for x, y in data[:2]:
                mse(ddp(dist(x, mesh)), dist(y, mesh)).backward()
        assert reductions(tr) == []                      # none inside no_sync
        x, y = data[2]
        mse(ddp(dist(x, mesh)), dist(y, mesh)).backward()
    assert reductions(tr) == ONE                         # the sum, once
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e9), want)
    full = {n: p.grad.full() for n, p in wb.dist_parameters(model)}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.grad, msg=n)


# ---- 2. FullyShardedDataParallel.no_sync(): FSDP1's ---------------------------------------
class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def two_blocks():
    torch.manual_seed(0)
    return TwoBlocks()


def micro_batches(steps, k, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(6, 6, generator=g), torch.randn(6, 5, generator=g))
             for _ in range(k)] for _ in range(steps)]


def grad_collectives(tr) -> list:
    return [e.label for e in tr.collectives() if e.label.startswith("fsdp grad")]


@pytest.mark.parametrize("compute_dtype", [None, torch.float64])
def test_fsdp_no_sync_accumulates_as_one_device(compute_dtype):
    ref = two_blocks()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    mesh = wb.Mesh.grid(3, ["dp"])
    fsdp = wb.FullyShardedDataParallel(two_blocks(), mesh, units=[nn.Sequential],
                                       compute_dtype=compute_dtype)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
    size = torch.empty((), dtype=compute_dtype or torch.float32).element_size()
    held_bytes = sum(-(-p.numel() // 3) * 3 * size for p in ref.parameters())
    for step in micro_batches(2, 3):
        ropt.zero_grad()
        for x, y in step:
            mse(ref(x), y).backward()
        opt.zero_grad()
        with wb.trace() as tr:
            with fsdp.no_sync():                 # raised NotImplementedError ("not built")
                for x, y in step[:-1]:
                    xd, yd = (wb.shard_tensor(t, mesh, [wb.Shard(0)]) for t in (x, y))
                    mse(fsdp(xd), yd).backward()
            assert grad_collectives(tr) == []    # no communication inside no_sync
            # the unsharded gradients, kept (FSDP1's note): every rank's, padded to 3 chunks
            assert fsdp.unsynced_bytes() == 3 * held_bytes
            x, y = step[-1]
            xd, yd = (wb.shard_tensor(t, mesh, [wb.Shard(0)]) for t in (x, y))
            mse(fsdp(xd), yd).backward()
        assert fsdp.unsynced_bytes() == 0
        # one reduce-scatter per unit, as a step without accumulation
        assert sorted(grad_collectives(tr)) == ["fsdp grad a", "fsdp grad b", "fsdp grad root"]
        want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
        got = torch.nn.utils.clip_grad_norm_(fsdp.parameters(), 1e9)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        ropt.step()
        opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(fsdp.full_state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_fsdp_over_disttensors_no_sync_still_raises():
    mesh, model = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"]), mlp()
    wb.parallelize(model, mesh, PLAN, mesh_dim="tp")
    fsdp = wb.FullyShardedDataParallel(model, mesh, "dp")
    with pytest.raises(NotImplementedError, match="not built"):
        with fsdp.no_sync():
            pass


# ---- 3. fully_shard over DistTensors: the attribute outside forward is one object ----------
def _tp_fully_shard():
    from tests.test_fully_shard import tp_model, wrap_tp_fsdp
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    return wrap_tp_fsdp(tp_model(), mesh), tp_model(), mesh


def _loss(m, mesh, ids, y):
    from tests.test_audit_tp_fsdp import _loss
    return _loss(m, mesh, ids, y)


def test_fully_shard_attribute_is_one_live_object_as_fsdp2():
    from tests.test_fully_shard import batches as tp_batches
    m, ref, mesh = _tp_fully_shard()
    list(m.parameters())                                 # the sharded state built
    w = m.blocks[0].up.weight
    assert w is m.blocks[0].up.weight                    # was False: a new gather per read
    assert m.blocks[1].up.weight is m.blocks[1].up.weight
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for ids, y in tp_batches(k=2):
        for model, o, me in ((m, opt, mesh), (ref, ropt, None)):
            o.zero_grad()
            _loss(model, me, ids, y).backward()
            o.step()
    assert w is m.blocks[0].up.weight
    # a reference kept across the steps reads the stepped value (FSDP2's is the parameter)
    torch.testing.assert_close(w.full(), ref.blocks[0].up.weight.detach())
    torch.testing.assert_close(w.grad.full(), ref.blocks[0].up.weight.grad)


def test_fully_shard_writes_through_the_kept_attribute_reach_the_shards():
    m, ref, mesh = _tp_fully_shard()
    list(m.parameters())                                 # the sharded state built
    w, rw = m.blocks[1].down.weight, ref.blocks[1].down.weight
    torch.manual_seed(3)
    torch.nn.init.normal_(w)
    torch.manual_seed(3)
    torch.nn.init.normal_(rw)
    torch.testing.assert_close(m.state_dict()["blocks.1.down.weight"].full(), rw.detach())
    w.data.copy_(torch.ones(w.shape))                    # through .data: the shards
    with torch.no_grad():
        rw.data.copy_(torch.ones(rw.shape))
        w.mul_(2)                                        # in place under no_grad
        rw.mul_(2)
    assert w is m.blocks[1].down.weight
    from tests.test_fully_shard import batches as tp_batches
    ids, y = tp_batches(k=1)[0]
    torch.testing.assert_close(_loss(m, mesh, ids, y), _loss(ref, None, ids, y))
    # a loss term on the kept attribute gives the shards one device's gradient
    m.zero_grad()
    ref.zero_grad()
    (w ** 2).sum().backward()
    (rw ** 2).sum().backward()
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9),
                               torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))


def test_fully_shard_tied_weight_outside_forward_is_one_object():
    from tests.test_habits4 import ids, tied
    mesh = wb.Mesh.grid((2, 1), ["dp", "tp"])
    m, ref = tied(), tied()
    wb.parallelize(m, mesh)
    wb.fully_shard(m, mesh=mesh["dp"])
    list(m.parameters())                                 # the sharded state built
    assert m.head.weight is m.emb.weight                 # was False (FSDP2: True)
    torch.testing.assert_close(m(wb.shard_tensor(ids(), mesh, ["S(0)", "R"])).full(),
                               ref(ids()))
    assert m.head.weight is m.emb.weight
    torch.testing.assert_close(m.emb.weight.full(), ref.emb.weight.detach())
