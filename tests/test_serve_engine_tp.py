"""The serving engine on a tensor-parallel model (workbench.serve.engine_tp): every
request's tokens are those of serving it alone with ``generate`` on the same laid-out
model (greedy, and seeded sampling), for the Llama and the GPT in float32 and bfloat16,
tp = 2 and 4, grouped-query attention, with preemption and eos; and those of the
one-device engine (the same steps) wherever the one-device model's own tokens are the
laid-out model's (float32: always; bfloat16: the tensor-parallel sums round otherwise).
Each rank's pool holds its own key/value heads of the one-device pool, and costs 1/tp
of its bytes; the attention adds no communication; the layouts it cannot serve are
refused naming the fix."""
import pytest
import torch

import workbench as wb
from workbench.parallel.placement import Replicate, Shard
from workbench.serve import generate
from workbench.serve.engine import Engine
from workbench.serve.engine_tp import ShardedPagedCache
from workbench.serve.kv_cache import kv_bytes_per_token

BS = 4
LENS = [1, BS - 1, BS, BS + 1, 11, 2]
NEWS = [9, 8, 9, 3, 8, 5]
CASES = [(p, d) for p in ("tiny", "gpt-tiny") for d in ("float32", "bfloat16")]

_MODELS = {}


def models(preset, dtype="float32", tp=2, vocab=76, **over):
    """(one device's model, the same weights laid out tp-way by serve_model).  A vocabulary
    of 76 splits evenly over tp: the head and the logits are vocabulary-sharded
    (Megatron's) and the tokens are picked by the vocabulary-parallel argmax / topk; 75
    does not: the head is replicated."""
    key = (preset, dtype, tp, vocab, tuple(sorted(over.items())))
    if key not in _MODELS:
        cfg = wb.models.get_config(preset, dtype=dtype, vocab_size=vocab, **over)
        one = wb.models.build_model(cfg, seed=0).eval()
        served = wb.serve.serve_model(cfg, tp=tp, state_dict=one.state_dict())
        _MODELS[key] = one, served.model
    return _MODELS[key]


def prompts(seed=0, lens=LENS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 75, (n,), generator=g).tolist() for n in lens]


def alone(m, prompt, n, eos=None, **kw):
    out = generate(m, torch.tensor([prompt]), n, **kw)[0, len(prompt):].tolist()
    return out[:out.index(eos) + 1] if eos is not None and eos in out else out


def serve(m, ps, news, eos=None, arrive=2, kw=lambda i: {}):
    """An engine whose pool of 5 blocks is too small for the requests: admission waits
    and preemption; requests 3.. arrive after ``arrive`` steps; ``kw(i)``: request i's
    sampling arguments.  Returns the engine and request id -> the logits (k, V) each of
    its tokens was chosen from."""
    e = Engine(m, num_blocks=5, block_size=BS, max_batch=3, token_budget=6)
    for i in range(3):
        e.add_request(i, ps[i], news[i], eos_token_id=eos, **kw(i))
    steps, logits = 0, {}
    while e.has_unfinished():
        for o in e.step():
            logits.setdefault(o.request_id, []).append(o.logits)
        steps += 1
        if steps == arrive:
            for i in range(3, len(ps)):
                e.add_request(i, ps[i], news[i], eos_token_id=eos,
                              **kw(i))
    return e, {i: torch.stack(v).float() for i, v in logits.items()}


