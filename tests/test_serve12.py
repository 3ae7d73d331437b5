"""Seeded randomized probes of train-to-serve against a plain one-device reference.

* the continuous-batching engine (one device and tensor parallel): random request mixes
  (prompt lengths 1 and around the block size, arrivals mid-run, pools small enough to
  wait and preempt, chunked prefill, eos) give, greedy, the tokens of the plain model's
  forward over the whole context, no cache;
* paged attention: random block tables, block sizes, grouped-query heads, float16 /
  bfloat16 / float32, on every backend, equals ``scaled_dot_product_attention`` over the
  gathered keys in float64;
* a training run saved on one layout and resumed on another gives the uninterrupted
  one-device run's losses.  It was refused for the GPT (tied embeddings) resumed into
  ZeRO-3 over tensor parallelism: the load wrote ``lm_head.weight`` (the storage itself)
  and then took the ZeRO-3 copy of ``tok_emb.weight`` it had also written for stale
  (``parallel.load_back.loading``; two keys of other values load as torch's);
* int8 / int4 weights hold their stated bound |W - s q| <= s / 2: in float16 a small
  row's scale was rounded down (or to 0), putting its largest weight past the clamp
  (300 seeded random weights: |W - s q| up to 43 s, 817 nonzero weights under a scale
  of 0, 14 nonzero rows dequantized to all zeros; now at most s / 2, none).
"""
import random
import warnings

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.ops import registry
from workbench.recipes.hybrid import Hybrid
from workbench.serve.engine import Engine
from workbench.serve.quantize import dequantize, quantize_weight
from workbench.train import SingleDevice, train

import importlib

PA = importlib.import_module("workbench.ops.paged_attention")

_MODELS = {}


def _model(preset, **over):
    key = (preset, tuple(sorted(over.items())))
    if key not in _MODELS:
        cfg = wb.models.get_config(preset, dtype="float32", **over)
        _MODELS[key] = wb.models.build_model(cfg, seed=0).eval()
    return _MODELS[key]


def _plain_greedy(m, prompt, n, eos=None):
    """The plain model's tokens: a whole forward over the context per token, no cache."""
    toks, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits, _ = m(torch.tensor([toks]))
            t = int(logits[0, -1].argmax())
            out.append(t)
            toks.append(t)
            if eos is not None and t in eos:
                break
    return out


def _requests(rng, vocab, bs, n):
    out = []
    for i in range(n):
        pl = rng.choice([1, bs, 2 * bs, bs + 1, max(1, bs - 1), rng.randint(1, 14)])
        out.append((i, [rng.randrange(vocab) for _ in range(pl)], rng.randint(1, 8),
                    rng.random() < 0.3, rng.randint(0, 3)))
    return out


def _serve(e, reqs, eos):
    pending, step = sorted(reqs, key=lambda r: r[4]), 0
    while pending or e.has_unfinished():
        while pending and pending[0][4] <= step:            # arrivals mid-run
            i, p, mn, _, _ = pending.pop(0)
            e.add_request(i, p, mn, eos_token_id=eos[i])
        e.step()
        step += 1
        assert step < 1000
    return e.outputs


