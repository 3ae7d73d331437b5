"""What a ZeRO-1/2 (``partition="chunks"``) parameter's gradient reads as: the replica's
``p.grad`` once its gradient is reduce-scattered (:class:`GradInShard`: refused, no
one-device gradient is held), and the inner optimizer's parameters, one rank's flat
chunks whose ``.grad`` is the gradient summed over dp (:class:`ShardParameter`)."""
from __future__ import annotations

import torch
from torch import nn

from ...sim_mesh import backends as _B


_SHARD_REFUSE = (
    "p.grad of a ZeroRedundancyOptimizer(partition='chunks') parameter whose gradient is "
    "already reduce-scattered (ZeRO-2, overlap_comm=True: in backward; ZeRO-1: by "
    "opt.clip_grad_norm_ / opt.grad_norm / opt.reduce_grads_): each rank keeps only its "
    "shard of the summed gradient and the replica's .grad is freed (as DeepSpeed's ZeRO-2 "
    "frees it), so no one-device gradient is held to read.  Read the norm with "
    "opt.grad_norm(), or clip with the optimizer: opt.clip_grad_norm_(max_norm) after "
    "backward, before step()")


class GradInShard:
    """``p.grad`` of replica ``i`` (``DistTensor.grad`` reads it through the storage's
    ``_wb_grad_of``, as FSDP's ``GradOf``).  Before its gradient is summed: the replica's
    own, ``Partial("sum")`` over dp (:meth:`.grad_replicas.GradReplicas._replica_grad`),
    whose reads reduce the ranks' shares, exact.  Once it is reduce-scattered into the
    optimizer's shard (``_gshard``): a raise naming the optimizer's norm and clip.  It was
    None there (zero1tp), so a gradient-norm log (``[p.grad for p in model.parameters()]``,
    ``if p.grad is not None``) read nothing, silently.  Not a view of the shards: they are
    flat padded chunks, one per rank, of which no DistTensor placement is a view.
    ``p.grad = None`` drops both, as ``model.zero_grad()`` does."""

    def __init__(self, opt, i: int):
        self.opt, self.i = opt, i

    def get(self):
        opt = self.opt
        if self.i in opt._gshard:
            raise RuntimeError(_SHARD_REFUSE)
        if opt.distributed and self.i in opt._in_backward and \
                opt.params[self.i]._local.grad is not None:
            # torch.distributed: ZeRO-2's gradient waits for step()'s reduce-scatter here
            # (gloo's collectives block), but the program is the one simulated ranks run,
            # where backward reduce-scattered it: the same refusal (readsync: it read the
            # gradient here, raised there)
            raise RuntimeError(_SHARD_REFUSE)
        return opt.params[self.i]._storage_grad()

    def clear(self) -> None:
        self.opt._gshard.pop(self.i, None)
        self.opt.params[self.i]._local.grad = None


class ShardParameter(nn.Parameter):
    """One rank's flat chunks of a parameter (what the inner optimizer steps), whose
    ``.grad`` is the gradient summed over dp: read before the optimizer has summed it
    (ZeRO-1 sums in ``step``; ZeRO-2 the gradients its backward hooks skip, sequence
    parallelism's partial norm weights), the read first reduce-scatters every pending
    gradient (:meth:`ChunkedZeroOptimizer.reduce_grads_`, one buffer), as torch's
    ZeroRedundancyOptimizer's parameters hold the gradient DDP all-reduced in backward.

    Who reads it: ``torch.amp.GradScaler.unscale_(opt)`` unscales and inf-checks the
    gradients of ``opt.param_groups``, i.e. these.  Before (habits18), ZeRO-1's shards
    held none until ``step``: ``unscale_`` unscaled nothing, ``opt.clip_grad_norm_`` after
    it returned the scaled norm (1024x at scale 2**10), silently, then ``scaler.step``
    raised torch's "No inf checks were recorded for this optimizer"; the fix asked of the
    user was ``opt.reduce_grads_()`` before ``unscale_``.  Under torch.distributed each
    process holds (and a scaler inf-checks) its own chunks only, as under FSDP: use torch's
    ``ShardedGradScaler`` (``torch.distributed.fsdp.sharded_grad_scaler``), which
    all-reduces the inf flags so that every process skips the same steps (a plain
    ``GradScaler`` would let a process whose chunks are finite step alone, and wait in
    the step's all-gather); before, the gradients stayed unreduced until ``step`` there
    and ``scaler.step`` raised torch's "No inf checks" whichever scaler."""

    @property
    def grad(self):
        ref = self.__dict__.get("_wb_zero")
        opt = ref() if ref is not None else None
        if opt is not None and not opt._busy and opt._unreduced():
            if opt.distributed:     # a collective: every process of the group reads, or
                from ...sim_mesh.agreed_reads import agree      # the reader is told
                agree(list(_B.group(opt.group_mesh, opt.group_axis)[1]),
                      "the ZeroRedundancyOptimizer shards' .grad (its first read "
                      "reduce-scatters the gradients: scaler.unscale_(opt) on every process)",
                      "reduce-scattered over")
            opt.reduce_grads_()
        return torch.Tensor.grad.__get__(self)

    @grad.setter
    def grad(self, value):
        torch.Tensor.grad.__set__(self, value)

    @grad.deleter
    def grad(self):
        torch.Tensor.grad.__delete__(self)

    def __reduce_ex__(self, proto):
        # pickled (torch.save) as the plain nn.Parameter it is, without the optimizer's
        # link (a weak reference cannot be pickled)
        return nn.Parameter(self.detach(), self.requires_grad).__reduce_ex__(proto)
