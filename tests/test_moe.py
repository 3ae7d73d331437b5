"""The mixture-of-experts layer (models/moe.py, ops/moe.py) held to a dense loop over
experts written here from the papers' formulas: routing, capacity and drops, the
load-balancing loss, shared experts, both gatings, forward and backward (fp32, 1e-5)."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import workbench as wb
from workbench.models import build_model, get_config
from workbench.models.moe import MoE, aux_loss, moe_layers
from workbench.ops.moe import capacity, moe_combine, moe_dispatch, router_topk


def _layer(arch="llama", seed=0, **kw):
    cfg = get_config("tiny" if arch == "llama" else "gpt-tiny", d_model=16, n_head=2,
                     d_ff=24, **{"moe_experts": 4, "moe_topk": 2, **kw})
    m = MoE(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.train()


def _expert(m, i, t):
    """Expert i of ``m`` on one token t (h,), written out."""
    P = dict(m.experts.named_parameters())
    if m.experts.arch == "llama":
        return (F.silu(t @ P["w1"][i]) * (t @ P["w3"][i])) @ P["w2"][i]
    return F.gelu(t @ P["fc1_weight"][i] + P["fc1_bias"][i]) @ P["fc2_weight"][i] + \
        P["fc2_bias"][i]


def dense_loop(m, x):
    """Per sequence, per choice (first choices first: GShard), per token: the expert's
    output times its gate, while the expert has room; the Switch aux loss per sequence."""
    B, S, h = x.shape
    E, k = m.num_experts, m.k
    C = capacity(S, E, k, m.capacity_factor)
    ys, auxes, dropped, load = [], [], 0, torch.zeros(E, dtype=torch.long)
    for b in range(B):
        z = x[b] @ m.router.weight.T                                   # (S, E)
        s = torch.softmax(z, -1) if m.gating == "softmax" else torch.sigmoid(z)
        p = s if m.gating == "softmax" else s / s.sum(-1, keepdim=True)
        top, idx = s.topk(k, -1)
        gate = top / top.sum(-1, keepdim=True)
        used = [0] * E
        rows = [torch.zeros(h) for _ in range(S)]
        for j in range(k):
            for t in range(S):
                e = int(idx[t, j])
                load[e] += 1
                if used[e] < C:
                    used[e] += 1
                    rows[t] = rows[t] + gate[t, j] * _expert(m, e, x[b, t])
                else:
                    dropped += 1
        f = torch.bincount(idx.reshape(-1), minlength=E).float() / (S * k)
        auxes.append(E * (f * p.mean(0)).sum())
        ys.append(torch.stack(rows))
    y = torch.stack(ys)
    if m.shared is not None:
        y = y + m.shared(x)
    return y, torch.stack(auxes), dropped, load


def _grads(m, x):
    return [x.grad] + [p.grad for p in m.parameters()]


def _check_against_loop(m, x, gy):
    x1 = x.clone().requires_grad_()
    y = m(x1)
    (y * gy).sum().backward()
    got = _grads(m, x1)
    stats = m.last_stats
    m.zero_grad()
    x2 = x.clone().requires_grad_()
    y_ref, aux, dropped, load = dense_loop(m, x2)
    ((y_ref * gy).sum() + m.aux_loss_coef * aux.mean()).backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, _grads(m, x2)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert stats["dropped"] == dropped
    assert torch.equal(stats["tokens_per_expert"], load)
    assert stats["aux_loss"] == pytest.approx(m.aux_loss_coef * float(aux.mean()), rel=1e-5)
    return stats


@pytest.mark.parametrize("arch", ["llama", "gpt"])
@pytest.mark.parametrize("gating,cf,shared", [("softmax", None, 0), ("softmax", 1.0, 1),
                                              ("sigmoid", 0.75, 0), ("sigmoid", None, 2)])
def test_moe_equals_a_dense_loop_forward_and_backward(arch, gating, cf, shared):
    m = _layer(arch, moe_gating=gating, moe_capacity_factor=cf, moe_shared_experts=shared,
               moe_aux_loss_coef=0.1)
    g = torch.Generator().manual_seed(1)
    x, gy = torch.randn(3, 8, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    stats = _check_against_loop(m, x, gy)
    assert (stats["dropped"] > 0) == (cf is not None and cf < 1.0) or cf == 1.0
    assert stats["capacity"] == (8 if cf is None else math.ceil(cf * 8 * 2 / 4))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), B=st.integers(1, 3), S=st.integers(1, 7),
       k=st.integers(1, 3), cf=st.sampled_from([None, 0.5, 1.0, 1.5]),
       gating=st.sampled_from(["softmax", "sigmoid"]))
def test_moe_router_seeds_and_uneven_token_counts(seed, B, S, k, cf, gating):
    m = _layer("llama", seed=seed, moe_topk=k, moe_capacity_factor=cf, moe_gating=gating)
    g = torch.Generator().manual_seed(seed + 1)
    x, gy = torch.randn(B, S, 16, generator=g), torch.randn(B, S, 16, generator=g)
    stats = _check_against_loop(m, x, gy)
    assert stats["routed"] == B * S * k
    assert stats["dropped"] == 0 or cf is not None


def test_aux_loss_is_switch_formula_and_one_for_uniform_routing():
    # uniform router (zero weights): every expert's probability 1/E; P_i = 1/E, sum f_i = 1
    logits = torch.zeros(2, 6, 3, requires_grad=True)
    _, _, _, aux = router_topk(logits, 1)
    torch.testing.assert_close(aux, torch.ones(2))
    # all tokens to expert 0 with probability ~1: f_0 = 1, P_0 = 1 -> aux = E
    big = torch.tensor([50.0, 0, 0, 0]).expand(2, 5, 4).clone()
    _, e, _, aux = router_topk(big, 1)
    assert (e == 0).all()
    torch.testing.assert_close(aux, torch.full((2,), 4.0))


def test_dispatch_then_combine_is_the_identity_for_identity_experts():
    g = torch.Generator().manual_seed(3)
    for k, E in ((1, 3), (2, 4), (3, 3)):
        x = torch.randn(3, 7, 5, generator=g)
        w, e, s, _ = router_topk(torch.randn(3, 7, E, generator=g), k)
        C = capacity(7, E, k, None)
        torch.testing.assert_close(moe_combine(moe_dispatch(x, e, s, E, C), w, e, s), x)
        # with drops: each token keeps the gates of its choices that found room
        w, e, s, _ = router_topk(torch.randn(3, 7, E, generator=g), k, capacity=2)
        out = moe_combine(moe_dispatch(x, e, s, E, 2), w, e, s)
        torch.testing.assert_close(out, x * (w * (s >= 0)).sum(-1, keepdim=True))


def test_the_model_trains_on_lm_loss_plus_aux_and_reports_both():
    cfg = get_config("tiny", n_layer=1, moe_experts=4, moe_topk=2, moe_aux_loss_coef=0.5)
    model = build_model(cfg)
    idx = torch.randint(0, 75, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx, idx)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 75), idx.reshape(-1)))
    loss.backward()
    got = model.layers[0].mlp.router.weight.grad.clone()
    # the same gradient from lm loss + alpha * aux written out, with the scaler off
    model.zero_grad()
    layer = moe_layers(model)[0]
    layer.aux_loss_coef = 0.0
    _, lm = model(idx, idx)
    z = layer.router(model.layers[0].mlp_norm(_block_input(model, idx)))
    _, _, _, aux = router_topk(z, 2)
    (lm + 0.5 * aux.mean()).backward()
    torch.testing.assert_close(got, layer.router.weight.grad, rtol=1e-5, atol=1e-7)
    assert aux_loss(model) == pytest.approx(0.0)          # coefficient 0 now
    layer.aux_loss_coef = 0.5
    model(idx, idx)
    assert aux_loss(model) == pytest.approx(0.5 * float(aux.mean()), rel=1e-5)


def _block_input(model, idx):
    """The MoE layer's input in block 0: x + attention(norm(x))."""
    b = model.layers[0]
    x = model.tok_emb(idx)
    S = idx.shape[1]
    return x + b.attn(b.attn_norm(x), model.rope_cos[:S], model.rope_sin[:S])


