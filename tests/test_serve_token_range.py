"""generate() with token ids outside the vocabulary: a clear error naming the id and
the range, before any forward (PyTorch's embedding raised a bare 'index out of range
in self' from inside the model; Engine.add_request already checked the range)."""
import pytest
import torch

import workbench as wb
from workbench.serve import generate


def _model():
    cfg = wb.models.get_config("tiny")
    return wb.models.build_model(cfg, seed=0).eval(), cfg


@pytest.mark.parametrize("bad", [75, 1000, -1])
def test_out_of_vocabulary_prompt_is_named(bad):
    m, cfg = _model()
    assert cfg.vocab_size == 75
    idx = torch.tensor([[3, bad, 5]])
    before = idx.clone()
    with pytest.raises(ValueError, match=rf"token id {bad}, outside the vocabulary \[0, 75\)"):
        generate(m, idx, 2)
    assert torch.equal(idx, before)


def test_ids_at_the_edges_generate():
    m, cfg = _model()
    out = generate(m, torch.tensor([[0, cfg.vocab_size - 1]]), 3)
    assert out.shape == (1, 5)
    assert int(out.min()) >= 0 and int(out.max()) < cfg.vocab_size


def test_a_placed_prompt_is_checked_on_its_ranks_without_a_collective():
    from workbench.serve import serve_model
    cfg = wb.models.get_config("tiny")
    s = serve_model(cfg, seed=0, dp=2, tp=2)
    bad = torch.tensor([[1, 2], [3, 80]])
    with wb.trace() as tr:
        with pytest.raises(ValueError, match=r"token id 80, outside the vocabulary \[0, 75\)"):
            generate(s.model, s.place(bad), 2)
    assert not [e for e in tr.events if e.stream == "comm"]
