"""Memory bars and the memory widget: they draw the planner's numbers, redraw in place,
say why a choice is not a layout, and carry a PNG for static front ends."""
import pytest

import workbench as wb
from workbench.plan.memory import model_state_bytes, stage_memory
from workbench.viz.memory import PARTS, memory_bars, memory_widget, stage_rows

from .figure_checks import covered, crossed

GPT3 = wb.models.get_config("gpt3-175b")


def _gids(fig, gid):
    return [a for ax in fig.axes for a in ax.get_children() if a.get_gid() == gid]


def test_bars_stack_the_parts_and_mark_the_limit():
    rows = {f"ZeRO-{z}": model_state_bytes(7.5e9, 64, z) for z in range(4)}
    fig = memory_bars(rows, limit=80e9)
    segs = _gids(fig, "segment")
    assert len(segs) == 3 * 4                # 3 parts > 0 in each row; no activations
    one = memory_bars({"a": {"params": 1e9, "grads": 0.0, "activations": 2e9}})
    assert [s.get_width() for s in _gids(one, "segment")] == [1.0, 2.0]   # empty parts skipped
    widths = sorted(round(s.get_width(), 6) for s in segs)
    assert max(widths) == pytest.approx(90.0)          # 12 x 7.5e9 bytes of Adam, in GB
    totals = [t.get_text().strip() for t in _gids(fig, "total")]
    assert totals == ["120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"]
    assert [t.get_color() for t in _gids(fig, "total")][:2] == ["#c00000", "#222222"]
    assert len(_gids(fig, "limit")) == 1


def test_bars_reject_bad_rows():
    with pytest.raises(ValueError, match="give"):
        memory_bars({})
    with pytest.raises(ValueError, match="params=-1"):
        memory_bars({"x": {"params": -1}})
    with pytest.raises(ValueError, match="limit"):
        memory_bars({"x": {"params": 1.0}}, limit=0)


def test_stage_rows_are_the_planners():
    lay = wb.plan.Layout(dp=8, tp=8, pp=16, recompute="selective", global_batch=1536)
    rows = stage_rows(GPT3, lay)
    assert list(rows) == ["stage 0 (first)", "stage 8 (middle)", "stage 15 (last)"]
    assert rows["stage 8 (middle)"] == stage_memory(GPT3, lay, 8)
    assert list(stage_rows(GPT3, lay.replace(pp=4, dp=32))) == [
        "stage 0 (first)", "stage 2 (middle)", "stage 3 (last)"]
    assert list(stage_rows(GPT3, lay.replace(pp=1, dp=128))) == ["stage 0 (only)"]


def test_widget_redraws_in_place_and_explains_errors():
    pytest.importorskip("ipywidgets")
    w = memory_widget(GPT3, 1024, "ascend-910b", tp=8, pp=16)
    assert "does NOT fit" in w.message and w.rows["stage 0 (first)"]["total"] > 64e9
    image, first = w.image, w.figure
    w.controls["recompute"].value = "full"      # selective: 60.9 GB with HCCL's buffers
    assert "fits" in w.message and "NOT" not in w.message
    assert w.image is image and w.figure is not first and image.value[:4] == b"\x89PNG"
    w.controls["zero"].value = 2                         # ZeRO-2 with a pipeline
    assert w.figure is None and "zero<=1 or pp=1" in w.message
    assert image.layout.visibility == "hidden" and "zero" in w.status.value
    w.controls["zero"].value = 1
    w.controls["tp"].value = 1024                          # 1024 x 16 > devices
    assert w.figure is None and "16384 is more than the 1024 devices" in w.message
    assert "divide" not in w.message
    w.controls["tp"].value = 8
    bundle = w._repr_mimebundle_()
    assert bundle["image/png"] and "dp8 tp8 pp16" in bundle["text/plain"]
    assert set(PARTS) <= set(w.rows["stage 0 (first)"])


def test_sp_is_greyed_out_where_it_changes_nothing():
    """At TP = 1 sequence parallelism changes nothing (the layout drops it): its box is
    disabled, and enabled again after.  The schedule stays enabled at PP = 1: there it is
    the order of gradient accumulation, and GPipe's holds every micro-batch."""
    pytest.importorskip("ipywidgets")
    w = memory_widget(GPT3, 1024, "ascend-910b", tp=8, pp=16)
    c = w.controls
    c["sp"].value = True
    assert not c["sp"].disabled and " sp " in w.message
    c["tp"].value = 1
    assert c["sp"].disabled and " sp " not in w.message            # the layout has no SP
    c["tp"].value = 8
    assert not c["sp"].disabled and " sp " in w.message
    c["pp"].value = 1
    one_f_one_b = w.rows["stage 0 (only)"]["activations"]
    c["schedule"].value = "gpipe"
    assert not c["schedule"].disabled
    assert w.rows["stage 0 (only)"]["activations"] == pytest.approx(w.layout().m * one_f_one_b)


