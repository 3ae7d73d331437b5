"""What the pipeline clip on torch.distributed refuses, named before any collective (the
distributed runs themselves: tests/test_pipeline_clip_eval_torchrun.py)."""
import pytest
import torch

from workbench.models import get_config
from workbench.recipes.hybrid import Hybrid
from workbench.recipes.pipeline_clip_dist import _check_kinds


def _opts(cfg, **kw):
    st = Hybrid(pp=2, **kw)
    return st, st.build_optimizer(st.build_model(cfg, 0), 1e-3, 0.0)


def test_stage_optimizers_of_every_zero_stage_are_taken():
    for zero in (0, 1, 3):
        st, opts = _opts(get_config("tiny"), dp=2, zero=zero)
        assert _check_kinds(st, opts, "clip_grad_norm_") == opts


def test_other_optimizers_and_experts_are_refused_naming_what_is_built():
    st, opts = _opts(get_config("tiny"))
    sgd = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    with pytest.raises(NotImplementedError, match=r"got a SGD; clip on simulated ranks"):
        _check_kinds(st, [sgd], "clip_grad_value_")
    st, opts = _opts(get_config("tiny").replace(moe_experts=4), dp=1, ep=2)
    with pytest.raises(NotImplementedError, match=r"no expert parallelism\); got a "
                                                  r"DataParallel on Mesh"):
        _check_kinds(st, opts, "clip_grad_norm_")
