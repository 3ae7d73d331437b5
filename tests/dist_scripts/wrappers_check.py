"""Run under torchrun (gloo): DDP, FSDP and ZeroRedundancyOptimizer on the process
group give one device's parameters and the simulation's.  Rank 0 prints one JSON
line per case: the largest difference to one device and to the simulated ranks."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workbench as wb  # noqa: E402
from wrappers_model import CASES, one_device, wrapped  # noqa: E402


def diff(a, b):
    return max((a[n].float() - b[n].float()).abs().max().item() for n in b)


def main():
    wb.distributed.init(timeout_s=60)
    n, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    for kind, opt, cd, bucket in CASES:
        cd = getattr(torch, cd) if cd else None
        got = wrapped(kind, opt, None, cd, bucket)
        ref = one_device(opt, cd)
        sim = wrapped(kind, opt, wb.Mesh.grid(n, ["dp"]), cd, bucket)
        if rank == 0:
            print(json.dumps({"case": [kind, opt, str(cd), bucket], "one_device": diff(got, ref),
                              "simulated": diff(got, sim),
                              "frozen_kept": torch.equal(got["frozen"], ref["frozen"]),
                              "unused_kept": torch.equal(got["unused"], ref["unused"])}),
                  flush=True)
    # FSDP units on processes: the gathered weights alive at once, per process
    from tests.test_fsdp_units import Block, Net
    torch.manual_seed(0)
    f = wb.FullyShardedDataParallel(Net(), units={Block})
    ids = torch.randint(0, 10, (4, 3))
    f.gathered.reset_peak()
    loss = f(ids).sum()
    fwd = f.gathered.peak
    f.gathered.reset_peak()
    loss.backward()
    if rank == 0:
        print(json.dumps({"memory": [fwd, f.gathered.peak, f.gathered.alive()]}), flush=True)
    # the replica check: equal after construction; a drifted rank is found
    m = wb.DistributedDataParallel(__import__("wrappers_model").make())
    m.check_replicas()
    if rank == n - 1:
        with torch.no_grad():
            m.module.hid.bias[0] += 1.0
    try:
        m.check_replicas()
        found = False
    except RuntimeError:
        found = True
    if rank == 0:
        print(json.dumps({"drift_found": found}), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
