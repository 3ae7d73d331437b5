"""Shape ops (ops_table/shape.py, reshape.py) and attention-family ops
(ops_table/attention.py, fused.py).

Forward: every input placement combination on meshes of 2, 4 and 2x2 ranks (uneven
sizes included, Partial from unequal parts) against one device (tests/spmd_harness.py);
the large attention cases sample the 2x2 mesh deterministically.
Plans: reshape keeps a sharding with no communication exactly where the ranks'
blocks line up (checked against brute-force index arithmetic), and reshards where
they do not; the other ops' must-be-whole dims are resharded.
Backward: gradients of DistTensor leaves equal single-device gradients.
"""
import itertools
import zlib

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.spmd_harness import MESHES, check_op
from workbench.parallel import DistTensor, layout
from workbench.parallel.dispatch import dispatch
from workbench.parallel.ops_table import TABLE
from workbench.parallel.ops_table.reshape import reshape_keeps, view_groups
from workbench.parallel.ops_table.shape import normalize_index

T = torch.Tensor
S, R, P = wb.Shard, wb.Replicate(), wb.Partial()
M2, M4, M22 = MESHES




def getitem(x, idx):
    """x[idx]; straight to the dispatcher until DistTensor has a __getitem__ dunder."""
    if isinstance(x, DistTensor) and not hasattr(type(x), "__getitem__"):
        return dispatch(T.__getitem__, (x, idx), None)
    return x[idx]


flash = wb.ops.flash_attention


def sample(n2=1, n4=1, n22=1):
    """Keep a deterministic 1/n of the placement combinations on each mesh (2, 4, 2x2)."""
    keep = {(2,): n2, (4,): n4, (2, 2): n22}
    return lambda mesh, combo: zlib.crc32(str((mesh.shape, combo)).encode()) % keep[mesh.shape] != 0


VARIANT = sample(4, 8, 1000)           # ~130 combinations per attention variant


torch.manual_seed(0)
X = torch.randn(4, 6, 5)               # 6 uneven on 4 ranks, 5 uneven on 2 and 4
Q, K, V = (torch.randn(2, 4, 5, 6) for _ in range(3))
KG, VG = torch.randn(2, 2, 5, 6), torch.randn(2, 2, 5, 6)
MASK = torch.rand(5, 5) > 0.4
MASK.fill_diagonal_(True)
COS, SIN = wb.ops.rope_cos_sin(5, 4)
COSI, SINI = wb.ops.rope_cos_sin(5, 4, mode="interleave")


def sdpa(**kw):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)


SHAPE_CASES = {
    "reshape_merge": (lambda x: x.reshape(24, 5), [X]),
    "reshape_merge_uneven": (lambda x: torch.reshape(x, (-1,)), [torch.randn(5, 6)]),
    "view_split": (lambda x: x.view(4, 3, 2, 5), [X]),
    "view_split_heads": (lambda x: x.view(2, 5, 4, 2), [torch.randn(2, 5, 8)]),
    "reshape_many_to_many": (lambda x: x.reshape(4, 6), [torch.randn(6, 4)]),
    "flatten": (lambda x: torch.flatten(x, 1), [X]),
    "unflatten": (lambda x: x.unflatten(1, (2, 3)), [X]),
    "unsqueeze": (lambda x: x.unsqueeze(1), [X]),
    "squeeze": (lambda x: torch.squeeze(x), [torch.randn(4, 1, 5)]),
    "squeeze_dim": (lambda x: x.squeeze(1), [torch.randn(4, 1, 5)]),
    "view_as": (lambda x: x.view_as(torch.empty(6, 4, 5)), [X]),
    "permute": (lambda x: x.permute(2, 0, 1), [X]),
    "transpose": (lambda x: x.transpose(0, 2), [X]),
    "swapaxes": (lambda x: torch.swapaxes(x, -1, 1), [X]),
    "t": (lambda x: x.t(), [torch.randn(5, 6)]),
    "movedim": (lambda x: torch.movedim(x, 0, -1), [X]),
    "contiguous": (lambda x: x.transpose(0, 1).contiguous(), [X]),
    "cat": (lambda a, b: torch.cat([a, b], 1), [X, torch.randn(4, 3, 5)], sample(1, 1, 6)),
    "cat_dim0": (lambda a, b: torch.cat((a, b)), [torch.randn(3, 5), torch.randn(2, 5)],
                 sample(1, 1, 4)),
    "stack": (lambda a, b: torch.stack([a, b], 1), [torch.randn(5, 6), torch.randn(5, 6)],
              sample(1, 1, 4)),
    "split_sizes": (lambda x: x.split([2, 4], 1), [X]),
    "split_int": (lambda x: torch.split(x, 2, -1), [X]),
    "chunk": (lambda x: torch.chunk(x, 3, 1), [X]),
    "unbind": (lambda x: x.unbind(0), [X]),
    "getitem_mixed": (lambda x: getitem(x, (slice(None), 1, None, slice(1, 4))), [X]),
    "getitem_ellipsis": (lambda x: getitem(x, (..., 2)), [X]),
    "getitem_int": (lambda x: getitem(x, -1), [X]),
    "getitem_step": (lambda x: getitem(x, (slice(None), slice(None, None, 2))), [X]),
    "getitem_none": (lambda x: getitem(x, (None, ..., slice(0, 5))), [X]),
}

