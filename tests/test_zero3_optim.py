"""Zero3's shards are nn.Parameters any torch.optim optimizer steps, under the module's own
qualified names; tied weights stay one tensor (parallelize, DataParallel, Zero3), frozen
ones stay frozen, unused ones untouched: the same parameters as one device."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.parallel.strategies.data_parallel import DataParallel
from workbench.parallel.strategies.zero3 import Zero3

V, H, B, S = 16, 8, 8, 4


class Tied(nn.Module):
    """A tied head, a frozen bias that is used, and a module never used in forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, H)
        self.mid = nn.Linear(H, H)
        self.mid.bias.requires_grad_(False)
        self.spare = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(B * S, V), targets.reshape(B * S))


def data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
}


def one_device(make_opt, steps=5):
    m = Tied()
    opt = make_opt(m.parameters())
    for step in range(steps):
        ids, tgt = data(step)
        opt.zero_grad()
        loss_of(m(ids), tgt).backward()
        opt.step()
    return m


def sharded(mesh, make_opt=None, steps=5):
    m = Tied()
    wb.parallelize(m, mesh, {})
    z = Zero3(m, mesh, "dp", lr=1e-2, weight_decay=0.1)
    opt = make_opt(z.parameters()) if make_opt else None
    for step in range(steps):
        ids, tgt = data(step)
        dp = ["S(0)" if n == "dp" else "R" for n in mesh.dim_names]
        loss_of(m(wb.shard_tensor(ids, mesh, dp)), wb.shard_tensor(tgt, mesh, dp)).backward()
        if opt is None:
            z.step()
        else:
            z.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad()
    return z


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("grid", [(2,), (4,), (2, 2)])
def test_torch_optim_steps_the_shards_like_one_device(opt, grid):
    ref = one_device(OPTIMIZERS[opt])
    mesh = wb.Mesh.grid(grid, ["dp", "tp"][:len(grid)])
    z = sharded(mesh, OPTIMIZERS[opt])
    got = dict(z.full_parameters())
    want = dict(ref.named_parameters())
    assert list(got) == list(want)                        # qualified, complete, tied once
    for n, q in want.items():
        torch.testing.assert_close(got[n], q.detach(), rtol=1e-5, atol=1e-6, msg=n)
    fresh = Tied()
    for n in ("mid.bias", "spare.weight", "spare.bias"):  # frozen / unused: untouched
        assert torch.equal(got[n], getattr(fresh, n.split(".")[0]).get_parameter(
            n.split(".")[1]).detach()), n


