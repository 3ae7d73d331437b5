"""User-trial audit of pipeline / tensor / sequence parallelism (auditpp).

Each test holds the hybrid recipe to one device's losses, the simulated schedules to the
textbook bubble formulas, or a bad argument to a clear error naming the fix.
"""
import pytest

from workbench.parallel.schedules import gpipe, interleaved_1f1b, one_f_one_b, simulate
from workbench.recipes.hybrid import Hybrid
from workbench.train import train


def _losses(strategy=None, **over):
    return [r["loss"] for r in train("tiny", steps=2, seed=0, batch_size=6, timing=False,
                                     strategy=strategy, **over)]


@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 1), (4, 8)])
def test_bubble_fraction_is_textbook_formula(p, m):
    # Narayanan et al. 2021 sec. 2.2: bubble (p - 1) / (m + p - 1) for GPipe and 1F1B
    for fn in (gpipe, one_f_one_b):
        r = simulate(fn(p, m), f=1.0, b=2.0, w=0.0)
        assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert simulate(gpipe(p, m)).peak_inflight[0] == m
    assert simulate(one_f_one_b(p, m)).peak_inflight[0] == min(p, m)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 3)])
def test_interleaved_bubble_divides_by_v(p, m, v):
    r = simulate(interleaved_1f1b(p, m, v), f=1.0 / v, b=2.0 / v, w=0.0)
    assert r.bubble_fraction == pytest.approx((p - 1) / v / (m + (p - 1) / v))


def test_pp_uneven_stages_and_odd_microbatches_match_one_device():
    ref = _losses(n_layer=5, dropout=0.1)
    got = _losses(Hybrid(pp=2, microbatches=2, stage_sizes=(1, 4)), n_layer=5, dropout=0.1)
    assert got == pytest.approx(ref, abs=1e-4)
    got = _losses(Hybrid(pp=2, microbatches=3), n_layer=2)
    assert got == pytest.approx(_losses(n_layer=2), abs=1e-4)


def test_layers_not_dividing_stages_names_stage_sizes():
    with pytest.raises(ValueError, match="n_layer=5.*stage_sizes"):
        _losses(Hybrid(pp=2, microbatches=2), n_layer=5)
    with pytest.raises(ValueError, match="n_layer=5; pick pp x virtual"):
        _losses(Hybrid(pp=2, virtual=2, schedule="interleaved", microbatches=2), n_layer=5)
