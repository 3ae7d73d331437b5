"""The data-parallel group a wrapper runs on: simulated ranks or torch.distributed.

:class:`RankGroup` hides which of the two executors runs the data-parallel
wrappers (:mod:`.ddp`, :mod:`.fsdp`, :mod:`.zero_optimizer`):

* ``mesh=None``: the default torch.distributed process group (one rank per
  process, plain local tensors), as ``torch.nn.parallel.DistributedDataParallel``;
* a mesh built by ``wb.distributed.mesh``: the process group of this process
  along ``dim``;
* a simulated :class:`~workbench.Mesh`: the ranks along ``dim`` live in this
  process.  A wrapped parameter then holds one row per rank (a leading axis of
  size N: each rank's copy, or each rank's shard), so any elementwise
  ``torch.optim`` optimizer steps every rank's copy exactly as that rank would.
  The module's own forward runs once per rank on the rank's rows
  (``torch.func.functional_call``): the same arithmetic as each process of a
  torchrun job, so simulated and real runs agree bitwise.

Collectives are recorded in the current trace (:func:`workbench.trace`) on the
groups along ``dim``; the math of the simulated ones is a reduction over the
leading rank axis.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from ...sim_mesh import backends as _B
from ...sim_mesh import collectives as C
from ...sim_mesh.mesh import Mesh
from ...sim_mesh.trace import current_trace
from ...ops.moe import loss_share, one_batch
from ..dist_tensor import DistTensor
from ..placement import Partial, Replicate, Shard
from .rank_hooks import as_rank
from .rank_recompute import (RankScope, checkpoint_nodes, close_open_scopes, hook_nodes,
                             outer_checkpoint, reentrant_error, refuse_outer_reentrant,
                             seq_mark)

__all__ = ["RankGroup"]


class RankGroup:
    """N data-parallel ranks: simulated (``distributed`` False) or processes."""

    def __init__(self, mesh, dim="dp", who: str = "wrapper"):
        self.mesh = mesh
        if mesh is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"{who}(mesh=None) uses the default torch.distributed process group, "
                    "but torch.distributed is not initialized: call wb.distributed.init() "
                    "under torchrun, or pass a simulated mesh, e.g. "
                    "mesh=wb.Mesh.grid(2, ['dp'])")
            self.distributed, self.axis, self.pg = True, None, None
            self.n, self.k = dist.get_world_size(), dist.get_rank()
            self.ranks = tuple(range(self.n))
            return
        if not isinstance(mesh, Mesh):
            raise TypeError(f"{who}(mesh={mesh!r}): expected None (torch.distributed's "
                            "default group) or a workbench Mesh")
        self.axis = mesh.dim(dim)
        self.distributed = _B.is_distributed(mesh)
        if self.distributed:
            self.pg, g = _B.group(mesh, self.axis)
            self.ranks, self.n, self.k = tuple(g), len(g), g.index(dist.get_rank())
        else:
            self.pg, self.k = None, None
            self.n = mesh.shape[self.axis]
            self.ranks = mesh.groups(self.axis)[0]

    # ---- torch.distributed ------------------------------------------------------------
    def global_rank(self, k: int) -> int:
        """The global rank of the group's k-th rank (what dist.broadcast's src wants)."""
        return self.ranks[k]

    # ---- the trace ------------------------------------------------------------------------
    def record(self, kind: str, nbytes: int, label: str, overlap: bool = False):
        """Record ``kind`` over the group(s) in the current trace; returns the handles."""
        if current_trace() is None:
            return []
        if self.mesh is None:
            return C.record_collective(kind, None, None, nbytes, label, groups=[self.ranks],
                                       overlap=overlap)
        groups = [self.ranks] if self.distributed else None
        return C.record_collective(kind, self.mesh, self.axis, nbytes, label, groups=groups,
                                   overlap=overlap)

    @staticmethod
    def wait(handles) -> None:
        tr = current_trace()
        if tr is not None:
            for h in handles:
                tr.wait(h)

    # ---- simulated ranks: inputs in, outputs out --------------------------------------------
    def split(self, args, kwargs):
        """Per-rank (args, kwargs) from DistTensor inputs (each rank's local shard) and
        plain values (the same on every rank); also the batch dim the inputs shard."""
        dims = set()

        def per_rank(x, k):
            if not isinstance(x, DistTensor):
                return x
            if x.mesh != self.mesh:
                raise ValueError(f"an input lives on {x.mesh}; the wrapper runs on {self.mesh}")
            idx = []
            for a, p in enumerate(x.placements):
                if a == self.axis:
                    if p.is_partial():
                        raise ValueError(f"an input is {p} on the data-parallel dim; give "
                                         "inputs sharded (Shard) or replicated there")
                    if p.is_shard():
                        dims.add(p.dim)
                    n = x._local.lead[a] if not x.is_even else x._local.shape[a]
                    idx.append(k if n > 1 else 0)
                else:
                    if not p.is_replicate():
                        raise ValueError(f"an input is {p} on mesh dim "
                                         f"{self.mesh.dim_names[a]!r}: the data-parallel "
                                         "wrappers shard inputs on their own dim only")
                    idx.append(0)
            return x._local[tuple(idx)]

        out = [pytree.tree_map(lambda x, k=k: per_rank(x, k), (args, kwargs))
               for k in range(self.n)]
        if len(dims) > 1:
            raise ValueError(f"inputs are sharded on different dims {sorted(dims)}")
        return out, (dims.pop() if dims else None)

    def join(self, outs, dim):
        """One DistTensor per output position from every rank's outputs: Shard(dim)
        on the data-parallel dim (a scalar per rank, e.g. a loss, is the mean of
        the ranks' values: Partial('avg')); Replicate when no input was sharded."""
        flat = [pytree.tree_flatten(o) for o in outs]
        spec = flat[0][1]
        leaves = []
        for i, first in enumerate(flat[0][0]):
            items = [f[0][i] for f in flat]
            leaves.append(self._join_one(items, dim) if isinstance(first, torch.Tensor)
                          else first)
        return pytree.tree_unflatten(leaves, spec)

    def _join_one(self, items, dim):
        nd, ax = self.mesh.ndim, self.axis
        shapes = {tuple(t.shape) for t in items}
        ps = [Replicate()] * nd
        shape = list(items[0].shape)
        if dim is not None and items[0].dim() > dim:
            ps[ax] = Shard(dim)
            shape[dim] = sum(t.shape[dim] for t in items)
        elif dim is not None:
            if len(shapes) > 1:
                raise ValueError("ranks returned outputs of different shapes")
            ps[ax] = Partial("avg")
        if len(shapes) > 1:
            lead = [1] * nd
            lead[ax] = self.n
            return DistTensor(C.Cells(lead, items), self.mesh, ps, shape, items[0].dtype)
        st = torch.stack(items)
        lead = [1] * nd
        lead[ax] = self.n
        return DistTensor(st.reshape(tuple(lead) + tuple(st.shape[1:])), self.mesh, ps, shape)


def check_module(module, who):
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{who}(module={type(module).__name__}): expected an nn.Module")
    if getattr(module, "_wb_wrapped", None):
        raise ValueError(f"{who}: this module is already wrapped by {module._wb_wrapped}; "
                         "wrap a fresh module")


def check_not_meta(module, who) -> None:
    """A plain module on the meta device (shapes, no values) refused: the wrapper copies
    its values into rows or shards at construction, and ``to_empty`` afterwards would
    swap in new parameters the wrapper does not hold (FSDP2's meta-device init, where
    ``fully_shard`` comes before ``to_empty``, is not built here)."""
    meta = [n for n, p in module.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ValueError(f"{who}: the module's parameters {meta[:3]} are on the meta device "
                         "(shapes, no values); build it on a real device (or "
                         "module.to_empty(device='cpu') and initialize or load it) before "
                         "wrapping")


def replace_parameter(module, old, new) -> None:
    """Put ``new`` wherever ``module`` (or a submodule) holds ``old`` (tied weights too)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is old:
                sub._parameters[name] = new


def run_per_rank(group, module, params, args, kwargs, owner: int = 0):
    """Run ``module`` once per simulated rank with ``params[k]`` (name -> tensor) and
    that rank's inputs; join the outputs into DistTensors.  Only rank ``owner``'s
    forward writes the module's buffers (:func:`rank_buffers`)."""
    check_batch_stats(group, module, "DistributedDataParallel", local_ok=True)
    refuse_outer_reentrant("DistributedDataParallel", args, kwargs)
    close_open_scopes()         # a backward that raised inside a recompute: parameters back
    per, dim = group.split(args, kwargs)
    outs, snap = [], buffer_snapshot(module)
    outer = outer_checkpoint()  # checkpoint(wrapper, ...): its rerun is the whole wrapper's
    stacked = dict(module.named_parameters())
    places = [(m, n, p) for m in module.modules() for n, p in m._parameters.items()]
    with one_batch():           # a MoE's last_stats: every rank's part (ops/moe.py)
        for k, (a, kw) in enumerate(per):
            # the join averages the ranks' losses: a loss term attached by gradient takes
            # each rank's share too (ops/moe.py: loss_share)
            since = seq_mark() + 1
            with rank_buffers(module, snap if k != owner else None), \
                    loss_share(1 / group.n), as_rank(module, k):    # a hook's rank (rank_hooks)
                bufs = [(m, n, b) for m in module.modules() for n, b in m._buffers.items()
                        if b is not None] if k != owner else []
                try:
                    outs.append(torch.func.functional_call(module, params[k], a, kw,
                                                           tie_weights=True, strict=False))
                finally:
                    _restore_places(places)
            # a checkpoint's recompute in backward: with this rank's parameters
            # (rank_recompute.py)
            reentrant, plain = checkpoint_nodes(pytree.tree_leaves(outs[-1]), since, outer)
            if reentrant:
                raise reentrant_error("DistributedDataParallel", group.n)
            if reentrant or plain:
                rows = {id(p): params[k][n] for n, p in stacked.items() if n in params[k]}
                hook_nodes(reentrant + plain,      # the recompute's hooks: this rank's too
                           RankScope(module, rows, bufs,
                                     lambda k=k: _share_as_rank(module, group.n, k)))
    return group.join(outs, dim)


@contextlib.contextmanager
def _share_as_rank(module, n: int, k: int):
    """Rank ``k``'s loss share and hook rank (:mod:`.rank_hooks`), for its recompute."""
    with loss_share(1 / n), as_rank(module, k):
        yield


def _restore_places(places) -> None:
    """Every ``(module, name, parameter)`` of ``places`` back as it was.  torch's
    ``functional_call`` leaves a module reached under two names (``nn.Sequential(l, act,
    l)``: ``0.weight`` and ``2.weight`` name one attribute) holding the tensor swapped in:
    it swaps that attribute twice, saving the first swap's tensor as the second's
    original, and restores in the same order (torch 2.13 ``torch/nn/utils/
    stateless.py`` ``_reparametrize_module``; measured: ``l.weight`` is the passed tensor
    afterwards).  DDP then read rank N-1's row as the module's parameter and its next
    forward raised "assigned after wrapping" (habits9b)."""
    for m, n, p in places:
        if m._parameters.get(n) is not p:
            m._parameters[n] = p


def check_batch_stats(group, module, who: str, local_ok: bool = False) -> None:
    """Simulated ranks (N > 1): refuse a BatchNorm that normalizes by the batch's
    statistics (training mode, or no running statistics).  Each rank would normalize its
    own rows by their own mean and variance (torch DDP's behaviour without SyncBatchNorm),
    which is not one device's answer over the global batch.  ``local_ok`` (DDP): a plain
    BatchNorm passes, as torch DDP runs it (each rank its own batch's statistics, buffers
    from the broadcast rank before each forward, :func:`rank_buffers`); nn.SyncBatchNorm
    (global statistics over a process group) still raises on simulated ranks."""
    if group.distributed or group.n == 1:
        return
    for name, m in module.named_modules():
        if local_ok and not isinstance(m, nn.SyncBatchNorm):
            continue
        if isinstance(m, nn.SyncBatchNorm) and (m.training or m.running_mean is None):
            raise NotImplementedError(
                f"{who} on {group.n} simulated ranks: {name or 'the module'} (SyncBatchNorm) "
                "takes its statistics over every rank's rows, which the simulated wrappers do "
                "not build; run the module itself on a batch sharded as a DistTensor "
                "(wb.shard_tensor(x, mesh, [wb.Shard(0)])), whose batch_norm all-reduces the "
                "global statistics as SyncBatchNorm does, or use it under torchrun on GPU or "
                "NPU processes (torch's SyncBatchNorm refuses CPU tensors), or put it in eval "
                "mode (m.eval(): running statistics)")
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and \
                (m.training or m.running_mean is None):
            raise NotImplementedError(
                f"{who} on {group.n} simulated ranks: {name or 'the module'} "
                f"({type(m).__name__}) normalizes by batch statistics, which each rank would "
                "take over its own rows only (torch DDP without SyncBatchNorm), not one "
                "device's global batch; put the BatchNorm layers in eval mode "
                "(m.eval(): running statistics), use a per-sample norm (nn.LayerNorm, "
                "nn.GroupNorm), or run on one rank; or run the module itself on a batch "
                "sharded as a DistTensor (wb.shard_tensor(x, mesh, [wb.Shard(0)])), whose "
                "batch_norm all-reduces the global statistics as SyncBatchNorm does")


def check_sync_batchnorm_device(group, module, who: str) -> None:
    """torch.distributed: a module holding ``nn.SyncBatchNorm`` on CPU refused when
    wrapped, as torch DDP refuses it (``SyncBatchNorm layers only work with GPU
    modules``), naming what does work on CPU; without this the first training forward
    would fail inside torch's SyncBatchNorm."""
    if not group.distributed:
        return
    for name, m in module.named_modules():
        if isinstance(m, nn.SyncBatchNorm) and any(
                t.device.type == "cpu" for t in list(m.parameters()) + list(m.buffers())):
            raise ValueError(
                f"{who}: {name or 'the module'} is an nn.SyncBatchNorm on CPU; torch's "
                "SyncBatchNorm only works with GPU (or NPU) tensors, and torch DDP refuses it "
                "on CPU.  On CPU processes use nn.BatchNorm (each process its own shard's "
                "statistics, as torch DDP without SyncBatchNorm), or run the module itself "
                "on a batch sharded as a DistTensor (wb.shard_tensor(x, mesh, "
                "[wb.Shard(0)]), mesh = wb.distributed.mesh(n, ['dp'])), whose batch_norm "
                "all-reduces the global statistics as SyncBatchNorm does")


def buffer_snapshot(module) -> dict:
    """{id(buffer): a copy} of the module's buffers before a step's forwards."""
    return {id(b): b.detach().clone() for m in module.modules()
            for b in m._buffers.values() if b is not None}


@contextlib.contextmanager
def rank_buffers(module, snapshot: dict | None):
    """With a ``snapshot`` (:func:`buffer_snapshot`): the module's buffers replaced for
    the block by fresh copies of their values before the step, so every rank starts from
    the same buffers and only the rank run without one writes the module's (running
    statistics, counters): they change once a step, as torch DDP keeps rank 0's (it
    broadcasts them before each forward, ``broadcast_buffers=True``) and as one device
    changes them once."""
    if snapshot is None:
        yield
        return
    held, made = [], {}
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and id(b) in snapshot:
                held.append((m, name, b))
                m._buffers[name] = made.setdefault(id(b), snapshot[id(b)].clone())
    try:
        yield
    finally:
        for m, name, b in held:
            m._buffers[name] = b


def _ddp_class():
    from .ddp import DistributedDataParallel
    return DistributedDataParallel


class ModuleWrapper(torch.nn.Module):
    """What the data-parallel wrappers share: they keep the wrapped ``module`` and
    answer with its own names (no ``module.`` prefix, as torch FSDP1's
    ``named_parameters``; ``DistributedDataParallel`` overrides them with torch DDP's
    ``module.`` names), so any ``torch.optim`` optimizer built on ``wrapper.parameters()``
    steps the module's parameters."""

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        close_open_scopes()     # after a backward that raised in a recompute: the stacked
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def parameters(self, recurse=True):
        close_open_scopes()
        return self.module.parameters(recurse)

    # the module's own tree under its own names, as named_parameters: ``model.modules()``,
    # ``model.apply(init_fn)`` and ``model.buffers()`` reach the wrapped module's (the
    # wrapper holds the module outside ``_modules``, so torch's would see nothing)
    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        return self.module.named_modules(memo, prefix, remove_duplicate)

    def named_children(self):
        return self.module.named_children()

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def __getattr__(self, name):
        # as torch DDP, the wrapper has no attribute of the module's (``ddp.module.fc``);
        # but its names are the module's, so torch.distributed.checkpoint.state_dict's
        # helpers look them up here and failed with a bare AttributeError: say why
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("module")
            if module is None or name.startswith("_") or not hasattr(module, name):
                raise
            cls = type(self).__name__
            if isinstance(self, _ddp_class()):      # torch DDP's names ("module.<name>")
                raise AttributeError(
                    f"'{cls}' object has no attribute {name!r}: the wrapped module's is "
                    f"{cls}.module.{name}, as torch DDP's") from None
            raise AttributeError(
                f"'{cls}' object has no attribute {name!r}: the wrapped module's is "
                f"{cls}.module.{name}; named_parameters() gives the module's own names, so "
                "torch.distributed.checkpoint.state_dict's helpers and torch.func."
                "functional_call (which look those names up on the wrapper) do not know this "
                "wrapper: use wb.checkpoint.get_model_state_dict / get_optimizer_state_dict / "
                "get_state_dict / set_model_state_dict / set_optimizer_state_dict / "
                "set_state_dict (torch's signatures), and functional_call on the plain module"
                ) from None

    def get_submodule(self, target: str = ""):
        """By the names ``named_modules`` gives (``get_parameter`` / ``get_buffer`` too)."""
        return self.module.get_submodule(target)

    def apply(self, fn):
        """``fn`` on every submodule of the wrapped module, then on the wrapper (torch's
        order)."""
        self.module.apply(fn)
        fn(self)
        return self

    def train(self, mode: bool = True):
        self.module.train(mode)
        return super().train(mode)

    def __deepcopy__(self, memo):
        raise NotImplementedError(
            f"copy.deepcopy of a {type(self).__name__}: its gradient hooks, buckets and "
            "shards are keyed to this wrapper's parameters, so the copy would not train as "
            "one device; deepcopy the module before wrapping it and wrap the copy, or give "
            "a plain copy the weights: plain.load_state_dict(wrapper.full_state_dict())")

    def _apply(self, fn, recurse=True):
        """``.to(dtype)``, ``.double()``, ``.half()``...: the module's parameters (its
        rows or shards) converted in place, as torch converts a module's (the same
        ``nn.Parameter`` objects, so optimizers and hooks still hold them)."""
        self.module._apply(fn, recurse)
        return super()._apply(fn, recurse=False)    # children() is the module's: done


def state_dict_check(owner, mine: dict, given, strict: bool):
    """(missing, unexpected) keys of ``given`` against the wrapper's ``mine`` (key ->
    tensor); raises torch's ``load_state_dict`` error first when ``strict`` and a key
    differs, or when a shape does (before anything is copied)."""
    from ..module_state import check_state_dict
    # a module's get_extra_state() (any object, no shape) under "..._extra_state"
    check_state_dict(owner, {k: tuple(v.shape) if isinstance(v, torch.Tensor) or
                             hasattr(v, "placements") else None for k, v in mine.items()},
                     given, strict)
    return [k for k in mine if k not in given], [k for k in given.keys() if k not in mine]


def set_extra_states(module: nn.Module, extra: dict) -> None:
    """``{"<submodule>._extra_state": value}``: each submodule's ``set_extra_state(value)``,
    as torch's ``load_state_dict`` calls it."""
    suffix = nn.modules.module._EXTRA_STATE_KEY_SUFFIX
    for key, v in extra.items():
        module.get_submodule(key[:-len(suffix)].rstrip(".")).set_extra_state(v)


def bucket_order(sizes, bucket_bytes) -> list[list[int]]:
    """Indices of tensors of ``sizes`` bytes grouped into buckets, in reverse order (the
    order backward produces gradients), each bucket closed once it holds at least
    ``bucket_bytes``; ``bucket_bytes=None``: one tensor a bucket.  The fixed buckets of
    ``DataParallel`` and of DDP's DistTensor mode with ``bucket_bytes`` (one dtype); torch
    DDP's own rules, per dtype, are :mod:`.ddp_buckets`."""
    order = list(range(len(sizes)))[::-1]
    if bucket_bytes is None:
        return [[i] for i in order]
    out, cur, size = [], [], 0
    for i in order:
        cur.append(i)
        size += sizes[i]
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out

