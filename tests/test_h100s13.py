"""Host (CPU) time against device time for the Megatron-LM README's H100 rows
(``benchmarks/h100_breakdown.py``: ``queue_idle``, ``forward_spans``, ``host_check``;
its docstring's "Host time").

The one host figure of 2024 found, NVIDIA/TransformerEngine pull request #1191
(2024-09-18): Megatron-core's ``TEColumnParallelLinear``, BF16, TP 1, 140 us of host time
per forward (115 us after the pull request, "a 1.22x speedup"; Megatron-core's own
``ColumnParallelLinear`` 74 us).  With the four TE linear modules of a layer at that
figure and the modules without a figure at zero, the host is a lower bound; the launch
queue (no CUDA graph at f2e5db402c) absorbs it in every row: nothing is priced, and the
small rows' gaps would need a host three to four and a half times the bound.
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import h100_breakdown as HB  # noqa: E402
import published as P  # noqa: E402


@pytest.fixture(scope="module")
def checks():
    return {x["name"]: x for x in (HB.host_check(r) for r in HB.rows())}


def test_the_cited_figures_agree_with_their_stated_speedup():
    # #1191: 140 us before, 115 us after, "a 1.22x speedup"; its own linear 74 us
    assert HB.TE_LINEAR_FWD_HOST_2024 / HB.TE_LINEAR_FWD_HOST_AFTER_1191 \
        == pytest.approx(1.22, abs=0.005)
    assert HB.MCORE_LINEAR_FWD_HOST_2024 < HB.TE_LINEAR_FWD_HOST_AFTER_1191 \
        < HB.TE_LINEAR_FWD_HOST_2024


def test_queue_idle_by_hand():
    # host ends at 2, 2, 5; device runs 2-3, 3-4, 5-6: the lead-in 2 and one late span 1
    assert HB.queue_idle([(2.0, 1.0), (0.0, 1.0), (3.0, 1.0)]) == pytest.approx(3.0)
    # a host under the device after the first span: only the lead-in
    assert HB.queue_idle([(0.5, 2.0), (1.0, 2.0), (1.5, 2.0)]) == pytest.approx(0.5)
    # one slow span is absorbed by the lead built before it
    assert HB.queue_idle([(0.1, 1.0), (0.0, 1.0), (1.5, 0.2)]) == pytest.approx(0.1)
    assert HB.queue_idle([]) == 0.0
    with pytest.raises(ValueError, match="span 1"):
        HB.queue_idle([(0.1, 1.0), (-0.1, 1.0)])


def test_the_spans_hold_the_layer_forward_exactly():
    row = HB.rows()[0]                                    # GPT 1.7B, tp 1: no TP comm
    spans = HB.forward_spans(row)
    layer = P.predict(row)["estimate"].details["layer"]
    assert [n for n, _, _ in spans] == [n for n, _, _ in HB.FORWARD_MODULES]
    assert sum(x for _, _, x in spans) == pytest.approx(layer.fwd_compute, rel=1e-9)
    assert sum(h for _, h, _ in spans) == pytest.approx(4 * HB.TE_LINEAR_FWD_HOST_2024)
    # the projection's span has less device work than its module's host time
    proj = dict((n, (h, x)) for n, h, x in spans)["linear_proj: TERowParallelLinear"]
    assert proj[0] > proj[1]


def test_an_op_outside_every_module_is_refused(monkeypatch):
    mods = tuple(m for m in HB.FORWARD_MODULES if m[0] != "activation: bias_gelu")
    monkeypatch.setattr(HB, "FORWARD_MODULES", mods)
    with pytest.raises(ValueError, match="bias_gelu"):
        HB.forward_spans(HB.rows()[0])


def test_the_2024_figure_leaves_every_row_device_bound(checks):
    assert len(checks) == 9
    for x in checks.values():
        assert not x["host_paces"], x["name"]
        assert x["host_forward_bound"] < x["device_forward"], x["name"]
        # a micro-batch's forward from an empty queue waits for the lead-in only
        assert x["idle_per_forward"] == pytest.approx(HB.TE_LINEAR_FWD_HOST_2024,
                                                      rel=1e-9), x["name"]


def test_the_small_rows_would_need_a_host_well_above_the_bound(checks):
    a, b = checks["GPT 1.7B"], checks["GPT 7.1B"]
    assert a["gap"] > 0 and b["gap"] > 0
    assert a["host_to_close_gap"] / a["host_forward_bound"] > 2.5
    assert b["host_to_close_gap"] / b["host_forward_bound"] > 4.0
    assert checks["GPT 32B"]["host_to_close_gap"] is None      # pessimistic: nothing to close


def test_the_syncs_at_the_sourced_figure_are_small(checks):
    a = checks["GPT 1.7B"]
    assert a["syncs"] == a["m"] + 26                  # 4 loss checks, 26 buckets
    for name in ("GPT 1.7B", "GPT 7.1B"):
        x = checks[name]
        assert x["sync_bound"] < 0.02 * x["published"], name
        assert x["sync_bound"] < 0.1 * x["gap"], name
