"""``FullyShardedDataParallel`` over DistTensor parameters: ZeRO-3 beside tensor parallelism.

    wb.parallelize(model, mesh, tp_plan, mesh_dim="tp")      # mesh dims ("dp", "tp")
    fsdp = wb.FullyShardedDataParallel(model, mesh, "dp", prefetch=True)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)      # the dp shards
    loss = fsdp(x).mean(); loss.backward()
    fsdp.finish_gradient_synchronization(); opt.step()

A module whose parameters are DistTensors (``wb.parallelize``; FSDP2's 2-D layout: the
parameters sharded over the dp dim of a mesh whose other dims hold tensor parallelism)
runs its own forward once on the DistTensors.  ``wb.FullyShardedDataParallel(module,
...)`` builds this class for such a module.  ``Zero3`` (:mod:`.zero3`, the course's name
and the hybrid recipe's) is this wrapper with its own AdamW.

ZeRO stage 3 (Rajbhandari et al. 2020, P_os+g+p): each data-parallel rank keeps only 1/N_d of every (flattened, padded) parameter,
with its gradient shard and Adam states.  Right before a module runs forward, a
pre-hook all-gathers that module's parameters (one copy per rank, as the layer
needs them); in backward the parameters are gathered again (ZeRO frees them after
forward; here the gathered copy autograd saved stands in for it, and the re-gather
is recorded in the trace) and the gradients are reduce-scattered back to the
shards.  Per step: all-gather forward + all-gather backward + reduce-scatter =
1.5x the all-reduce of plain data parallelism.

Overlap on the simulated clock (DeepSpeed's ZeRO-3: parameters prefetched ahead of
use up to ``stage3_prefetch_bucket_size`` elements, default 5e7, and gradients
reduce-scattered as they are produced, ``overlap_comm``): the gathers are async
collectives on the comm stream issued ahead in execution order, and a module's compute
waits for its own gather.  Forward: the modules after the one starting, in the order the
last forward ran them (registration order before the first).  Backward: the forward's
order reversed (DeepSpeed's coordinator records the order modules are fetched over a
forward and backward, ``partitioned_param_coordinator.ZeRoTraceMode``, and prefetches
along it).  The backward's first gathers are issued when the forward's last module
ends, the module that ran last first, up to the prefetch budget, so they run beside the
loss and the tied head's backward instead of after them (DeepSpeed starts them at the
root module's pre-backward hook, ``plan.zero_cost``); each module starting its backward
then gathers ahead of itself.  Each shard's reduce-scatter is launched when backward
accumulates its gradient and ``step`` waits for them (a recompute in backward gathers
each module as it reruns, without prefetch, and its backward reuses that copy).  The
gathered copies one rank holds, prefetched ones included, are counted over the clock in
``live`` (:mod:`.zero3_clock`).  On torch.distributed the collectives are blocking calls
(each gather at its module, each reduce-scatter in backward); they run unrecorded there,
and the clock records the program's, from the same hooks (task tdclock2).

The shards are ``nn.Parameter``s under the module's own qualified names
(:meth:`DistTensorFSDP.named_parameters`, a tied weight one shard), laid out as the
plain-module FSDP's (:mod:`.flat_shards`), so any ``torch.optim`` optimizer steps them
(elementwise ones exactly as on one device); call :meth:`finish_gradient_synchronization`
before its ``step()`` so the clock counts the reduce-scatters as waited for.  On simulated
ranks each shard is stored with the dp chunks of every tensor-parallel coordinate side by
side, and the module's own DistTensor parameters are views of it
(:mod:`.fsdp_dist_views`): ``model.named_parameters()`` reads the values stepped last.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from ...sim_mesh import backends as _B
from ...sim_mesh import collectives as C
from .. import step_clock, storage
from ..dist_tensor import DistTensor
from ..module import dist_parameters
from ..module_state import BackwardHookRefusal
from .flat_dims import flatten_dims
from .flat_shards import flat_padded, tensor_places, unflat
from .replaced_params import check_dist_places
from .fsdp_dist_views import dp_minor, view_template, wrapper_names
from .fsdp_dist_habits import install_habits, users_read_the_module
from .laid_out import laid_out
from .fsdp import FullyShardedDataParallel
from .ranks import RankGroup, check_module
from .zero3_clock import Zero3Clock

__all__ = ["DistTensorFSDP", "PREFETCH_NUMEL"]

# DeepSpeed's stage3_prefetch_bucket_size default (deepspeed/runtime/zero/config.py:
# 5e7 elements): how far ahead parameters are gathered
PREFETCH_NUMEL = 50_000_000


class DistTensorFSDP(BackwardHookRefusal, Zero3Clock, FullyShardedDataParallel):
    """ZeRO-3 over the ``dim`` dim of ``mesh`` for a module parallelized with
    :func:`workbench.parallelize` (its DistTensor parameters replicated on that dim);
    ``prefetch``: True (DeepSpeed's default budget), False, or elements to gather ahead.
    Mixed precision (``compute_dtype``), ``units`` and ``reshard_after_forward=False``
    are built for plain modules only (:mod:`.fsdp`): here they raise."""

    def __init__(self, module: nn.Module, mesh=None, dim="dp", compute_dtype=None,
                 units=None, prefetch: bool | int = False, reshard_after_forward: bool = True,
                 reduce_dtype=None):
        nn.Module.__init__(self)
        check_module(module, "FullyShardedDataParallel")
        if reduce_dtype is not None:
            raise NotImplementedError(
                f"FullyShardedDataParallel(reduce_dtype={reduce_dtype!r}) over DistTensor "
                "parameters: mixed precision is built for plain modules only; leave it None")
        if compute_dtype is not None:
            raise NotImplementedError(
                f"FullyShardedDataParallel(compute_dtype={compute_dtype!r}) over DistTensor "
                "parameters: mixed precision is built for plain modules only; leave it None")
        if units is not None:
            raise NotImplementedError(
                "FullyShardedDataParallel(units=...) over DistTensor parameters: every module "
                "holding parameters is its own unit here; leave units=None")
        if reshard_after_forward is not True:
            raise NotImplementedError(
                f"reshard_after_forward={reshard_after_forward!r} (ZeRO-2 as FSDP's "
                "SHARD_GRAD_OP) over DistTensor parameters is not built: leave it True, or use "
                "DataParallel(zero=2), DeepSpeed's ZeRO-2")
        if prefetch is True:
            prefetch = PREFETCH_NUMEL
        elif prefetch is False:
            prefetch = 0
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch={prefetch!r}: True (DeepSpeed's {PREFETCH_NUMEL:.0e} "
                             "elements ahead), False (none), or the elements to gather ahead, "
                             "an int >= 0")
        check_dist_places(module, "FullyShardedDataParallel")   # (.replaced_params)
        params = list(dist_parameters(module))
        if not params:
            raise ValueError("FullyShardedDataParallel over DistTensor parameters: the module "
                             "has none; wb.parallelize it first (or pass a plain module)")
        if mesh is None or mesh != params[0][1].mesh:
            from .mesh_advice import world_slice_advice
            advice = world_slice_advice(params[0][1].mesh, mesh, dim,
                                        f"FullyShardedDataParallel(mesh={mesh!r})",
                                        f"FullyShardedDataParallel(model, world_mesh, dim={dim!r})")
            if advice:
                raise ValueError(advice)
            raise ValueError(f"FullyShardedDataParallel(mesh={mesh!r}): the module's DistTensor "
                             f"parameters live on {params[0][1].mesh}; pass that mesh")
        graded = [n for n, p in params if p.grad is not None]
        if graded:
            # the shards are new leaves: a gradient from a backward before the wrap would
            # be dropped, and a torch.optim step after it would skip the parameter
            raise RuntimeError(
                f"FullyShardedDataParallel over DistTensor parameters: {graded[:3]} already "
                f"have a gradient ({len(graded)} of {len(params)}; a backward ran before the "
                "wrap), which the dp shards do not keep; wrap (build_optimizer) before the "
                "first backward, or clear the gradients first (model.zero_grad())")
        self.prefetch_numel = prefetch
        object.__setattr__(self, "module", module)
        self.mesh = mesh
        # the data-parallel group the wrappers use (ranks.RankGroup): its size, its axis
        # and the recording of the collectives on the simulated clock.  ``dim`` may be a
        # tuple of adjacent dims (context parallelism's ("dp", "cp"), as torchtitan shards
        # FSDP2 over dp_shard x cp): shards over all their ranks, each collective one per
        # group on the merged dim (flat_dims), the shard index k = d * cp + c
        dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
        if not dims:
            raise ValueError("FullyShardedDataParallel(dim=()): name the data-parallel mesh "
                             "dim(s), e.g. 'dp'")
        self.axes = tuple(sorted({mesh.dim(d) for d in dims}))
        self.group_mesh, self.group_axis = flatten_dims(mesh, self.axes)
        self.group = RankGroup(self.group_mesh, self.group_axis, "FullyShardedDataParallel")
        self.axis, self.n = self.axes[0], self.group.n
        self.entries = []           # (module, name, template DistTensor, shard Parameter)
        self.names = []             # the qualified name of each entry's parameter
        self._places = []           # every (module, attr) holding it (tied weights: several)
        nd = mesh.ndim
        for qname, p, places in tensor_places(module, lambda m: getattr(m, "_wb_dist_params",
                                                                         {})):
            bad = [a for a in self.axes if not p.placements[a].is_replicate()]
            if bad:
                raise ValueError(f"{qname} is {p.placements[bad[0]]} on the dp dim "
                                 f"{mesh.dim_names[bad[0]]!r}; FullyShardedDataParallel "
                                 "shards parameters replicated there")
            if not isinstance(p._local, torch.Tensor):
                raise NotImplementedError(
                    f"FullyShardedDataParallel over DistTensor parameters: {qname} (shape "
                    f"{tuple(p.shape)}, {[str(q) for q in p.placements]} on {mesh}) has "
                    "uneven tensor-parallel shards (torch.chunk sizes differ), which the flat "
                    "dp shards are not built for; choose sizes divisible by the tp degree")
            loc = p._local.detach()
            if _B.is_distributed(mesh):         # the replicas start from dp rank 0's values
                loc = loc.clone()
                for a in self.axes:
                    loc = _B.broadcast_(loc, mesh, a, 0)
            chunk = self.chunk_of(loc)
            if not _B.is_distributed(mesh):     # stored so the template can view it
                chunk = dp_minor(chunk, self.axes)
            # the shard is the leaf an optimizer steps (frozen stays frozen)
            shard = laid_out(chunk, p.requires_grad,
                             f"it holds each dp rank's flat chunk of {qname}'s local shards "
                             f"(the {tuple(p.shape)} DistTensor)")
            if not _B.is_distributed(mesh):     # the module's parameter: the shards' value
                view_template(p, shard, self.axes, qname)
            step_clock.hold([shard], mesh.ranks, mesh.ndim)          # an optimizer's step over it: on the clock
            self.entries.append((places[0][0], places[0][1], p, shard))
            self.names.append(qname)
            self._places.append(places)
        self._by_mod: dict = {}     # id(module) -> [(attr, entry index)]
        for i, places in enumerate(self._places):
            for mod, attr in places:
                self._by_mod.setdefault(id(mod), []).append((attr, i))
        mods = [m for m in module.modules() if id(m) in self._by_mod]
        self.order = mods                   # execution order (registration until seen)
        self._seen: list = []               # the order this forward runs them in
        self._numel = {id(m): sum(math.prod(self.entries[i][3].shape[nd:]) * self.n
                                  for _, i in self._by_mod[id(m)]) for m in mods}
        self._init_clock(mods)
        self.async_ = not _B.is_distributed(mesh)
        self._hooks = [mod.register_forward_pre_hook(self._gather_hook(mod)) for mod in mods]
        # the modeled clock's hooks (zero3_clock) on both executors: on torch.distributed
        # the real gathers and reduce-scatters run unrecorded (_gather), and the clock
        # records the program's prefetched gathers and hooked reduce-scatters, as here
        self._hooks += [mod.register_forward_hook(self._backward_hook(mod)) for mod in mods]
        for i, e in enumerate(self.entries):
            if e[3].requires_grad:      # fires on each gradient computed for it (a
                e[3].register_hook(self._reduce_scatter_hook(i))   # split W pass too)
        module._wb_wrapped = "FullyShardedDataParallel"
        install_habits(self)
        # wb.FullyShardedDataParallel / Zero3 (parallelized model): an optimizer's
        # state_dict() over the shards in one device's shapes, as fully_shard's and the
        # plain module's (it gave the flat chunks' storage, (dp, tp, chunk), which no
        # other layout's optimizer takes; for a user's torch.optim over Zero3's shards too,
        # where an SGD momentum buffer, a gradient's clone, would not deepcopy: habits13b);
        # Zero3's own stage optimizer keeps the storage's (zero3.py)
        from .fsdp_dist_habits import module_shaped_optimizer_states
        module_shaped_optimizer_states(self)
        users_read_the_module(self)     # simulated ranks: a user's p.numel(), p.grad.mean()

    def chunk_of(self, loc: torch.Tensor) -> torch.Tensor:
        """Each dp rank's chunk of a template's local storage ``loc`` (flattened, padded;
        rank k of dp keeps chunk k: the dp axis becomes the shard index)."""
        nd, axes = self.mesh.ndim, self.axes
        flat = flat_padded(loc, self.n, nd)
        if _B.is_distributed(self.mesh):
            k = _B.local_index(self.group_mesh, self.group_axis)
            return flat.unflatten(-1, (self.n, -1)).select(-2, k).contiguous()
        for a in axes:
            if flat.shape[a] != 1:              # one copy per dp rank: rank 0's
                flat = flat.narrow(a, 0, 1)
        chunks = flat.unflatten(-1, (self.n, -1))
        for a in reversed(axes):
            chunks = chunks.squeeze(a)          # (*other dims, n, c)
        # k = d * cp + c (the merged group's order) back onto the dp (and cp) axes
        return chunks.movedim(nd - len(axes), axes[0]).unflatten(
            axes[0], tuple(self.mesh.shape[a] for a in axes)).contiguous()

    def gather_compact(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's chunk side by side, one copy on the dp dim(s), on the simulated
        ranks (not recorded by itself: inside ``suspend`` or the clock's hooks)."""
        nd, gm = self.mesh.ndim, self.group_mesh
        if gm is self.mesh:
            return C.all_gather(shard, self.mesh, self.axis, 0)
        a, b = self.axes[0], self.axes[-1] + 1
        lead = tuple(shard.shape[:nd])
        flat = shard.reshape(lead[:a] + (self.n,) + lead[b:] + tuple(shard.shape[nd:]))
        full = C.all_gather(flat, gm, self.group_axis, 0)
        return full.reshape(lead[:a] + (1,) * (b - a) + lead[b:] + tuple(full.shape[gm.ndim:]))

    def _gather(self, tmpl: DistTensor, shard: torch.Tensor, cast: bool = False) -> DistTensor:
        nd, mesh = self.mesh.ndim, self.mesh
        if self.async_:
            return self._gather_math(tmpl, shard, cast)
        # the real gather (its backward the gradient's reduce-scatter), unrecorded: the
        # clock's hooks (zero3_clock) record the program's, prefetched ahead of use and the
        # re-gather before the layer's backward (the saved copy stands in), as on the
        # simulated ranks.  Recorded here as gloo's calls block, each gather waited for at
        # its module and each reduce-scatter in backward, tiny dp 4 zero 3 read 0.449549 ms
        # for the simulator's 0.348613 (task tdclock2).
        gm = self.group_mesh
        full = C._dist("all_gather", shard.reshape((1,) * gm.ndim + tuple(shard.shape[nd:])),
                       gm, self.group_axis, "zero-3 params",
                       lambda l, pg, n, k: _B.AllGather.apply(l, pg, n, 0, k, True),
                       record=False)
        full = unflat(full.reshape((1,) * nd + tuple(full.shape[gm.ndim:])),
                      tmpl._local.shape[nd:], nd)
        # the views above dropped the gather's mark: without it the first op meeting the
        # dp-sharded batch gives the copy an expand_replicas (an all-reduce in backward) on
        # top of the gather's reduce-scatter, and every gradient came out dp times too big
        _B.tag(full, self.axes)
        full._wb_stale = self._gathered_message()
        full._wb_on_requires_grad = tmpl.requires_grad_     # (as in _gather_math)
        full._wb_data_of = tmpl
        _refuse_clip_as(full, tmpl)
        return DistTensor(full, mesh, tmpl.placements, tmpl.shape, tmpl.dtype)

    def _gathered_message(self) -> str:
        # what an in-place write to a gathered copy (a module's attribute from its forward
        # to the optimizer step) raises (parallel/inplace.py reads ``_wb_stale``)
        from .fsdp_dist_views import wrapper_names      # the name the user called
        return (f"this DistTensor is the copy of a parameter that {wrapper_names(self)[0]}'s "
                "forward gathered from its flat shards; a write to it would not reach the "
                "shards: initialize before wrapping, or load values with "
                "module.load_state_dict (it cuts them into the shards)")

    # fully_shard's MixedPrecisionPolicy over DistTensors (:mod:`.fully_shard_tp`): the
    # dtype a forward gathers and computes in, and the one gradients are reduced in
    # (None: param_dtype's); both None here unless fully_shard set them
    param_dtype = None
    reduce_dtype = None

    def _gather_math(self, tmpl: DistTensor, shard: torch.Tensor,
                     cast: bool = False) -> DistTensor:
        """The gathered parameter, one copy per dp rank, with no collective recorded (the
        hooks record them on the clock): its backward, the sum over the copies of each
        rank's chunk, is the reduce-scatter's math.  ``cast`` (a forward's gather under
        ``param_dtype``): FSDP2's ``foreach_all_gather`` of the shards cast to
        ``param_dtype`` (``_fsdp_param.py``), and its ``foreach_reduce`` of the gradients
        cast to ``reduce_dtype`` (``_fsdp_collectives.py``): the copies are summed in
        ``reduce_dtype`` (the cast after the expand) or in ``param_dtype`` (before)."""
        from ...sim_mesh.trace import suspend
        nd, mesh = self.mesh.ndim, self.mesh
        compute = (self.param_dtype if cast else None) or shard.dtype
        red = (self.reduce_dtype or self.param_dtype) if cast else None
        if red is not None and shard.dtype != red:
            shard = shard.to(red)
        with suspend():
            full = self.gather_compact(shard)                # compact: one copy on dp
        local = tuple(tmpl._local.shape[nd:])
        full = unflat(full, local, nd)
        lead = list(full.shape[:nd])
        for a in self.axes:
            lead[a] = mesh.shape[a]
        full = full.expand(tuple(lead) + local)
        if full.dtype != compute:
            full = full.to(compute)              # per copy: its gradient cast back first
        if type(full) is not torch.Tensor:
            # the wrappers' own view of the shards (the module's values, one copy per dp
            # rank) as a plain tensor, the same autograd graph: a user's read of
            # module.weight after a forward is no storage read (laid_out_views refused
            # torch.equal(model[2].bias.full(), ...) once the shards read as the module's)
            with torch._C.DisableTorchFunctionSubclass():
                full = full.as_subclass(torch.Tensor)
        full._wb_stale = self._gathered_message()
        # module.weight.requires_grad_(False) after a forward (the attribute is this copy
        # until the next one): the parameter frozen, and through its hook the shard the
        # optimizer steps (the copy alone was: the parameter went on training)
        full._wb_on_requires_grad = tmpl.requires_grad_
        # its .data is the parameter's (habits._get_data): module.weight.data.mul_(2)
        # after a forward wrote a throwaway copy (the training never saw it)
        full._wb_data_of = tmpl
        _refuse_clip_as(full, tmpl)
        return DistTensor(full, mesh, tmpl.placements, tmpl.shape, full.dtype)

    # ---- the optimizer: the shards are the parameters --------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """(the module's own qualified name, its shard ``nn.Parameter``), as
        ``module.named_parameters()`` names them (a tied weight once, unless
        ``remove_duplicate=False``): what any ``torch.optim`` optimizer steps."""
        if remove_duplicate:
            for qname, e in zip(self.names, self.entries):
                yield prefix + qname, e[3]
        else:
            for qname, i in self._named_places():
                yield prefix + qname, self.entries[i][3]

    def _named_places(self):
        """(qualified name, entry index) of every place, in the module's order."""
        index = {id(e[2]): i for i, e in enumerate(self.entries)}
        for mname, m in self.module.named_modules():
            for attr, t in getattr(m, "_wb_dist_params", {}).items():
                yield (f"{mname}.{attr}" if mname else attr), index[id(t)]

    def parameters(self, recurse: bool = True):
        """The shards (``torch.optim.SGD(fsdp.parameters(), lr=...)`` steps them)."""
        return (e[3] for e in self.entries)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for e in self.entries:
            if e[3].grad is not None:
                e[3].grad = None if set_to_none else e[3].grad.zero_()

    def no_sync(self):
        """Not built over DistTensor parameters (the plain-module wrapper's FSDP1
        ``no_sync`` holds its gradients in its own reduce path, which this mode does not
        run): raises, naming what gives the same gradients."""
        raise NotImplementedError(
            f"{type(self).__name__}.no_sync() over DistTensor parameters is not built; "
            "accumulate over micro-batches without it: each backward reduce-scatters its "
            "gradients onto the shards, where they add up to the same sum (or use "
            "fully_shard's set_requires_gradient_sync(False), built on simulated ranks)")

    def finish_gradient_synchronization(self) -> None:
        """Wait (on the simulated clock) for every gradient reduce-scatter launched in
        backward, recording those of gradients set without backward's hook (a split
        backward's W pass).  The shards already hold the reduced gradients (the math
        runs in autograd); call it before a torch.optim optimizer's ``step()`` (as
        ``Zero3.step()`` does), so the clock counts the reduce-scatters as waited for.
        Called again before a new gradient (``Hybrid.clip_grad_norm_``'s, then the step's),
        it records nothing: each gradient is reduce-scattered once, as FSDP's
        ``clip_grad_norm_`` then ``optimizer.step()`` do (was: every gradient's
        reduce-scatter recorded a second time, 21 phantom ones on tiny, dp 2)."""
        from ...sim_mesh.trace import current_trace
        tr = current_trace()
        for i, e in enumerate(self.entries):
            g = e[3].grad
            if g is not None and i not in self._reduced and \
                    (i not in self._synced or self._synced[i]() is not g):
                self._reduce_scatter_hook(i)(e[3])
        self._synced = {i: weakref.ref(e[3].grad) for i, e in enumerate(self.entries)
                        if e[3].grad is not None}
        if tr is not None:
            tr.flush()                    # the reduce-scatters deferred in backward
        for t, h in self._pending + [p for v in self._inflight.values() for p in v]:
            if t is tr and tr is not None:
                for h1 in (h if isinstance(h, list) else [h]):
                    tr.wait(h1)
        self._pending, self._inflight, self._reduced = [], {}, set()
        self._grads_left, self._frozen_b = {}, []
        self.live.free_all()

    def forward(self, *args, **kwargs):
        self.check_places()
        return self.module(*args, **kwargs)

    def check_places(self, who: str = "FullyShardedDataParallel") -> None:
        """A parameter assigned on the module since wrapping: raise (.replaced_params)."""
        check_dist_places(self.module, who, [(n, places, e[2]) for n, places, e in
                                             zip(self.names, self._places, self.entries)])

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """{the module's own qualified name: the full tensor}, every name of a tied weight
        included (as ``FullyShardedDataParallel.full_state_dict``), shards gathered."""
        from ...sim_mesh.trace import suspend
        from ..load_back import flush
        flush()                         # a write into an earlier state_dict()'s copies
        out, full = {}, {}
        with suspend():
            for qname, i in self._named_places():
                if i not in full:
                    _, _, tmpl, shard = self.entries[i]
                    full[i] = self._gather(tmpl, shard.detach()).full()
                out[qname] = full[i].clone()
            # the module's state_dict() keys in its order: its buffers (persistent ones)
            # and extra state too, as FSDP1's FULL_STATE_DICT and a plain module's
            whole = {}
            for name, v in self.module.state_dict(keep_vars=True).items():
                if name in out:
                    whole[name] = out.pop(name)
                elif isinstance(v, DistTensor):
                    whole[name] = v.full().detach().clone()
                elif isinstance(v, torch.Tensor):
                    whole[name] = v.detach().clone()
                else:
                    whole[name] = v
        whole.update(out)
        return whole

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        """The module's ``state_dict()``: its own names, each parameter a DistTensor of
        the template's placements gathered from the shards (:mod:`.fsdp_dist_habits`)."""
        from ..keep_vars import as_parameters
        sd = self.module.state_dict(destination=destination, prefix=prefix,
                                    keep_vars=keep_vars)
        # a user's keep_vars=True: the parameters themselves (the shards), as FSDP2's
        return as_parameters(self, sd, prefix, keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The module's ``load_state_dict`` (DistTensors or full tensors): the loaded
        values are cut into the shards."""
        return self.module.load_state_dict(state_dict, strict, assign)

    def _apply(self, fn, recurse=True):
        raise NotImplementedError(f"{wrapper_names(self)[0]} over DistTensor parameters: "
                                  ".to() / .double() / .half() / .float() / .cuda() would miss "
                                  "the shards; move or cast the module before wb.parallelize")

    def full_parameters(self):
        """(qualified name, global tensor) of every parameter, as ``named_parameters``
        names them (a tied weight once), from :meth:`full_state_dict`."""
        full = self.full_state_dict()
        for qname in self.names:
            yield qname, full[qname]

    def extra_repr(self) -> str:
        return (f"{type(self.module).__name__}, DistTensor parameters on {self.mesh}, "
                f"dp={self.n}, prefetch_numel={self.prefetch_numel}")


def _refuse_clip_as(t: torch.Tensor, tmpl: DistTensor) -> None:
    """A gathered copy (the module's attribute after a forward) holds no gradient, as its
    template: clip_grad_norm_ over the attributes gave 0 and clipped nothing; now it
    raises the template's message (clip the shards)."""
    for s in storage.tensors(tmpl._local):
        msg = getattr(s, "_wb_clip_refuse", None)
        if msg:
            t._wb_clip_refuse = msg
            if getattr(s, "_wb_clip_shard", None) is not None:     # simulated: clip it
                t._wb_clip_shard = s._wb_clip_shard
            return
