"""``mesh["tp"]`` / ``mesh["dp", "tp"]`` under torchrun (4 gloo processes, a 2 x 2 mesh):
each process's sub-mesh is the one through its own rank, as torch's DeviceMesh gives it,
and collectives on it run in its process group (tests/test_device_mesh_torchrun.py).
Prints one JSON row per process."""
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

import workbench as wb


def main():
    wb.distributed.init(timeout_s=60)
    rank = dist.get_rank()
    mesh = wb.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tmesh = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    row = {"rank": rank}
    for name in ("dp", "tp"):
        sub = mesh[name]
        row[name] = list(sub.ranks)
        row["torch_" + name] = tmesh[name].mesh.tolist()
        # a collective on the sub-mesh: a Partial of each process's rank, reduced over it
        x = torch.full((2,), float(rank))
        d = wb.DistTensor.from_local(x, sub, [wb.Partial()])
        row["sum_" + name] = d.full_tensor().tolist()
    row["both"] = list(mesh["dp", "tp"].ranks)
    print(json.dumps(row), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
