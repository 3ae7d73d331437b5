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
* ZeRO-2 (P_os+g): the same messages; each rank keeps only its gradient shard;
* ZeRO-3 (P_os+g+p): parameters stay sharded; each layer all-gathers its
  parameters before forward and again before backward, and gradients are
  reduce-scattered: 1.5x the data-parallel volume.

Parameters are flattened per tensor and padded to a multiple of N_d for the
sharded stages (:mod:`.flat_shards`, the layout FSDP and ZeRO-3 use too), whose
messages go as one buffer (ZeRO-2's reduce-scatter async during backward:
:mod:`.zero_step`).  ``step`` runs AdamW (``workbench.ops.adamw``, a step count per
parameter as ``torch.optim.AdamW``); plain DP also takes any ``torch.optim`` optimizer
over :meth:`DataParallel.parameters` after :meth:`finish_gradient_synchronization`.
Memory is counted per rank from what each rank actually holds (:meth:`memory`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..placement import Replicate
from .ddp_dist import GradReplicas
from .flat_shards import flat_padded
from .zero_step import ZeroStep

__all__ = ["DataParallel", "MemoryReport"]


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


class DataParallel(ZeroStep):
    """Data parallel training of ``params`` (DistTensor leaves, replicated on ``dp``).

    Args:
        params: the model's DistTensor parameters (e.g. ``wb.dist_parameters(model)``).
        mesh: their mesh; ``dp`` names its data-parallel dimension.
        zero: 0 (plain DP), 1, 2 or 3.
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
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={zero!r}: use 0 (plain data parallel), 1, 2 or 3")
        if zero == 3:
            raise NotImplementedError("zero=3 (sharded parameters gathered per layer) is not "
                                      "built yet; use zero=1 or 2")
        # the replicas and their gradients' reduction: DistributedDataParallel's
        # DistTensor mode (ddp_dist.GradReplicas), the one copy of that code
        self.replicas = GradReplicas(params, mesh, dp, bucket_bytes, partial_grads,
                                     partial_dim, "DataParallel")
        r = self.replicas
        self.params, self.mesh, self.axis, self.n = r.params, mesh, r.axis, r.n
        self.partial_axis, self.bucket_bytes, self.distributed = \
            r.partial_axis, r.bucket_bytes, r.distributed
        self.zero = zero
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.step_count = 0             # step() calls
        # optimizer states: full per rank (stage 0) or a 1/N_d shard of the flat tensor
        # on the parameter's device ("meta" in a dry run) and dtype (as torch.optim.AdamW)
        self._steps = [0] * len(self.params)    # AdamW steps each parameter has taken
        like = [dict(device=p._local.device, dtype=p._local.dtype) for p in self.params]
        self.m = [torch.zeros(self._state_shape(p), **k) for p, k in zip(self.params, like)]
        self.v = [torch.zeros(self._state_shape(p), **k) for p, k in zip(self.params, like)]
        # ZeRO-2 reduce-scatters each gradient from a post-accumulate-grad hook, during
        # backward (async on the simulated clock); on torch.distributed the collectives
        # are blocking calls, so there the reduce-scatter stays in step()
        self._gshard: dict[int, torch.Tensor] = {}    # param index -> its gradient shard
        self._pending: list = []                       # (trace, handle) to wait for in step
        if zero == 2 and not self.distributed:
            for i, p in enumerate(self.params):       # (partial ones: summed at step)
                if p._local.requires_grad and not r.is_partial(p):
                    p._local.register_post_accumulate_grad_hook(self._reduce_scatter_hook(i))

    # ---- shapes ---------------------------------------------------------------------------
    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        """(lead..., *local) -> (lead..., numel padded to a multiple of N_d)."""
        return flat_padded(t, self.n, self.mesh.ndim)

    def _state_shape(self, p):
        loc = p._local
        nd = self.mesh.ndim
        if self.zero == 0:
            return tuple(loc.shape)
        numel = math.prod(loc.shape[nd:])
        padded = numel + (-numel) % self.n
        return tuple(loc.shape[:nd]) + (padded // self.n,)

    # ---- the step ---------------------------------------------------------------------------
    def shard_batch(self, x: torch.Tensor, dim: int = 0):
        """A global batch split over the data-parallel ranks (replicated elsewhere)."""
        from ..dist_tensor import shard_tensor
        from ..placement import Shard
        ps = [Replicate()] * self.mesh.ndim
        ps[self.axis] = Shard(dim)
        return shard_tensor(x, self.mesh, ps)

    @torch.no_grad()
    def step(self) -> None:
        """Reduce the gradients over dp and take one AdamW step (in place)."""
        # as torch.optim: a parameter without a gradient (frozen, or unused) is skipped
        live = [i for i, p in enumerate(self.params)
                if p._local.grad is not None or i in self._gshard]
        if not live:
            raise RuntimeError("DataParallel.step(): no parameter has a gradient; call "
                               "loss.backward() first")
        self.step_count += 1
        for i in live:       # as torch.optim's AdamW: a step count per parameter
            self._steps[i] += 1
        params = [self.params[i] for i in live]
        m, v = [self.m[i] for i in live], [self.v[i] for i in live]
        if self.zero == 0:
            self._reduce(params)
            self._adamw([p._local for p in params], [p._local.grad for p in params], m, v,
                        live)
        else:
            self._sum_partials(params)
            self._zero_step(params, [p._local.grad for p in params], m, v, live)
        for p in params:
            p._local.grad = None

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
        self._reduce([p for p in self.params if p._local.grad is not None])

    def _reduce(self, params) -> None:
        self.replicas.reduce(params)

    def _sum_partials(self, params) -> None:
        self.replicas.sum_partials(params)

    def _flat_nopad(self, t):
        return t.reshape(tuple(t.shape[:self.mesh.ndim]) + (-1,))

    # ---- accounting ------------------------------------------------------------------------
    def memory(self, mixed_precision: bool = False) -> MemoryReport:
        """Model-state bytes each rank holds.

        As run here (fp32): parameters and gradients 4 bytes, Adam's m and v 8 bytes
        per element held.  With ``mixed_precision=True``, the same sharding priced as
        the ZeRO paper counts it: 2-byte weights and gradients, 12 bytes of optimizer
        state (fp32 master weights, m, v), so it equals the paper's formulas when
        every parameter divides by N_d (no padding)."""
        nd = self.mesh.ndim
        elems = lambda shape: math.prod(shape[nd:])  # noqa: E731
        wb_, gb, ob = (2, 2, 12) if mixed_precision else (4, 4, 8)
        params = grads = opt = 0
        n_params = 0
        for p, m in zip(self.params, self.m):
            full = elems(p._local.shape)
            shard = elems(m.shape) if self.zero else full
            n_params += math.prod(p.shape)
            params += (shard if self.zero == 3 else full) * wb_
            grads += (shard if self.zero >= 2 else full) * gb
            opt += shard * ob
        return MemoryReport(params, grads, opt, n_params, self.n, self.zero)
