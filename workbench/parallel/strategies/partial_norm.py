"""This rank's part of a norm of gradient shards (:class:`PartialNorm`), reduced over the
ranks when torch takes the norm of the stacked norms, as FSDP2's per-shard norms come
back ``_NormPartial``; and calls with subclass dispatch off (:func:`_plain`)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...sim_mesh.backends import all_reduce_


def _plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


def _mixed():
    return RuntimeError(
        "clip_grad_norm_ over FullyShardedDataParallel's shards together with other "
        "tensors: a shard's norm is a partial norm, the others' are whole; clip the "
        "wrapper's parameters on their own (fsdp.parameters())")


_READ = "a norm of a wrapper's gradient shards (p.grad.norm(), clip_grad_norm_)"


def _groups(pg):
    return pg if isinstance(pg, tuple) else (pg,)


class PartialNorm(torch.Tensor):
    """This rank's part of a norm (of its shards): ``.to`` and ``torch.stack`` keep it
    partial; ``torch.linalg.vector_norm`` of it combines the ranks' parts (the p-th
    powers summed, or the max / min for p = +-inf; one all-reduce) into the true norm, a
    plain tensor equal on every rank.  Any other use reduces it first."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:         # torch moves each norm to the first's device
            return _keep(_plain(func, args, kwargs), args[0])
        if func is torch.stack:
            ts = args[0]
            if not all(isinstance(t, PartialNorm) for t in ts):
                raise _mixed()
            return _keep(_plain(func, args, kwargs), ts[0])
        if func is torch.linalg.vector_norm and len(args) >= 1 and \
                isinstance(args[0], PartialNorm) and kwargs.get("dim") is None:
            x = args[0]
            ord_ = float(args[1] if len(args) > 1 else kwargs.get("ord", 2.0))
            if ord_ != x._wb_ord:
                raise ValueError(f"the norm of order {ord_} of partial norms of order "
                                 f"{x._wb_ord}: take both of the same order")
            return _reduce(x.as_subclass(torch.Tensor), ord_, x._wb_pg)
        # any other use: the full norms first (each element reduced on its own)
        args = [_full(a) if isinstance(a, PartialNorm) else a for a in args]
        return _plain(func, args, kwargs)


def _keep(out, like):
    out = out.as_subclass(PartialNorm)
    out._wb_pg, out._wb_ord = like._wb_pg, like._wb_ord
    return out


def _reduce(x, ord_, pg):
    """The norm of order ``ord_`` of the vector whose pieces' norms on the ranks are ``x``
    (a read one process makes alone waits for its peers, as torch's ``_NormPartial``
    does: it ends in an error naming the fix, agreed_reads.reading)."""
    from ...sim_mesh.agreed_reads import reading
    with torch._C.DisableTorchFunctionSubclass(), reading(_READ):
        x = x.detach().reshape(-1)
        if ord_ == math.inf:
            v = x.amax() if x.numel() else torch.tensor(0.0)
            for g in _groups(pg):       # NaN kept, as torch's max of the norms (sweep18)
                all_reduce_(v, "max", g)
            return v
        if ord_ == -math.inf:
            v = x.amin() if x.numel() else torch.tensor(math.inf)
            for g in _groups(pg):
                all_reduce_(v, "min", g)
            return v
        v = x.sum() if ord_ == 0 else x.pow(ord_).sum()
        for g in _groups(pg):        # the groups of each dim in turn: the whole mesh's sum
            dist.all_reduce(v, op=dist.ReduceOp.SUM, group=g)
        return v if ord_ == 0 else v.pow(1.0 / ord_)


def _full(x):
    """Each element of the partial norms ``x`` reduced over the ranks (one all-reduce)."""
    from ...sim_mesh.agreed_reads import reading
    with torch._C.DisableTorchFunctionSubclass(), reading(_READ):
        ord_, pg = x._wb_ord, x._wb_pg
        v = x.detach().clone()
        if ord_ in (math.inf, -math.inf):
            for g in _groups(pg):
                all_reduce_(v, "max" if ord_ > 0 else "min", g)
            return v
        if ord_ != 0:
            v = v.pow(ord_)
        for g in _groups(pg):
            dist.all_reduce(v, op=dist.ReduceOp.SUM, group=g)
        return v if ord_ == 0 else v.pow(1.0 / ord_)
