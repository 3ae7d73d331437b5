"""ZeRO stage 3 (Rajbhandari et al. 2020, P_os+g+p): parameters sharded over dp.

Each data-parallel rank keeps only 1/N_d of every (flattened, padded) parameter,
with its gradient shard and Adam states.  Right before a module runs forward, a
pre-hook all-gathers that module's parameters (one copy per rank, as the layer
needs them); in backward the parameters are gathered again (ZeRO frees them after
forward; here the gathered copy autograd saved stands in for it, and the re-gather
is recorded in the trace) and the gradients are reduce-scattered back to the
shards.  Per step: all-gather forward + all-gather backward + reduce-scatter =
1.5x the all-reduce of plain data parallelism.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...ops import adamw as _adamw
from ...sim_mesh import backends as _B
from ...sim_mesh import collectives as C
from ..dist_tensor import DistTensor
from .data_parallel import MemoryReport

__all__ = ["Zero3"]


class Zero3:
    """ZeRO-3 over the ``dp`` dim of ``mesh`` for a module parallelized with
    :func:`workbench.parallelize` (its DistTensor parameters replicated on dp)."""

    def __init__(self, module: nn.Module, mesh, dp="dp", lr=1e-3, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.0):
        self.module, self.mesh = module, mesh
        self.axis = mesh.dim(dp)
        self.n = mesh.shape[self.axis]
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.step_count = 0
        self.entries = []           # (module, name, template DistTensor, shard leaf)
        self.names = []             # the qualified name of each entry's parameter
        nd = mesh.ndim
        for mname, mod in module.named_modules():
            for name, p in list(getattr(mod, "_wb_dist_params", {}).items()):
                if not p.placements[self.axis].is_replicate():
                    raise ValueError(f"{name} is {p.placements[self.axis]} on the dp dim; "
                                     "ZeRO-3 shards replicated parameters")
                loc = p._local.detach()
                if _B.is_distributed(mesh):     # the replicas start from dp rank 0's values
                    loc = _B.broadcast_(loc.clone(), mesh, self.axis, 0)
                flat = loc.reshape(tuple(loc.shape[:nd]) + (-1,))
                pad = (-flat.shape[-1]) % self.n
                flat = torch.nn.functional.pad(flat, (0, pad)) if pad else flat
                # rank k of dp keeps chunk k: the dp axis becomes the shard index
                if _B.is_distributed(mesh):
                    k = _B.local_index(mesh, self.axis)
                    chunks = flat.unflatten(-1, (self.n, -1)).select(-2, k)
                else:
                    chunks = flat.unflatten(-1, (self.n, -1)).squeeze(self.axis) \
                        .movedim(nd - 1, self.axis)
                shard = chunks.contiguous().requires_grad_(p.requires_grad)   # frozen stays
                self.entries.append((mod, name, p, shard))
                self.names.append(f"{mname}.{name}" if mname else name)
        self.m = [torch.zeros_like(e[3]) for e in self.entries]
        self.v = [torch.zeros_like(e[3]) for e in self.entries]
        self._hooks = [mod.register_forward_pre_hook(self._gather_hook(mod))
                       for mod in {id(e[0]): e[0] for e in self.entries}.values()]

    def _gather_hook(self, mod):
        def hook(module, args):
            for (m, name, tmpl, shard) in self.entries:
                if m is module:
                    object.__setattr__(m, name, self._gather(tmpl, shard))
        return hook

    def _gather(self, tmpl: DistTensor, shard: torch.Tensor) -> DistTensor:
        nd, mesh = self.mesh.ndim, self.mesh
        full = C.all_gather(shard, mesh, self.axis, 0, expanded=True, label="zero-3 params")
        local = tuple(tmpl._local.shape[nd:])
        numel = math.prod(local)
        lead = tuple(full.shape[:nd])
        full = full[..., :numel].reshape(lead + local)
        nb = shard[(0,) * nd].numel() * shard.element_size() * self.n
        # the re-gather ZeRO-3 does before the layer's backward (the saved copy stands in)
        full = C._on_backward(full, "all_gather", mesh, self.axis, nb, "zero-3 re-gather")
        return DistTensor(full, mesh, tmpl.placements, tmpl.shape, tmpl.dtype)

    @torch.no_grad()
    def step(self) -> None:
        # as torch.optim: a shard without a gradient (frozen, or unused) is skipped
        live = [i for i, e in enumerate(self.entries) if e[3].grad is not None]
        if not live:
            raise RuntimeError("Zero3.step(): no parameter shard has a gradient; call "
                               "loss.backward() first")
        self.step_count += 1
        shards = [self.entries[i][3] for i in live]
        grads = [s.grad for s in shards]
        m, v = [self.m[i] for i in live], [self.v[i] for i in live]
        _adamw(shards, grads, m, v, self.step_count, lr=self.lr,
               beta1=self.betas[0], beta2=self.betas[1], eps=self.eps, weight_decay=self.wd)
        for s in shards:
            s.grad = None

    def full_parameters(self):
        """(qualified name, global tensor) of every parameter, gathered (for checking)."""
        from ...sim_mesh.trace import suspend
        with suspend(), torch.no_grad():
            for qname, (m, name, tmpl, shard) in zip(self.names, self.entries):
                yield qname, self._gather(tmpl, shard).full()

    def memory(self, mixed_precision: bool = False) -> MemoryReport:
        nd = self.mesh.ndim
        wb_, gb, ob = (2, 2, 12) if mixed_precision else (4, 4, 8)
        shard = sum(math.prod(e[3].shape[nd:]) for e in self.entries)
        n_params = sum(math.prod(e[2].shape) for e in self.entries)
        return MemoryReport(shard * wb_, shard * gb, shard * ob, n_params, self.n, 3)
