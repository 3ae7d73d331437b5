"""Megatron's f (``megatron_f``) enters a tp region from whatever layout the op table
chose on tp: Replicate, a Partial, a shard (a norm on a Partial input may reduce-scatter
it onto the batch dim when that is cheaper). It reshards to the layout it starts from,
never relabels: before the fix a Shard(0) on tp came out labelled Replicate with each
rank holding half the batch, and ``ContextParallel(cp=2, tp=2)`` past the tiny preset
failed in the q projection's view into heads."""
import pytest
import torch

import workbench as wb
from workbench.parallel.dist_tensor import shard_tensor
from workbench.parallel.placement import Partial, Replicate, Shard
from workbench.parallel.strategies.tensor_parallel import megatron_f
from workbench.recipes import ContextParallel
from workbench.train import train


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("tp_in", [Shard(0), Shard(2), Replicate(), Shard(1)])
def test_f_reshards_any_tp_layout_and_keeps_the_values(tp_in, sp):
    mesh = wb.Mesh.grid((2, 2), ["cp", "tp"])
    torch.manual_seed(0)
    x = torch.randn(4, 8, 6, requires_grad=True)
    d = shard_tensor(x, mesh, [Shard(1), tp_in])
    y = megatron_f(d, 1, sp=sp, seq_dim=1)
    assert y.placements == (Shard(1), Replicate())
    # every rank's local block is the shape its layout says, and the values are x's
    assert tuple(y._local.shape[2:]) == (4, 4, 6)
    torch.testing.assert_close(y.full(), x.detach())
    (y * y).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())


def test_f_reduces_a_partial_input():
    mesh = wb.Mesh.grid(2, ["tp"])
    parts = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    d = wb.DistTensor(parts, mesh, [Partial()], torch.Size((3, 4)), parts.dtype)
    y = megatron_f(d, 0)
    assert y.placements == (Replicate(),)
    torch.testing.assert_close(y.full(), parts.sum(0))


@pytest.mark.parametrize("preset", ["tiny", "gpt-tiny"])
def test_cp2_tp2_past_the_tiny_preset_gives_one_devices_losses(preset):
    """Past the presets' toy sizes (d_model 128, seq_len 128; 256 failed the same way)
    the op table's cost picks other layouts: the Llama's first norm reduce-scattered the
    embedding's Partial on tp onto the batch dim, which f relabelled Replicate (a crash
    in the q view); the GPT's embedding sum came sharded on cp, which the ring layout
    refused. Both now give one device's losses."""
    kw = dict(steps=2, seed=0, batch_size=2, timing=False, d_model=128, seq_len=128,
              n_layer=1, n_head=4, d_ff=256, vocab_size=256)
    got = [r["loss"] for r in train(preset, strategy=ContextParallel(cp=2, tp=2), **kw)]
    want = [r["loss"] for r in train(preset, **kw)]
    assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("sp", [False, True])
def test_cp_recipe_pins_the_residual_streams_tp_layout(sp):
    """The vocab-parallel embedding's output (Partial on tp; on cp the ids' ring layout,
    Shard(1)) is reduced once, as Hybrid._layout does: Replicate on tp (sp: the cp chunk
    sharded on tp), not left Partial for the op table to reduce before each use.  The
    sequence keeps its order (the ids came in ring order); whole on cp, it is sliced."""
    s = ContextParallel(cp=2, tp=2, sp=sp)
    mesh = s.meshes[0]
    parts = torch.randn(2, 2, 8, 4, generator=torch.Generator().manual_seed(2))  # tp, B, S, h
    local = torch.stack([torch.stack([parts[t][:, 4 * c:4 * c + 4] for t in range(2)])
                         for c in range(2)])                        # (cp, tp, B, S / 2, h)
    want_p = (Shard(1), Shard(1) if sp else Replicate())
    for x in (wb.DistTensor(local, mesh, [Shard(1), Partial()], torch.Size((2, 8, 4)),
                            parts.dtype),
              wb.DistTensor(parts.unsqueeze(0).expand(2, 2, 2, 8, 4), mesh,
                            [Replicate(), Partial()], torch.Size((2, 8, 4)), parts.dtype)):
        with wb.trace("a100") as tr:
            y = s._layout(x)
        assert y.placements == want_p
        torch.testing.assert_close(y.full(), parts.sum(0))
        comm = [e for e in tr.events if e.stream != "compute"]
        assert [e.name for e in comm] == ["reduce_scatter" if sp else "all_reduce"] * 2
        assert all(len(e.ranks) == 2 and e.ranks[1] - e.ranks[0] == 1 for e in comm)  # tp
