"""DeepSpeed v0.3 ZeRO-3 (``plan.zero3_2021``) at GPT 530B's shapes: the live-parameter
counter behind the prefetch check, against DeepSpeed v0.3.13's stage3.py (module
docstring of ``plan.zero3_2021``)."""
import pytest

from workbench.plan import zero3_2021 as Z
from tests.test_zero3_2021 import _gpt, _trace as _zero3_trace


def _trace_530b(layers):
    return _zero3_trace(_gpt(20480, layers), "full", 1)


def _ag(n):                     # a ring at 150 GB/s over 640 ranks, 16-bit elements
    return 2 * n * (639 / 640) / 150e9


def test_post_step_gather_of_persistent_parameters_is_not_counted():
    # _post_step gathers the persistent parameters through Init._all_gather, which never
    # raises total_available_parameter_numel: at step 2 the counter after A's fetch is
    # a alone (max_live - 30,000), not a plus the norm's 50,000 persistent elements.
    # The check (counter < max_live) passes, so A prefetches b, whose gather runs beside
    # A's compute: 5 (a, prefetched at the norm) + 10 + 10 ms.  Before the fix the
    # 50,000 counted, A prefetched nothing and b's gather waited: 30 ms, 1 prefetch
    tr = [Z.Entry("ln", (("ln.w", 50_000),), 0.0, "f"),
          Z.Entry("A", (("a", Z.MAX_LIVE_NUMEL - 30_000),), 0.010, "f"),
          Z.Entry("B", (("b", 10**6),), 0.010, "f")]
    assert Z.counter_start(tr, 2, True) == 0.0
    r = Z.simulate(tr, 2, lambda n: 0.005, lambda n: 0.0, 1e30)
    assert r["prefetches"] == 2
    slack = 6 * Z.SYNC_S + 4 * (Z.AG_LOOP_S + Z.RECORD_COPY_S) + 3 * Z.RELEASE_S
    assert r["seconds"] == pytest.approx(0.005 + 0.010 + 0.010, abs=slack)


def test_counter_drifts_down_by_the_persistent_elements_each_step():
    # release_and_reset_parameter (stage3.py :461) lowers the counter for every gathered
    # parameter after each backward, the persistent ones that _post_step gathered
    # uncounted included: step k starts at -(k - 2) P; a later micro-batch of the step
    # gathers them again (counted) from one P lower
    tr = _trace_530b(2)
    persistent = 2 * 13 * 20480 + 2 * 20480        # per layer 13 h of biases and norms
    assert Z.counter_start(tr, 2, True) == 0.0
    assert Z.counter_start(tr, 7, True) == -5 * persistent
    assert Z.counter_start(tr, 7, False) == -6 * persistent
    for bad in (1, 0, 2.0, True):
        with pytest.raises(ValueError, match="step"):
            Z.counter_start(tr, bad, True)


def test_530b_prefetch_opens_as_the_counter_drifts():
    # GPT 530B: the root holds V h = 1.05e9 >= max live, so step 2 prefetches nothing;
    # with P = 28.0 M a step the check opens at the LayerNorms (counter = the embedding
    # less the drift) from step 4 (1.049e9 - 2 P < 1e9), at the projection (+ 4.19e8,
    # prefetching fc1 beside its compute) from step 19 (17 P > 4.68e8), before every
    # matrix later on; each opening shortens the micro-batch or leaves it (a norm's
    # compute is priced inside the matrices': no time to hide a gather behind)
    tr = _trace_530b(105)
    persistent = 105 * 13 * 20480 + 2 * 20480
    assert Z.counter_start(tr, 3, True) == -persistent
    runs = {k: Z.simulate(tr, 640, _ag, _ag, 1.555e12, step=k)
            for k in (2, 3, 4, 18, 19, 200)}
    assert runs[2]["prefetches"] == runs[3]["prefetches"] == 0
    assert runs[4]["prefetches"] > 0 and runs[18]["prefetches"] == runs[4]["prefetches"]
    assert runs[19]["prefetches"] - runs[18]["prefetches"] == 105   # fc1, once a layer
    assert runs[19]["seconds"] < runs[18]["seconds"] < runs[2]["seconds"] + 1e-9
    assert runs[200]["seconds"] < runs[19]["seconds"]
    assert {r["gathers"] for r in runs.values()} == {runs[2]["gathers"]}   # same gathers


def test_estimate_prices_step_two():
    # the estimate's hook prices COUNTER_STEP = 2 (ASSUMED: the measured step is not
    # stated), as a direct simulation at step 2 of the same trace
    assert Z.COUNTER_STEP == 2
    tr = _trace_530b(2)
    a = Z.simulate(tr, 64, _ag, _ag, 1.555e12)
    b = Z.simulate(tr, 64, _ag, _ag, 1.555e12, step=2)
    assert a == b
