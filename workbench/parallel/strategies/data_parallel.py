"""Data parallelism and ZeRO stages 1-3 over the "dp" dimension of a mesh.

Every data-parallel rank holds a replica of the model (stored once per rank:
the stacked parameter has a real dp axis) and runs its own shard of the batch.
After backward each rank holds the gradient of its shard; then:

* naive DP: all-reduce every gradient (PyTorch DDP without buckets);
* bucketed DP: flatten gradients into buckets of ``bucket_bytes`` and all-reduce
  each bucket (fewer, larger messages: DDP's gradient buckets).  Both are
  ``DistributedDataParallel``'s DistTensor mode (:mod:`.ddp_dist`): the replicas
  and their reduction are its :class:`~.ddp_dist.GradReplicas`;
* ZeRO-1 (optimizer states sharded, Rajbhandari et al. 2020, P_os): reduce-scatter
  the gradients, each rank updates its 1/N_d of the parameters with its 1/N_d of
  the Adam states, then all-gather the parameters;
* ZeRO-2 (P_os+g): the same bytes by the same two collectives; each rank keeps only
  its gradient shard, each gradient reduce-scattered as backward produces it.
  Both are ``ZeroRedundancyOptimizer(partition="chunks")`` (:mod:`.zero_optimizer_dist`,
  ``overlap_comm`` for stage 2) with ``wb.ops.AdamW``;
* ZeRO-3 (P_os+g+p): parameters stay sharded; each layer all-gathers its
  parameters before forward and again before backward, and gradients are
  reduce-scattered: 1.5x the data-parallel volume.  That is :class:`.zero3.Zero3`,
  ``FullyShardedDataParallel`` over DistTensor parameters (:mod:`.fsdp_dist`).

Parameters are flattened per tensor and padded to a multiple of N_d for the
sharded stages (:mod:`.flat_shards`, the layout FSDP and ZeRO-3 use too); ZeRO-1
reduce-scatters them as one buffer after backward, ZeRO-2 one gradient at a time during
it (async), and both all-gather one buffer after the update.  ``step``
runs AdamW (``wb.ops.AdamW``, a step count per parameter as ``torch.optim.AdamW``);
plain DP also takes any ``torch.optim`` optimizer over :meth:`DataParallel.parameters`
after :meth:`finish_gradient_synchronization`.
Memory is counted per rank from what each rank actually holds (:meth:`memory`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...ops.adamw import AdamW as _AdamW
from ..module_state import clear_grad
from ..placement import Replicate
from .ddp_dist import GradReplicas
from .optim_layout import check_state_shapes
from .zero_optimizer_dist import ChunkedZeroOptimizer

__all__ = ["DataParallel", "MemoryReport"]


class Hyper:
    """An AdamW hyperparameter of an optimizer-style object (``dp.lr``, ``dp.wd``...), read
    from and written to its optimizer's parameter groups: ``dp.lr = 1e-4`` sets the next
    step's lr, as ``for g in dp.param_groups: g["lr"] = 1e-4`` does (a copy kept beside the
    optimizer took the write and no step read it)."""

    def __init__(self, key: str):
        self.key = key

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        groups = obj.param_groups
        return groups[0][self.key] if groups else obj.__dict__["_hyper"][self.key]

    def __set__(self, obj, value) -> None:
        for g in obj.param_groups:
            g[self.key] = value
        obj.__dict__["_hyper"][self.key] = value


class AdamWHypers:
    """``lr``, ``betas``, ``eps``, ``wd`` and ``param_groups`` of an object whose
    ``optimizer`` (an AdamW, or None) steps its parameters: torch.optim's habit
    (nanoGPT's schedule writes ``g["lr"]`` for each of ``optimizer.param_groups``)."""
    lr, betas, eps, wd = Hyper("lr"), Hyper("betas"), Hyper("eps"), Hyper("weight_decay")

    @property
    def param_groups(self) -> list:
        """The optimizer's parameter groups (a change reaches the next step)."""
        opt = self.__dict__.get("optimizer")
        return [] if opt is None else opt.param_groups


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per rank of model states, as held (plain data)."""
    params: int
    grads: int
    optimizer: int
    n_params: int          # parameters of the whole model (elements)
    dp: int
    stage: int             # 0 = plain DP

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


class DataParallel(AdamWHypers):
    """Data parallel training of ``params`` (DistTensor leaves, replicated on ``dp``): the
    course's optimizer-style name over the data-parallel wrappers' DistTensor engines.

    Args:
        params: the model's DistTensor parameters (e.g. ``wb.dist_parameters(model)``).
        mesh: their mesh; ``dp`` names its data-parallel dimension, or a tuple of adjacent
            dims summed over as one group (("dp", "cp"): :mod:`.flat_dims`; ZeRO 1-2 then
            shard over all their ranks, as Megatron-Core's distributed optimizer does over
            its data-parallel group with context parallel).
        zero: 0 (plain DP: ``DistributedDataParallel``'s engine, :mod:`.ddp_dist`), 1 or 2
            (``ZeroRedundancyOptimizer(partition="chunks")``); ZeRO-3 is :class:`.zero3.Zero3`.
        bucket_bytes: for plain DP, all-reduce gradients in buckets of this size
            (None: one all-reduce per gradient; ``math.inf``: every gradient in one
            contiguous buffer, Megatron-LM's default without overlap).
        partial_grads: parameters (of ``params``) whose gradients are each rank's
            partial sum over mesh dim ``partial_dim`` (sequence-parallel norms:
            :func:`.tensor_parallel.sequence_parallel_norms`); ``step`` all-reduces
            them over that dim in one buffer, once, before the data-parallel reduce.
    """

    def __init__(self, params, mesh, dp="dp", zero: int = 0, bucket_bytes: int | None = None,
                 lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, partial_grads=(), partial_dim="tp"):
        if isinstance(zero, bool) or not isinstance(zero, int) or zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={zero!r}: use 0 (plain data parallel), 1, 2 or 3")
        if zero == 3:
            raise NotImplementedError("DataParallel(zero=3): ZeRO-3 is Zero3(module, mesh, "
                                      "'dp') (FullyShardedDataParallel over DistTensors)")
        self.zero = zero
        self.__dict__["_hyper"] = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.step_count = 0             # step() calls
        adamw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if zero == 0:
            # the replicas and their gradients' reduction: DistributedDataParallel's
            # DistTensor engine; AdamW over the replicas, as any torch.optim optimizer
            self.replicas = GradReplicas(params, mesh, dp, bucket_bytes, partial_grads,
                                         partial_dim, "DataParallel")
            self.optimizer = _AdamW([p._local for p in self.replicas.params], **adamw) \
                if self.replicas.params else None
        else:
            if bucket_bytes is not None:
                raise ValueError(f"bucket_bytes={bucket_bytes!r} with zero={zero}: ZeRO "
                                 "reduce-scatters every gradient in one buffer; leave it None")
            self.optimizer = ChunkedZeroOptimizer(
                params, _AdamW, mesh, dp, overlap_comm=zero == 2, partial_grads=partial_grads,
                partial_dim=partial_dim, **adamw)
            self.replicas = self.optimizer.replicas
        r = self.replicas
        self.params, self.mesh, self.axis, self.n = r.params, mesh, r.axis, r.n
        self.bucket_bytes, self.distributed = r.bucket_bytes, r.distributed

    def shard_batch(self, x: torch.Tensor, dim: int = 0):
        """A global batch split over the data-parallel ranks (replicated elsewhere)."""
        from ..dist_tensor import shard_tensor
        from ..placement import Shard
        ps = [Replicate()] * self.mesh.ndim
        ps[self.axis] = Shard(dim)
        return shard_tensor(x, self.mesh, ps)

    # ---- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Reduce the gradients over dp and take one AdamW step (in place)."""
        # as torch.optim: a parameter without a gradient (frozen, or unused) is skipped
        live = self.optimizer.live() if self.zero else \
            [i for i, p in enumerate(self.params) if p._local.grad is not None]
        if not live:
            if not any(p.requires_grad for p in self.params):
                # every parameter frozen (a pipeline stage whose layers are all frozen,
                # fine-tuning the later ones): nothing to step, as torch.optim skips each
                # parameter without a gradient (was: "call loss.backward() first", raised
                # after a backward on every step of Hybrid(pp=2) with stage 0 frozen)
                self.step_count += 1
                return
            raise RuntimeError("DataParallel.step(): no parameter has a gradient; call "
                               "loss.backward() first")
        self.step_count += 1
        if self.zero:
            self.optimizer.step()
            return
        params = [self.params[i] for i in live]
        self.replicas.reduce(params)
        self.optimizer.step()
        for p in params:
            p._local.grad = None

    # ---- the optimizer's habits (torch.optim.Optimizer's names) -----------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every gradient cleared (``set_to_none``) or zeroed, as ``Optimizer.zero_grad``;
        ZeRO 1-2: the gradient shards reduced in backward too."""
        if self.zero:
            self.optimizer.zero_grad(set_to_none)
            return
        for p in self.params:
            clear_grad(p._local, set_to_none)

    def state_dict(self) -> dict:
        """The AdamW's ``state_dict()`` (per parameter: ``step``, ``exp_avg``,
        ``exp_avg_sq`` as this layout holds them: one copy per dp replica; under ZeRO 1-2
        the ZeroRedundancyOptimizer's, in each parameter's shape); :meth:`load_state_dict`
        takes it back on the same layout (across layouts: ``wb.checkpoint``)."""
        if self.optimizer is None:
            return {"state": {}, "param_groups": []}
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """:meth:`state_dict`'s dict, into this optimizer (the same layout)."""
        if self.optimizer is not None:
            if not self.zero:
                check_state_shapes("DataParallel", self.optimizer, state_dict)
            # ZeRO 1-2: the ZeroRedundancyOptimizer checks and cuts module-shaped states
            # (its state_dict()'s, since habits13b) into its chunks itself
            self.optimizer.load_state_dict(state_dict)
        elif state_dict.get("state") or state_dict.get("param_groups"):
            raise ValueError("DataParallel.load_state_dict: this DataParallel has no parameters "
                             f"(so no optimizer), but the state_dict holds "
                             f"{len(state_dict.get('param_groups') or [])} param group(s); load "
                             "it into a DataParallel built over the same parameters")

    # ---- any torch.optim optimizer (plain data parallel) ----------------------------------
    def parameters(self):
        """The replicas (each parameter's local leaf, one copy per dp rank) for a
        ``torch.optim`` optimizer; call :meth:`finish_gradient_synchronization` after
        backward, then its ``step()``.  ZeRO 1-2 shard the optimizer states, which a
        plain torch.optim optimizer does not: there use :meth:`step`."""
        if self.zero:
            raise ValueError(f"DataParallel(zero={self.zero}).parameters(): ZeRO shards the "
                             "optimizer states, so step with DataParallel.step(); for any "
                             "torch.optim optimizer use zero=0 (or wb.ZeroRedundancyOptimizer "
                             "with wb.DistributedDataParallel)")
        return (p._local for p in self.params)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """ZeRO 0: every gradient summed over dp (the global loss's gradient: each rank's
        already carries its 1/N of the mean), written back as each replica's ``.grad``."""
        if self.zero:
            self.parameters()                       # the same clear error
        self.replicas.reduce()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their total norm as one device's
        ``torch.nn.utils.clip_grad_norm_``; returns that norm.  Call it after backward,
        before :meth:`step`.  ZeRO 0: the gradients are summed over dp first
        (:meth:`finish_gradient_synchronization`, which ``step`` then does not repeat);
        ZeRO 1-2: :meth:`.zero_optimizer_dist.ChunkedZeroOptimizer.clip_grad_norm_`."""
        refuse = getattr(self, "_wb_clip_refuse", None)     # one stage of a pipeline
        if refuse:
            raise RuntimeError(f"DataParallel.{refuse}")
        if self.zero:
            return self.optimizer.clip_grad_norm_(max_norm, norm_type)
        self.finish_gradient_synchronization()
        return torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type)

    # ---- accounting ------------------------------------------------------------------------
    def memory(self, mixed_precision: bool = False) -> MemoryReport:
        """Model-state bytes each rank holds.

        As run here (fp32): parameters and gradients 4 bytes, Adam's m and v 8 bytes
        per element held.  With ``mixed_precision=True``, the same sharding priced as
        the ZeRO paper counts it: 2-byte weights and gradients, 12 bytes of optimizer
        state (fp32 master weights, m, v), so it equals the paper's formulas when
        every parameter divides by N_d (no padding)."""
        nd = self.mesh.ndim
        wb_, gb, ob = (2, 2, 12) if mixed_precision else (4, 4, 8)
        params = grads = opt = 0
        n_params = 0
        shards = self.optimizer.shard_numel() if self.zero else [None] * len(self.params)
        for p, sh in zip(self.params, shards):
            full = math.prod(p._local.shape[nd:])
            shard = sh if self.zero else full
            n_params += math.prod(p.shape)
            params += full * wb_
            grads += (shard if self.zero >= 2 else full) * gb
            opt += shard * ob
        return MemoryReport(params, grads, opt, n_params, self.n, self.zero)
