"""FSDP's units: which parameters are gathered together, and how many gathered bytes live.

A *unit* is a submodule whose parameters are all-gathered just before its own forward
and freed right after it, gathered again when its backward needs them, and whose
gradients are reduce-scattered when its backward ends (PyTorch FSDP's
``auto_wrap_policy=ModuleWrapPolicy({Block})`` / FSDP2's ``fully_shard(block)`` on each
block; Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel", VLDB, which splits a model into such "FSDP units").  The parameters no
unit holds form the root unit (the wrapped module itself), gathered from the start of
forward to the end of its backward (torch keeps the root gathered: no re-gather).
With one unit per block the gathered weights alive at once are the root unit's plus
one block's (plus the next block's with prefetch), not the whole model's.

:class:`GatheredBytes` counts it: it keeps a weak reference to the storage of every
gathered tensor and sums the bytes of those still alive (a storage is freed only when
no tensor, view or autograd graph holds it), so the figure is what memory holds, not
what the code meant to free.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..versions import OWN_FIX
from .flat_shards import pack, pack_rank_major, tensor_places, unpack
from .laid_out_whole import storage_numel
from .replaced_params import mark_successor

__all__ = ["Unit", "UnitCall", "Regather", "Saved", "GatherUnit", "all_gather", "reduce_scatter",
           "plan_units", "GatheredBytes", "tree_cast"]


class Unit:
    """One unit: its module (the wrapped module for the root), its qualified name
    (``""`` for the root) and its parameters: (own name, shard, [(submodule, attr)])."""

    def __init__(self, index, name, module):
        self.index, self.name, self.module = index, name, module
        self.params = []

    def __repr__(self):
        return f"Unit({self.name or '<root>'}, {len(self.params)} parameters)"


def _resolve(module, units):
    """The unit submodules, in ``module.named_modules()`` order, from ``units``: None,
    module classes (every submodule of one), or submodules of ``module``."""
    if units is None:
        return []
    if isinstance(units, (nn.Module, type)):
        units = [units]
    try:
        units = list(units)
    except TypeError:
        raise TypeError(f"FullyShardedDataParallel(units={units!r}): give None (one unit), "
                        "module classes (e.g. {Block}) or submodules of the module") from None
    classes = [u for u in units if isinstance(u, type)]
    bad = [u for u in units if not (isinstance(u, nn.Module) or
                                    (isinstance(u, type) and issubclass(u, nn.Module)))]
    if bad:
        raise TypeError(f"FullyShardedDataParallel(units=...): {bad[0]!r} is neither an "
                        "nn.Module class nor a submodule")
    mods = {id(u) for u in units if isinstance(u, nn.Module)}
    named = list(module.named_modules())
    found = {id(m) for _, m in named[1:]}
    if id(module) in mods:
        raise ValueError("FullyShardedDataParallel(units=...): the wrapped module itself is "
                         "always the root unit; list its submodules (e.g. its blocks)")
    missing = mods - found
    if missing:
        raise ValueError("FullyShardedDataParallel(units=...): a listed module is not a "
                         "submodule of the wrapped module; give its own submodules")
    return [(n, m) for n, m in named[1:] if id(m) in mods or
            (classes and isinstance(m, tuple(classes)))]


def plan_units(module, units, shards_of):
    """[root, unit 1, ...] with each parameter in the innermost unit that holds every
    use of it; a parameter held by two units (tied weights across blocks) goes to the
    root.  ``shards_of(name, p)`` makes the shard that replaces ``p``."""
    subs = _resolve(module, units)
    out = [Unit(0, "", module)] + [Unit(i + 1, n, m) for i, (n, m) in enumerate(subs)]
    owner = {}                                  # id(submodule) -> innermost unit
    for u in sorted(out[1:], key=lambda u: -len(list(u.module.modules()))):
        for m in u.module.modules():            # deeper units are visited later and win
            owner[id(m)] = u
    for name, p, places in tensor_places(module):       # a tied weight: one, every place
        homes = {id(owner.get(id(m), out[0])) for m, _ in places}
        unit = owner.get(id(places[0][0]), out[0]) if len(homes) == 1 else out[0]
        shard = shards_of(name, p)
        mark_successor(p, shard)        # an optimizer built before: follows (.replaced_params)
        for m, attr in places:
            m._parameters[attr] = shard
        unit.params.append((name, shard, places))
    return out


class GatheredBytes:
    """Bytes of gathered parameters alive now, and the most alive at once (``peak``)."""

    def __init__(self):
        self._refs = []
        self.peak = 0

    def add(self, t) -> None:
        """Count ``t`` (a fresh gathered tensor) while its storage lives; update the peak
        (alive bytes only grow here, so sampling here finds the true maximum)."""
        s = t.untyped_storage()
        self._refs.append((StorageWeakRef(s), s.nbytes()))
        self.peak = max(self.peak, self.alive())

    def alive(self) -> int:
        self._refs = [(r, nb) for r, nb in self._refs if not r.expired()]
        return sum(nb for _, nb in self._refs)

    def reset_peak(self) -> None:
        self.peak = self.alive()


class UnitCall:
    """One entry of a unit in a forward, shared by the ranks (simulated: the j-th
    entry of every rank): the per-rank gradients waiting for the reduce-scatter and
    the weights re-gathered for backward."""

    def __init__(self, unit):
        self.unit, self.entered, self.grads = unit, 0, {}   # entered: ranks (simulated)
        self.cache, self.packed, self.ptrs, self.recorded, self.done = {}, {}, {}, set(), set()
        self.by_rank = {}               # rank -> its entries in forward order (prefetch)
        self.versions = {}              # rank -> the shards' version counters at the gather
        # a kept (root) unit: rank -> {(i, own): [weakref to a saved copy]} (.fsdp_kept), and
        # rank -> {(i, own): flat gathered again} worked out once per backward
        self.kept, self.checked = {}, {}
        self.src = {}                   # rank -> a plain alias of each shard's storage at the
        #                                 gather (a later p.data = t swaps the shard's)


def check_version(call, k, i, who: str = "FullyShardedDataParallel") -> None:
    """Backward reads rank k's gathered copy of the unit's i-th parameter (kept or
    re-gathered): raise torch's error where its shard was written since the forward gathered
    it.  The copy has a version counter of its own, so a write into the shard
    (``p.detach().mul_``, ``mul_`` under no_grad, ``nn.init.zeros_``) between forward and
    backward left backward the old weights' gradient (kept root) or the new weights'
    (re-gathered), silently, where one device's saved weight raises at backward
    (torch/csrc/autograd/saved_variable.cpp, ``SavedVariable::unpack``) (fsdpw17).  A write
    through ``.data`` (or ``p.data = t``: torch's assignment, the version counter kept) has a
    counter of its own (torch's too): not an error; the kept copy is compared with what one
    device's backward would read and gathered again where they differ (:mod:`.fsdp_kept`,
    fsdpdata17/18), a re-gather reads that anyway.  The error's hint is its own
    (``versions.OWN_FIX``: no DistTensor hint is added to it).  FSDP2 itself
    copies its gathered weights out under ``torch.autograd._unsafe_preserve_version_counter``
    (torch 2.13 ``_fully_shard/_fsdp_collectives.py:484-499``), so, read from its code (not
    run here), its re-gather would hand backward the written weights without a word: not
    followed, one device's torch is the oracle."""
    name, shard, _ = call.unit.params[i]
    was = call.versions.get(k, ())
    if i < len(was) and shard._version != was[i]:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: {who}'s parameter {name!r} (its shard "
            f"{tuple(shard.shape)}) is at version {shard._version}; expected version "
            f"{was[i]} instead (the version its forward gathered). {OWN_FIX}; write after "
            "backward (e.g. after optimizer.step()), or run forward again after the write.")


