"""A floor under :func:`~workbench.plan.estimate.estimate`'s step time, and ``search``'s
best-first use of it: a layout whose floor already exceeds the step time of ``top``
layouts estimated cannot be among the ``top`` fastest, so it is never estimated.

The floor of a layout: with T = (n_layer / pp) x one layer's forward and backward
(compute and its TP / EP / CP communication, as ``estimate`` prices the layer:
``estimate.layer_for``), m micro-batches of T plus the bubble of pp stages of T,

    m T + (pp - 1) T / v.

``estimate``'s step is m x the slowest stage's time per micro-batch + the bubble + the
data-parallel sync + the optimizer step (its module docstring), where

- every stage's time is its n_layer / pp layers' plus, none of them negative, the
  pipeline's point-to-point sends, the embedding's and the head's compute and
  collectives, the edges' kernels (``edge_cost``): at least T;
- the bubble, (sum - max) / v over the stages' times, is the sum of all but the
  largest over v, which no stage's time can lower by growing: at least (pp - 1) T / v;
- the sync (``stage_sync`` exposes max(0, ...)) and the optimizer are not negative.

Rounding sums and products of non-negative floats moves them by parts in 1e16; the floor
is taken a further 1e-9 of itself low.  Where ``estimate`` prices otherwise (DeepSpeed's
pipeline engine, uneven ``stages``, FSDP2 on its attention profile) the floor is 0: such
layouts are always estimated.  ``tests/test_plan_search_speed.py`` holds floor <= step on
every layout of searches.
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
    ly = layer_for(model, lay, cluster.profile, attention, False, tp_comm_overlap)
    t = (model.n_layer // lay.pp) * (ly.fwd_compute + ly.bwd_compute + ly.fwd_comm
                                     + ly.bwd_comm)
    return (lay.m * t + (lay.pp - 1) * t / lay.v) * (1 - 1e-9)


def best_first(layouts, top: int, estimate_one, floor_one) -> list:
    """The ``top`` fastest of ``layouts`` as ``[(Layout, Estimate)]``, ordered as sorting
    all of them by (step time, memory) would (ties: in ``layouts``' order), estimating
    (``estimate_one(lay)``) in the order of their floors (``floor_one(lay)``) and no
    layout whose floor exceeds the ``top``-th best step time found so far: none of the
    layouts after it can beat that."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"best_first(top={top!r}): give an int >= 1, the number of layouts "
                         "to keep")
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
