"""PyTorch's DeviceMesh names on a workbench :class:`~workbench.sim_mesh.mesh.Mesh`.

A user who knows ``torch.distributed.device_mesh`` writes::

    mesh = wb.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh.size(), mesh.size(1), mesh.mesh_dim_names, mesh.mesh   # 4, 2, ('dp', 'tp'), tensor
    mesh["dp"], mesh["dp", "tp"]                                 # sub-meshes by name
    mesh.get_local_rank("tp"), mesh.get_coordinate()             # this process's place

and gets DeviceMesh's answers (torch 2.13, ``torch/distributed/device_mesh.py``).  What
the simulator changes, said where it happens: every rank lives in this one process, so
there is no "current rank" to ask about (``get_local_rank``, ``get_coordinate`` and
``get_rank`` answer on a mesh of one rank, or under torchrun, and otherwise raise naming
``mesh.coordinate(rank)``); a sub-mesh by name is the one through the mesh's first rank
(under torchrun as well), as ``mesh["dp"]`` always is here.
"""
from __future__ import annotations

__all__ = ["MeshSize", "MeshDimNameError", "init_device_mesh", "check_names",
           "slice_by_names", "install"]


class MeshSize(int):
    """``mesh.size``: the number of ranks, an int, that can also be called as
    DeviceMesh's method: ``mesh.size()`` (every rank) and ``mesh.size(mesh_dim)`` (the
    ranks along one dim, given by index or name).  Made on each read (a Mesh stores no
    MeshSize, so pickled meshes and checkpoints are unchanged)."""

    def __new__(cls, mesh):
        self = super().__new__(cls, len(mesh.ranks))
        self._mesh = mesh
        return self

    def __call__(self, mesh_dim=None) -> int:
        """DeviceMesh.size(mesh_dim=None): every rank, or the ranks along ``mesh_dim``."""
        if mesh_dim is None:
            return int(self)
        m = self._mesh
        if isinstance(mesh_dim, str) and mesh_dim not in m.dim_names:
            raise KeyError(f"mesh.size({mesh_dim!r}): no mesh dim of that name; the mesh's "
                           f"dims are {list(m.dim_names)}")
        if not isinstance(mesh_dim, str) and (isinstance(mesh_dim, bool) or not isinstance(
                mesh_dim, int) or not -m.ndim <= mesh_dim < m.ndim):
            raise IndexError(f"mesh.size({mesh_dim!r}): give a mesh dim in [{-m.ndim}, "
                             f"{m.ndim - 1}] or a name in {list(m.dim_names)}")
        return m.shape[m.dim(mesh_dim)]

    def __reduce__(self):
        return (_plain_int, (int(self),))    # loads as the plain int it is


def _plain_int(n) -> int:
    """What a pickled :class:`MeshSize` loads as (allowed by ``torch.load``'s default
    ``weights_only=True``, as the library's other saved types are)."""
    return int(n)


class MeshDimNameError(KeyError, ValueError):
    """An unknown mesh dim name in ``mesh[...]``: a KeyError as DeviceMesh raises, and a
    ValueError as :meth:`Mesh.dim` raises for one."""

    def __str__(self) -> str:
        return str(self.args[0])


def check_names(mesh, names: tuple) -> list[int]:
    """The mesh dims ``names`` select, as DeviceMesh's ``__getitem__`` checks them: names
    of this mesh, each once, in the mesh's order."""
    bad = [n for n in names if not isinstance(n, str)]
    if bad or not names:
        raise TypeError(f"mesh[{names!r}]: index with dim names (strings), e.g. "
                        f"mesh[{mesh.dim_names[0]!r}]")
    unknown = [n for n in names if n not in mesh.dim_names]
    if unknown:
        raise MeshDimNameError(f"mesh[{names!r}]: {unknown[0]!r} is not a dim of this mesh; "
                               f"its dims are {list(mesh.dim_names)}")
    if len(set(names)) != len(names):
        raise RuntimeError(f"mesh[{names!r}] names a dim twice; name each dim once")
    dims = [mesh.dim_names.index(n) for n in names]
    if dims != sorted(dims):
        raise MeshDimNameError(f"mesh[{names!r}]: name the dims in the mesh's order "
                               f"{list(mesh.dim_names)} (DeviceMesh's rule), e.g. "
                               f"mesh[{tuple(mesh.dim_names[d] for d in sorted(dims))!r}]")
    return dims


def slice_by_names(mesh, names: tuple):
    """``mesh["dp", "tp"]``: the sub-mesh over those dims.  On simulated ranks, through
    the mesh's first rank (coordinate 0 on the dims left out); under torchrun, through
    this process's rank, as DeviceMesh's ``__getitem__`` gives it, its process groups
    the parent's own (:func:`backends.register_submesh`: no new group is made)."""
    from .mesh import Mesh
    from . import backends
    dims = check_names(mesh, names)
    if len(dims) == mesh.ndim:
        return mesh
    real = backends.is_distributed(mesh)
    base = list(mesh.coordinate(backends.rank())) if real else [0] * mesh.ndim

    def nest(k, coord):
        if k == len(dims):
            return mesh.rank_at(coord)
        out = []
        for i in range(mesh.shape[dims[k]]):
            coord[dims[k]] = i
            out.append(nest(k + 1, coord))
        coord[dims[k]] = base[dims[k]]
        return out
    sub = Mesh(nest(0, list(base)), dim_names=list(names))
    return backends.register_submesh(mesh, sub, dims) if real else sub


