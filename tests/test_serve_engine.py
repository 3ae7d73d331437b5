"""The continuous-batching engine (workbench.serve.engine): every request's tokens are
those of serving it alone with ``generate``, whatever shares its steps (prompt lengths
around the block size, eos, arrivals mid-run, more requests than the batch, a pool too
small for all: admission waits and recompute preemption, chunked prefill), for the
Llama and the GPT in float32 and bfloat16; the pool is whole again at the end."""
import numpy as np
import pytest
import torch

import workbench as wb
from workbench.serve import generate
from workbench.serve.batching import Request, StepPricer, continuous, latency_table
from workbench.serve.engine import Engine, StepRecord

BS = 4                                              # block size
LENS = [1, BS - 1, BS, BS + 1, 11, 2, 7, 5]         # prompt lengths
NEWS = [1, 6, 9, 3, 12, 5, 8, 7]                    # max_new_tokens
CASES = [(p, d) for p in ("tiny", "gpt-tiny") for d in ("float32", "bfloat16")]


def seeded(s):
    return torch.Generator().manual_seed(s)


_MODELS = {}


def model(preset, dtype="float32", **over):
    key = (preset, dtype, tuple(sorted(over.items())))
    if key not in _MODELS:
        cfg = wb.models.get_config(preset, dtype=dtype, **over)
        _MODELS[key] = wb.models.build_model(cfg, seed=0).eval()
    return _MODELS[key]


def prompts(seed=0):
    g = seeded(seed)
    return [torch.randint(0, 75, (n,), generator=g).tolist() for n in LENS]


def alone(m, prompt, n, eos=None, **kw):
    """generate's tokens for one request, cut after its first eos."""
    out = generate(m, torch.tensor([prompt]), n, **kw)[0, len(prompt):].tolist()
    return out[:out.index(eos) + 1] if eos is not None and eos in out else out


def full_logits(m, prompt, out):
    """The logits each of ``out``'s tokens was chosen from, by one full forward."""
    with torch.no_grad():
        logits, _ = m(torch.tensor([prompt + out[:-1]]))
    return logits[0, len(prompt) - 1:].float()                              # (len(out), V)


@pytest.mark.parametrize("preset,dtype", CASES)
def test_each_request_gets_the_tokens_it_gets_alone(preset, dtype):
    m, ps = model(preset, dtype), prompts()
    ref = [alone(m, p, n) for p, n in zip(ps, NEWS)]
    eos = ref[4][3]                                 # request 4 stops at its 4th token (or before)
    ref_eos = [alone(m, p, n, eos if i == 4 else None) for i, (p, n) in enumerate(zip(ps, NEWS))]
    assert len(ref_eos[4]) < NEWS[4]
    # a pool of 6 blocks (24 tokens) for 8 requests of up to 22: admission waits, preemption
    e = Engine(m, num_blocks=6, block_size=BS, max_batch=3, token_budget=6)
    for i in range(5):
        e.add_request(i, ps[i], NEWS[i], eos_token_id=eos if i == 4 else None)
    logits = {i: [] for i in range(len(ps))}
    steps = 0
    while e.has_unfinished():
        for o in e.step():
            logits[o.request_id].append(o.logits)
            done = len(e.outputs[o.request_id]) == NEWS[o.request_id] or \
                (o.request_id == 4 and o.token == eos)
            assert o.finished == done
        steps += 1
        if steps == 3:                                  # arrivals while others run
            for i in range(5, len(ps)):
                e.add_request(i, ps[i], NEWS[i])
    for i in range(len(ps)):
        assert e.outputs[i] == ref_eos[i], (i, e.outputs[i], ref_eos[i])
        # the logits each token was chosen from: those of one full forward over its context
        got = torch.stack(logits[i]).float()
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == "float32" else dict(rtol=0.02, atol=0.02)
        torch.testing.assert_close(got, full_logits(m, ps[i], e.outputs[i]), **tol)
    assert e.finish_reason[4] == "eos" and e.finish_reason[0] == "length"
    log = e.log
    assert any(r.preempted for r in log), "the pool is small enough to preempt"
    for k, r in enumerate(log):             # a preempted request is the next one admitted
        if r.preempted:
            nxt = next(q.admitted for q in log[k + 1:] if q.admitted)
            assert nxt[0] == r.preempted[-1]
    assert max(r.running for r in log) <= 3 and max(r.tokens for r in log) <= 6
    assert all(r.blocks_in_use <= 6 for r in log)
    assert any(r.prefill and r.decode for r in log), "a step mixing prefill and decode"
    assert any(n < len(ps[i]) for r in log for i, c, n in r.prefill if c == 0), "chunked"
    assert e.cache.allocator.num_used == 0 and not e.cache.tables.blocks   # the pool is whole
    assert log[-1].running == log[-1].waiting == 0


