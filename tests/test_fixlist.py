"""Regression tests for three user-facing defects (oracle: plain single-device PyTorch).

1. The course's Llama under ``torch.autocast("cpu", dtype=torch.bfloat16)``: RoPE on a bf16
   q with float32 cos/sin follows torch's type promotion (HF Llama's apply_rotary_pos_emb),
   and wb.ops.flash_attention casts like torch's scaled_dot_product_attention.
2. ``torch.nn.utils.clip_grad_norm_`` (and friends) on a wb.parallelize'd model.
3. A MoE layer's ``last_stats`` under simulated DDP: the whole batch's.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.models import build_model, get_config
from workbench.ops import rope_cos_sin, rotary_embedding

R, S = wb.Replicate, wb.Shard
AC = dict(device_type="cpu", dtype=torch.bfloat16)


# ---- 1. RoPE / attention under autocast ---------------------------------------------------
def _rotate_half(x):                                    # HF Llama's rotate_half
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def _hf_rope(q, cos, sin):                              # HF Llama's apply_rotary_pos_emb
    return q * cos + _rotate_half(q) * sin


def _plain_llama(m, idx, tgt):
    """The course's Llama written with plain torch ops (F.rms_norm, HF's RoPE, SDPA)."""
    cfg, P = m.cfg, dict(m.named_parameters())
    B, T = idx.shape
    x = F.embedding(idx, P["tok_emb.weight"])
    cos, sin = m.rope_cos[:T], m.rope_sin[:T]
    nh, nkv, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    for i in range(cfg.n_layer):
        p = lambda n: P[f"layers.{i}.{n}"]              # noqa: E731
        h = F.rms_norm(x, (cfg.d_model,), p("attn_norm.weight"), cfg.norm_eps)
        q = F.linear(h, p("attn.wq.weight")).view(B, T, nh, hd).transpose(1, 2)
        k = F.linear(h, p("attn.wk.weight")).view(B, T, nkv, hd).transpose(1, 2)
        v = F.linear(h, p("attn.wv.weight")).view(B, T, nkv, hd).transpose(1, 2)
        q, k = _hf_rope(q, cos, sin), _hf_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
        x = x + F.linear(y.transpose(1, 2).reshape(B, T, nh * hd), p("attn.wo.weight"))
        h = F.rms_norm(x, (cfg.d_model,), p("mlp_norm.weight"), cfg.norm_eps)
        x = x + F.linear(F.silu(F.linear(h, p("mlp.w1.weight"))) * F.linear(h, p("mlp.w3.weight")),
                         p("mlp.w2.weight"))
    x = F.rms_norm(x, (cfg.d_model,), P["norm.weight"], cfg.norm_eps)
    logits = F.linear(x, P["lm_head.weight"])
    return logits, F.cross_entropy(logits.flatten(0, 1), tgt.flatten())


def _ids():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, 75, (2, 16), generator=g) for _ in range(2))


def _cfg():
    return get_config("tiny", n_layer=2, seq_len=16, n_kv_head=2, dropout=0.0)


def _full(t):
    return t.full() if isinstance(t, wb.DistTensor) else t


@pytest.mark.parametrize("where", ["one_device", "tp"])
def test_llama_trains_under_bf16_autocast_as_plain_torch(where):
    idx, tgt = _ids()
    ref = build_model(_cfg(), seed=0)
    m = copy.deepcopy(ref)
    if where == "tp":
        mesh = wb.Mesh.grid((2,), ("tp",))
        wb.parallelize(m, mesh, m.tp_plan(2), mesh_dim="tp")
    with torch.autocast(**AC):
        rlogits, rloss = _plain_llama(ref, idx, tgt)
        logits, loss = m(idx, tgt)
    assert _full(logits).dtype == rlogits.dtype == torch.bfloat16
    torch.testing.assert_close(_full(logits), rlogits, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(_full(loss), rloss, rtol=1e-2, atol=1e-2)
    rloss.backward()
    loss.backward()
    rgrads = dict(ref.named_parameters())
    for name, p in m.named_parameters():
        g, rg = _full(p.grad), rgrads[name].grad
        assert g.dtype == rg.dtype == torch.float32, name
        err = ((g - rg).norm() / rg.norm()).item()       # bf16 GEMMs: ~1e-2 apart
        assert err < 3e-2, (name, err)


def _qcs(dt=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 6, 8, generator=g).to(dt).requires_grad_()
    cos, sin = (t.requires_grad_() for t in rope_cos_sin(6, 8))         # float32
    return q, cos, sin


@pytest.mark.parametrize("backend", ["reference", "unfused"])
def test_rotary_mixed_dtypes_promote_as_torch(backend):
    q, cos, sin = _qcs()
    rq, rc, rs = (t.detach().clone().requires_grad_() for t in (q, cos, sin))
    with wb.ops.use(backend):
        out = rotary_embedding(q, cos, sin)
    ref = _hf_rope(rq, rc, rs)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(dy)
    ref.backward(dy)
    for a, b in ((q, rq), (cos, rc), (sin, rs)):
        assert a.grad.dtype == b.grad.dtype == a.dtype
        # bf16 dq: torch rounds each product's gradient, ours the sum (one bf16 ulp apart)
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-3)


def test_rotary_mixed_dtypes_on_dist_tensors():
    q, cos, sin = _qcs()
    mesh = wb.Mesh.grid((2,), ("tp",))
    dq = wb.distribute_tensor(q.detach(), mesh, [S(1)]).requires_grad_()
    out = rotary_embedding(dq, cos.detach(), sin.detach())
    ref = _hf_rope(q, cos.detach(), sin.detach())
    assert out.dtype == torch.float32 and out.placements == (S(1),)
    torch.testing.assert_close(out.full(), ref)
    out.sum().backward()
    ref.sum().backward()
    assert dq.grad.dtype == torch.bfloat16
    torch.testing.assert_close(dq.grad.full(), q.grad, rtol=2e-2, atol=4e-3)   # one bf16 ulp
    q1 = q.detach().clone().requires_grad_()
    rotary_embedding(q1, cos.detach(), sin.detach()).sum().backward()       # one device: exact
    torch.testing.assert_close(dq.grad.full(), q1.grad, rtol=0, atol=0)


def test_flash_attention_casts_under_autocast_as_sdpa():
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(2))     # float32 (after RoPE)
    v = torch.randn(1, 2, 5, 8, generator=g).bfloat16()                 # a bf16 linear's
    with torch.autocast(**AC):
        out = wb.ops.flash_attention(q, k, v, causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(TypeError, match="share one dtype"):             # outside autocast
        wb.ops.flash_attention(q, k, v, causal=True)


# ---- 2. torch.nn.utils.clip_grad_norm_ & co. on a wb.parallelize'd model -------------------
def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8),
                               torch.nn.LayerNorm(8))


def _clip_pair(mesh_shape=(2,), names=("tp",), scale=1.0):
    """(one-device params, parallelized params): the same model after one backward, with an
    extra plain parameter beside the DistTensors (a mixed list)."""
    ref = _mlp()
    m = copy.deepcopy(ref)
    mesh = wb.Mesh.grid(mesh_shape, names)
    wb.parallelize(m, mesh, {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    (ref(x).pow(2).sum() * scale).backward()
    (m(x).pow(2).sum() * scale).backward()
    extra = [torch.ones(3, requires_grad=True) for _ in range(2)]
    for e in extra:
        e.grad = torch.full((3,), 0.5 * scale)
    return list(ref.parameters()) + extra[:1], list(m.parameters()) + extra[1:]


def _same_grads(ps, rs):
    assert any(isinstance(p, wb.DistTensor) for p in ps)
    for p, r in zip(ps, rs):
        torch.testing.assert_close(_full(p.grad), r.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_torch_clip_grad_norm_on_parallelized_model(norm_type, foreach):
    rs, ps = _clip_pair()
    want = torch.nn.utils.clip_grad_norm_(rs, 1.0, norm_type, foreach=foreach)
    got = torch.nn.utils.clip_grad_norm_(iter(ps), 1.0, norm_type, foreach=foreach)
    assert want.item() > 1.0                           # the clipping scaled the gradients
    assert type(got) is torch.Tensor and got.dtype == want.dtype
    torch.testing.assert_close(got, want)
    _same_grads(ps, rs)


def test_torch_clip_grad_norm_on_dp_tp_mesh_and_llama():
    rs, ps = _clip_pair((2, 2), ("dp", "tp"))
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(ps, 0.5),
                               torch.nn.utils.clip_grad_norm_(rs, 0.5))
    _same_grads(ps, rs)
    idx, tgt = _ids()
    ref = build_model(_cfg(), seed=0)
    m = copy.deepcopy(ref)
    wb.parallelize(m, wb.Mesh.grid((2,), ("tp",)), m.tp_plan(2), mesh_dim="tp")
    ref(idx, tgt)[1].backward()
    m(idx, tgt)[1].backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    got = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _same_grads(list(m.parameters()), list(ref.parameters()))


def test_torch_get_total_norm_clip_grads_with_norm_and_clip_value():
    rs, ps = _clip_pair()
    want = torch.nn.utils.get_total_norm([r.grad for r in rs], 3.0)
    got = torch.nn.utils.get_total_norm([p.grad for p in ps], 3.0)
    torch.testing.assert_close(got, want)
    torch.nn.utils.clip_grads_with_norm_(rs, 0.3, want)
    torch.nn.utils.clip_grads_with_norm_(ps, 0.3, got)
    _same_grads(ps, rs)
    rs, ps = _clip_pair()
    torch.nn.utils.clip_grad_value_(rs, 0.05)
    torch.nn.utils.clip_grad_value_(ps, 0.05)
    _same_grads(ps, rs)


def test_torch_clip_grad_norm_error_if_nonfinite_leaves_grads():
    rs, ps = _clip_pair(scale=math.inf)
    before = [_full(p.grad).clone() for p in ps]
    for params in (rs, ps):
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    for p, b in zip(ps, before):
        torch.testing.assert_close(_full(p.grad), b, equal_nan=True)
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(ps, 1.0),     # nan, as torch
                               torch.nn.utils.clip_grad_norm_(rs, 1.0), equal_nan=True)
    for p, r in zip(ps, rs):
        torch.testing.assert_close(_full(p.grad), r.grad, equal_nan=True)


def test_torch_clip_grad_norm_of_plain_tensors_is_torchs():
    assert torch.nn.utils.clip_grad_norm_.__wrapped__ is not None
    with pytest.warns(UserWarning, match="empty generator"):
        assert torch.nn.utils.clip_grad_norm_((p for p in []), 1.0).item() == 0.0
    p = torch.ones(4, requires_grad=True)
    p.grad = torch.full((4,), 2.0)
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(p, 1.0), torch.tensor(4.0))
    torch.testing.assert_close(p.grad, torch.full((4,), 0.5 / (1 + 2.5e-7)))


# ---- 3. a MoE layer's last_stats under simulated data parallelism -------------------------
@pytest.mark.parametrize("kind,n", [("ddp", 2), ("ddp", 4), ("fsdp", 2)])
def test_moe_last_stats_under_simulated_dp_are_the_whole_batch(kind, n):
    """Measured before the fix (ddp, n=2): 32 of 64 dropped on the last rank's rows where
    one device drops 64 of 128."""
    from workbench.models.moe import aux_loss, moe_layers
    cfg = get_config("tiny", n_layer=2, seq_len=16, moe_experts=4, moe_topk=2,
                     moe_capacity_factor=0.5, moe_aux_loss_coef=0.1)
    ref, m = build_model(cfg, seed=0), build_model(cfg, seed=0)
    mesh = wb.Mesh.grid(n, ["dp"])
    model = wb.DistributedDataParallel(m, mesh) if kind == "ddp" else \
        wb.FullyShardedDataParallel(m, mesh)
    g = torch.Generator().manual_seed(1)
    for step in range(2):                  # the second batch's replace the first's
        idx, tgt = (torch.randint(0, 75, (4, 16), generator=g) for _ in range(2))
        ref(idx, tgt)
        model(wb.shard_tensor(idx, mesh, [S(0)]), wb.shard_tensor(tgt, mesh, [S(0)]))
        for a, b in zip(moe_layers(ref), moe_layers(m)):
            want, got = a.last_stats, b.last_stats
            assert want["dropped"] > 0 and want["routed"] == 4 * 16 * 2
            assert torch.equal(got.pop("tokens_per_expert"), want.pop("tokens_per_expert"))
            assert got.pop("aux_loss") == pytest.approx(want.pop("aux_loss"), rel=1e-5)
            assert got == want
        assert aux_loss(m) == pytest.approx(aux_loss(ref), rel=1e-5)


def test_torch_foreach_norm_of_dist_tensors():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(4, 6, generator=g), torch.randn(5, generator=g)
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    da = wb.distribute_tensor(a, mesh, [R(), S(0)])
    for ord in (2, 1, math.inf):
        got = torch._foreach_norm([da, b], ord)
        want = torch._foreach_norm([a, b], ord)
        assert isinstance(got[0], wb.DistTensor) and got[0].placements == (R(), R())
        torch.testing.assert_close(got[0].full(), want[0])
        torch.testing.assert_close(got[1], want[1])
