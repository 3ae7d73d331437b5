"""The notebooks' charts draw what they are given: bars, lines, the roofline, tile grids."""
import matplotlib
import pytest

import workbench as wb
from workbench.viz import charts as C

from .figure_checks import covered, crossed


def found(fig, gid):
    return fig.findobj(lambda a: a.get_gid() == gid)


def test_bars_one_per_value_and_reference_line():
    fig = C.bars({"a": {"x": 1.0, "y": 2.0}, "b": {"z": 3.0}}, unit="GB", hline=(2.5, "limit"))
    widths = sorted(p.get_width() for p in found(fig, "bar"))
    assert widths == [1.0, 2.0, 3.0] and len(found(fig, "hline")) == 1
    with pytest.raises(ValueError, match="finite"):
        C.bars({"a": {"x": float("nan")}})
    with pytest.raises(ValueError, match="log axis"):
        C.bars({"a": {"x": 0.0}}, log=True)


def test_lines_keep_their_data():
    fig = C.lines([1, 2, 4], {"s": [3.0, 2.0, 1.0]}, hlines=[(0.5, "half")])
    (line,) = found(fig, "line")
    assert list(line.get_xdata()) == [1, 2, 4] and list(line.get_ydata()) == [3.0, 2.0, 1.0]
    with pytest.raises(ValueError, match="3 x values"):
        C.lines([1, 2, 4], {"s": [1.0]})


def test_lines_reference_pairs_share_a_colour_and_lie_beneath():
    """A measurement on its formula stays visible: the formula dashed, beneath, in the
    measurement's colour; one colour per pair (notebook 10's overlap figure)."""
    x = [1, 2, 4]
    fig = C.lines(x, {"a": [0.0, 0.5, 0.7], "b": [0.0, 0.2, 0.3]},
                  reference={"a": ("formula a", [0.0, 0.5, 0.7]),
                             "b": ("formula b", [0.0, 0.25, 0.4])})
    solid, dashed = found(fig, "line"), found(fig, "reference")
    assert [l.get_label() for l in solid] == ["a", "b"]
    assert [l.get_label() for l in dashed] == ["formula a", "formula b"]
    for s, d in zip(solid, dashed):
        assert s.get_color() == d.get_color()
        assert d.get_linestyle() == "--" and s.get_linestyle() == "-"
        assert d.get_zorder() < s.get_zorder() and s.get_marker() == "o"
    assert solid[0].get_color() != solid[1].get_color()
    assert list(dashed[1].get_ydata()) == [0.0, 0.25, 0.4]
    with pytest.raises(ValueError, match="names no series"):
        C.lines(x, {"a": [0.0, 1.0, 2.0]}, reference={"c": ("f", [0.0, 1.0, 2.0])})
    with pytest.raises(ValueError, match="2 values for 3"):
        C.lines(x, {"a": [0.0, 1.0, 2.0]}, reference={"a": ("f", [0.0, 1.0])})


def test_roofline_points_sit_on_each_profile_roof():
    npu = wb.get_profile("ascend-910b")
    work = {"k": dict(flops=1e9, bytes_moved=1e8)}                       # intensity 10
    fig = C.roofline([npu], work)
    (pt,) = found(fig, "point")
    assert pt.get_xdata()[0] == pytest.approx(10)
    assert pt.get_ydata()[0] == pytest.approx(min(npu.peak("bfloat16"), 10 * npu.memory_bandwidth) / 1e12)
    with pytest.raises(ValueError, match="flops > 0"):
        C.roofline([npu], {"bad": dict(flops=0, bytes_moved=1)})


