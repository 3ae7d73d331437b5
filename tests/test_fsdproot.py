"""FSDP's root unit stays gathered from forward to the end of backward, as torch's.

Torch never frees the root's gathered parameters after forward: FSDP2 sets the root's
``post_forward_mesh_info = None`` when ``reshard_after_forward`` is not given (torch 2.13
``torch/distributed/fsdp/_fully_shard/_fsdp_state.py:203-207``), FSDP1 skips the free for
the root (``_runtime_utils.py:493-500``), and both free them in the root's post-backward.
So the root's backward gathers nothing: per step the root sends one all-gather and one
reduce-scatter, a unit below it two all-gathers and one reduce-scatter.  Before this fix
``wb.FullyShardedDataParallel`` re-gathered the root in backward (an extra
``fsdp re-gather root`` all-gather) and held none of it between forward and backward.
"""
import pytest
import torch
from torch import nn

import workbench as wb

from .test_habits5 import _Boom      # identity whose backward raises


class Block(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.lin = nn.Linear(w, w)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """An embedding and a head in the root (their weights untied), two blocks."""

    def __init__(self, width=8, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def padded(p, n):
    return p.numel() + (-p.numel()) % n


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (4, 3), generator=g), torch.randint(0, 11, (4, 3), generator=g)


def loss_of(out, y):
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize("units", [None, {Block}])
@pytest.mark.parametrize("n", [2, 3])
def test_the_root_is_gathered_once_per_step(n, units):
    torch.manual_seed(0)
    net = Net()
    sizes = {name: 4 * padded(p, n) for name, p in net.named_parameters()}   # fp32 bytes
    mesh = wb.Mesh.grid(n, ["dp"])
    f = wb.FullyShardedDataParallel(net, mesh, units=units)
    ids, y = batch()
    with wb.trace() as tr:
        loss_of(f(wb.shard_tensor(ids, mesh, ["S(0)"])).full(), y).backward()
    ag = [(e.label, e.args["buffer_bytes"]) for e in tr.collectives()
          if e.name == "all_gather" and e.label.startswith("fsdp")]
    rs = [(e.label, e.args["buffer_bytes"]) for e in tr.collectives()
          if e.name == "reduce_scatter" and e.label.startswith("fsdp")]
    if units is None:               # the whole module is the root: torch's rule, 1 gather
        assert ag == [("fsdp params root", sum(sizes.values()))]
        assert rs == [("fsdp grad root", sum(sizes.values()))]
        return
    root = sizes["emb.weight"] + sizes["head.weight"]
    blk = [sizes[f"blocks.{i}.lin.weight"] + sizes[f"blocks.{i}.lin.bias"] for i in (0, 1)]
    # forward: root, block 0, block 1; backward: each block re-gathers the weight its
    # linear saved (not the bias, which no backward formula reads), the root nothing
    assert ag == [("fsdp params root", root), ("fsdp params blocks.0", blk[0]),
                  ("fsdp params blocks.1", blk[1]),
                  ("fsdp re-gather blocks.1", sizes["blocks.1.lin.weight"]),
                  ("fsdp re-gather blocks.0", sizes["blocks.0.lin.weight"])]
    assert rs == [("fsdp grad blocks.1", blk[1]), ("fsdp grad blocks.0", blk[0]),
                  ("fsdp grad root", root)]
    assert sum(sizes.values()) == root + sum(blk)      # every parameter in one unit


def test_the_root_lives_until_its_gradients_are_reduced():
    n = 2
    torch.manual_seed(0)
    net = Net()
    root = 4 * (padded(net.emb.weight, n) + padded(net.head.weight, n))   # one rank's
    blk0 = 4 * padded(net.blocks[0].lin.weight, n)
    mesh = wb.Mesh.grid(n, ["dp"])
    f = wb.FullyShardedDataParallel(net, mesh, units={Block})
    seen = []
    # at block 0's backward (the last block backward reaches) each rank still holds its
    # root beside the block's re-gathered weight; the simulated ranks' backward ends one
    # after the other, a rank's root freed by its own share of the root's reduce-scatter
    net.blocks[0].lin.register_full_backward_hook(lambda *a: seen.append(f.gathered.alive()))
    ids, y = batch()
    loss = loss_of(f(wb.shard_tensor(ids, mesh, ["S(0)"])).full(), y)
    assert f.gathered.alive() == n * root            # after forward: the root kept
    loss.backward()
    # before the fix: [n * head + blk0, head + blk0], only the re-gathered head weight
    assert seen == [2 * root + blk0, root + blk0]
    assert f.gathered.alive() == 0                   # freed by its reduce-scatter
    with torch.no_grad():                            # no backward coming: nothing kept
        f(wb.shard_tensor(ids, mesh, ["S(0)"]))
    assert f.gathered.alive() == 0


@pytest.mark.parametrize("units", [None, {Block}])
def test_gradients_unchanged_against_one_device(units):
    n = 3
    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(0)
    mesh = wb.Mesh.grid(n, ["dp"])
    f = wb.FullyShardedDataParallel(Net(), mesh, units=units)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    o = torch.optim.SGD(f.parameters(), lr=0.5)
    for s in range(3):
        ids, y = batch(s)
        o_ref.zero_grad()
        o.zero_grad()
        loss_of(ref(ids), y).backward()
        loss_of(f(wb.shard_tensor(ids, mesh, ["S(0)"])).full(), y).backward()
        o_ref.step()
        o.step()
    got = f.full_state_dict()
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(got[name], t, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("reshard", [None, True, False])
def test_fully_shard_root_follows_reshard_after_forward(reshard):
    # torch: None keeps the root gathered, an explicit True reshards it (re-gathered in
    # backward), False keeps it (FSDP2 _fully_shard.py: auto_reshard_after_forward)
    n = 2
    torch.manual_seed(0)
    net = Net()
    mesh = wb.Mesh.grid(n, ["dp"])
    for b in net.blocks:
        wb.fully_shard(b, mesh=mesh)
    wb.fully_shard(net, mesh=mesh, reshard_after_forward=reshard)
    ids, y = batch()
    with wb.trace() as tr:
        loss_of(net(wb.shard_tensor(ids, mesh, ["S(0)"])).full(), y).backward()
    labels = [e.label for e in tr.collectives() if e.name == "all_gather"]
    assert ("fsdp re-gather root" in labels) is (reshard is True)
    assert labels.count("fsdp re-gather blocks.0") == 1


class UnusedRoot(nn.Module):
    """The root's only parameter never reaches the loss: its reduce-scatter never comes."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.randn(5))
        self.blk = nn.Linear(4, 4)

    def forward(self, x):
        return self.blk(x)


def test_the_root_is_freed_when_backward_ends_without_its_reduce_scatter():
    # FSDP2 reshards the root in its final callback (_root_post_backward_final_callback),
    # which runs even when none of its gradients came; so here: nothing alive after backward
    torch.manual_seed(0)
    mesh = wb.Mesh.grid(2, ["dp"])
    f = wb.FullyShardedDataParallel(UnusedRoot(), mesh, units=[nn.Linear])
    out = f(wb.shard_tensor(torch.randn(4, 4), mesh, ["S(0)"]))
    assert f.gathered.alive() == 2 * 4 * 6          # 2 ranks x fp32 x padded (6,) copy
    out.full().sum().backward()
    assert f.gathered.alive() == 0


def test_a_root_kept_by_a_backward_that_raised_is_freed_by_the_next_forward():
    # the failed step's kept root stayed counted alive for good: every later step ended
    # with 2,560 B alive and a backward peak 6,144 B instead of 3,584
    def model():
        torch.manual_seed(0)
        return wb.FullyShardedDataParallel(Net(), mesh, units={Block})
    mesh = wb.Mesh.grid(2, ["dp"])
    ids, y = batch()
    d, dy = (wb.shard_tensor(t, mesh, ["S(0)"]) for t in (ids, y))
    clean = model()
    clean.gathered.reset_peak()
    loss_of(clean(d), dy).backward()
    want = clean.gathered.peak
    f = model()
    with pytest.raises(RuntimeError, match="boom"):
        loss_of(_Boom.apply(f(d)), dy).backward()
    f.zero_grad()
    f.gathered.reset_peak()
    loss_of(f(d), dy).backward()
    assert f.gathered.alive() == 0 and f.gathered.peak == want
