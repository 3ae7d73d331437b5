"""``fully_shard``: PyTorch FSDP2's front door on our ``FullyShardedDataParallel``.

    mesh = wb.Mesh.grid(4, ["dp"])
    mp = wb.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        wb.fully_shard(block, mesh=mesh, mp_policy=mp)
    wb.fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)      # built after fully_shard
    loss = loss_fn(model(x), y); loss.backward(); opt.step()

As torch's ``fully_shard`` (torch 2.13, ``torch/distributed/fsdp/_fully_shard/
_fully_shard.py``) it changes ``module`` in place and returns it: its class becomes
``FSDP<Class>`` (:class:`~.fsdp_module.FSDPModule` placed before the original class, as
FSDP2 does), and its parameters become their shards.  Calls go bottom-up: a call on a
block makes the block one unit (its parameters gathered in one collective before its
forward, its gradients reduce-scattered in one when its backward ends); the call on the
root takes in the parameters no block holds and builds the sharded state,
:class:`~.fully_shard_state.FullyShardRoot`.  After it the user's own object trains as
one device: ``model(x)``, ``model.parameters()`` (the shards, which any ``torch.optim``
optimizer steps), ``zero_grad()``, ``torch.nn.utils.clip_grad_norm_``, ``state_dict()``
(FSDP2's ``Shard(0)`` DistTensors) and ``load_state_dict``.

What differs from FSDP2, said rather than hidden: the shards are flat padded chunks
(FSDP1's layout, :mod:`.flat_shards`), so ``model.parameters()`` gives ``(N, chunk)``
tensors on simulated ranks, not ``Shard(0)`` DTensors of the module's shapes
(``state_dict()`` gives those); a block can run only inside its root's forward; the root
is found when its call comes (FSDP2 finds it at the first forward), so a call on a
parent after a block ran raises; what cannot be honoured raises (:func:`check_arguments`).
A model whose parameters are DistTensors (tensor parallelism first, as torchtitan) is
sharded over dp by the DistTensor mode (:mod:`.fully_shard_tp`).

A user's hooks (the root's own too: the wrapper is the module) fire once per simulated
rank with that rank's tensors, as each FSDP2 process's fire once with its own
(``wb.simulated_rank()`` names the rank); over DistTensors once with the global tensors:
:mod:`.rank_hooks`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...sim_mesh.mesh import Mesh
from .fsdp_module import FSDPModule, fsdp_class, install_hooks
from .fully_shard_state import FSState, FullyShardRoot
from .fully_shard_tp import check_order, mark
from .laid_out import LaidOutParameter

__all__ = ["fully_shard", "MixedPrecisionPolicy", "FSDPModule"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision (``torch.distributed.fsdp.MixedPrecisionPolicy``, same
    fields): ``param_dtype`` the dtype weights are gathered and computed in (the shards,
    their gradients and the optimizer states keep theirs); ``reduce_dtype`` the dtype
    gradients are reduced in (None: ``param_dtype``); ``output_dtype`` the dtype each
    sharded module's floating outputs are cast to; ``cast_forward_inputs``: cast each
    sharded module's floating inputs to ``param_dtype``.  torch's own policy object is
    accepted too."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def _policy(mp):
    """The policy's fields, checked; torch's MixedPrecisionPolicy read as ours."""
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if type(mp).__name__ != "MixedPrecisionPolicy" or not all(hasattr(mp, f) for f in fields):
        raise TypeError(f"fully_shard(mp_policy={mp!r:.80}): give a MixedPrecisionPolicy "
                        "(wb.MixedPrecisionPolicy or torch.distributed.fsdp's)")
    mp = MixedPrecisionPolicy(*(getattr(mp, f) for f in fields))
    for f in fields[:3]:
        d = getattr(mp, f)
        if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
            raise TypeError(f"fully_shard(mp_policy=...{f}={d!r}): give a floating-point "
                            "torch dtype (torch.bfloat16, torch.float16...) or None")
    return mp


def _reduce_dtype(mp):
    """The wrapper's reduce_dtype: None where gradients reduce in the gather dtype (FSDP2
    reduces in ``param_dtype`` when ``reduce_dtype`` is None)."""
    rd = mp.reduce_dtype
    return None if rd is None or rd == mp.param_dtype else rd


def check_arguments(module, mesh, reshard_after_forward, shard_placement_fn, offload_policy,
                    ignored_params, dp_mesh_dims):
    """What fully_shard cannot honour raises before anything changes; returns the dim."""
    if isinstance(module, (list, tuple)):
        raise NotImplementedError(
            "fully_shard([module, ...]): one group over several modules is not built here; "
            "call fully_shard on each module (one unit each) or on their common parent")
    if isinstance(module, type) or not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard(module={module!r:.60}): expected an nn.Module instance")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise ValueError("reshard_after_forward should be a bool or an int representing the "
                         f"group size to reshard to, not {reshard_after_forward!r}")
    if shard_placement_fn is not None:
        raise NotImplementedError(
            f"fully_shard(shard_placement_fn={shard_placement_fn!r:.60}): every parameter "
            "is sharded as one flat chunk per rank here; leave shard_placement_fn=None")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise NotImplementedError(
            f"fully_shard(offload_policy={offload_policy!r:.60}): CPU offload is not built "
            "(simulated ranks have no device memory to spare); leave the default "
            "OffloadPolicy()")
    if ignored_params:
        raise NotImplementedError(
            "fully_shard(ignored_params=...): every parameter of the module is sharded here; "
            "freeze it (requires_grad=False) or keep it outside the module")
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            f"fully_shard(dp_mesh_dims={dp_mesh_dims!r:.60}) is not built: pass the 1-d "
            "data-parallel mesh, mesh=world_mesh['dp']")
    if mesh is None:
        return "dp"
    if not isinstance(mesh, Mesh):
        raise TypeError(f"fully_shard(mesh={mesh!r:.60}): expected a workbench Mesh, e.g. "
                        "wb.Mesh.grid(4, ['dp']) (or world_mesh['dp']), not torch's DeviceMesh")
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard(mesh={mesh}): a {mesh.ndim}-d mesh is FSDP2's HSDP (replicate x "
            "shard), not built here; pass the 1-d data-parallel mesh, e.g. mesh['dp']")
    return mesh.dim_names[0]


def reshard_after_forward_bool(v, mesh):
    """torch's int ``reshard_after_forward`` (``_fsdp_init._get_post_forward_mesh_info``,
    torch 2.13): a factor of the shard group's size; 1 is False (torch warns: not True),
    the group's size is True; a world in between is not built here."""
    if v is None or isinstance(v, bool):
        return v
    if mesh is not None:
        n = mesh.size
    else:
        import torch.distributed as dist
        n = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if v < 1 or v > n or n % v:
        raise ValueError("If passing reshard_after_forward as an int, it should be a factor "
                         f"of {n}, not {v}")
    if v == 1:
        import warnings
        warnings.warn("reshard_after_forward=1 (int) means resharding parameters to world "
                      "size 1, instead of reshard_after_forward=True (bool)", stacklevel=3)
        return False
    if v == n:
        return True
    raise NotImplementedError(
        f"fully_shard(reshard_after_forward={v}): resharding to a smaller world ({v} of {n} "
        "ranks) after forward is not built; give True (free after forward, gather again in "
        "backward), False (keep) or None (False for the root)")


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy=MixedPrecisionPolicy(), offload_policy=None, ignored_params=None,
                dp_mesh_dims=None):
    """Shard ``module``'s parameters over ``mesh`` (1-d, the data-parallel ranks; None:
    torch.distributed's default group) in place, as FSDP2's ``fully_shard``; returns
    ``module``, now an :class:`FSDPModule`.  ``reshard_after_forward``: None (FSDP2's
    default: True for a block, False for the root), True or False (or torch's int: 1 is
    False, the mesh's size True); ``mp_policy``: a
    :class:`MixedPrecisionPolicy` (every call on one model gives the same
    ``param_dtype``)."""
    dim = check_arguments(module, mesh, reshard_after_forward, shard_placement_fn,
                          offload_policy, ignored_params, dp_mesh_dims)
    mp = _policy(mp_policy)
    reshard_after_forward = reshard_after_forward_bool(reshard_after_forward, mesh)
    name = type(module).__name__
    if isinstance(module, FSDPModule):
        raise RuntimeError(f"fully_shard was already applied to this {name}; apply it once per "
                           "module (blocks first, then the root)")
    check_order(module)
    from .ddp_dist import has_dist_parameters
    if has_dist_parameters(module):      # after tensor parallelism (torchtitan's order)
        from .fully_shard_tp import check_tp
        full = check_tp(module, mesh, dim, mp, reshard_after_forward, FSDPModule)
        state = FSState(module, mesh, dim, mp, reshard_after_forward)
        state.tp = (full, dim)
        for m in module.modules():
            if m is not module and isinstance(m, FSDPModule) and m._wb_fully_shard.top is None:
                m._wb_fully_shard.top = module
        module._wb_fully_shard = state
        install_hooks(module)            # mp_policy's input / output casts, per module
        module.__class__ = fsdp_class(type(module))
        mark(module)
        return module
    inside = {id(m) for m in module.modules()}
    check_split_ties(module, name, inside)
    roots, adopt = [], {}
    for p in module.parameters():
        if not isinstance(p, LaidOutParameter):
            continue
        owner = getattr(p, "_wb_fs_owner", None)
        if owner is None:
            raise ValueError(f"fully_shard({name}): its parameters are already laid out by "
                             "another wrapper (DistributedDataParallel / "
                             "FullyShardedDataParallel); apply fully_shard to a plain module")
        if id(owner.module) not in inside:
            raise RuntimeError(
                f"fully_shard({name}) after fully_shard on a module above it "
                f"({type(owner.module).__name__}), which holds its parameters already; "
                "call fully_shard bottom-up: the blocks first, then the root")
        if owner not in roots:
            roots.append(owner)
        adopt[id(p)] = owner._meta[id(p)]
    units = [m for m in module.modules() if m is not module and isinstance(m, FSDPModule)]
    for w in roots:
        _check_joinable(w, name, mesh, dim, mp)
    taken = [_dissolve(w) for w in roots]
    state = FSState(module, mesh, dim, mp, reshard_after_forward)
    try:
        before = _hook_keys(module)
        root = FullyShardRoot(module, mesh, dim, mp.param_dtype, units or None, adopt,
                              reduce_dtype=_reduce_dtype(mp))
    except BaseException:
        for w, removed in zip(roots, taken):
            _restore(w, removed)
        raise
    state.hooks = [(d, k, d[k]) for d, k in _new_hooks(module, before)]
    state.wrapper = root
    for u in root.units:
        for _, shard, _ in u.params:
            shard._wb_fs_owner = root
            # torch.distributed: numel() / dim() / a reduction read the module's parameter,
            # the chunks gathered (FSDP2's DTensor: its full tensor's; .laid_out_whole)
            shard._wb_gathers = root.group.distributed
    module._wb_fully_shard = state
    for m in units:
        m._wb_fully_shard.owner, m._wb_fully_shard.wrapper = root, None
    install_hooks(module)
    module.__class__ = fsdp_class(type(module))
    mark(module)
    return module


