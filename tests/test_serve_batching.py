"""Continuous against static batching (workbench.serve.batching): a hand-worked trace on a
clock of one second per step, the schedulers' invariants on a random trace, the step
prices against the model's own parameters and the roofline's verdict, percentiles as
torch.quantile, and the throughput gain under load (none under light load)."""
import pytest
import torch

from workbench.models.config import build_model, get_config
from workbench.serve.batching import (Request, StepPricer, continuous, latency_table,
                                      percentile, poisson_trace, read_trace, static)
from workbench.sim_mesh.kernel_cost import explain_compute


class OneSecond(StepPricer):
    """Every step costs one second, whatever it holds."""

    def seconds(self, prefill=(), decode=()):
        return 1.0


def test_hand_worked_trace():
    p = OneSecond("tiny", "a100")
    trace = [Request(0, 0.0, 4, 2), Request(1, 0.0, 4, 10), Request(2, 0.5, 4, 3)]
    s = static(trace, p, max_batch=2)
    # batch {0, 1}: prefill [0, 1), 9 decode steps to 10; request 2 waits for it
    assert s.first_token == {0: 1.0, 1: 1.0, 2: 11.0}
    assert s.finish == {0: 2.0, 1: 10.0, 2: 13.0}
    c = continuous(trace, p, max_batch=2, token_budget=8)
    # request 0 leaves at 2, request 2 takes its slot: decode 1 + prefill 2 in one step
    assert c.first_token == {0: 1.0, 1: 1.0, 2: 3.0}
    assert c.finish == {0: 2.0, 1: 10.0, 2: 5.0}
    assert (c.steps[2].prefill_tokens, c.steps[2].decode_tokens) == (4, 1)
    assert c.ttft() == [1.0, 1.0, 2.5] and s.ttft() == [1.0, 1.0, 10.5]
    assert c.tpot() == [1.0, 1.0, 1.0]
    assert s.useful_decode_share == (1 + 9 + 2) / (9 * 2 + 2 * 1)


def test_a_long_prompt_is_prefilled_in_chunks_under_the_budget():
    p = OneSecond("tiny", "a100")
    c = continuous([Request(0, 0.0, 10, 1)], p, max_batch=2, token_budget=4)
    assert [s.prefill_tokens for s in c.steps] == [4, 4, 2]
    assert c.first_token == {0: 3.0} and c.finish == {0: 3.0}


def test_invariants_on_a_random_trace():
    pricer = StepPricer("llama2-7b", "ascend-910b")
    trace = poisson_trace(60, 20.0, prompt=(8, 300), output=(1, 200), seed=3)
    c = continuous(trace, pricer, max_batch=8, token_budget=256)
    s = static(trace, pricer, max_batch=8)
    for res in (c, s):
        assert set(res.finish) == {r.id for r in trace}
        for r in trace:
            assert r.arrival < res.first_token[r.id] <= res.finish[r.id]
        starts = [st.start for st in res.steps]
        assert starts == sorted(starts)
        assert all(len(st.requests) <= 8 for st in res.steps)
    assert all(st.prefill_tokens + st.decode_tokens <= 256 for st in c.steps)
    # continuous computes exactly the decode tokens the requests need; static pads
    assert sum(st.decode_tokens for st in c.steps) == sum(r.output - 1 for r in trace)
    assert c.useful_decode_share == 1.0 > s.useful_decode_share
    assert sum(st.prefill_tokens for st in c.steps) == sum(r.prompt for r in trace)


