"""The course's Llama, its dataset and single-device training (models/, train.py)."""
import argparse
import json

import pytest
import torch

from workbench import ops
from workbench.models.config import PRESETS, ModelConfig, get_config, param_count
from workbench.models.data import ALPHABET, TOKENIZER, batches, get_batch, load_text
from workbench.models.llama import Llama
from workbench.sim_mesh.estimates import megatron_params
from workbench.train import add_train_arguments, main_train, train


# ---- config -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, words", [
    (dict(n_head=5), ["n_head=5", "d_model=64"]),
    (dict(d_model=96, n_head=32), ["head dim", "= 3", "odd"]),
    (dict(n_kv_head=3), ["n_kv_head=3", "n_head=4"]),
    (dict(dropout=1.0), ["dropout=1.0"]),
    (dict(dtype="float8"), ["dtype='float8'"]),
    (dict(recompute="some"), ["recompute='some'", "selective"]),
    (dict(vocab_size=0), ["vocab_size=0"]),
    (dict(n_layer=True), ["n_layer=True"]),
    (dict(norm_eps=0), ["norm_eps=0"]),
])
def test_config_errors_name_the_argument(kw, words):
    with pytest.raises(ValueError) as e:
        get_config("tiny", **kw)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_config_defaults_replace_and_presets():
    cfg = ModelConfig(d_model=384, n_head=6)
    assert cfg.n_kv_head == 6 and cfg.d_ff == 1024 and cfg.head_dim == 64
    assert cfg.replace(n_layer=3).n_layer == 3 and cfg.n_layer == 2
    with pytest.raises(ValueError, match="n_head=7"):
        cfg.replace(n_head=7)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        get_config("huge")
    for name in PRESETS:
        get_config(name)
    assert get_config("tiny").vocab_size == TOKENIZER.vocab_size == len(ALPHABET) == 75


def test_param_counts_match_closed_forms():
    for name in ("tiny", "small"):
        pc = param_count(name)
        assert pc.module == sum(pc.terms.values()), (name, pc.terms)
        assert pc.module - pc.megatron == sum(pc.differences.values()), pc.explain()
    assert param_count("tiny").module == 116_416


def test_gpt3_175b_on_meta_vs_megatron():
    cfg = get_config("gpt3-175b", arch="llama")           # GPT-3's shape as a Llama
    pc = param_count(cfg)
    l, h, V, s = cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.seq_len
    assert pc.megatron == round(megatron_params(l, h, V, s))
    assert abs(pc.megatron - 174.6e9) < 0.05e9                   # Narayanan et al. eq. 2
    # Same 12 l h^2 matrices (d_ff = 8/3 h makes SwiGLU's 3 h d_ff = 8 h^2; tied
    # embedding); eq. 2's 13 l h counts GPT's biases and LayerNorm biases, ours has
    # only 2 RMSNorm weights per layer; RoPE has no position table; eq. 2 omits the
    # final norm.  Nothing else differs.
    explained = -11 * l * h - s * h + h
    assert pc.module - pc.megatron == explained, (
        f"module {pc.module:,} - Megatron {pc.megatron:,} = {pc.module - pc.megatron:,}; "
        f"expected -11 l h (biases) - s h (positions) + h (final norm) = {explained:,}\n"
        + pc.explain())
    assert abs(pc.module / 174.6e9 - 1) < 1e-3
    untied = param_count(cfg.replace(tie_embeddings=False))
    assert untied.module - pc.module == V * h                    # Llama's separate lm head


# ---- data ---------------------------------------------------------------------------------

def test_text_tokenizer_and_batches():
    text = load_text()
    assert 20_000 <= len(text.encode()) <= 50_000
    assert set(text) <= set(ALPHABET)
    assert TOKENIZER.decode(TOKENIZER.encode("Many hands, 8 loads!")) == "Many hands, 8 loads!"
    with pytest.raises(ValueError, match="not in the 75-character alphabet"):
        TOKENIZER.encode("caf\u00e9")
    cfg = get_config("tiny")
    x, y = get_batch(cfg, 4, seed=3, step=7)
    assert x.shape == y.shape == (4, cfg.seq_len) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])                       # targets: next character
    again = list(batches(cfg, 4, seed=3, steps=8))
    assert len(again) == 8 and torch.equal(again[7][0], x)       # batch i is (seed, i) only
    assert not torch.equal(get_batch(cfg, 4, seed=4, step=7)[0], x)
    with pytest.raises(ValueError, match="batch_size=0"):
        get_batch(cfg, 0)


