"""A floor under :func:`~workbench.plan.estimate.estimate`'s step time, and ``search``'s
best-first use of it: a layout whose floor already exceeds the step time of ``top``
layouts estimated cannot be among the ``top`` fastest, so it is never estimated.

The floor of a layout is m micro-batches of one pipeline stage's layers' compute,

    m x (n_layer / pp) x (forward + backward compute of one layer),

the layer priced as ``estimate`` prices it (``estimate.layer_for``).  ``estimate``'s
step is compute + communication + bubble (its module docstring) where

- compute = m x the slowest stage's compute + the optimizer step, and every stage's
  compute is its n_layer / pp layers' plus, on the first and last stages, the
  embedding's, the head's and the edges' (``edge_cost``), none of them negative;
- communication (m x the stage's collectives and p2p, plus the data-parallel sync, which
  ``stage_sync`` exposes as max(0, ...)) and the bubble ((sum - max) / v over the
  stages) are not negative either.

Rounding a sum of non-negative floats never takes it below one of its terms; the floor
is taken a further 1e-9 of itself low, far beyond the rounding of its products.  Where
``estimate`` prices otherwise (DeepSpeed's pipeline engine, uneven ``stages``, FSDP2 on
its attention profile) the floor is 0: such layouts are always estimated.
``tests/test_plan_search_speed.py`` holds floor <= step on every layout of searches.
"""
from __future__ import annotations

import heapq

from .estimate import layer_for

__all__ = ["step_floor", "best_first"]


def step_floor(model, lay, cluster, attention: str, tp_comm_overlap: bool = False) -> float:
    """Seconds that ``estimate(model, lay, cluster, attention, tp_comm_overlap=...)``'s
    step time cannot be below (module docstring); 0 where no floor is derived."""
    if lay.stages is not None or lay.engine == "fsdp" or (
            lay.engine == "deepspeed" and lay.pp > 1):
        return 0.0
    layer = layer_for(model, lay, cluster.profile, attention, False, tp_comm_overlap)
    per_stage = (model.n_layer // lay.pp) * (layer.fwd_compute + layer.bwd_compute)
    return lay.m * per_stage * (1 - 1e-9)


def best_first(layouts, top: int, estimate_one, floor_one) -> list:
    """The ``top`` fastest of ``layouts`` as ``[(Layout, Estimate)]``, ordered as sorting
    all of them by (step time, memory) would (ties: in ``layouts``' order), estimating
    (``estimate_one(lay)``) in the order of their floors (``floor_one(lay)``) and no
    layout whose floor exceeds the ``top``-th best step time found so far: none of the
    layouts after it can beat that."""
    order = sorted((floor_one(lay), i) for i, lay in enumerate(layouts))
    kept: list = []      # max-heap (negated) of the best keys: (step, memory, index)
    for floor, i in order:
        if len(kept) == top and floor > -kept[0][0]:
            break
        e = estimate_one(layouts[i])
        key = (-e.step_time, -e.memory["total"], -i)
        if len(kept) < top:
            heapq.heappush(kept, (*key, e))
        elif key > kept[0][:3]:
            heapq.heapreplace(kept, (*key, e))
    best = sorted(((-s, -mem, -i, e) for s, mem, i, e in kept), key=lambda r: r[:3])
    return [(layouts[i], e) for _, _, i, e in best]
