"""The shard layout and buffers ZeRO-1/2/3, FSDP and DDP share (strategies/flat_shards.py)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from workbench.parallel.strategies.flat_shards import (flat_padded, pack, pack_rank_major,
                                                       tensor_places, unflat, unpack)

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, n=st.integers(1, 5), lead=st.sampled_from([(), (2,), (3, 1)]))
def test_flat_padded_splits_in_n_and_unflat_gives_the_tensor_back(shape, n, lead):
    t = torch.randn(lead + shape)
    flat = flat_padded(t, n, len(lead))
    assert flat.shape[:len(lead)] == lead and flat.shape[-1] % n == 0
    assert flat.shape[-1] - t[(0,) * len(lead)].numel() < n          # the least padding
    assert not flat[..., t[(0,) * len(lead)].numel():].any()          # zeros
    assert torch.equal(unflat(flat, shape, len(lead)), t)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(shapes, min_size=1, max_size=4), lead=st.sampled_from([(), (2,)]))
def test_pack_and_unpack_round_trip(sizes, lead):
    ts = [torch.randn(lead + s) for s in sizes]
    buf = pack(ts, len(lead))
    assert buf.shape == lead + (sum(t[(0,) * len(lead)].numel() for t in ts),)
    for t, u in zip(ts, unpack(buf, sizes, len(lead))):
        assert torch.equal(t, u)


def test_pack_rank_major_puts_chunk_k_of_every_tensor_together():
    n = 3
    a, b = torch.arange(6.), torch.arange(100., 109.)      # chunks of 2 and of 3
    buf = pack_rank_major([a, b], n).view(n, -1)            # row k: what rank k receives
    for k in range(n):
        assert torch.equal(buf[k], torch.cat([a.view(n, -1)[k], b.view(n, -1)[k]]))


def test_tensor_places_names_a_tied_weight_once_with_every_place():
    m = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
    m[1].weight = m[0].weight
    got = tensor_places(m)
    assert [(n, [a for _, a in places]) for n, _, places in got] == [("0.weight",
                                                                        ["weight", "weight"])]
    assert [mod for mod, _ in got[0][2]] == [m[0], m[1]]
    assert [n for n, _, _ in got] == [n for n, _ in m.named_parameters()]