@pytest.mark.parametrize("preset,dtype", CASES)
def test_tp_engine_tokens_are_generates_and_the_one_device_engines(preset, dtype):
    one, tp = models(preset, dtype)
    ps = prompts()
    ref = [alone(tp, p, n) for p, n in zip(ps, NEWS)]
    eos = ref[4][2]                                 # request 4 stops at its 3rd token (or before)
    ref = [alone(tp, p, n, eos) for p, n in zip(ps, NEWS)]
    assert len(ref[4]) < NEWS[4]
    assert tp.lm_head.weight.placements[1] == Shard(0)       # vocabulary-sharded logits
    with wb.trace() as tr:
        e, logits = serve(tp, ps, NEWS, eos)
    # greedy: one gather of the step's R rows of logits a step, the argmax taken of them
    gathers = [ev for ev in tr.events if ev.name == "all_gather"]
    assert len(gathers) == len(e.log)
    assert isinstance(e.cache, ShardedPagedCache) and e.cache.tp == 2
    assert [e.outputs[i] for i in range(len(ps))] == ref
    assert e.finish_reason[4] == "eos"
    assert any(r.preempted for r in e.log)          # the pool ran out: recompute preemption
    # the one-device engine: the same tokens wherever the one-device MODEL makes the same
    # tokens as the laid-out one under generate.  In float32 that is every request (and the
    # steps are the same); in bfloat16 the row-parallel partial sums round differently
    # (logits ~2e-3 apart), which flips near-ties of generate itself: not the engine's doing.
    e1, logits1 = serve(one, ps, NEWS, eos)
    same = [i for i, (p, n) in enumerate(zip(ps, NEWS)) if alone(one, p, n, eos) == ref[i]]
    assert same == list(range(len(ps))) if dtype == "float32" else same
    for i in same:
        assert e1.outputs[i] == e.outputs[i]
    if len(same) == len(ps):
        assert e1.log == e.log
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=0.1, rtol=0.05)
    for i in same:                                  # and the logits they were chosen from
        assert logits[i].shape == (len(ref[i]), 76)
        torch.testing.assert_close(logits[i], logits1[i], **tol)
    assert e.cache.allocator.num_free == e.num_blocks == 5      # the pool is whole again


@pytest.mark.parametrize("tp_size,vocab,over", [(4, 76, {}), (4, 75, {}), (2, 75, {"n_kv_head": 2}),
                                                (4, 76, {"n_kv_head": 4}), (1, 76, {})])
def test_tp4_and_grouped_query_attention(tp_size, vocab, over):
    one, tp = models("tiny", tp=tp_size, vocab=vocab, **over)
    ps = prompts(1)
    e = serve(tp, ps, NEWS)[0]
    assert e.cache.tp == tp_size
    assert [e.outputs[i] for i in range(len(ps))] == [alone(tp, p, n) for p, n in zip(ps, NEWS)]
    assert serve(one, ps, NEWS)[0].outputs == e.outputs          # float32: the same tokens


@pytest.mark.parametrize("preset", ["tiny", "gpt-tiny"])
def test_seeded_sampling_draws_generates_tokens(preset):
    one, tp = models(preset)
    ps = prompts(2)
    kw = dict(temperature=0.8, top_k=20, top_p=0.95)
    ref = [alone(tp, p, n, generator=torch.Generator().manual_seed(10 + i), **kw)
           for i, (p, n) in enumerate(zip(ps, NEWS))]
    e = serve(tp, ps, NEWS, kw=lambda i: dict(kw, seed=10 + i))[0]
    assert [e.outputs[i] for i in range(len(ps))] == ref
    assert serve(one, ps, NEWS, kw=lambda i: dict(kw, seed=10 + i))[0].outputs == e.outputs


def test_each_rank_pools_its_own_kv_heads_of_the_one_device_pool():
    one, tp = models("tiny", tp=2, n_kv_head=2)
    ps = prompts(3, [5, 3])
    es = []
    for m in (one, tp):
        e = Engine(m, num_blocks=8, block_size=BS)
        for i, p in enumerate(ps):
            e.add_request(i, p, 4)
        e.step()                                     # both prompts prefilled
        e.step()                                     # one decode token each
        es.append(e)
    used = sorted(b for bl in es[1].cache.tables.blocks.values() for b in bl)
    assert used == sorted(b for bl in es[0].cache.tables.blocks.values() for b in bl)
    assert len(used) == 3                           # 6 and 4 tokens in 4-slot blocks
    for layer in range(one.cfg.n_layer):
        for pools, pools1 in ((es[1].cache.k_pools, es[0].cache.k_pools),
                              (es[1].cache.v_pools, es[0].cache.v_pools)):
            p = pools[layer]
            assert tuple(p.placements) == (Replicate(), Shard(1))
            assert p.shape == pools1[layer].shape == (8, 2, BS, one.cfg.head_dim)
            for r in (0, 1):                        # rank r: key/value head r, every block
                loc = p.local(r)
                assert loc.shape == (8, 1, BS, one.cfg.head_dim)
                torch.testing.assert_close(loc[used], pools1[layer][used][:, r:r + 1])


