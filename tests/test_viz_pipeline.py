"""The pipeline visualizer draws what the simulator measured: checked through the artists."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from workbench.parallel.schedules import (gpipe, interleaved_1f1b, one_f_one_b,  # noqa: E402
                                          simulate, zb_h1)
from workbench.viz import pipeline as V  # noqa: E402


def artists(fig, gid):
    ax = fig.axes[0]
    return [a for a in ax.get_children() if a.get_gid() == gid]


def rects(collection):
    """Per path of the collection, its rectangles as (x0, x1, y_center), 5 vertices each."""
    out = []
    for path in collection.get_paths():
        v = path.vertices.reshape(-1, 5, 2)
        assert (path.codes.reshape(-1, 5) == [1, 2, 2, 2, 79]).all()   # MOVETO ... CLOSEPOLY
        out.append([(xs.min(), xs.max(), (ys.min() + ys.max()) / 2)
                    for xs, ys in zip(v[:, :4, 0], v[:, :4, 1])])
    return out


def count(collection):
    return sum(len(p) for p in rects(collection))


def test_blocks_sit_where_the_simulator_put_them():
    r = simulate(one_f_one_b(4, 8))
    fig = V.draw_pipeline(r)
    (blocks,) = artists(fig, "blocks")
    per_path = rects(blocks)
    assert len(per_path) == 2                                   # one path per kind (one chunk)
    drawn = sorted(x for path in per_path for x in path)
    assert len(drawn) == 2 * 4 * 8
    bl = r.blocks
    expected = sorted(zip(bl.start.tolist(), (bl.start + bl.duration).tolist(),
                          bl.rank.astype(float).tolist()))
    assert np.allclose(drawn, expected)
    # fixed colour per kind: every rectangle of a path is one kind, drawn in its colour
    kind_at = {(t, float(rk)): k for t, rk, k in zip(bl.start.tolist(), bl.rank.tolist(),
                                                     bl.kind.tolist())}
    for path, face in zip(per_path, blocks.get_facecolors()):
        kinds = {kind_at[(x0, y)] for x0, x1, y in path}
        assert len(kinds) == 1
        assert np.allclose(face[:3], to_rgba(V.KIND_COLORS["FBW"[kinds.pop()]])[:3])


def test_micro_batch_labels_and_their_cutoff():
    r = simulate(one_f_one_b(2, 3))
    fig = V.draw_pipeline(r)
    labels = artists(fig, "labels")
    assert sorted(t.get_text() for t in labels) == sorted(str(m) for m in r.blocks.mb.tolist())
    first = min(labels, key=lambda t: (t.get_position()[1], t.get_position()[0]))
    assert first.get_position() == (0.5, 0) and first.get_text() == "0"   # F0 on rank 0
    assert artists(V.draw_pipeline(r, max_labels=5), "labels") == []


def test_bubbles_shaded_match_idle_time():
    r = simulate(gpipe(3, 4))
    fig = V.draw_pipeline(r)
    (bub,) = artists(fig, "bubbles")
    (drawn,) = rects(bub)
    # rank 0 idles mid-step; rank 1 before, mid and after; the last rank before and after
    assert [len(b) for b in r.bubbles()] == [1, 3, 2] and len(drawn) == 6
    for rank in range(3):
        width = sum(x1 - x0 for x0, x1, y in drawn if y == rank)
        assert width == pytest.approx(r.bubble_time[rank])
    assert np.allclose(bub.get_facecolors()[0], to_rgba(V.BUBBLE_COLOR))


def test_caption_prints_measured_next_to_formula():
    fig = V.draw_pipeline(simulate(one_f_one_b(4, 8)))
    (cap,) = artists(fig, "caption")
    assert cap.get_text() == "bubble: measured 27.27% | formula (p-1)/(m+p-1) = 27.27%"
    zb = V.draw_pipeline(simulate(zb_h1(4, 8), w=1))
    assert "measured 11.11% | formula (p-1)(f+b-w)" in artists(zb, "caption")[0].get_text()
    hand = simulate(one_f_one_b(2, 2), f=[1, 2])
    assert "no closed-form formula" in V.bubble_caption(hand)


def test_chunks_are_shaded_lighter_and_split_backward_shows_w():
    r = simulate(interleaved_1f1b(2, 4, 2))
    (blocks,) = artists(V.draw_pipeline(r), "blocks")
    assert [len(p) for p in rects(blocks)] == [8, 8, 8, 8]        # F c0, F c1, B c0, B c1
    f0, f1, b0, b1 = blocks.get_facecolors()[:, :3]
    assert np.allclose(f0, to_rgba(V.KIND_COLORS["F"])[:3])
    assert f1.sum() > f0.sum() and b1.sum() > b0.sum()           # later chunk: lighter
    fused = simulate(one_f_one_b(2, 2), w=1)                      # B then W per backward
    fig = V.draw_pipeline(fused)
    assert count(artists(fig, "blocks")[0]) == 2 * 2 * 3
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["F", "B", "W", "bubble"]


def test_memory_panel_draws_one_step_line_per_rank_up_to_the_peak():
    r = simulate(one_f_one_b(4, 8))
    fig = V.draw_pipeline(r)
    mem = fig.axes[1]
    lines = [ln for ln in mem.get_lines() if str(ln.get_gid()).startswith("memory-")]
    assert len(lines) == 4
    assert [max(ln.get_ydata()) for ln in lines] == [4, 3, 2, 1]
    assert len(V.draw_pipeline(r, memory=False).axes) == 1


def test_row_label_names_the_rows_and_the_memory_lines():
    r = simulate(one_f_one_b(2, 4))
    fig = V.draw_pipeline(r, row_label="stage")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["stage 0", "stage 1"]
    assert [ln.get_label() for ln in fig.axes[1].get_lines()
            if str(ln.get_gid()).startswith("memory-")] == ["stage 0", "stage 1"]
    assert [t.get_text() for t in V.draw_pipeline(r).axes[0].get_yticklabels()] == [
        "rank 0", "rank 1"]
    with pytest.raises(ValueError, match="row_label=''"):
        V.draw_pipeline(r, row_label="")


def test_time_unit_labels_the_time_axis():
    """Notebook 17 draws a planner estimate's pipeline, timed in seconds, and its prose
    said "the time axis is in seconds" under an axis labelled only "time (modeled)"."""
    r = simulate(one_f_one_b(2, 4), f=0.5, b=1.0)
    assert V.draw_pipeline(r, time_unit="s").axes[-1].get_xlabel() == "time (modeled, s)"
    assert V.draw_pipeline(r).axes[-1].get_xlabel() == "time (modeled)"
    assert V.draw_pipeline(r, memory=False, time_unit="ms").axes[0].get_xlabel() == \
        "time (modeled, ms)"
    with pytest.raises(ValueError, match="time_unit=''"):
        V.draw_pipeline(r, time_unit="")


def test_draw_accepts_a_schedule_and_is_deterministic():
    a = V.draw_pipeline(one_f_one_b(3, 4), f=1, b=2)
    b = V.draw_pipeline(simulate(one_f_one_b(3, 4), f=1, b=2))
    assert a._repr_png_() == b._repr_png_()
    assert a._repr_png_()[:4] == b"\x89PNG"
    with pytest.raises(TypeError, match="SimulationResult or a Schedule"):
        V.draw_pipeline([1, 2])


def test_no_pyplot_state_is_touched():
    import matplotlib.pyplot as plt
    before = plt.get_fignums()
    V.draw_pipeline(simulate(one_f_one_b(2, 2)))
    assert plt.get_fignums() == before


def test_render_text_one_char_per_time_unit():
    assert V.render_text(simulate(one_f_one_b(2, 2))) == (
        "1f1b p=2 m=2 v=1   (1 char = 1 time unit; . = idle)\n"
        "rank 0 |FF.B.B|\n"
        "rank 1 |.FBFB.|\n"
        "bubble: measured 33.33% | formula (p-1)/(m+p-1) = 33.33%")
    il = V.render_text(simulate(interleaved_1f1b(2, 4, 2))).splitlines()
    assert il[1] == "rank 0 |FFffFbFbfBfB.b.bBB|"               # lower case: chunk 1
    half = V.render_text(simulate(one_f_one_b(2, 2), f=1, b=2.5)).splitlines()
    assert "0.5 time units" in half[0] and half[1].count("F") == 4
    big = V.render_text(simulate(one_f_one_b(16, 64)), width=40).splitlines()
    assert len(big) == 18 and all(len(row) == len(big[1]) for row in big[1:17])
    assert "#" in big[1] and "# = mixed" in big[0]
    with pytest.raises(ValueError, match=r"render_text\(unit=0\)"):
        V.render_text(simulate(one_f_one_b(2, 2)), unit=0)


def test_widget_redraws_and_still_shows_a_static_figure_headless():
    pytest.importorskip("ipywidgets")
    w = V.pipeline_widget(p=3, m=6, v=2, schedule="1F1B")
    bundle = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "image/png" in bundle
    n = count(artists(w.figure, "blocks")[0])
    assert n == 3 * 6 * 3                                  # F, B, W per micro-batch and rank
    w.controls["schedule"].value = "Interleaved 1F1B"
    assert count(artists(w.figure, "blocks")[0]) == 2 * n
    w.controls["m"].value = 5                              # 5 % 3 != 0: the error, not a crash
    assert w.figure is None and "multiple" in w.message and "multiple" in w.status.value
    assert w.image.layout.display == "none"        # collapsed: the message under the controls
    assert "multiple" in w._repr_mimebundle_()["text/plain"]
    image = w.image
    w.controls["m"].value = 6
    # the same image widget, its PNG replaced in place; the caption printed once, below it
    assert w.image is image and w.image.value == V._png(w.figure)
    assert w.message == V.bubble_caption(simulate(interleaved_1f1b(3, 6, 2), f=1.0, b=1.0, w=1.0))
    assert w.image.layout.display is None
    assert w.status.value == f"<pre{V._WRAP}>{w.message}</pre>"
    assert artists(w.figure, "caption") == []
    with pytest.raises(ValueError, match=r"schedule='2F2B'"):
        V.pipeline_widget(schedule="2F2B")


def test_widget_text_names_the_choice_within_the_notebook_width():
    """Shown as text (nbval, a static viewer), the explorer was ipywidgets' VBox repr: 111
    characters cut at the dropdown's options (notebook 07), naming neither p, m, v nor the
    bubble; it is now the call that rebuilds the choice and under it the caption or the
    error, in lines of at most text_width.WIDTH."""
    pytest.importorskip("ipywidgets")
    from workbench.text_width import WIDTH
    w = V.pipeline_widget(p=4, m=8, v=2, schedule="1F1B")
    text = w._repr_mimebundle_()["text/plain"]
    assert text == ("pipeline_widget(p=4, m=8, v=2, schedule='1F1B')\n"
                    + V.bubble_caption(simulate(one_f_one_b(4, 8))))
    w.controls["schedule"].value = "Interleaved 1F1B"
    w.controls["m"].value = 5                              # 5 % 4 != 0: the error, wrapped
    text = w._repr_mimebundle_()["text/plain"]
    assert text.startswith("pipeline_widget(p=4, m=5, v=2, schedule='Interleaved 1F1B')\n")
    assert " ".join(text.split()).endswith(" ".join(w.message.split()))
    assert len(text) > WIDTH and max(len(line) for line in text.splitlines()) <= WIDTH
    costs = V.pipeline_widget(p=2, m=2, f=1.0, b=2.0, w=None)._repr_mimebundle_()["text/plain"]
    assert costs.startswith("pipeline_widget(p=2, m=2, v=2, schedule='1F1B', b=2.0, w=None)\n")


def test_v_slider_is_enabled_only_where_used_and_labels_fit():
    pytest.importorskip("ipywidgets")
    w = V.pipeline_widget(p=4, m=8, v=2, schedule="1F1B")
    assert w.controls["v"].disabled
    w.controls["schedule"].value = "Interleaved 1F1B"
    assert not w.controls["v"].disabled
    w.controls["schedule"].value = "ZB-H1"
    assert w.controls["v"].disabled
    assert all(c.style.description_width == "initial" for c in w.controls.values())


def test_legend_names_the_chunk_shades():
    fig = V.draw_pipeline(simulate(interleaved_1f1b(2, 4, 2)))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["F chunk 0", "F chunk 1", "B chunk 0", "B chunk 1", "bubble"]
    fig = V.draw_pipeline(simulate(one_f_one_b(2, 4)))
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["F", "B", "bubble"]


@pytest.mark.parametrize("v, memory", [(2, True), (4, True), (12, True), (12, False)])
def test_legend_stays_below_the_time_axis(v, memory):
    """Interleaved with v = 12 (notebook 17's 910B choice) has 25 legend entries in 4 rows:
    they sat over the time axis's ticks and label; the figure grows to hold them."""
    fig = V.draw_pipeline(simulate(interleaved_1f1b(8, 16, v)), memory=memory)
    fig.draw_without_rendering()
    legend = fig.legends[0].get_window_extent()
    axis = fig.axes[-1].get_tightbbox()            # the lowest axes, ticks and label in
    assert legend.y0 >= 0 and legend.y1 <= axis.y0, (legend, axis)


@pytest.mark.parametrize("sched", [one_f_one_b(4, 8), interleaved_1f1b(4, 8, 2),
                                   interleaved_1f1b(4, 8, 4), zb_h1(4, 16)])
def test_each_label_fits_inside_its_block(sched):
    """A micro-batch number is written only where it fits in its block: at v = 4 the
    numbers ran into each other (one block narrower than a digit)."""
    r = simulate(sched, f=1 / sched.v, b=1 / sched.v, w=1 / sched.v)
    fig = V.draw_pipeline(r, dpi=80)
    fig.draw_without_rendering()
    ax = fig.axes[0]
    labels = artists(fig, "labels")
    blocks = [(t, t + d, rk) for t, d, rk in zip(r.blocks.start.tolist(),
                                                r.blocks.duration.tolist(), r.blocks.rank.tolist())]
    for label in labels:
        x, y = label.get_position()
        t0, t1, _ = next(b for b in blocks if b[2] == y and b[0] < x < b[1])
        left, right = ax.transData.transform([(t0, y), (t1, y)])[:, 0]
        box = label.get_window_extent()
        assert left <= box.x0 and box.x1 <= right, (label.get_text(), t0, t1)
    if sched.v == 4:                       # 0.25 units a block over 26 units: no room
        assert len(labels) < len(blocks)
    else:                                  # room for every number
        assert len(labels) == len(blocks)


def test_memory_panel_counts_chunks_where_a_rank_holds_several():
    fig = V.draw_pipeline(simulate(interleaved_1f1b(4, 8, 2)))
    axm = fig.axes[1]
    assert axm.get_ylabel() == "chunks\nin flight"
    assert any(t.get_text() == " peak 11 chunks = 5.5 micro-batches" for t in axm.texts)
    assert all(float(y).is_integer() for y in axm.get_yticks())      # a count
    fig = V.draw_pipeline(simulate(one_f_one_b(4, 8)))
    assert fig.axes[1].get_ylabel() == "activations\nin flight"
    assert any(t.get_text() == " peak 4" for t in fig.axes[1].texts)


def test_explorer_gives_every_schedule_the_same_work():
    """Interleaved chunks cost 1/v of a stage: the explorer's time axes compare (its
    interleaved step was v times the work of 1F1B's, drawn twice as long)."""
    pytest.importorskip("ipywidgets")
    w = V.pipeline_widget(p=4, m=8, v=2, schedule="1F1B")
    busy = w.result.busy
    w.controls["schedule"].value = "Interleaved 1F1B"
    assert w.result.busy == busy == (24.0,) * 4                     # m (f + b + w) per rank
    ref = simulate(interleaved_1f1b(4, 8, 2), f=0.5, b=0.5, w=0.5)
    assert w.result.makespan == ref.makespan == 28.5 < simulate(one_f_one_b(4, 8), w=1.0).makespan
    w.controls["v"].value = 4
    assert w.result.busy == busy


def test_large_schedule_draws_without_labels():
    r = simulate(one_f_one_b(64, 1024))
    fig = V.draw_pipeline(r)
    assert count(artists(fig, "blocks")[0]) == 2 * 64 * 1024
    assert artists(fig, "labels") == []


def test_module_examples_run():
    import doctest
    assert doctest.testmod(V).failed == 0


def wcag(a, b):
    """WCAG 2.1 contrast ratio, written here apart from the module's (held to it below)."""
    def lum(c):
        c = np.array(to_rgba(c)[:3])
        c = np.where(c <= 0.03928, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
        return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]
    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_memory_lines_read_on_white(p):
    """The activations-in-flight lines were viridis: the last rank's pale yellow had a
    1.3:1 contrast on the white page.  Every line now has at least 3:1 (WCAG 2.1's
    minimum for graphics), and neighbouring ranks differ."""
    fig = V.draw_pipeline(simulate(one_f_one_b(p, 2 * p)))
    lines = [ln for ln in fig.axes[1].get_lines() if str(ln.get_gid()).startswith("memory-")]
    assert len(lines) == p
    colors = [ln.get_color() for ln in lines]
    assert min(wcag(c, "white") for c in colors) >= 3.0, colors
    assert all(not np.allclose(to_rgba(a), to_rgba(b)) for a, b in zip(colors, colors[1:]))


def test_contrast_is_wcag():
    assert V.contrast("black", "white") == pytest.approx(21.0)
    assert V.contrast("#767676", "white") == pytest.approx(4.54, abs=0.01)   # WCAG's example
    for c in ("#3a78b5", "#e8862a", (0.2, 0.5, 0.1)):
        assert V.contrast(c, "white") == pytest.approx(wcag(c, "white"))


@pytest.mark.parametrize("sched", [interleaved_1f1b(4, 8, 2), zb_h1(4, 8), one_f_one_b(4, 8)])
def test_block_numbers_read_on_their_block(sched):
    """White on the backward's orange was 2.7:1; each number is now black or white,
    whichever reads better on its block: at least 4.5:1 (WCAG AA for text)."""
    r = simulate(sched, f=1, b=1, w=1 if sched.split_backward else None)
    fig = V.draw_pipeline(r)
    (blocks,) = artists(fig, "blocks")
    fills = {}
    for path, face in zip(rects(blocks), blocks.get_facecolors()):
        for x0, x1, y in path:
            fills[(round((x0 + x1) / 2, 6), round(y))] = face
    labels = artists(fig, "labels")
    assert labels
    for t in labels:
        x, y = t.get_position()
        assert wcag(t.get_color(), fills[(round(x, 6), round(y))]) >= 4.5, t.get_text()


def test_legend_of_many_chunks_names_the_first_and_the_lightest():
    """Notebook 17's v = 12 legend had 24 chunk swatches in 4 rows, neighbours too alike to
    tell apart: beyond 4 chunks it names chunk 0 and the lightest, the rest between."""
    fig = V.draw_pipeline(simulate(interleaved_1f1b(8, 16, 12)))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["F chunk 0", "F chunk 11 (1-10 between)", "B chunk 0",
                      "B chunk 11 (1-10 between)", "bubble"]
    fig = V.draw_pipeline(simulate(interleaved_1f1b(4, 8, 4)))          # 4: one per chunk
    assert len(fig.legends[0].get_texts()) == 2 * 4 + 1
