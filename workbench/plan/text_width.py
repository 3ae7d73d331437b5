"""The planner's text width: :mod:`workbench.text_width`, where the layers below the
planner (the SPMD decisions that ``wb.spmd.infer`` and ``wb.explain`` print) find it too."""
from ..text_width import HANG, WIDTH, wrap

__all__ = ["HANG", "WIDTH", "wrap"]
