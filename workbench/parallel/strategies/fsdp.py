"""``FullyShardedDataParallel``: every parameter sharded over the data-parallel ranks.

    fsdp = wb.FullyShardedDataParallel(model, mesh, compute_dtype=torch.bfloat16,
                                       units={Block}, prefetch=True)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)   # steps the fp32 shards
    loss = F.cross_entropy(fsdp(x), y); loss.backward(); opt.step()

ZeRO stage 3 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", P_os+g+p) in the form of PyTorch FSDP (Zhao et al. 2023,
"PyTorch FSDP", VLDB; ``torch.distributed.fsdp``):

* each parameter is flattened, padded to a multiple of N and split in N chunks;
  rank k keeps chunk k, and that chunk *is* the ``nn.Parameter`` the optimizer
  steps (its gradient and optimizer states are sharded with it);
* ``units`` (module classes or submodules, FSDP's ``ModuleWrapPolicy`` / FSDP2's
  ``fully_shard`` per block; :mod:`.fsdp_units`): a unit all-gathers its parameters
  just before its own forward and frees them right after; a saved-tensor hook keeps
  only their geometry for backward and all-gathers them again when backward first
  needs them; when the unit's backward ends its gradients are reduce-scattered (the
  average over ranks) onto the shards and the re-gathered weights freed.  The
  parameters of no unit form the root unit: gathered at the start of forward and, as
  in torch, kept gathered until its gradients are reduce-scattered at the end of
  backward, so its backward re-gathers nothing (FSDP2 does not reshard the root after
  forward unless ``reshard_after_forward`` is given, torch 2.13
  ``_fully_shard/_fsdp_state.py:203-207``; FSDP1's ``FULL_SHARD`` does not free the
  root's flat parameter after forward, ``_runtime_utils.py:493-500``).  Gathered
  weights alive at once: the root's plus one unit's (``prefetch=True``: plus the next
  unit's, gathered one unit early in forward and in backward); :attr:`gathered` counts
  them.  Without ``units`` the whole module is the root: one all-gather per step;
* ``compute_dtype`` (e.g. ``torch.bfloat16``): the shards are cast before the
  all-gather, so forward, backward and both collectives run in it, while the
  shards (master weights), their gradients and the optimizer states stay fp32
  (FSDP's ``MixedPrecisionPolicy(param_dtype=reduce_dtype=compute_dtype)``);
  floating-point inputs are cast to it too (``cast_forward_inputs``).
* ``reduce_dtype`` (e.g. ``torch.float32``; None: ``compute_dtype``): the gradients are
  cast to it before the reduce-scatter, which runs (bytes, clock, the division by the
  world size) in it, and the reduced shard is cast to the shard's dtype (torchtitan's
  default ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; FSDP2's
  ``foreach_reduce``, torch 2.13 ``_fsdp_collectives.py``).

Per step and unit but the root: all-gather forward + all-gather backward + reduce-scatter,
1.5x the all-reduce volume of DDP (the root: all-gather + reduce-scatter, 1x); one
collective per unit and phase, labelled ``fsdp params|re-gather|grad <unit>`` (``root``
for the root unit, which has no re-gather): the unit's shards are copied into one buffer,
all-gathered and copied out per parameter (FSDP2's ``foreach_all_gather`` /
``foreach_all_gather_copy_out``; its gradients likewise, laid out rank-major for the
reduce-scatter, ``foreach_reduce``: torch 2.13,
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``); the re-gather holds only
the parameters autograd saved (FSDP2 re-gathers the whole unit: a bias that no backward
formula reads is sent again there, not here).  The module may use its weights any way it
likes (``weight[ids]``, ``x @ w.T``...): it runs its own forward on the gathered
tensors.  On simulated ranks the module runs once per rank, each rank on its own
gathered copy.

A module whose parameters are DistTensors (``wb.parallelize``, e.g. tensor parallel on
another mesh dim: FSDP2's 2-D layout) gets the DistTensor mode (:mod:`.fsdp_dist`, which
``Zero3`` and the hybrid recipe run on): one forward over the DistTensors, each module
holding parameters its own unit, gathers prefetched on the modeled clock.

The habits of one device hold: ``state_dict()`` gives FSDP2's ``Shard(0)`` DistTensors and
``load_state_dict`` takes them or full tensors (:mod:`.fsdp_state`);
``torch.nn.utils.clip_grad_norm_(fsdp.parameters(), ...)`` gives the total norm (on
simulated ranks the rows hold every shard; on torch.distributed each shard's gradient is
a :class:`~.rank_grads.ShardGrad`, whose norms torch reduces over the ranks, as FSDP2's
DTensor norms); ``.double()`` / ``.to(dtype)`` convert the shards in place.
``fsdp.module.state_dict()`` and an optimizer's ``state_dict()`` over the shards give full
tensors of the module's shapes, and ``fsdp.module.load_state_dict`` / ``p.copy_(t)`` /
``optimizer.load_state_dict`` take them (:mod:`.laid_out`; on torch.distributed the
chunks all-gathered, so every process calls them, as FSDP's own ``state_dict()``); buffers a
forward writes change once a step (rank 0's), a BatchNorm on batch statistics raises
(:func:`.ranks.check_batch_stats`).

A user's hooks on the module or its submodules fire once per simulated rank with that
rank's tensors (each torchrun process's once with its own; ``wb.simulated_rank()`` names
the rank), in the DistTensor mode once with the global tensors: :mod:`.rank_hooks`.

``no_sync()`` is FSDP1's (:mod:`.fsdp_no_sync`): unsharded gradients held, their sum
reduce-scattered by the first backward after it.  So are the static context managers
``FullyShardedDataParallel.summon_full_params(module, writeback=True, ...)`` and
``state_dict_type(module, StateDictType.FULL_STATE_DICT)`` (:mod:`.fsdp_summon`).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from ...ops.moe import loss_share, one_batch
from .. import step_clock
from ..load_back import flush
from ..versions import plain_forward
from .flat_shards import flat_padded, unflat
from .laid_out import Chunks, ProcessChunks, laid_out, module_shaped_state_dict
from .fsdp_units import (GatheredBytes, GatherUnit, Kept, Regather, Saved, UnitCall, all_gather,
                         check_version, plan_units, reduce_scatter, tree_cast)
from .fsdp_kept import kept_changes, note_kept, regather_sources, source_alias
from .fsdp_no_sync import NoSync
from .fsdp_state import FSDPStateDict
from .fsdp_summon import SummonFullParams
from .rank_grads import as_chunk_rows, as_shard_grad
from .laid_out_whole import storage_numel
from .rank_hooks import as_rank
from .rank_recompute import refuse_checkpoint, refuse_outer_reentrant, seq_mark
from .laid_out_hooks import check_hooks
from .replaced_params import check_places, check_read_through
from .ranks import (ModuleWrapper, RankGroup, buffer_snapshot, check_batch_stats, check_module,
                    check_not_meta,
                    rank_buffers)

__all__ = ["FullyShardedDataParallel"]


class FullyShardedDataParallel(SummonFullParams, FSDPStateDict, NoSync, ModuleWrapper):
    """Fully sharded data parallel training of ``module`` along ``dim`` of ``mesh``
    (``mesh=None``: the default torch.distributed process group).

    ``fsdp.parameters()`` are the module's own parameters under their own names,
    each now its flat shard: shape ``(chunk,)`` on torch.distributed, ``(N, chunk)``
    (one row per rank) on a simulated mesh.  :meth:`full_state_dict` gathers them.
    ``units``: None (one unit), module classes or submodules (one unit each);
    ``prefetch``: gather the next unit one unit early.  ``fsdp.units`` lists them and
    ``fsdp.gathered`` (``.alive()``, ``.peak``, ``.reset_peak()``) counts the bytes of
    gathered weights alive (summed over simulated ranks).
    """

    def __new__(cls, module=None, *args, **kwargs):
        # a module with DistTensor parameters (wb.parallelize: FSDP over dp beside tensor
        # parallelism) gets the DistTensor mode, :class:`.fsdp_dist.DistTensorFSDP` (ZeRO-3)
        if cls is FullyShardedDataParallel:
            from .ddp_dist import has_dist_parameters
            if has_dist_parameters(module):
                from .fsdp_dist import DistTensorFSDP
                cls = DistTensorFSDP
        return super().__new__(cls)

    def __init__(self, module: nn.Module, mesh=None, dim="dp", compute_dtype=None,
                 units=None, prefetch: bool = False, reduce_dtype=None):
        super().__init__()
        check_module(module, "FullyShardedDataParallel")
        check_not_meta(module, self._who)     # fully_shard names itself
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and
                                              compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype={compute_dtype!r}: give a floating-point torch "
                             "dtype (torch.bfloat16, torch.float16) or None (the parameters' "
                             "own dtype)")
        if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and
                                             reduce_dtype.is_floating_point):
            raise ValueError(f"FullyShardedDataParallel(reduce_dtype={reduce_dtype!r}): give a "
                             "floating-point torch dtype (torch.float32) or None (compute_dtype)")
        if not isinstance(prefetch, bool):
            raise TypeError(f"FullyShardedDataParallel(prefetch={prefetch!r}): give True or False")
        g = RankGroup(mesh, dim, "FullyShardedDataParallel")
        check_hooks(module, self._who, g.distributed)  # a user's gradient hooks (.laid_out_hooks)
        object.__setattr__(self, "module", module)
        self.group, self.compute_dtype, self.prefetch = g, compute_dtype, prefetch
        self.reduce_dtype = reduce_dtype     # None: the gradients' own (compute) dtype
        self._meta = {}                  # id(shard) -> (shape, numel)
        self._hooked = set()             # ids of shards whose gradients become Shard/ChunkRows
        with torch.no_grad():
            self.units = plan_units(module, units, self._shard)
        module_shaped_state_dict(module)    # module.state_dict(): full tensors (simulated)
        for u in self.units[1:]:
            u.module.register_forward_pre_hook(lambda m, a, u=u: self._enter(u))
            u.module.register_forward_hook(lambda m, a, o, u=u: self._exit(u))
        object.__setattr__(self, "gathered", GatheredBytes())
        self._k, self._order, self._prefetched, self._owners = None, [], {}, {}
        self._sync_enabled = True        # False inside no_sync()
        object.__setattr__(self, "_unsynced", {})      # (unit index, rank) -> [grad]
        module._wb_wrapped = "FullyShardedDataParallel"

    _casts_inputs = True     # fully_shard's root: its policy's cast_forward_inputs

    def _shard(self, name, p):
        g = self.group
        if g.distributed:                # every rank starts from rank 0's values
            dist.broadcast(p.data, src=g.global_rank(0), group=g.pg)
        rows = flat_padded(p.detach(), g.n).view(g.n, -1)
        shard = rows[g.k] if g.distributed else rows
        # simulated: every chunk here; torch.distributed: the chunks all-gathered
        how = ProcessChunks(g, p.shape) if g.distributed else Chunks(g.n, p.shape)
        shard = laid_out(shard.clone(), p.requires_grad,
                         f"it holds each rank's flat chunk of the {tuple(p.shape)} parameter "
                         f"(shape {tuple(shard.shape)})", p.shape, how)
        self._meta[id(shard)] = (tuple(p.shape), p.numel())
        shard._wb_swaps_data = True     # p.data = t: a storage of its own (.laid_out_draws)
        if not g.distributed:           # a row per rank: an optimizer's step on their clock
            step_clock.hold([shard], g.ranks, 1)
        return shard

    def _hook_shards(self):
        """Each trainable shard's gradient, once accumulated, becomes what torch's
        clip_grad_norm_ reads as one device: on torch.distributed a ShardGrad (the norm
        over every rank's shard), on simulated ranks a ChunkRows (the rows without their
        padding zeros, which a norm of order -inf would read as the smallest |g|).  Hooked
        at each forward: a shard unfrozen after construction too."""
        pg, dist_ = self.group.pg, self.group.distributed
        for u in self.units:
            for _, s, _ in u.params:
                if s.requires_grad and id(s) not in self._hooked:
                    self._hooked.add(id(s))
                    shape, numel = self._meta[id(s)]
                    s.register_post_accumulate_grad_hook(
                        lambda s, numel=numel, shape=shape: setattr(
                            s, "grad", as_shard_grad(s.grad, pg, param=s) if dist_ else
                            as_chunk_rows(s.grad, numel, shape)))

    def _cast(self, shard):
        cd = self.compute_dtype
        return shard.to(cd) if cd is not None and shard.dtype != cd else shard

    # ---- forward: a unit gathers on entry, frees on exit ------------------------------------
    _who = "FullyShardedDataParallel"     # the name errors give (fully_shard's own)

    def forward(self, *args, **kwargs):
        if getattr(self, "_wb_summoned", False):    # torch refuses it too
            raise RuntimeError(f"{self._who}: forward inside summon_full_params(); run it "
                               "after the context exits")
        check_places(self.units, self._who)     # a tie after wrapping: raise (.replaced_params)
        check_read_through(self, self._who)     # torch.func.functional_call on the wrapper
        flush()                     # a write into a state_dict() copy: into the shards
        g, cd = self.group, self.compute_dtype
        if cd is not None and self._casts_inputs:
            args, kwargs = tree_cast(args, cd), tree_cast(kwargs, cd)
        if not g.distributed:       # checkpoint(fsdp, x, use_reentrant=True): untracked
            refuse_outer_reentrant(self._who, args, kwargs)
            plain_forward()         # its version errors' hint (versions.explained)
        per, dim = ([(args, kwargs)], None) if g.distributed else g.split(args, kwargs)
        ks = [g.k] if g.distributed else range(g.n)
        self._hook_shards()
        self._drop_cleared()        # held no_sync gradients a zero_grad cleared: dropped
        check_batch_stats(g, self.module, "FullyShardedDataParallel")
        for call in getattr(self, "_calls", {}).values():
            # a kept root from a forward whose backward never ended (it raised, or was never
            # run): its copy would stay counted alive (``gathered``) for good; what a pending
            # backward still needs autograd saved itself
            call.cache.clear()
        self._calls, self._counts, self._by_rank, self._active, self._next = {}, {}, {}, {}, {}
        order, outs = [], []
        snap = None if g.distributed else buffer_snapshot(self.module)   # rank 0's writes kept
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), \
                    one_batch():        # a MoE's last_stats: every rank's part (ops/moe.py)
                for k, (a, kw) in zip(ks, per):
                    self._k, self._seen = k, order if k == ks[0] else []
                    self._enter(self.units[0])
                    # the join averages the ranks' losses: a loss term attached by
                    # gradient takes each rank's share too (ops/moe.py: loss_share)
                    since = seq_mark() + 1
                    with rank_buffers(self.module, snap if k != ks[0] else None), \
                            loss_share(1.0 if g.distributed else 1 / g.n), \
                            as_rank(self.module, k) if not g.distributed else nullcontext():
                        outs.append(self.module(*a, **kw))
                    self._exit(self.units[0])
                    if not g.distributed:
                        refuse_checkpoint(outs[-1], since, self._who, g.n)
        except BaseException:            # no backward will come: the kept weights freed
            for call in self._calls.values():
                call.cache.clear()
            raise
        finally:
            self._k = None
            for u in self.units:         # on error too: the shards are the parameters again
                for _, shard, places in u.params:
                    for m, attr in places:
                        m._parameters[attr] = shard
            self._owners.clear()
            self._prefetched.clear()
        self._order = order
        self._release_at_backward_end(outs)
        return outs[0] if g.distributed else g.join(outs, dim)

    def _release_at_backward_end(self, outs):
        """The weights a kept unit holds (the root's, ``call.cache``) freed when the
        backward through ``outs`` ends, even where its reduce-scatter never comes (no
        trainable parameter of it reached the loss): FSDP2 reshards in the root's final
        callback (``_root_post_backward_final_callback``, queued by its pre-backward hook
        on the outputs), here queued by a hook on each output likewise."""
        calls = [c for c in self._calls.values() if c.cache or c.kept]
        if not calls:
            return
        from torch.autograd import Variable
        from torch.utils import _pytree as pytree
        queued = []

        def free():
            queued.clear()
            for c in calls:
                c.cache.clear()
                c.checked.clear()       # the next backward checks the kept copies again

        def hook(grad):
            if not queued:
                queued.append(True)
                Variable._execution_engine.queue_callback(free)
        for t in pytree.tree_leaves(outs):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)

    def _enter(self, unit):
        k = self._k
        if k is None:
            raise RuntimeError(f"unit {unit.name!r} of a FullyShardedDataParallel ran on its "
                               "own: call the wrapper (fsdp(x)), which gathers its weights")
        call, views = self._gather(unit, k, self._prefetched.pop((unit.index, k), None))
        self._active.setdefault((unit.index, k), []).append(call)
        for (_, _, places), v in zip(unit.params, views):
            for m, attr in places:
                m._parameters[attr] = v
        if unit.index not in self._seen:
            self._seen.append(unit.index)
        if self.prefetch and unit.index in self._order:
            at = self._order.index(unit.index) + 1
            if at < len(self._order) and (self._order[at], k) not in self._prefetched:
                nxt = self.units[self._order[at]]     # gathered now, its node made on entry
                with torch.no_grad():
                    self._prefetched[(nxt.index, k)] = self._all_gather(
                        self._call(nxt, k), k, [self._cast(s) for _, s, _ in nxt.params])

    def _exit(self, unit):
        k = self._k
        call = self._active[(unit.index, k)].pop()
        for _, shard, places in unit.params:
            for m, attr in places:
                m._parameters[attr] = shard
        for ptr in call.ptrs.get(k, ()):
            self._owners.pop(ptr, None)

    def _call(self, unit, k):
        """The next entry of ``unit`` on rank k (made once; a prefetch makes it early)."""
        if (unit.index, k) not in self._next:
            j = self._counts.get((unit.index, k), 0)
            self._counts[(unit.index, k)] = j + 1
            call = self._calls.setdefault((unit.index, j), UnitCall(unit))
            call.entered += 1
            self._by_rank.setdefault(k, []).append(call)
            call.by_rank[k] = self._by_rank[k]
            self._next[(unit.index, k)] = call
        return self._next[(unit.index, k)]

    def _gather(self, unit, k, pre=None):
        call = self._call(unit, k)
        del self._next[(unit.index, k)]
        if not unit.params:
            return call, []
        cast = (lambda s: s) if self.reduce_dtype is not None else self._cast
        call.versions[k] = [s._version for _, s, _ in unit.params]    # check_version
        call.src[k] = [source_alias(s) for _, s, _ in unit.params]     # .fsdp_kept
        flats = GatherUnit.apply(self, call, k, pre, *[cast(s) for _, s, _ in unit.params])
        if not self._reshards(unit) and torch.is_grad_enabled() and \
                any(s.requires_grad for _, s, _ in unit.params):
            # kept gathered (the root): alive until its reduce-scatter frees call.cache
            call.cache.setdefault(k, {}).update((i, f.detach()) for i, f in enumerate(flats))
        views, ptrs = [], []
        for i, ((_, s, _), f) in enumerate(zip(unit.params, flats)):
            shape, _ = self._meta[id(s)]
            views.append(unflat(f, shape))
            if f.numel():
                ptrs.append(f.untyped_storage().data_ptr())
                self._owners[ptrs[-1]] = (call, k, i, id(views[-1]))
        call.ptrs[k] = ptrs
        return call, views

    def _all_gather(self, call, k, shards, what="params"):
        """Rank k's gathered flat copies of ``shards`` (parameters of ``call``'s unit), in
        one collective for the unit (FSDP2's copy-in / all-gather / copy-out), counted."""
        if not shards:
            return ()
        g = self.group
        # the storage's elements (padding too), not the module's (p.numel(): laid_out_whole)
        nb = sum(storage_numel(s) * s.element_size() for s in shards) * \
            (g.n if g.distributed else 1)
        if g.distributed or what not in call.recorded:
            call.recorded.add(what)
            g.record("all_gather", nb, f"fsdp {what} {call.unit.name or 'root'}")
        flats = all_gather(shards, g) if g.distributed else \
            tuple(s.reshape(-1).clone() for s in shards)
        for f in flats:
            self.gathered.add(f)
        return flats

    # ---- backward: re-gather on first use, reduce-scatter when the unit is done -----------
    def _reshards(self, unit) -> bool:
        """Whether ``unit``'s gathered weights are freed after its forward (and gathered
        again in backward): every unit but the root.  Torch keeps the root gathered: FSDP2
        sets the root's ``post_forward_mesh_info = None`` when ``reshard_after_forward`` was
        not given (torch 2.13 ``_fully_shard/_fsdp_state.py:203-207``), FSDP1 does not free
        the root's flat parameter after forward (``_runtime_utils.py:493-500``)."""
        return unit.index != 0

    def _pack(self, t):
        if t.layout != torch.strided:
            return t
        hit = self._owners.get(t.untyped_storage().data_ptr()) if self._owners else None
        if hit is None:
            return Saved(t)     # its version checked at unpack, as torch's (fsdp_units.Saved)
        call, k, i, view = hit
        own = id(t) == view     # autograd saved the parameter itself, not a view (.fsdp_kept)
        if not self._reshards(call.unit):
            note_kept(call, k, (i, own), t)
            return Kept(call, k, i, t, own)   # kept gathered: saved as is, no re-gather
        call.packed.setdefault(k, set()).add((i, own))
        return Regather(call, k, i, t, own)

    def _unpack(self, s):
        if isinstance(s, Saved):
            return s.check()
        if isinstance(s, Kept):
            check_version(s.call, s.k, s.i, self._who)     # a write into its shard since: raise
            return self._kept(s)
        if not isinstance(s, Regather):
            return s
        check_version(s.call, s.k, s.i, self._who)
        flats = self._regather(s.call, s.k)
        if self.prefetch:                # the unit before it in forward, if not done yet
            calls = s.call.by_rank[s.k]
            at = next((x for x, c in enumerate(calls) if c is s.call), 0)
            if at > 0 and s.k not in calls[at - 1].done:
                self._regather(calls[at - 1], s.k)
        return flats[(s.i, s.own)].as_strided(s.shape, s.stride, s.offset)

    def _kept(self, s):
        """The kept (root's) gathered weight ``s`` saved, as one device's backward reads it
        after a ``p.data`` write or assignment since forward: the copy itself, or the
        parameter gathered again where they differ (:mod:`.fsdp_kept`: one check per
        backward for every kept weight; on torch.distributed one recorded all-reduce of
        their flags)."""
        flat = kept_changes(self, s.call, s.k).get((s.i, s.own))
        t = s.t
        if flat is None:
            return t
        return flat.as_strided(t.shape, t.stride(), t.storage_offset())

    def _regather(self, call, k):
        flats = call.cache.setdefault(k, {})
        todo = [key for key in sorted(call.packed.get(k, ())) if key not in flats]
        shards = regather_sources(self, call, k, todo)     # (.fsdp_kept: p.data = t since)
        flats.update(zip(todo, self._all_gather(call, k, shards, "re-gather")))
        return flats

    def _reduce_scatter_now(self, call, k, grads, needs):
        """Rank k's part of the unit's gradient reduction; the re-gathered weights freed."""
        g = self.group
        call.cache.pop(k, None)
        call.checked.pop(k, None)
        call.done.add(k)
        todo = [i for i, (gr, need) in enumerate(zip(grads, needs)) if need and gr is not None]
        grads = self._to_reduce_dtype(grads)
        nb = sum(grads[i].numel() * grads[i].element_size() for i in todo)
        label = f"fsdp grad {call.unit.name or 'root'}"
        if g.distributed:                # one reduce-scatter for the unit's gradients
            out = [None] * len(grads)
            if todo:
                g.record("reduce_scatter", nb, label)
                for i, r in zip(todo, reduce_scatter([grads[i] for i in todo], g)):
                    out[i] = r.div(g.n)     # its own tensor, as each gradient was
            return tuple(out)
        if todo and "grad" not in call.recorded:    # recorded at the first rank's arrival
            call.recorded.add("grad")
            g.record("reduce_scatter", nb, label)
        call.grads[k] = grads
        # the last rank's backward brings the sum; counted, not used up, so that a second
        # backward through the same graph (``retain_graph=True``) reduces again (a
        # countdown left every later one with no gradient, silently)
        if len(call.grads) < call.entered:
            return (None,) * len(grads)
        out = []
        for i, need in enumerate(needs):
            rows = [call.grads[r][i] for r in sorted(call.grads)]
            if not need or all(r is None for r in rows):
                out.append(None)
                continue
            like = next(r for r in rows if r is not None)
            rows = [torch.zeros_like(like) if r is None else r for r in rows]
            out.append(torch.stack(rows).sum(0).view(g.n, -1))
        call.grads.clear()
        return tuple(out)

    def _to_reduce_dtype(self, grads):
        """The unsharded gradients cast to ``reduce_dtype`` before the reduce-scatter, which
        then runs (and divides by the world size) in it (FSDP2's ``foreach_reduce``,
        torch 2.13 ``_fsdp_collectives.py``); autograd casts the reduced shard to the
        shard's own dtype (the fp32 master), as FSDP2 does after the reduce-scatter."""
        rd = self.reduce_dtype
        return tuple(g if g is None or rd is None or g.dtype == rd else g.to(rd) for g in grads)

    def finish_gradient_synchronization(self) -> None:
        """The reduce-scatters run inside backward (synchronously), so the shards hold
        their averaged gradients once ``backward()`` returns; kept for DDP's API."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch FSDP1's ``model.clip_grad_norm_(max_norm, norm_type)`` (torch 2.13
        ``torch/distributed/fsdp/fully_sharded_data_parallel.py`` ``clip_grad_norm_``: the
        total norm of the full gradients, every gradient scaled by ``max_norm / (total +
        1e-6)`` where that is below 1, the total returned).  The shards' gradients already
        give one device's norm to ``torch.nn.utils.clip_grad_norm_`` (``_hook_shards``), so
        it is that call over the wrapper's parameters; FSDP1 loops call the method (it
        raised AttributeError)."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    def extra_repr(self) -> str:
        g = self.group
        where = "torch.distributed" if g.distributed else f"{g.n} simulated ranks"
        return (f"{type(self.module).__name__}, {where}, compute_dtype={self.compute_dtype}, "
                f"{len(self.units)} units, prefetch={self.prefetch}"
                + (f", reduce_dtype={self.reduce_dtype}" if self.reduce_dtype else ""))