@pytest.mark.parametrize("preset", ["tiny", "gpt-tiny"])
def test_whole_prompts_and_a_roomy_pool_run_everyone_at_once(preset):
    m, ps = model(preset), prompts(1)
    e = Engine(m, num_blocks=64, block_size=BS, max_batch=16)      # token_budget None
    out = e.generate_all(ps, NEWS)
    assert out == [alone(m, p, n) for p, n in zip(ps, NEWS)]
    first = e.log[0]
    assert [i for i, _, _ in first.prefill] == list(range(len(ps)))  # one forward, all prompts
    assert first.tokens == sum(LENS) and not first.decode
    assert [c for _, c, _ in first.prefill] == [0] * len(ps)
    assert not any(r.preempted for r in e.log)
    # decode steps: each request's context before its token, one token each
    second = e.log[1]
    assert second.decode == tuple((i, LENS[i]) for i in range(len(ps)) if NEWS[i] > 1)
    assert e.cache.allocator.num_used == 0


def test_recompute_preemption_of_the_newest_and_first_come_first_served():
    m = model("tiny")
    e = Engine(m, num_blocks=4, block_size=4, max_batch=2)
    reqs = {"A": ([1, 2, 3, 4], 9), "B": ([5, 6, 7], 6), "C": ([8, 9, 10, 11], 1)}
    for k, (p, n) in reqs.items():
        e.add_request(k, p, n)
    out = e.run()
    assert out == {k: alone(m, p, n) for k, (p, n) in reqs.items()}
    log = e.log
    assert log[0].admitted == ("A", "B") and log[0].waiting == 1        # C: no batch slot
    # A (8 tokens, 2 blocks) and B (7 tokens, 2 blocks) fill the pool; A's 9th token needs
    # a block: B, the newest, is preempted (its blocks freed), A goes on alone
    assert [r.blocks_in_use for r in log[:5]] == [2, 3, 4, 4, 4]
    assert log[5].preempted == ("B",) and log[5].decode == (("A", 8),)
    # C would fit the free block, but B is first in the queue and needs 2: C waits too
    assert all(not r.admitted for r in log[5:9]) and log[8].finished == ("A",)
    # B is recomputed from its prompt and the 5 tokens it had made, then C
    assert log[9].admitted == ("B", "C") and log[9].prefill == (("B", 0, 8), ("C", 0, 4))
    assert e.cache.allocator.num_used == 0


def test_admission_waits_for_blocks():
    m, ps = model("tiny"), prompts(2)
    # 6 blocks: request 4 (11 + 12 tokens) alone needs all 6, so it runs by itself
    e = Engine(m, num_blocks=6, block_size=BS, max_batch=8)
    out = e.generate_all(ps, NEWS)
    assert out == [alone(m, p, n) for p, n in zip(ps, NEWS)]
    assert any(r.waiting for r in e.log)
    assert e.cache.allocator.num_used == 0


@pytest.mark.parametrize("preset,dtype", CASES)
def test_seeded_sampling_draws_what_generate_draws(preset, dtype):
    m, ps = model(preset, dtype), prompts(3)
    kw = [dict(temperature=0.8, top_k=20, top_p=0.9, seed=i) if i % 3 else {}
          for i in range(len(ps))]
    e = Engine(m, num_blocks=10, block_size=BS, max_batch=4, token_budget=8)
    for i, (p, n) in enumerate(zip(ps, NEWS)):
        e.add_request(i, p, n, **kw[i])
    e.run()
    for i, (p, n) in enumerate(zip(ps, NEWS)):
        gen = {} if not kw[i] else dict(temperature=0.8, top_k=20, top_p=0.9,
                                         generator=seeded(kw[i]["seed"]))
        assert e.outputs[i] == alone(m, p, n, **gen), i
    assert any(r.preempted for r in e.log)          # recomputed requests keep their draws
    assert e.cache.allocator.num_used == 0


