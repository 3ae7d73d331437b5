"""The batch's mean loss over micro-batches whose targets ignore some tokens.

A pipeline (:func:`workbench.schedules.run_pipeline`) scales each micro-batch's loss by
1/m, so the sum is the batch's mean only when every micro-batch's loss averages over the
same number of tokens.  Targets equal to ``ignore_index`` (-100, ``F.cross_entropy``'s
default: padding, prompt tokens) break that: one device's loss is the mean over the
batch's counted tokens, ``sum_i n_i mean_i / N``.  So micro-batch i's loss is weighed by
``w_i = m n_i / N`` (Megatron-LM divides the summed loss by the step's token count for
the same reason: ``calculate_per_token_loss``); its 1/m scaling then gives one device's
mean, and a micro-batch with no counted token weighs 0.
"""
from __future__ import annotations

import torch

__all__ = ["token_weights", "weighted_loss_fn"]

IGNORE_INDEX = -100                 # F.cross_entropy's default


def token_weights(targets: torch.Tensor, m: int, ignore_index: int = IGNORE_INDEX):
    """``[m n_i / N]`` for the ``m`` micro-batches ``targets.chunk(m)``, or None when
    every micro-batch counts the same number of tokens (each then weighs 1 exactly), or
    none is counted at all (one device's mean is then nan, as is each micro-batch's)."""
    counts = [int((t != ignore_index).sum()) for t in targets.chunk(m)]
    total = sum(counts)
    if total == 0 or len(set(counts)) == 1:
        return None
    return [c * len(counts) / total for c in counts]


def weighted_loss_fn(loss, weights):
    """``loss(out, i)`` weighed by ``weights[i]`` (:func:`token_weights`; None: as is)."""
    if weights is None:
        return loss

    def fn(out, i):
        if weights[i] == 0:             # every target ignored: its mean is nan, its weight 0
            return out.sum() * 0.0
        return loss(out, i) * weights[i]
    return fn
