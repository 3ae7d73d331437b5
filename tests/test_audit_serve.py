"""Audit of train-to-serve as a PyTorch user would write it: each test pins one defect found
by a probe (a silent wrong answer, a silent no-op, or an unclear error) against one
device's answer or PyTorch's own behaviour."""
import json

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.cli import main
from workbench.models.config import build_model, get_config
from workbench.ops.kv_blocks import BlockAllocator
from workbench.serve import KVCache, PagedKVCache, generate
from workbench.serve.batching import StepPricer, continuous, static
from workbench.serve.quantize import (QuantizedLinear, dequantize, quantize_model,
                                      quantize_weight)
from workbench.serve.requests import Request, read_trace


def prompt(B, S, seed=0):
    return torch.randint(0, 75, (B, S), generator=torch.Generator().manual_seed(seed))


def no_cache_greedy(model, idx, n):
    """The textbook loop: the whole prefix recomputed for every token."""
    out = idx
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(out)
            out = torch.cat((out, logits[:, -1].argmax(-1, keepdim=True)), 1)
    return out


@pytest.fixture(scope="module")
def tiny():
    return build_model(get_config("tiny"), seed=1).eval()


# ---- paged cache ---------------------------------------------------------------------------

def test_a_freed_paged_cache_serves_the_next_batch_with_its_blocks(tiny):
    """free() used to leave the cache reporting its old length (generate refused it: 'holds
    10 tokens'); it now resets, and the blocks go to the next request."""
    idx, idx2 = prompt(2, 5), prompt(2, 7, seed=1)
    cache = PagedKVCache.for_model(tiny, batch=2, num_blocks=6, block_size=4)
    first = generate(tiny, idx, 6, cache=cache)
    assert cache.allocator.num_free == 0
    cache.free()
    assert cache.get_seq_length() == 0 and cache.allocator.num_free == 6
    second = generate(tiny, idx2, 5, cache=cache)              # 12 tokens: 3 blocks each
    assert torch.equal(first, no_cache_greedy(tiny, idx, 6))
    assert torch.equal(second, no_cache_greedy(tiny, idx2, 5))


def test_blocks_a_finished_request_frees_go_to_another_cache_on_the_pool(tiny):
    alloc = BlockAllocator(6)
    idx = prompt(2, 5)
    a = PagedKVCache(tiny.cfg, 2, 6, 4, allocator=alloc)
    want = generate(tiny, idx, 6, cache=a)
    b = PagedKVCache(tiny.cfg, 2, 6, 4, allocator=alloc)
    with pytest.raises(wb.ops.kv_blocks.OutOfBlocks, match="more num_blocks"):
        generate(tiny, idx, 6, cache=b)
    a.free()
    assert torch.equal(generate(tiny, idx, 6, cache=b), want)


def test_a_paged_cache_for_a_deeper_model_raises_instead_of_wrong_positions(tiny):
    """A 4-layer cache on a 2-layer model never committed its length: every step ran at
    position 0 (RoPE), silently; the dense cache gets it right, the paged one now raises."""
    deeper = get_config("tiny").replace(n_layer=4)
    cache = PagedKVCache(deeper, batch=1, num_blocks=16, block_size=4)
    with pytest.raises(RuntimeError, match="previous step stopped before layer 3"):
        generate(tiny, prompt(1, 5), 4, cache=cache)
    dense = KVCache(4, tiny.cfg.seq_len)
    assert torch.equal(generate(tiny, prompt(1, 5), 4, cache=dense),
                       no_cache_greedy(tiny, prompt(1, 5), 4))


@pytest.mark.parametrize("S, bs", [(3, 4), (4, 4), (5, 4), (7, 3), (1, 1)])
def test_paged_equals_contiguous_across_block_boundaries(tiny, S, bs):
    idx = prompt(2, S, seed=S)
    cache = PagedKVCache.for_model(tiny, batch=2, num_blocks=64, block_size=bs)
    assert torch.equal(generate(tiny, idx, 9, cache=cache), no_cache_greedy(tiny, idx, 9))


# ---- quantization --------------------------------------------------------------------------

