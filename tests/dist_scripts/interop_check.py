"""Run under torchrun (4 processes): DistTensor <-> DTensor on the real process group."""
import torch

import workbench as wb
from workbench.parallel import interop

wb.distributed.init()
mesh = wb.distributed.mesh((2, 2), ("dp", "tp"))
x = torch.arange(48.).reshape(8, 6)
t = wb.shard_tensor(x, mesh, ["S(0)", "S(1)"])
d = interop.to_dtensor(t)
assert torch.equal(d.to_local(), t.local())
assert torch.equal(d.full_tensor(), x)                       # PyTorch's own all-gather
y = d.redistribute(d.device_mesh, interop.to_dtensor_placements([wb.Replicate(), wb.Shard(0)]))
back = interop.from_dtensor(y, mesh)
assert back.placements == (wb.Replicate(), wb.Shard(0))
assert torch.equal(back.full(), x)                           # and ours on the result
if wb.distributed.rank() == 0:
    print("interop ok", flush=True)
torch.distributed.barrier()
wb.distributed.shutdown()
