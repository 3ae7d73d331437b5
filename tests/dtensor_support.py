"""The DTensor oracle's process group, shared by the tests that hold workbench to
PyTorch DTensor under LocalTensorMode and a fake process group."""
import itertools
import math

import pytest
import torch
import torch.distributed as dist

import workbench as wb

if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

try:
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode  # noqa: F401
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: F401
    from torch.distributed.tensor import Partial as DPartial  # noqa: F401
    from torch.distributed.tensor import Replicate as DReplicate  # noqa: F401
    from torch.distributed.tensor import Shard as DShard  # noqa: F401
    from torch.distributed.tensor._redistribute import Redistribute  # noqa: F401
    from torch.distributed.tensor.debug import CommDebugMode  # noqa: F401
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
except ImportError as e:  # pragma: no cover - older torch
    pytest.skip(f"DTensor LocalTensorMode not available in this torch ({e})",
                allow_module_level=True)


# ---- the oracle: one fake process group at a time ------------------------------------------

class Oracle:
    """Owns the fake process group (re-made when the world size changes) and the
    DeviceMeshes built on it."""

    def __init__(self):
        self.world = None
        self.meshes = {}

    def mesh(self, shape) -> DeviceMesh:
        shape = tuple(shape)
        world = math.prod(shape)
        if self.world != world:
            self.close()
            dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
            self.world = world
        if shape not in self.meshes:
            self.meshes[shape] = DeviceMesh("cpu", torch.arange(world).reshape(shape))
        return self.meshes[shape]

    def close(self):
        if self.world is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.world = None
        self.meshes = {}


@pytest.fixture(scope="module")
def oracle():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process (by another "
                    "test); the DTensor oracle needs its own fake group")
    o = Oracle()
    try:
        yield o
    finally:
        o.close()
        from torch.distributed.tensor import _random
        from torch.distributed.tensor._redistribute import _gen_transform_infos
        _random._rng_tracker = None
        _gen_transform_infos.cache_clear()      # drop plans that hold the dead meshes
        assert not dist.is_initialized()


def to_dt(p):
    if isinstance(p, wb.Replicate):
        return DReplicate()
    if isinstance(p, wb.Shard):
        return DShard(p.dim)
    return DPartial(p.reduce_op)


def coords(mesh_shape):
    return list(itertools.product(*[range(n) for n in mesh_shape]))   # row-major = rank order


def ref_local(x, mesh_shape, placements, coord):
    """Nested torch.chunk, left to right over mesh dims, padded with empty chunks."""
    t = x
    for i, p in enumerate(placements):
        if isinstance(p, wb.Shard):
            n, d = mesh_shape[i], p.dim
            pieces = list(torch.chunk(t, n, d)) if t.shape[d] else []
            pieces += [t.narrow(d, t.shape[d], 0)] * (n - len(pieces))
            t = pieces[coord[i]]
    return t


def partial_locals(x, mesh_shape, placements):
    """Unequal integer parts that sum to x's shard exactly over the Partial mesh dims:
    part k = shard * (k + 1) + k for all but the last, the last the remainder."""
    pdims = [i for i, p in enumerate(placements) if isinstance(p, wb.Partial)]
    n = math.prod(mesh_shape[i] for i in pdims)
    as_rep = [wb.Replicate() if isinstance(p, wb.Partial) else p for p in placements]
    out = []
    for c in coords(mesh_shape):
        k = 0
        for i in pdims:
            k = k * mesh_shape[i] + c[i]
        base = ref_local(x, mesh_shape, as_rep, c)
        others = [base * (j + 1) + j for j in range(n - 1)]
        out.append((others[k] if k < n - 1 else base - sum(others, torch.zeros_like(base)))
                   .contiguous())
    return out