def test_a_quantized_linear_keeps_its_weight_in_the_state_dict_and_follows_to():
    """The integers and scales were plain attributes: state_dict() held only the bias (a
    saved quantized model lost its weights) and .double() broke the forward."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 10)
    q = QuantizedLinear(lin, bits=4, group_size=16)
    sd = q.state_dict()
    assert set(sd) == {"qdata", "scale", "bias"} and sd["qdata"].dtype == torch.uint8
    other = QuantizedLinear(nn.Linear(64, 10), bits=4, group_size=16)
    other.load_state_dict(sd)
    x = torch.randn(3, 64)
    assert torch.equal(other(x), q(x))
    want = x.double() @ dequantize(q.qweight).double().T + lin.bias.double()
    q.double()
    assert q.qdata.dtype == torch.uint8 and q.scale.dtype == torch.float64
    y = q(x.double())
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)


def test_quantized_model_state_dict_round_trips_through_a_checkpoint(tmp_path, tiny):
    q = quantize_model(tiny, bits=8)
    wb.checkpoint.save(tmp_path / "q", {"model": q.state_dict()})
    fresh = quantize_model(build_model(get_config("tiny"), seed=7).eval(), bits=8)
    sd = fresh.state_dict()
    wb.checkpoint.load(tmp_path / "q", {"model": sd})
    fresh.load_state_dict(sd)
    idx = prompt(2, 6)
    assert torch.equal(fresh(idx)[0], q(idx)[0])


def test_quantize_model_names_an_unknown_skip_and_takes_one_name(tiny):
    with pytest.raises(ValueError, match=r"\['lm_haed'\] name no nn.Linear"):
        quantize_model(tiny, skip=["lm_haed"])
    q = quantize_model(tiny, skip="lm_head")                  # one name, not its letters
    assert type(q.lm_head) is nn.Linear
    assert isinstance(q.layers[0].attn.wq, QuantizedLinear)


def test_a_weight_with_inf_or_nan_is_refused():
    w = torch.randn(4, 32)
    w[1, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_weight(w, 8)


# ---- the serving benchmark -----------------------------------------------------------------

def test_a_request_longer_than_the_context_is_refused():
    p = StepPricer("tiny", "a100")                             # seq_len 64
    trace = [Request(0, 0.0, 40, 20), Request(1, 0.1, 50, 20)]
    for run in (static, continuous):
        with pytest.raises(ValueError, match=r"request 1: prompt 50 \+ output 20 = 70 "
                                              r"tokens > seq_len=64"):
            run(trace, p, 4)


def test_duplicate_ids_and_empty_requests_are_refused():
    """Results are keyed by id: two requests with one id overwrote each other's times."""
    p = StepPricer("tiny", "a100")
    with pytest.raises(ValueError, match="two requests have id=3"):
        continuous([Request(3, 0.0, 5, 2), Request(3, 0.1, 5, 2)], p, 4)
    with pytest.raises(ValueError, match="prompt and output must be ints >= 1"):
        static([Request(0, 0.0, 0, 2)], p, 4)


def test_read_trace_refuses_fractional_tokens_and_taken_ids(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"arrival": 0, "prompt": 3.7, "output": 2}) + "\n")
    with pytest.raises(ValueError, match=r":1:.*prompt=3.7 is not a whole number"):
        read_trace(f)
    f.write_text(json.dumps({"arrival": 0, "prompt": 3, "output": 2.0, "id": 1}) + "\n"
                 + json.dumps({"arrival": 0, "prompt": 3, "output": 2}) + "\n")
    with pytest.raises(ValueError, match=":2: id 1 is taken"):
        read_trace(f)
    f.write_text('{"arrival": 0, "prompt": Infinity, "output": 2}\n')      # json reads it
    with pytest.raises(ValueError, match="prompt=inf is not a whole number"):
        read_trace(f)


