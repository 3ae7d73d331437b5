"""Run under torchrun (gloo, 4 processes, 2 x 2 dp x tp): torch's own clip_grad_norm_
over FullyShardedDataParallel's / Zero3's / fully_shard's shards of a tensor-parallel
MLP, and over the module's own parameters (the templates), against one device: the
returned norms (norm types 2 and inf) and the parameters after the clipped SGD step.
Every rank prints one JSON line per case."""
import json
import math
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workbench as wb  # noqa: E402
from workbench.parallel.strategies.zero3 import Zero3  # noqa: E402

PLAN = {"0": "colwise", "2": "rowwise"}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def xy():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def case(kind, which, norm_type, mesh):
    ref, (x, y) = mlp(), xy()
    ((ref(x) - y) ** 2).mean().backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), norm.item() / 3, norm_type)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    model = wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")
    if kind == "fully_shard":
        w = wb.fully_shard(model, mesh=mesh["dp"])
    else:
        w = Zero3(model, mesh, "dp") if kind == "zero3" else \
            wb.FullyShardedDataParallel(model, mesh, "dp")
    opt = torch.optim.SGD(w.parameters(), lr=0.1)
    pl = [wb.Shard(0), wb.Replicate()]
    ((w(wb.shard_tensor(x, mesh, pl)) - wb.shard_tensor(y, mesh, pl)) ** 2).mean().backward()
    if hasattr(w, "finish_gradient_synchronization"):
        w.finish_gradient_synchronization()
    ps = w.parameters() if which == "wrapper" else model.parameters()
    try:
        got = torch.nn.utils.clip_grad_norm_(ps, norm.item() / 3, norm_type).item()
    except Exception as e:          # noqa: BLE001  (reported, not hidden)
        return {"case": [kind, which, norm_type], "raised": f"{type(e).__name__}: {e}"[:300]}
    opt.step()
    sd = model.state_dict()
    diff = max((sd[n].full() - p.detach()).abs().max().item()
               for n, p in ref.named_parameters())
    return {"case": [kind, which, norm_type], "norm": [got, want.item()], "params": diff}


def main():
    wb.distributed.init(timeout_s=120)
    mesh = wb.distributed.mesh((2, 2), ["dp", "tp"])
    rank = torch.distributed.get_rank()
    for kind in ("fsdp", "zero3", "fully_shard"):
        for which in ("wrapper", "model"):
            for norm_type in (2.0, math.inf):
                print(json.dumps({"rank": rank, **case(kind, which, norm_type, mesh)}),
                      flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
