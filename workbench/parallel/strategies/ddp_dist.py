"""``DistributedDataParallel`` over DistTensor parameters: DDP beside tensor parallelism.

    wb.parallelize(model, mesh, tp_plan, mesh_dim="tp")      # mesh dims ("dp", "tp")
    ddp = wb.DistributedDataParallel(model, mesh, "dp")      # torch DDP's buckets
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)       # every rank's replica
    loss = ddp(x).mean(); loss.backward(); opt.step()        # x: Shard(0) on "dp"

A module whose parameters are DistTensors (``wb.parallelize``: PyTorch's 2-D layout, DDP
over the dp dim of a mesh whose other dims shard the parameters) runs its own forward
once on the DistTensors; no per-rank loop.  Every parameter must be replicated on the
data-parallel dim; that dim becomes real storage (one replica per rank, each keeping the
gradient of its own examples), and :class:`GradReplicas` sums the replicas' gradients,
one all-reduce per bucket.  ``DistributedDataParallel``'s default is torch DDP's buckets
(:mod:`.ddp_buckets`: one per dtype in the first step, then rebuilt in the order the grad
hooks saw, 1 MiB then 25 MiB, ``bucket_cap_mb`` honoured), over each rank's local shards;
``bucket_bytes=B`` gives fixed buckets filled in reverse registration order
(:func:`.ranks.bucket_order`; ``1``: one all-reduce per gradient; ``math.inf``: one
contiguous buffer, Megatron-LM's ``DistributedDataParallel`` without overlap).
``GradReplicas`` without a policy (``DataParallel``, the hybrid recipe) keeps
``bucket_bytes=None`` as one all-reduce per gradient.  Unlike torch's reducer, on
simulated ranks a parameter with no gradient is left out of its bucket's message.  Which
parameters a backward used is read from the grad hooks, as torch's reducer reads it (not
from ``.grad``: a stale one from an earlier step, or an exact zero, changes nothing).
With ``find_unused_parameters=True`` the processes all-reduce that map (torch's
``local_used_map``, one int32 each, every step): a parameter used on some ranks gets the
average on all (a skipping rank sends its ``.grad``, zeros if None, as torch's bucket
holds it), one used nowhere keeps its ``.grad``.  With ``find_unused_parameters=False``
(torch's reducer then never finishes: it raises at the next forward, or hangs) a skipping
rank sends zeros; it raises at once if the sum shows another rank's gradient, else at its
next forward with torch's "Expected to have finished reduction" (:mod:`.unfinished`).

The reduction runs by itself at the end of every backward that reached the module's
parameters outside :meth:`~DistTensorDDP.no_sync`, as torch DDP's (its reducer's
finalize is queued on the autograd engine by the first grad hook,
``Variable._execution_engine.queue_callback``, ``torch/csrc/distributed/c10d/reducer.cpp``
``Reducer::mark_variable_ready``): an ordinary ``loss.backward(); opt.step()`` loop steps
the summed gradients.  Inside ``no_sync()`` nothing is reduced; the next backward outside
it reduces the accumulated sum (torch's semantics).  The buckets are all-reduced after
backward, not during it (Megatron-LM's ``overlap_grad_reduce=False``); launching them
during backward (PyTorch DDP's overlap) is built for plain modules (:mod:`.ddp`) only:
``overlap_grad_reduce=True`` raises here.  :meth:`DistTensorDDP.
finish_gradient_synchronization` stays (a pipeline's micro-batches run their backwards
inside ``no_sync()`` but the last, or call it after): it reduces only what no backward
reduced yet, never twice.

:class:`GradReplicas` is the one copy of this reduction: ``DataParallel`` (the course's
optimizer-style name, :mod:`.data_parallel`) and the hybrid recipe run on it.  Sequence
parallelism's norm gradients, partial sums over tp (``partial_grads``), are all-reduced
over that dim in one buffer first, as Megatron-LM's ``_allreduce_layernorm_grads``.

The habits of one device hold: each replica's gradient is a
:class:`~.rank_grads.ReplicaGrad`, so ``torch.nn.utils.clip_grad_norm_(ddp.parameters(),
...)`` reads one copy (one device's norm, not ``sqrt(N_dp)`` times it) once the gradients
are summed and raises before; a backward after the sum accumulates as torch DDP's (the
sum kept in one copy) and a second sum is skipped; ``state_dict()`` gives torch DDP's keys
(DistTensors over the replicas), ``load_state_dict`` copies into every replica in place,
``requires_grad_`` and ``.to(dtype)`` convert the replicas in place (the optimizer keeps
its tensors).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..dist_tensor import DistTensor
from ..module import dist_parameters
from ..module_state import BackwardHookRefusal
from .ddp import DistributedDataParallel, check_broadcast_buffers
from .ddp_buckets import torch_policy
from .ddp_dist_habits import check_written_replicas, install as install_habits, replicas_equal
from .grad_replicas import GradReplicas
from .ranks import bucket_order, check_module
from .replaced_params import check_named, snapshot
from .torch_kwargs import ddp_torch_kwargs

__all__ = ["GradReplicas", "DistTensorDDP"]


def has_dist_parameters(module) -> bool:
    """Does ``module`` hold DistTensor parameters (``wb.parallelize`` made them)?"""
    return isinstance(module, nn.Module) and next(dist_parameters(module), None) is not None


class DistTensorDDP(BackwardHookRefusal, DistributedDataParallel):
    """``DistributedDataParallel`` of a module with DistTensor parameters (module
    docstring); ``wb.DistributedDataParallel(module, ...)`` builds one for such a module.

    ``parameters()`` are the replicas (each parameter's local leaf, one copy per rank
    along every mesh dim it is replicated on) for any ``torch.optim`` optimizer.
    """

    def __init__(self, module: nn.Module, mesh=None, dim="dp", bucket_bytes=None,
                 broadcast_from: int = 0, overlap_grad_reduce: bool = False,
                 partial_grads=(), partial_dim="tp", broadcast_buffers: bool | None = True,
                 **torch_kwargs):
        nn.Module.__init__(self)
        check_module(module, "DistributedDataParallel")
        cap_mb = torch_kwargs.get("bucket_cap_mb")
        ddp_torch_kwargs(torch_kwargs, bucket_bytes)   # torch DDP's own, checked
        # no bucket_bytes: torch DDP's buckets (bucket_cap_mb's, 25 MiB by default)
        policy = torch_policy(cap_mb, bool(torch_kwargs.get("find_unused_parameters", False)),
                              bool(torch_kwargs.get("static_graph", False)))
        check_broadcast_buffers(broadcast_buffers)     # one copy of each buffer: True holds
        params = list(dist_parameters(module))
        mesh0 = params[0][1].mesh
        if mesh is None or mesh != mesh0:
            from .mesh_advice import world_slice_advice
            advice = world_slice_advice(mesh0, mesh, dim, f"DistributedDataParallel(mesh={mesh!r})",
                                         f"DistributedDataParallel(model, world_mesh, dim={dim!r})")
            if advice:
                raise ValueError(advice)
            raise ValueError(f"DistributedDataParallel(mesh={mesh!r}): the module's DistTensor "
                             f"parameters live on {mesh0}; pass that mesh")
        if not isinstance(overlap_grad_reduce, bool):
            raise TypeError(f"DistributedDataParallel(overlap_grad_reduce="
                            f"{overlap_grad_reduce!r}): give True or False")
        if overlap_grad_reduce:
            raise NotImplementedError(
                "DistributedDataParallel(overlap_grad_reduce=True) over DistTensor parameters: "
                "gradients are reduced in finish_gradient_synchronization() after backward "
                "(Megatron-LM's overlap_grad_reduce=False); leave it False")
        if isinstance(broadcast_from, bool) or not isinstance(broadcast_from, int):
            raise ValueError(f"broadcast_from={broadcast_from!r}: give a rank index of the "
                             "data-parallel group (an int; 0 over DistTensor parameters)")
        if broadcast_from != 0:
            raise NotImplementedError(f"broadcast_from={broadcast_from!r} over DistTensor "
                                      "parameters: the replicas start from dp rank 0's copy")
        object.__setattr__(self, "module", module)
        self._places = snapshot(module)     # a tie after wrapping: raise (.replaced_params)
        static = bool(torch_kwargs.get("static_graph", False))
        self.replicas = GradReplicas(params, mesh, dim, bucket_bytes, partial_grads,
                                     partial_dim, "DistributedDataParallel", policy,
                                     find_unused=None if static else
                                     bool(torch_kwargs.get("find_unused_parameters", False)))
        self._names = [name for name, _ in params]
        if len(self._names) == len(self.replicas.params):   # (a tied weight: one of two)
            self.replicas.names = self._names
        self.broadcast_from, self._sync_enabled = 0, True
        self._finish_queued = False     # the end-of-backward reduction is queued
        self.replicas.unsynced_hint = (
            "torch.nn.utils.clip_grad_norm_ over DistributedDataParallel's replicas before "
            "their gradients are summed over the data-parallel ranks (each rank would clip "
            "by its own gradient): a backward outside no_sync() sums them when it returns "
            "(or call finish_gradient_synchronization() after leaving no_sync()), then clip")
        for p in self.replicas.params:  # after GradReplicas' own hooks (registered first)
            if id(p) in self.replicas.hooked:
                p._local.register_post_accumulate_grad_hook(self._queue_finish)
        module._wb_wrapped = "DistributedDataParallel"
        install_habits(self)            # the replicas as one device's parameters

    def forward(self, *args, **kwargs):
        # a parameter assigned after wrapping (head.weight = emb.weight): its replica is not
        # the one hooked and bucketed; torch's reducer raised "Expected to have finished
        # reduction" only at the forward after the step that used it (habits11)
        check_named(self.module, self._places, "DistributedDataParallel")
        check_written_replicas(self)    # a write that left the replicas different: raise
        # a backward that raised after queueing its reduction never ran the callback: a new
        # iteration queues afresh (else no later backward would reduce, silently)
        self._finish_queued = False
        if torch.is_grad_enabled():
            self.replicas.ensure_prior_reduction_finished()     # torch's rebuild_buckets does
            self.replicas.rebuild_buckets()
        return self.module(*args, **kwargs)

    # ---- what an optimizer steps ------------------------------------------------------------
    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """(``"module." +`` the module's own name, its replica), torch DDP's names (a tied
        weight under each of its names with ``remove_duplicate=False``, as torch's)."""
        if not recurse:
            return
        mine = {id(p) for p in self.replicas.params}
        for name, p in self.module.named_parameters(self._child_prefix(prefix), True,
                                                    remove_duplicate):
            if id(p) in mine:
                yield name, p._local

    def parameters(self, recurse=True):
        # recurse=False: none, as torch DDP's (it holds no parameter of its own); it gave
        # every replica while named_parameters(recurse=False) gave none
        return (p for _, p in self.named_parameters(recurse=recurse))

    # ---- gradient synchronization ---------------------------------------------------------
    def _queue_finish(self, leaf) -> None:
        """A replica's gradient was accumulated: outside ``no_sync()``, reduce at the end of
        this backward (once per backward, as torch's reducer queues its finalize)."""
        if self._sync_enabled and not self._finish_queued:
            self._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._finish_queued = False
        self.finish_gradient_synchronization()

    def finish_gradient_synchronization(self) -> None:
        """Sum every gradient over the data-parallel ranks (in buckets), in place.  Run by
        itself at the end of each backward outside ``no_sync()``; a call with nothing
        new since (no backward reached the parameters) reduces nothing."""
        if self._sync_enabled and self.replicas.used:
            self.replicas.reduce()

    def _set_sync(self, flag: bool) -> None:
        """``require_backward_grad_sync = flag``: ``no_sync()``'s switches, left set."""
        self._sync_enabled = self.replicas.mark_ready = flag

    @contextlib.contextmanager
    def no_sync(self):
        """Inside the block the backwards reduce nothing (nor does
        :meth:`finish_gradient_synchronization`); the gradients accumulate locally and the
        first backward after it reduces their sum (torch DDP's ``no_sync``)."""
        old, self._sync_enabled = self._sync_enabled, False
        self.replicas.mark_ready = False
        try:
            yield
        finally:
            self._sync_enabled = old
            self.replicas.mark_ready = old

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Debug: raise if any parameter differs between the ranks' replicas."""
        for name, p in zip(self._names, self.replicas.params):
            loc = p._local
            if self.replicas.distributed:
                continue                  # one replica per process: nothing to compare here
            if not replicas_equal(loc, self.replicas.axes):              # NaN == NaN
                raise RuntimeError(f"DistributedDataParallel: the replicas of {name!r} differ "
                                   "between ranks; did something update one rank's copy "
                                   "outside the optimizer step?")

    # ---- the module's own names -------------------------------------------------------------
    def requires_grad_(self, requires_grad: bool = True):
        late = [n for n, p in zip(self._names, self.replicas.params)
                if id(p) not in self.replicas.hooked]
        if requires_grad and late:
            raise ValueError(f"DistributedDataParallel.requires_grad_(True): {late[:3]} were "
                             "frozen when the wrapper was built, so their gradients are not "
                             "tracked as replicas; set requires_grad before wrapping the module")
        for p in self.replicas.params:
            p._local.requires_grad_(requires_grad)
        return self

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        """torch DDP's keys (``prefix + "module." +`` the module's own name); each value the
        module's DistTensor (its storage the replicas), buffers as they are."""
        from ..keep_vars import as_parameters
        out = {} if destination is None else destination
        for name, t in self.module.state_dict(keep_vars=keep_vars).items():
            out[prefix + "module." + name] = t
        # a user's keep_vars=True: the parameters themselves (the replica storages), as
        # torch DDP's (keep_vars)
        return as_parameters(self, out, prefix, keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """:meth:`state_dict`'s keys; DistTensors or full tensors, copied into every
        replica in place (keys and shapes checked first, nothing copied on a mismatch)."""
        from .ranks import state_dict_check
        if assign:
            raise NotImplementedError("DistributedDataParallel.load_state_dict(assign=True): "
                                      "the replicas are the optimizer's tensors; load with "
                                      "assign=False (copies into them)")
        from ..keep_vars import module_values
        state_dict = module_values(state_dict)      # a wrapper's keep_vars dict: values
        mine = self.state_dict(keep_vars=True)
        missing, unexpected = state_dict_check("DistributedDataParallel", mine, state_dict,
                                               strict)
        own = {k[len("module."):]: v for k, v in state_dict.items() if k in mine}
        self.module.load_state_dict(own, strict=False)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """{the module's own name: the full tensor} (dp rank 0's replica), buffers too."""
        from ...sim_mesh.trace import suspend
        with suspend():                 # a tp-sharded one is gathered: not the step's traffic
            full = {name: p.full().detach().clone() for name, p in
                    zip(self._names, self.replicas.params)}
            out = {}                    # the module's state_dict() keys, in its order
            for name, v in self.module.state_dict(keep_vars=True).items():
                if name in full:
                    out[name] = full[name]
                elif isinstance(v, (torch.Tensor, DistTensor)):
                    out[name] = (v.full() if isinstance(v, DistTensor) else v).detach().clone()
                else:                   # a module's extra state, as it is
                    out[name] = v
        return out

    @property
    def bucket_names(self) -> list[list[str]]:
        """The parameters' names in each bucket, in the order they are all-reduced (every
        parameter with a gradient: the buckets of ``bucket_bytes``, or torch's)."""
        r = self.replicas
        name = {id(p): n for n, p in zip(self._names, r.params)}
        if r.book is not None:
            return [[name[id(p)] for p in b] for b in r.book.buckets]
        ps = [p for p in r.params if id(p) in r.hooked]
        if not r.bucket_bytes:
            return [[name[id(p)]] for p in ps]
        lead = (0,) * r.mesh.ndim
        sizes = [p._local[lead].numel() * p._local.element_size() for p in ps]
        return [[name[id(ps[j])] for j in b] for b in bucket_order(sizes, r.bucket_bytes)]

    def extra_repr(self) -> str:
        r = self.replicas
        return (f"{type(self.module).__name__}, DistTensor parameters on {r.mesh}, "
                f"dp={r.n}, bucket_bytes={r.bucket_bytes}")