ATTENTION_CASES = {     # name: (fn, inputs, skip or check_op keywords)
    "sdpa": (sdpa(), [Q, K, V], sample(1, 1, 200)),      # all on 2 and 4 ranks
    "sdpa_causal": (sdpa(is_causal=True), [Q, K, V], VARIANT),
    "sdpa_causal_short_keys": (sdpa(is_causal=True), [Q, torch.randn(2, 4, 3, 6),
                                                     torch.randn(2, 4, 3, 6)], VARIANT),
    "sdpa_value_dim": (sdpa(), [Q, K, torch.randn(2, 4, 5, 3)], VARIANT),
    "sdpa_gqa": (sdpa(enable_gqa=True, is_causal=True), [Q, KG, VG], VARIANT),
    "sdpa_mqa": (sdpa(enable_gqa=True), [Q, KG[:, :1], VG[:, :1]], VARIANT),
    "sdpa_bool_mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=MASK),
                       [Q, K, V], VARIANT),
    "sdpa_float_mask": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                        [Q, K, V, torch.randn(2, 1, 5, 5)],
                        dict(meshes=(M2, M4), skip=sample(10, 20))),   # 4 inputs: 6^8 on 2x2
    "flash": (lambda q, k, v: flash(q, k, v), [Q, K, V], VARIANT),
    "flash_causal_gqa": (lambda q, k, v: flash(q, k, v, causal=True), [Q, KG, VG], VARIANT),
    "flash_window": (lambda q, k, v: flash(q, k, v, mask=wb.ops.SlidingWindow(2)), [Q, K, V],
                     VARIANT),
    "flash_block_diagonal": (lambda q, k, v: flash(q, k, v, mask=wb.ops.BlockDiagonal((2, 3))),
                             [Q, K, V], VARIANT),
    "flash_mask_causal": (lambda q, k, v: flash(q, k, v, mask=MASK, causal=True), [Q, K, V],
                          VARIANT),
    "swiglu": (lambda x: wb.ops.swiglu(x), [torch.randn(5, 3, 6)], None),
    "swiglu_dim0": (lambda x: wb.ops.swiglu(x, dim=0), [torch.randn(6, 5)], None),
    "rotary_half": (lambda x, c, s: wb.ops.rotary_embedding(x, c, s),
                    [torch.randn(2, 2, 5, 4), COS, SIN], VARIANT),
    "rotary_interleave": (lambda x, c, s: wb.ops.rotary_embedding(x, c, s, mode="interleave"),
                          [torch.randn(3, 5, 4), COSI, SINI], VARIANT),
    "rotary_broadcast_4d": (lambda x, c, s: wb.ops.rotary_embedding(x, c, s),
                            [torch.randn(2, 2, 5, 4), COS[None, None], SIN[None, None]],
                            VARIANT),
}


@pytest.mark.parametrize("name", sorted(SHAPE_CASES))
def test_shape_exhaustive(name):
    fn, inputs, *skip = SHAPE_CASES[name]
    assert check_op(fn, inputs, skip=skip[0] if skip else lambda mesh, combo: False) > 0


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_attention_exhaustive(name):
    fn, inputs, kw = ATTENTION_CASES[name]
    kw = kw if isinstance(kw, dict) else {"skip": kw or (lambda mesh, combo: False)}
    assert check_op(fn, inputs, **kw) > 0


# ---- reshape: the validity condition --------------------------------------------------------

