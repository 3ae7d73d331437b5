"""The reducer of :class:`~.ddp.DistributedDataParallel` (plain modules): torch DDP's
``Reducer`` (``torch/csrc/distributed/c10d/reducer.cpp``), on simulated ranks or processes.

A mixin of the wrapper, reading what its constructor sets: ``group`` (a
:class:`~.ranks.RankGroup`), ``module``, ``_book`` (the buckets, :class:`~.ddp_buckets.
BucketBook`), ``_sync_enabled`` (False inside :meth:`no_sync`), ``_find_unused``,
``_static``, ``_as_view`` (torch's ``find_unused_parameters``, ``static_graph``,
``gradient_as_bucket_view``), ``_unused`` (the parameters the last forward's outputs do
not reach) and ``_synced`` (simulated ranks: ids of the parameters whose rows hold the
average).  Each parameter's post-accumulate-grad hook (:meth:`_on_grad`) marks it ready;
a bucket whose parameters are all ready, and every bucket before it launched, is
all-reduced as one buffer (:meth:`_launch`); :meth:`finish_gradient_synchronization`, run
by itself at the end of backward, launches the rest, waits, and leaves the averages.
What it does, and where torch's own differs, is told in :mod:`.ddp`'s docstring.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .ddp_buckets import sync_bucket_indices
from .flat_shards import pack, unpack
from .rank_grads import as_rank_rows
from .unfinished import prior_reduction_error

__all__ = ["Reducer"]


class Reducer:
    """Gradient synchronization of :class:`~.ddp.DistributedDataParallel` (module
    docstring)."""

    def _rebuild_buckets(self):
        """torch's ``Reducer::rebuild_buckets`` before a forward: the buckets in the order
        the recorded backward produced the gradients, rank 0's sent to every rank."""
        self._ensure_prior_reduction_finished()
        book, g = self._book, self.group
        if book.pending is None:
            return
        cast = (lambda t: dist.broadcast(t, src=g.global_rank(0), group=g.pg)) \
            if g.distributed else None
        buckets = sync_bucket_indices(
            book.rebuilt_buckets(),
            lambda n: g.wait(g.record("broadcast", n, "ddp rebuild buckets")), cast)
        book.rebuild(buckets)
        self._reset()

    def _ensure_prior_reduction_finished(self):
        """torch's ``Reducer::ensure_prior_reduction_finished`` (run by ``rebuild_buckets``
        before a forward with grad enabled): the last backward left trainable parameters
        without a gradient under ``find_unused_parameters=False``, so torch's reducer never
        finished it; raise as torch does, naming them (:func:`.unfinished.prior_reduction_error`)."""
        left = getattr(self, "_unfinished", None)
        if left:                        # kept: every later forward raises again, as torch's
            names = {id(q): n for n, q in self.module.named_parameters()}
            rank = dist.get_rank(self.group.pg) if self.group.distributed else None
            raise prior_reduction_error([(i, names.get(id(self._book.params[i]), "?"))
                                         for i in left], rank)

    # ---- gradient synchronization ---------------------------------------------------------
    def _reset(self):
        self._book.reset()
        self._pending = []          # (bucket index, work or None, flat or None, trace handles)
        self._unused_ids = set()    # ids of self._unused marked ready in this backward
        self._callback_queued = False
        self._done = True

    @torch.no_grad()
    def _before_grad(self, p):
        """Simulated ranks, before a backward adds to a gradient already averaged (every
        row the average G): keep G in row 0 only, so that the rows' sum (the all-reduce)
        gives G plus the ranks' new gradients, as torch DDP's average of G + each rank's
        does.  Rows not yet averaged (inside no_sync) are summed as they are."""
        if id(p) in self._synced:
            self._synced.discard(id(p))
            if p.grad is not None:
                p.grad[1:].zero_()

    def _on_grad(self, p):
        if not self.group.distributed:     # torch's clip_grad_norm_ reads one row's norm
            p.grad = as_rank_rows(p.grad)
        if not self._sync_enabled:
            return
        launch = []
        if not self._callback_queued:       # finish by itself at the end of this backward
            self._callback_queued, self._done = True, False
            torch.autograd.Variable._execution_engine.queue_callback(
                self.finish_gradient_synchronization)
            self._unused_ids = {id(q) for q in self._unused}
            for q in self._unused:          # torch marks them ready at the first hook
                launch += self._book.mark_ready(q)
        if id(p) in self._unused_ids:
            self._refuse_unreached(p)
        if self._static and self._book.backwards == 0:
            self._book.mark_ready(p, launch=False)   # static_graph: all at the end, once
            return
        for b in launch + self._book.mark_ready(p):
            self._launch(b)

    def _refuse_unreached(self, p):
        """``p`` was marked ready (unused) at the first hook, its bucket maybe sent
        already, and now receives a gradient: torch's reducer raises ("Expected to mark a
        variable ready only once"); going on would average zeros in its place."""
        name = next((n for n, q in self.module.named_parameters() if q is p), "?")
        self._reset()
        if self._static:
            raise RuntimeError(
                f"DistributedDataParallel(static_graph=True): parameter {name!r} received a "
                "gradient, but the first backward left it unused, so it is reduced as unused "
                "(zeros) before its gradient comes; a graph that changes between steps needs "
                "static_graph=False (and find_unused_parameters=True if some steps skip "
                "parameters)")
        raise RuntimeError(
            f"DistributedDataParallel(find_unused_parameters=True): parameter {name!r} "
            "received a gradient, but the forward's outputs do not reach it, so it was "
            "reduced as unused (zeros) before its gradient came; return every tensor the "
            "loss uses from forward (a tensor, list, tuple, dict or dataclass of them), or "
            "compute the loss inside forward")

    @torch.no_grad()
    def _launch(self, b):
        """All-reduce bucket ``b``'s buffer: every parameter of it (zeros for one without a
        gradient, as torch's bucket contents)."""
        bucket = self._book.buckets[b]
        g = self.group
        label = "ddp grad" if len(bucket) == 1 else "ddp bucket"
        handles = g.record("all_reduce", self._book.nbytes(b), label, overlap=True)
        if not g.distributed:
            # the ranks' rows summed (each row already holds 1/N of the global mean)
            for p in bucket:
                # a gradient averaged by an earlier backward and not touched by this one
                # (every row already the average: unused now) is that average, not N times it
                if p.grad is not None and id(p) not in self._synced:
                    # (over the storage's rows: p.grad.sum() is one device's, .rank_grads)
                    with torch._C.DisableTorchFunctionSubclass():
                        p.grad.copy_(p.grad.sum(0, keepdim=True).expand_as(p.grad))
                    self._synced.add(id(p))
            self._pending.append((b, None, None, handles))
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = grads[0] if len(bucket) == 1 else pack(grads)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=g.pg, async_op=True)
        self._pending.append((b, work, flat, handles))

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Launch the buckets still open, wait for every all-reduce, and leave each
        gradient the average over the data-parallel ranks."""
        if self._done:
            return                  # nothing to synchronize (or done at the end of backward)
        hooked = self._book.index
        late = [n for n, p in self.module.named_parameters()
                if p.grad is not None and id(p) not in hooked]
        if late:
            raise RuntimeError(f"DistributedDataParallel: {late[:3]} received gradients but "
                               "were frozen when the wrapper was built, so no rank averages "
                               "them; set requires_grad before wrapping the module")
        book = self._book
        # static_graph's first backward (torch's delay_all_reduce): which parameters each
        # rank used, then every bucket; find_unused_parameters: the buckets, then the map
        first = self._static and book.backwards == 0
        used = self._used_map() if first else None
        for b in book.rest():
            self._launch(b)         # buckets with unused parameters
        if self._find_unused and not self._static:
            used = self._used_map()
        if first:                   # a static graph's unused: ready from the first hook
            self._unused = [p for p in book.params if book.index[id(p)] not in book.marked]
        out = []                    # (parameter, its averaged piece, bucket size)
        for b, work, flat, handles in self._pending:
            self.group.wait(handles)
            if work is None:
                continue
            work.wait()
            flat.div_(self.group.n)
            ps = book.buckets[b]
            pieces = [flat] if len(ps) == 1 else unpack(flat, [p.shape for p in ps])
            out += [(p, piece, len(ps)) for p, piece in zip(ps, pieces)]
        unmarked = set()
        if not self._find_unused and not self._static:
            # find_unused_parameters=False: a trainable parameter no hook marked in this
            # backward (here: on any rank) leaves torch's reducer unfinished; the next
            # forward raises as torch's (a stale .grad from an earlier step changes nothing:
            # marked is the hooks', not the values')
            unmarked = {i for i in range(len(book.params)) if i not in book.marked}
        if used is None:
            self._refuse_used_elsewhere(out)
        for p, piece, size in out:
            if book.index[id(p)] in unmarked:
                continue                        # torch's reduction never finished: as it is
            if p.grad is None and used is not None and used[book.index[id(p)]]:
                p.grad = piece.clone()          # used on another rank: torch gives it one
            elif p.grad is None:
                continue                        # used on no rank: grad stays None
            elif self._as_view and size > 1:
                p.grad = piece                  # gradient_as_bucket_view: a view of the bucket
            elif piece is not p.grad:
                p.grad.copy_(piece)
        book.backward_done()
        self._reset()
        self._unfinished = sorted(unmarked) or None

    def _refuse_used_elsewhere(self, out):
        """torch.distributed without the used-parameter map (``find_unused_parameters=
        False``): a parameter with no gradient here whose average is not zero was used on
        another rank.  torch's reducer then never finishes the step (a hang, or "Expected
        to have finished reduction" at the next forward); keeping ``grad=None`` here while
        the other ranks step it would let the replicas drift apart, so raise, before any
        gradient is written."""
        # no gradient here and a nonzero average: used on another rank (a zero average
        # says nothing, unmarked parameters are refused at the next forward)
        late = [p for p, piece, _ in out if p.grad is None and bool(piece.any())]
        if late:
            names = {id(q): n for n, q in self.module.named_parameters()}
            self._reset()
            raise RuntimeError(
                f"DistributedDataParallel: {[names[id(p)] for p in late][:3]} received no "
                "gradient on this rank but one on another (the ranks' forwards used "
                "different parameters), so the replicas would drift apart; pass "
                "find_unused_parameters=True (torch's argument for a forward that skips "
                "parameters), or use every parameter on every rank")

    def _used_map(self):
        """torch's all-reduce of which parameters each rank used (``local_used_map``, one
        int32 each), waited for only when a parameter went unused here (torch's lazy wait
        in ``finalize_bucket_dense``); on torch.distributed returns it (a parameter used on
        any rank gets a gradient)."""
        book, g = self._book, self.group
        unused = {id(p) for p in self._unused}
        here = [book.index[id(p)] in book.marked and id(p) not in unused for p in book.params]
        handles = g.record("all_reduce", 4 * len(book.params), "ddp used params",
                           overlap=True)
        if not all(here):
            g.wait(handles)
        if not g.distributed:
            return None
        used = torch.tensor(here, dtype=torch.int32)
        dist.all_reduce(used, op=dist.ReduceOp.SUM, group=g.pg)
        return used.tolist()

    def register_comm_hook(self, state, hook):
        """torch DDP's communication hooks are not built: refused by name (was Python's
        AttributeError)."""
        raise NotImplementedError(
            f"DistributedDataParallel.register_comm_hook(hook={getattr(hook, '__name__', hook)!r}"
            "): communication hooks are not built here; each bucket is all-reduced and "
            "averaged (torch's default, allreduce_hook).  Leave the hook out, or run torch's "
            "own DistributedDataParallel for compression hooks")

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag that ``no_sync()`` clears (torch 2.13
        ``torch/nn/parallel/distributed.py:1680-1685``); nanoGPT's train.py sets it by
        hand instead of ``no_sync()``: ``model.require_backward_grad_sync = (micro_step ==
        gradient_accumulation_steps - 1)``.  False: the backwards reduce nothing, as inside
        ``no_sync()``.  (It was a plain attribute nothing read: every micro-batch was
        all-reduced, the gradients the same sum but N times the traffic, silently.)"""
        return self._sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, flag: bool) -> None:
        if not isinstance(flag, bool):
            raise TypeError(f"require_backward_grad_sync = {flag!r}: give True or False")
        self._set_sync(flag)

    def _set_sync(self, flag: bool) -> None:
        self._sync_enabled = flag

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no all-reduce) inside the block; the first
        backward after it reduces the sum (``DistributedDataParallel.no_sync``)."""
        old, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = old

    @property
    def bucket_names(self) -> list[list[str]]:
        """The parameters' names in each bucket, in the order the buckets are launched
        (torch's ``bucket.parameters()`` in a comm hook)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in ps] for ps in self._book.buckets]