def test_grouped_query_heads_read_their_shared_pages():
    m = model("tiny", n_kv_head=2)              # 4 query heads on 2 key/value heads
    ps = prompts(6)
    e = Engine(m, num_blocks=7, block_size=BS, max_batch=4, token_budget=8)
    assert e.cache.k_pools[0].shape == (7, 2, BS, 16)
    assert e.generate_all(ps, NEWS) == [alone(m, p, n) for p, n in zip(ps, NEWS)]


def test_a_model_in_training_mode_is_served_in_eval_and_left_as_it_was():
    m = model("tiny", dropout=0.5)
    ps = prompts(7)[:3]
    ref = [alone(m, p, 4) for p in ps]                  # generate evaluates too
    m.train()
    try:
        assert Engine(m, num_blocks=16, block_size=BS).generate_all(ps, 4) == ref
        assert m.training
    finally:
        m.eval()


def test_a_dropless_mixture_of_experts_is_served():
    m = model("tiny", moe_experts=4, moe_topk=2)
    ps = prompts(4)[:4]
    out = Engine(m, num_blocks=16, block_size=BS, max_batch=4).generate_all(ps, 5)
    assert out == [alone(m, p, 5) for p in ps]


def test_step_outputs_and_the_log_as_data():
    m = model("tiny")
    e = Engine(m, num_blocks=16, block_size=BS, max_batch=2)
    assert e.step() == [] and e.log == []               # nothing to do
    e.add_request("a", [1, 2, 3], 2)
    e.add_request("b", torch.tensor([4]), 1)          # a tensor of ids, as a list's
    first = e.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in first] == \
        [("a", False, None), ("b", True, "length")]
    assert first[0].logits.shape == (75,)
    rec = e.log[0]
    assert isinstance(rec, StepRecord)
    assert rec.prefill == (("a", 0, 3), ("b", 0, 1)) and rec.admitted == ("a", "b")
    assert rec.finished == ("b",) and rec.blocks_in_use == 1 and rec.tokens == 4
    (o,) = e.step()
    assert o.finished and e.log[1].decode == (("a", 3),) and e.log[1].blocks_in_use == 0
    # on the modeled clock: each step priced by batching's StepPricer
    pricer = StepPricer(m.cfg, "ascend-910b")
    tl = e.timeline(pricer)
    assert [s.prefill_tokens for s in tl] == [4, 0] and [s.decode_tokens for s in tl] == [0, 1]
    assert tl[0].seconds == pricer.seconds(prefill=[(0, 3), (0, 1)])
    assert tl[1].start == tl[0].seconds and tl[1].seconds == pricer.seconds(decode=[3])
    # as batching's schedulers report: b's first (and last) token at the end of step 0
    res = e.result(pricer)
    assert [(r.id, r.arrival, r.prompt, r.output) for r in res.requests] == \
        [("a", 0.0, 3, 2), ("b", 0.0, 1, 1)]
    assert res.first_token == {"a": tl[0].seconds, "b": tl[0].seconds}
    assert res.finish == {"a": tl[1].start + tl[1].seconds, "b": tl[0].seconds}
    assert res.throughput == 3 / res.finish["a"] and "engine" in latency_table([res])
    e.add_request("c", [5], 3)                          # arrives after step 1
    e.run()
    c = next(r for r in e.result(pricer).requests if r.id == "c")
    assert c.arrival == tl[1].start + tl[1].seconds


def test_with_a_roomy_pool_the_engine_runs_the_modeled_schedulers_steps():
    # batching.continuous schedules Request objects on the modeled clock; the engine,
    # generating, makes the same steps: which requests, prefill and decode tokens each
    m, ps = model("tiny"), prompts(8)
    e = Engine(m, num_blocks=64, block_size=BS, max_batch=4, token_budget=8)
    e.generate_all(ps, NEWS)
    pricer = StepPricer(m.cfg, "a100")
    modeled = continuous([Request(i, 0.0, len(p), n) for i, (p, n) in enumerate(zip(ps, NEWS))],
                         pricer, max_batch=4, token_budget=8)
    assert [(s.prefill_tokens, s.decode_tokens, s.requests) for s in e.timeline(pricer)] == \
        [(s.prefill_tokens, s.decode_tokens, s.requests) for s in modeled.steps]


