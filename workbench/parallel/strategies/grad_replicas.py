"""``GradReplicas``: the replicas of DistTensor parameters along the data-parallel mesh
dim(s), and the sum of their gradients, in buckets.  The engine of DDP's DistTensor mode
(:class:`~.ddp_dist.DistTensorDDP`, whose docstring tells what it does and where torch's
reducer differs), of ``DataParallel`` (:mod:`.data_parallel`), the hybrid recipe and
ZeRO's DistTensor optimizer (:mod:`.zero_optimizer_dist`)."""
from __future__ import annotations

import math

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...sim_mesh import backends as _B
from ...sim_mesh import collectives as C
from ...sim_mesh.collectives import Cells
from .. import step_clock
from ..dist_tensor import DistTensor
from .flat_dims import all_reduce_dims, flatten_dims
from .flat_shards import pack, unpack
from .rank_grads import ReplicaGrad, as_replica_grad
from .ddp_buckets import BucketBook, sync_bucket_indices
from .ranks import bucket_order
from .unfinished import prior_reduction_error

__all__ = ["GradReplicas"]


class GradReplicas:
    """The replicas of DistTensor ``params`` along ``dim`` of ``mesh``, and the sum of
    their gradients (module docstring).  ``dim`` may be a tuple of adjacent dims (context
    parallelism's ("dp", "cp")): replicas on each, one all-reduce per bucket over all of
    them (:mod:`.flat_dims`).  ``who`` names the caller in errors."""

    def __init__(self, params, mesh, dim="dp", bucket_bytes=None, partial_grads=(),
                 partial_dim="tp", who: str = "DistributedDataParallel", policy=None,
                 find_unused=None, carry_summed: bool = True):
        params = [p for _, p in params] if params and isinstance(params[0], tuple) \
            else list(params)
        # a tensor listed twice (a tied weight from two modules) is one parameter
        self.params = list({id(p): p for p in params}.values())
        self.mesh = mesh
        # several adjacent dims (("dp", "cp")): replicas on each, gradients summed over
        # all of them by one collective per bucket on the merged group (flat_dims)
        dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
        if not dims:
            raise ValueError(f"{who}: dim=(); name the data-parallel mesh dim(s), e.g. 'dp'")
        self.axes = tuple(mesh.dim(d) for d in dims)
        self.axis = self.axes[0]
        self._flat, self._flat_axis = flatten_dims(mesh, self.axes)
        ids = {id(p) for p in self.params}
        if any(id(p) not in ids for p in partial_grads):
            raise ValueError("partial_grads: every one must be one of params")
        self._partial = {id(p) for p in partial_grads}
        self.partial_axis = mesh.dim(partial_dim) if self._partial else None
        self.n = math.prod(mesh.shape[a] for a in self.axes)
        if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or
                                         not isinstance(bucket_bytes, (int, float)) or
                                         not bucket_bytes > 0):
            raise ValueError(f"bucket_bytes={bucket_bytes!r}: give a size > 0 in bytes, "
                             "math.inf for one bucket, or None for one all-reduce per gradient")
        self.bucket_bytes = bucket_bytes
        self.distributed = _B.is_distributed(mesh)
        for p in self.params:
            if not isinstance(p, DistTensor):
                raise ValueError(f"{who} needs DistTensor parameters, got a "
                                 f"{type(p).__name__}")
            if isinstance(p._local, Cells):
                raise ValueError(
                    f"{who} needs evenly sharded DistTensor parameters: one of shape "
                    f"{tuple(p.shape)} is laid out {[str(q) for q in p.placements]} on mesh "
                    f"{dict(zip(mesh.dim_names, mesh.shape))}, uneven shards (torch.chunk "
                    "sizes differ).  Make each sharded dim a multiple of its mesh dims' "
                    "sizes (pad a vocabulary: Megatron's make_vocab_size_divisible_by)")
            for a in self.axes:
                if not p.placements[a].is_replicate():
                    raise ValueError(f"a parameter is {p.placements[a]} on the data-parallel "
                                     f"dim {mesh.dim_names[a]!r}; parameters must be "
                                     "replicated there")
        self.hooked: set = set()            # ids of the parameters trainable when wrapped
        carried = []                        # (parameter, the gradient it had before)
        for p in self.params:
            # one replica per data-parallel rank (the dp axis becomes real storage; on
            # torch.distributed every process already is one replica)
            trainable = p.requires_grad          # frozen parameters stay frozen
            old_grad = p._local.grad             # a backward before the wrap: kept below
            if old_grad is not None and self.distributed:
                raise RuntimeError(
                    f"{who}: a parameter already has a gradient (a backward ran before "
                    "the wrap); on torch.distributed it is not known whether it was summed "
                    "over the data-parallel ranks. Wrap (build_optimizer) before the first "
                    "backward, or clear the gradients first (model.zero_grad())")
            loc = p._local.detach()
            if self.distributed:
                loc = loc.clone()
                # the replicas start from dp rank 0's values (torch.distributed's
                # from_local/shard_tensor do not check that processes agree)
                for a in self.axes:
                    _B.broadcast_(loc, mesh, a, 0)
                # (a tag the parameter had kept: sequence_parallel_norms' tp copies)
                _B.tag(loc, tuple(getattr(p._local, "_wb_replica_axes", ())) + self.axes)
            elif any(loc.shape[a] == 1 for a in self.axes):
                shape = list(loc.shape)
                for a in self.axes:
                    shape[a] = mesh.shape[a]
                loc = loc.expand(shape).clone()
            p._local = loc.requires_grad_(trainable)
            if old_grad is not None:
                carried.append((p, old_grad))
            step_clock.hold([p._local], mesh.ranks, mesh.ndim)       # an optimizer's step over it: on the clock
            if trainable:
                self.hooked.add(id(p))
                p._local.register_hook(self._before_grad(p))
                p._local.register_post_accumulate_grad_hook(self._grad_hook(p))
        self.who = who
        # torch DDP's buckets (.ddp_buckets) when a policy is given and no bucket_bytes:
        # DistributedDataParallel's default; the order is recorded by the grad hooks
        self.book = None
        # False inside DistTensorDDP.no_sync: torch's reducer records the order of a
        # backward that all-reduces only (its hooks return early under no_sync)
        self.mark_ready = True
        self.names = None                   # the parameters' names, for errors (the wrapper's)
        # DistributedDataParallel's find_unused_parameters (None: not DDP, or static_graph:
        # no check): which parameters each backward used is read from the hooks
        # (self.used, torch's local_used_map), never from the gradients' values
        self.find_unused = find_unused
        self.used: set = set()              # ids of parameters whose hook ran since the sum
        self.unfinished = None              # find_unused=False: [index] no hook marked
        if policy is not None and bucket_bytes is None:
            trainable = [p for p in self.params if id(p) in self.hooked]
            lead = (0,) * mesh.ndim
            self.book = BucketBook(trainable, [p._local[lead].numel() * p._local.element_size()
                                               for p in trainable], policy)
        # what torch.nn.utils.clip_grad_norm_ over the replicas says before the sum
        self.unsynced_hint = (
            f"torch.nn.utils.clip_grad_norm_ over {who}'s replicas before their gradients "
            "are summed over the data-parallel ranks (each rank would clip by its own "
            f"gradient): call {who}.finish_gradient_synchronization() after backward, then "
            "clip (inside no_sync() nothing is summed)")
        for p, g in carried:
            p._local.grad = self._carried_grad(p, g, carry_summed)

    @torch.no_grad()
    def _carried_grad(self, p, g, summed: bool):
        """The gradient ``p`` had before the wrap, on its replicas: torch's DDP and
        optimizers leave ``.grad`` alone, so a step after the wrap still sees it (before,
        the new replica leaves dropped it and a torch.optim step skipped every parameter).
        One copy on the data-parallel dims (the simulator's replicated parameter) already
        holds the sum over them: each replica gets that sum, marked summed, unless a
        partial one (``partial_grads``) still needs its sum over ``partial_dim``, or the
        owner sums every gradient whatever its mark (ZeRO's reduce-scatter: ``summed``
        False); then dp rank 0 keeps it and the others hold zeros, so the next sum gives
        it back.  A gradient with a real copy per dp rank is each rank's own (unsummed)
        unless marked summed (``_wb_synced``: an earlier wrapper's replicas, every copy the
        sum), which is carried as the one-copy sum is (was: summed again, dp x)."""
        nd = self.mesh.ndim
        shape = tuple(p._local.shape)
        one_copy = all(g.shape[a] == 1 for a in self.axes)
        if not one_copy and not getattr(g, "_wb_synced", False):
            return self._replica_grad(p, g.detach().clone(), False)
        out = g.detach().expand(shape[:nd] + tuple(g.shape[nd:])).clone()
        pa = self.partial_axis
        if not summed or (id(p) in self._partial and g.shape[pa] > 1):
            keep = torch.zeros(shape[:nd], dtype=torch.bool)
            keep[tuple(slice(0, 1) if a in self.axes else slice(None) for a in range(nd))] = True
            out.masked_fill_(~keep.reshape(shape[:nd] + (1,) * (out.dim() - nd)), 0)
            return self._replica_grad(p, out, False)
        return self._replica_grad(p, out, True)

    # ---- gradients torch's clip_grad_norm_ reads as one device (rank_grads.ReplicaGrad) ----
    def _replica_grad(self, p, g, synced: bool, partial_summed: bool = False):
        """``g`` as ``p``'s replica gradient (:func:`.rank_grads.as_replica_grad`).  Not
        ``synced``: each rank's copy is its share of the model's gradient (the loss's
        gradient through this rank's part of the batch: the shares sum to it, and the sum
        is what :meth:`reduce` and ZeRO's reduce-scatter take), so ``_wb_unsummed`` names
        the mesh axes to sum them over, the data-parallel ones (and ``partial_dim`` for a
        partial gradient not yet summed there, ``partial_summed`` False), each where the
        copies are real (one per rank: simulated ranks' full axis, or a process).  A user's
        ``p.grad`` (``DistTensor.grad``) is then ``Partial("sum")`` there, so its reads
        (``full()``, ``norm()``, ``sum()``) reduce the shares: one device's gradient, the
        one ``step()`` will apply.  Before (zero1tp: ZeRO-1 over dp 2 x tp 2), it said
        ``Replicate`` and read dp rank 0's share: ``p.grad.full().norm()`` 0.2533 where one
        device's is 0.3791.

        Why Partial and not a refusal (as torch's clip over the replicas gets, below): it is
        what the gradient is (DTensor's name for an unreduced value; ``{U_dp}``), exact for
        every read (the dispatcher reduces a Partial before any op that is not linear) and
        every in-place write (a linear one scales each share; another is reduced and
        written back as one share, so the step's sum is still the written value:
        ``test_zero1tp``), and it leaves the habits that touch ``p.grad`` before the sum
        working (``p.grad is not None``, ``zero_()``).  The step's collectives are
        untouched: it sums the storage's gradients, never ``p.grad``; a read's reduction
        is its own all-reduce, on the trace where the user reads."""
        axes = tuple(a for a, pl in enumerate(p.placements) if not pl.is_shard())
        refuse = None
        sharded = [self.mesh.dim_names[a] for a, pl in enumerate(p.placements)
                   if pl.is_shard() and self.mesh.shape[a] > 1]
        if self.distributed and sharded:
            refuse = (f"torch.nn.utils.clip_grad_norm_ over {self.who}'s replicas under "
                      f"torch.distributed: a parameter is sharded on mesh dim {sharded[0]!r}, "
                      "so this process's gradient is a shard and its norm not the model's; "
                      "call wb.clip_grad_norm_(model.parameters(), max_norm) (the "
                      "DistTensors: it combines the shards' norms)")
        out = as_replica_grad(g, axes, synced, self.unsynced_hint, refuse, p._local)
        if out is not None:
            over = () if synced else self.axes + (
                (self.partial_axis,) if id(p) in self._partial and not partial_summed else ())
            out._wb_unsummed = tuple(a for a in over
                                     if self.distributed or out.shape[a] == self.mesh.shape[a])
        return out

    def _before_grad(self, p):
        """Before backward adds to a gradient already summed (every copy the sum G): keep
        G in one copy (dp rank 0's; for a partial one, tp rank 0's too), so the next sum
        gives G plus the ranks' new gradients, as torch DDP's average of G + each rank's."""
        @torch.no_grad()
        def hook(grad):
            g = p._local.grad
            if g is None or not getattr(g, "_wb_synced", False):
                return None
            axes = list(self.axes) + ([self.partial_axis] if id(p) in self._partial else [])
            if self.distributed:
                if any(_B.local_index(self.mesh, a) != 0 for a in axes):
                    g.zero_()
            else:
                keep = torch.zeros_like(g, dtype=torch.bool)
                idx = [slice(None)] * g.dim()
                for a in axes:
                    idx[a] = slice(0, 1)
                keep[tuple(idx)] = True
                g.masked_fill_(~keep, 0)
            g._wb_synced = False
            g._wb_unsummed = tuple(a for a in axes
                                   if self.distributed or g.shape[a] == self.mesh.shape[a])
            return None
        return hook

    def _grad_hook(self, p):
        def hook(leaf):             # a gradient backward accumulated: not summed over dp
            self.used.add(id(p))
            if self.book is not None and self.mark_ready:
                self.book.mark_ready(p, launch=False)   # the order the rebuild takes
            if leaf.grad is not None:
                leaf.grad = self._replica_grad(p, leaf.grad, False)
        return hook

    def is_partial(self, p) -> bool:
        return id(p) in self._partial

    def lead(self, t):
        """``t`` with every mesh axis at full size (one copy per rank), so tensors of
        different placements can share one buffer (torch.distributed: one rank, all 1)."""
        lead = (1,) * self.mesh.ndim if self.distributed else tuple(self.mesh.shape)
        return t.expand(lead + tuple(t.shape[self.mesh.ndim:]))

    @torch.no_grad()
    def reduce(self, params=None) -> None:
        """Every gradient of ``params`` (default: all that have one) summed over dp (the
        global loss's gradient: each rank's already carries its 1/N of the mean), written
        back as each replica's ``.grad``; partial ones first summed over their dim."""
        # a gradient already summed (finish_gradient_synchronization called twice, or
        # DataParallel.step after it) is not summed again
        everyone = params is None
        params = [p for p in (self.params if params is None else params)
                  if p._local.grad is not None and
                  not getattr(p._local.grad, "_wb_synced", False)]
        absent: list = []
        # by the hooks (DDP): the trainable parameters no backward since the last sum used
        # here, whatever their .grad holds (None, or a stale one from an earlier step)
        unmarked = [p for p in self.params if id(p) in self.hooked and id(p) not in self.used] \
            if self.find_unused is not None and everyone else None
        if self.distributed and everyone:
            # processes: every one sends the same buffers (torch's bucket contents), a
            # parameter without a gradient here as zeros; left out, the processes' buffers
            # would not line up (a hang, or one parameter summed with another)
            absent = unmarked if unmarked is not None else \
                [p for p in self.params if id(p) in self.hooked and p._local.grad is None]
            keep = {id(p) for p in params + absent}
            params = [p for p in self.params if id(p) in keep]
        self.sum_partials(params)
        absent_ids = {id(p) for p in absent}
        grads = [self._absent_grad(p) if id(p) in absent_ids else p._local.grad
                 for p in params]
        summed = self._all_reduce(grads, params)
        # every process all-reduces the map each step (torch's), whether it skipped any
        used = self._used_map() if self.find_unused and self.distributed and everyone else None
        if not self.find_unused:
            self._refuse_used_elsewhere(params, summed, absent_ids)
        for p, g in zip(params, summed):
            if id(p) in absent_ids and not (used is not None and used[id(p)]):
                continue        # used on no rank (or find_unused=False): left as it is
            p._local.grad = self._replica_grad(p, g, True)
        if unmarked and self.find_unused is False:
            # torch's reducer is left waiting for them: the next forward raises
            ids = {id(p) for p in unmarked}
            self.unfinished = [i for i, p in enumerate(self.params) if id(p) in ids]
        self.used = set()
        if self.book is not None and params:
            self.book.backward_done()
            self.book.reset()

    def _absent_grad(self, p):
        """What a parameter no hook marked here sends (torch's bucket contents: its .grad,
        zeros if None).  A stale gradient already summed (every replica the sum G) is sent
        by dp rank 0 only, as :meth:`_before_grad` keeps it, so the sum is G plus the other
        ranks' new gradients (torch's average of G and each rank's G + g)."""
        g = p._local.grad
        if g is None or not self.find_unused:
            # (find_unused_parameters=False: torch's reducer never sends it; zeros, so that
            # a nonzero sum says another rank used it)
            return torch.zeros_like(p._local)
        if getattr(g, "_wb_synced", False) and \
                any(_B.local_index(self.mesh, a) != 0 for a in self.axes):
            return torch.zeros_like(g)
        return g

    def _used_map(self) -> dict:
        """torch's all-reduce of which parameters each rank used (``local_used_map``, one
        int32 per trainable parameter, ``find_unused_parameters=True``): {id: used on any
        rank}.  Processes only (simulated ranks run one forward: used by all or by none)."""
        ps = [p for p in self.params if id(p) in self.hooked]
        here = torch.tensor([id(p) in self.used for p in ps], dtype=torch.int32)
        summed = self._sum(here.reshape((1,) * self.mesh.ndim + (-1,)), "ddp used params")
        return {id(p): bool(u) for p, u in zip(ps, summed.reshape(-1).tolist())}

    def ensure_prior_reduction_finished(self) -> None:
        """Before a forward with grad enabled: raise torch's error for a backward that left
        parameters unmarked under ``find_unused_parameters=False`` (:mod:`.unfinished`).
        Kept: every later forward raises it again, as torch's (its reducer stays unfinished)."""
        left = self.unfinished
        if left:
            names = self.names or [f"parameter {i}" for i in range(len(self.params))]
            rank = _B.rank() if self.distributed else None
            raise prior_reduction_error([(i, names[i]) for i in left], rank)

    def _refuse_used_elsewhere(self, params, summed, absent) -> None:
        """A parameter with no gradient on this process whose sum is not zero had one on
        another: keeping ``grad=None`` here while the others step it lets the replicas drift
        apart (torch's reducer hangs there), so raise before any gradient is written."""
        late = [p for p, t in zip(params, summed) if id(p) in absent and bool(t.any())]
        if late:
            names = self.names or [f"parameter {i}" for i in range(len(self.params))]
            which = [n for n, q in zip(names, self.params) if any(q is p for p in late)]
            raise RuntimeError(
                f"{self.who}: {which[:3]} received no gradient on this rank but one on "
                "another (the ranks' forwards used different parameters), so the replicas "
                "would drift apart; pass find_unused_parameters=True (torch's argument for a "
                "forward that skips parameters), or use every parameter on every rank")

    @torch.no_grad()
    def rebuild_buckets(self) -> None:
        """torch DDP's bucket rebuild before a forward (:mod:`.ddp_buckets`): the buckets in
        the order the gradients were ready, agreed by two broadcasts from dp rank 0 (the
        indices and the bucket count, then the buckets' lengths; int32)."""
        book = self.book
        if book is None or book.pending is None:
            return
        cast = (lambda t: _B.broadcast_(t, self._flat, self._flat_axis, 0)) \
            if self.distributed else None
        buckets = sync_bucket_indices(
            book.rebuilt_buckets(),
            lambda n: C.record_collective("broadcast", self._flat, self._flat_axis, n,
                                          "ddp rebuild buckets"), cast)
        book.rebuild(buckets)

    @torch.no_grad()
    def sum_partials(self, params) -> None:
        """Partial gradients (``partial_grads``) summed over their dim, one buffer."""
        part = [p for p in params if id(p) in self._partial and p._local.grad is not None]
        if not part:
            return
        nd = self.mesh.ndim
        buf = pack([self.lead(p._local.grad) for p in part], nd)
        red = C.all_reduce(buf, self.mesh, self.partial_axis, "sum", expanded=True,
                           label="sequence-parallel norm grads")
        for p, piece in zip(part, unpack(red, [p._local.grad.shape[nd:] for p in part], nd)):
            # back to the gradient's own lead: a dim it holds once (a parameter replicated
            # over cp as one copy, ZeRO over dp with context parallelism) stays one copy
            # (the expanded copies are equal, and so are their sums)
            keep = tuple(slice(0, 1) if n == 1 else slice(None)
                         for n in p._local.grad.shape[:nd])
            p._local.grad = self._replica_grad(p, piece[keep].contiguous(), False, True)

    def _sum(self, t, label):
        """``t`` summed over the data-parallel dim(s): one all-reduce per group."""
        if self._flat is self.mesh:
            return C.all_reduce(t, self.mesh, self.axis, "sum", expanded=True, label=label)
        return all_reduce_dims(t, self.mesh, self._flat, self._flat_axis, label=label)

    def _all_reduce(self, grads, params):
        mesh = self.mesh
        if self.book is not None:
            # torch DDP's buckets, each restricted to the gradients being summed
            at = {id(p): j for j, p in enumerate(params)}
            buckets = [[at[id(p)] for p in b if id(p) in at] for b in self.book.buckets]
            buckets = [b for b in buckets if b]
        elif not self.bucket_bytes:
            return [self._sum(g, "dp grad").contiguous() for g in grads]
        else:
            # buckets in reverse order of registration (the order backward produces them),
            # as DistributedDataParallel fills them (ranks.bucket_order)
            sizes = [g[(0,) * mesh.ndim].numel() * g.element_size() for g in grads]
            buckets = bucket_order(sizes, self.bucket_bytes)
        out = [None] * len(grads)
        lead = (1,) * mesh.ndim if self.distributed else tuple(mesh.shape)
        nd = mesh.ndim
        for bucket in buckets:
            flat = pack([grads[j].expand(lead + tuple(grads[j].shape[nd:])) for j in bucket], nd)
            # the sum is one copy expanded over dp (stride 0): each rank's own buffer, so
            # the gradients take in-place ops (clip's mul_, zero_grad's zero_) as torch's
            red = self._sum(flat, "dp bucket").contiguous()
            for j, piece in zip(bucket, unpack(red, [grads[j].shape[nd:] for j in bucket], nd)):
                for a in range(nd):             # replicated axes back to one copy
                    if grads[j].shape[a] == 1:
                        piece = piece.narrow(a, 0, 1)
                out[j] = piece
        return out


def _refuse_unsummed_step(optimizer, args, kwargs) -> None:
    """A ``torch.optim`` step over replicas whose gradients are not summed over the
    data-parallel ranks yet would step each rank by its own gradient (the replicas drift
    apart, silently): ``DataParallel`` sums in ``finish_gradient_synchronization()``
    (Megatron-LM's ``overlap_grad_reduce=False``); ``DistributedDataParallel`` sums by
    itself at the end of backward, as torch DDP, except inside ``no_sync()``.  A global
    optimizer step pre-hook (``torch.optim.optimizer.
    register_optimizer_step_pre_hook``), so any optimizer over the replicas is checked."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = getattr(p, "grad", None)
            if isinstance(g, ReplicaGrad) and not getattr(g, "_wb_synced", True):
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() over DistTensor replicas whose "
                    "gradients are not summed over the data-parallel ranks yet (each rank "
                    "would step by its own gradient): call finish_gradient_synchronization() "
                    "on the DistributedDataParallel (or DataParallel) after backward, then "
                    "step (inside no_sync() nothing is summed)")


register_optimizer_step_pre_hook(_refuse_unsummed_step)
