"""A timeline names every bar it has room to mark: a label in its bar where it fits, else a
circled number in the bar and the label in a key under the axis.  Read from the drawn
texts (gids "labels", "label_marks", "label_key"), not from pixels."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.parallel.strategies.overlap_multicopy import multi_copy_estimate  # noqa: E402
from workbench.viz import timeline as T  # noqa: E402
from workbench.viz.timeline_labels import (MARKS, fits, key_lines,  # noqa: E402
                                           place_labels)


@pytest.fixture(scope="module")
def notebook10():
    """Notebook 10's multi-copy layer (hidden 8,192, FFN 32,768, seq 4,096, micro-batch 2,
    tp 8, two copies, ascend-910b): its all-reduces and wqkv dW are short bars."""
    return multi_copy_estimate(2, seq=4096, hidden=8192, heads=64, ffn=32768,
                               mesh=wb.Mesh.grid(8, ("tp",)), axis="tp", copies=2,
                               profile="ascend-910b")


def texts(fig, gid):
    return fig.findobj(lambda a: a.get_gid() == gid and hasattr(a, "get_text"))


def named_bars(rep, fig):
    """{(x centre, row): label} of every event drawn on rank 0, in the axis's unit."""
    unit, scale = T.time_unit(rep.total)
    t0 = min(e.start for e in rep.events)
    return {(round((e.start + e.end) / 2 * scale - t0 * scale, 9), int(e.stream == "comm")):
            e.label or e.name for e in rep.events if 0 in e.ranks}


@pytest.mark.parametrize("step", ["forward", "backward"])
def test_every_bar_of_the_multicopy_step_is_named(notebook10, step):
    rep = getattr(notebook10, step)
    fig = T.draw_timeline(rep, ranks=[0])
    bars = named_bars(rep, fig)
    (key,) = texts(fig, "label_key")
    entries = dict(reversed(e.split(" ", 1)) for e in key.get_text().replace("\n", "   ")
                   .split("   "))                                    # label -> mark
    named = {}
    for t in texts(fig, "labels") + texts(fig, "label_marks"):
        x, y = t.get_position()
        named[round(x, 9), int(y)] = t.get_text()
    assert set(named) == set(bars)                       # one text on every bar
    for where, label in bars.items():
        shown = named[where]
        assert shown == label or entries.get(label) == shown, (where, label, shown)
    marked = {bars[w] for w, s in named.items() if s in MARKS}
    assert set(entries) == marked and len(set(entries.values())) == len(entries)
    if step == "forward":                                # the review's two cases
        assert entries["attention A"] == "①" and entries["attention B"] == "②"
        assert named[next(w for w, l in bars.items() if l == "attention A" and w[1] == 1)] == "①"
    else:
        assert {"wqkv dW A", "wqkv dW B"} <= set(entries)


def test_the_key_sits_under_the_axis_label_inside_the_figure(notebook10):
    plain = T.draw_timeline(notebook10.forward, ranks=[0], labels=False)
    fig = T.draw_timeline(notebook10.forward, ranks=[0])
    assert texts(plain, "label_key") == texts(plain, "label_marks") == []
    assert fig.get_figheight() > plain.get_figheight()   # the key has a band of its own
    canvas = FigureCanvasAgg(fig)
    canvas.draw()                                        # lays out the axis label
    renderer = canvas.get_renderer()
    (key,) = texts(fig, "label_key")
    k = key.get_window_extent(renderer)
    xlabel = fig.axes[0].xaxis.label.get_window_extent(renderer)
    assert k.y1 <= xlabel.y0 and k.y0 >= 0 and k.x1 <= fig.bbox.width
    # the axes keep their height: the bars are as tall as without the key
    assert fig.axes[0].get_window_extent(renderer).height == pytest.approx(
        plain.axes[0].get_window_extent(FigureCanvasAgg(plain).get_renderer()).height)


def test_place_labels_numbers_each_distinct_label_once():
    # 100 pt per unit: "ab" needs 12.4 pt, a mark 10 pt
    rows = [(0.5, 0, "ab", 1.0), (1.5, 1, "a long label", 0.2), (2.5, 1, "a long label", 0.2),
            (3.5, 0, "other long label", 0.15), (4.5, 0, "sliver", 0.05)]
    inside, marked, key, left_out = place_labels(rows, 100.0)
    assert inside == [(0.5, 0, "ab")]
    assert marked == [(1.5, 1, "①"), (2.5, 1, "①"), (3.5, 0, "②")]
    assert key == {"a long label": "①", "other long label": "②"}
    assert left_out == ["sliver"]                        # 5 pt: no room for a mark
    assert fits("ab", 12.4) and not fits("ab", 12.3)


def test_past_ten_marks_a_label_is_left_out_and_said_so():
    rows = [(i, 0, f"kernel number {i}", 0.5) for i in range(12)]
    inside, marked, key, left_out = place_labels(rows, 100.0)
    assert [m for _, _, m in marked] == list(MARKS) and len(key) == 10
    assert left_out == ["kernel number 10", "kernel number 11"] and inside == []


def test_key_lines_wrap_between_entries():
    key = {f"a label of some length {i}": MARKS[i] for i in range(10)}
    lines = key_lines(key)
    assert len(lines) > 1 and all(len(ln) <= 120 for ln in lines)
    assert "   ".join(lines).split("   ") == [f"{m} {k}" for k, m in key.items()]
    assert key_lines({}) == []