def test_the_benchmark_prices_a_large_preset_as_documented(tmp_path, capsys):
    """``serve --preset llama2-7b --requests FILE`` (the module's own example) was refused
    by argparse: --preset listed only the text presets."""
    f = tmp_path / "t.jsonl"
    f.write_text('{"arrival": 0, "prompt": 100, "output": 20}\n'
                 '{"arrival": 0.01, "prompt": 500, "output": 50}\n')
    assert main(["serve", "--preset", "llama2-7b", "--profile", "h100",
                 "--requests", str(f)]) == 0
    out = capsys.readouterr().out
    p = StepPricer("llama2-7b", "h100")
    trace = read_trace(f)
    want = continuous(trace, p).summary()["throughput_tok_s"]
    assert out.startswith("2 requests, llama2-7b on h100\n") and f"{want}" in out
    with pytest.raises(SystemExit):                            # text: the alphabet's presets
        main(["serve", "--preset", "llama2-7b", "--prompt", "The fox"])
    assert "invalid choice: 'llama2-7b'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--requests", "{f}", "--tp", "2", "--temperature", "0.8"],
     "--temperature --tp: the --requests benchmark does not read them"),
    (["--prompt", "The fox", "--max-batch", "4"],
     "--max-batch: text generation (--prompt) does not read it"),
])
def test_a_flag_the_mode_ignores_is_an_error(tmp_path, capsys, flags, message):
    f = tmp_path / "t.jsonl"
    f.write_text('{"arrival": 0, "prompt": 10, "output": 5}\n')
    assert main(["serve", *[x.format(f=f) for x in flags]]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and message in cap.err and cap.err.count("\n") == 1


# ---- checkpoints: model and optimizer, save -> load -> continue ----------------------------

def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _steps(model, opt, batches):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


BATCHES = [(torch.randn(6, 8, generator=torch.Generator().manual_seed(i)),
            torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + i)))
           for i in range(5)]


