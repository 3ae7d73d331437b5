"""Run under torchrun (gloo, 2 processes): wb.checkpoint on torch.distributed, and its
format against torch.distributed.checkpoint both ways.  Each process prints one JSON
line of what it checked."""
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor, init_device_mesh
from torch.distributed.tensor import Replicate as TR, Shard as TS

import workbench as wb


def main(root):
    wb.distributed.init(timeout_s=60)
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 4, generator=g), torch.randn(5, generator=g)
    z = torch.randn(6, generator=g)
    mesh = wb.distributed.mesh((n,), ["x"])
    tmesh = init_device_mesh("cpu", (n,))
    out = {"rank": rank}

    # ours -> ours, Shard(0) -> Shard(1): each process reads only its pieces
    ours = os.path.join(root, "ours")
    wb.checkpoint.save(ours, {"w": wb.shard_tensor(x, mesh, [wb.Shard(0)]), "b": y, "step": 3})
    t = wb.shard_tensor(torch.zeros(6, 4), mesh, [wb.Shard(1)])
    st = {"w": t, "b": torch.zeros(5), "step": 0}
    rep = wb.checkpoint.load(ours, st)
    out["ours_to_ours"] = torch.equal(t.full(), x) and torch.equal(st["b"], y) and st["step"] == 3
    out["files"] = sorted(f for f in os.listdir(ours) if f.endswith(".distcp"))
    out["w_files_read"] = sorted({r.file for r in rep.reads if r.key == "w"})
    # a Shard(0) target: this process reads only its own rows' piece
    t0 = wb.shard_tensor(torch.zeros(6, 4), mesh, [wb.Shard(0)])
    rep0 = wb.checkpoint.load(ours, {"w": t0})
    out["own_rows_read"] = sorted({r.file for r in rep0.reads})

    # ours -> torch DCP, into DTensors of another placement
    dt = distribute_tensor(torch.zeros(6, 4), tmesh, [TS(1)])
    sd = {"w": dt, "b": torch.zeros(5), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=ours)
    out["ours_to_dcp"] = torch.equal(sd["w"].full_tensor(), x) and \
        torch.equal(sd["b"], y) and sd["step"] == 3

    # torch DCP (DTensors) -> ours, into another placement
    theirs = os.path.join(root, "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": distribute_tensor(x, tmesh, [TS(0)]), "r": distribute_tensor(z, tmesh, [TR()]),
                  "step": 4}, checkpoint_id=theirs)
    t = wb.shard_tensor(torch.zeros(6, 4), mesh, [wb.Shard(1)])
    r = wb.shard_tensor(torch.zeros(6), mesh, [wb.Shard(0)])
    st = {"w": t, "r": r, "step": 0}
    wb.checkpoint.load(theirs, st)
    out["dcp_to_ours"] = torch.equal(t.full(), x) and torch.equal(r.full(), z) and st["step"] == 4
    print(json.dumps(out), flush=True)
    dist.barrier()
    wb.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
