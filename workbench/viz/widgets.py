"""Interactive pickers for notebooks: choose placements, see the layout and the plan.

* :func:`placement_picker` — one dropdown per mesh dim (R, S(d), P); redraws the
  tensor's blocks on the mesh and prints the notation;
* :func:`reshard_picker` — a source and a target placement per mesh dim; prints the
  cheapest plan (collectives, bytes, modeled time) and draws before and after.

Like :func:`workbench.viz.pipeline.pipeline_widget`, each renders data only (the
layout comes from ``workbench.parallel.layout``, the plan from ``plan_reshard``) and
degrades gracefully where no widget front end runs (nbval, nbconvert): its display
data also carries a PNG of the figure for the current choice.
"""
from __future__ import annotations

import base64

from ..parallel.placement import Replicate, Shard, parse_placements
from ..parallel.reshard import plan_reshard
from ..parallel.dist_tensor import TensorSpec
from .placements import draw_placements, draw_reshard, render_reshard_text, to_png

__all__ = ["placement_picker", "reshard_picker", "PlacementPicker", "ReshardPicker"]


def _options(ndim: int) -> list[str]:
    return ["R"] + [f"S({d})" for d in range(ndim)] + ["P(sum)"]


class _Picker:
    """Shared plumbing: dropdowns, an image and a text updated in place, a PNG for static
    front ends."""

    def _widgets(self):
        try:
            import ipywidgets as widgets
        except ImportError:
            raise ImportError("the pickers need ipywidgets (pip install 'workbench[course]'); "
                              "draw_placements / draw_reshard draw the static figures") from None
        return widgets

    def _dropdowns(self, widgets, mesh, ndim, values, label):
        return [widgets.Dropdown(options=_options(ndim), value=str(v), description=f"{label}{n}",
                                 style={"description_width": "initial"})
                for n, v in zip(mesh.dim_names, values)]

    def _area(self, widgets):
        """The image and the text below it, replaced in place on every change (emptying an
        Output area instead would make the page jump)."""
        # at the PNG's own size (a VBox would stretch it to the full width, blurred)
        self.image = widgets.Image(format="png", layout=widgets.Layout(align_self="flex-start",
                                                                       max_width="100%"))
        self.textbox = widgets.HTML()
        return [self.image, self.textbox]

    def _show(self, text: str) -> None:
        import html
        if self.figure is not None:
            self.image.value = to_png(self.figure)
            self.image.layout.visibility = "visible"
        else:
            self.image.layout.visibility = "hidden"
        self.textbox.value = f"<pre>{html.escape(text)}</pre>"

    def _repr_mimebundle_(self, **kwargs):
        bundle = dict(self.box._repr_mimebundle_(**kwargs))
        if self.figure is not None:
            bundle["image/png"] = base64.b64encode(to_png(self.figure)).decode("ascii")
        bundle["text/plain"] = self.text
        return bundle


class PlacementPicker(_Picker):
    """Dropdowns of placements for a tensor of ``shape`` on ``mesh``."""

    def __init__(self, shape, mesh, placements=None, dpi: int = 100):
        widgets = self._widgets()
        self.shape, self.mesh, self.dpi = tuple(shape), mesh, dpi
        placements = parse_placements(placements or ["R"] * mesh.ndim)
        self.controls = self._dropdowns(widgets, mesh, len(self.shape), placements, "")
        self.box = widgets.VBox([widgets.HBox(self.controls), *self._area(widgets)])
        self.figure, self.text = None, ""
        for c in self.controls:
            c.observe(lambda change: self.redraw(), names="value")
        self.redraw()

    @property
    def placements(self):
        return parse_placements([c.value for c in self.controls])

    def redraw(self) -> None:
        try:
            spec = TensorSpec(self.shape, self.mesh, self.placements)
            self.figure = draw_placements(spec, dpi=self.dpi)
            self.text = spec.notation()
        except ValueError as err:       # e.g. nested shards that do not fit: say why
            self.figure, self.text = None, str(err)
        self._show(self.text)


class ReshardPicker(_Picker):
    """Source and target placements; shows the cheapest plan between them."""

    def __init__(self, shape, mesh, src=None, dst=None, profile=None, dpi: int = 100):
        widgets = self._widgets()
        self.shape, self.mesh, self.profile, self.dpi = tuple(shape), mesh, profile, dpi
        src = parse_placements(src or [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
        dst = parse_placements(dst or ["R"] * mesh.ndim)
        n = len(self.shape)
        self.src = self._dropdowns(widgets, mesh, n, src, "from ")
        self.dst = self._dropdowns(widgets, mesh, n, dst, "to ")
        self.box = widgets.VBox([widgets.HBox(self.src), widgets.HBox(self.dst),
                                 *self._area(widgets)])
        self.figure, self.text, self.plan = None, "", None
        for c in self.src + self.dst:
            c.observe(lambda change: self.redraw(), names="value")
        self.redraw()

    def redraw(self) -> None:
        try:
            spec = TensorSpec(self.shape, self.mesh, [c.value for c in self.src])
            self.plan = plan_reshard(spec, self.mesh, [c.value for c in self.dst],
                                     profile=self.profile)
            self.figure = draw_reshard(self.plan, dpi=self.dpi)
            self.text = render_reshard_text(self.plan)
        except ValueError as err:
            self.figure, self.plan, self.text = None, None, str(err)
        self._show(self.text)


def placement_picker(shape, mesh, placements=None) -> PlacementPicker:
    """Pick a placement per mesh dim and see where every block of the tensor lies."""
    return PlacementPicker(shape, mesh, placements)


def reshard_picker(shape, mesh, src=None, dst=None, profile=None) -> ReshardPicker:
    """Pick source and target placements and see the cheapest reshard plan."""
    return ReshardPicker(shape, mesh, src, dst, profile)