def _process_rank(mesh, what: str):
    """This process's global rank when ``mesh`` is one of a torch.distributed job's
    meshes; on simulated ranks, the one rank of a one-rank mesh, else an error."""
    from . import backends
    if backends.is_distributed(mesh):
        return backends.rank()
    if mesh.size == 1:
        return mesh.ranks[0]
    raise RuntimeError(
        f"{what} on simulated ranks: all {int(mesh.size)} ranks of {mesh} live in this one "
        "process, so there is no current rank; read a given rank's place with "
        "mesh.coordinate(rank) (its index along a dim: mesh.coordinate(rank)[mesh.dim(name)]), "
        "or run under torchrun with a mesh from wb.init_device_mesh / wb.distributed.mesh")


def _get_rank(self) -> int:
    """DeviceMesh.get_rank(): this process's global rank (see :func:`_process_rank`)."""
    return _process_rank(self, "get_rank()")


def _get_coordinate(self):
    """DeviceMesh.get_coordinate(): this process's coordinate on every mesh dim."""
    return self.coordinate(_process_rank(self, "get_coordinate()"))


def _get_local_rank(self, mesh_dim=None) -> int:
    """DeviceMesh.get_local_rank(mesh_dim): this process's index along ``mesh_dim`` (a
    name or an index; may be left out on a 1-d mesh)."""
    if mesh_dim is None:
        if self.ndim > 1:
            raise RuntimeError(f"get_local_rank() on a {self.ndim}-d mesh: mesh_dim needs to "
                               f"be given, one of {list(self.dim_names)}")
        mesh_dim = 0
    d = self.dim(mesh_dim)
    return self.coordinate(_process_rank(self, f"get_local_rank({mesh_dim!r})"))[d]


def _mesh_tensor(self):
    """DeviceMesh.mesh: the ranks as an int64 tensor of the mesh's shape."""
    import torch
    return torch.tensor(self.ranks, dtype=torch.int64).reshape(self.shape)


def install(cls) -> None:
    cls.mesh_dim_names = property(lambda self: self.dim_names)
    cls.mesh = property(_mesh_tensor)
    cls.get_rank = _get_rank
    cls.get_local_rank = _get_local_rank
    cls.get_coordinate = _get_coordinate


def init_device_mesh(device_type: str, mesh_shape, *, mesh_dim_names=None,
                     backend_override=None):
    """``torch.distributed.device_mesh.init_device_mesh`` for a workbench Mesh: ranks
    0 .. prod(mesh_shape)-1 in row-major order, one name per dim.  Simulated ranks unless
    this process belongs to a torch.distributed job (``wb.distributed.init()`` under
    torchrun): then the mesh's process groups are made (:func:`backends.mesh`), a
    collective every process runs in the same order.  ``device_type`` is checked and
    otherwise not used (tensors stay where you put them)."""
    if not isinstance(device_type, str) or not device_type:
        raise TypeError(f"init_device_mesh(device_type={device_type!r}): give a device type "
                        "string, e.g. 'cpu', 'cuda' or 'npu'")
    if backend_override is not None:
        raise NotImplementedError("init_device_mesh(backend_override=...): every mesh dim uses "
                                  "the job's backend here; leave it None")
    if isinstance(mesh_shape, int) and not isinstance(mesh_shape, bool):
        mesh_shape = (mesh_shape,)
    if not isinstance(mesh_shape, (tuple, list)):
        raise TypeError(f"init_device_mesh(mesh_shape={mesh_shape!r}): give a tuple of ints, "
                        "e.g. (2, 4)")
    if mesh_dim_names is not None:
        if isinstance(mesh_dim_names, str) or not isinstance(mesh_dim_names, (tuple, list)):
            raise TypeError(f"init_device_mesh(mesh_dim_names={mesh_dim_names!r}): give a tuple "
                            "of names, one per mesh dim, e.g. ('dp', 'tp')")
        if len(mesh_dim_names) != len(mesh_shape):
            raise ValueError(f"init_device_mesh(mesh_shape={tuple(mesh_shape)}, mesh_dim_names="
                             f"{tuple(mesh_dim_names)}): give one name per mesh dim")
    import torch.distributed as dist
    from . import backends
    from .mesh import Mesh
    if dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake":
        return backends.mesh(tuple(mesh_shape), mesh_dim_names)
    return Mesh.grid(tuple(mesh_shape), mesh_dim_names)


def _allow_in_checkpoints() -> None:
    import torch
    torch.serialization.add_safe_globals([_plain_int])


_allow_in_checkpoints()