def test_step_prices_read_the_models_weights_and_the_roofline():
    cfg = get_config("tiny")
    with torch.device("meta"):
        model = build_model(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    p = StepPricer(cfg, "a100")
    assert p.weight_bytes == linear * 4
    assert p.kv_bytes_per_token == 2 * cfg.n_layer * cfg.d_model * 4
    big = StepPricer("llama2-7b", "ascend-910b")
    f, b, _ = big.terms(decode=[512] * 8)
    assert explain_compute(f, b, big.profile, "bfloat16", "matmul")["bound"] == "memory"
    f, b, _ = big.terms(prefill=[(0, 512)])
    assert explain_compute(f, b, big.profile, "bfloat16", "matmul")["bound"] == "compute"
    # memory-bound: 32 sequences decode in well under twice the time of one
    assert big.seconds(decode=[512] * 32) < 2 * big.seconds(decode=[512])


def test_percentile_is_torch_quantiles():
    xs = [5.0, 1.0, 4.0, 2.5, 9.0, 7.0, 3.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(torch.quantile(torch.tensor(xs),
                                                                 q / 100).item())


def test_continuous_gains_under_load_and_not_under_light_load():
    pricer = StepPricer("llama2-7b", "ascend-910b")
    light = poisson_trace(40, 0.5, seed=0)
    heavy = poisson_trace(120, 16.0, seed=0)
    r_light = continuous(light, pricer).throughput / static(light, pricer).throughput
    c, s = continuous(heavy, pricer), static(heavy, pricer)
    assert 0.97 < r_light < 1.05
    assert c.throughput / s.throughput > 1.8
    assert c.ttft_p50 < s.ttft_p50 and c.tpot_p99 < s.tpot_p99


def test_trace_is_seeded_and_bad_arguments_are_named():
    assert poisson_trace(5, 2.0, seed=1) == poisson_trace(5, 2.0, seed=1)
    assert poisson_trace(5, 2.0, seed=1) != poisson_trace(5, 2.0, seed=2)
    gaps = [r.arrival for r in poisson_trace(2000, 4.0, seed=0)]
    assert gaps[-1] / 2000 == pytest.approx(0.25, rel=0.1)
    with pytest.raises(ValueError, match="rate=0"):
        poisson_trace(5, 0)
    with pytest.raises(ValueError, match=r"output=\(0, 3\)"):
        poisson_trace(5, 1.0, output=(0, 3))
    with pytest.raises(ValueError, match="token_budget=4"):
        continuous(poisson_trace(3, 1.0), StepPricer("tiny", "a100"), max_batch=8,
                   token_budget=4)


def test_int8_and_int4_weights_shrink_the_weight_bytes_and_the_decode_step_only():
    base = StepPricer("llama2-7b", "ascend-910b")
    q8 = StepPricer("llama2-7b", "ascend-910b", weight_bits=8)
    q4 = StepPricer("llama2-7b", "ascend-910b", weight_bits=4)
    assert base.weight_bytes == 2 * q8.weight_bytes == 4 * q4.weight_bytes
    d = [[512] * 8]
    assert base.seconds(decode=d[0]) > q8.seconds(decode=d[0]) > q4.seconds(decode=d[0])
    assert base.seconds(prefill=[(0, 512)]) == q8.seconds(prefill=[(0, 512)])   # compute-bound
    with pytest.raises(ValueError, match="weight_bits=3"):
        StepPricer("tiny", "a100", weight_bits=3)


def test_read_trace_and_the_latency_table(tmp_path):
    f = tmp_path / "requests.jsonl"
    f.write_text('{"arrival": 0.0, "prompt": 4, "output": 2}\n\n'
                 '{"arrival": 0.5, "prompt": 4, "output": 3, "id": 7}\n')
    trace = read_trace(f)
    assert trace == [Request(0, 0.0, 4, 2), Request(7, 0.5, 4, 3)]
    p = OneSecond("tiny", "a100")
    table = latency_table([continuous(trace, p), static(trace, p)])
    assert table.splitlines()[0].split()[:2] == ["schedule", "throughput_tok_s"]
    assert [line.split()[0] for line in table.splitlines()[1:]] == ["continuous", "static"]
    f.write_text('{"arrival": 0.0, "prompt": 4}\n')
    with pytest.raises(ValueError, match=r"requests.jsonl:1: .* is not a request"):
        read_trace(f)
    f.write_text('{"arrival": 0.0, "prompt": 0, "output": 1}\n')
    with pytest.raises(ValueError, match=r"requests.jsonl:1: arrival must be"):
        read_trace(f)


class Recording(StepPricer):
    """Records what each step is priced on."""

    def seconds(self, prefill=(), decode=()):
        self.calls.append((tuple(prefill), tuple(decode)))
        return 1.0


@pytest.mark.parametrize("schedule", [static, continuous])
def test_a_decode_step_reads_the_cache_before_the_token_it_feeds(schedule):
    # prompt 5, 3 tokens out: the prefill samples token 1; feeding token 1 reads the 5
    # prompt keys, feeding token 2 reads 6 (the engine's cache, serve.engine, holds as many)
    p = Recording("tiny", "a100")
    p.calls = []
    schedule([Request(0, 0.0, 5, 3)], p, max_batch=1)
    assert [d for _, d in p.calls] == [(), (5,), (6,)]
    assert p.calls[0][0] == ((0, 5),)
