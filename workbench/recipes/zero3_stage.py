"""A pipeline stage's ZeRO-3 as ``Hybrid.build_optimizer`` hands it out: an optimizer.

``Hybrid(zero=3).build_optimizer`` returns one :class:`~workbench.parallel.strategies.
zero3.Zero3` per stage (the wrapper that gathers the stage's shards and steps them with
its ``wb.ops.AdamW``).  To the user the list is the optimizers (README: "one per stage,
each with ``zero_grad`` / ``state_dict`` / ``load_state_dict``"), as the ZeRO 0-2 stages'
``DataParallel`` are, and as torch keeps a model and its optimizer apart
(``model.state_dict()`` the weights, ``optimizer.state_dict()`` the moments): so here
``state_dict`` / ``load_state_dict`` are the optimizer's, the AdamW over the shards
(``step``, ``exp_avg``, ``exp_avg_sq`` per shard: this layout's, loaded back on the same
layout; across layouts ``wb.checkpoint.training`` gathers them).  ``Zero3`` built by hand
stays a module whose ``state_dict()`` is the module's; the weights of a Hybrid model are
``model.state_dict()``.  (Before, a stage's ``state_dict()`` was the stage's weights and
``load_state_dict`` put them back, so a resumed run silently restarted AdamW from zero
moments.)
"""
from __future__ import annotations

from ..parallel.strategies.optim_layout import check_state_shapes
from ..parallel.strategies.zero3 import Zero3

__all__ = ["Zero3Stage"]


class Zero3Stage(Zero3):
    """:class:`Zero3` whose ``state_dict`` / ``load_state_dict`` are its optimizer's."""

    def state_dict(self, *args, **kwargs) -> dict:
        """The stage's AdamW ``state_dict()`` (torch.optim's format, per shard)."""
        if args or kwargs:
            raise TypeError("Hybrid(zero=3)'s stage optimizer: state_dict() takes no "
                            f"arguments (got {args or kwargs}); the model's weights are "
                            "model.state_dict()")
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict, *args, **kwargs) -> None:
        """:meth:`state_dict`'s dict back into the stage's AdamW (the same layout)."""
        if args or kwargs:
            raise TypeError("Hybrid(zero=3)'s stage optimizer: load_state_dict(state_dict) "
                            f"takes no other argument (got {args or kwargs}); load the "
                            "model's weights with model.load_state_dict")
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            got = (f"a dict with keys {list(state_dict)[:3]}" if isinstance(state_dict, dict)
                   else type(state_dict).__name__)
            raise ValueError("Hybrid(zero=3)'s stage optimizer: load_state_dict takes the "
                             f"optimizer's state_dict() ({{'state', 'param_groups'}}), got "
                             f"{got}; the model's weights load with model.load_state_dict")
        check_state_shapes("Zero3", self.optimizer, state_dict)
        self.optimizer.load_state_dict(state_dict)
