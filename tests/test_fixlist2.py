"""fixlist2: defects left by earlier sessions, each held to plain PyTorch (or to a hand
count), one section per item."""
import pytest
import torch

from workbench.models.config import param_count
from workbench.serve.batching import StepPricer
from workbench.sim_mesh.profiles import get_profile


# ---- item 4: the KV cache's room counts every weight the server holds ----------------------
@pytest.mark.parametrize("name,bits,want", [
    # tiny (Llama, untied, fp32): linears 2 x (4 x 64 x 64 + 3 x 64 x 192) + head 75 x 64
    # = 111,296; embedding 75 x 64 + norms 2 x 2 x 64 + 64 = 5,120
    ("tiny", None, (111_296 + 5_120) * 4),
    ("tiny", 8, 111_296 * 1 + 5_120 * 4),
    # gpt-tiny (tied head, d_ff = 4 h = 256): linears 2 x (4 x 64 x 64 + 2 x 64 x 256)
    # = 98,304 (the tied head is the embedding: kept in dtype); embedding 75 x 64, position
    # table 64 x 64, biases 2 x (4 x 64 + 256 + 64), LayerNorms 2 x 2 x 128 + 128 = 10,688
    ("gpt-tiny", None, (98_304 + 10_688) * 4),
    ("gpt-tiny", 4, 98_304 // 2 + 10_688 * 4),
])
def test_kv_capacity_leaves_room_for_every_weight_held(name, bits, want):
    """Was: memory - the linears' bytes only (the embedding, and norms, biases, the
    position table left out): the room for the cache overstated."""
    p = StepPricer(name, "a100", weight_bits=bits)
    assert p.resident_bytes == want
    mem = get_profile("a100").memory_bytes
    assert p.kv_capacity() == int((mem * 0.9 - want) // p.kv_bytes_per_token)
    if bits is None:                     # every parameter of the module, each once
        assert p.resident_bytes == param_count(name).module * 4


# ---- item 5: d.stride() and d.is_contiguous() are the global tensor's, as DTensor's -------
import workbench as wb                                                      # noqa: E402

MESHES = [((1,), ["a"]), ((2,), ["a"]), ((3,), ["a"]), ((2, 2), ["a", "b"])]
VIEWS = {"itself": lambda t: t, "transpose": lambda t: t.transpose(0, -1),
         "permute+contiguous": lambda t: t.permute(*reversed(range(t.ndim))).contiguous(),
         "reshape": lambda t: t.reshape(-1)}


def _placements(mesh, ndim):
    out = [[wb.Replicate()] * mesh.ndim] + [[wb.Shard(i)] * mesh.ndim for i in range(ndim)]
    if mesh.ndim == 2:
        out.append([wb.Shard(0), wb.Shard(ndim - 1)])
    return out


@pytest.mark.parametrize("mesh_shape,names", MESHES)
@pytest.mark.parametrize("shape", [(4, 6), (5, 7), (1, 3), (6,), (3, 4, 5)])
def test_stride_and_is_contiguous_are_the_global_tensors(mesh_shape, names, shape):
    """Was: NoRuleError.  DTensor.stride() is the spec's (the global tensor's): here the
    strides one device's tensor has, on every dim of more than one element (a size-1 dim's
    stride is arbitrary in torch too), even and uneven shards."""
    mesh = wb.Mesh.grid(mesh_shape, names)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for pl in _placements(mesh, len(shape)):
        d = wb.shard_tensor(x, mesh, pl)
        for view, f in VIEWS.items():
            got, want = f(d), f(x)
            assert got.is_contiguous() == want.is_contiguous(), (pl, view)
            for k in range(-want.ndim, want.ndim):
                if want.shape[k] > 1:
                    assert got.stride(k) == want.stride(k), (pl, view, k)
                    assert got.stride()[k] == want.stride()[k], (pl, view, k)
            assert isinstance(got.stride(), tuple) and len(got.stride()) == want.ndim


def test_stride_of_a_bad_dim_is_torchs_index_error():
    d = wb.shard_tensor(torch.randn(4, 6), wb.Mesh.grid(2, ["a"]), [wb.Shard(0)])
    assert d.stride() == (6, 1) and d.stride(-2) == 6
    with pytest.raises(IndexError, match=r"stride\(2\): dimension out of range"):
        d.stride(2)
    with pytest.raises(IndexError):
        torch.randn(4, 6).stride(2)                  # torch's own: IndexError too
