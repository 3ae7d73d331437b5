"""Adversarial train-to-serve probes (helper serve7): each test pins one defect a probe
found (a silent wrong answer, a silently changed state, or an unclear error), held to
serving a request alone with ``generate`` or to PyTorch's own behaviour."""
import pytest
import torch

from workbench.models.config import build_model, get_config
from workbench.serve import Engine, generate

_MODELS = {}


def model(preset="tiny", **over):
    key = (preset, tuple(sorted(over.items())))
    if key not in _MODELS:
        _MODELS[key] = build_model(get_config(preset, dtype="float32", **over), seed=1).eval()
    return _MODELS[key]


def alone(m, prompt, n, **kw):
    return generate(m, torch.tensor([prompt]), n, **kw)[0, len(prompt):].tolist()


# ---- the engine's requests -------------------------------------------------------------------
def test_generate_all_keeps_an_earlier_requests_results_and_takes_free_ids():
    """generate_all numbered its prompts len(outputs), len(outputs) + 1, ...: after
    add_request(1, ...) had run, its first id was 1, add_request refused it, and the
    roll-back then deleted request 1's own tokens (outputs {} and a finish reason with no
    tokens); it now takes the next ids no request holds."""
    m = model()
    eng = Engine(m, num_blocks=16, block_size=4)
    eng.add_request(1, [5, 7, 9], 3)
    first = eng.run()[1]
    assert first == alone(m, [5, 7, 9], 3)
    outs = eng.generate_all([[3, 4], [8]], 2)
    assert outs == [alone(m, [3, 4], 2), alone(m, [8], 2)]
    assert eng.outputs[1] == first and eng.finish_reason[1] == "length"
    assert sorted(eng.outputs) == [1, 2, 3]
    # a call that fails rolls back only its own requests
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate_all([[3], [4]], [2, 0])
    assert sorted(eng.outputs) == [1, 2, 3] and eng.outputs[1] == first
    assert not eng.has_unfinished()



@pytest.mark.parametrize("seeded", [True, False], ids=["own_seed", "global_rng"])
def test_a_failed_draw_leaves_every_request_with_the_keys_its_cache_holds(seeded):
    """A step samples request by request after the forward: a draw that raised (a
    temperature of 1e-45 makes logits / T overflow, torch.multinomial refuses the nan
    probabilities) left the requests after it in the loop one chunk behind the cache,
    which had stored their keys; once the bad request was aborted, the next step fed the
    prompt again, duplicated in the cache (logits 0.037 off the recomputed ones).  The
    step now draws every token first, and a failure gives the cache's slots and the
    generators back."""
    m = model()
    prompt = [15, 27, 9, 44, 61]
    kw = dict(temperature=0.9, top_k=20)
    eng = Engine(m, num_blocks=16, block_size=4)
    eng.add_request("early", [8, 1], 4, seed=3 if seeded else None, **kw)
    eng.step()                                           # "early" has its first token
    eng.add_request("bad", [3, 4], 5, temperature=1e-45)
    eng.add_request("ok", prompt, 6)
    torch.manual_seed(11)
    with pytest.raises(RuntimeError, match="probability tensor"):
        eng.step()
    assert eng.cache.tables.lengths == {"early": 2}     # "bad", "ok": no slot kept
    eng.abort_request("bad")
    torch.manual_seed(11)                               # the draws the failed step would take
    logits = {}
    while eng.has_unfinished():
        for o in eng.step():
            logits.setdefault(o.request_id, []).append(o.logits)
    seq = prompt + eng.outputs["ok"]
    with torch.no_grad():
        ref, _ = m(torch.tensor([seq]))
    torch.testing.assert_close(torch.stack(logits["ok"]), ref[0, len(prompt) - 1:-1],
                               atol=1e-5, rtol=0)
    assert eng.outputs["ok"] == alone(m, prompt, 6)
    if seeded:                                          # its generator as if nothing failed
        assert eng.outputs["early"] == alone(m, [8, 1], 4, generator=torch.Generator()
                                             .manual_seed(3), **kw)
    assert eng.cache.allocator.num_used == 0