def check_split_ties(module, name: str, inside: set) -> None:
    """A weight tied across a block's boundary (``head.weight = emb.weight`` with
    ``fully_shard(emb)`` first): the block's call sharded the weight for the block's own
    uses only, so the other module still holds the plain parameter, which this call would
    shard again as a second parameter: the tie broken, the two trained apart (habits11:
    the output 0.0685 off one device's after two SGD steps, silently).  Raise naming the
    fix, before anything changes."""
    for pname, p in module.named_parameters(remove_duplicate=False):
        if isinstance(p, LaidOutParameter):
            continue
        new = getattr(p, "_wb_successor", None)
        while getattr(new, "_wb_successor", None) is not None:
            new = new._wb_successor
        owner = getattr(new, "_wb_fs_owner", None)
        if owner is not None and id(owner.module) in inside:
            block = next(n for n, m in module.named_modules() if m is owner.module)
            raise ValueError(
                f"fully_shard({name}): {pname!r} is tied to a parameter of {block!r}, which "
                f"fully_shard({type(owner.module).__name__}) already sharded for that "
                "block's own uses; sharding it again here would make two parameters and "
                "break the tie.  Keep every use of a tied weight in one fully_shard call: "
                f"do not call fully_shard on {block!r} (its parent's call shards the tied "
                "weight once, as torchtitan keeps tied embeddings in the root), or tie "
                "the weights inside the block")


