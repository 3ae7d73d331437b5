"""A layout's optimizer state dict loaded on another layout: refused before it changes.

The optimizers of the data-parallel family here (``DataParallel``'s AdamW over each
replica, ZeRO-1/2's over each rank's flat chunk, ``Zero3``'s over the shards) hold their
states in the layout's own storage shape: ``(dp, ...)`` rows, ``(dp, chunk)`` chunks.
``torch.optim.Optimizer.load_state_dict`` does not compare shapes, so a state dict from
another dp size, ZeRO stage or tensor-parallel degree loaded silently and the next
``step`` failed with the states half-replaced.  :func:`check_state_shapes` compares every
state tensor with the leaf it belongs to first, and names the way across layouts.
"""
from __future__ import annotations

import torch

__all__ = ["check_state_shapes"]

ACROSS = ("a stage optimizer's state_dict() loads back on the layout that saved it; across "
          "layouts save and resume with wb.checkpoint.training.save_training / "
          "resume_training (python -m workbench train --save DIR / --resume DIR), which keep "
          "each state in its parameter's global shape")


def check_state_shapes(owner: str, optimizer, state_dict) -> None:
    """Raise ValueError if a state tensor of ``state_dict`` (torch.optim's format, indexed
    as ``optimizer``'s parameters) has another shape than its parameter in ``optimizer``
    (0-d states such as ``step`` are not compared)."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
        raise ValueError(f"{owner}.load_state_dict: give an optimizer's state_dict() "
                         "({'state': ..., 'param_groups': ...}), got "
                         f"{type(state_dict).__name__}"
                         + (f" with keys {list(state_dict)[:3]}" if isinstance(state_dict, dict)
                            else ""))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, st in state_dict["state"].items():
        if not isinstance(i, int) or not 0 <= i < len(params) or not isinstance(st, dict):
            continue                # torch.optim's own checks name these
        want = tuple(params[i].shape)
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != want:
                raise ValueError(f"{owner}.load_state_dict: state {k!r} of parameter {i} has "
                                 f"shape {tuple(v.shape)}, this layout's optimizer holds "
                                 f"{want}: the state dict was saved on another layout (dp "
                                 f"size, ZeRO stage or tensor-parallel degree); {ACROSS}")