def test_freed_blocks_poisoned_with_nan_serve_the_next_requests_exactly():
    """Fill, free, reuse: after every step each free block of every pool is set to nan, so
    a read of any slot no live token wrote (a stale key of a finished or preempted request,
    a padded table entry, the tail of a last block) would turn the logits nan.  Each
    request still gets its tokens alone (a pool of 7 blocks of 2: preemption included)."""
    m = model("tiny", n_kv_head=2)
    prompts = [[5, 7, 9], [1, 2, 3, 4, 5, 6, 7, 8], [11], [4, 4, 4, 4, 4, 4], [9, 8]]
    news = [6, 4, 7, 5, 3]
    eng = Engine(m, num_blocks=7, block_size=2, max_batch=3, token_budget=5)
    for i, (p, n) in enumerate(zip(prompts, news)):
        eng.add_request(i, p, n)
    preempted = 0
    while eng.has_unfinished():
        eng.step()
        preempted += len(eng.log[-1].preempted)
        used = {b for bl in eng.cache.tables.blocks.values() for b in bl}
        free = [b for b in range(eng.num_blocks) if b not in used]
        for pool in eng.cache.k_pools + eng.cache.v_pools:
            pool[free] = float("nan")
    assert preempted > 0
    assert [eng.outputs[i] for i in range(5)] == [alone(m, p, n) for p, n in zip(prompts, news)]

# ---- a checkpoint's model config -------------------------------------------------------------
@pytest.fixture(scope="module")
def topk1(tmp_path_factory):
    """One step of a mixture of experts routing each token to 1 expert, saved."""
    from workbench.train import train
    path = str(tmp_path_factory.mktemp("topk1") / "ckpt")
    train("tiny", steps=1, seed=0, timing=False, save=path, moe_experts=4, moe_topk=1)
    return path


def test_serving_a_checkpoint_with_another_routing_is_refused(topk1):
    """`train --moe-experts 4 --moe-topk 1 --save DIR`, then `serve --checkpoint DIR
    --moe-experts 4` (topk left at 2): the weights' shapes are the same, so the load passed
    and the text came from another function of the weights ('The foxe the thee e e' for
    'The foxe the e e e e'), silently.  The checkpoint now records the config fields its
    shapes do not show; serving with others names the field and the flag."""
    from workbench.serve.cli import load_served
    for over, flag in ((dict(), "--moe-topk 1"), (dict(moe_topk=1, moe_gating="sigmoid"),
                                                   "--moe-gating softmax")):
        with pytest.raises(ValueError, match=flag):
            load_served(get_config("tiny", moe_experts=4, **over), topk1)
    served = load_served(get_config("tiny", moe_experts=4, moe_topk=1), topk1)
    one = build_model(get_config("tiny", moe_experts=4, moe_topk=1), seed=5).eval()
    sd = one.state_dict()
    from workbench import checkpoint
    checkpoint.load(topk1, {"model": sd})
    one.load_state_dict(sd)
    idx = torch.tensor([[5, 7, 9]])
    assert torch.equal(generate(served.model, idx, 6), generate(one, idx, 6))


def test_resuming_with_another_routing_or_heads_is_refused(topk1, tmp_path, capsys):
    """A resume with --moe-topk 2 trained on from the top-1 run's weights and moments with
    top-2 routing (loss 3.91025 for 3.91043 uninterrupted), silently; likewise a dense
    model saved with another RoPE base (no weight shows it)."""
    from workbench.cli import main
    from workbench.train import train
    with pytest.raises(ValueError, match="moe_topk=1"):
        train("tiny", steps=2, seed=0, timing=False, resume=topk1, moe_experts=4)
    assert main(["train", "--moe-experts", "4", "--steps", "2", "--resume", topk1]) == 2
    assert "--moe-topk 1" in capsys.readouterr().err
    path = str(tmp_path / "theta")
    train("tiny", steps=1, seed=0, timing=False, save=path, rope_theta=5e5)
    with pytest.raises(ValueError, match="rope_theta=500000.0"):
        train("tiny", steps=2, seed=0, timing=False, resume=path)
    assert len(train("tiny", steps=2, seed=0, timing=False, resume=path, rope_theta=5e5)) == 1
    from workbench.serve.cli import load_served
    with pytest.raises(ValueError, match="rope_theta=500000.0"):
        load_served("tiny", path)