def test_view_groups():
    assert view_groups((2, 3, 4), (6, 4)) == [((0, 1), (0,)), ((2,), (1,))]
    assert view_groups((2, 5, 8), (2, 5, 4, 2)) == [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3))]
    assert view_groups((6, 4), (4, 6)) == [((0, 1), (0, 1))]
    assert view_groups((5, 6), (5, 1, 6)) == [((0,), (0,)), ((1,), (2,))]
    assert view_groups((0, 3), (3, 0)) == []


def _brute_keeps(in_shape, out_shape, mesh, in_ps, out_ps):
    """Every rank's input block, flattened, is its output block: by explicit indices."""
    n = 1
    for s in in_shape:
        n *= s
    a_in, a_out = torch.arange(n).reshape(in_shape), torch.arange(n).reshape(out_shape)
    for r in mesh.ranks:
        si = layout.shard_bounds(in_shape, mesh, in_ps, r)
        so = layout.shard_bounds(out_shape, mesh, out_ps, r)
        blk_in = a_in[tuple(slice(s, s + k) for s, k in si)].reshape(-1)
        blk_out = a_out[tuple(slice(s, s + k) for s, k in so)].reshape(-1)
        if not torch.equal(blk_in, blk_out):
            return False
    return True


@pytest.mark.parametrize("in_shape,out_shape", [
    ((4, 6, 5), (24, 5)), ((5, 6), (30,)), ((7, 2), (14,)), ((6, 5), (3, 2, 5)),
    ((12, 3), (3, 4, 3)), ((6, 4), (4, 6)), ((2, 8), (2, 4, 2)), ((3, 4), (12,)),
    ((8, 3), (2, 4, 3))])
def test_reshape_condition_matches_brute_force(in_shape, out_shape):
    """reshape_keeps is exactly 'the reshaped local block is the output block'."""
    meshes = [wb.Mesh.grid(n, ["a"]) for n in (2, 3, 4)] + [M22, wb.Mesh.grid((2, 3), ["a", "b"])]
    for mesh in meshes:
        for gi, go in view_groups(in_shape, out_shape):
            for combo in itertools.product([None, (gi[0], go[0])], repeat=mesh.ndim):
                if all(c is None for c in combo):
                    continue
                ips = [R if c is None else S(c[0]) for c in combo]
                ops = [R if c is None else S(c[1]) for c in combo]
                want = _brute_keeps(in_shape, out_shape, mesh, ips, ops)
                assert reshape_keeps(in_shape, out_shape, mesh, ips, ops) == want, \
                    (in_shape, out_shape, mesh.shape, ips)


def _infer(op, *specs, **attrs):
    return wb.spmd.infer(op, *specs, **attrs)


@pytest.mark.parametrize("mesh,in_shape,ps,out_shape,out_ps", [
    (M4, (4, 6, 8), [S(0)], (24, 8), [S(0)]),                  # (B, S, H) -> (B*S, H)
    (M4, (2, 8, 12), [S(2)], (2, 8, 4, 3), [S(2)]),            # H -> (nh, hd), 4 | nh
    (M4, (2, 8, 12), [S(1)], (2, 8, 4, 3), [S(1)]),            # an untouched dim
    (M4, (7, 2), [S(0)], (14,), [S(0)]),                       # uneven yet aligned: 2,2,2,1
    (M22, (8, 6), [S(0), S(0)], (48,), [S(0), S(0)]),          # nested shards
    (M22, (4, 6, 8), [S(0), S(2)], (24, 2, 4), [S(0), S(1)]),  # two groups at once
    (M4, (4, 1, 6), [S(2)], (4, 6), [S(1)]),                   # squeeze
])
def test_reshape_keeps_sharding_without_communication(mesh, in_shape, ps, out_shape, out_ps):
    d = _infer("reshape", wb.TensorSpec(in_shape, mesh, ps), shape=out_shape)
    assert d.inputs == (tuple(ps),) and d.outputs == (tuple(out_ps),)
    assert d.chosen.bytes == 0 and d.chosen.collectives == []


