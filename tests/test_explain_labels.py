"""Estimate.explain / assumptions name what the layout runs: the CP all-to-all form
(cp_comm="a2a", DeepSpeed-Ulysses) is not called a ring, and the recipe's ZeRO stage is
the layout's own (found by the browser review of notebook 14, nbr13)."""
import pytest

import workbench as wb
from workbench.plan.presets import get_config


def _est(cp_comm="p2p", zero=2):
    cfg = get_config("llama3-8b-128k")
    lay = wb.plan.Layout(dp=32, tp=1, pp=1, cp=8, cp_comm=cp_comm, zero=zero, recompute="op",
                         framework="workbench", micro_batch=1, global_batch=32)
    return wb.plan.estimate(cfg, lay, wb.plan.Cluster("a100", 256))


@pytest.mark.parametrize("cp_comm,word,other", [("a2a", "CP all-to-all", "CP ring"),
                                                ("p2p", "CP ring", "CP all-to-all")])
def test_explain_names_the_cp_form(cp_comm, word, other):
    text = _est(cp_comm).explain()
    assert word in text and other not in text


@pytest.mark.parametrize("zero,want", [(2, "ZeRO-2"), (3, "ZeRO-3 one gather per layer")])
def test_recipe_words_name_the_zero_stage(zero, want):
    line = next(a for a in _est(zero=zero).assumptions() if a.startswith("this library's recipe"))
    assert want in line
    if zero != 3:
        assert "ZeRO-3" not in line