def test_roofline_profiles_with_one_peak_stay_apart():
    """The 910B's and the A100's roofs nearly coincide (313 and 312 TFLOP/s): each profile
    has its own line style and marker, the later ones hollow, so neither hides the other."""
    profs = [wb.get_profile("ascend-910b"), wb.get_profile("a100")]
    fig = C.roofline(profs, {"k": dict(flops=1e12, bytes_moved=1e9)})   # on both flat roofs
    roofs, points = found(fig, "roof"), found(fig, "point")
    assert [r.get_linestyle() for r in roofs] == ["-", "--"]
    assert [p.get_marker() for p in points] == ["o", "s"]
    assert points[1].get_markerfacecolor() == "none"
    assert points[1].get_markersize() > points[0].get_markersize()
    legend = fig.axes[0].get_legend()
    assert [h.get_marker() for h in legend.legend_handles] == ["o", "s"]


def test_tile_grid_colours_each_tile_by_its_kind():
    plan = wb.ops.attention_tiles(512, causal=True, tile_q=128, tile_k=128)
    fig = C.tile_grid({"causal": plan})
    tiles = found(fig, "tile")
    assert len(tiles) == 16
    colours = [matplotlib.colors.to_hex(t.get_facecolor()) for t in tiles]
    assert colours.count(C.TILE_COLORS["skip"]) == plan.skipped
    assert "10 of 16 tiles computed" in fig.axes[0].get_title()


def test_deterministic_png():
    make = lambda: C.lines([1, 2], {"a": [1.0, 2.0]})   # noqa: E731
    assert C.to_png(make()) == C.to_png(make())


# ---- readable labels: no reference line through a number, nothing clipped or covered ----
# notebook 01 (GPT-3 against one A100, log axis), 05 (ZeRO, linear), 14 (an even share)
CASES = [dict(groups={"model states": {"GPT-3": 2794.0},
                      "activations per GPU": {"none": 275.0, "tp": 55.6, "tp+sp": 34.4,
                                              "tp+sp+selective": 10.3, "full": 4.83}},
              unit="GB", hline=(80.0, "one A100 (80 GB)"), log=True),
         dict(groups={"formula": {"stage 0": 120.0, "stage 1": 31.4, "stage 2": 16.6,
                                  "stage 3": 1.88}},
              unit="GB", hline=(80.0, "one A100 (80 GB)")),
         dict(groups={"token-slots routed": {f"expert {i}": float(n) for i, n in
                                             enumerate([70, 56, 45, 108, 44, 87, 43, 59])}},
              hline=(64.0, "even share")),
         dict(groups={"a": {"x": 77.0, "y": 1000.0}}, unit="GB",               # label at the
              hline=(995.0, "a reference line with a long label"))]             # right edge


@pytest.mark.parametrize("case", CASES)
def test_bar_labels_are_never_crossed_covered_or_clipped(case):
    """Notebook 01's "55.6 GB" was crossed by the dashed 80 GB line, its "one A100 (80 GB)"
    sat on the GPT-3 bar: a value label starts right of the line where the line would run
    through it, the line's label has a row of its own, the legend sits below the plot."""
    fig = C.bars(**case)
    assert crossed(fig, {"hline"}) == []
    assert covered(fig) == []
    values = sorted(float(t.get_text().split()[0].replace(",", "")) for t in found(fig, "value"))
    assert values == sorted(v for d in case["groups"].values() for v in d.values())
    assert C.to_png(fig) == C.to_png(C.bars(**case))          # the same PNG every time


def test_a_label_moved_past_the_line_stays_in_its_row():
    fig = C.bars({"a": {"x": 70.0, "y": 10.0}}, unit="GB", hline=(80.0, "one A100"), log=True)
    moved, kept = found(fig, "value")
    assert moved.xy == (80.0, 0.0) and kept.xy == (10.0, 1.0)       # past the line, same row


def test_bar_numbers_keep_their_precision():
    """Notebook 17's step-time bars read "15.4 s" beside "16 s" (15.996 rounded): a
    rounded-away zero is kept; an exact 70 or a paper's 1.9 gets none added."""
    fig = C.bars({"a": {"x": 15.996, "y": 70.0, "z": 1.9, "w": 0.10449, "v": 2794.4}}, unit="s")
    assert [t.get_text() for t in found(fig, "value")] == ["16.0 s", "70 s", "1.9 s",
                                                            "0.104 s", "2,794 s"]
