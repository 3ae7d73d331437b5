"""``ZeroRedundancyOptimizer(partition="chunks")``: ZeRO stages 1 and 2 over DistTensor
parameters, as the ZeRO paper and Megatron-LM's distributed optimizer shard them.

    wb.parallelize(model, mesh, tp_plan, mesh_dim="tp")     # any tp plan, dims (dp, tp)
    opt = wb.ZeroRedundancyOptimizer(wb.dist_parameters(model), wb.ops.AdamW, mesh, "dp",
                                     partition="chunks", lr=1e-3)
    loss.backward(); opt.step()                             # reduce-scatter, step, all-gather

Rajbhandari et al. 2020 (P_os, P_os+g): every parameter is flattened, padded to a multiple
of N_d and cut in N_d chunks (:mod:`.flat_shards`); rank k keeps chunk k of each as an
``nn.Parameter`` (``shards``) that ``optimizer_class`` (any ``torch.optim`` optimizer)
steps, so each rank holds 1/N_d of the optimizer states.  The replicas' gradients are
*not* all-reduced first (no DDP all-reduce: this replaces it):

* one buffer: every gradient (flattened, padded) is laid out rank-major in one contiguous
  buffer, so one reduce-scatter leaves rank k its chunk k of each (Megatron-LM's
  distributed optimizer shards one contiguous gradient buffer the same way,
  ``megatron/core/distributed/param_and_grad_buffer.py``); after the step the updated
  shards come back to every replica in one all-gather.  Same bytes as DP's all-reduce.
  ``dim`` may name several adjacent mesh dims (context parallelism's ("dp", "cp")): the
  chunks are cut over all their ranks, each collective one per group on the merged dim
  (:mod:`.flat_dims`), as Megatron-Core shards over its data-parallel group with context
  parallel (``recipes/context_parallel.py`` cites it).
* ``overlap_comm=True`` (ZeRO-2, DeepSpeed's ``overlap_comm``): each gradient's
  reduce-scatter is launched from a post-accumulate-grad hook as soon as backward has
  produced it, async on the simulated clock (the dp group's comm stream), and only the
  shard is kept; ``step`` waits for them.  A gradient a wgrad produced is issued after
  the collective of the same backward's input gradient (tensor parallelism's f), which
  Megatron-LM launches before the wgrad GEMM (``Trace.defer``).  On torch.distributed the
  collectives are blocking calls, so there the reduce-scatter stays in ``step``; the clock
  records the program's, launched from the same hooks (``_clock_hook``, task tdclock2).

PyTorch's own ``ZeroRedundancyOptimizer`` (:mod:`.zero_optimizer`, ``partition="owners"``,
plain modules) partitions whole tensors among owners after DDP's all-reduce and
broadcasts them back: 1.5x the bytes of this one.  The replicas are made real on dp by
DDP's DistTensor engine (:class:`.ddp_dist.GradReplicas`), which also sums sequence
parallelism's partial norm gradients (``partial_grads``) first.  ``DataParallel(zero=1|2)``
is this optimizer with ``wb.ops.AdamW``.

The optimizer's parts live beside this module (their names stay importable from here):
the gradients it hands out (:mod:`.zero_chunk_grads`), the chunks' shapes and collectives
(:mod:`.zero_chunk_comm`), its step (:mod:`.zero_chunk_step`), its state dict
(:mod:`.zero_chunk_states`) and its parameter groups (:mod:`.zero_chunk_groups`).
"""
from __future__ import annotations

import weakref

import torch

from ...ops.adamw import AdamW as _AdamW
from .. import step_clock
from .ddp_dist import GradReplicas
from .torch_kwargs import zero_torch_kwargs
from .zero_chunk_comm import _ChunkComm, _fit, _narrow_to, defer_reduce_scatter  # noqa: F401
from .zero_chunk_grads import _SHARD_REFUSE, GradInShard, ShardParameter  # noqa: F401
from .zero_chunk_groups import _copy_hyper, _param_groups
from .zero_chunk_states import _ChunkStates
from .zero_chunk_step import _ChunkStep
from .zero_optimizer import ZeroRedundancyOptimizer

__all__ = ["ChunkedZeroOptimizer", "GradInShard", "defer_reduce_scatter", "ELEMENTWISE"]

# Optimizers whose update of an element reads only that element's parameter, gradient and
# states (torch 2.13 torch/optim/*.py; workbench.ops.AdamW is AdamW's): on the flat chunks
# they give the unsharded result.  Others (Adafactor's factored moments, LBFGS's flat
# history) would compute on the chunks' shape: (n, chunk) stacked here, (chunk,) under
# torchrun, neither the parameter's.
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta",
    "ASGD", "Rprop") if hasattr(torch.optim, n)) + (_AdamW,)


_CLIP_REFUSE = (
    "ZeroRedundancyOptimizer(partition='chunks') (ZeRO-1/2, DataParallel(zero=1|2)) sums the "
    "gradients over the data-parallel ranks inside step() (one reduce-scatter; ZeRO-2 keeps "
    "only each rank's shard): before it each replica holds its own rank's gradient, so "
    "clipping now would not clip the model's.  Clip with the optimizer: "
    "opt.clip_grad_norm_(max_norm) (DataParallel: dp.clip_grad_norm_(max_norm)) after "
    "backward, before step()")


