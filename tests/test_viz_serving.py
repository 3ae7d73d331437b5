"""The batching timeline draws what the schedule computed: one waiting bar (arrival to
first token) and one decoding bar (first to last token) per request, per panel."""
import pytest

from workbench.serve.batching import Request, StepPricer, continuous, static
from workbench.viz.serving import batching_timeline


class OneSecond(StepPricer):
    def seconds(self, prefill=(), decode=()):
        return 1.0


def test_one_wait_and_one_decode_bar_per_request():
    trace = [Request(0, 0.0, 4, 2), Request(1, 0.0, 4, 10), Request(2, 0.5, 4, 3)]
    p = OneSecond("tiny", "a100")
    s, c = static(trace, p, max_batch=2), continuous(trace, p, max_batch=2, token_budget=8)
    fig = batching_timeline({"static": s, "continuous": c})
    for ax, res in zip(fig.axes, (s, c)):
        waits = [b for b in ax.patches if b.get_gid() == "wait"]
        decodes = [b for b in ax.patches if b.get_gid() == "decode"]
        assert len(waits) == len(decodes) == 3
        for r, w, d in zip(trace, waits, decodes):
            assert w.get_x() == r.arrival and w.get_width() == res.first_token[r.id] - r.arrival
            assert d.get_x() == res.first_token[r.id]
            assert d.get_x() + d.get_width() == pytest.approx(res.finish[r.id])
    with pytest.raises(ValueError, match="results"):
        batching_timeline({})