@pytest.mark.parametrize("tp_size,dtype", [(2, "float32"), (4, "bfloat16")])
def test_memory_reports_bytes_per_rank(tp_size, dtype):
    one, tp = models("tiny", dtype, tp=tp_size)
    cfg = one.cfg
    e, e1 = Engine(tp, num_blocks=10, block_size=BS), Engine(one, num_blocks=10, block_size=BS)
    m, m1 = e.memory(), e1.memory()
    assert e.num_blocks == m.num_blocks == 10 and (m.tp, m1.tp) == (tp_size, 1)
    assert m1.bytes_per_block == kv_bytes_per_token(cfg) * BS
    assert m.bytes_per_block * tp_size == m1.bytes_per_block       # 1/tp of the heads each
    held = sum(p.local(r).numel() * p.local(r).element_size()
               for p in e.cache.k_pools + e.cache.v_pools for r in (0,))
    assert m.pool_bytes_per_rank == held == m1.pool_bytes_per_rank // tp_size
    e.add_request("a", [1, 2, 3, 4, 5], 3)
    e.step()                                        # 5 tokens: 2 blocks
    assert e.memory().blocks_in_use == 2
    assert e.memory().used_bytes_per_rank == 2 * m.bytes_per_block
    assert f"tp={tp_size}" in str(e.memory()) and f"tp={tp_size}" in repr(e)


def test_layouts_the_engine_cannot_serve_are_refused():
    served = wb.serve.serve_model("tiny", dp=2, tp=2)
    with pytest.raises(ValueError, match=r"dp.*one Engine per replica.*tp=2"):
        Engine(served.model, 8, BS)
    from workbench.recipes.hybrid import Hybrid          # serve_model refuses this one early
    m = Hybrid(dp=1, tp=4).build_model(wb.models.get_config("tiny", n_kv_head=2), 0)
    with pytest.raises(ValueError, match=r"tp=4 does not divide n_kv_head=2"):
        Engine(m.eval(), 8, BS)
    from workbench.serve.engine_tp import make_cache
    cache = make_cache(models("tiny")[1], 8, BS)           # plain q, k, v into sharded pools
    cache.begin([("a", 2)])
    x = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match=r"q is a plain Tensor.*serve_model"):
        cache.attend(0, x, x, x)


def test_the_sharded_cache_adds_no_communication():
    """Each rank attends its own heads to its own pool: a packed step communicates what
    the laid-out model's forward of the same tokens does without a cache (the all-reduces
    of the row-parallel linears and the embedding), nothing more."""
    from workbench.serve.engine_forward import packed_forward
    from workbench.serve.engine_tp import make_cache
    _, tp = models("tiny")
    segs = [("a", [1, 2, 3, 4, 5]), ("b", [7, 8])]
    cache = make_cache(tp, 8, BS)

    def comms(tr):
        return [(ev.name, ev.bytes) for ev in tr.events if ev.stream != "compute"]

    with wb.trace() as t1, torch.no_grad():
        packed_forward(tp, cache, segs)
    with wb.trace() as t2, torch.no_grad():
        tp(torch.tensor([[1, 2, 3, 4, 5, 7, 8]]),
           position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1]]), logits_to_keep=torch.tensor([4, 6]))
    assert comms(t1) == comms(t2)
    assert [n for n, _ in comms(t1)] == ["all_reduce"] * (1 + 2 * tp.cfg.n_layer)


@pytest.mark.slow
def test_torchrun_engine_gives_the_simulations_tokens(tmp_path_factory):
    """One process per tp rank (gloo): the same tokens, preemptions and bytes per rank as
    the simulated mesh."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "engine_tp_check.py")      # one launch: 2-process checks
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert len(rows) == 1, text
    ps, news = prompts(0, [1, 3, 4, 5, 11, 2]), [9, 8, 9, 3, 8, 5]
    want = {}
    for preset in ("tiny", "gpt-tiny"):
        tp = wb.serve.serve_model(wb.models.get_config(preset, vocab_size=76), tp=2, seed=0).model
        e = Engine(tp, num_blocks=5, block_size=BS, max_batch=3, token_budget=6)
        want[preset] = e.generate_all(ps, news)
        want[preset + "/preempted"] = sum(len(r.preempted) for r in e.log)
        want[preset + "/bytes_per_block"] = e.memory().bytes_per_block
        want[preset + "/sampled"] = [alone(tp, p, n, temperature=0.8, top_k=20, top_p=0.95,
                                           generator=torch.Generator().manual_seed(10 + i))
                                     for i, (p, n) in enumerate(zip(ps, news))]
    assert want["tiny/preempted"] > 0
    assert rows[0] == want
