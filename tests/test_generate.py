"""Generation with a KV cache (workbench.serve): the cache gives the full recompute's
logits and tokens, token by token; sampling is seeded and follows Hugging Face's
top-k / top-p semantics; every layout (tp 2, dp 2 x tp 2, torchrun) picks one
device's tokens, the vocabulary-sharded argmax gathering 2 numbers per row and rank."""
import json
import math

import pytest
import torch
from hypothesis import given, strategies as st

import workbench as wb
from workbench.serve import (KVCache, SamplingParams, causal_offset_mask, filter_logits,
                             generate, kv_bytes_per_token, sample_next, serve_model)

PRESETS = ["tiny", "gpt-tiny"]
# vocabulary 76: divisible by tp = 2, so the head is column-parallel (vocab-sharded logits)
CFG76 = {p: wb.models.get_config(p, vocab_size=76) for p in PRESETS}
PROMPT = torch.randint(0, 75, (2, 5), generator=torch.Generator().manual_seed(1))


def seeded(s=3):
    return torch.Generator().manual_seed(s)


@pytest.fixture(scope="module")
def models():
    return {p: wb.models.build_model(CFG76[p], seed=0).eval() for p in PRESETS}


@pytest.mark.parametrize("preset", PRESETS)
def test_cached_decode_gives_the_full_recomputes_logits_token_by_token(models, preset):
    m = models[preset]
    out = generate(m, PROMPT, 12, use_cache=False)       # the textbook loop
    cache = KVCache.for_model(m)
    with torch.no_grad():
        logits, _ = m(PROMPT, cache=cache)                                 # prefill
        for t in range(PROMPT.shape[1], out.shape[1]):
            full, _ = m(out[:, :t])                                         # recompute all
            torch.testing.assert_close(logits[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)
            assert torch.equal(logits[:, -1].argmax(-1), out[:, t])       # the same token
            logits, _ = m(out[:, t:t + 1], cache=cache)                   # decode one
    assert cache.get_seq_length() == out.shape[1]
    assert torch.equal(generate(m, PROMPT, 12), out)


@pytest.mark.parametrize("preset", PRESETS)
def test_chunked_prefill_is_causal_within_the_chunk(models, preset):
    m = models[preset]
    x = torch.randint(0, 75, (2, 9), generator=seeded(5))
    cache = KVCache.for_model(m)
    with torch.no_grad():
        full, _ = m(x)
        a, _ = m(x[:, :4], cache=cache)
        b, _ = m(x[:, 4:], cache=cache)                 # 5 queries after 4 cached tokens
    torch.testing.assert_close(torch.cat((a, b), 1), full, rtol=1e-5, atol=1e-5)
    assert causal_offset_mask(2, 4).tolist() == [[True, True, True, False], [True] * 4]


def test_cache_bytes_and_errors(models):
    m = models["tiny"]
    cfg = m.cfg
    cache = KVCache.for_model(m)
    with torch.no_grad():
        m(PROMPT, cache=cache)
    per_token = kv_bytes_per_token(cfg)
    assert per_token == 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4
    assert cache.nbytes() == PROMPT.numel() * per_token                   # counted == formula
    with pytest.raises(ValueError, match="seq_len=64"):
        generate(m, PROMPT, 60)
    with pytest.raises(ValueError, match="batch and heads"):
        with torch.no_grad():
            m(PROMPT[:1, :1], cache=cache)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(m, PROMPT, -1)
    assert torch.equal(generate(m, PROMPT, 0), PROMPT)
    assert m.training is False


def test_sampling_is_seeded_and_reproducible(models):
    m = models["tiny"]
    kw = dict(temperature=1.0, top_k=20, top_p=0.95)
    a = generate(m, PROMPT, 10, generator=seeded(0), **kw)
    assert torch.equal(a, generate(m, PROMPT, 10, generator=seeded(0), **kw))
    assert not torch.equal(a, generate(m, PROMPT, 10, generator=seeded(1), **kw))
    # the cache changes nothing: the same draws from the same generator
    assert torch.equal(a, generate(m, PROMPT, 10, generator=seeded(0), use_cache=False, **kw))


def _reference_filter(row, temperature, top_k, top_p):
    """One row, written independently: Hugging Face's warpers in plain Python."""
    x = [v / temperature for v in row.tolist()]
    keep = set(range(len(x)))
    if top_k is not None:
        kth = sorted(x, reverse=True)[min(top_k, len(x)) - 1]
        keep = {i for i in keep if x[i] >= kth}
    if top_p is not None:
        live = sorted(keep, key=lambda i: -x[i])
        mx = max(x[i] for i in live)
        z = sum(math.exp(x[i] - mx) for i in live)
        mass, kept = 0.0, set()
        for i in live:
            if mass < top_p:
                kept.add(i)
            mass += math.exp(x[i] - mx) / z
        keep = kept
    return [i in keep for i in range(len(x))]


@given(seed=st.integers(0, 2**16), top_k=st.one_of(st.none(), st.integers(1, 12)),
       top_p=st.one_of(st.none(), st.floats(0.05, 1.0)), temperature=st.floats(0.3, 2.0))
def test_top_k_and_top_p_keep_what_the_reference_keeps(seed, top_k, top_p, temperature):
    logits = torch.randn(3, 10, generator=seeded(seed), dtype=torch.float64).float() * 2
    got = filter_logits(logits, SamplingParams(temperature, top_k, top_p))
    for r in range(3):
        want = _reference_filter(logits[r].double(), temperature, top_k, top_p)
        assert (got[r] > float("-inf")).tolist() == want
        kept = got[r][got[r] > float("-inf")]
        torch.testing.assert_close(kept, (logits[r] / temperature)[torch.tensor(want)])


def test_sampling_draws_only_kept_tokens_with_their_probabilities():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).expand(4000, 4)
    tok = sample_next(logits, SamplingParams(1.0, top_k=2), seeded(0))
    assert set(tok.tolist()) == {2, 3}
    share = (tok == 3).float().mean().item()
    assert abs(share - math.e / (1 + math.e)) < 0.03      # e^3 / (e^2 + e^3), 4000 draws
    assert torch.equal(sample_next(logits[:2], SamplingParams()), torch.tensor([3, 3]))


