"""What the pipeline clip on torch.distributed refuses, named before any collective (the
distributed runs themselves: tests/test_pipeline_clip_eval_torchrun.py)."""
import pytest

from workbench.models import get_config
from workbench.recipes.hybrid import Hybrid
from workbench.recipes.pipeline_clip_dist import _check_kinds


def test_zero3_stage_optimizers_are_refused_naming_the_layouts_built():
    st = Hybrid(pp=2, dp=2, zero=3)
    model = st.build_model(get_config("tiny"), 0)
    opts = st.build_optimizer(model, 1e-3, 0.0)
    with pytest.raises(NotImplementedError, match=r"got a Zero3 .*use zero 0-2"):
        _check_kinds(st, opts, "clip_grad_norm_")
    st1 = Hybrid(pp=2, dp=2, zero=1)
    opts1 = st1.build_optimizer(st1.build_model(get_config("tiny"), 0), 1e-3, 0.0)
    assert _check_kinds(st1, opts1, "clip_grad_value_") == opts1