def _check_joinable(w, name, mesh, dim, mp):
    st = w.module._wb_fully_shard
    below = type(w.module).__name__
    if w._order or w._hooked:
        raise RuntimeError(f"fully_shard({name}) after its sub-module {below} ran forward: "
                           "apply fully_shard to every module before the first forward")
    if st.mesh != mesh or st.dim != dim:
        raise ValueError(f"fully_shard({name}, mesh={mesh}): its sub-module {below} is sharded "
                         f"over {st.mesh}; give every call of one model the same mesh")
    if _reduce_dtype(st.mp_policy) != _reduce_dtype(mp):
        raise NotImplementedError(
            f"fully_shard({name}) with reduce_dtype={mp.reduce_dtype}: its sub-module {below} "
            f"has reduce_dtype={st.mp_policy.reduce_dtype}; one model reduces in one dtype "
            "here, give every call the same reduce_dtype")
    if st.mp_policy.param_dtype != mp.param_dtype:
        raise NotImplementedError(
            f"fully_shard({name}) with param_dtype={mp.param_dtype}: its sub-module {below} "
            f"has param_dtype={st.mp_policy.param_dtype}; one model gathers in one dtype "
            "here, give every call the same param_dtype")


def _hook_keys(module):
    return {id(m): (set(m._forward_pre_hooks), set(m._forward_hooks)) for m in module.modules()}


def _new_hooks(module, before):
    for m in module.modules():
        pre, post = before.get(id(m), (set(), set()))
        yield from ((m._forward_pre_hooks, k) for k in list(m._forward_pre_hooks) if k not in pre)
        yield from ((m._forward_hooks, k) for k in list(m._forward_hooks) if k not in post)


def _dissolve(w):
    """Undo what the sub-tree's root wrapper put on the modules (its units' hooks, its
    mark), keeping the shards: the new root adopts them.  Returns what was removed."""
    st = w.module._wb_fully_shard
    for d, k, _ in st.hooks:
        d.pop(k, None)
    mark = w.module.__dict__.pop("_wb_wrapped", None)
    return st.hooks, mark


def _restore(w, removed):
    hooks, mark = removed
    for d, k, fn in hooks:
        d[k] = fn
    if mark is not None:
        w.module._wb_wrapped = mark