# ---- model --------------------------------------------------------------------------------

def _loss_and_grads(cfg, seed=0):
    model = Llama(cfg, seed=seed).train()
    x, y = get_batch(cfg, 4, seed=1)
    torch.manual_seed(123)                                        # dropout, if any
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_loss_and_gradients(mode, dropout):
    cfg = get_config("tiny", dropout=dropout)
    loss0, g0 = _loss_and_grads(cfg)
    loss1, g1 = _loss_and_grads(cfg.replace(recompute=mode))
    assert abs(float(loss0) - float(loss1)) <= 1e-6
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-6, rtol=0), n


def test_init_is_deterministic_and_leaves_global_rng_alone():
    cfg = get_config("tiny")
    state = torch.get_rng_state()
    a, b = Llama(cfg, seed=0), Llama(cfg, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(Llama(cfg, seed=1).tok_emb.weight, a.tok_emb.weight)


def test_gqa_reference_backend_and_generate():
    cfg = get_config("tiny", n_kv_head=2)
    model = Llama(cfg, seed=0).eval()
    assert model.layers[0].attn.wk.weight.shape == (2 * cfg.head_dim, cfg.d_model)
    x, y = get_batch(cfg, 2, seed=0)
    with torch.no_grad():
        logits, loss = model(x, y)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)
    with ops.use("reference"), torch.no_grad():                   # the readable kernels
        _, ref = model(x, y)
    assert abs(float(loss) - float(ref)) < 1e-5
    out = model.generate(x[:, :5], 3, temperature=0)
    assert out.shape == (2, 8) and torch.equal(out[:, :5], x[:, :5])
    with pytest.raises(ValueError, match="longer than seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


# ---- training -----------------------------------------------------------------------------

def test_training_is_deterministic():
    a = train("tiny", steps=3, seed=0, timing=False)
    b = train("tiny", steps=3, seed=0, timing=False)
    assert a == b and [r["step"] for r in a] == [0, 1, 2]
    assert a[-1]["tokens"] == 3 * 8 * 64 and set(a[0]) == {"step", "loss", "tokens", "lr"}
    assert train("tiny", steps=3, seed=1, timing=False) != a
    assert "ms" in train("tiny", steps=1)[0]


def test_tiny_model_learns():
    losses = [r["loss"] for r in train("tiny", steps=30, seed=0, timing=False)]
    assert abs(losses[0] - torch.log(torch.tensor(75.0)).item()) < 0.1   # starts at ln(V)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.2, losses               # ~4.3 -> ~2.3


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return parser.parse_args(list(argv))


def test_main_train_prints_one_json_line_per_step(capsys):
    assert main_train(_args("--preset", "tiny", "--steps", "2", "--seed", "0")) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(s) for s in out.splitlines()]
    assert [r["step"] for r in lines] == [0, 1] and err == ""    # no bar: stderr is no TTY
    assert [r["loss"] for r in lines] == [r["loss"] for r in train("tiny", steps=2, seed=0)]


def test_parallel_flags_train_the_same_losses(capsys):
    """--dp/--tp/--pp/--sp/--zero/--schedule run the simulated ranks (tests/test_strategies.py
    checks every layout); the JSON lines carry the same losses as one device."""
    assert main_train(_args("--steps", "2", "--dp", "2", "--tp", "2", "--sp")) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(s) for s in out.splitlines()]
    ref = [r["loss"] for r in train("tiny", steps=2, seed=0)]
    assert [r["loss"] for r in lines] == pytest.approx(ref, rel=1e-5)
    assert all(r["comm_bytes"] > 0 and r["modeled_ms"] > 0 and r["state_bytes"] > 0
               for r in lines)


@pytest.mark.parametrize("argv, msg", [(["--tp", "3"], "tp=3 does not divide n_head=4"),
                                       (["--sp"], "sp=True needs tp > 1"),
                                       (["--backend", "torch"], "launch with `torchrun")])
def test_bad_layouts_fail_before_running(capsys, argv, msg):
    assert main_train(_args(*argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and msg in err
