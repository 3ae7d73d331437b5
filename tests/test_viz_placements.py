"""workbench.viz.placements: what was drawn (rectangles, positions, sizes, labels,
hatching), checked against the runtime's own offset function; never pixels."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.colors  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.parallel import layout  # noqa: E402
from workbench.viz import placements as vp  # noqa: E402

MESH23 = wb.Mesh([[0, 1, 2], [3, 4, 5]], dim_names=["x", "y"])
MESH4 = wb.Mesh.grid(4, ["dp"])
MESH222 = wb.Mesh.grid((2, 2, 2), ["pp", "dp", "tp"])


def found(fig, gid):
    return fig.findobj(lambda a: a.get_gid() == gid)


def rects(fig, gid="block"):
    """(x, y, width, height) of every rectangle with this gid, sorted."""
    return sorted((r.get_x(), r.get_y(), r.get_width(), r.get_height()) for r in found(fig, gid))


def texts(fig, gid="label"):
    return [t.get_text() for t in found(fig, gid)]


# ---- the data layer -----------------------------------------------------------------------

def test_boxes_come_from_shard_bounds():
    lay = vp.placement_layout((4, 3), MESH23, [wb.Shard(0), wb.Shard(1)])
    for box in lay.boxes:
        assert box.bounds == layout.shard_bounds((4, 3), MESH23, lay.placements, box.rank)
    assert [b.label for b in lay.blocks] == ["0", "1", "2", "3", "4", "5"]
    assert lay.notation == "f32[I_x, J_y]"


def test_layout_accepts_tensor_spec_and_dist_tensor():
    spec = wb.TensorSpec((4, 3), MESH23, ["S(0)", "S(1)"])
    t = wb.shard_tensor(torch.arange(12.0).reshape(4, 3), MESH23, ["S(0)", "S(1)"])
    a, b = vp.placement_layout(spec), vp.placement_layout(t)
    assert a.blocks == b.blocks and a.notation == b.notation
    # the drawn boxes hold exactly the values the runtime keeps on each rank
    full = torch.arange(12.0).reshape(4, 3)
    for box in b.boxes:
        (r0, rn), (c0, cn) = box.bounds
        assert torch.equal(t.local(box.rank), full[r0:r0 + rn, c0:c0 + cn])


def test_replicas_and_partial_groups():
    lay = vp.placement_layout((4, 3), MESH23, [wb.Partial(), wb.Replicate()])
    (block,) = lay.blocks
    assert block.groups == ((0, 3), (1, 4), (2, 5))      # parts summed along x; copies along y
    assert block.label == "0+3,1+4,2+5" and block.partial == ("x",)
    lay = vp.placement_layout((8,), MESH4, ["R"])
    assert lay.blocks[0].label == "0,1,2,3" and lay.blocks[0].partial == ()
    lay = vp.placement_layout((8,), wb.Mesh.grid(8), ["R"])
    assert lay.blocks[0].label == "0,1,2,3,4,..(+3)"    # long labels are shortened
    lay = vp.placement_layout((8,), MESH4, ["P(max)"])
    assert lay.blocks[0].partial == ("dp(max)",)


def test_uneven_and_empty_shards():
    lay = vp.placement_layout((10, 4), MESH4, ["S(0)"])
    assert [b.bounds[0] for b in lay.blocks] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    lay = vp.placement_layout((5,), MESH4, ["S(0)"])
    assert lay.empty_ranks == (3,) and len(lay.blocks) == 3


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="Shard\\(2\\) on a 2-d tensor"):
        vp.placement_layout((4, 3), MESH23, ["S(2)", "R"])
    with pytest.raises(ValueError, match="give a DistTensor or TensorSpec"):
        vp.placement_layout((4, 3))
    with pytest.raises(ValueError, match="shape="):
        vp.placement_layout((4, -1), MESH4, ["R"])


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 3), (2, 2, 2)])
@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 5, 4), (2, 3, 4, 5)])
def test_blocks_tile_the_tensor_exactly(mesh_shape, shape):
    """Every element lies in exactly one block; every non-empty rank holds one block."""
    mesh = wb.Mesh.grid(mesh_shape)
    nd = len(shape)
    for k in range(8):            # a few deterministic placement choices
        ps = [("R", f"S({(k + i) % nd})", "P(sum)")[(k + 2 * i) % 3] for i in range(mesh.ndim)]
        lay = vp.placement_layout(shape, mesh, ps)
        cover = torch.zeros(shape, dtype=torch.int64)
        for b in lay.blocks:
            cover[tuple(slice(s, s + n) for s, n in b.bounds)] += 1
        assert torch.all(cover == 1), ps
        held = sorted(r for b in lay.blocks for r in b.ranks)
        assert held == sorted(set(mesh.ranks) - set(lay.empty_ranks))


# ---- text -------------------------------------------------------------------------------

def test_text_grid_of_rank_numbers():
    assert vp.render_text((4, 3), MESH23, [wb.Shard(0), wb.Shard(1)]) == (
        "f32[I_x, J_y]  shape (4, 3)  [S(0), S(1)]  mesh x=2, y=3\n"
        "      0:1 1:2 2:3\n"
        "  0:2   0   1   2\n"
        "  2:4   3   4   5")


def test_text_uneven_partial_and_facets():
    out = vp.render_text((10,), MESH4, ["S(0)"])
    assert out.splitlines()[1:] == ["    0:3  3:6  6:9 9:10", "      0    1    2    3"]
    out = vp.render_text((4, 3), MESH23, ["P(sum)", "R"])
    assert "0+3,1+4,2+5" in out and "(Partial)" in out and "(Replicate)" in out
    out = vp.render_text((2, 4, 6), MESH23, ["S(0)", "S(2)"])
    assert " [0, :, :]" in out and " [1, :, :]" in out
    assert "empty shard: rank 3" in vp.render_text((5,), MESH4, ["S(0)"])
    assert "(no elements)" in vp.render_text((0, 4), MESH4, ["S(0)"])
    out = vp.render_text((8, 8), MESH222, ["S(0)", "S(1)", "R"])
    assert out.splitlines()[2:4] == ["  0:4 0,1 2,3", "  4:8 4,5 6,7"]


# ---- figures ----------------------------------------------------------------------------

def test_figure_2d_mesh_blocks_at_true_positions():
    fig = vp.draw_placements((4, 3), MESH23, [wb.Shard(0), wb.Shard(1)])
    assert rects(fig) == [(c, r, 1, 2) for c in range(3) for r in (0, 2)]
    blocks = found(fig, "block")
    assert {matplotlib.colors.to_hex(b.get_facecolor()) for b in blocks} == \
        {vp.rank_color(r) for r in range(6)}
    assert all(not b.get_hatch() for b in blocks)
    assert sorted(texts(fig)) == ["0", "1", "2", "3", "4", "5"]
    assert len(found(fig, "mesh-rank")) == 6 and not found(fig, "copy")


def test_figure_uneven_shards_at_true_size():
    fig = vp.draw_placements(wb.TensorSpec((10, 4), MESH4, ["S(0)"]))
    assert rects(fig) == [(0, 0, 4, 3), (0, 3, 4, 3), (0, 6, 4, 3), (0, 9, 4, 1)]
    ax = found(fig, "block")[0].axes
    assert ax.get_ylim() == (10, 0)               # row 0 on top


def test_figure_partial_is_hatched_white_with_a_dot_per_part():
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    fig = vp.draw_placements((4, 4), mesh, [wb.Partial(), wb.Shard(1)])
    blocks = found(fig, "block")
    assert len(blocks) == 2 and all(b.get_hatch() == vp.HATCH for b in blocks)
    assert {matplotlib.colors.to_hex(b.get_facecolor()) for b in blocks} == {vp.PARTIAL_FACE}
    assert sorted(texts(fig)) == ["sum\n0+2", "sum\n1+3"]
    dots = found(fig, "copy")                    # one dot per holding rank
    assert sorted(matplotlib.colors.to_hex(d.get_markerfacecolor()) for d in dots) == \
        sorted(vp.rank_color(r) for r in range(4))
    assert "(Partial)" in texts(fig, "legend")[0]


def test_figure_replicate_is_one_grey_block_listing_the_copies():
    """Replicate must not look like Shard(1): no rank-coloured stripes, one grey block,
    the copies listed and one fixed-size dot per copy."""
    fig = vp.draw_placements((6,), MESH4, ["R"])
    (block,) = found(fig, "block")
    assert (block.get_x(), block.get_width(), block.get_height()) == (0, 6, 1)
    assert matplotlib.colors.to_hex(block.get_facecolor()) == vp.COPY_FACE and not block.get_hatch()
    assert texts(fig) == ["copies\n0,1,2,3"]
    dots = found(fig, "copy")
    assert [matplotlib.colors.to_hex(d.get_markerfacecolor()) for d in dots] == \
        [vp.rank_color(r) for r in range(4)]
    assert all(d.get_markersize() == 7 for d in dots)          # points, not data widths
    from matplotlib.patches import Rectangle
    assert [a for a in fig.findobj(Rectangle) if a.get_gid() == "copy"] == []


def test_all_text_is_at_least_9pt():
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    plan = wb.plan_reshard(wb.TensorSpec((8, 8), mesh, ["P(sum)", "S(1)"]), mesh, ["S(0)", "R"])
    for fig in (vp.draw_reshard(plan), vp.draw_placements((4, 4), mesh, ["P(sum)", "R"])):
        for gid in ("label", "step", "legend", "total"):
            assert all(t.get_fontsize() >= 9 for t in found(fig, gid)), gid


def test_figure_3d_mesh_and_4d_tensor_facets():
    fig = vp.draw_placements((2, 3, 4, 4), MESH222, ["S(0)", "S(1)", "S(3)"])
    titles = sorted(ax.get_title() for ax in fig.axes if ax.get_title().startswith("["))
    # dim 0 split 1, 1 by pp; dim 1 (3 long) split 2, 1 by dp: four facets
    assert titles == ["[0, 0:2, :, :]", "[0, 2, :, :]", "[1, 0:2, :, :]", "[1, 2, :, :]"]
    assert len(found(fig, "block")) == 8          # 4 facets x 2 column blocks (tp)
    assert rects(fig) == sorted([(0, 0, 2, 4), (2, 0, 2, 4)] * 4)
    assert len(found(fig, "mesh-rank")) == 8
    with pytest.raises(ValueError, match="max_facets"):
        vp.draw_placements((20, 4, 4), MESH4, ["R"], max_facets=0)


def test_facet_titles_name_the_leading_block():
    fig = vp.draw_placements((2, 4, 6), MESH23, ["S(0)", "S(2)"])
    assert sorted(ax.get_title() for ax in fig.axes if ax.get_title().startswith("[")) == \
        ["[0, :, :]", "[1, :, :]"]
    assert rects(fig) == sorted([(c, 0, 2, 4) for c in (0, 2, 4)] * 2)


def test_reshard_figure_shows_plan_steps_and_bytes():
    x = wb.TensorSpec((4, 3), MESH23, ["S(0)", "S(1)"])
    plan = wb.plan_reshard(x, MESH23, ["R", "R"], profile="ascend-910b")
    fig = vp.draw_reshard(plan)
    steps = texts(fig, "step")
    assert len(steps) == len(plan.steps) == 2
    for s, text in zip(plan.steps, steps):
        assert text.startswith(f"{plan.steps.index(s) + 1}. {s.kind} on {s.mesh_dim_name}")
        assert f"{s.bytes:,d} B/rank" in text
    assert steps[0].splitlines()[2] == "f32[I_x, J_y] -> f32[I, J_y]"   # the notation edit
    assert texts(fig, "total") == [f"total {plan.total_bytes:,d} B sent per rank, "
                                   f"{plan.total_time * 1e6:.2f} us on ascend-910b"]
    # 6 shards before, 3 column blocks after the first step (the intermediate layout), 1 after
    assert len(found(fig, "block")) == 6 + 3 + 1
    titles = [t.get_text().splitlines()[0] for t in fig.findobj(matplotlib.text.Text)
              if t.get_text().startswith(("before", "after"))]
    assert titles == ["before", "after step 1", "after"]


def test_reshard_cross_mesh_figure_and_text():
    a, b = wb.Mesh([0, 1], ["x"]), wb.Mesh([2, 3], ["x"])
    plan = wb.plan_reshard(wb.TensorSpec((4, 2), a, ["R"]), b, ["S(0)"])
    fig = vp.draw_reshard(plan)
    assert texts(fig, "step")[-1].startswith("2. send_recv (2 pairs)")
    # before: copies on 0, 1; after the local slice: 0 and 1; after send/recv: 2 and 3
    assert texts(fig) == ["copies\n0,1", "0", "1", "2", "3"]
    assert len(found(fig, "mesh-rank")) == 4     # the mesh drawn where it changes
    out = vp.render_reshard_text(plan)
    assert out.startswith("before: f32[I, J]") and "send_recv" in out and "after:  f32[I_x, J]" in out


def test_empty_plan():
    plan = wb.plan_reshard(wb.TensorSpec((4,), MESH4, ["R"]), MESH4, ["R"])
    assert texts(vp.draw_reshard(plan), "step") == ["(nothing to do)"]


def test_deterministic_png_and_show(monkeypatch):
    make = lambda: vp.draw_placements((10, 4), MESH4, ["S(0)"])  # noqa: E731
    assert vp.to_png(make()) == vp.to_png(make())
    shown = []
    import IPython.display
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append((obj, raw)))
    vp.show(make())
    (obj, raw), = shown
    assert raw and list(obj) == ["image/png"] and obj["image/png"][:4] == b"\x89PNG"


def test_legend_names_the_axis_of_the_copies():
    """[P(sum), R] on (x, y): parts of a sum over x, and each sum copied along y; the
    legend says both (notebook 02's picture)."""
    from workbench.viz.placements import render_text
    mesh = wb.Mesh.grid((2, 3), ["x", "y"])
    text = render_text(wb.TensorSpec((4, 3), mesh, ["P(sum)", "R"]))
    assert "0+3,1+4,2+5" in text
    assert "copies a,b: same values on a and b, along y (Replicate)" in text
    assert "reduced over x (Partial); the sums are copies along y" in text
    text = render_text(wb.TensorSpec((4, 3), mesh, ["P(sum)", "S(1)"]))
    assert "copies" not in text and "reduced over x (Partial)" in text
    assert "along x, y" in render_text(wb.TensorSpec((4, 3), mesh, ["R", "R"]))


def test_reshard_figure_keeps_to_a_jupyterlab_output_width():
    """Notebook 03's plans drew one row 14.5-16 inches wide: JupyterLab showed it at 55%,
    its 9 pt text as 5 pt.  Rows now wrap at max_width (8.2 in), the same scale in each,
    and a step's long line breaks before its arrow instead of being clipped."""
    plan = wb.plan_reshard(wb.TensorSpec((4, 3), MESH23, ["S(0)", "S(1)"]), MESH23, ["R", "R"],
                           profile="ascend-910b")
    fig = vp.draw_reshard(plan)
    assert fig.get_figwidth() <= 8.2
    assert len(texts(fig, "step")) == 2 and len(found(fig, "block")) == 6 + 3 + 1
    mesh = wb.Mesh.grid((2, 2, 2), ["dp", "cp", "tp"])
    wide = wb.plan_reshard(wb.TensorSpec((8, 16, 16), mesh, ["S(0)", "S(1)", "R"]), mesh,
                           ["S(0)", "R", "S(2)"])
    fig = vp.draw_reshard(wide)
    assert fig.get_figwidth() <= 8.2
    first = texts(fig, "step")[0].splitlines()
    assert first[1:3] == ["[S(0), S(1), R]", "-> [S(0), S(1), S(2)]"]


@pytest.mark.parametrize("shape, placements", [((64, 256), ["S(1)"]), ((12, 32), ["S(1)"])])
def test_wide_tensor_sits_under_its_title(shape, placements):
    """Notebook 06's (h, 4h) weight and (T, V) logits: every facet row was a whole facet
    width tall, so a wide tensor's blocks sat about 1.2 in below the title, in a band of
    white space (seen in JupyterLab, nbfix06).  The figure is as tall as its blocks and mesh
    need, and the blocks start right under the title."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig = vp.draw_placements(wb.TensorSpec(shape, wb.Mesh.grid(4, ["tp"]), placements),
                             title="a wide tensor")
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle.get_window_extent(renderer)
    blocks = found(fig, "block")[0].axes.get_window_extent(renderer)
    gap_in = (title.y0 - blocks.y1) / fig.dpi
    assert gap_in < 0.6, f"{gap_in:.2f} in of white space between the title and the blocks"
    tall = vp.draw_placements(wb.TensorSpec((256, 64), wb.Mesh.grid(2, ["tp"]), ["S(0)"]))
    assert fig.get_size_inches()[1] < tall.get_size_inches()[1]   # a tall one keeps its height