class ChunkedZeroOptimizer(_ChunkComm, _ChunkStep, _ChunkStates, ZeroRedundancyOptimizer):
    """ZeRO-1 (``overlap_comm=False``) or ZeRO-2 (``True``) over the ``dim`` dim of
    ``mesh`` for DistTensor ``params`` replicated there (module docstring); ``stage``
    says which (1 or 2), ``replicas`` the :class:`.ddp_dist.GradReplicas` it runs on."""

    def __init__(self, params, optimizer_class, mesh=None, dim="dp", partition="chunks",
                 overlap_comm: bool = False, partial_grads=(), partial_dim="tp", **kwargs):
        kwargs = zero_torch_kwargs(kwargs)      # torch's own (parameters_as_bucket_view...)
        if partition != "chunks":
            raise ValueError(f"partition={partition!r}: this is the 'chunks' partition")
        if not (isinstance(optimizer_class, type) and
                issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class={optimizer_class!r}: give a torch.optim.Optimizer "
                            "subclass, e.g. wb.ops.AdamW")
        if not issubclass(optimizer_class, ELEMENTWISE):
            names = ", ".join(c.__name__ for c in ELEMENTWISE[:-1])
            raise ValueError(f"optimizer_class={optimizer_class.__name__}: partition='chunks' "
                             "steps it on flat chunks of the parameters, exact only for an "
                             f"elementwise optimizer (torch.optim's {names}, wb.ops.AdamW, or "
                             "a subclass); give one of those, or partition='owners' (whole "
                             "tensors, exact for any optimizer)")
        if not isinstance(overlap_comm, bool):
            raise TypeError(f"overlap_comm={overlap_comm!r}: give True (ZeRO-2) or False")
        if mesh is None:
            raise ValueError("ZeroRedundancyOptimizer(partition='chunks', mesh=None): pass the "
                             "mesh the DistTensor parameters live on")
        spec = _param_groups(params)        # [(hyperparameters, params)], torch's groups
        self.replicas = r = GradReplicas([p for _, ps in spec for p in ps], mesh, dim, None,
                                         partial_grads, partial_dim, "ZeroRedundancyOptimizer",
                                         carry_summed=False)     # step() sums every one
        self.params, self.mesh, self.axis, self.n = r.params, mesh, r.axis, r.n
        self.distributed, self.stage = r.distributed, 2 if overlap_comm else 1
        # several data-parallel dims (context parallelism's ("dp", "cp")): the chunks are
        # cut over all their ranks at once, one collective on the merged group (flat_dims)
        self.axes = tuple(sorted(r.axes))
        self.group_mesh, self.group_axis = r._flat, r._flat_axis
        nd = mesh.ndim
        # the replicas' gradients are summed inside step(): a clip before it would read
        # each rank's own gradient (or none: ZeRO-2 keeps only the shard)
        r.unsynced_hint = _CLIP_REFUSE
        for p in self.params:
            p._local._wb_clip_refuse = _CLIP_REFUSE
        # rank k's chunk k of each flat padded replica: the leaves the optimizer steps
        self.shards = [ShardParameter(self._my_chunk(p._local.detach()),
                                      requires_grad=p.requires_grad) for p in self.params]
        self._busy = 0                  # > 0: inside step / reduce (no lazy reduction)
        for s in self.shards:
            s._wb_zero = weakref.ref(self)
        step_clock.hold(self.shards, mesh.ranks, nd)          # the inner optimizer's step: on the clock
        # each group's shards, in the order of its parameters (GradReplicas keeps it)
        at = [0]
        for _, ps in spec:
            at.append(at[-1] + len(ps))
        torch.optim.Optimizer.__init__(self, [{**h, "params": self.shards[a:b]} for (h, _), a, b
                                              in zip(spec, at, at[1:])], dict(kwargs))
        self.optimizer_class = optimizer_class
        self._inner = optimizer_class([{**h, "params": self.shards[a:b]} for (h, _), a, b
                                       in zip(spec, at, at[1:])], **kwargs)
        # every hyperparameter the inner optimizer uses (betas...), as torch's
        # ZeroRedundancyOptimizer copies its local optimizer's groups in
        _copy_hyper(self._inner.param_groups, self.param_groups)
        self._built = True
        self._stepped: set = set()     # the parameters the last step() stepped
        self._zeroed = False           # zero_grad() since the last step()
        self._gshard: dict[int, torch.Tensor] = {}    # param index -> its gradient shard
        self._pending: list = []                       # (trace, handle) to wait for in step
        self._clocked: set = set()     # torch.distributed: hooked gradients, on the clock
        # ZeRO-2: the gradients reduce-scattered in backward (on torch.distributed: kept
        # for step's one reduce-scatter, but read as on simulated ranks: GradInShard)
        self._in_backward = set()
        if overlap_comm:
            for i, p in enumerate(self.params):       # (partial ones: summed at step)
                if p._local.requires_grad and not r.is_partial(p):
                    self._in_backward.add(i)
                    p._local.register_post_accumulate_grad_hook(
                        self._clock_hook(i) if self.distributed else
                        self._reduce_scatter_hook(i))
        for i, p in enumerate(self.params):
            # model.zero_grad() reaches the shard that replaced the gradient (ZeRO-2's in
            # backward; ZeRO-1's too once clip_grad_norm_ / reduce_grads_ made it)
            p._local._wb_zero_grad_hook = self._zero_shard_hook(i)
            p._local._wb_grad_of = GradInShard(self, i)     # p.grad: exact, or it raises

    def add_param_group(self, param_group) -> None:
        if getattr(self, "_built", False):  # torch.optim.Optimizer.__init__ calls it first
            raise NotImplementedError(
                "ZeroRedundancyOptimizer(partition='chunks').add_param_group: its buffers and "
                "gradient hooks are laid out over the parameters it was built with; build a "
                "new one with every group (a list of dicts, as torch.optim takes)")
        torch.optim.Optimizer.add_param_group(self, param_group)

    @property
    def optimizer(self):
        """The ``optimizer_class`` instance over :attr:`shards` (every rank's at once)."""
        return self._inner
