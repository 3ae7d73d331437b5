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
