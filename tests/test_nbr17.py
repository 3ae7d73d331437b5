"""nbr17's browser review of notebooks 08, 11, 13: rules held generally.

The memory widget (notebook 11) offers sliders for TP, PP and the micro-batch, not the
global batch or dp; a choice whose batch does not split must say so in the sliders'
terms, and the fix it names must be a layout."""
import pytest

import workbench as wb
from workbench.viz.memory import memory_widget

GPT3 = wb.models.get_config("gpt3-175b")


@pytest.mark.parametrize("tp,pp,mb", [(1, 1, 1), (1, 1, 16), (8, 1, 16), (2, 1, 4), (1, 1, 4)])
def test_memory_widget_batch_message_names_a_slider_fix(tp, pp, mb):
    pytest.importorskip("ipywidgets")
    w = memory_widget(GPT3, 1024, "ascend-910b", tp=8, pp=16, recompute="selective")
    c = w.controls
    c["micro_batch"].value, c["tp"].value, c["pp"].value = mb, tp, pp
    dp = 1024 // (tp * pp)
    assert 1536 % (dp * mb), "the case must be one whose batch does not split"
    assert w.figure is None and w.rows is None
    assert f"dp x micro-batch = {dp} x {mb} = {dp * mb} does not divide" in w.message
    assert "global_batch" not in w.message          # not a field the widget offers
    # the fix it names is a layout: apply it and the widget draws
    if 1536 % dp == 0:
        assert "lower the micro-batch" in w.message
        c["micro_batch"].value = max(o for o in c["micro_batch"].options if (1536 // dp) % o == 0)
    else:
        k = int(w.message.split("raise TP x PP to at least ")[1].split()[0])
        # the least TP x PP whose dp x micro-batch divides the batch, the micro-batch kept
        assert 1536 % (mb * 1024 // k) == 0 and 1536 % (mb * 1024 // (k // 2)) != 0
        c["pp"].value = k // tp if k >= tp else 1
        c["tp"].value = k // c["pp"].value
    assert w.figure is not None and "GB of the" in w.message, w.message


def test_memory_widget_valid_batches_are_the_layouts():
    # every slider choice the widget refuses for the batch is one Layout refuses too
    pytest.importorskip("ipywidgets")
    w = memory_widget(GPT3, 1024, "ascend-910b", tp=8, pp=16)
    for tp in (1, 2):            # dp 1024: no micro-batch splits 1536; dp 512: only 1
        for mb in w.controls["micro_batch"].options:
            w.controls["tp"].value, w.controls["pp"].value = tp, 1
            w.controls["micro_batch"].value = mb
            dp = 1024 // tp
            refused = "does not divide the global batch" in w.message
            assert refused == bool(1536 % (dp * mb)), (tp, mb, w.message)
            if refused:
                with pytest.raises(ValueError, match="not divisible by micro_batch x dp"):
                    wb.plan.Layout(dp=dp, tp=tp, pp=1, micro_batch=mb, global_batch=1536)
