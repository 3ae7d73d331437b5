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
    # int8: one fp32 scale per output row (revO): 2 x (4 x 64 + 192 + 192 + 64) + 75 = 1,483
    ("tiny", 8, 111_296 * 1 + (5_120 + 1_483) * 4),
    # gpt-tiny (tied head, d_ff = 4 h = 256): linears 2 x (4 x 64 x 64 + 2 x 64 x 256)
    # = 98,304 (the tied head is the embedding: kept in dtype); embedding 75 x 64, position
    # table 64 x 64, biases 2 x (4 x 64 + 256 + 64), LayerNorms 2 x 2 x 128 + 128 = 10,688
    ("gpt-tiny", None, (98_304 + 10_688) * 4),
    # int4: one scale per row and group of 32 inputs (revO): 2 x (4 x 64 x 2 + 256 x 2
    # + 64 x 8) = 3,072
    ("gpt-tiny", 4, 98_304 // 2 + (10_688 + 3_072) * 4),
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


def _order_lost(d):
    """Every shard holds at most one element of a dim of more than one, beside another
    such dim (the case strides.py refuses), counted from the layout by hand."""
    from workbench.parallel import layout
    big = [i for i, n in enumerate(d.shape) if n > 1]
    most = [0] * d.ndim
    for r in d.mesh.ranks:
        for i, (_, n) in enumerate(layout.shard_bounds(tuple(d.shape), d.mesh, d.placements, r)):
            most[i] = max(most[i], n)
    return len(big) > 1 and any(most[i] <= 1 for i in big)


@pytest.mark.parametrize("mesh_shape,names", MESHES)
@pytest.mark.parametrize("shape", [(4, 6), (5, 7), (1, 3), (6,), (3, 4, 5)])
def test_stride_and_is_contiguous_are_the_global_tensors(mesh_shape, names, shape):
    """Was: NoRuleError.  DTensor.stride() is the spec's (the global tensor's): here the
    strides one device's tensor has, on every dim of more than one element (a size-1 dim's
    stride is arbitrary in torch too), even and uneven shards."""
    mesh = wb.Mesh.grid(mesh_shape, names)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    lost = 0
    for pl in _placements(mesh, len(shape)):
        d = wb.shard_tensor(x, mesh, pl)
        for view, f in VIEWS.items():
            got, want = f(d), f(x)
            # revO: where the shards cannot tell (_order_lost), stride() raised; sweep9:
            # the strides are kept beside the shards (strides.py), torch's here too
            lost += _order_lost(got)
            assert got.is_contiguous() == want.is_contiguous(), (pl, view)
            for k in range(-want.ndim, want.ndim):
                if want.shape[k] > 1:
                    assert got.stride(k) == want.stride(k), (pl, view, k)
                    assert got.stride()[k] == want.stride()[k], (pl, view, k)
            assert isinstance(got.stride(), tuple) and len(got.stride()) == want.ndim
    if (shape, mesh_shape) == ((3, 4, 5), (3,)):
        assert lost                     # the case revO refused is among them


def test_stride_of_a_bad_dim_is_torchs_index_error():
    d = wb.shard_tensor(torch.randn(4, 6), wb.Mesh.grid(2, ["a"]), [wb.Shard(0)])
    assert d.stride() == (6, 1) and d.stride(-2) == 6
    with pytest.raises(IndexError, match=r"stride\(2\): dimension out of range"):
        d.stride(2)
    with pytest.raises(IndexError):
        torch.randn(4, 6).stride(2)                  # torch's own: IndexError too



@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_take_is_one_devices_take(mesh_shape, names):
    """torch.take on DistTensors (was NoRuleError): the input gathered (a flat position
    mixes every dim), the index's placement passed to the output; values, gradient,
    negative and out-of-range positions as torch's."""
    mesh = wb.Mesh.grid(mesh_shape, names)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64)
    idx = torch.randint(-30, 30, (4, 3), generator=g)
    rep = [wb.Replicate()] * mesh.ndim
    for px in (rep, [wb.Shard(0)] * mesh.ndim, [wb.Shard(1)] + rep[1:]):
        for pi in (rep, [wb.Shard(0)] * mesh.ndim, [wb.Shard(1)] * mesh.ndim):
            leaf = x.clone().requires_grad_()
            out = torch.take(wb.shard_tensor(leaf, mesh, px), wb.shard_tensor(idx, mesh, pi))
            ref = torch.take(x, idx)
            assert out.shape == ref.shape and out.dtype == ref.dtype
            torch.testing.assert_close(out.full(), ref, rtol=0, atol=0)
            (out * torch.arange(12.).reshape(4, 3).double()).sum().backward()
            want = torch.zeros(30, dtype=torch.float64).index_add_(
                0, idx.reshape(-1) % 30, torch.arange(12.).double()).reshape(5, 6)
            torch.testing.assert_close(leaf.grad, want)
    d = wb.shard_tensor(x, mesh, rep)
    assert torch.equal(d.take(idx).full(), x.take(idx))         # the method, a plain index
    with pytest.raises(IndexError, match="tried to access index 30 on a tensor of 30"):
        torch.take(d, torch.tensor([30]))
    with pytest.raises(RuntimeError, match="Expected a long tensor for index"):
        torch.take(d, torch.tensor([1.0]))


@pytest.mark.parametrize("call", [lambda d: torch.quantile(d, 0.3, dim=0),
                                  lambda d: torch.searchsorted(d[:, 0], torch.tensor([0.1]))])
