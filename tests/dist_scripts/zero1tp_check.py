"""Run under torchrun (gloo, 4 processes, 2 x 2 dp x tp): zero1tp's reads of a gradient
before ``step()`` under ``ZeroRedundancyOptimizer(partition="chunks")`` (ZeRO-1, and ZeRO-2
with ``overlap_comm``) over tensor parallelism, against one device.  After one backward:
each parameter's ``p.grad`` placements, ``p.grad.full().norm()``, ``p.grad.norm()``,
``p.grad.sum()``, torch's ``clip_grad_norm_`` (what it raises), then the weights' sums
after the step.  Rank 0 prints one JSON line per read (an error's text where a read
raises); every rank's reads are checked equal (``same``: the gathered rows agree)."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import workbench as wb  # noqa: E402
from workbench.sim_mesh import backends  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from habits15_check import PLAN, mlp  # noqa: E402  (the same 45-parameter MLP and plan)
from habits13_check import start  # noqa: E402  (the job, its rank and batch)


def num(v):
    if not isinstance(v, torch.Tensor):
        return float(v)
    if isinstance(v, wb.DistTensor):
        v = v.full()
    with torch._C.DisableTorchFunctionSubclass():
        return float(v.detach())


def safe(f):
    try:
        with torch.no_grad():
            return f()
    except Exception as e:     # noqa: BLE001  (what raised, for the test to read)
        return f"{type(e).__name__}: {e}"


def full(g):
    return g.full() if isinstance(g, wb.DistTensor) else g


READS = {
    "full_norm": lambda g: num(full(g).norm()), "norm": lambda g: num(g.norm()),
    "sum": lambda g: num(g.sum()), "full_abs_max": lambda g: num(full(g).abs().max()),
}


def run(overlap, x, y):
    mesh = wb.distributed.mesh((2, 2), ["dp", "tp"])
    m = mlp()
    wb.parallelize_module(m, mesh, PLAN)
    wb.parallelize(m, mesh)
    ps = [p for _, p in wb.dist_parameters(m)]
    opt = wb.ZeroRedundancyOptimizer(ps, torch.optim.AdamW, mesh, "dp", partition="chunks",
                                     lr=1e-2, overlap_comm=overlap)
    out = m(wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()]))
    ((out.full() - y) ** 2).mean().backward()
    rows = {"placements": [safe(lambda p=p: str(p.grad.placements)) for p in ps]}
    rows.update({k: [safe(lambda p=p, f=f: f(p.grad)) for p in ps] for k, f in READS.items()})
    rows["clip"] = safe(lambda: float(nn.utils.clip_grad_norm_(ps, 1e9)))
    opt.step()
    rows["after_step"] = [num(p.sum()) for p in ps]
    return rows


def main():
    rank, x, y = start()
    ref = mlp()
    ((ref(x) - y) ** 2).mean().backward()
    one = {k: [num(f(p.grad)) for p in ref.parameters()] for k, f in READS.items()}
    one["placements"] = one["clip"] = None
    torch.optim.AdamW(ref.parameters(), lr=1e-2).step()
    one["after_step"] = [num(p.sum()) for p in ref.parameters()]
    for stage, overlap in (("zero1", False), ("zero2", True)):
        mine = run(overlap, x, y)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if rank == 0:
            for c in mine:
                print(json.dumps({"case": f"{stage}_{c}", "one": one[c], "wb": mine[c],
                                  "same": all(e[c] == mine[c] for e in every)}))
    dist.barrier()
    backends.shutdown()     # (several.py: its own, which keeps the group for the next part)


if __name__ == "__main__":
    main()
