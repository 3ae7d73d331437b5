"""Adjacent mesh dims seen as one: the group a gradient is summed over with context parallelism.

With context parallelism every rank of a (dp, cp) pair holds a replica of the weights
and the gradient of its own tokens, so the gradients are summed over dp x cp ranks at
once. Megatron-Core does this with one process group: ``parallel_state.py`` builds the
data-parallel group "with context parallel" (``_DATA_PARALLEL_GROUP_WITH_CP``, returned by
``get_data_parallel_group(with_context_parallel=True)``), and its
``distributed/distributed_data_parallel.py`` lays its gradient buckets out on that group
(the group it falls back to when none is given). PyTorch's DeviceMesh spells it
``mesh["dp", "cp"]._flatten("dp_cp")``.

Here :func:`flatten_dims` gives a Mesh over the same ranks in the same order with those
dims merged into one (named by joining their names with "_"); a stacked local tensor's
leading axes reshape to it (a view), one collective runs along the merged dim, and the
result reshapes back (:func:`all_reduce_dims`). On torch.distributed the merged mesh is
registered, so the group is one process group (every process must build it in the same
order, as any new_group).
"""
from __future__ import annotations

import math

import torch

from ...sim_mesh import backends as _B
from ...sim_mesh import collectives as C
from ...sim_mesh.mesh import Mesh

__all__ = ["flatten_dims", "all_reduce_dims"]


def flatten_dims(mesh: Mesh, dims) -> tuple[Mesh, int]:
    """(the mesh with ``dims`` merged into one dim, that dim's index). ``dims``: names or
    indices of adjacent mesh dims (in any order); one dim gives ``(mesh, its index)``."""
    axes = sorted({mesh.dim(d) for d in dims})
    if axes != list(range(axes[0], axes[0] + len(axes))):
        raise ValueError(f"flatten_dims: mesh dims {[mesh.dim_names[a] for a in axes]} of "
                         f"{list(mesh.dim_names)} are not adjacent; one group over them needs "
                         "them next to each other in the mesh (order the mesh so they are)")
    if len(axes) == 1:
        return mesh, axes[0]
    a, b = axes[0], axes[-1] + 1
    shape = mesh.shape[:a] + (math.prod(mesh.shape[a:b]),) + mesh.shape[b:]
    names = mesh.dim_names[:a] + ("_".join(mesh.dim_names[a:b]),) + mesh.dim_names[b:]
    flat = Mesh(torch.tensor(mesh.ranks).reshape(shape).tolist(), names)
    if _B.is_distributed(mesh):
        flat = _B.register(flat)
    return flat, a


def all_reduce_dims(x: torch.Tensor, mesh: Mesh, flat: Mesh, axis: int, *,
                    label: str = "") -> torch.Tensor:
    """The sum of stacked ``x`` (leading axes: ``mesh``'s, full size on the merged dims)
    over the merged dim ``axis`` of ``flat`` (:func:`flatten_dims`): one all-reduce per
    group, recorded once. Returns the sum laid out on ``mesh`` again (one copy per rank)."""
    nd, fnd = mesh.ndim, flat.ndim
    lead = tuple(x.shape[:nd])
    flead = (1,) * fnd if _B.is_distributed(mesh) else tuple(
        math.prod(lead[i:i + nd - fnd + 1]) if i == axis else
        lead[i if i < axis else i + nd - fnd] for i in range(fnd))
    y = C.all_reduce(x.reshape(flead + tuple(x.shape[nd:])), flat, axis, "sum",
                     expanded=True, label=label)
    return y.reshape(lead + tuple(y.shape[fnd:]))