@pytest.mark.parametrize("mesh,in_shape,ps,out_shape", [
    (M4, (4, 6, 8), [S(1)], (24, 8)),          # S is the non-leading dim of {B, S}
    (M4, (5, 6), [S(0)], (30,)),               # rows 2,2,1,0 -> runs of 12,12,6,0; chunk(30): 8s
    (M4, (2, 8, 12), [S(2)], (2, 8, 3, 4)),    # nh = 3 not divisible by 4
    (M2, (2, 8, 12), [S(2)], (2, 8, 3, 4)),    # ceil(12/2)=6 != 4*ceil(3/2)=8
    (M22, (8, 6), [S(1), S(0)], (48,)),
])
def test_reshape_must_reshard(mesh, in_shape, ps, out_shape):
    spec = wb.TensorSpec(in_shape, mesh, ps)
    d = _infer("view", spec, shape=out_shape)
    assert d.inputs != (tuple(ps),) and d.chosen.bytes > 0
    x = torch.randn(in_shape)
    y = wb.shard_tensor(x, mesh, ps).view(out_shape)
    torch.testing.assert_close(y.full(), x.view(out_shape))


def test_reshape_runtime_communication_counted():
    """(B, S, H) -> (B*S, H): S(0) moves nothing; S(1) is moved by one all-to-all."""
    x = torch.randn(4, 8, 6)
    for ps, want in (([S(0)], {}), ([S(1)], {"all_to_all": 1})):
        t = wb.shard_tensor(x, M4, ps)
        with wb.trace() as tr:
            y = t.reshape(32, 6)
        assert dict(tr.counts()) == want and y.placements == (S(0),)
        torch.testing.assert_close(y.full(), x.reshape(32, 6))
    q = wb.shard_tensor(torch.randn(2, 8, 4, 6), M4, [S(1)])     # (B, nh, S, hd) heads split
    with wb.trace() as tr:
        y = q.transpose(1, 2).reshape(2, 4, 48)                  # -> (B, S, nh*hd)
    assert dict(tr.counts()) == {} and y.placements == (S(2),)


# ---- other ops: whole where needed, free where not ------------------------------------------

def _spec(shape, mesh, ps):
    return wb.TensorSpec(shape, mesh, ps)


def test_plans_shape_ops():
    x = _spec((4, 6, 5), M2, [S(0)])
    assert _infer("permute", x, dims=(2, 0, 1)).outputs == ((S(1),),)
    assert _infer("transpose", x, dims=(1, 0, 2)).outputs == ((S(1),),)
    idx = normalize_index((4, 6, 5), (slice(None), 2))
    d = _infer("getitem", x, index=idx)
    assert d.outputs == ((S(0),),) and d.chosen.bytes == 0
    d = _infer("getitem", x, index=normalize_index((4, 6, 5), (slice(1, 3),)))
    assert d.inputs[0] != (S(0),) and d.chosen.bytes > 0        # sliced sharded dim: whole
    d = _infer("getitem", x, index=normalize_index((4, 6, 5), (1,)))
    assert d.inputs[0] != (S(0),)                               # int on a sharded dim
    y = _spec((4, 3, 5), M2, [S(0)])
    assert _infer("cat", x, y, dim=1).chosen.bytes == 0
    d = _infer("cat", x, _spec((2, 6, 5), M2, [S(0)]), dim=0)
    assert all(p != (S(0),) for p in d.inputs) and d.chosen.bytes > 0
    d = _infer("split", x, sizes=(2, 4), dim=1)
    assert d.outputs == ((S(0),), (S(0),)) and d.chosen.bytes == 0
    d = _infer("chunk", _spec((4, 6, 5), M2, [S(1)]), sizes=(3, 3), dim=1)
    assert d.inputs[0] != (S(1),) and d.chosen.bytes > 0
    d = _infer("unbind", _spec((4, 6, 5), M2, [S(2)]), dim=0)
    assert d.outputs == ((S(1),),) * 4
    d = _infer("reshape", _spec((4, 6), M2, [P]), shape=(24,))
    assert d.outputs == ((P,),) and d.chosen.bytes == 0         # linear: Partial passes


def test_normalize_index_errors():
    assert normalize_index((4, 6), (..., None)) == (("all",), ("all",), ("new",))
    assert normalize_index((4, 6), (slice(0, 9), -1)) == (("all",), ("int", 5))
    with pytest.raises(NotImplementedError, match="advanced indexing"):
        normalize_index((4, 6), (torch.tensor([0, 1]),))
    with pytest.raises(IndexError, match="out of bounds"):
        normalize_index((4, 6), (4,))
    with pytest.raises(IndexError, match="too many"):
        normalize_index((4, 6), (0, 0, 0))
    x = wb.shard_tensor(torch.randn(4, 6), M2, [S(0)])
    with pytest.raises(TypeError, match="view\\(dtype"):
        x.view(torch.int32)


