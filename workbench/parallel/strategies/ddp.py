"""``DistributedDataParallel``: PyTorch DDP's contract, on simulated ranks or processes.

    ddp = wb.DistributedDataParallel(model, mesh)        # or mesh=None under torchrun
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)   # the module's own parameters
    loss = F.cross_entropy(ddp(x), y)                     # x: a DistTensor sharded on "dp"
    loss.backward()                                       # gradients all-reduced as they come
    ddp.finish_gradient_synchronization()
    opt.step()

What it does (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training", VLDB; ``torch.nn.parallel.DistributedDataParallel``):

* at construction every rank receives rank ``broadcast_from``'s parameters and
  buffers (a broadcast), so the replicas start equal;
* during backward, a post-accumulate-grad hook on each parameter marks it ready;
  when every parameter of a bucket is ready, and every bucket before it has been
  launched, its gradients are all-reduced *asynchronously* as one buffer (the trace
  records the all-reduce with ``overlap=True``, on the comm stream, while backward
  goes on);
* the buckets are torch DDP's (:mod:`.ddp_buckets`): by default one bucket per dtype
  in the first step, then, from the second, buckets rebuilt in the order the first
  backward produced the gradients, the first of 1 MiB and the others of 25 MiB
  (``bucket_cap_mb=M``: M MiB each; ``find_unused_parameters=True``: buckets from
  registration order, reversed, never rebuilt; ``static_graph=True``: rebuilt one step
  later).  workbench's ``bucket_bytes=B`` instead keeps fixed buckets of at least ``B``
  bytes from the first step, filled in reverse registration order (``B=1``: one
  all-reduce per parameter, the naive version);
* :meth:`finish_gradient_synchronization` launches the buckets still open (a
  parameter that received no gradient travels as zeros in its bucket, as in torch's
  buffer, and keeps ``grad=None``), waits for every all-reduce and leaves each
  gradient the *average* over ranks (``ReduceOp.AVG``).  It also runs by itself at
  the end of backward.  With ``find_unused_parameters=True`` the parameters the
  forward's outputs do not reach are ready from the first hook of backward, and the
  ranks all-reduce which parameters they used (one int32 each) after the last bucket,
  as torch's reducer does.  Where torch's reducer raises or hangs, this one raises too:
  a gradient reaching a parameter the outputs do not reach (a loss using a tensor
  forward stored instead of returned), a graph that changes under ``static_graph``,
  (torch.distributed, ``find_unused_parameters=False``) a parameter used on some ranks
  only, and (``find_unused_parameters=False``) a trainable parameter a backward left
  without a gradient (no hook ran; a stale ``.grad`` does not count): the next forward
  with grad enabled raises torch's "Expected to have finished reduction in the prior
  iteration", naming it (:mod:`.unfinished`).

Frozen parameters (``requires_grad=False``) get no hook and stay frozen; a
parameter used nowhere keeps ``grad=None`` (its bucket carries zeros for it, as torch's
does; the optimizer skips it as on one device); tied weights are one parameter, reduced
once.

A module whose parameters are DistTensors (``wb.parallelize``, e.g. tensor parallel on
another mesh dim) runs in DDP's DistTensor mode (:mod:`.ddp_dist`): one forward over the
DistTensors, the gradients reduced at the end of backward too (after it, not overlapped).

torch DDP *averages* the gradients over the ranks: each rank backpropagates its own
loss and every parameter ends with the mean of the ranks' gradients, so a loss that
sums over the local batch gives 1/N of the summed global batch's gradient, and one that
averages gives the global mean's.  The simulation keeps those semantics:

* a loss the module returns (one scalar per rank) is joined as the ranks' mean
  (``Partial('avg')``), so backward gives each rank 1/N of its own loss's gradient and
  the all-reduce sums the rows: the average, whatever the loss sums or averages; a loss
  term the module attaches by gradient (a MoE layer's load-balancing loss,
  ``ops.moe.attach_aux_loss``) takes the same 1/N in each rank's forward
  (``ops.moe.loss_share``);
* a loss computed outside the module on the joined output is the loss of the global
  batch (a DistTensor, as DTensor computes it).  With a loss that averages over the
  batch (``cross_entropy``'s default) each rank's row already carries the 1/N of the
  mean and the summed rows are the average a torchrun process computes.  A loss that
  *sums* over the global batch is N times the average torch DDP takes: divide it by N
  (or return it from the module) to train as torchrun does.  With uneven shards (a
  batch the N ranks do not divide) the mean over the global batch is one device's loss,
  while torch DDP averages the ranks' own means (each over its own rows; 0.022 apart in
  a gradient for 7 rows on 2 ranks): return the loss from the module to train as
  torchrun does.

Two things the simulated ranks give as one device and torchrun processes do not (not
defects of either; the same program then differs between the two): the uneven-shard
mean above, and dropout.  The simulated ranks draw their masks one after another from
the one generator, so together they are one device's mask over the global batch; each
torchrun process draws from its own generator (wb DDP's processes draw what torch DDP's
draw, measured bitwise), so with the same seed on every process each rank's mask is the
first draw of its shard's shape.  Compare the two with dropout off (``model.eval()`` or
``p=0``); the course's models key their masks by position instead
(:mod:`workbench.sim_mesh.rng`), and give one device's masks on both.

On torch.distributed the all-reduce sums and divides by N (gloo has no AVG op).

A user's hooks (:mod:`.rank_hooks`): on simulated ranks the module runs once per rank, so a
forward (pre-)hook, a full backward hook or a ``Tensor.register_hook`` inside ``forward``
on the module or a submodule fires N times a step, each time with that rank's tensors, as
each torchrun process's hook fires once with its own (torch.nn.DataParallel documents the
same N calls); a hook that changes the forward changes each rank's, so the step is one
device's.  ``wb.simulated_rank()`` names the rank (None outside a simulated rank's
forward): ``if wb.simulated_rank() in (None, 0)`` logs rank 0's view, as a torchrun
script's ``if dist.get_rank() == 0``.  A hook on the wrapper itself, and every hook in
DistTensor mode, fires once with the global tensors.

State dicts follow torch DDP: ``state_dict()`` keys are ``"module." +`` the module's own
names (on simulated ranks each value is rank ``broadcast_from``'s copy, of the module's
own shape; ``keep_vars=True``: the parameters themselves, as torch's), ``load_state_dict``
takes them (full tensors, copied into every rank's copy), keys and shapes checked before
anything is copied.  ``torch.autograd.grad(loss, ddp.parameters())`` raises on simulated
ranks (each row would be its own rank's gradient, never averaged; torch DDP documents that
it does not work with ``autograd.grad``; over DistTensors too, each replica's own share:
``..autograd._check_replicas``): call ``loss.backward()``.  ``torch.nn.utils.
clip_grad_norm_(ddp.parameters(), ...)`` gives one device's norm: on simulated ranks
the gradients are :class:`~.rank_grads.RankRows`, whose norm is one rank's.  On simulated
ranks a random ``nn.init`` of a parameter after wrapping raises (:mod:`.laid_out`: each
rank's row would get its own draw, the fan-in read from the rows): initialize before;
``p.copy_(t)``, ``fill_``, ``mul_`` write every row.  ``ddp.module.state_dict()`` gives the
module's own shapes (rank ``broadcast_from``'s rows) and ``ddp.module.load_state_dict``
takes them, as torch's; a write into those rows (``sd[k].copy_(t)``, DCP's load in
place, ``optimizer.state_dict()``'s states) reaches every row before the next forward
or step (:mod:`.replica_writes`), and a row written on its own raises there;
``ddp.modules()`` (the wrapper, then the module's, as torch DDP's), ``ddp.apply(fn)``,
``ddp.buffers()`` reach the module's.  Buffers a
forward writes change once a step, from rank ``broadcast_from``
(torch DDP broadcasts that rank's buffers before each forward); a plain BatchNorm in
training normalizes each rank's rows by that rank's own statistics, as torch DDP does
(running statistics: rank ``broadcast_from``'s); ``nn.SyncBatchNorm`` raises on N > 1
simulated ranks (its global statistics are not built here).  On torch.distributed the
processes take rank ``broadcast_from``'s buffers before a forward as torch DDP does (before
the first, and after one run with grad enabled outside ``no_sync``), so each process's
running statistics, and its ``eval()`` output, are torch DDP's.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from ...sim_mesh import backends as _B
from .. import step_clock
from ..dist_tensor import DistTensor
from ..load_back import mark
from ..versions import plain_forward
from .laid_out import Rows, laid_out, module_shaped, module_shaped_state_dict, rank_row
from .laid_out_hooks import check_hooks
from .replaced_params import check_named, mark_successor, snapshot
from .torch_kwargs import ddp_torch_kwargs
from .ddp_buckets import (BucketBook, fixed_policy, output_tensors, reachable_leaves,
                          ready_order, torch_policy)
from .ddp_reducer import Reducer
from .replica_writes import sync_rows
from .rank_recompute import close_open_scopes
from .ranks import (ModuleWrapper, RankGroup, check_module, replace_parameter,
                    run_per_rank, state_dict_check, check_not_meta, set_extra_states,
                    check_sync_batchnorm_device)

__all__ = ["DistributedDataParallel"]


def check_broadcast_buffers(broadcast_buffers) -> None:
    """Only torch's default is built (True, or None: torch's default spelling; False:
    per-rank buffers)."""
    if broadcast_buffers is not True and broadcast_buffers is not None:
        raise NotImplementedError(
            f"DistributedDataParallel(broadcast_buffers={broadcast_buffers!r}): only "
            "True (torch's default: rank broadcast_from's buffers before each forward) "
            "is built; drop the argument")


class DistributedDataParallel(Reducer, ModuleWrapper):
    """Data parallel training of ``module`` over the ranks along ``dim`` of ``mesh``
    (``mesh=None``: the default torch.distributed process group).

    The module's parameters stay its own ``nn.Parameter``s; ``ddp.parameters()`` is
    ``module.parameters()`` and, as torch DDP's, ``named_parameters()``,
    ``named_buffers()``, ``named_modules()`` name them ``"module." +`` their own.  On a
    simulated mesh each parameter holds one row per rank (shape ``(N, *shape)``);
    :meth:`state_dict` gives one rank's tensors under torch DDP's keys (``module.``
    prefix), :meth:`full_state_dict` under the module's own names.
    """

    def __new__(cls, module=None, *args, **kwargs):
        # a module with DistTensor parameters (wb.parallelize: DDP beside tensor
        # parallelism) gets the DistTensor mode, :class:`.ddp_dist.DistTensorDDP`
        if cls is DistributedDataParallel:
            from .ddp_dist import DistTensorDDP, has_dist_parameters
            if has_dist_parameters(module):
                cls = DistTensorDDP
        return super().__new__(cls)

    def __init__(self, module: nn.Module, mesh=None, dim="dp", bucket_bytes: int | None = None,
                 broadcast_from: int = 0, broadcast_buffers: bool | None = True, **torch_kwargs):
        super().__init__()
        check_module(module, "DistributedDataParallel")
        check_broadcast_buffers(broadcast_buffers)
        # torch DDP's own arguments (find_unused_parameters, bucket_cap_mb...): .torch_kwargs
        ddp_torch_kwargs(torch_kwargs, bucket_bytes)
        check_not_meta(module, "DistributedDataParallel")
        if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or
                                         not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
            raise ValueError(f"bucket_bytes={bucket_bytes!r}: give a positive number of bytes "
                             "(fixed buckets; 1: one all-reduce per parameter) or None for "
                             "torch DDP's buckets (bucket_cap_mb, 25 MiB by default)")
        self._find_unused = bool(torch_kwargs.get("find_unused_parameters", False))
        self._static = bool(torch_kwargs.get("static_graph", False))
        self._as_view = bool(torch_kwargs.get("gradient_as_bucket_view", False))
        policy = fixed_policy(bucket_bytes) if bucket_bytes is not None else torch_policy(
            torch_kwargs.get("bucket_cap_mb"), self._find_unused, self._static)
        g = RankGroup(mesh, dim, "DistributedDataParallel")
        check_sync_batchnorm_device(g, module, "DistributedDataParallel")
        # a user's gradient hooks on the parameters it replaces (.laid_out_hooks)
        check_hooks(module, "DistributedDataParallel", g.distributed, keeps=g.distributed)
        if isinstance(broadcast_from, bool) or not isinstance(broadcast_from, int) or \
                not 0 <= broadcast_from < g.n:
            raise ValueError(f"broadcast_from={broadcast_from!r}: give a rank index in "
                             f"[0, {g.n - 1}] of the data-parallel group")
        object.__setattr__(self, "module", module)    # not a submodule: names keep no prefix
        self.group, self.broadcast_from = g, broadcast_from
        self._sync_enabled = True
        self._sync_buffers_next = True      # torch DDP's require_forward_param_sync
        self._broadcast_state()
        params = list(module.parameters())
        trainable = [p for p in params if p.requires_grad]
        with torch._C.DisableTorchFunctionSubclass():    # the storage's rows (laid_out_views)
            sizes = [(p[0] if not g.distributed else p).numel() * p.element_size()
                     for p in trainable]
        self._book = BucketBook(trainable, sizes, policy)
        self._unused = []                   # find_unused_parameters: unreached by the forward
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trainable]
        self._synced = set()                # simulated: ids of parameters whose rows are averaged
        if not g.distributed:
            self._hooks += [p.register_hook(lambda grad, p=p: self._before_grad(p))
                            for p in trainable]
        self._reset()
        self._places = snapshot(module)     # a tie after wrapping: raise (.replaced_params)
        module._wb_wrapped = "DistributedDataParallel"

    # ---- construction ----------------------------------------------------------------------
    @torch.no_grad()
    def _broadcast_state(self):
        g, m = self.group, self.module
        tensors = list(m.parameters()) + list(m.buffers())
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        g.record("broadcast", nbytes, "ddp broadcast")
        if g.distributed:
            for t in tensors:
                dist.broadcast(t.data, src=g.global_rank(self.broadcast_from), group=g.pg)
            return
        bf = self.broadcast_from
        for p in list(m.parameters()):         # one row per simulated rank (real storage)
            shape = tuple(p.shape)
            rows = laid_out(p.detach().unsqueeze(0).repeat((g.n,) + (1,) * p.dim()),
                            p.requires_grad, f"on {g.n} simulated ranks it holds one row per "
                            f"rank (shape {(g.n,) + shape})", shape, Rows(g.n, bf))
            rows._wb_rows = g.n             # one copy per rank: ZeroRedundancyOptimizer reads it
            step_clock.hold([rows], g.ranks, 1)     # an optimizer's step: on their clock
            rows._wb_src = bf               # the row the state dicts give (.replica_writes)
            replace_parameter(m, p, rows)
            mark_successor(p, rows)         # an optimizer built before: follows (.replaced_params)
        module_shaped_state_dict(m)            # m.state_dict(): rank bf's row, as torch DDP's
        sync_rows(m.named_parameters())        # the rows' value now: a later write is seen

    @torch.no_grad()
    def _sync_buffers(self):
        """torch.distributed: every buffer from rank ``broadcast_from`` (torch DDP's
        ``_sync_buffers`` before a forward, ``distributed.py``).  Not recorded in the
        trace, as the simulated ranks' copy of rank ``broadcast_from``'s buffers is not."""
        g = self.group
        for b in self.module.buffers():
            dist.broadcast(b, src=g.global_rank(self.broadcast_from), group=g.pg)

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        check_named(self.module, self._places, "DistributedDataParallel")
        if torch.is_grad_enabled():
            self._rebuild_buckets()
        out = self._forward(*args, **kwargs)
        if self._find_unused and not self._static and torch.is_grad_enabled():
            # torch's search_unused_parameters: what the outputs' graph does not reach
            reached = reachable_leaves(output_tensors(out))
            self._unused = [p for p in self._book.params if id(p) not in reached]
        return out

    def _forward(self, *args, **kwargs):
        g = self.group
        if g.distributed:
            # torch DDP's buffer sync (broadcast_buffers=True): before a forward that
            # follows one run with grad enabled outside no_sync (and before the first),
            # every process takes rank broadcast_from's buffers (BatchNorm's running
            # statistics); without it a process's running statistics would be its own
            # shards' alone, and its eval() output not torch DDP's
            if self._sync_buffers_next:
                self._sync_buffers()
            out = self.module(*args, **kwargs)
            self._sync_buffers_next = torch.is_grad_enabled() and self._sync_enabled
            return out
        close_open_scopes()     # a backward that raised in a recompute: stacked ones back
        plain_forward()         # its version errors' hint (versions.explained)
        named = dict(self.module.named_parameters())
        sync_rows(named.items())            # a write through one row's handle: every row
        # rank k's row of each parameter: the module's tensor on that rank (its forward's
        # reductions of it are one device's, laid_out_views)
        params = [{n: rank_row(p, k) for n, p in named.items()} for k in range(g.n)]
        if torch.is_grad_enabled():     # p.data = t before backward: these too (laid_out_draws)
            for n, p in named.items():
                p._wb_row_views = [weakref.ref(ps[n]) for ps in params]
        out = run_per_rank(g, self.module, params, args, kwargs, self.broadcast_from)
        book = self._book
        if book.recording and torch.is_grad_enabled():
            # the order torch's reducer would record: from rank 0's graph (.ddp_buckets)
            name = {id(p): n for n, p in named.items()}
            views = [params[0][name[id(p)]] for p in book.params]
            book.set_order(ready_order(output_tensors(out), views))
        return out

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Debug: raise if any parameter differs between the ranks' replicas (on
        torch.distributed: an all-reduce of its max and of its min per parameter)."""
        g = self.group
        if not g.distributed:               # a write through a state-dict row: every row
            sync_rows(self.module.named_parameters())
        for name, p in self.module.named_parameters():
            if g.distributed:
                # NaN where every rank holds NaN is the same value; NaN on some ranks only
                # is not (gloo's MAX / MIN dropped a NaN, so a copy that turned NaN on one
                # rank passed, and equal NaN copies failed torch.equal: sweep18): the NaN
                # positions compared apart, the values with NaN read as 0
                nan = p.detach().isnan()
                hi = torch.where(nan, 0, p.detach()).to(p.dtype)
                lo = hi.clone()
                hn, ln = nan.to(torch.uint8), nan.to(torch.uint8)
                for t, op in ((hi, "max"), (lo, "min"), (hn, "max"), (ln, "min")):
                    _B.all_reduce_(t, op, g.pg)
                same = torch.equal(hi, lo) and torch.equal(hn, ln)
            else:
                same = bool(((p == p[:1]) | p.isnan() & p[:1].isnan()).all())
            if not same:
                raise RuntimeError(f"DistributedDataParallel: the replicas of {name!r} differ "
                                   "between ranks; did something update one rank's copy "
                                   "outside the optimizer step?")

    # ---- torch DDP's names: the module is its child "module" ---------------------------------
    # torch DDP registers the module as its child, so named_parameters(), named_buffers(),
    # named_modules() and state_dict() all carry "module."; these gave the module's own
    # names (state_dict() alone had the prefix), so a name from ddp.named_parameters()
    # was not a key of ddp.state_dict() nor of torch DDP's named_parameters()
    @staticmethod
    def _child_prefix(prefix: str) -> str:
        return prefix + ("." if prefix else "") + "module"

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """(``"module." +`` the module's own name, parameter), as torch DDP's."""
        close_open_scopes()     # after a backward that raised in a recompute
        if not recurse:         # torch DDP holds no parameter of its own
            return iter(())
        return self.module.named_parameters(self._child_prefix(prefix), True,
                                            remove_duplicate)

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        if not recurse:
            return iter(())
        return self.module.named_buffers(self._child_prefix(prefix), True, remove_duplicate)

    def named_children(self):
        yield "module", self.module

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        """The wrapper (``prefix``), then the module's tree under ``"module"``: torch's."""
        if memo is None:
            memo = set()
        if self in memo and remove_duplicate:
            return
        if remove_duplicate:
            memo.add(self)
        yield prefix, self
        yield from self.module.named_modules(memo, self._child_prefix(prefix),
                                             remove_duplicate)

    def get_submodule(self, target: str = ""):
        """By ``named_modules()``'s names (``"module.fc"``), as torch's."""
        return nn.Module.get_submodule(self, target)

    def requires_grad_(self, requires_grad: bool = True):
        hooked = self._book.index
        late = [n for n, p in self.module.named_parameters() if id(p) not in hooked]
        if requires_grad and late:
            raise ValueError(f"DistributedDataParallel.requires_grad_(True): {late[:3]} were "
                             "frozen when the wrapper was built, so their gradients would "
                             "not be averaged; set requires_grad before wrapping the module")
        return super().requires_grad_(requires_grad)

    # ---- state dicts: torch DDP's keys ("module." + the module's own name) ------------------
    def state_dict(self, destination=None, prefix="", keep_vars=False):
        """{``prefix + "module." +`` the module's own name: tensor}, as torch DDP (whose
        module is its child); each tensor the one a rank holds (on simulated ranks, rank
        ``broadcast_from``'s row, a view).  ``keep_vars=True`` gives each parameter itself,
        the object ``parameters()`` gives (torch's ``nn.Module.state_dict``; on simulated
        ranks it holds every rank's row: ``(N, *shape)``), buffers as they are."""
        out = {} if destination is None else destination
        rows = not self.group.distributed
        for name, t in self.module.state_dict(keep_vars=True).items():
            if rows and isinstance(t, nn.Parameter) and not keep_vars:
                with torch._C.DisableTorchFunctionSubclass():   # a plain view, as torch's
                    p, t = t, t[self.broadcast_from].detach()       # (not laid_out's guarded one)
                # one replica's row: a load in place (wb.checkpoint.load) writes every row
                out[prefix + "module." + name] = mark(t, lambda v, p=p: p.copy_(v.clone()))
                continue
            # (a module's get_extra_state() may be any object: as it is, as torch's)
            out[prefix + "module." + name] = t if keep_vars or not isinstance(
                t, torch.Tensor) else t.detach()
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load ``state_dict()``'s keys (``module.`` + the module's own names): full
        tensors, copied into every rank's copy.  Keys and shapes are checked first, as
        torch does with ``strict`` (nothing is copied when they do not match).  A state
        dict of the plain module (no ``module.`` prefix) loads with
        ``ddp.module``'s names: ``ddp.load_state_dict({"module." + k: v ...})``."""
        if assign:
            raise NotImplementedError("DistributedDataParallel.load_state_dict(assign=True): "
                                      "the parameters are hooked and bucketed; load with "
                                      "assign=False (copies into them)")
        mine = self.state_dict()        # the module's shapes (keep_vars=True: the rows)
        # a keep_vars=True dict (the parameters themselves, every rank's row): their
        # module-shaped values, as torch loads its keep_vars dict
        state_dict = {k: module_shaped(v) for k, v in state_dict.items()}
        missing, unexpected = state_dict_check("DistributedDataParallel", mine, state_dict,
                                               strict)
        own = dict(self.module.state_dict(keep_vars=True))
        extra = {}
        for key, v in state_dict.items():
            if key in mine:
                if not isinstance(own[key[len("module."):]], torch.Tensor):
                    extra[key[len("module."):]] = v     # set_extra_state's, as torch's
                    continue
                if isinstance(v, DistTensor):   # e.g. FSDP's Shard(0) state dict: gathered
                    v = v.full()
                own[key[len("module."):]].copy_(torch.as_tensor(v).detach().clone())
        set_extra_states(self.module, extra)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """{the module's own name: the full tensor} (rank ``broadcast_from``'s copy)."""
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            rows = isinstance(t, nn.Parameter) and not self.group.distributed
            if not isinstance(t, torch.Tensor):     # a module's extra state
                out[name] = t
                continue
            out[name] = (t[self.broadcast_from] if rows else t).detach().clone()
        return out

    def extra_repr(self) -> str:
        g = self.group
        where = "torch.distributed" if g.distributed else f"{g.n} simulated ranks"
        return f"{type(self.module).__name__}, {where}, {len(self._book.buckets)} buckets"
