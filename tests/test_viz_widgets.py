"""The placement and reshard pickers: redraw on a change, show a PNG when headless."""
import pytest

import workbench as wb
from workbench.viz.widgets import placement_picker, reshard_picker

pytest.importorskip("ipywidgets")


def test_placement_picker_redraws_and_degrades_to_png():
    mesh = wb.Mesh.grid((2, 3), ("dp", "tp"))
    p = placement_picker((4, 3), mesh, ["S(0)", "S(1)"])
    assert p.text == "f32[I_dp, J_tp]"
    bundle = p._repr_mimebundle_()
    assert bundle["image/png"] and bundle["text/plain"] == "f32[I_dp, J_tp]"
    first, image = p.figure, p.image
    p.controls[1].value = "R"
    assert p.text == "f32[I_dp, J]" and p.figure is not first
    assert p.image is image and p.image.value[:4] == b"\x89PNG"      # replaced in place
    assert "f32[I_dp, J]" in p.textbox.value
    assert p.placements == (wb.Shard(0), wb.Replicate())


def test_reshard_picker_shows_the_plan_and_errors():
    mesh = wb.Mesh.grid(4, ["x"])
    r = reshard_picker((8, 4), mesh, ["S(0)"], ["R"], profile="ascend-910b")
    assert r.plan.collectives() == ["all_gather"] and "all_gather" in r.text
    r.dst[0].value = "S(1)"
    assert r.plan.collectives() == ["all_to_all"]
    r.src[0].value = "P(sum)"
    assert r.plan.collectives() == ["reduce_scatter"]
    assert "image/png" in r._repr_mimebundle_()


def test_widget_images_keep_their_own_size():
    """In a VBox an image is stretched to the full width (the 02 picker's 472 px PNG was
    shown 968 px wide, blurred): every explorer's image is aligned to the start, at most
    as wide as its area, and drawn at the static figures' 100 dpi."""
    from workbench.viz.pipeline import pipeline_widget
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    for w in (placement_picker((4, 4), mesh, ["S(0)", "R"]),
              reshard_picker((4, 4), mesh, ["S(0)", "R"], ["R", "R"]), pipeline_widget()):
        assert w.image.layout.align_self == "flex-start" and w.image.layout.max_width == "100%"
    assert placement_picker((4, 4), mesh).figure.dpi == 100
