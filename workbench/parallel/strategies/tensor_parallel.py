"""Megatron-LM's f and g: the two conjugate operators around a tensor-parallel region.

Shoeybi et al. 2019 (Megatron-LM), sec. 3: a column-parallel linear followed by a
row-parallel one needs one operator before the region and one after it:

* ``f``: every tp rank gets its copy of the input; forward moves nothing, backward
  all-reduces the input gradient over tp.  Under sequence parallelism (Korthikanti
  et al. 2022) the input arrives sharded on the sequence dim, so f all-gathers it
  (and backward reduce-scatters);
* ``g``: the row-parallel partial sums are reduced: an all-reduce over tp (backward:
  identity).  Under sequence parallelism a reduce-scatter onto the sequence dim
  (backward: all-gather).

Under sequence parallelism the linears reading f's gathered copy keep its sequence SHARD
for their weight gradient and all-gather it again in backward, beside the first input-
gradient GEMM (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``;
Korthikanti et al. sec. 4.2.2 count those inputs at 2 sbh / t): ``ops_table.linear_regather``.
``regather=False`` keeps the gathered copy instead, as PyTorch's DTensor does.

:func:`tensor_parallel_region` registers both on a module as forward hooks, so the
module's own forward is untouched.  This is the one copy used by the hybrid recipe
and the torchrun activation check.

f's backward all-reduce (sequence parallel: reduce-scatter) is asynchronous on the
simulated clock, as Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``
issues it (``async_op=True`` on the input gradient, then the weight-gradient GEMM, then
the wait): the region's first linear records its backward as dgrad then wgrad
(``ops_table.pricing``), and the collective starts on the tp group's comm stream when
the dgrad ended, beside the wgrad; the compute stream waits for it after the wgrad.
Hidden: min(collective, wgrad) when that stream is free (the data-parallel group's
gradient reduce-scatters run on their own stream, ``sim_mesh.trace``; issued after this
one, as Megatron-LM issues them).  Anything else recorded between
them on the ranks' compute streams, or uneven shards, leave it blocking.  On
torch.distributed the all-reduce runs blocking (the executor's), but the clock records
it as here (:func:`_expand_dist_async`; sp: :func:`_gather_dist_async` and the
re-gather), so that both executors report the same step.  Under sp both run
Megatron-LM's program for the norms too: :func:`sequence_parallel_norms` keeps each
norm's gradient partial per tp rank and the optimizer sums it once per step (on
torch.distributed it had been all-reduced in backward, every micro-batch: tiny dp 2 x tp 2
sp read 0.2571 ms for the simulator's 0.2389; the same 0.2389 now, task sptorchrun).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function

from ...sim_mesh import backends as _B
from ...sim_mesh import collectives as C
from ...sim_mesh import cost as _cost
from ...sim_mesh.backward_pass import in_weight_pass
from ...sim_mesh.grid import Stacked, ops_for
from ...sim_mesh.trace import current_trace, suspend
from ..dist_tensor import DistTensor
from ..ops_table import linear_regather as _regather
from .. import dist_uneven as _uneven
from ..layout import is_even as _is_even
from ..placement import Replicate, Shard
from ..reshard import reshard
from ..storage import own_coord

__all__ = ["megatron_f", "megatron_g", "tensor_parallel_region", "sequence_parallel_norms",
           "sequence_parallel_params"]


def megatron_f(x: DistTensor, tp_axis: int, sp: bool = False, seq_dim: int = 1,
               regather: bool = True, *, origin: str = "megatron_f") -> DistTensor:
    """Enter a tp region: each tp rank its own copy of ``x`` (sp: the whole sequence).

    Under sp the linears reading the gathered copy keep ``x``'s sequence shard for their
    weight gradient and all-gather it again in backward, as Megatron-LM does
    (``ops_table.linear_regather``); ``regather=False`` keeps the gathered copy instead
    (2 s b h per rank where the shard is 2 s b h / t; no all-gather in backward).
    ``origin``: the entry point whose ``regather`` argument the uneven-shard error tells
    the user to set (``tensor_parallel_region``, ``Hybrid``... name themselves).

    ``x`` is first brought to the layout f starts from on tp: Replicate, or Shard(seq_dim)
    under sp. Any other (a Partial, or a shard the op table's cost chose, e.g. the
    reduce-scatter onto the batch dim that a norm on a Partial input may pick) is
    resharded there, never relabelled: relabelling a shard Replicate would leave each
    rank a slice of the tensor under a whole-tensor layout.

    To ``wb.compile``'s capture (a plain meta tensor under its tracer) f is one op of the
    table, ``megatron_f`` (``ops_table/megatron.py``: its layout on tp as its rule); the
    compiled program calls this function on the DistTensor laid out so."""
    if not isinstance(x, DistTensor):
        return _plain(megatron_f, x, (x, tp_axis, sp, seq_dim, regather), {"origin": origin})
    want = Shard(seq_dim) if sp else Replicate()
    if x.placements[tp_axis] != want:
        ps = list(x.placements)
        ps[tp_axis] = want
        x = reshard(x, x.mesh, ps)
    mesh, loc = x.mesh, x._local
    shard = loc
    dist = _B.is_distributed(mesh)
    # uneven sequence shards: cells on the simulator, one process's own on torch.distributed
    uneven = sp and (not _is_even(x.shape, mesh, x.placements) if dist
                     else ops_for(loc) is not Stacked)
    if sp and regather and torch.is_grad_enabled() and uneven:
        raise _uneven_regather(x, tp_axis, seq_dim, origin)   # (both executors: uneven18)
    if dist and uneven:
        # the padded collectives with the layout's sizes, recorded as the simulator's cells
        # (its busiest rank's bytes, grid.gather_sent; the backward reduce-scatter too):
        # before (uneven18) _gather_dist_async's even all-gather of unequal pieces, gloo's
        # "Received data size doesn't match expected size" abort (5 rows on 3 processes)
        loc = C.all_gather(loc, mesh, tp_axis, seq_dim, expanded=True, label="f: all-gather",
                           **_uneven.step_kwargs("all_gather", x.shape, x.dtype, mesh,
                                                 x.placements, _ps_replicated(x, tp_axis),
                                                 tp_axis, own_coord(mesh)))
    elif dist or ops_for(loc) is not Stacked:                    # blocking
        if sp and dist:                         # S(seq_dim) on tp -> the whole sequence
            loc = _gather_dist_async(loc, mesh, tp_axis, seq_dim, "f: all-gather")
            if regather:
                loc = _regathered(loc, shard, mesh, tp_axis, seq_dim, blocking=True)
        elif sp:
            loc = C.all_gather(loc, mesh, tp_axis, seq_dim, expanded=True,
                               label="f: all-gather")
        elif dist:
            loc = _expand_dist_async(loc, mesh, tp_axis, "f: grad all-reduce")
        else:
            loc = C.expand_replicas(loc, mesh, [tp_axis], label="f: grad all-reduce")
    elif sp:
        ax = mesh.dim(tp_axis)
        loc = C.all_gather(loc, mesh, ax, seq_dim, label="f: all-gather")
        loc = _expand_async(loc, mesh, ax, "reduce_scatter", "f: all-gather")
        if regather:
            loc = _regathered(loc, shard, mesh, ax, seq_dim, blocking=False)
    else:
        loc = _expand_async(loc, mesh, mesh.dim(tp_axis), "all_reduce", "f: grad all-reduce")
    ps = list(x.placements)
    ps[tp_axis] = Replicate()
    out = DistTensor(loc, mesh, ps, x.shape, x.dtype)
    out._ring_order = getattr(x, "_ring_order", None)     # x's values: its order (seq_order)
    return out


def _ps_replicated(x: DistTensor, tp_axis: int) -> tuple:
    """``x``'s placements with Replicate on ``tp_axis`` (f's output layout)."""
    ps = list(x.placements)
    ps[tp_axis] = Replicate()
    return tuple(ps)


def _uneven_regather(x, tp_axis: int, seq_dim: int, origin: str) -> ValueError:
    """The error for a re-gather over uneven shards: the simulator holds them as one
    tensor per rank (``Cells``), where the re-gathering linear (which keeps ONE shard per
    gathered input) has no place to keep them; it would keep the whole gathered input
    instead, silently undoing what ``regather=True`` asks for.  ``origin``: where the
    user sets ``regather`` (megatron_f's own argument, or the entry point that called it)."""
    from ...sim_mesh.grid import chunk_bounds
    mesh, uneven, fix = x.mesh, [], []
    for i, p in enumerate(x.placements):
        if p.is_shard():
            n, L = mesh.shape[i], x.shape[p.dim]
            sizes = [chunk_bounds(L, n, k)[1] for k in range(n)]
            if len(set(sizes)) > 1:
                uneven.append(f"dim {p.dim} ({L}) over {mesh.dim_names[i]}={n}: "
                              f"{', '.join(map(str, sizes))}")
                fix.append(f"dim {p.dim} a multiple of {n}")
    return ValueError(
        f"{origin}(sp=True, regather=True): the input {tuple(x.shape)} laid out "
        f"{[str(p) for p in x.placements]} on mesh {dict(zip(mesh.dim_names, mesh.shape))} "
        f"has uneven shards ({'; '.join(uneven)}), which the re-gather of the sequence "
        f"shard in backward does not support; make {' and '.join(fix) or 'the shards even'}"
        f", or pass regather=False to {origin} to keep the gathered input (2 s b h per "
        f"rank, no all-gather in backward)")


def _regathered(loc, shard, mesh, axis: int, seq_dim: int, blocking: bool):
    """``loc`` (the gathered copy of ``shard``) marked so that the linears reading it
    keep ``shard`` and gather it again in backward (``ops_table.linear_regather``)."""
    if not torch.is_grad_enabled():
        return loc
    if blocking:                          # torch.distributed: this process's group
        def rebuild(s):
            with suspend():
                return C.all_gather(s, mesh, axis, seq_dim, expanded=True)
        groups = [_B.group(mesh, axis)[1]]
        nb = loc.numel() * loc.element_size()
    else:                                 # stacked shards: the view f made, unrecorded
        F, n = ops_for(shard), mesh.shape[axis]

        def rebuild(s):
            return F.expand(F.all_gather(s, mesh.ndim, axis, seq_dim, n), axis, n)
        groups = mesh.groups(axis)
        nb = F.rank_bytes(loc, mesh.ndim)
    # the clock records the re-gather beside the dgrad on both executors (a gloo / nccl
    # call blocking is the executor's, not the modeled program's; task tdclock)
    rg = _regather.Regather(rebuild, groups, mesh.dim_names[axis], nb, "f: re-gather",
                            False)
    return _regather.mark(loc, shard, rg)


class _AsyncGradCollective(torch.autograd.Function):
    """Identity; its backward records the gradient's all-reduce (sp: reduce-scatter)
    over ``axis``, async beside the wgrad just recorded (module docstring)."""

    @staticmethod
    def forward(ctx, info, x):
        ctx.info = info
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if not (getattr(ctx, "recorded", False) and in_weight_pass()):   # (W: B's, again)
            ctx.recorded = True
            _record_grad_collective(*ctx.info)
        return None, g


def _record_grad_collective(kind: str, mesh, axis: int, nbytes: int, label: str,
                            groups=None) -> None:
    from ..ops_table.pricing import wgrad_overlap
    tr = current_trace()
    if tr is None:
        return
    waits = []                  # every group's collective issued, then waited for
    for g in (mesh.groups(axis) if groups is None else groups):
        if len(g) == 1:
            continue
        ready = wgrad_overlap(tr, g)
        h = tr.record_collective(
            g, kind, _cost.price(kind, nbytes, g, tr.profile),
            bytes=_cost.wire_bytes(kind, nbytes, len(g)), label=label,
            args={"mesh_dim": mesh.dim_names[axis], "buffer_bytes": int(nbytes),
                  "overlaps": "wgrad" if ready is not None else ""},
            overlap=ready is not None, ready=ready)
        if ready is not None:
            waits.append(h)
    for h in waits:
        tr.wait(h)


def _expand_async(x, mesh, axis: int, kind: str, label: str):
    """One copy of ``x`` (a stacked tensor) per rank along ``axis``, as
    ``collectives.expand_replicas`` (all_reduce) or the expanded ``all_gather``
    (reduce_scatter) give it, with the backward collective recorded by
    :class:`_AsyncGradCollective` (``kind`` of the tensor's bytes)."""
    F = ops_for(x)
    if F.lead(x, mesh.ndim)[axis] != 1:
        return x                          # one copy per rank already: nothing to expand
    nb = F.rank_bytes(x, mesh.ndim)
    x = F.expand(x, axis, mesh.shape[axis])
    if x.requires_grad and torch.is_grad_enabled():
        x = _AsyncGradCollective.apply((kind, mesh, axis, nb, label), x)
    return x


def _expand_dist_async(x, mesh, axis: int, label: str):
    """``collectives.expand_replicas`` on torch.distributed (this process's copy; the
    backward all-reduces the gradient over the process group, blocking), recorded on the
    clock as the simulator records f's (:func:`_expand_async`): async beside the wgrad
    just recorded.  How the gloo / nccl call blocks is this executor's, not the modeled
    program's (Megatron-LM's ``async_op=True``): recorded blocking, the clock of dense
    dp 2 x tp 2 read 0.1732 ms here for the simulator's 0.1687 (task tdclock).  Only this
    process's group is recorded, as every collective under torch.distributed is."""
    had = getattr(x, "_wb_replica_axes", ())
    if axis in had:
        return x                          # one copy per rank already (f, or data parallel)
    pg, g = _B.group(mesh, axis)
    nb = x.numel() * x.element_size()
    y = _B.ExpandReplicas.apply(x, pg)    # the real all-reduce in backward, unrecorded
    if y.requires_grad and torch.is_grad_enabled():
        y = _AsyncGradCollective.apply(("all_reduce", mesh, axis, nb, label, [g]), y)
    return _B.tag(y, had + (axis,))


def _gather_dist_async(x, mesh, axis: int, dim: int, label: str):
    """``collectives.all_gather(..., expanded=True)`` on torch.distributed (the backward
    reduce-scatters the gradient over the process group, blocking), its backward recorded
    as the simulator records f's under sp (:func:`_expand_async`): async beside the wgrad.
    Recorded blocking (with the re-gather), tiny dp 2 x tp 2 sp read 0.2661 ms here for
    the simulator's 0.2389; 0.2571 then, the rest the norms' gradient all-reduces
    (task tdclock), summed once per step since (module docstring; task sptorchrun).
    ``dim``: the dim of the local tensor, lead axes left out."""
    pg, g = _B.group(mesh, axis)
    nd = mesh.ndim
    lead = tuple(x.shape[:nd])
    y = _B.AllGather.apply(x.reshape(x.shape[nd:]), pg, len(g), dim, g.index(_B.rank()), True)
    y = y.reshape(lead + tuple(y.shape))
    nb = y.numel() * y.element_size()             # the cost model's: the gathered buffer
    C.record_collective("all_gather", mesh, axis, nb, label, groups=[g])
    if y.requires_grad and torch.is_grad_enabled():
        y = _AsyncGradCollective.apply(("reduce_scatter", mesh, axis, nb, label, [g]), y)
    return _B.tag(y, (axis,))


def megatron_g(y: DistTensor, tp_axis: int, sp: bool = False, seq_dim: int = 1) -> DistTensor:
    """Leave a tp region: reduce the partial sums (sp: onto the sequence shards).  To
    ``wb.compile``'s capture one op of the table, as :func:`megatron_f`."""
    if not isinstance(y, DistTensor):
        return _plain(megatron_g, y, (y, tp_axis, sp, seq_dim), {})
    ps = list(y.placements)
    ps[tp_axis] = Shard(seq_dim) if sp else Replicate()
    return reshard(y, y.mesh, ps)


def _plain(fn, x, args, kwargs):
    """``fn`` (f or g) called on a tensor that is not a DistTensor: under a torch function
    mode (``wb.compile``'s tracer) the mode records it as the op it is; a plain meta tensor
    (the tracer's own call, the mode off) gives the result's shape; anything else is
    refused, naming the fix (was: AttributeError 'Tensor' object has no attribute
    'placements')."""
    if has_torch_function((x,)):
        return handle_torch_function(fn, (x,), *args, **kwargs)
    if type(x) is torch.Tensor and x.is_meta:
        return x.view_as(x)
    raise TypeError(f"{fn.__name__}: the input is a {type(x).__name__}, not a DistTensor; "
                    "a tensor-parallel region reads and sets its placements over tp: lay "
                    "it out first (wb.distribute_tensor / wb.shard_tensor)")


def tensor_parallel_region(module, mesh, tp="tp", sp: bool = False, seq_dim: int = 1,
                           regather: bool = True, *, origin: str = "tensor_parallel_region"):
    """Put f before ``module`` (on its first argument) and g after it; returns the hooks.
    ``regather`` (sp only): :func:`megatron_f`'s; ``origin``: the entry point named by
    its uneven-shard error (a recipe calling this names itself)."""
    ax = mesh.dim(tp)
    if not isinstance(regather, bool):
        raise TypeError(f"regather={regather!r}: give True (keep the sequence shard and "
                        "all-gather it again in backward, as Megatron-LM) or False (keep "
                        "the gathered input)")

    def f(mod, args):
        x, *rest = args
        return (megatron_f(x, ax, sp, seq_dim, regather, origin=origin), *rest)

    def g(mod, args, out):
        return megatron_g(out, ax, sp, seq_dim)
    return module.register_forward_pre_hook(f), module.register_forward_hook(g)


def sequence_parallel_norms(module, mesh, norm_classes, tp="tp") -> list:
    """Under sequence parallelism each norm runs on the rank's slice of the sequence, so
    its weight's (and bias's) gradient is a partial sum over tp.  Megatron-LM marks these
    parameters ``sequence_parallel`` and all-reduces their gradients over tp ONCE per
    step, after the pipeline flush (``finalize_model_grads``: ``_allreduce_layernorm_grads``
    in megatron/core/distributed/finalize_model_grads.py), not every micro-batch.  Here
    each such parameter gets one copy per tp rank (so no per-micro-batch all-reduce is
    inserted and each rank keeps its partial gradient, summed over the micro-batches); the
    optimizer sums them over tp in one buffer, before the data-parallel reduce and before
    a clip reads them (``DataParallel(partial_grads=...)``, ``GradReplicas.sum_partials``).
    On the simulated ranks the copies are real storage (a tp axis of size tp); on
    torch.distributed each process's parameter already is its own copy: it is marked so
    (``_wb_replica_axes``, which ``collectives.expand_replicas`` reads), and the same sum
    runs at the same point, one all-reduce over the tp process group per step.  Until it
    has run the gradients are partial: an optimizer that is not given them as
    ``partial_grads`` would step each rank by its own part, on both executors.
    ``norm_classes``: the module classes that are norms (a model says which:
    ``model.norm_classes()``, ``workbench/models/split.py``; this layer knows no model).
    Returns the parameters it marked (a second call marks none)."""
    given = norm_classes
    norm_classes = (given,) if isinstance(given, type) else \
        tuple(given) if isinstance(given, (tuple, list, set, frozenset)) else ()
    if not norm_classes or not all(isinstance(c, type) and issubclass(c, nn.Module)
                                   for c in norm_classes):
        raise TypeError(f"norm_classes={given!r}: give the model's norm layer classes "
                        "(nn.Module subclasses), e.g. model.norm_classes()")
    return [p for mod in module.modules() if isinstance(mod, norm_classes)
            for p in sequence_parallel_params(mod, mesh, tp)]


def sequence_parallel_params(module, mesh, tp="tp") -> list:
    """:func:`sequence_parallel_norms` for every parameter of ``module`` itself that is
    replicated over tp (a module whose every use reads the rank's sequence shard, so its
    gradient is a partial sum over tp: a norm, or a head replicated over tp after a
    sequence-parallel norm); returns those it marked."""
    ax, n = mesh.dim(tp), mesh.shape[mesh.dim(tp)]
    dist = _B.is_distributed(mesh)
    out = []
    for p in getattr(module, "_wb_dist_params", {}).values():
        if not p.placements[ax].is_replicate():
            continue
        if dist:
            # this process's copy is already its own: marked one copy per tp rank,
            # C.expand_replicas inserts no all-reduce of its gradient in backward
            if ax not in getattr(p._local, "_wb_replica_axes", ()):
                _B.tag(p._local, (ax,))
                out.append(p)
            continue
        if p._local.shape[ax] != 1:
            continue
        loc = p._local.detach()
        shape = list(loc.shape)
        shape[ax] = n
        p._local = loc.expand(shape).clone().requires_grad_(p._local.requires_grad)
        out.append(p)
    return out
