"""``fully_shard`` after tensor parallelism: torchtitan's order, FSDP over the dp dim.

    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    wb.parallelize_module(model, mesh, plan)              # TP first (DistTensor parameters)
    for block in model.blocks:
        wb.fully_shard(block, mesh=mesh["dp"])
    wb.fully_shard(model, mesh=mesh["dp"])                # the 1-d dp mesh, as torchtitan's

torchtitan (``parallelize_llama``: ``apply_tp`` then ``apply_fsdp`` on ``world_mesh["dp"]``)
shards the DTensor parameters a second time, over dp (FSDP2's 2-D layout).  Our engine
for that is :class:`~.fsdp_dist.DistTensorFSDP` (``wb.FullyShardedDataParallel(model,
mesh, "dp")``), which makes every module holding parameters its own unit.  So here the
calls only mark the modules; the sharded state is built once, on the topmost marked
module (the root), the first time the model runs or its parameters are asked for
(FSDP2 too finds its root lazily, at the first forward).  After that the user's module
answers with the dp shards: ``model.parameters()`` / ``named_parameters()`` (what an
optimizer steps; a block's: its own; any sub-module's, passed to fully_shard or not:
its own shards, :class:`~..module_state.ParallelModule`), ``zero_grad()``; a parameter
attribute (``module.weight``) reads the shards' value now (:mod:`.fully_shard_attrs`); ``state_dict()`` gives DistTensors
of the tensor-parallel placements gathered from the shards and ``load_state_dict`` cuts
values into them (:mod:`.fsdp_dist_habits`).

The reduce-scatters launched in a backward are waited for on the modeled clock at the
root's next forward (``finish_gradient_synchronization``; the shards hold the reduced
gradients when ``backward()`` returns, so the numbers do not depend on it).

``mp_policy`` (simulated ranks): each forward gathers the shards cast to ``param_dtype``
and the gradients are summed over dp in ``reduce_dtype`` (:meth:`.fsdp_dist.
DistTensorFSDP._gather_math`), onto the shards in their own dtype; one policy per model.

``set_requires_gradient_sync(False)`` (simulated ranks): gradient accumulation without
reduce-scatters (:mod:`.fully_shard_tp_units`).

Not built here, and refused: mixed precision and ``set_requires_gradient_sync(False)``
and ``reshard_after_forward=False`` under torch.distributed (:mod:`.fully_shard_tp_units`
builds them on simulated ranks), a fully_shard call after the state was built.
"""
from __future__ import annotations

import weakref

__all__ = ["check_order", "check_tp", "mark", "built", "build_above", "tp_named_parameters"]

_MARKED = weakref.WeakSet()      # modules fully_shard was applied to (both modes)


def mark(module) -> None:
    _MARKED.add(module)


def check_order(module) -> None:
    """FSDP2's order, bottom-up: no call on a module below one already sharded."""
    for r in list(_MARKED):
        if r is not module and any(m is module for m in r.modules()):
            raise RuntimeError(
                f"fully_shard({type(module).__name__}) after fully_shard on "
                f"{r._wb_fully_shard.name} above it; call fully_shard bottom-up: the blocks "
                "first, then the root")