def test_a_fresh_optimizers_empty_state_is_an_error_not_a_silent_skip(tmp_path):
    """A fresh torch.optim optimizer's state_dict() has "state": {} until its first step;
    load filled nothing there and returned, so training went on from zero moments."""
    m = _mlp(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _steps(m, opt, BATCHES[:2])
    wb.checkpoint.save(tmp_path, {"model": m.state_dict(), "optim": opt.state_dict()})
    m2 = _mlp(1)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    st = {"model": m2.state_dict(), "optim": opt2.state_dict()}
    before = m2[0].weight.clone()
    with pytest.raises(wb.checkpoint.CheckpointError,
                       match=r"'optim.state' is empty, the checkpoint holds 12 entries"):
        wb.checkpoint.load(tmp_path, st)
    assert torch.equal(m2[0].weight, before)                   # raised before any copy
    wb.checkpoint.load(tmp_path, st, strict=False)             # asked for: the rest loads
    assert torch.equal(m2[0].weight, m[0].weight) and st["optim"]["state"] == {}


def test_save_load_continue_equals_never_stopping(tmp_path):
    ref_model = _mlp(0)
    ref = _steps(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2), BATCHES)
    m = _mlp(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    first = _steps(m, opt, BATCHES[:3])
    wb.checkpoint.save(tmp_path, {"model": m.state_dict(), "optim": opt.state_dict()})
    m2 = _mlp(9)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    for p in m2.parameters():                 # the states to fill, as DCP's _init_optim_state
        opt2.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                         "exp_avg_sq": torch.zeros_like(p)}
    st = {"model": m2.state_dict(), "optim": opt2.state_dict()}
    wb.checkpoint.load(tmp_path, st)
    m2.load_state_dict(st["model"])
    opt2.load_state_dict(st["optim"])
    assert opt2.param_groups[0]["lr"] == 1e-2
    assert first + _steps(m2, opt2, BATCHES[3:]) == ref
    for a, b in zip(m2.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


# ---- the roofline ---------------------------------------------------------------------------

def test_step_cost_refuses_a_context_the_model_does_not_have_and_names_chunks_prefill():
    from workbench.serve.roofline import step_cost
    with pytest.raises(ValueError, match=r"context 60 \+ new_tokens 8 = 68 > seq_len=64"):
        step_cost("tiny", batch=1, new_tokens=8, context=60)
    assert step_cost("tiny", batch=1, new_tokens=8, context=16).phase == "prefill"   # a chunk
    assert step_cost("tiny", batch=1, new_tokens=1, context=16).phase == "decode"
    assert step_cost("tiny", batch=1, new_tokens=8, context=0).phase == "prefill"


def test_a_mixture_of_experts_is_not_priced_without_its_experts():
    """The experts are 3-d parameters, not nn.Linear: the weights counted left them out,
    so a MoE model was priced as its attention alone."""
    from workbench.serve.roofline import linear_weights, step_cost
    moe = get_config("tiny").replace(moe_experts=4)
    for price in (lambda: linear_weights(moe), lambda: StepPricer(moe, "a100"),
                  lambda: step_cost(moe, batch=1, new_tokens=1, context=8)):
        with pytest.raises(NotImplementedError, match="moe_experts=4"):
            price()


@pytest.mark.parametrize("batch", [0, -1, True, 2.0])
def test_a_paged_cache_of_no_sequences_is_refused(tiny, batch):
    with pytest.raises(ValueError, match=f"batch={batch!r}"):
        PagedKVCache.for_model(tiny, batch, 8, 4)


def test_resuming_with_fewer_steps_than_the_checkpoint_ran_is_an_error(tmp_path, capsys):
    """train(steps=2, resume=<a step-3 checkpoint>) returned [] as if it had trained."""
    from workbench.train import train
    train("tiny", steps=3, seed=0, timing=False, save=str(tmp_path))
    with pytest.raises(ValueError, match=r"has run 3 steps already; give steps >= 3"):
        train("tiny", steps=2, seed=0, timing=False, resume=str(tmp_path))
    assert train("tiny", steps=3, seed=0, timing=False, resume=str(tmp_path)) == []
    d = str(tmp_path)
    assert main(["train", "--steps", "2", "--resume", d]) == 2
    assert "has run 3 steps already, --steps 2 is fewer" in capsys.readouterr().err


def test_a_model_with_multihead_attention_quantizes_and_runs():
    """nn.MultiheadAttention reads out_proj.weight directly: a QuantizedLinear there (no
    .weight) crashed the forward; torch.ao leaves that Linear float, and so do we."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(32, 4, batch_first=True)
            self.fc = nn.Linear(32, 8)

        def forward(self, x):
            return self.fc(self.att(x, x, x)[0])

    torch.manual_seed(0)
    m = Net().eval()
    q = quantize_model(m, bits=8)
    assert isinstance(q.fc, QuantizedLinear) and type(q.att.out_proj) is not QuantizedLinear
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        want = fc_dequantized(m, q, x)
        torch.testing.assert_close(q(x), want, rtol=0, atol=1e-6)


def fc_dequantized(m, q, x):
    """The float model with fc's weight replaced by its dequantized int8 one."""
    h = m.att(x, x, x)[0]
    return torch.nn.functional.linear(h, dequantize(q.fc.qweight), m.fc.bias)


@pytest.mark.parametrize("preset", ["tiny", "gpt-tiny"])
def test_zero3_trains_the_experts_of_a_moe_model(preset):
    """Experts.forward read self._parameters, so ZeRO-3's gathered weights (set as the
    attribute by its pre-forward hook) were never seen: the experts stayed at their init and
    the losses left one device's from step 2 (found resuming a MoE run on dp 3 ZeRO-3)."""
    from workbench.recipes.hybrid import Hybrid
    from workbench.train import SingleDevice, train
    kw = dict(steps=3, seed=0, batch_size=4, timing=False, moe_experts=4)
    one = [r["loss"] for r in train(preset, strategy=SingleDevice(), **kw)]
    z3 = [r["loss"] for r in train(preset, strategy=Hybrid(dp=2, zero=3), **kw)]
    torch.testing.assert_close(torch.tensor(z3), torch.tensor(one), rtol=1e-5, atol=0)


def test_a_trace_of_one_token_outputs_reports_no_time_per_output_token(tmp_path, capsys):
    """Every output 1 token: the latency table crashed ('percentile of no values')."""
    p = StepPricer("tiny", "a100")
    res = continuous([Request(0, 0.0, 10, 1), Request(1, 0.01, 5, 1)], p, 4)
    assert res.tpot() == [] and res.tpot_p50 != res.tpot_p50        # nan: undefined
    assert res.ttft_p50 > 0 and res.throughput > 0
    f = tmp_path / "t.jsonl"
    f.write_text('{"arrival": 0, "prompt": 10, "output": 1}\n')
    assert main(["serve", "--requests", str(f)]) == 0
    assert "nan" in capsys.readouterr().out


def test_int4_on_an_odd_layer_names_the_layer_and_a_way_out():
    net = nn.Sequential(nn.Linear(7, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"layer '0': group_size=32.* 7 input features "
                                         r"\(none exists.*bits=8"):
        quantize_model(net, bits=4)
    with pytest.raises(ValueError, match=r"96 input features \(e.g. 32\)"):
        quantize_weight(torch.randn(2, 96), 4, group_size=64)
    q = quantize_model(net, bits=4, group_size=8, skip=["0"])
    assert isinstance(q[2], QuantizedLinear) and type(q[0]) is nn.Linear


def test_causal_offset_mask_is_flash_attentions_bottom_right_causal_and_refuses_more_queries():
    from workbench.serve import causal_offset_mask
    want = torch.ones(2, 5, dtype=torch.bool).tril(diagonal=3)            # FA-2: k_len - q_len
    assert torch.equal(causal_offset_mask(2, 5), want)
    with pytest.raises(ValueError, match=r"q_len=3, k_len=2"):
        causal_offset_mask(3, 2)                                            # row 0 saw nothing


def test_a_shared_allocator_and_another_num_blocks_is_refused(tiny):
    with pytest.raises(ValueError, match=r"num_blocks=100.*give num_blocks=6"):
        PagedKVCache(tiny.cfg, 2, 100, 4, allocator=BlockAllocator(6))


def test_generating_with_a_capacity_limited_moe_and_a_cache_is_refused():
    """Capacity ceil(cf S k / E) depends on S: cached decode (S = 1, never dropping) gave
    other tokens than the recompute it is held to (tiny, 4 experts, cf 1.0), silently."""
    cfg = get_config("tiny").replace(moe_experts=4, moe_capacity_factor=1.0)
    m = build_model(cfg, seed=0).eval()
    idx = prompt(2, 8)
    with pytest.raises(ValueError, match=r"moe_capacity_factor=1.0.*use_cache=False"):
        generate(m, idx, 10)
    assert torch.equal(generate(m, idx, 10, use_cache=False), no_cache_greedy(m, idx, 10))
    dropless = build_model(cfg.replace(moe_capacity_factor=None), seed=0).eval()
    assert torch.equal(generate(dropless, idx, 10), no_cache_greedy(dropless, idx, 10))


@pytest.mark.parametrize("q", [150, -50, float("nan")])
def test_percentile_outside_0_100_is_named(q):
    from workbench.serve.requests import percentile
    with pytest.raises(ValueError, match=r"percentile\(q="):
        percentile([1.0, 2.0, 3.0], q)


def _resumed(tmp_path, save_on, resume_on, **kw):
    """Losses of 2 steps on ``save_on``, saved, then steps 2-3 resumed on ``resume_on``,
    beside 4 steps on one device."""
    from workbench.recipes.hybrid import Hybrid
    from workbench.train import SingleDevice, train
    kw = dict(seed=0, batch_size=8, timing=False, **kw)
    lay = lambda x: SingleDevice() if x is None else Hybrid(**x)        # noqa: E731
    one = [r["loss"] for r in train("tiny", steps=4, strategy=SingleDevice(), **kw)]
    first = train("tiny", steps=2, strategy=lay(save_on), save=str(tmp_path), **kw)
    rest = train("tiny", steps=4, strategy=lay(resume_on), resume=str(tmp_path), **kw)
    return [r["loss"] for r in first + rest], one


@pytest.mark.parametrize("save_on, resume_on", [(dict(dp=2, ep=2), None),
                                                (dict(dp=2, ep=2), dict(dp=2, ep=2))])
def test_expert_parallel_optimizer_states_are_saved(tmp_path, save_on, resume_on):
    """With ep, a stage has two optimizers (dense, experts); the save paired optimizers with
    stages one to one and left the experts' AdamW states out: the first resumed update
    differed (step 3: 3.680888 against one device's 3.681402)."""
    got, one = _resumed(tmp_path, save_on, resume_on, moe_experts=4)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(one), rtol=1e-6, atol=0)


@pytest.mark.parametrize("save_on", [None, dict(pp=2, schedule="dualpipe")])
def test_resuming_into_dualpipe_loads_both_copies(tmp_path, save_on):
    """DualPipe's copy 1 of each stage stayed at its init on resume: half the micro-batches
    ran on the untrained model (step 2: 4.088 against 3.862)."""
    got, one = _resumed(tmp_path, save_on, dict(pp=2, schedule="dualpipe"))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(one), rtol=1e-6, atol=0)


