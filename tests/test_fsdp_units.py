"""FSDP units (one per block): a unit gathers just before its forward and frees after,
gathers again for its backward and reduce-scatters when its backward ends, so the
gathered weights alive at once are the root's (kept gathered until its backward ends, as
torch's root) plus one block's (two with prefetch);
the training is the same as one unit's, bitwise."""
import pytest
import torch
from torch import nn

import workbench as wb
from tests.dist_scripts.wrappers_model import data, loss_fn, make, one_device


class Block(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.lin = nn.Linear(w, w, bias=False)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, layers=4, width=16, vocab=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def gathered(p, n, dtype=torch.float32):
    """Bytes of one rank's gathered copy of ``p``: its numel padded to a multiple of n."""
    return (p.numel() + (-p.numel()) % n) * dtype.itemsize


def peaks(n, units, prefetch, steps=2):
    torch.manual_seed(0)
    mesh = wb.Mesh.grid(n, ["dp"])
    net = Net()
    sizes = {name: gathered(p, n) for name, p in net.named_parameters()}
    f = wb.FullyShardedDataParallel(net, mesh, units=units, prefetch=prefetch)
    ids = wb.shard_tensor(torch.randint(0, 10, (4, 3)), mesh, ["S(0)"])
    out = []
    for _ in range(steps):
        f.gathered.reset_peak()
        loss = f(ids).full().sum()
        fwd, after_fwd = f.gathered.peak, f.gathered.alive()
        f.gathered.reset_peak()
        loss.backward()
        out.append((fwd, after_fwd, f.gathered.peak, f.gathered.alive()))
    return sizes, out


@pytest.mark.parametrize("n", [2, 4])
def test_gathered_weights_alive_at_once_are_root_plus_one_unit(n):
    sizes, whole = peaks(n, None, False)
    everything = sum(sizes.values())
    block = sizes["blocks.0.lin.weight"]
    root = sizes["emb.weight"] + sizes["head.weight"]
    # the root stays gathered from its forward to the end of its backward, as torch's root
    # (FSDP2: no reshard after forward, _fsdp_state.py:203-207); its backward re-gathers
    # nothing.  The counts sum the simulated ranks, which run one after another: every
    # rank's root is alive at once (n copies) beside one rank's block.  Before the fix the
    # root was freed after forward (0 alive) and its saved head weight re-gathered.
    assert whole == [(n * everything, n * everything, n * everything, 0)] * 2
    _, units = peaks(n, {Block}, False)
    assert units == [(n * root + block, n * root, n * root + block, 0)] * 2
    assert root + block < everything
    # prefetch: the next unit is gathered one unit early (forward follows the order the
    # previous forward recorded, so the first forward does not prefetch)
    _, pre = peaks(n, {Block}, True)
    assert pre == [(n * root + block, n * root, n * root + 2 * block, 0),
                   (n * root + 2 * block, n * root, n * root + 2 * block, 0)]


def train(units, opt, prefetch=False, compute_dtype=None, n=2, model=make):
    mesh = wb.Mesh.grid(n, ["dp"])
    f = wb.FullyShardedDataParallel(model(), mesh, units=units, prefetch=prefetch,
                                    compute_dtype=compute_dtype)
    o = (torch.optim.SGD(f.parameters(), lr=0.05, momentum=0.9) if opt == "sgd" else
         torch.optim.AdamW(f.parameters(), lr=1e-3, weight_decay=0.1))
    for ids, y in data(5):
        o.zero_grad()
        loss_fn(f(wb.shard_tensor(ids, mesh, ["S(0)"])), wb.shard_tensor(y, mesh, ["S(0)"])) \
            .backward()
        o.step()
    return f, f.full_state_dict()


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_units_train_as_one_unit_bitwise_and_as_one_device(opt, prefetch):
    # nn.Linear units: hid is one; head's weight is tied to emb's, so it stays in the root
    f, got = train({nn.Linear}, opt, prefetch)
    assert [u.name for u in f.units] == ["", "hid", "head"]
    assert [[p[0] for p in u.params] for u in f.units] == \
        [["frozen", "unused", "emb.weight"], ["hid.weight", "hid.bias"], []]
    _, whole = train(None, opt)
    ref = one_device(opt)
    for name in ref:
        assert torch.equal(got[name], whole[name]), name
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-6, msg=name)


