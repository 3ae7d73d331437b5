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


def test_padding_bar_where_a_static_slot_outlives_its_request():
    """Static batching holds a finished request's slot until the batch's longest output is
    done (grey "pad" bar to the batch's last step); continuous batching frees it at once."""
    trace = [Request(0, 0.0, 4, 2), Request(1, 0.0, 4, 10), Request(2, 0.5, 4, 3)]
    p = OneSecond("tiny", "a100")
    s, c = static(trace, p, max_batch=2), continuous(trace, p, max_batch=2, token_budget=8)
    fig = batching_timeline({"static": s, "continuous": c})
    pads = [b for b in fig.axes[0].patches if b.get_gid() == "pad"]
    assert len(pads) == 1                     # request 0: 2 tokens in a batch of 10
    batch_end = max(st.start + st.seconds for st in s.steps if 0 in st.requests)
    assert pads[0].get_x() == s.finish[0] and batch_end == s.finish[1]
    assert pads[0].get_x() + pads[0].get_width() == pytest.approx(batch_end)
    assert not [b for b in fig.axes[1].patches if b.get_gid() == "pad"]
