"""The layout a :class:`~.hybrid.Hybrid` runs on: one (dp, tp) mesh per pipeline stage,
and the pipeline schedules it knows by name."""
from __future__ import annotations

from ..parallel import schedules as S
from ..sim_mesh.mesh import Mesh


SCHEDULES = {"gpipe": S.gpipe, "1f1b": S.one_f_one_b, "interleaved": S.interleaved_1f1b,
             "zb-h1": S.zb_h1, "zb-v": S.zb_v,   # zb-v: 2 chunks per rank, V-placed
             "dualpipe": S.dualpipe}              # two copies of the stages: recipes/dualpipe.py


def stage_meshes(dp: int, tp: int, pp: int) -> list[Mesh]:
    """One (dp, tp) mesh per pipeline stage over consecutive ranks."""
    n = dp * tp
    return [Mesh([[s * n + i * tp + j for j in range(tp)] for i in range(dp)], ["dp", "tp"])
            for s in range(pp)]
