"""Run under torchrun: init with a short timeout, then loop forever, all-reducing on a
subgroup (a mesh dim) or, with ``idle``, only sleeping (no collective pending when a
rank freezes).  Each rank prints "ready <rank> <pid>"; the test kills or stops one and
expects the job to end, non-zero, within the timeout.

    torchrun --nproc-per-node 4 fault_check.py TIMEOUT_S [collectives|idle]"""
import os
import sys
import time
from datetime import timedelta

import torch

import workbench as wb

# Every rank here before any starts init(): init's timeout (a few seconds, the one under
# test) also bounds its own rendezvous (each rank waits in the store for its peers'
# addresses), and on a loaded machine the ranks' imports can end seconds apart.  The
# barrier waits on torchrun's own store with a long timeout of its own.
_store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    is_master=False, timeout=timedelta(seconds=300))
_store.set(f"fault_check/arrived/{os.environ['RANK']}", "1")
_store.wait([f"fault_check/arrived/{r}" for r in range(int(os.environ["WORLD_SIZE"]))])
wb.distributed.init(timeout_s=float(sys.argv[1]))
mode = sys.argv[2] if len(sys.argv) > 2 else "collectives"
mesh = wb.distributed.mesh((2, wb.distributed.world_size() // 2), ("dp", "tp"))
x = wb.shard_tensor(torch.ones(4, 4), mesh, [wb.Shard(0), wb.Replicate()])
print(f"ready {wb.distributed.rank()} {os.getpid()}", flush=True)
while True:
    if mode == "collectives":                # all-reduces on the "dp" subgroups
        wb.collectives.all_reduce(x._local, mesh, 0)
    time.sleep(0.01)
