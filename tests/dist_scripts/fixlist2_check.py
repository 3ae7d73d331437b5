"""Run under torchrun (gloo, 2 processes) by tests/test_fixlist2.py: torch's own
DistributedDataParallel, wb's (mesh=None) and wb's DistTensor mode on a, b, c where b is
skipped or used on some ranks only.  Each rank prints one JSON line per case: every
parameter's gradient (its first values) after the case's steps, or the error raised."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
import workbench as wb

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4,4).double(), nn.Linear(4,4).double(), nn.Linear(4,2).double()
    def forward(self, x, mode="all"):
        y = torch.tanh(self.a(x))
        if mode == "skip_b": return self.c(y)
        if mode == "zero_b": return self.c(y + 0 * self.b(y))
        return self.c(torch.tanh(self.b(y)))

def batch(step, rank, n):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, generator=g, dtype=torch.float64).chunk(n)[rank]

def run(wrap, kw, modes, rank, n, dt=False):
    m = Net()
    if dt:
        mesh = wb.distributed.mesh(n, ["dp"])
        ddp = wb.DistributedDataParallel(wb.parallelize(m, mesh, {}), mesh, "dp", **kw)
    else:
        ddp = wrap(m, **kw)
    for step, mode in enumerate(modes):
        mode = mode.split("|")[0 if rank == 0 else 1] if "|" in mode else mode
        if mode == "none":
            continue
        if dt:
            # this process's rows (from_local: no collective, so one rank may stop early)
            x = wb.DistTensor.from_local(batch(step, rank, n), mesh, [wb.Shard(0)])
        else:
            x = batch(step, rank, n)
        if mode == "fwd":                   # the next forward only (grad enabled)
            ddp(x, "all")
            continue
        ddp(x, mode).mean().backward()
        if dt: ddp.finish_gradient_synchronization()
    return {k.replace("module.", ""): None if p.grad is None else p.grad.flatten().tolist()
            for k, p in ddp.named_parameters()}

def main(end=os._exit):
    """The cases named in sys.argv, then ``end(0)``: by default the process ends there, the
    process group's teardown skipped (ddp_unused_check.py passes another ``end`` and runs
    review_revI_check's cases next)."""
    wb.distributed.init(timeout_s=30)
    n, rank = dist.get_world_size(), dist.get_rank()
    cases = {"A_unused_everywhere": ({}, ["skip_b", "skip_b"]),
             "B_used_rank0": ({"find_unused_parameters": True}, ["all|skip_b"]),
             "C_zero_used_rank0": ({"find_unused_parameters": True}, ["zero_b|skip_b"]),
             "D_stale_then_rank0": ({"find_unused_parameters": True}, ["all", "all|skip_b"]),
             # b used on rank 0 with an exactly zero gradient, skipped on rank 1
             # (torch's reducer waits forever on rank 0 there: not run; rank 0 stops)
             "E_zero_used_rank0_strict": ({}, ["zero_b|skip_b", "none|fwd"]),
             # a stale gradient on rank 1, where b is skipped
             "F_stale_strict": ({}, ["all", "all|skip_b", "none|fwd"])}
    for name in sys.argv[1:]:
        kw, modes = cases[name]
        row = {"case": name, "rank": rank}
        for who in ["torch", "wb", "wbdt"]:
            if who == "torch" and name.endswith("_strict"):
                continue
            try:
                row[who] = run(nn.parallel.DistributedDataParallel if who == "torch" else wb.DistributedDataParallel, kw, modes, rank, n, dt=(who == "wbdt"))
            except Exception as e:
                row[who] = type(e).__name__ + ": " + str(e)[:700]
            dist.barrier()
        print(json.dumps(row), flush=True)
    end(0)
if __name__ == "__main__":
    main()