def test_units_with_bf16_compute_match_one_unit_bitwise():
    _, got = train({nn.Linear}, "adamw", True, torch.bfloat16, n=4)
    _, whole = train(None, "adamw", False, torch.bfloat16, n=4)
    assert all(torch.equal(got[k], whole[k]) for k in whole)


def test_collectives_follow_the_units():
    torch.manual_seed(0)
    mesh = wb.Mesh.grid(2, ["dp"])
    f = wb.FullyShardedDataParallel(Net(layers=2), mesh, units={Block})
    ids = wb.shard_tensor(torch.randint(0, 10, (4, 3)), mesh, ["S(0)"])
    with wb.trace() as tr:
        f(ids).full().sum().backward()
    got = [(e.name, e.label.split(" ", 2)[1:]) for e in tr.collectives()
           if e.label.startswith("fsdp")]
    ag, rs = "all_gather", "reduce_scatter"
    assert got == [                                          # one collective per unit
        (ag, ["params", "root"]), (ag, ["params", "blocks.0"]), (ag, ["params", "blocks.1"]),
        (ag, ["re-gather", "blocks.1"]),        # the root is kept gathered: no re-gather
        (rs, ["grad", "blocks.1"]),                          # block 1 done before block 0
        (ag, ["re-gather", "blocks.0"]),
        (rs, ["grad", "blocks.0"]),
        (rs, ["grad", "root"])]                              # emb and head together
    root = [e for e in tr.collectives() if e.label == "fsdp params root"][0]
    # the root's shards, (N, chunk) each: one rank's gathered copy of both, fp32
    assert root.args["buffer_bytes"] == 4 * (f.module.emb.weight.numel() +
                                             f.module.head.weight.numel()) == 4 * 2 * 160


def test_bad_units_are_named():
    mesh = wb.Mesh.grid(2, ["dp"])
    with pytest.raises(ValueError, match="not a submodule"):
        wb.FullyShardedDataParallel(Net(), mesh, units=[nn.Linear(2, 2)])
    m = Net()
    with pytest.raises(ValueError, match="root unit"):
        wb.FullyShardedDataParallel(m, mesh, units=[m])
    with pytest.raises(TypeError, match="units="):
        wb.FullyShardedDataParallel(Net(), mesh, units=3)
    with pytest.raises(TypeError, match="prefetch="):
        wb.FullyShardedDataParallel(Net(), mesh, units={Block}, prefetch="yes")


def test_a_unit_called_on_its_own_is_refused():
    f = wb.FullyShardedDataParallel(Net(), wb.Mesh.grid(2, ["dp"]), units={Block})
    with pytest.raises(RuntimeError, match="call the wrapper"):
        f.module.blocks[0](torch.randn(2, 16))


class Twice(nn.Module):
    """One block applied twice (its weights gathered, re-gathered and reduced twice)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(12, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)

    def forward(self, ids):
        return self.head(torch.tanh(self.block(torch.tanh(self.block(self.emb(ids))))))


def test_a_unit_used_twice_per_forward_trains_as_one_device():
    ref = Twice()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for ids, y in data(5):
        opt.zero_grad()
        loss_fn(ref(ids), y).backward()
        opt.step()
    _, got = train({nn.Linear}, "sgd", prefetch=True, n=4, model=Twice)
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(got[name], t, rtol=1e-6, atol=1e-6, msg=name)


class Fails(Net):
    def forward(self, ids):
        super().forward(ids)
        raise RuntimeError("boom")


def test_a_failed_forward_leaves_the_shards_as_the_parameters():
    f = wb.FullyShardedDataParallel(Fails(), wb.Mesh.grid(2, ["dp"]), units={Block})
    before = list(f.parameters())
    with pytest.raises(RuntimeError, match="boom"):
        f(wb.shard_tensor(torch.zeros(2, 3, dtype=torch.long), f.group.mesh, ["S(0)"]))
    assert all(a is b for a, b in zip(f.parameters(), before))
    assert isinstance(f.module.blocks[0].lin.weight, nn.Parameter)
    assert f.gathered.alive() == 0
