"""torchtitan's FSDP2 rows taken apart (``benchmarks/torchtitan_breakdown.py``): the
terms read from the planner's own functions add up to the estimate's step, the exposed
collectives the script re-runs on the stream model are the estimate's, and the probe
that scales the network finds the link at which the estimate takes the published step.
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torchtitan_breakdown as TB  # noqa: E402


@pytest.fixture(scope="module")
def terms():
    return [TB.breakdown(row) for row in TB.rows()]


def test_the_terms_sum_to_the_estimate(terms):
    assert len(terms) == 8
    for x in terms:
        parts = x["blocks"] + x["head_loss"] + x["embedding"] + x["copies"] \
            + x["grad_accumulation"]
        assert parts == pytest.approx(x["compute"], rel=1e-9), x["name"]
        step = x["compute"] + x["exposed"] + x["optimizer"] + x["bubble"]
        assert step == pytest.approx(x["predicted"], rel=1e-9), x["name"]
        # the stream model re-run here is the estimate's: forward + backward exposed
        assert x["exposed_forward"] + x["exposed_backward"] == pytest.approx(
            x["exposed"], rel=1e-9, abs=1e-12), x["name"]
        # the published step from the TPS/GPU: the predicted step x the ratio (of throughputs)
        assert x["published"] == pytest.approx(x["predicted"] * x["ratio"], rel=1e-9)
        assert x["room"] == pytest.approx(x["published"] - x["compute"] - x["optimizer"])
        # what is exposed is part of the collectives' own seconds (slowed compute included)
        assert 0 < x["exposed"] < x["collectives"], x["name"]
        assert x["serial"] == pytest.approx(x["compute"] + x["collectives"] + x["optimizer"])


def test_a_block_is_a_block_and_the_root_its_own_unit(terms):
    from workbench.plan.memory import layer_params
    from workbench.plan.presets import get_config
    for x, row in zip(terms, TB.rows()):
        cfg = get_config(row["preset"], **row["model"])
        assert x["block_params"] == layer_params(cfg, 1)
        h, V = cfg.d_model, cfg.vocab_size
        assert x["root_params"] == 2 * V * h + h      # embedding, output layer, final norm
        assert 0 < x["eager"] < x["blocks"]
        assert x["busbw_priced"] > x["busbw_onset"] > 0


def test_the_bandwidth_probe_lands_on_the_published_step():
    """``needed_scale``'s factor makes the estimate take the published step (a probe of
    what the network would need to be, never a figure the profiles take)."""
    row = next(r for r in TB.rows() if r["name"] == "Llama 2 13B"
               and r["layout"]["recompute"] == "none")
    x = TB.breakdown(row)
    k = TB.needed_scale(row, iters=16)
    assert k is not None and 0 < k < 1
    import published as P
    import workbench as wb
    cfg, lay, cl = P.build(row)
    est = wb.plan.estimate(cfg, lay, wb.plan.Cluster(TB._scaled(cl.profile, x["link"], k),
                                                     row["devices"]),
                           attention=row["attention"], **row["estimate_args"])
    assert est.step_time == pytest.approx(x["published"], rel=2e-3)
