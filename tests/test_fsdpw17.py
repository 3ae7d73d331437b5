"""fsdpw17: a write into a parameter between forward and backward under the sharded
wrappers raises at backward as one device's torch does; ``stride()`` of a DistTensor view
is torch's (``expand``: 0)."""
import pytest
import torch
from torch import nn

import workbench as wb


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))


def _fsdp_units(m, mesh):
    return wb.FullyShardedDataParallel(m, mesh, units=[m[0], m[2]])


def _fsdp_units_prefetch(m, mesh):
    return wb.FullyShardedDataParallel(m, mesh, units=[m[0], m[2]], prefetch=True)


def _fully_shard_blocks(m, mesh):
    wb.fully_shard(m[0], mesh=mesh)
    wb.fully_shard(m[2], mesh=mesh)
    return wb.fully_shard(m, mesh=mesh)


def _fully_shard_root(m, mesh):
    return wb.fully_shard(m, mesh=mesh)


WRAPS = {"fsdp-units": _fsdp_units, "fsdp-units-prefetch": _fsdp_units_prefetch,
         "fully_shard-blocks": _fully_shard_blocks, "fully_shard-root": _fully_shard_root}


def _loss(m, mesh):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 6, generator=g), torch.randn(6, 5, generator=g)
    if mesh is not None:
        x, y = (wb.shard_tensor(t, mesh, [wb.Shard(0)]) for t in (x, y))
    return ((m(x) - y) ** 2).mean()


def _write(p):
    with torch.no_grad():
        p.mul_(2)


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_write_between_forward_and_backward_raises_as_one_device(wrap):
    """Units resharded after forward re-gather at backward: the re-gather read the written
    shard (the new weights' gradient, silently); the kept root's copy the old one.  Both
    raise now, as one device's saved weight does."""
    ref = _mlp()
    loss = _loss(ref, None)
    _write(ref[2].weight)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as one:
        loss.backward()
    mesh = wb.Mesh.grid(3, ["dp"])
    m = _mlp()
    w = WRAPS[wrap](m, mesh)
    loss = _loss(w, mesh)
    _write(m[2].weight)
    with pytest.raises(type(one.value), match="modified by an inplace operation.*'2.weight'"):
        loss.backward()


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_unwritten_step_still_matches_one_device(wrap):
    """The check leaves a plain step alone: the gradients equal one device's, and a write
    after backward (the optimizer's) does not raise at the next backward."""
    ref, m = _mlp(), _mlp()
    mesh = wb.Mesh.grid(3, ["dp"])
    w = WRAPS[wrap](m, mesh)
    for model, me in ((ref, None), (w, mesh)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            _loss(model, me).backward()
            opt.step()
    want = dict(ref.named_parameters())
    got = dict(w.named_parameters())
    assert list(got) == list(want)
    for name, p in got.items():
        torch.testing.assert_close(p.full_tensor(), want[name], rtol=1e-6, atol=1e-6, msg=name)


VIEWS = {
    "expand": lambda x: x.expand(3, 4, 4),
    "t.expand": lambda x: x.t().expand(2, 4, 4),
    "unsqueeze.expand": lambda x: x[:, None].expand(4, 3, 4),
    "step slice": lambda x: x[:, ::2],
    "diagonal": lambda x: x.diagonal(),
    "unfold": lambda x: x.unfold(0, 2, 1),
    "expand.exp": lambda x: x.expand(3, 4, 4).exp(),
    "expand.contiguous": lambda x: x.expand(3, 4, 4).contiguous(),
    "transpose": lambda x: x.transpose(0, 1),
}


@pytest.mark.parametrize("place", ["R", "S0", "S1"])
@pytest.mark.parametrize("name", sorted(VIEWS))
def test_view_strides_are_torchs(name, place):
    """``d.expand(3, 4, 4).stride()`` was (16, 4, 1) (dense strides in the shards' order)
    where torch gives (0, 4, 1); a step slice, ``diagonal``, ``unfold`` misstated likewise,
    and ``expand(...).exp()`` over Shard(1) gave (4, 12, 1) for (16, 4, 1)."""
    mesh = wb.Mesh.grid(2, ["dp"])
    t = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    pl = {"R": wb.Replicate(), "S0": wb.Shard(0), "S1": wb.Shard(1)}[place]
    d = VIEWS[name](wb.shard_tensor(t, mesh, [pl]))
    want = VIEWS[name](t)
    assert d.stride() == want.stride()
    assert d.is_contiguous() == want.is_contiguous()
    torch.testing.assert_close(d.full_tensor(), want)
