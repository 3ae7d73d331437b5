"""What made the suite's slow tests smaller must not change what they measure (task speed15).

``plan.meta_moe.measured_routing`` now ends its forward once the first MoE layer has
recorded its routing (the experts, the later blocks and the vocabulary projection were
~2/3 of test_dryrun_ep_cp's uneven-routing forward): the counts are the ones a whole
forward records, and the layer is left as it was (its class's ``record_stats``; a later
forward records and returns as before)."""
import torch

from workbench.models.config import build_model, get_config
from workbench.models.moe import moe_layers
from workbench.plan.meta_moe import measured_routing

# two MoE blocks (the second must not overwrite what the first routed), top-2, uneven
# tokens per rank; small enough for a whole forward in a test
MOE = get_config("llama2-7b", n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=96,
                 seq_len=32, vocab_size=97, moe_experts=4, moe_topk=2)


def _whole_forward(cfg, micro_batch, ranks, seed=0):
    """measured_routing's counts the readable way: the whole forward, then the first MoE
    layer's recorded routing (what it did before it stopped early)."""
    torch.manual_seed(seed)
    model = build_model(cfg, seed=seed).eval()
    idx = torch.randint(0, cfg.vocab_size, (ranks * micro_batch, cfg.seq_len))
    with torch.no_grad():
        model(idx)
    e, slot, _, _ = moe_layers(model)[0]._last[0]
    return [torch.bincount(e[r * micro_batch:(r + 1) * micro_batch][
                slot[r * micro_batch:(r + 1) * micro_batch] >= 0],
            minlength=cfg.moe_experts).tolist() for r in range(ranks)]


def test_measured_routing_is_the_whole_forwards_first_layer_routing():
    for cfg, mb, ranks, seed in [(MOE, 1, 2, 0), (MOE, 2, 3, 1),
                                 (MOE.replace(n_layer=1, moe_topk=1), 1, 4, 0)]:
        got = measured_routing(cfg, mb, ranks, seed=seed)
        assert got == _whole_forward(cfg, mb, ranks, seed)
        assert [sum(c) for c in got] == [mb * cfg.seq_len * cfg.moe_topk] * ranks
        assert len({tuple(c) for c in got}) > 1          # ranks' rows differ: a real count


def test_the_layer_records_and_returns_as_before_after_a_measured_routing(monkeypatch):
    from workbench.models import config
    built = []
    monkeypatch.setattr(config, "build_model",
                        lambda *a, **k: built.append(build_model(*a, **k)) or built[-1])
    got = measured_routing(MOE, 1, 2)
    (model,) = built
    layer = moe_layers(model)[0]
    assert "record_stats" not in vars(layer)         # the class's method again
    first = [t.clone() for t in layer._last[0][:2]]
    torch.manual_seed(5)
    idx = torch.randint(0, MOE.vocab_size, (2, MOE.seq_len))
    with torch.no_grad():
        out = model(idx)                             # a whole forward: the head's logits
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == (2, MOE.seq_len, MOE.vocab_size)
    assert len(layer._last) == 1 and not torch.equal(layer._last[0][0], first[0])
    assert got == _whole_forward(MOE, 1, 2)


def test_the_suite_cputime_report_sums_own_and_childrens_cpu(tmp_path):
    """benchmarks/suite_cputime.py (the per-test CPU measurement of speed15): a test's cost
    is its own CPU plus its waited children's; an empty directory is an error naming the
    fix, never an empty report."""
    import importlib.util
    import json
    from pathlib import Path

    import pytest
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "suite_cputime.py"
    spec = importlib.util.spec_from_file_location("suite_cputime", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(ValueError, match="SUITE_CPUTIME_DIR"):
        mod.report(str(tmp_path))
    rows = [("tests/test_a.py::t1", "gw0", 0.5, 4.0), ("tests/test_a.py::t2", "gw1", 2.0, 0.0),
            ("tests/test_b.py::t3", "gw0", 0.25, 0.0)]
    for nid, w, cpu, child in rows:
        with open(tmp_path / f"cpu_{w}.jsonl", "a") as f:
            f.write(json.dumps({"id": nid, "w": w, "t0": 0.0, "t1": 1.0, "cpu": cpu,
                                "child": child}) + "\n")
    text = mod.report(str(tmp_path), 2).splitlines()
    assert text[0] == "3 tests, 7 s of CPU (own + waited children)"     # 4.5 + 2 + 0.25
    top = text[text.index("the 2 costliest tests (CPU s: own + children; wall s; worker):") + 1:]
    assert top[0].split()[0] == "4.5" and top[0].endswith("tests/test_a.py::t1")
    assert top[1].split()[0] == "2.0" and "t3" not in "\n".join(top[:2])
    files = text[text.index("the 2 costliest files:") + 1:]
    assert files[0].split() == ["6.5", "tests/test_a.py"]
    assert files[1].split() == ["0.2", "tests/test_b.py"]