@pytest.mark.parametrize("trial", range(6))
def test_random_request_mixes_get_the_plain_models_tokens(trial):
    rng = random.Random(trial)
    preset = ("tiny", "gpt-tiny")[trial % 2]
    m = _model(preset, **({"n_kv_head": 1} if trial % 4 == 0 else {}))
    bs = rng.choice([1, 2, 3, 4, 8])
    reqs = _requests(rng, m.cfg.vocab_size, bs, rng.randint(2, 6))
    eos, refs = {}, {}
    for i, p, mn, use_eos, _ in reqs:
        r = _plain_greedy(m, p, mn)
        eos[i] = [r[len(r) // 2]] if use_eos else None
        refs[i] = _plain_greedy(m, p, mn, eos[i])
    most = max(-(-(len(p) + mn - 1) // bs) for _, p, mn, _, _ in reqs)
    mb = rng.randint(1, 4)
    e = Engine(m, num_blocks=rng.randint(most, 2 * most), block_size=bs, max_batch=mb,
               token_budget=rng.choice([None, mb + rng.randint(0, 6)]))
    out = _serve(e, reqs, eos)
    assert {i: out[i] for i in refs} == refs
    assert e.cache.allocator.num_used == 0


@pytest.mark.parametrize("trial", range(2))
def test_random_request_mixes_on_tensor_parallel_get_one_devices_plain_tokens(trial):
    rng = random.Random(100 + trial)
    preset, tp = ("tiny", "gpt-tiny")[trial], (2, 4)[trial]
    cfg = wb.models.get_config(preset, dtype="float32", vocab_size=(76, 75)[trial])
    one = wb.models.build_model(cfg, seed=trial).eval()
    m = wb.serve.serve_model(cfg, tp=tp, state_dict=one.state_dict()).model
    bs = rng.choice([2, 4])
    reqs = _requests(rng, cfg.vocab_size, bs, 4)
    refs = {i: _plain_greedy(one, p, mn) for i, p, mn, _, _ in reqs}
    most = max(-(-(len(p) + mn - 1) // bs) for _, p, mn, _, _ in reqs)
    e = Engine(m, num_blocks=most + 1, block_size=bs, max_batch=3, token_budget=5)
    out = _serve(e, reqs, {i: None for i in refs})
    assert {i: out[i] for i in refs} == refs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_random_block_tables_on_every_backend_equal_sdpa_over_the_gathered_keys(dtype):
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 2e-5}[dtype]
    for trial in range(8):
        rng, g = random.Random(trial), torch.Generator().manual_seed(trial)
        B, hkv, grp = rng.randint(1, 3), rng.choice([1, 2]), rng.choice([1, 2, 4])
        D, bs = rng.choice([4, 8]), rng.choice([1, 3, 4, 16])
        lens = [rng.randint(1, 30) for _ in range(B)]
        sq = rng.randint(1, min(lens))
        width = max(-(-n // bs) for n in lens) + rng.randint(0, 2)
        nb = B * width + rng.randint(0, 3)
        table = torch.randperm(nb, generator=g)[:B * width].reshape(B, width)
        kp = torch.randn(nb, hkv, bs, D, generator=g).to(dtype)
        vp = torch.randn(nb, hkv, bs, D, generator=g).to(dtype)
        q = torch.randn(B, hkv * grp, sq, D, generator=g).to(dtype)
        ref = []
        for b, n in enumerate(lens):
            rows = table[b, :-(-n // bs)]
            k, v = (p[rows].transpose(0, 1).reshape(hkv, -1, D)[:, :n].double()
                    .repeat_interleave(grp, 0)[None] for p in (kp, vp))
            keep = torch.arange(n - sq, n)[:, None] >= torch.arange(n)[None]
            ref.append(F.scaled_dot_product_attention(q[b:b + 1].double(), k, v,
                                                      attn_mask=keep))
        ref = torch.cat(ref)
        t, ln, sc = PA._check(q, kp, vp, table, torch.tensor(lens), None)
        for be in ("reference", "unfused", "native"):
            out = registry._TABLE[(PA._OP, be)](q, kp, vp, t, ln, sc)
            assert out.dtype == dtype and out.shape == q.shape
            assert (out.double() - ref).abs().max().item() <= tol, (trial, be)


def _losses(records):
    return [r["loss"] for r in records]


@pytest.mark.parametrize("a,b", [(None, dict(dp=2, tp=2, zero=3)),
                                 (dict(dp=2, zero=3), dict(tp=2, zero=0)),
                                 (dict(tp=2), dict(dp=2, tp=2, zero=3))])
def test_the_gpts_tied_embedding_resumes_into_zero3_over_tensor_parallel(tmp_path, a, b):
    # was: RuntimeError "a state_dict() value (shape (75, 64)) was written after the model
    # changed" for b = dp2 x tp2 ZeRO-3 (the load's own write of lm_head.weight)
    kw = dict(seed=0, batch_size=8, timing=False)
    want = _losses(train("gpt-tiny", steps=3, strategy=SingleDevice(), **kw))
    first = _losses(train("gpt-tiny", steps=1, strategy=SingleDevice() if a is None
                          else Hybrid(**a), save=str(tmp_path / "ck"), **kw))
    rest = _losses(train("gpt-tiny", steps=3, strategy=Hybrid(**b),
                         resume=str(tmp_path / "ck"), **kw))
    assert len(rest) == 2
    torch.testing.assert_close(torch.tensor(first + rest), torch.tensor(want), rtol=2e-6,
                               atol=0)


def test_a_tied_weights_two_keys_that_differ_load_as_torchs(tmp_path):
    # one parameter, two keys of other values: torch's load_state_dict keeps the later
    # key's (lm_head.weight); so does a load into ZeRO-3 over tensor parallelism
    cfg = wb.models.get_config("gpt-tiny", dtype="float32")
    sd = {k: v.clone() for k, v in wb.models.build_model(cfg, seed=0).state_dict().items()}
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    wb.checkpoint.save(tmp_path, {"model": sd})
    plain = wb.models.build_model(cfg, seed=1)
    plain.load_state_dict(sd)
    model = Hybrid(dp=2, tp=2, zero=3).build_model(cfg, 1)
    wb.checkpoint.load(tmp_path, {"model": model.state_dict()})
    got = {k: (v.full() if isinstance(v, wb.DistTensor) else v) for k, v in
           model.state_dict().items()}
    for k, v in plain.state_dict().items():
        assert torch.equal(got[k], v), k
    assert torch.equal(got["tok_emb.weight"], sd["lm_head.weight"])


def test_torch_dcp_moves_the_gpts_tied_weights_between_zero3_over_tp_layouts(tmp_path):
    import torch.distributed.checkpoint as dcp
    cfg = wb.models.get_config("gpt-tiny", dtype="float32")
    src = wb.models.build_model(cfg, seed=3).state_dict()
    ma = Hybrid(dp=2, tp=2, zero=3).build_model(cfg, 0)
    ma.load_state_dict(src, strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": ma.state_dict()}, checkpoint_id=str(tmp_path))
        mb = Hybrid(tp=2, zero=0).build_model(cfg, 1)
        st = {"model": mb.state_dict()}
        dcp.load(st, checkpoint_id=str(tmp_path))
    got = {k: (v.full() if isinstance(v, wb.DistTensor) else v) for k, v in
           mb.state_dict().items()}
    for k, v in src.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_weights_hold_the_stated_bound_at_every_magnitude(dtype, bits):
    g = torch.Generator().manual_seed(bits)
    for mag in (3e-7, 2e-6, 1e-5, 3e-4, 1e-2, 1.0, 300.0):
        w = (torch.randn(6, 16, generator=g) * mag).to(dtype)
        w[1] = 0                                          # a zero row
        qw = quantize_weight(w, bits, group_size=8)
        if bits == 8:
            q = qw.data.double()
            s = qw.scale.double().expand(6, 16)
        else:
            q = torch.empty(6, 16, dtype=torch.float64)
            q[:, 0::2], q[:, 1::2] = (qw.data & 0xF).double() - 8, (qw.data >> 4).double() - 8
            s = qw.scale.double().repeat_interleave(8, 1)
        assert qw.scale.dtype == dtype and bool((qw.scale > 0).all())
        err = (w.double() - s * q).abs()                  # s q exactly, in float64
        assert bool((err <= s / 2).all()), (mag, (err / s).max().item())
        d = dequantize(qw)                                # ... and as dequantize rounds it
        nonzero = (w != 0).any(1)
        assert not bool(((d == 0).all(1) & nonzero).any()), mag
        assert d.dtype == dtype
