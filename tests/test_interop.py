"""Meshes, placements and tensors to and from PyTorch DeviceMesh / DTensor."""
import pytest
import torch

import workbench as wb
from tests.dtensor_support import DTensor, LocalTensorMode, Oracle  # noqa: F401
from workbench.parallel import interop


@pytest.fixture(scope="module")
def fake_pg():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    o = Oracle()
    yield o
    o.close()


def test_placements_round_trip():
    ps = (wb.Replicate(), wb.Shard(1), wb.Partial("max"))
    d = interop.to_dtensor_placements(ps)
    assert [type(p).__name__ for p in d] == ["Replicate", "Shard", "Partial"]
    assert interop.from_dtensor_placements(d) == ps
    with pytest.raises(TypeError, match="not a workbench"):
        interop.to_dtensor_placements(["S(0)"])


@pytest.mark.parametrize("shape,ps", [((2, 2), ["S(0)", "S(1)"]), ((4,), ["P(sum)"]),
                                      ((2, 2), ["R", "S(0)"])])
def test_dist_tensor_to_dtensor_and_back(fake_pg, shape, ps):
    import math
    fake_pg.mesh(shape)                                   # the fake group of this size
    mesh = wb.Mesh.grid(shape, ["a", "b"][:len(shape)])
    x = torch.arange(48.).reshape(8, 6)
    t = wb.shard_tensor(x, mesh, ps)
    with LocalTensorMode(math.prod(shape)):
        dmesh = interop.to_device_mesh(mesh)
        assert dmesh.mesh_dim_names == mesh.dim_names
        d = interop.to_dtensor(t, dmesh)
        assert isinstance(d, DTensor) and tuple(d.shape) == (8, 6)
        assert interop.from_dtensor_placements(d.placements) == t.placements
        back = interop.from_dtensor(d, mesh)
        full = d.full_tensor()
    assert back.placements == t.placements
    for r in mesh.ranks:
        assert torch.equal(back.local(r), t.local(r))
    assert torch.equal(full._local_tensors[0], x)        # DTensor agrees on the value
    assert interop.from_device_mesh(dmesh) == mesh