class Kept:
    """What a saved weight of a unit kept gathered (the root) becomes: the weight itself,
    where to check its shard's version (:func:`check_version`) and whether autograd saved
    the installed parameter itself (``own``) or a view of it (:mod:`.fsdp_kept`)."""
    __slots__ = ("call", "k", "i", "t", "own")

    def __init__(self, call, k, i, t, own=False):
        self.call, self.k, self.i, self.t, self.own = call, k, i, t, own


class Saved:
    """Any other tensor saved while the wrapper's saved-tensor hooks run (an activation),
    with the version it was saved at: torch checks no version of a tensor its pack hook
    took, so a write into a saved activation inside the module (``h = sigmoid(x);
    h.mul_(2)``) gave a wrong gradient, silently, where one device's backward raises
    (fsdpdata18).  :meth:`check` raises torch's error in torch's words."""
    __slots__ = ("t", "version")

    def __init__(self, t):
        self.t, self.version = t, t._version

    def check(self):
        t = self.t
        if t._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: [{t.type()} {list(t.shape)}] is at version "
                f"{t._version}; expected version {self.version} instead. Hint: enable "
                "anomaly detection to find the operation that failed to compute its "
                "gradient, with torch.autograd.set_detect_anomaly(True).")
        return t


class Regather:
    """What a saved gathered weight becomes: where to find it again (``own``: as
    :class:`Kept`)."""
    __slots__ = ("call", "k", "i", "shape", "stride", "offset", "own")

    def __init__(self, call, k, i, t, own=False):
        self.call, self.k, self.i, self.own = call, k, i, own
        self.shape, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()