def test_split_returns_a_tuple():
    x = wb.shard_tensor(torch.randn(4, 6), M2, [S(0)])
    assert isinstance(x.split(6, 1), tuple) and len(x.split(6, 1)) == 1


# ---- attention plans -----------------------------------------------------------------------

def _attn(q, k, v, mask=None, **attrs):
    return _infer("scaled_dot_product_attention", q, k, v, mask, **attrs)


def test_plans_attention():
    for ps in ([S(0)], [S(1)]):                         # batch, heads: no communication
        q = _spec((2, 8, 16, 4), M4 if ps == [S(1)] else M2, ps)
        d = _attn(q, q, q)
        assert d.outputs == ((ps[0],),) and d.chosen.bytes == 0
    q = _spec((2, 8, 16, 4), M4, [S(2)])                # sequence: q stays, K/V gathered
    d = _attn(q, q, q, causal=True)
    assert d.inputs[0] == (S(2),) and d.outputs == ((S(2),),)
    assert d.inputs[1] == d.inputs[2] == (R,)
    q = _spec((2, 8, 16, 4), M4, [S(3)])                # q/k head_dim: whole
    d = _attn(q, q, _spec((2, 8, 16, 4), M4, [R]))
    assert d.inputs[0] != (S(3),) and d.inputs[1] != (S(3),)
    v = _spec((2, 8, 16, 4), M4, [S(3)])                # v columns: free
    r = _spec((2, 8, 16, 4), M4, [R])
    assert _attn(r, r, v).outputs == ((S(3),),) and _attn(r, r, v).chosen.bytes == 0
    vp = _spec((2, 8, 16, 4), M4, [P])                  # Partial v stays Partial (linear) ...
    assert _attn(r, r, vp).outputs == ((P,),)
    assert _attn(r, r, vp, dropout_p=0.1).outputs != ((P,),)   # ... but not under dropout
    assert _attn(r, r, v, dropout_p=0.1).outputs != ((S(3),),)  # one dropout mask per row


def test_attention_dropout_runs_sharded():
    q = wb.shard_tensor(Q, M22, [S(0), S(1)])
    out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert out.placements == (S(0), S(1)) and out.full().shape == Q.shape
    # 3-d (batch, seq, head_dim) q, k, v: one head, as torch (sweep12: this held a refusal)
    x3 = torch.randn(2, 5, 6)
    got = F.scaled_dot_product_attention(*(wb.shard_tensor(x3, M2, [S(0)]) for _ in range(3)))
    torch.testing.assert_close(got.full(), F.scaled_dot_product_attention(x3, x3, x3))
    with pytest.raises(ValueError, match="expected 4-d"):
        F.scaled_dot_product_attention(*(wb.shard_tensor(torch.randn(5, 6), M2, [S(0)])
                                         for _ in range(3)))


def test_plans_gqa_heads():
    q = _spec((2, 8, 16, 4), M22, [S(1), S(1)])
    k2 = _spec((2, 2, 16, 4), M22, [S(1), S(1)])        # 2 K/V heads on 4 ranks: cannot pair
    d = _attn(q, k2, k2)
    assert d.inputs[0] != (S(1), S(1)) and d.chosen.bytes > 0
    k4 = _spec((2, 4, 16, 4), M22, [S(1), S(1)])        # 4 K/V heads: one per rank
    assert _attn(q, k4, k4).chosen.bytes == 0
    k1 = _spec((2, 1, 16, 4), M22, [R, R])              # MQA: K/V whole, q heads split
    assert _attn(q, k1, k1).chosen.bytes == 0


def test_plans_swiglu_rotary():
    d = _infer("swiglu", _spec((4, 8), M2, [S(1)]), dim=1)
    assert d.inputs[0] != (S(1),) and d.chosen.bytes > 0
    assert _infer("swiglu", _spec((4, 8), M2, [S(0)]), dim=1).chosen.bytes == 0
    x = _spec((2, 2, 8, 4), M2, [S(2)])
    cs = _spec((8, 4), M2, [S(0)])
    d = _infer("rotary_embedding", x, cs, cs, mode="half")
    assert d.outputs == ((S(2),),) and d.chosen.bytes == 0
    d = _infer("rotary_embedding", _spec((2, 2, 8, 4), M2, [S(3)]), cs, cs, mode="half")
    assert d.inputs[0] != (S(3),)


