"""Mixture-of-experts wiring for the hybrid recipe: the MoE layers of a course model
(``workbench/models/moe.py``) and expert parallelism
(``workbench/parallel/strategies/expert_parallel.py``), which knows no model.

* :func:`scale_aux_losses`: a pipeline averages m micro-batch losses, so each layer's
  load-balancing gradient is scaled by 1/m (Megatron-LM's
  ``MoEAuxLossAutoScaler.set_loss_scale``).
"""
from __future__ import annotations

from ..models.moe import moe_layers

__all__ = ["scale_aux_losses"]


def scale_aux_losses(model, microbatches: int) -> None:
    """Every MoE layer's aux-loss gradient scaled by 1/``microbatches``."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = 1.0 / microbatches
