"""The step of :class:`~.zero_optimizer_dist.ChunkedZeroOptimizer`: the gradients summed
over dp (one reduce-scatter; ZeRO-2's already in backward), their norm and clipping as
one device's, the inner optimizer's step on each rank's chunks, the parameters gathered
back, and ``zero_grad``."""
from __future__ import annotations

import math

import torch

from ...sim_mesh import backends as _B
from ...sim_mesh import collectives as C
from ..module_state import clear_grad
from .flat_shards import unflat
from .zero_chunk_comm import _fit
from .zero_chunk_groups import _copy_hyper
from .zero_optimizer import run_closure


class _ChunkStep:
    """The step (a base of ``ChunkedZeroOptimizer``)."""

    # ---- the step --------------------------------------------------------------------------
    def _unreduced(self) -> bool:
        """A replica holds a gradient not yet reduce-scattered into its shard."""
        return any(p._local.grad is not None for p in self.params)

    def live(self) -> list[int]:
        """Indices of the parameters with a gradient (in ``.grad`` or reduced in backward)."""
        return [i for i, p in enumerate(self.params)
                if p._local.grad is not None or i in self._gshard]

    @torch.no_grad()
    def _reduce_grads(self, live) -> list:
        """Each live parameter's gradient shard, summed over dp: ZeRO-2's (reduce-scattered
        in backward, waited for now), then one reduce-scatter of the rest in one buffer.
        A gradient another wrapper already summed (marked ``_wb_synced``: every replica
        holds the sum, e.g. ``DistributedDataParallel`` wrapped over this optimizer's
        replicas, torch's DDP + ZeroRedundancyOptimizer habit) is not summed again: each
        rank takes its chunk of it (was: summed twice, dp x the gradient)."""
        from ...sim_mesh.trace import current_trace, suspend
        mesh, ax = self.group_mesh, self.group_axis
        for i in live:                  # the replicas converted after the shards were cut
            if self.params[i]._local.dtype != self.shards[i].dtype:
                raise RuntimeError(
                    f"ZeroRedundancyOptimizer: a parameter is {self.params[i]._local.dtype} "
                    f"but the optimizer's shard of it is {self.shards[i].dtype} (the model "
                    "was converted with .to(dtype) after the optimizer was built); build "
                    "the optimizer after converting the model")
        synced = {i for i in live if getattr(self.params[i]._local.grad, "_wb_synced", False)}
        self.replicas.sum_partials([self.params[i] for i in live if i not in synced])
        tr = current_trace()
        if tr is not None:
            tr.flush()                      # ZeRO-2's deferred reduce-scatters recorded
        for t, h in self._pending:          # ZeRO-2: the reduce-scatters launched in backward
            if t is tr and tr is not None:
                tr.wait(h)
        self._pending = []
        clocked, self._clocked = self._clocked, set()
        grads = [None if i in synced else self.params[i]._local.grad for i in live]
        shards = [self._gshard.pop(i, None) for i in live]
        for j, i in enumerate(live):    # already the sum over dp: this rank's chunk of it
            if i in synced:
                mine = _fit(self._my_chunk(self.params[i]._local.grad), self.shards[i])
                shards[j] = mine if shards[j] is None else shards[j] + mine
        todo = [j for j, g in enumerate(grads) if g is not None]
        if todo:     # gradients not reduced in backward: one reduce-scatter of one buffer
            buf = self._pack([self._flat(grads[j]) for j in todo])
            label = f"zero-{self.stage} grad"
            on_clock = [j for j in todo if live[j] in clocked]
            if on_clock:    # torch.distributed: those recorded in backward (_clock_hook)
                with suspend():
                    red = self._reduce_scatter(buf, label)
                rest = [j for j in todo if live[j] not in clocked]
                if rest and tr is not None:     # the others' one buffer, as simulated
                    nb = sum(math.prod(self._flat(grads[j]).shape[self.mesh.ndim:])
                             for j in rest) * buf.element_size()
                    C.record_collective("reduce_scatter", mesh, ax, nb, label,
                                        groups=[_B.group(mesh, ax)[1]])
            else:
                red = self._reduce_scatter(buf, label)
            for j, gs in zip(todo, self._unpack(red, [self.shards[live[j]] for j in todo])):
                shards[j] = gs if shards[j] is None else shards[j] + gs
        return shards

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the model's gradients by their total norm, as one device's
        ``torch.nn.utils.clip_grad_norm_`` over the model's parameters; returns that norm.

        ZeRO sums the gradients inside :meth:`step`, so clipping is the optimizer's (FSDP1's
        ``FullyShardedDataParallel.clip_grad_norm_``, DeepSpeed's ``gradient_clipping``):
        the gradients are reduce-scattered now (what ``step`` would do), each rank takes its
        shards' part of the norm, a scalar all-reduce over the mesh combines the parts, and
        the shards are scaled by ``min(max_norm / (total + 1e-6), 1)``; ``step`` then steps
        them.  Call it after the backward(s) of the step, before ``step``."""
        total = self.grad_norm(norm_type)
        self.scale_grads_(torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
        return total

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0, record: bool = True) -> torch.Tensor:
        """The total norm of the model's gradients, nothing scaled: the gradients are
        reduce-scattered now (kept for :meth:`step`) and the shards' parts combined by one
        scalar all-reduce over every rank of the mesh: Megatron-LM's distributed optimizer
        reduces its gradient statistics over all its ranks, dp and model-parallel together
        (``megatron/core/optimizer/distrib_optimizer.py:796-802``
        ``get_grad_stats_parallel_group``, ``clip_grads.py:55-140`` ``get_grad_norm_fp32``:
        one ``all_reduce`` of ``sum |g|^p`` on that group; NVIDIA/Megatron-LM d98e8a6);
        DeepSpeed's ZeRO-1/2 all-reduces over dp and then over the model-parallel group
        (``deepspeed/runtime/zero/stage_1_and_2.py:2054-2098`` ``get_grad_norm_direct``,
        deepspeedai/DeepSpeed edaa722: two all-reduces where Megatron has one); this
        library's ZeRO-1/2 is Megatron's (one contiguous buffer, module docstring), and so
        is its torchrun clip (:mod:`workbench.recipes.pipeline_clip_dist`).  Was: one
        all-reduce per mesh dim (Hybrid dp 2 x tp 2: four events where torchrun records
        one).
        ``record=False``: a pipeline records the one over every stage's ranks instead
        (:func:`workbench.recipes.pipeline_clip.clip_grad_norm_`)."""
        p = float(norm_type)
        if self.distributed:
            raise NotImplementedError("ZeroRedundancyOptimizer(partition='chunks')."
                                      "clip_grad_norm_ under torch.distributed is not built; "
                                      "clip on a simulated mesh")
        if p in (0.0, -math.inf):
            raise ValueError(f"norm_type={norm_type!r}: the padded shards hold zeros that "
                             "this norm would count; use a p-norm p > 0 or inf")
        norms = []
        for i, gs in self.reduce_grads_().items():
            for a, pl in enumerate(self.params[i].placements):
                if a not in self.axes and not pl.is_shard() and gs.shape[a] > 1:
                    gs = gs.narrow(a, 0, 1)     # a replicated dim: one copy
            norms.append(torch.linalg.vector_norm(gs, p))
        if record:                              # the ranks' parts combined: one scalar
            C.record_collective("all_reduce", self.mesh, None, 4, "clip_grad norm over " +
                                " x ".join(self.mesh.dim_names), groups=[self.mesh.ranks])
        return torch.linalg.vector_norm(torch.stack(norms), p) if norms else \
            torch.tensor(0.0)

    @torch.no_grad()
    def reduce_grads_(self) -> dict:
        """The gradients reduce-scattered now (what :meth:`step` would do first) into
        each rank's shard, kept for ``step``: ``{parameter index: its gradient shard}``.
        Each shard is its optimizer shard's ``.grad`` too, which ``torch.amp.GradScaler.
        unscale_(opt)`` unscales; reading a shard's ``.grad`` calls this first
        (:class:`ShardParameter`), so ZeRO-1 needs no call before ``unscale_``."""
        live = self.live()
        for i, gs in zip(live, self._reduce_grads(live)):
            self._keep_shard(i, gs)             # step() takes them from here
            self.params[i]._local.grad = None
        return {i: self._gshard[i] for i in live}

    def _keep_shard(self, i, gs) -> None:
        """Parameter ``i``'s reduced gradient shard, kept for ``step`` and held as its
        shard's ``.grad`` (the same tensor): ``torch.amp.GradScaler.unscale_(opt)`` unscales
        and inf-checks the gradients of ``opt.param_groups`` (the shards), so ZeRO-2's
        (reduced in backward) and ZeRO-1's (reduced when ``unscale_`` reads them:
        :class:`ShardParameter`) are unscaled in place before ``clip_grad_norm_`` and
        ``step`` read them.  Before (habits18) no shard held one: ``unscale_`` unscaled
        nothing, ``opt.clip_grad_norm_`` returned the scaled norm (1024x at scale 2**10) and
        ``scaler.step`` raised torch's "No inf checks were recorded for this optimizer"."""
        gs = _fit(gs, self.shards[i]).contiguous()
        self._gshard[i] = gs
        if gs.dtype == self.shards[i].dtype:   # (else step() raises naming the conversion)
            self.shards[i].grad = gs

    @torch.no_grad()
    def scale_grads_(self, coef) -> None:
        """Every reduced gradient shard (:meth:`grad_norm` made them) times ``coef``."""
        for gs in self._gshard.values():
            gs.mul_(coef)

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce-scatter the gradients (ZeRO-2: wait for those launched in backward),
        step the shards with ``optimizer``, all-gather them back into every replica; the
        replicas' gradients are then cleared.  ``closure`` runs first, once, with grad
        enabled, and its loss is returned (as torch's ``step(closure)``).

        Unlike torch's ``ZeroRedundancyOptimizer``, which keeps ``p.grad`` until
        ``zero_grad`` (there DDP all-reduced it in backward: every rank holds the averaged
        gradient), this one clears it: each replica's ``p.grad`` is its own rank's
        un-reduced gradient (only the reduce-scattered shard is averaged; ZeRO-2 frees the
        replica's in backward), so keeping it would hand a user's gradient-norm log one
        rank's gradient, not one device's, and making it one device's would cost an
        all-gather of the gradients that torch's ZeRO does not run (habits16).  Read the
        norm with :meth:`clip_grad_norm_` before ``step()``."""
        loss = run_closure(self.optimizer_class, closure)   # once, grad enabled: torch's
        nd = self.mesh.ndim
        live = self.live()
        if not live and self._zeroed:
            # zero_grad() since the last step, no backward after it: every gradient is
            # None, and torch.optim's step skips each such parameter, a no-op (it raised
            # "call loss.backward() first" after backward; zero_grad(); step(): habits13b)
            return loss
        if not live:        # (it failed inside torch.cat, saying nothing of why)
            raise RuntimeError(
                "ZeroRedundancyOptimizer(partition='chunks').step(): no parameter has a "
                "gradient; call loss.backward() first (the optimizer gives each parameter "
                "data-parallel replicas when it is built: gradients of a backward run "
                "before that are not on them, so build it before the first backward)")
        params = [self.params[i] for i in live]
        shards = self._reduce_grads(live)
        # my shard of the parameters, from the replica (the replicas are the truth: an
        # in-place change to them between steps is what the shards step from)
        for j, i in enumerate(live):
            s = self.shards[i]
            s.copy_(self._my_chunk(self.params[i]._local.detach()))
            s.grad = shards[j].contiguous()
        _copy_hyper(self.param_groups, self.optimizer.param_groups)      # lr schedules
        self._busy += 1                 # the inner step reads the shards' .grad set above
        try:
            self.optimizer.step()
        finally:
            self._busy -= 1
        # the updated shards, gathered back in one buffer
        ps = [self.shards[i] for i in live]
        full = self._all_gather(torch.cat([self.replicas.lead(s) for s in ps], dim=-1),
                                f"zero-{self.stage} params")
        full = full.unflatten(-1, (self.n, -1))
        off = 0
        for p, s in zip(params, ps):        # rank-major: chunk k of each, back whole
            loc, c = p._local, s.shape[-1]
            piece = unflat(full[..., off:off + c].flatten(-2), loc.shape[nd:], nd)
            off += c
            for a in range(nd):
                if loc.shape[a] == 1 and piece.shape[a] != 1:
                    piece = piece.narrow(a, 0, 1)
            loc.copy_(piece)
        for p, s in zip(params, ps):
            p._local.grad = None
            s.grad = None
        self._stepped, self._zeroed = set(live), False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``: gradients to None, or (``set_to_none=
        False``) existing gradients zeroed in place (detached first when they carry a
        history, as torch does); the reduced shards accumulated so far are dropped either
        way, so the next backward starts from zero."""
        self._busy += 1                 # (reading a shard's .grad here reduces nothing)
        try:
            for t in [p._local for p in self.params] + list(self.shards):
                clear_grad(t, set_to_none)
            if not set_to_none:
                # step() freed the gradients it stepped, where torch's optimizers keep
                # theirs: those torch would zero read zeros here too (they read None,
                # habits13b), each replica's a zero gradient the next backward adds to
                for i in self._stepped:
                    loc = self.params[i]._local
                    if loc.grad is None and loc.requires_grad:
                        loc.grad = torch.zeros_like(loc)
        finally:
            self._busy -= 1
        self._gshard.clear()
        self._zeroed = True