def test_an_aborted_request_frees_its_blocks_and_the_rest_go_on():
    m, ps = model("gpt-tiny"), prompts(9)
    e = Engine(m, num_blocks=16, block_size=BS, max_batch=2)
    for i in range(4):
        e.add_request(i, ps[i], NEWS[i] + 3)
    e.step()
    e.step()
    held = len(e.cache.tables.blocks[1])
    used = e.cache.allocator.num_used
    e.abort_request(1)                                  # running
    e.abort_request(3)                                  # waiting
    assert e.cache.allocator.num_used == used - held and 1 not in e.cache.tables.blocks
    assert e.finish_reason[1] == e.finish_reason[3] == "abort" and len(e.outputs[1]) == 2
    with pytest.raises(KeyError, match="finished: True"):
        e.abort_request(1)
    out = e.run()
    for i in (0, 2):
        assert out[i] == alone(m, ps[i], NEWS[i] + 3)
    assert out[1] == alone(m, ps[1], NEWS[1] + 3)[:2] and out[3] == []
    assert e.cache.allocator.num_used == 0


def test_a_failed_forward_changes_no_table_and_the_engine_goes_on():
    m, ps = model("tiny"), prompts(5)
    e = Engine(m, num_blocks=12, block_size=BS, max_batch=4)
    for i in range(4):
        e.add_request(i, ps[i], NEWS[i])
    e.step()
    before = ({k: list(v) for k, v in e.cache.tables.blocks.items()},
              dict(e.cache.tables.lengths), e.cache.allocator.num_used)
    block = m.layers[1]

    def boom(*a, **k):
        raise RuntimeError("boom")
    block.forward = boom
    try:
        with pytest.raises(RuntimeError, match="boom"):
            e.step()
    finally:
        del block.forward
    assert ({k: list(v) for k, v in e.cache.tables.blocks.items()},
            dict(e.cache.tables.lengths), e.cache.allocator.num_used) == before
    e.run()
    assert [e.outputs[i] for i in range(4)] == [alone(m, ps[i], NEWS[i]) for i in range(4)]


def test_bad_requests_are_named():
    m = model("tiny")
    e = Engine(m, num_blocks=8, block_size=BS)
    with pytest.raises(ValueError, match="empty"):
        e.add_request(0, [], 3)
    with pytest.raises(ValueError, match="seq_len=64"):
        e.add_request(0, [1] * 60, 5)
    with pytest.raises(TypeError, match="2.0"):
        e.add_request(0, [1, 2.0], 3)
    with pytest.raises(TypeError, match="True"):
        e.add_request(0, [True], 3)
    with pytest.raises(TypeError, match="float32"):
        e.add_request(0, torch.tensor([1.0, 2.0]), 3)
    with pytest.raises(ValueError, match="75"):
        e.add_request(0, [75], 3)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        e.add_request(0, [1], 0)
    with pytest.raises(ValueError, match="eos_token_id=-1"):
        e.add_request(0, [1], 2, eos_token_id=-1)
    with pytest.raises(ValueError, match="temperature"):
        e.add_request(0, [1], 2, temperature=-1.0)
    with pytest.raises(ValueError, match="num_blocks"):      # 40 tokens: 10 blocks > 8
        e.add_request(0, [1] * 30, 11)
    with pytest.raises(ValueError, match="empty"):           # the third prompt is bad:
        e.generate_all([[1], [2], []], 2)                     # none of them is queued
    with pytest.raises(ValueError, match="2 max_new_tokens for 1"):
        e.generate_all([[1]], [2, 3])
    assert not e.has_unfinished() and e.outputs == {}        # nothing was queued
    e.add_request(0, np.array([1, 2]), 2)                    # numpy's ints are ints
    assert e.waiting[0].prompt == [1, 2] and type(e.waiting[0].prompt[0]) is int
    with pytest.raises(ValueError, match="request_id=0"):
        e.add_request(0, [2], 2)
    with pytest.raises(ValueError, match="token_budget=2"):
        Engine(m, num_blocks=8, block_size=BS, max_batch=4, token_budget=2)
    with pytest.raises(ValueError, match="block_size=0"):
        Engine(m, num_blocks=8, block_size=0)
    with pytest.raises(ValueError, match="moe_capacity_factor=1.25"):
        Engine(model("tiny", moe_experts=4, moe_capacity_factor=1.25), 8, BS)
    with pytest.raises(TypeError, match="not a workbench"):
        Engine(torch.nn.Linear(2, 2), 8, BS)
    with pytest.raises(TypeError, match=r"no single offset.*position_ids"):
        m(torch.tensor([[1]]), cache=e.cache)