def test_bad_sampling_parameters_are_named():
    for kw, msg in ((dict(temperature=-1), "temperature"), (dict(temperature=1, top_k=0), "top_k"),
                    (dict(temperature=1, top_p=1.5), "top_p"), (dict(top_k=5), "greedy")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp=2, tp=2)])
def test_every_layout_gives_one_devices_tokens(models, preset, layout):
    ref_greedy = generate(models[preset], PROMPT, 6)
    kw = dict(temperature=0.9, top_k=30, top_p=0.9)
    ref_sampled = generate(models[preset], PROMPT, 6, generator=seeded(7), **kw)
    s = serve_model(CFG76[preset], seed=0, **layout)
    assert s.model.lm_head.weight.placements[1] == wb.Shard(0)        # vocab-sharded head
    with wb.trace() as tr:
        out = generate(s.model, s.place(PROMPT), 6)
    assert torch.equal(out.full(), ref_greedy)
    # the argmax over sharded logits gathers (value, index) pairs, never the logits
    gathers = [e for e in tr.events if e.name == "all_gather"]
    # (the gathered buffer: B / dp rows x 2 ranks x 8-byte indices; the logits: x 76 x 4)
    rows = PROMPT.shape[0] // layout.get("dp", 1)
    assert gathers and max(e.args["buffer_bytes"] for e in gathers) == rows * 2 * 8
    out = generate(s.model, s.place(PROMPT), 6, generator=seeded(7), **kw)
    assert torch.equal(out.full(), ref_sampled)
    # the cache's keys and values are sharded like the heads that made them
    cache = KVCache.for_model(s.model)
    with torch.no_grad():
        s.model(s.place(PROMPT), cache=cache)
    dp_place = wb.Shard(0) if layout.get("dp", 1) > 1 else wb.Replicate()
    assert tuple(cache.keys[0].placements) == (dp_place, wb.Shard(1))


@pytest.mark.slow
def test_torchrun_gives_one_devices_tokens(models, tmp_path_factory):
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "generate_check.py")      # one launch: 2-process checks
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert len(rows) == 1, text
    want = {p: generate(models[p], PROMPT, 6).tolist() for p in PRESETS}
    want_s = generate(models["tiny"], PROMPT, 6, generator=seeded(7), temperature=0.9,
                      top_k=30, top_p=0.9).tolist()
    assert rows[0] == {"greedy": want, "sampled": want_s}


def test_grouped_query_heads_cache_and_shard_like_the_others():
    cfg = wb.models.get_config("tiny", n_kv_head=2, vocab_size=76)      # 2 query heads per kv
    m = wb.models.build_model(cfg).eval()
    ref = generate(m, PROMPT, 8, use_cache=False)
    assert torch.equal(generate(m, PROMPT, 8), ref)
    s = serve_model(cfg, tp=2)                                          # one kv head per rank
    assert torch.equal(generate(s.model, s.place(PROMPT), 8).full(), ref)
