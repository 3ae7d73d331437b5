"""Advice for a data-parallel wrapper given the mesh torch's order would give it.

PyTorch's FSDP + TP order is ``parallelize_module(model, world_mesh["tp"], plan)`` then
``fully_shard(model, mesh=world_mesh["dp"])`` (or DDP over ``world_mesh["dp"]``).  Under
torchrun each process's slice is its own group; on simulated ranks ``world_mesh["tp"]`` is
the first data-parallel group's slice alone (``Mesh.__getitem__``), so the parameters cover
those ranks only and no dp dim can be found.  The wrapper's refusal then names the form
that works on both: tensor parallelism over the whole mesh (it takes the "tp" dim)."""
from __future__ import annotations

__all__ = ["world_slice_advice"]


def world_slice_advice(params_mesh, mesh, dim, wrapper: str, then: str) -> str | None:
    """The refusal's text when ``params_mesh`` (the parameters') looks like a slice of the
    world mesh that ``mesh`` (given to ``wrapper``) is another slice or the whole of: a 1-d
    mesh without ``dim``, starting at the same rank; None otherwise.  ``then``: the
    wrapper's own call that follows."""
    if mesh is None or params_mesh.ndim != 1 or dim in params_mesh.dim_names or \
            params_mesh.ranks[0] != mesh.ranks[0] or not isinstance(dim, str):
        return None
    if set(params_mesh.dim_names) & set(mesh.dim_names) and mesh.ndim == 1:
        return None
    name = params_mesh.dim_names[0]
    return (f"{wrapper}: the module's parameters are DistTensors on {params_mesh}, a slice of "
            f"the world mesh (world_mesh[{name!r}]): on simulated ranks such a slice is the "
            "first data-parallel group's alone, so tensor parallelism over every group is "
            "parallelize_module(model, world_mesh, plan) (it takes the 'tp' dim; the same call "
            f"runs under torchrun), then {then}")