def test_flash_attention_public_call():
    """wb.ops.flash_attention(DistTensor, ...) must reach the SPMD layer."""
    q = wb.shard_tensor(Q, M2, [S(0)])
    out = wb.ops.flash_attention(q, q, q, causal=True)
    assert isinstance(out, DistTensor) and out.placements == (S(0),)
    torch.testing.assert_close(out.full(), wb.ops.flash_attention(Q, Q, Q, causal=True))


def test_flash_tile_stats_refused():
    q = wb.shard_tensor(Q, M2, [S(0)])
    with pytest.raises(ValueError, match="tile_stats"):
        flash(q, q, q, tile_stats=object())


# ---- backward ---------------------------------------------------------------------------------

def check_grad(fn, inputs, mesh, placements):
    """Gradients of DistTensor leaves laid out by ``placements`` equal one device's."""
    g = torch.Generator().manual_seed(1)
    ref_in = [x.clone().requires_grad_() for x in inputs]
    ref = fn(*ref_in)
    w = torch.randn(ref.shape, generator=g)
    (ref * w).sum().backward()
    dist = [wb.shard_tensor(x, mesh, ps).requires_grad_() for x, ps in zip(inputs, placements)]
    out = fn(*dist)
    torch.testing.assert_close(out.full(), ref.detach(), rtol=1e-4, atol=1e-5)
    (out * w).sum().backward()
    for d, r, ps in zip(dist, ref_in, placements):
        assert d.grad is not None, f"no gradient for the input laid out {ps}"
        torch.testing.assert_close(d.grad.full(), r.grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{[str(p) for p in ps]}: {m}")


def _split_sum(x):
    a, b = x.split([2, 4], 1)
    return torch.cat([b, a * 2.0], 1)


GRAD_CASES = [
    ("reshape_keep", lambda x: x.reshape(24, 5), [X], M4, [[S(0)]]),
    ("reshape_reshard", lambda x: x.reshape(24, 5), [X], M22, [[S(1), S(2)]]),
    ("view_heads", lambda x: x.view(2, 5, 4, 2), [torch.randn(2, 5, 8)], M22, [[S(2), S(1)]]),
    ("permute", lambda x: x.permute(2, 0, 1), [X], M22, [[S(0), S(2)]]),
    ("getitem", lambda x: getitem(x, (slice(None), 1, slice(1, 4))), [X], M4, [[S(2)]]),
    ("cat", lambda a, b: torch.cat([a, b], 1), [X, torch.randn(4, 3, 5)], M22,
     [[S(0), R], [R, S(2)]]),
    ("split", _split_sum, [X], M22, [[S(2), S(0)]]),
    ("sdpa_heads_seq", sdpa(is_causal=True), [Q, K, V], M22, [[S(1), S(2)], [S(1), R], [S(1), R]]),
    ("sdpa_seq_uneven", sdpa(is_causal=True), [Q, K, V], M4, [[S(2)], [S(2)], [R]]),
    ("sdpa_gqa_batch", sdpa(enable_gqa=True), [Q, KG, VG], M22,
     [[S(0), S(1)], [S(0), S(1)], [S(0), R]]),
    ("flash_window_seq", lambda q, k, v: flash(q, k, v, mask=wb.ops.SlidingWindow(2)),
     [Q, K, V], M2, [[S(2)], [R], [R]]),
    ("swiglu", lambda x: wb.ops.swiglu(x), [torch.randn(5, 3, 6)], M22, [[S(0), S(1)]]),
    ("rotary", lambda x, c, s: wb.ops.rotary_embedding(x, c, s),
     [torch.randn(2, 2, 5, 4), COS, SIN], M22, [[S(1), S(2)], [R, S(0)], [R, S(0)]]),
]


@pytest.mark.parametrize("name,fn,inputs,mesh,placements", GRAD_CASES,
                         ids=[c[0] for c in GRAD_CASES])
def test_backward_matches_single_device(name, fn, inputs, mesh, placements):
    check_grad(fn, inputs, mesh, placements)


def test_split_family_returns_any_number_of_pieces():
    """split/chunk/unbind are registered ``multi=True``: a tuple of as many pieces as torch."""
    x = wb.shard_tensor(X, M2, [S(0)])
    pieces = x.chunk(3, 1)
    assert isinstance(pieces, tuple) and len(pieces) == len(X.chunk(3, 1)) == 3
    assert all(TABLE[n].multi for n in ("split", "chunk", "unbind"))