def test_named_parameters_are_the_modules_own_names():
    mesh = wb.Mesh.grid(2, ["dp"])
    m = Tied()
    names = [n for n, _ in m.named_parameters()]
    wb.parallelize(m, mesh, {})
    assert m.emb.weight is m.head.weight                  # parallelize keeps the tie
    assert [n for n, _ in wb.dist_parameters(m)] == names
    z = Zero3(m, mesh, "dp")
    assert [n for n, _ in z.named_parameters()] == names
    both = [n for n, _ in z.named_parameters(remove_duplicate=False)]
    assert both == [n for n, _ in Tied().named_parameters(remove_duplicate=False)]
    assert "head.weight" in both and "head.weight" not in names
    shards = dict(z.named_parameters())
    assert all(isinstance(p, nn.Parameter) for p in shards.values())
    assert not shards["mid.bias"].requires_grad and shards["mid.weight"].requires_grad
    assert list(z.parameters()) == list(shards.values())
    sd = z.full_state_dict()
    ref = Tied().state_dict()
    assert list(sd) == list(ref)                          # every name of the tied weight
    for n, t in ref.items():
        assert torch.equal(sd[n], t), n


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_library_adamw_with_tied_frozen_unused(zero):
    """DataParallel (ZeRO 0-2) and Zero3.step() with their own AdamW: one device's
    torch.optim.AdamW parameters, the tied weight updated once per step."""
    ref = one_device(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    mesh = wb.Mesh.grid(2, ["dp"])
    if zero == 3:
        got = dict(sharded(mesh).full_parameters())
    else:
        m = Tied()
        wb.parallelize(m, mesh, {})
        opt = DataParallel(list(wb.dist_parameters(m)), mesh, "dp", zero=zero, lr=1e-2,
                           weight_decay=0.1)
        for step in range(5):
            ids, tgt = data(step)
            x, y = wb.shard_tensor(ids, mesh, ["S(0)"]), wb.shard_tensor(tgt, mesh, ["S(0)"])
            loss_of(m(x), y).backward()
            opt.step()
        got = {n: p.full() for n, p in wb.dist_parameters(m)}
    want = dict(ref.named_parameters())
    assert list(got) == list(want)
    for n, q in want.items():
        torch.testing.assert_close(got[n], q.detach(), rtol=1e-5, atol=1e-6, msg=n)


def test_step_delegates_to_a_torch_optim_adamw_bitwise():
    """Zero3.step() is its ``optimizer`` (wb.ops.AdamW over the shards) plus the
    waits: the same bits as that optimizer driven by hand."""
    mesh = wb.Mesh.grid(4, ["dp"])
    a = sharded(mesh, steps=3)
    b = sharded(mesh, lambda ps: wb.ops.AdamW(ps, lr=1e-2, weight_decay=0.1), steps=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert isinstance(a.optimizer, torch.optim.Optimizer)


class Sometimes(nn.Module):
    """``extra`` is used on some steps only: torch.optim.AdamW advances its step count
    (its bias correction) only on the steps that give it a gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.extra, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, use_extra):
        h = torch.tanh(self.a(x))
        return self.b(h + self.extra(h) if use_extra else h)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_parameter_unused_on_some_steps_counts_its_own_steps(zero):
    uses = [False, True, False, True, True]
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    ref = Sometimes()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for use in uses:
        opt.zero_grad()
        ((ref(X, use) - Y) ** 2).mean().backward()
        opt.step()
    mesh = wb.Mesh.grid(2, ["dp"])
    m = Sometimes()
    wb.parallelize(m, mesh, {})
    dp = Zero3(m, mesh, "dp", lr=1e-2, weight_decay=0.1) if zero == 3 else \
        DataParallel(list(wb.dist_parameters(m)), mesh, "dp", zero=zero, lr=1e-2,
                     weight_decay=0.1)
    x, y = wb.shard_tensor(X, mesh, ["S(0)"]), wb.shard_tensor(Y, mesh, ["S(0)"])
    for use in uses:
        ((m(x, use) - y) ** 2).mean().backward()
        dp.step()
    got = dict(dp.full_parameters()) if zero == 3 else \
        {n: p.full() for n, p in wb.dist_parameters(m)}
    for n, q in ref.named_parameters():
        torch.testing.assert_close(got[n], q.detach(), rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("bucket_bytes", [None, 256, math.inf])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_plain_data_parallel_under_torch_optim(opt, bucket_bytes):
    """DataParallel(zero=0): finish_gradient_synchronization() leaves each replica the
    global gradient, and any torch.optim optimizer over parameters() trains like one
    device (tied weight once, frozen and unused untouched)."""
    ref = one_device(OPTIMIZERS[opt])
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    m = Tied()
    wb.parallelize(m, mesh, {"mid": "colwise"}, mesh_dim="tp")
    dp = DataParallel(list(wb.dist_parameters(m)), mesh, "dp", bucket_bytes=bucket_bytes)
    o = OPTIMIZERS[opt](dp.parameters())
    for step in range(5):
        ids, tgt = data(step)
        x, y = (wb.shard_tensor(t, mesh, ["S(0)", "R"]) for t in (ids, tgt))
        loss_of(m(x), y).backward()
        dp.finish_gradient_synchronization()
        o.step()
        o.zero_grad()
    got = {n: p.full() for n, p in wb.dist_parameters(m)}
    for n, q in ref.named_parameters():
        torch.testing.assert_close(got[n], q.detach(), rtol=1e-5, atol=1e-6, msg=n)
    assert torch.equal(got["spare.weight"], Tied().spare.weight.detach())


def test_sharded_states_refuse_a_torch_optim_optimizer():
    mesh = wb.Mesh.grid(2, ["dp"])
    m = Tied()
    wb.parallelize(m, mesh, {})
    dp = DataParallel(list(wb.dist_parameters(m)), mesh, "dp", zero=1)
    with pytest.raises(ValueError, match=r"zero=1\).parameters\(\).*use zero=0"):
        dp.parameters()