def test_limit_label_stays_inside_the_figure():
    """The device-memory label sits beside its line inside the plot, never past its right
    edge (where the figure clips it), whether the bars end left of the limit or right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    for total in (55.2e9, 20e9, 200e9):
        fig = memory_bars({"a": {"params": total}}, limit=64e9,
                          limit_label="Ascend 910B (Atlas 800T A2), device memory")
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        (text,) = fig.findobj(lambda a: a.get_gid() == "limit_label")
        box, edge = text.get_window_extent(canvas.get_renderer()), fig.axes[0].bbox
        assert edge.x0 <= box.x0 and box.x1 <= edge.x1, (total, box, edge)


def test_fits_means_under_the_usable_memory():
    """The planner's fits compares with Profile.usable_memory (the device's memory less the
    runtime's context and fragmentation); the bars mark it and the widget says it."""
    fig = memory_bars({"a": {"params": 62e9}}, limit=64e9, usable=60e9)
    (total,) = fig.findobj(lambda a: a.get_gid() == "total")
    assert total.get_color() == "#c00000"              # past the usable 60, under the 64
    assert len(fig.findobj(lambda a: a.get_gid() == "usable")) == 1
    (label,) = fig.findobj(lambda a: a.get_gid() == "usable_label")
    assert label.get_text().strip() == "usable 60.0 GB"
    with pytest.raises(ValueError, match="usable=70000000000.0 must be bytes > 0 and at most"):
        memory_bars({"a": {"params": 1.0}}, limit=64e9, usable=70e9)
    pytest.importorskip("ipywidgets")
    w = memory_widget(GPT3, 1024, "ascend-910b", tp=8, pp=16, recompute="selective")
    usable = w.cluster.profile.usable_memory()
    assert f"of the {usable / 1e9:.1f} GB usable (64 GB device)" in w.message
    for rc in ("none", "selective", "full"):
        w.controls["recompute"].value = rc
        lay = w.layout()
        est = wb.plan.estimate(GPT3, lay, wb.plan.Cluster("ascend-910b", 1024))
        assert ("does NOT fit" not in w.message) == est.fits, (rc, w.message)


def test_every_part_in_the_legend_inside_the_figure():
    """With all seven parts (the workspace's label the longest of a row) the legend takes
    fewer columns rather than run past the figure's edges, where it would be clipped; the
    workspace is hatched, and the totals' white boxes start right of the bars' ends, so a
    sliver of workspace at a bar's end stays visible."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    lay = wb.plan.Layout(dp=8, tp=8, pp=16, recompute="selective", global_batch=1536)
    rows = stage_rows(GPT3, lay, profile=wb.sim_mesh.get_profile("ascend-910b"))
    assert all(r["workspace"] > 0 and r["comm_buffers"] > 0 for r in rows.values())
    for width in (7.5, 5.0, 12.0):
        fig = memory_bars(rows, limit=64e9, usable=60e9, width=width)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        (legend,) = fig.legends
        box = legend.get_window_extent(canvas.get_renderer())
        assert 0 <= box.x0 and box.x1 <= fig.bbox.x1, (width, box, fig.bbox)
        assert len(legend.get_texts()) == len(PARTS)
        assert any("workspace" in t.get_text() for t in legend.get_texts())
    segs = _gids(fig, "segment")
    hatched = [s for s in segs if s.get_hatch()]
    assert len(hatched) == len(rows)                   # one workspace segment a bar
    renderer = canvas.get_renderer()
    for total, bar_end in zip(_gids(fig, "total"), [s for s in segs if s.get_hatch()]):
        text_box = total.get_bbox_patch().get_window_extent(renderer)
        assert text_box.x0 > bar_end.get_window_extent(renderer).x1


def test_no_line_runs_through_a_total():
    """Notebook 17's 910B choice: 58.5 GB of a 64 GB device, 60.0 GB usable; the dotted
    usable line and the dashed limit ran through "58.5 GB".  A total starts right of the
    last line it would meet; every label stays inside the plot and off the bars."""
    rows = {"first": {"params": 21.5e9, "activations": 37.0e9},
            "middle": {"params": 20.5e9, "activations": 34.0e9},
            "last": {"params": 21.5e9, "activations": 31.9e9}}
    fig = memory_bars(rows, limit=64e9, usable=60e9, limit_label="910B")
    assert crossed(fig, {"limit", "usable"}) == []
    assert covered(fig, "segment") == []
    totals = _gids(fig, "total")
    assert [t.get_text() for t in totals] == ["58.5 GB", "54.5 GB", "53.4 GB"]
    assert totals[0].xy[0] == 64.0                                   # past both lines


def test_usable_label_stays_inside_when_the_bars_run_far_past_the_device():
    """GPipe or ZeRO-0 at PP = 1 in notebook 11's widget (400 GB bars): the usable line
    lies near 0 and its label ran left out of the axes, over the row names (found in the
    browser); it moves right of the lines and says which one it names."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    for rows in ({"stage 0 (only)": {"params": 400e9}},
                 {"a": {"params": 62e9}, "b": {"params": 30e9}}):
        fig = memory_bars(rows, limit=64e9, usable=60e9)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        (label,) = fig.findobj(lambda a: a.get_gid() == "usable_label")
        box, edge = label.get_window_extent(canvas.get_renderer()), fig.axes[0].bbox
        assert edge.x0 <= box.x0 and box.x1 <= edge.x1, (rows, box, edge)
        assert "usable 60.0 GB" in label.get_text()


def test_device_memory_reads_with_one_decimal_at_most():
    """An A100 80GB's memory is what CUDA reports, 85.094e9 bytes: the bars' label and the
    widget's line said '85.094 GB' where the notebooks' prose says 85.1 (student review of
    notebook 11); round numbers stay whole (64 GB)."""
    for limit, shown in ((85.094e9, "A100 85.1 GB"), (64e9, "A100 64 GB")):
        fig = memory_bars({"a": {"params": 1e9}}, limit=limit, limit_label="A100")
        (text,) = fig.findobj(lambda a: a.get_gid() == "limit_label")
        assert text.get_text() == shown
    w = memory_widget(GPT3, 1024, "a100", tp=8, pp=16, recompute="selective")
    assert "(85.1 GB device)" in w.message, w.message