def test_quantile_and_searchsorted_run_sharded_without_the_fallback(call):
    """These were refused here (no rule); fixlist3 gave them rules (ops_table/quantile.py,
    searchsorted.py: the reduced or searched dim gathered whole, tests/test_fixlist3.py).
    Sharded along that dim they now run without allow_replicate_fallback and give torch's."""
    x = torch.sort(torch.randn(6, 4, generator=torch.Generator().manual_seed(2)), 0).values
    d = wb.shard_tensor(x, wb.Mesh.grid(2, ["a"]), [wb.Shard(0)])
    torch.testing.assert_close(call(d).full(), call(x))
    torch.testing.assert_close(call(d.full_tensor()), call(x))

# ---- items 1-3: DDP and a parameter skipped by some or all ranks, held to torch's DDP -----
from tests.torchrun_support import ddp_unused_rows                           # noqa: E402
from tests.test_review_revI import Net                                      # noqa: E402


@pytest.mark.parametrize("mode", ["plain", "plain_bucket_bytes", "disttensor"])
def test_simulated_parameter_unused_everywhere_raises_at_the_next_forward(mode):
    """find_unused_parameters=False, b skipped by every rank: torch's reducer never
    finishes, and its next forward raises "Expected to have finished reduction ...
    Parameter indices which did not receive grad for rank k: 2 3" (the torchrun test
    below holds torch's own).  Was: accepted silently."""
    mesh = wb.Mesh.grid(2, ["dp"])
    m = Net()
    if mode == "disttensor":
        m = wb.parallelize(m, mesh, {})
    ddp = wb.DistributedDataParallel(m, mesh, **({"bucket_bytes": 1}
                                                 if mode.endswith("bytes") else {}))
    x = wb.shard_tensor(torch.randn(6, 4, dtype=torch.float64), mesh, [wb.Shard(0)])
    ddp(x, skip_b=True).mean().backward()
    ddp.finish_gradient_synchronization()
    with torch.no_grad():
        ddp(x, skip_b=True)                              # no grad: no reducer, as torch
    with pytest.raises(RuntimeError, match=r"Expected to have finished reduction in the "
                       r"prior iteration(.|\n)*find_unused_parameters=True(.|\n)*did not "
                       r"receive grad for any rank: 2 3 \('b.weight', 'b.bias'\)"):
        ddp(x, skip_b=True)
    ok = wb.DistributedDataParallel(Net(), mesh, find_unused_parameters=True)
    for _ in range(2):                                   # torch's argument: trains
        ok(x, skip_b=True).mean().backward()
    assert ok.module.b.weight.grad is None


@pytest.fixture(scope="module")
def gloo_rows(tmp_path_factory):
    """tests/dist_scripts/fixlist2_check.py's rows (its cases A to F), from the session's
    one launch shared with test_review_revI (torchrun_support.ddp_unused_rows)."""
    return ddp_unused_rows(tmp_path_factory)


UNFINISHED = "RuntimeError: DistributedDataParallel: Expected to have finished reduction"


@pytest.mark.slow
def test_torchrun_unused_everywhere_raises_as_torchs(gloo_rows):
    for rank in (0, 1):
        r = gloo_rows[("A_unused_everywhere", rank)]
        assert r["torch"].startswith("RuntimeError: Expected to have finished reduction")
        for who in ("wb", "wbdt"):
            assert r[who].startswith(UNFINISHED), r[who]
            assert f"did not receive grad for rank {rank}: 2 3 ('b.weight', 'b.bias')" in r[who]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["B_used_rank0", "C_zero_used_rank0", "D_stale_then_rank0"])
def test_torchrun_find_unused_gradients_are_torch_ddps(gloo_rows, case):
    """find_unused_parameters=True, b used on rank 0 only (B; C: with an exactly zero
    gradient; D: after a step that used it, a stale .grad on rank 1): torch gives both ranks
    b's average.  Was, DistTensor mode: B raised, C left rank 1's grad None (rank 0 stepped
    b, rank 1 did not); by value, not by hook."""
    for rank in (0, 1):
        r = gloo_rows[(case, rank)]
        assert isinstance(r["torch"], dict), r["torch"]
        for who in ("wb", "wbdt"):
            assert isinstance(r[who], dict), (who, r[who])
            assert r[who].keys() == r["torch"].keys()
            for k, want in r["torch"].items():
                got = r[who][k]
                assert (got is None) == (want is None), (who, k)
                assert max(abs(a - b) for a, b in zip(got, want)) < 1e-12, (case, who, k)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["E_zero_used_rank0_strict", "F_stale_strict"])
def test_torchrun_strict_rank_that_skipped_raises_whatever_its_grad_holds(gloo_rows, case):
    """find_unused_parameters=False, b skipped on rank 1 only, where torch's reducer waits
    forever: rank 1 raises, although b's average is exactly zero (E) or its .grad holds an
    earlier step's (F).  Was: E passed silently with b's grad None on rank 1 and zeros on
    rank 0 (the replicas drift at a weight-decay step); F (DistTensor mode) sent the stale
    gradient as a new one and overwrote it with the sum.  At the next forward with torch's
    text; or at once, in the DistTensor mode, where the sum shows rank 0's gradient (F)."""
    r = gloo_rows[(case, 1)]
    for who in ("wb", "wbdt"):
        if case == "F_stale_strict" and who == "wbdt":
            assert r[who].startswith("RuntimeError: DistributedDataParallel: ['b.weight', "
                                     "'b.bias'] received no gradient on this rank but one "
                                     "on another"), r[who]
            assert "find_unused_parameters=True" in r[who]
            continue
        assert r[who].startswith(UNFINISHED), (who, r[who])
        assert "for rank 1: 2 3 ('b.weight', 'b.bias')" in r[who]
