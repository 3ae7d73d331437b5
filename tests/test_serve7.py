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