def test_generate_names_a_training_wrapper_and_returns_the_kind_it_was_given(tiny):
    """A DDP/FSDP-wrapped model crashed deep inside ('weight' must be 2-D, index out of
    range); a plain prompt on a served model came back a DistTensor, not 'the same kind'."""
    mesh = wb.Mesh.grid(2, ["dp"])
    ddp = wb.DistributedDataParallel(build_model(get_config("tiny"), seed=1), mesh)
    for model in (ddp, ddp.module):
        with pytest.raises(TypeError, match="wrapped by DistributedDataParallel"):
            generate(model, prompt(2, 5), 3)
    with pytest.raises(TypeError, match="a Linear, not a workbench model"):
        generate(nn.Linear(2, 2), prompt(2, 5), 3)
    served = wb.serve.serve_model("tiny", tp=2, state_dict=ddp.full_state_dict())
    out = generate(served.model, prompt(2, 5), 6)
    assert type(out) is torch.Tensor and torch.equal(out, no_cache_greedy(tiny, prompt(2, 5), 6))
    assert isinstance(generate(served.model, served.place(prompt(2, 5)), 6), wb.DistTensor)


@pytest.mark.parametrize("kw, message", [(dict(temperature=-1.0), "temperature=-1.0"),
                                         (dict(temperature=float("nan")), "temperature=nan"),
                                         (dict(max_new_tokens=-2), "max_new_tokens=-2")])
