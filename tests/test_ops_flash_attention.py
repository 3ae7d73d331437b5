"""flash_attention: every backend against the FlashAttention-2 reference, its memory,
its tile skipping, dropout, and its errors."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import workbench.ops as ops
from workbench.ops.flash_reference import dense_dropout_keep
from workbench.ops.masks import build_mask
from workbench.ops.testing import assert_close

FAST = settings(max_examples=30, deadline=None)


def run(backend, *args, **kwargs):
    with ops.use(backend):
        return ops.flash_attention(*args, **kwargs)


def naive(q, k, v, keep=None, scale=None, drop_keep=None, keep_prob=1.0):
    """Attention by the definition, in float64: softmax(q k^T * scale) v."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if drop_keep is not None:
        p = p * drop_keep / keep_prob
    return p @ v


def make(B, Hq, Hkv, Sq, Sk, D, Dv, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, Sk, D, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, Sk, Dv, generator=gen).to(dtype).requires_grad_()
    dout = torch.randn(B, Hq, Sq, Dv, generator=gen).to(dtype)
    return q, k, v, dout


def forward_backward(backend, q, k, v, dout, **kw):
    out = run(backend, q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return (out, *grads)


def mask_for(kind, B, Hq, Sq, Sk, seed):
    if kind == "causal":
        return dict(causal=True)
    if kind == "dense":    # random per (batch, head), some rows fully masked
        keep = torch.rand(B, Hq, Sq, Sk, generator=torch.Generator().manual_seed(seed)) > 0.4
        keep[..., 0, :] = False
        return dict(mask=keep)
    if kind == "window":
        return dict(mask=ops.SlidingWindow(3), causal=True)
    if kind == "blocks":
        return dict(mask=ops.BlockDiagonal((Sq // 2, Sq - Sq // 2)) if Sq > 1 else None)
    return {}


@FAST
@given(B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.integers(1, 3),
       Sq=st.integers(1, 40), Sk=st.integers(1, 40), D=st.sampled_from([4, 8, 16]),
       Dv=st.sampled_from([4, 8]), tile_q=st.integers(1, 17), tile_k=st.integers(1, 17),
       kind=st.sampled_from(["none", "causal", "dense", "window", "blocks"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_every_backend_matches_the_reference(B, Hkv, G, Sq, Sk, D, Dv, tile_q, tile_k, kind,
                                             dtype):
    if kind == "blocks":
        Sk = Sq
    q, k, v, dout = make(B, Hkv * G, Hkv, Sq, Sk, D, Dv, dtype=dtype)
    kw = mask_for(kind, B, Hkv * G, Sq, Sk, seed=Sq * 41 + Sk)
    ref = forward_backward("reference", q, k, v, dout, tile_q=tile_q, tile_k=tile_k, **kw)
    built = build_mask(Sq, Sk, Hkv * G, Hkv, B, kw.get("causal", False), kw.get("mask"))
    keep = None if built is None else built.dense4(Sq, Sk, "cpu")
    assert_close(ref[0], naive(q, k, v, keep).to(dtype), "reference vs the definition")
    for backend in ("native", "unfused"):
        got = forward_backward(backend, q, k, v, dout, **kw)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            assert_close(a, b, f"{backend} {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_paths_match_the_reference(dtype, causal):
    # odd lengths, tiles that do not divide them, GQA with 2 groups
    q, k, v, dout = make(2, 4, 2, 67, 45, 16, 16, dtype=dtype, seed=1)
    ref = forward_backward("reference", q, k, v, dout, causal=causal, tile_q=32, tile_k=16)
    assert all(t.dtype == dtype for t in ref)
    for backend in ("native", "unfused"):
        got = forward_backward(backend, q, k, v, dout, causal=causal)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            assert_close(a, b, f"{backend} {name} {dtype}")


def test_reference_in_float64_is_exact_to_the_definition():
    q, k, v, dout = make(1, 3, 1, 19, 23, 8, 8, dtype=torch.float64)
    keep = torch.rand(19, 23, generator=torch.Generator().manual_seed(3)) > 0.3
    out, *grads = forward_backward("reference", q, k, v, dout, mask=keep, tile_q=5, tile_k=7)
    want = naive(q, k, v, keep)
    assert_close(out, want, "out")
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(grads, want_grads):
        assert_close(a, b, "grad")
    small = make(1, 2, 1, 6, 7, 3, 2, dtype=torch.float64, seed=5)[:3]
    assert torch.autograd.gradcheck(
        lambda q, k, v: run("reference", q, k, v, mask=keep[:6, :7], tile_q=4, tile_k=3), small)


def test_rows_with_no_key_give_zero_output_and_gradient_on_every_path():
    q, k, v, dout = make(1, 2, 2, 8, 8, 4, 4)
    keep = torch.ones(8, 8, dtype=torch.bool)
    keep[3] = False
    for backend in ("reference", "native", "unfused"):
        out, dq, *_ = forward_backward(backend, q, k, v, dout, mask=keep, tile_q=3, tile_k=3)
        assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3])), backend
        assert torch.equal(dq[:, :, 3], torch.zeros_like(dq[:, :, 3])), backend
        assert torch.isfinite(out).all() and torch.isfinite(dq).all(), backend


# --- dropout ------------------------------------------------------------------------


def test_dropout_forward_and_backward_equal_the_definition_with_the_same_mask():
    B, Hq, Hkv, Sq, Sk = 1, 4, 2, 21, 30
    q, k, v, dout = make(B, Hq, Hkv, Sq, Sk, 8, 8, dtype=torch.float64)
    p, tq, tk = 0.3, 8, 16
    torch.manual_seed(123)
    out, *grads = forward_backward("reference", q, k, v, dout, dropout_p=p, causal=True,
                                   tile_q=tq, tile_k=tk)
    torch.manual_seed(123)
    seed = int(torch.randint(0, 2**62, ()))     # the draw the reference made
    drop = dense_dropout_keep(seed, B, Hq, Hkv, Sq, Sk, tq, tk, 1 - p)
    assert 0.6 < drop.float().mean() < 0.8
    want = naive(q, k, v, torch.ones(Sq, Sk, dtype=torch.bool).tril(), drop_keep=drop,
                 keep_prob=1 - p)
    assert_close(out, want, "dropout out")
    for a, b in zip(grads, torch.autograd.grad(want, (q, k, v), dout)):
        assert_close(a, b, "dropout grad")


def test_keep_probability_one_is_no_dropout():
    q, k, v, dout = make(1, 2, 2, 9, 9, 4, 4)
    for backend in ("reference", "native", "unfused"):
        a = run(backend, q, k, v, dropout_p=0.0)
        b = run("reference", q, k, v)
        assert_close(a, b, backend)


@pytest.mark.parametrize("backend", ["reference", "native", "unfused"])
def test_dropout_is_unbiased(backend):
    """E[dropout output] = the output without dropout; 400 draws, 5 standard errors."""
    q, k, v, _ = make(1, 1, 1, 16, 16, 8, 8)
    q, k, v = (t.detach() for t in (q, k, v))
    torch.manual_seed(0)
    draws = torch.stack([run(backend, q, k, v, dropout_p=0.25, tile_q=8, tile_k=8)
                         for _ in range(400)])
    clean = run("reference", q, k, v)
    err = (draws.mean(0) - clean).abs()
    stderr = draws.std(0) / math.sqrt(len(draws))
    assert (err <= 5 * stderr + 1e-6).float().mean() > 0.99
    assert not torch.allclose(draws[0], draws[1])


# --- memory and tiles ---------------------------------------------------------------


def saved_bytes(fn):
    """Bytes autograd keeps for backward: each saved storage counted once."""
    storages, big = {}, []

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        big.append(t.numel())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), max(big), out


def test_flash_attention_keeps_a_sixteenth_of_naive_attention_at_2048():
    S = 2048
    q, k, v, dout = make(1, 1, 1, S, S, 16, 16)
    fused, largest, out = saved_bytes(lambda: run("reference", q, k, v, causal=True))
    unfused, _, _ = saved_bytes(lambda: run("unfused", q, k, v, causal=True))
    assert fused * 16 <= unfused, (fused, unfused)
    assert largest < S * S            # no S x S tensor is saved
    cost = ops.cost("flash_attention", q, k, v, causal=True)
    assert (cost.saved_bytes_fused, cost.saved_bytes_unfused) == (fused, unfused)
    dq, = torch.autograd.grad(out, q, dout)   # the backward runs from what was saved
    assert torch.isfinite(dq).all()


def _no_key_rows():
    keep = torch.ones(9, 9, dtype=torch.bool)
    keep[2] = False                                   # query 2 sees no key
    return keep


@pytest.mark.parametrize("Hq, Hkv, kw", [
    (2, 2, dict()),
    (4, 2, dict(causal=True)),                        # GQA: the unfused path copies K/V
    (2, 1, dict(mask=_no_key_rows())),                # the unfused path zeroes that row
    (2, 2, dict(dropout_p=0.2, mask=ops.SlidingWindow(3))),   # dropout keeps its mask
])
def test_saved_bytes_match_the_cost_model(Hq, Hkv, kw):
    q, k, v, _ = make(2, Hq, Hkv, 9, 9, 8, 4)
    cost = ops.cost("flash_attention", q, k, v, **kw)
    assert saved_bytes(lambda: run("reference", q, k, v, **kw))[0] == cost.saved_bytes_fused
    assert saved_bytes(lambda: run("unfused", q, k, v, **kw))[0] == cost.saved_bytes_unfused


def test_block_diagonal_half_empty_skips_half_the_tiles_in_both_passes():
    S, T = 512, 64
    q, k, v, dout = make(1, 2, 2, S, S, 8, 8)
    mask = ops.BlockDiagonal((S // 2, S // 2))           # half the mask is empty
    stats = ops.TileStats()
    out = run("reference", q, k, v, mask=mask, tile_q=T, tile_k=T, tile_stats=stats)
    torch.autograd.grad(out, (q, k, v), dout)
    n = (S // T) ** 2
    assert stats.skipped >= n // 2 and stats.backward_skipped >= n // 2
    assert stats.computed + stats.skipped == n == stats.backward_computed + stats.backward_skipped
    assert_close(out, run("native", q, k, v, mask=mask), "block-diagonal vs sdpa")


def test_dense_mask_with_empty_tiles_skips_them():
    S, T = 256, 32
    keep = torch.rand(S, S, generator=torch.Generator().manual_seed(0)) > 0.5
    keep[: S // 2, S // 2:] = False                      # two empty quadrants: half the tiles
    keep[S // 2:, : S // 2] = False
    stats = ops.TileStats()
    q, k, v, _ = make(1, 1, 1, S, S, 8, 8)
    out = run("reference", q, k, v, mask=keep, tile_q=T, tile_k=T, tile_stats=stats)
    assert stats.skipped == (S // T) ** 2 // 2
    assert_close(out, naive(q, k, v, keep).float(), "dense mask")


def test_causal_and_sliding_window_tile_counts():
    n = 8
    plan = ops.attention_tiles(n * 16, causal=True, tile_q=16, tile_k=16)
    assert plan.skipped == n * (n - 1) // 2 and plan.count("partial") == n
    stats = ops.TileStats()
    q, k, v, _ = make(1, 1, 1, n * 16, n * 16, 4, 4)
    run("reference", q, k, v, causal=True, tile_q=16, tile_k=16, tile_stats=stats)
    assert (stats.computed, stats.skipped, stats.partial) == (plan.computed, plan.skipped, n)
    window = ops.attention_tiles(n * 16, mask=ops.SlidingWindow(16), tile_q=16, tile_k=16)
    assert window.computed == 2 * n - 1                   # the diagonal and the one below it
    assert "skipped" in str(window) and str(window).count("\n") == n


def test_tile_stats_only_on_the_reference():
    q, k, v, _ = make(1, 1, 1, 4, 4, 4, 4)
    with pytest.raises(ValueError, match="only the reference backend counts tiles"):
        run("native", q, k, v, tile_stats=ops.TileStats())


# --- errors --------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    (lambda q, k, v: (q[0], k, v), r"q.shape=\(4, 8, 8\); expected 4-d"),
    (lambda q, k, v: (q[:, :3], k, v), "q has 3 heads, k 2 and v 2"),
    (lambda q, k, v: (q, k[..., :4], v), "q head_dim 8 != k head_dim 4"),
    (lambda q, k, v: (q, k, v.double()), "inputs must share one dtype"),
    (lambda q, k, v: (q.long(), k, v), "q.dtype is torch.int64"),
])
def test_bad_shapes_are_named(change, message):
    q, k, v, _ = make(1, 4, 2, 8, 8, 8, 8)
    with pytest.raises((ValueError, TypeError), match=message):
        ops.flash_attention(*change(q.detach(), k.detach(), v.detach()))


@pytest.mark.parametrize("kwargs, message", [
    (dict(mask=torch.ones(8, 8)), "mask.dtype is torch.float32; give a bool mask"),
    (dict(mask=torch.ones(3, 8, dtype=torch.bool)), r"mask.shape=\(3, 8\) does not broadcast"),
    (dict(mask="causal"), "mask must be None, a bool tensor or a MaskPattern"),
    (dict(mask=ops.BlockDiagonal((3, 4))), "BlockDiagonal.*lengths summing to 7"),
    (dict(dropout_p=1.5), r"dropout_p=1.5; it must be in \[0, 1\]"),
    (dict(tile_q=0), "tile_q=0; give a positive int"),
])
def test_bad_arguments_are_named(kwargs, message):
    q, k, v, _ = make(1, 2, 2, 8, 8, 8, 8)
    with pytest.raises((ValueError, TypeError), match=message):
        ops.flash_attention(q, k, v, **kwargs)


def test_sliding_window_rejects_a_bad_window():
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        ops.SlidingWindow(0)
