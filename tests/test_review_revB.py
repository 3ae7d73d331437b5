"""Review of the planner's pruned search and the pipeline recipes (revB): each test
failed before its fix."""
import pytest
import torch

from workbench.models import build_model, get_config
from workbench.models.data import get_batch
from workbench.plan.step_floor import best_first
from workbench.recipes.hybrid import Hybrid


def test_best_first_refuses_a_top_below_one_by_name():
    # top=0 indexed an empty heap (IndexError) instead of naming the argument
    with pytest.raises(ValueError, match="top=0"):
        best_first(["a"], 0, lambda k: None, lambda k: 0.0)


def test_evaluate_on_one_stage_takes_a_batch_below_the_training_micro_batches():
    # pp=1 with microbatches=4: a validation batch of 2 raised "lower microbatches",
    # though the one-stage forward never splits the batch (pp > 1 already took it)
    cfg = get_config("tiny").replace(n_layer=2)
    x, y = get_batch(cfg, 8, 0, 0)
    ref = build_model(cfg, seed=0).eval()
    st = Hybrid(pp=1, microbatches=4)
    model = st.build_model(cfg, 0)
    model.eval()
    with torch.no_grad():
        want = float(ref(x[:2], y[:2])[1])
    assert float(st.evaluate(model, x[:2], y[:2])) == pytest.approx(want, rel=1e-5)
    assert st.m == 4 and st._m == 4         # the training step's count unchanged


def test_the_micro_batch_hint_names_only_counts_the_schedule_takes():
    # zb-v needs m >= pp; a batch of 1 on pp=2 was told "or Hybrid(microbatches=1)",
    # which zb_v then refused ("use m >= p")
    cfg = get_config("tiny").replace(n_layer=4)
    st = Hybrid(pp=2, schedule="zb-v")
    with pytest.raises(ValueError, match="does not divide") as err:
        st.check(cfg, 1)
    assert "microbatches=1" not in str(err.value)
    with pytest.raises(ValueError, match=r"microbatches=3\)"):
        st.check(cfg, 3)                     # 3 >= pp: still offered
    Hybrid(pp=2, schedule="zb-v", microbatches=3).check(cfg, 3)