def test_moe_on_dist_tensors_dp_tp_equals_one_device():
    from workbench.recipes import Hybrid
    from workbench.train import train
    cfg = get_config("tiny", n_layer=2, moe_experts=4, moe_topk=2, moe_capacity_factor=1.0,
                     moe_shared_experts=1)
    ref = [r["loss"] for r in train(cfg, steps=2, timing=False)]
    for kw in (dict(dp=2, tp=2), dict(pp=2), dict(dp=2, zero=2), dict(tp=2, sp=True)):
        got = [r["loss"] for r in train(cfg, steps=2, timing=False, strategy=Hybrid(**kw))]
        assert got == pytest.approx(ref, abs=2e-5), kw


def test_moe_ops_on_dist_tensors_place_and_count():
    M = wb.Mesh.grid(2, ["a"])
    g = torch.Generator().manual_seed(0)
    logits, x = torch.randn(4, 6, 3, generator=g), torch.randn(4, 6, 8, generator=g)
    ref = router_topk(logits, 2, capacity=3)
    with wb.trace() as tr:
        out = router_topk(wb.shard_tensor(logits, M, [wb.Shard(0)]), 2, capacity=3)
    assert all(o.placements == (wb.Shard(0),) for o in out)
    assert not [e for e in tr.events if e.stream != "compute"]        # no communication
    for o, r in zip(out, ref):
        assert torch.equal(o.full(), r)
    w, e, s, _ = ref
    # tokens sharded: each rank fills its own slots, the buffer is their sum
    buf = moe_dispatch(*(wb.shard_tensor(t, M, [wb.Shard(1)]) for t in (x, e, s)), 3, 3)
    assert buf.placements == (wb.Partial("sum"),)
    torch.testing.assert_close(buf.full(), moe_dispatch(x, e, s, 3, 3))


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="moe_topk=5 > moe_experts=4.*lower moe_topk"):
        get_config("tiny", moe_experts=4, moe_topk=5)
    with pytest.raises(ValueError, match="moe_capacity_factor=0"):
        get_config("tiny", moe_experts=4, moe_capacity_factor=0)
    with pytest.raises(ValueError, match="moe_gating='relu'"):
        get_config("tiny", moe_experts=4, moe_gating="relu")
    with pytest.raises(ValueError, match="moe_experts=-1"):
        get_config("tiny", moe_experts=-1)
    with pytest.raises(ValueError, match="k=4 > 3 experts"):
        router_topk(torch.randn(2, 3, 3), 4)
    with pytest.raises(ValueError, match="gating='tanh'"):
        router_topk(torch.randn(2, 3, 3), 1, gating="tanh")
    with pytest.raises(ValueError, match="give \\(groups, tokens, experts\\)"):
        router_topk(torch.randn(6, 3), 1)
    _, e, s, _ = router_topk(torch.randn(2, 3, 3), 2)
    with pytest.raises(ValueError, match="outside 2 experts"):
        moe_dispatch(torch.randn(2, 3, 4), e, s, 2, 3)


@pytest.mark.parametrize("name", ["tiny", "gpt-tiny"])
def test_param_count_closed_form_counts_the_moe_module(name):
    from workbench.models.config import param_count
    cfg = get_config(name, moe_experts=8, moe_topk=2, moe_shared_experts=2)
    pc = param_count(cfg)
    assert pc.module == sum(pc.terms.values()), pc.terms
    assert pc.module - pc.megatron == sum(pc.differences.values()), pc.explain()
    dense = param_count(name).module
    f, h, L = cfg.d_ff, cfg.d_model, cfg.n_layer
    per = 3 * h * f if name == "tiny" else 2 * h * f + f + h           # one dense MLP
    assert pc.module - dense == L * (h * 8 + 8 * per + (2 * per if name == "tiny" else
                                                        2 * h * 2 * f + 2 * f + h) - per)
