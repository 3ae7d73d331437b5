"""Log axes label their ticks with the values (1, 2, 4 ... 1K, 2K; 1, 10, 100, 1,000), not
2^10 or 10^3: read from the drawn figure's tick labels, not from pixels."""
import matplotlib
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

import workbench as wb
from workbench.viz import charts as C
from workbench.viz.ticks import log_axis, tick_label


def drawn_labels(axis):
    """The (value, label) of every major tick inside the axis's view, after a draw."""
    FigureCanvasAgg(axis.axes.figure).draw()
    lo, hi = sorted(axis.get_view_interval())
    return [(t.get_loc(), t.label1.get_text()) for t in axis.get_major_ticks()
            if lo <= t.get_loc() <= hi]


def minor_labels(axis):
    return [t.label1.get_text() for t in axis.get_minor_ticks() if t.label1.get_text()]


@pytest.mark.parametrize("value, base, want", [
    (1, 2, "1"), (2, 2, "2"), (32, 2, "32"), (512, 2, "512"), (1024, 2, "1K"),
    (8192, 2, "8K"), (2 ** 19, 2, "512K"), (2 ** 20, 2, "1M"), (2 ** 30, 2, "1G"),
    (2 ** 41, 2, "2T"), (0.5, 2, "0.5"), (0.125, 2, "0.125"), (1024.0000000000002, 2, "1K"),
    (1, 10, "1"), (10, 10, "10"), (1000, 10, "1,000"), (10000, 10, "10,000"),
    (1e6, 10, "1,000,000"), (0.1, 10, "0.1"), (0.01, 10, "0.01"), (999.9999999999999, 10, "1,000"),
])
def test_tick_label_is_the_value(value, base, want):
    assert tick_label(value, base=base) == want


def test_tick_label_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="base=3"):
        tick_label(9, base=3)
    with pytest.raises(ValueError, match="value=nan"):
        tick_label(float("nan"), base=2)
    with pytest.raises(ValueError, match="value=True"):
        tick_label(True, base=2)
    with pytest.raises(ValueError, match=r"log_axis\(base='e'\)"):
        log_axis(C.lines([1, 2], {"s": [1.0, 2.0]}).axes[0].xaxis, "e")
    assert tick_label(0.0, base=10) == ""


def test_lines_logx_labels_powers_of_two_as_numbers():
    """Notebook 10's chunks k = 1 ... 32 and hidden sizes 1,024 ... 8,192 (also 07's
    micro-batches, 14's sequence lengths): 1, 2, 4 ... 32 and 1K ... 8K."""
    fig = C.lines([1, 2, 4, 8, 16, 32], {"s": [0.0, 0.2, 0.4, 0.5, 0.6, 0.7]}, logx=True)
    ticks = drawn_labels(fig.axes[0].xaxis)
    assert [s for _, s in ticks] == ["1", "2", "4", "8", "16", "32"]
    assert fig.axes[0].xaxis.get_minorticklocs().size == 0          # no minor ticks
    fig = C.lines([1024, 2048, 4096, 8192], {"s": [0.6, 0.7, 0.75, 0.75]}, logx=True)
    assert [s for _, s in drawn_labels(fig.axes[0].xaxis)] == ["1K", "2K", "4K", "8K"]


def test_lines_logx_over_many_octaves_reads_in_binary_units():
    """Notebook 03's message sizes, 1 KiB to 1 GiB: every label is its tick's value in K,
    M or G (powers of 1,024), none in 2^n; the ticks sit at the points (charts.lines puts
    them there: the locator's every third octave fell between the points, nb18)."""
    x = [2 ** p for p in range(10, 31, 2)]
    fig = C.lines(x, {"busbw": [float(p) for p in range(len(x))]}, logx=True)
    ticks = drawn_labels(fig.axes[0].xaxis)
    assert len(ticks) >= 5
    units = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    for loc, text in ticks:
        number, unit = (text[:-1], text[-1]) if text[-1] in "KMG" else (text, "")
        assert float(number) * units[unit] == pytest.approx(loc), (loc, text)
        assert "^" not in text and "$" not in text
    assert [s for _, s in ticks] == ["1K", "4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M",
                                     "256M", "1G"]


def test_lines_logy_and_roofline_and_bars_label_powers_of_ten_as_numbers():
    fig = C.lines([1, 2, 4], {"s": [1.0, 100.0, 3000.0]}, logy=True)
    ticks = drawn_labels(fig.axes[0].yaxis)
    assert [s for _, s in ticks] == ["1", "10", "100", "1,000"]
    assert minor_labels(fig.axes[0].yaxis) == []                   # minor ticks unlabelled

    npu = wb.get_profile("ascend-910b")
    fig = C.roofline([npu], {"gelu": dict(flops=2e9, bytes_moved=1e9),
                             "matmul": dict(flops=2.7e12, bytes_moved=1e9)})
    ax = fig.axes[0]
    xs, ys = drawn_labels(ax.xaxis), drawn_labels(ax.yaxis)
    for loc, text in xs + ys:
        assert text == tick_label(loc, base=10) and "^" not in text
    assert [s for _, s in xs][:5] == ["1", "10", "100", "1,000", "10,000"]
    assert [s for _, s in ys] == ["1", "10", "100"]
    assert minor_labels(ax.xaxis) == minor_labels(ax.yaxis) == []

    fig = C.bars({"a": {"x": 5.0, "y": 300.0, "z": 2800.0}}, unit="GB", log=True)
    ticks = drawn_labels(fig.axes[0].xaxis)
    assert [s for _, s in ticks] == ["10", "100", "1,000", "10,000"]
    assert all(text == tick_label(loc, base=10) for loc, text in ticks)


def test_a_linear_axis_is_left_to_matplotlib():
    fig = C.lines([1, 2, 4], {"s": [1.0, 2.0, 3.0]})
    assert not isinstance(fig.axes[0].xaxis.get_major_formatter(),
                          matplotlib.ticker.FuncFormatter)


def test_the_module_example_runs():
    import doctest

    from workbench.viz import ticks
    assert doctest.testmod(ticks).attempted == 1 and doctest.testmod(ticks).failed == 0
