"""Recipes: models x strategies.

A recipe knows the models (it asks one for its tensor-parallel plan, its pipeline stages,
its norm classes: ``workbench/models/split.py``) and wires the strategies of
``workbench.parallel`` onto it.  It sits above ``parallel`` and ``models``, beside
``train`` and ``plan``, which run it; nothing under ``workbench.parallel`` or
``workbench.sim_mesh`` imports ``models``, ``plan`` or ``recipes`` (held by
tests/test_layering.py).

* :mod:`.hybrid`: DP x TP x PP (x SP, ZeRO-1/2/3) training of the course's models.
* :mod:`.context_parallel`: DP x CP x TP, the sequence sharded over cp ranks (ring attention).
"""
from .hybrid import Hybrid, stage_meshes
from .context_parallel import ContextParallel   # DP x CP x TP: the sequence over cp ranks

__all__ = ["Hybrid", "stage_meshes", "ContextParallel"]