def check_tp(module, mesh, dim, mp, reshard_after_forward, fsdp_module_cls):
    """The DistTensor parameters' mesh and the dp dim, checked (nothing changed yet)."""
    from ..module import dist_parameters
    from .laid_out import LaidOutParameter
    name = type(module).__name__
    for m in module.modules():
        st = getattr(m, "_wb_fully_shard", None)
        if isinstance(m, fsdp_module_cls) and _root(m)._wb_fully_shard.wrapper is not None:
            raise RuntimeError(
                f"fully_shard({name}) after {st.name} below it ran or gave its parameters: "
                "apply fully_shard to every module (bottom-up) before the first forward and "
                "before building the optimizer")
    meshes = {p.mesh for _, p in dist_parameters(module)}
    if len(meshes) != 1:
        raise NotImplementedError(f"fully_shard({name}): its DistTensor parameters live on "
                                  f"{len(meshes)} meshes; one mesh is built")
    full = meshes.pop()
    # full[dim]: under torchrun the dp slice through this process (DeviceMesh's), which
    # is the user's world_mesh["dp"]; submesh(dim) is the one through the first rank (it
    # alone was taken: every process off rank 0's dp slice was refused)
    from .mesh_advice import world_slice_advice
    advice = world_slice_advice(full, mesh, dim, f"fully_shard({name}, mesh={mesh})",
                                f"fully_shard(..., mesh=world_mesh[{dim!r}])")
    if advice:
        raise ValueError(advice)
    if mesh is None or dim not in full.dim_names or mesh not in (full.submesh(dim), full[dim]):
        raise ValueError(
            f"fully_shard({name}, mesh={mesh}): its parameters are DistTensors on {full}; "
            f"pass that mesh's data-parallel dim, mesh=world_mesh['dp'] (torchtitan's order: "
            "parallelize_module on the whole mesh, then fully_shard on its dp dim)")
    from ...sim_mesh import backends as _B
    if (mp.param_dtype is not None or mp.output_dtype is not None or
            mp.reduce_dtype is not None) and _B.is_distributed(full):
        raise NotImplementedError(
            f"fully_shard({name}, mp_policy={mp}) over tensor-parallel DistTensor "
            "parameters under torch.distributed: mixed precision is built on simulated ranks "
            "only here; leave the default MixedPrecisionPolicy()")
    for m in module.modules():           # one policy per model (one sharded state)
        st = getattr(m, "_wb_fully_shard", None)
        if m is not module and st is not None and st.mp_policy != mp:
            raise NotImplementedError(
                f"fully_shard({name}, mp_policy={mp}): {st.name} below it has "
                f"mp_policy={st.mp_policy}; over DistTensor parameters one model gathers and "
                "reduces in one dtype here, give every call the same MixedPrecisionPolicy")
    if reshard_after_forward is False and _B.is_distributed(full):
        raise NotImplementedError(
            f"fully_shard({name}, reshard_after_forward=False) over tensor-parallel "
            "DistTensor parameters under torch.distributed is not built: leave None or True "
            "(every unit re-gathers in backward)")
    dist = {id(p) for _, p in dist_parameters(module)}
    plain = [n for n, p in module.named_parameters() if id(p) not in dist
             and not isinstance(p, LaidOutParameter)]
    if plain:
        raise NotImplementedError(
            f"fully_shard({name}): {plain[0]!r} (and {len(plain) - 1} more) stayed a plain "
            "parameter beside DistTensor ones, which the DistTensor mode would not shard "
            f"nor step; make them replicated DistTensors first: wb.parallelize({name.lower()}, "
            "mesh) after parallelize_module (it leaves the DistTensors as they are)")
    if any(isinstance(p, LaidOutParameter) for p in module.parameters()):
        raise NotImplementedError(
            f"fully_shard({name}): some sub-modules were sharded as plain modules and others "
            "hold DistTensor parameters; parallelize_module the whole model first")
    return full


def _root(m):
    while m._wb_fully_shard.top is not None:
        m = m._wb_fully_shard.top
    return m


def built(m):
    """The sharded state of ``m``'s root (built on first use)."""
    r = _root(m)
    st = r._wb_fully_shard
    if st.wrapper is None:
        from .fsdp import FullyShardedDataParallel
        full, dim = st.tp
        st.building = True               # torch's own walks while the state is made
        try:
            w = FullyShardedDataParallel(r, full, dim)      # DistTensorFSDP
        finally:
            st.building = False
        st.wrapper = w
        mp = st.mp_policy               # fully_shard's MixedPrecisionPolicy (one per model)
        w.param_dtype = mp.param_dtype
        w.reduce_dtype = None if mp.reduce_dtype == mp.param_dtype else mp.reduce_dtype
        from .fsdp_dist_habits import module_shaped_optimizer_states
        from .fully_shard_attrs import install
        install(w)                  # module.weight: the shards' value now
        module_shaped_optimizer_states(w)    # the optimizer's states: one device's shapes
        if not w.async_:
            for _, _, _, shard in w.entries:
                # numel() / dim() / shape / a reduction of a shard or of its gradient read
                # the module's parameter, gathered over dp then tp (FSDP2's DTensor over the
                # 2-d mesh: its full tensor's; .laid_out_whole, habits13).  Simulated ranks:
                # every DistTensorFSDP's shards, a user's reads (habits14, habits15:
                # .fsdp_dist_habits.users_read_the_module)
                shard._wb_gathers = True
        if w.async_:                # set_requires_gradient_sync(False): gradients held
            from .fully_shard_tp_units import install as sync_hooks
            sync_hooks(w)
        for sub in r.modules():
            if sub.__dict__.get("_wb_shards"):       # its parameters() give the shards
                sub.__dict__["_wb_fully_shard_params"] = True
            s = getattr(sub, "_wb_fully_shard", None)
            if s is not None and sub is not r:
                s.owner = w
    return st.wrapper


def build_above(module) -> None:
    """A module inside a ``fully_shard`` root over DistTensors (not itself passed to
    ``fully_shard``): the root's sharded state built now, so ``module.parameters()`` gives
    the dp shards an optimizer over the root's parameters steps, never the templates."""
    for r in list(_MARKED):
        st = r._wb_fully_shard
        if st.tp is None or st.top is not None or st.wrapper is not None or st.building:
            continue
        if any(m is module for m in r.modules()):
            built(r)


def tp_named_parameters(m, prefix, recurse, remove_duplicate):
    """(name, dp shard) of ``m``'s parameters under ``m``'s own names."""
    w = built(m)
    if w.module is m:
        qual = ""
    else:
        qual = next(n for n, s in w.module.named_modules() if s is m) + "."
    for n, p in w.named_parameters(remove_duplicate=remove_duplicate):
        if n.startswith(qual) and (recurse or "." not in n[len(qual):]):
            yield prefix + n[len(qual):], p