class GatherUnit(torch.autograd.Function):
    """All-gather of a unit's shards for rank k (forward); its gradients reduce-scattered
    (backward).  Simulated: a shard is (N, chunk), rank k's copy a fresh (N*chunk,)."""

    @staticmethod
    def forward(ctx, fsdp, call, k, pre, *shards):
        ctx.fsdp, ctx.call, ctx.k = fsdp, call, k
        ctx.set_materialize_grads(False)
        # the shards come uncast when reducing in another dtype: the gradient returned
        # then reaches the shard in reduce_dtype, not through a cast to compute_dtype
        outs = pre or fsdp._all_gather(call, k, [fsdp._cast(s) for s in shards])
        ctx.mark_non_differentiable(*[o for o, need in zip(outs, ctx.needs_input_grad[4:])
                                      if not need])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        return (None,) * 4 + ctx.fsdp._reduce_scatter(ctx.call, ctx.k, grads,
                                                       ctx.needs_input_grad[4:])


def all_gather(shards, g):
    """Every rank's ``shards`` (1-D, this rank's chunk of each tensor) gathered in one
    collective: copied into one buffer, all-gathered, copied out into one flat tensor
    per shard (PyTorch FSDP2's ``foreach_all_gather`` and its copy-out)."""
    buf = pack(shards) if len(shards) > 1 else shards[0].contiguous()
    # the chunk's elements (a fully_shard shard's numel() is the module's: laid_out_whole)
    out = torch.empty(storage_numel(buf) * g.n, dtype=buf.dtype)
    dist.all_gather_single(out, buf, group=g.pg)
    # the copy-out gives tensors only this program holds (gloo's worker thread may still
    # hold ``out`` for a moment after the call returns), so their liveness
    # (GatheredBytes) does not depend on thread timing
    rows = out.view(g.n, -1)
    return tuple(r.reshape(-1).clone() for r in unpack(rows, [s.shape for s in shards], 1))


def reduce_scatter(grads, g):
    """Each rank's chunk of the sums of ``grads`` (1-D, N chunks each) over the ranks, in
    one collective: laid out rank-major (chunk k of every gradient together, so the
    reduce-scatter leaves rank k its chunk of each), then split."""
    buf = pack_rank_major(grads, g.n)
    out = torch.empty(buf.numel() // g.n, dtype=buf.dtype)
    dist.reduce_scatter_single(out, buf, op=dist.ReduceOp.SUM, group=g.pg)
    return unpack(out, [(gr.numel() // g.n,) for gr in grads])


def tree_cast(tree, dtype):
    """Floating-point tensors and DistTensors of ``tree`` cast to ``dtype``."""
    from torch.utils import _pytree as pytree

    from ..dist_tensor import DistTensor

    def one(x):
        if isinstance(x, (torch.Tensor, DistTensor)) and x.dtype.is_floating_point:
            return x.to(dtype)
        return x
    return pytree.tree_map(one, tree)
