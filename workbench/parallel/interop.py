"""Carry a plan to PyTorch's own stack: meshes, placements and tensors to and from
``torch.distributed`` DeviceMesh and DTensor.

    dmesh = wb.parallel.interop.to_device_mesh(mesh)            # needs a process group
    d = wb.parallel.interop.to_dtensor(x, dmesh)                 # DistTensor -> DTensor
    y = wb.parallel.interop.from_dtensor(d, mesh)                # and back

On torch.distributed (one rank per process) the DTensor wraps this process's shard.
In the simulator (every rank in this process) it wraps a ``LocalTensor`` holding
every rank's shard, for use under ``torch.distributed._local_tensor.LocalTensorMode``
with a fake process group of ``mesh.size`` ranks (how PyTorch tests DTensor on one
machine).  Placements map one to one: Replicate, Shard(dim), Partial(op) with
"avg" as DTensor's "avg".
"""
from __future__ import annotations

import torch

from ..sim_mesh.mesh import Mesh
from . import storage
from .dist_tensor import DistTensor, from_local
from .placement import Partial, Replicate, Shard

__all__ = ["to_device_mesh", "from_device_mesh", "to_dtensor_placements",
           "from_dtensor_placements", "to_dtensor", "from_dtensor"]


def _dt():
    from torch.distributed import tensor as dtensor
    return dtensor


def to_dtensor_placements(placements) -> tuple:
    """Our placements as DTensor's (``Shard(0)`` -> ``torch.distributed.tensor.Shard(0)``)."""
    t = _dt()
    out = []
    for p in placements:
        if isinstance(p, Replicate):
            out.append(t.Replicate())
        elif isinstance(p, Shard):
            out.append(t.Shard(p.dim))
        elif isinstance(p, Partial):
            out.append(t.Partial(p.reduce_op))
        else:
            raise TypeError(f"placement {p!r} is not a workbench Replicate / Shard / Partial")
    return tuple(out)


def from_dtensor_placements(placements) -> tuple:
    """DTensor's placements as ours; DTensor-only kinds raise a clear error."""
    t = _dt()
    out = []
    for p in placements:
        if isinstance(p, t.Replicate):
            out.append(Replicate())
        elif isinstance(p, t.Shard):
            out.append(Shard(p.dim))
        elif isinstance(p, t.Partial):
            out.append(Partial(p.reduce_op))
        else:
            raise TypeError(f"DTensor placement {p!r} has no workbench equivalent "
                            "(e.g. a strided or masked partial); redistribute it first")
    return tuple(out)


def to_device_mesh(mesh: Mesh, device_type: str = "cpu"):
    """The DeviceMesh over the same ranks and dim names (a process group must exist:
    the real one under torchrun, or a fake one of mesh.size ranks in the simulator)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, Mesh):
        raise TypeError(f"to_device_mesh(mesh={mesh!r:.60}): expected a workbench Mesh")
    if not dist.is_initialized():
        raise RuntimeError("to_device_mesh: no process group; under torchrun call "
                           "wb.distributed.init(), in the simulator init_process_group('fake', "
                           f"world_size={mesh.size}, store=FakeStore())")
    ranks = torch.tensor(mesh.ranks).reshape(mesh.shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=mesh.dim_names)


def from_device_mesh(device_mesh) -> Mesh:
    names = device_mesh.mesh_dim_names
    return Mesh(device_mesh.mesh.tolist(), dim_names=names)


def to_dtensor(x: DistTensor, device_mesh=None):
    """The same tensor as a DTensor on ``device_mesh`` (default: built from x.mesh)."""
    if not isinstance(x, DistTensor):
        raise TypeError(f"to_dtensor(x={type(x).__name__}): expected a DistTensor; make one "
                        "with shard_tensor()")
    t = _dt()
    dmesh = device_mesh if device_mesh is not None else to_device_mesh(x.mesh)
    ps = to_dtensor_placements(x.placements)
    if storage.holds_own(x.mesh):
        return t.DTensor.from_local(x.local(), dmesh, ps, shape=x.shape,
                                    stride=_contiguous_stride(x.shape))
    from torch.distributed._local_tensor import LocalTensor
    local = LocalTensor({r: x.local(r).clone() for r in x.mesh.ranks})
    return t.DTensor.from_local(local, dmesh, ps, shape=x.shape,
                                stride=_contiguous_stride(x.shape))


def from_dtensor(d, mesh: Mesh | None = None) -> DistTensor:
    """A DTensor as a DistTensor on ``mesh`` (default: built from its DeviceMesh)."""
    mesh = mesh if mesh is not None else from_device_mesh(d.device_mesh)
    ps = from_dtensor_placements(d.placements)
    local = d.to_local()
    if storage.holds_own(mesh):
        return from_local(local.detach(), mesh, ps, shape=d.shape)
    tensors = getattr(local, "_local_tensors", None)
    if tensors is None:
        raise TypeError("from_dtensor in the simulator needs a DTensor whose local is a "
                        "LocalTensor (made under LocalTensorMode); under torchrun, make the "
                        "mesh with wb.distributed.mesh")
    return from_local([tensors[r].detach() for r in mesh.ranks], mesh, ps, shape=d.shape)


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))
