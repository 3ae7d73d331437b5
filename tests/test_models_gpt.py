"""Megatron's GPT architecture (models/gpt.py GPT, ModelConfig(arch="gpt"))."""
import pytest
import torch
import torch.nn.functional as F

from workbench.models import GPT, Llama, build_model, get_config, get_batch, param_count
from workbench.sim_mesh.estimates import megatron_params


def test_gpt3_param_count_is_megatron_eq2_plus_the_final_layernorm():
    cfg = get_config("gpt3-175b")
    assert cfg.arch == "gpt" and cfg.d_ff == 4 * cfg.d_model and cfg.tie_embeddings
    pc = param_count(cfg)
    assert abs(pc.megatron - 174.6e9) < 0.05e9                        # published.md, eq. 2
    assert pc.megatron == round(megatron_params(96, 12288, 51200, 2048))
    assert pc.module - pc.megatron == 2 * 12288                        # final LN: weight, bias
    assert pc.module == sum(pc.terms.values())
    assert pc.module - pc.megatron == sum(pc.differences.values()), pc.explain()


@pytest.mark.parametrize("kw", [dict(), dict(d_ff=96, tie_embeddings=False)])
def test_gpt_module_count_matches_its_closed_form(kw):
    cfg = get_config("gpt-tiny", **kw)
    pc = param_count(cfg)
    assert pc.module == sum(p.numel() for p in GPT(cfg).parameters())
    assert pc.module == sum(pc.terms.values())
    assert pc.module - pc.megatron == sum(pc.differences.values()), pc.explain()


def _reference_forward(model, idx):
    """The same GPT written with torch.nn.functional only (an independent path)."""
    cfg = model.cfg
    B, S = idx.shape
    x = model.tok_emb.weight[idx] + model.pos_emb.weight[:S]
    for blk in model.layers:
        a = blk.attn
        y = F.layer_norm(x, (cfg.d_model,), blk.ln1.weight, blk.ln1.bias, cfg.norm_eps)
        q, k, v = (F.linear(y, w.weight, w.bias).view(B, S, cfg.n_head, -1).transpose(1, 2)
                   for w in (a.wq, a.wk, a.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(o.transpose(1, 2).reshape(B, S, -1), a.wo.weight, a.wo.bias)
        y = F.layer_norm(x, (cfg.d_model,), blk.ln2.weight, blk.ln2.bias, cfg.norm_eps)
        m = blk.mlp
        x = x + F.linear(F.gelu(F.linear(y, m.fc1.weight, m.fc1.bias)), m.fc2.weight, m.fc2.bias)
    x = F.layer_norm(x, (cfg.d_model,), model.norm.weight, model.norm.bias, cfg.norm_eps)
    return x @ model.tok_emb.weight.T


def test_gpt_forward_matches_a_functional_reference_and_ties_the_head():
    cfg = get_config("gpt-tiny")
    model = build_model(cfg, seed=3).eval()
    assert isinstance(model, GPT) and model.lm_head.weight is model.tok_emb.weight
    with torch.no_grad():                                    # LayerNorm biases: not all 0
        for blk in model.layers:
            blk.ln1.bias.normal_(0, 0.1)
            blk.attn.wq.bias.normal_(0, 0.1)
    x, y = get_batch(cfg, 3, seed=0)
    logits, loss = model(x, y)
    ref = _reference_forward(model, x)
    assert torch.allclose(logits, ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(loss, F.cross_entropy(ref.reshape(-1, cfg.vocab_size), y.reshape(-1)))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gpt_backward_and_recompute_give_the_same_gradients(mode):
    cfg = get_config("gpt-tiny", dropout=0.1)
    grads = []
    for c in (cfg, cfg.replace(recompute=mode)):
        model = GPT(c, seed=0).train()
        x, y = get_batch(c, 4, seed=1)
        torch.manual_seed(7)
        _, loss = model(x, y)
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        assert all(g is not None and torch.isfinite(g).all() for g in grads[-1].values())
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6, rtol=0), n


def test_gpt_init_and_generate():
    cfg = get_config("gpt-tiny")
    a, b = GPT(cfg, seed=1), GPT(cfg, seed=1)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert torch.all(a.layers[0].ln1.weight == 1) and torch.all(a.layers[0].attn.wq.bias == 0)
    out = a.generate(torch.zeros(1, 1, dtype=torch.long), 5, temperature=0)
    assert out.shape == (1, 6)


def test_arch_errors_and_default_stays_llama():
    assert isinstance(build_model(get_config("tiny")), Llama)
    with pytest.raises(ValueError, match="arch='bert'"):
        get_config("tiny", arch="bert")
    with pytest.raises(ValueError, match="n_kv_head=2 must equal n_head=4"):
        get_config("gpt-tiny", n_kv_head=2)
    with pytest.raises(ValueError, match="arch='llama'"):
        GPT(get_config("tiny"))
    with pytest.raises(ValueError, match="seq_len=64"):
        GPT(get_config("gpt-tiny"))(torch.zeros(1, 65, dtype=torch.long))


def test_llama_refuses_a_gpt_config():
    with pytest.raises(ValueError, match="arch='gpt'"):
        Llama(get_config("gpt-tiny"))


def test_gpt_tensor_parallel_matches_one_device():
    import workbench as wb
    from workbench.models import GPT_TP_PLAN
    cfg = get_config("gpt-tiny")
    x, y = get_batch(cfg, 2, seed=0)
    ref = GPT(cfg, seed=0)
    _, loss0 = ref(x, y)
    loss0.backward()
    model = GPT(cfg, seed=0)
    wb.parallelize(model, wb.Mesh([0, 1], dim_names=["tp"]), GPT_TP_PLAN)
    _, loss = model(x, y)
    loss.backward()
    assert torch.allclose(loss.full(), loss0, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.full() if hasattr(p.grad, "full") else p.grad
        assert torch.allclose(g, q.grad, atol=1e-5), n