def test_the_textbook_generate_refuses_a_negative_temperature(tiny, kw, message):
    """model.generate(temperature=-1) sampled from softmax(-logits), silently."""
    kw = {"max_new_tokens": 3, **kw}
    with pytest.raises(ValueError, match=message):
        tiny.generate(prompt(1, 3), **kw)


@pytest.mark.parametrize("u", [1.5, 0, -0.1])
def test_kv_capacity_takes_a_share_of_memory(u):
    with pytest.raises(ValueError, match=f"utilization={u!r}"):
        StepPricer("tiny", "a100").kv_capacity(u)


# ---- checkpoints: a module or an optimizer given as itself (DCP's Stateful) ----------------

def _stepped(seed):
    """A model and an AdamW that has taken a step (its states exist, to load into)."""
    m = _mlp(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=0.5)
    _steps(m, opt, BATCHES[4:])
    return m, opt


def test_a_module_and_optimizer_given_as_themselves_are_saved_and_loaded_in_place(tmp_path):
    """dcp.save({"model": model, "optim": opt}) saves their state_dict()s and dcp.load calls
    their load_state_dict (DCP's Stateful, torchtitan's habit).  wb.checkpoint pickled the
    objects whole and load put new ones in the dict: the model and optimizer the caller
    holds stayed at their init, silently (measured: a saved model and a fresh one loaded
    from it differed by up to 0.64 in a weight)."""
    ref_model = _mlp(0)
    ref = _steps(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2), BATCHES)
    m = _mlp(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    first = _steps(m, opt, BATCHES[:3])
    wb.checkpoint.save(tmp_path, {"model": m, "optim": opt, "step": 3})
    m2, opt2 = _stepped(9)
    state = {"model": m2, "optim": opt2, "step": 0}
    wb.checkpoint.load(tmp_path, state)
    assert state["model"] is m2 and state["optim"] is opt2 and state["step"] == 3
    for a, b in zip(m2.parameters(), m.parameters()):
        assert torch.equal(a, b)
    assert opt2.param_groups[0]["lr"] == 1e-2
    assert first + _steps(m2, opt2, BATCHES[3:]) == ref


def test_a_module_given_as_itself_loads_as_torch_dcp_loads_it(tmp_path):
    import torch.distributed.checkpoint as dcp
    m = _mlp(0)
    wb.checkpoint.save(tmp_path / "wb", {"model": m})
    for reader in ("wb", "dcp"):
        m2 = _mlp(1)
        if reader == "wb":
            wb.checkpoint.load(tmp_path / "wb", {"model": m2})
        else:
            dcp.load({"model": m2}, checkpoint_id=str(tmp_path / "wb"))
        for a, b in zip(m2.parameters(), m.parameters()):
            assert torch.equal(a, b), reader


def test_a_sharded_module_given_as_itself_loads_into_another_layout(tmp_path):
    m = _mlp(0)
    tp = wb.Mesh.grid(2, ["tp"])
    a = wb.parallelize_module(_mlp(0), tp, {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()})
    wb.checkpoint.save(tmp_path, {"model": a})
    b = wb.fully_shard(_mlp(3), mesh=wb.Mesh.grid(3, ["dp"]))
    wb.checkpoint.load(tmp_path, {"model": b})
    for (n, p), q in zip(b.state_dict().items(), m.state_dict().values()):
        assert torch.equal(p.full() if isinstance(p, wb.DistTensor) else p, q), n


def test_a_stateful_object_below_the_top_is_named(tmp_path):
    m = _mlp(0)
    with pytest.raises(wb.checkpoint.CheckpointError,
                       match=r"'run.model' is a Sequential .* put it at the top"):
        wb.checkpoint.save(tmp_path, {"run": {"model": m}})
    wb.checkpoint.save(tmp_path, {"model": m})
    with pytest.raises(wb.checkpoint.CheckpointError, match=r"'run.model' is a Sequential"):
        wb.checkpoint.load(tmp_path, {"run": {"model": _mlp(1)}}, strict=False)


@pytest.mark.parametrize("op", ["save", "load"])
def test_arguments_in_torch_dcps_order_are_named(tmp_path, op):
    """dcp.save(state_dict, checkpoint_id=path) is torch's order; given that way here the
    error was os.fspath's 'expected str, bytes or os.PathLike object, not dict'."""
    wb.checkpoint.save(tmp_path, {"w": torch.ones(2)})
    with pytest.raises(TypeError, match=rf"the directory comes first here: "
                                        rf"wb.checkpoint.{op}\(path, state\)"):
        getattr(wb.checkpoint, op)({"w": torch.zeros(2)}, tmp_path)


# ---- serving a mixture of experts from its training checkpoint -------------------------------

def test_the_serve_cli_serves_a_moe_checkpoint_with_trains_moe_flags(tmp_path, capsys):
    """`train --moe-experts 4 --save DIR` then `serve --checkpoint DIR`: serve had no
    --moe-* flags (argparse refused them), and without them the error was the loader's
    '... not in the checkpoint; pass strict=False to leave it as it is' (which would leave
    the experts at their init)."""
    from workbench.models.data import TOKENIZER
    from workbench.serve.cli import load_served
    from workbench.train import train
    cfg = get_config("tiny", moe_experts=4)
    d = str(tmp_path)
    train(cfg, steps=1, seed=0, timing=False, save=d)
    one = build_model(cfg, seed=3).eval()
    sd = one.state_dict()
    wb.checkpoint.load(d, {"model": sd})
    one.load_state_dict(sd)
    want = TOKENIZER.decode(generate(one, TOKENIZER.encode("The fox")[None], 8)[0])
    capsys.readouterr()
    assert main(["serve", "--checkpoint", d, "--prompt", "The fox", "--max-new-tokens", "8",
                 "--moe-experts", "4", "--tp", "2"]) == 0
    assert capsys.readouterr().out.strip() == want.strip()
    assert main(["serve", "--checkpoint", d, "--prompt", "The fox"]) == 2
    err = capsys.readouterr().err
    assert "'layers.0.mlp.w1.weight' is not in the checkpoint" in err and "--moe-*" in err
    assert "strict=False" not in err
    with pytest.raises(ValueError, match=r"has shape \(8, 64\) here and \(4, 64\)"):
        load_served(get_config("tiny", moe_experts=8), d)
