"""ZeRO stage 3 (Rajbhandari et al. 2020, P_os+g+p): parameters sharded over dp, the
course's name for ``FullyShardedDataParallel`` over DistTensor parameters with its own AdamW.

    z = Zero3(model, mesh, "dp", lr=1e-3)       # model: wb.parallelize'd (any tp plan)
    loss.backward(); z.step()                   # = z.finish_gradient_synchronization()
                                                #   + an AdamW step on the shards

``Zero3`` *is* the wrapper (:class:`.fsdp_dist.DistTensorFSDP`: gathers before each
module's forward and again before its backward, prefetched on the modeled clock, the
reduce-scatters launched as backward produces each gradient, the gathered copies counted
in ``live``), with ``optimizer``, a ``wb.ops.AdamW`` over the shards, and :meth:`memory`,
the model-state bytes each rank holds.  Any ``torch.optim`` optimizer over
``z.parameters()`` steps the same shards::

    opt = torch.optim.SGD(z.parameters(), lr=0.1)
    loss.backward(); z.finish_gradient_synchronization(); opt.step(); opt.zero_grad()

The module's habits read the shards (:mod:`.fsdp_dist_habits`): ``model.state_dict()``
gathers them, ``model.load_state_dict`` cuts into them, ``model.zero_grad()`` /
``requires_grad_`` reach them; ``torch.nn.utils.clip_grad_norm_(z.parameters(), ...)``
gives one device's norm; ``wb.clip_grad_norm_(model.parameters())`` and ``model.to()``
raise (the module's DistTensors are templates).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...ops.adamw import AdamW as _AdamW
from .data_parallel import AdamWHypers, MemoryReport
from .fsdp_dist import PREFETCH_NUMEL, DistTensorFSDP

__all__ = ["Zero3", "PREFETCH_NUMEL"]


class Zero3(AdamWHypers, DistTensorFSDP):
    """ZeRO-3 over the ``dp`` dim of ``mesh`` for a module parallelized with
    :func:`workbench.parallelize` (its DistTensor parameters replicated on dp);
    ``prefetch_numel``: elements gathered ahead (DeepSpeed's default; 0: none)."""

    def __init__(self, module: nn.Module, mesh, dp="dp", lr=1e-3, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.0, prefetch_numel: int = PREFETCH_NUMEL):
        if isinstance(prefetch_numel, bool) or not isinstance(prefetch_numel, int) \
                or prefetch_numel < 0:
            raise ValueError(f"prefetch_numel={prefetch_numel!r}: give the elements to "
                             "gather ahead, an int >= 0 (0: no prefetch)")
        super().__init__(module, mesh, dp, prefetch=prefetch_numel)
        self.__dict__["_hyper"] = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.step_count = 0
        # AdamW (wb.ops.adamw, as Zero3 always ran) as a torch.optim optimizer over the
        # shards; any other torch.optim optimizer over parameters() steps them the same way
        self.optimizer = _AdamW(self.parameters(), lr=lr, betas=betas, eps=eps,
                                weight_decay=weight_decay)
        # its state_dict() stays this layout's (per shard: recipes/zero3_stage.py), a
        # user's torch.optim over parameters() gives one device's shapes (laid_out.py)
        self.optimizer._wb_sd_hook = True

    @torch.no_grad()
    def step(self) -> None:
        """Wait for the reduce-scatters and take one AdamW step on the shards (the
        ``optimizer``, a ``wb.ops.AdamW``); the gradients are then cleared."""
        # as torch.optim: a shard without a gradient (frozen, or unused) is skipped
        if all(e[3].grad is None for e in self.entries):
            if not any(e[3].requires_grad for e in self.entries):
                self.step_count += 1        # every shard frozen: nothing to step (as
                return                      # DataParallel.step, torch.optim)
            raise RuntimeError("Zero3.step(): no parameter shard has a gradient; call "
                               "loss.backward() first")
        self.finish_gradient_synchronization()
        self.step_count += 1
        self.optimizer.step()
        self.zero_grad()

    def memory(self, mixed_precision: bool = False) -> MemoryReport:
        nd = self.mesh.ndim
        wb_, gb, ob = (2, 2, 12) if mixed_precision else (4, 4, 8)
        shard = sum(math.prod(e[3].shape[nd:]) for e in self.entries)
        n_params = sum(math.prod(e[2].shape) for e in self.entries)
        return MemoryReport(shard * wb_, shard * gb, shard * ob, n_params, self.n, 3)
