"""The timeline draws what the modeled clock recorded: checked through the artists."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.parallel.strategies.overlap import (exposed_intervals,  # noqa: E402
                                                   matmul_all_reduce)
from workbench.parallel.strategies.overlap_sweep import meta_inputs  # noqa: E402
from workbench.parallel.strategies.overlap_multicopy import multi_copy_estimate  # noqa: E402
from workbench.viz import timeline as T  # noqa: E402

MESH = wb.Mesh.grid((2, 2), ("dp", "tp"))


def report(k=3, profile="ascend-910b"):
    x, w = meta_inputs(matmul_all_reduce, (4096, 4096, 4096), MESH, "tp")
    return matmul_all_reduce(x, w, MESH, "tp", chunks=k, profile=profile)[1]


def artists(fig, gid):
    return [a for a in fig.axes[0].get_children() if a.get_gid() == gid]


def bars(fig, gid):
    """(x0, x1, y_center) of every rectangle in the collection with this gid, sorted."""
    (coll,) = artists(fig, gid)
    out = []
    for path in coll.get_paths():
        v = path.vertices[:4]
        out.append((v[:, 0].min(), v[:, 0].max(), (v[:, 1].min() + v[:, 1].max()) / 2))
    return sorted(out), coll


def test_bars_sit_where_the_events_are():
    rep = report()
    fig = T.draw_timeline(rep)
    unit, scale = T.time_unit(rep.total)
    assert unit == "ms"
    t0 = min(e.start for e in rep.events)
    ranks = sorted({r for e in rep.events for r in e.ranks})
    for stream, row in (("compute", 0), ("comm", 1)):
        drawn, coll = bars(fig, stream)
        want = sorted(((e.start - t0) * scale, (e.end - t0) * scale, 2 * i + row)
                      for i, r in enumerate(ranks) for e in rep.events
                      if e.stream == stream and r in e.ranks)
        assert len(drawn) == (3 * 4 if stream == "compute" else 3 * 4)
        assert np.allclose(drawn, want)
        assert np.allclose(coll.get_facecolors()[0], to_rgba(T.STREAM_COLORS[stream]))
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[:2] == ["rank 0 compute", "rank 0 comm"] and len(labels) == 8


def test_exposed_overlay_and_caption():
    rep = report(k=4)
    fig = T.draw_timeline(rep)
    unit, scale = T.time_unit(rep.total)
    t0 = min(e.start for e in rep.events)
    drawn, coll = bars(fig, "exposed")
    want = sorted(((s - t0) * scale, (e - t0) * scale, 2 * i + 1)
                  for i in range(4) for s, e in exposed_intervals(rep.events, i))
    assert drawn and np.allclose(drawn, want)
    assert np.allclose(coll.get_facecolors()[0], to_rgba(T.EXPOSED_COLOR))
    assert sum(x1 - x0 for x0, x1, y in drawn if y == 1) == pytest.approx(rep.exposed * scale)
    (cap,) = artists(fig, "caption")
    assert cap.get_text() == T.caption(rep)
    assert cap.get_text().startswith(f"comm hidden {rep.hidden_share:.1%} (")
    assert f"exposed {rep.exposed * 1e3:.3f} ms" in cap.get_text()
    assert fig.axes[0].get_title(loc="left") == "matmul_all_reduce  k=4"


def test_labels_only_where_they_fit():
    rep = multi_copy_estimate(2, 2048, 4096, 32, 16384, wb.Mesh.grid(8, ("tp",)), 0,
                              profile="ascend-910b").forward
    fig = T.draw_timeline(rep, ranks=[0])
    texts = sorted(t.get_text() for t in artists(fig, "labels"))
    assert "attention A" in texts and "ffn B" in texts
    assert len(texts) == 8                         # 4 compute + 4 comm bars on rank 0
    assert artists(T.draw_timeline(rep, ranks=[0], labels=False), "labels") == []


def test_accepts_a_trace_and_events_and_is_deterministic():
    x, w = meta_inputs(matmul_all_reduce, (1024, 1024, 1024), MESH, "tp")
    with wb.trace(profile="a100") as tr:
        matmul_all_reduce(x, w, MESH, "tp", chunks=2)
    a, b = T.draw_timeline(tr), T.draw_timeline(list(tr.events))
    assert a._repr_png_() == T.draw_timeline(tr)._repr_png_()
    assert a._repr_png_()[:4] == b"\x89PNG"
    assert "a100" in a.axes[0].get_xlabel() and b.axes[0].get_xlabel().endswith("profile)")
    assert len(bars(a, "compute")[0]) == 2 * 4
    with pytest.raises(TypeError, match="Trace, an OverlapReport or a list of Events"):
        T.draw_timeline(42)
    with pytest.raises(ValueError, match=r"ranks=\[9\]: \[9\] recorded no events"):
        T.draw_timeline(tr, ranks=[9])


def test_text_rendering():
    E = wb.Event
    ev = [E("mm", "compute", 0.0, 4e-3, (0,)), E("ar", "comm", 2e-3, 4e-3, (0,))]
    lines = T.render_text(ev, width=6).splitlines()
    assert lines[0].startswith("trace on ?   (1 char = 1 ms;")
    assert lines[1] == "rank 0 compute |####..|"
    assert lines[2] == "rank 0 comm    |..==!!|"
    # a cell shows what fills at least half of it: 0.75 ms cells
    assert T.render_text(ev, width=8).splitlines()[1:3] == ["rank 0 compute |#####...|",
                                                            "rank 0 comm    |...==!!!|"]
    assert lines[3] == "comm hidden 50.0% (2.000 of 4.000 ms) | exposed 2.000 ms | total 6.000 ms"
    rep = report(k=2)
    out = T.render_text(rep, ranks=[0, 3], width=40)
    assert out.splitlines()[0].startswith("matmul_all_reduce k=2 on ascend-910b")
    assert [ln.split("|")[0].strip() for ln in out.splitlines()[1:5]] == [
        "rank 0 compute", "rank 0 comm", "rank 3 compute", "rank 3 comm"]
    assert all(len(ln.split("|")[1]) == 40 for ln in out.splitlines()[1:5])
    with pytest.raises(ValueError, match="width=0"):
        T.render_text(rep, width=0)


@pytest.mark.parametrize("ranks", [[0], [0, 1, 2, 3]])
def test_a_long_title_never_runs_into_the_caption(ranks):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig = T.draw_timeline(report(), ranks=ranks,
                          title="a long title: multi-copy forward, 2 copies, ascend-910b, tp 8")
    renderer = FigureCanvasAgg(fig).get_renderer()
    title = fig.axes[0]._left_title                      # the Text that set_title(loc="left") set
    assert title.get_text().startswith("a long title")
    (cap,) = artists(fig, "caption")
    a, b = title.get_window_extent(renderer), cap.get_window_extent(renderer)
    assert a.y0 >= b.y1 - 0.5                            # the title sits above the caption
    assert a.y1 <= fig.bbox.height                       # and inside the figure


def test_until_puts_two_steps_on_one_scale():
    """``until`` stretches the axis (and picks its unit) without moving a bar; a span
    shorter than the step, or not a number, is refused with the argument named."""
    short, long_ = report(k=1), report(k=4)
    assert short.total != long_.total
    span = max(short.total, long_.total)
    figs = [T.draw_timeline(r, until=span) for r in (short, long_)]
    unit, scale = T.time_unit(span)
    for fig, rep in zip(figs, (short, long_)):
        assert fig.axes[0].get_xlim() == pytest.approx((0, span * scale))
        assert unit in fig.axes[0].get_xlabel()
        t0 = min(e.start for e in rep.events)
        drawn, _ = bars(fig, "compute")
        assert max(x1 for _, x1, _ in drawn) == pytest.approx(
            max(e.end - t0 for e in rep.events if e.stream == "compute") * scale)
    assert T.draw_timeline(long_).axes[0].get_xlim() == pytest.approx(
        (0, long_.total * T.time_unit(long_.total)[1]))
    # the caption reads in the axis's unit, also where the axis is stretched into a
    # larger unit than the step's own (a step of 29 us on a 0.25 ms axis: ms, not us)
    x, w = meta_inputs(matmul_all_reduce, (1024, 1024, 1024), MESH, "tp")
    step = matmul_all_reduce(x, w, MESH, "tp", chunks=1, profile="a100")[1]
    assert T.time_unit(step.total)[0] == "us"
    fig = T.draw_timeline(step, until=2.5e-4)
    (cap,) = artists(fig, "caption")
    assert "ms" in fig.axes[0].get_xlabel() and " us" not in cap.get_text()
    assert cap.get_text() == T.caption(step, 2.5e-4)
    assert f"total {step.total * 1e3:.3f} ms" in cap.get_text()
    assert T.caption(step).endswith(f"total {step.total * 1e6:.3f} us")
    with pytest.raises(ValueError, match="span="):
        T.caption(step, 0.0)
    for bad in (min(short.total, long_.total) / 2, "1 ms", True):
        with pytest.raises(ValueError, match="until="):
            T.draw_timeline(long_ if bad is not True else short, until=bad)
