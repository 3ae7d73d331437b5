"""Run under torchrun (gloo, 2 processes, a 1 x 2 dp x tp mesh, init timeout_s=5):
``wb.DistributedDataParallel`` over tensor parallelism, a user's reads of its parameters
that not every process makes (tests/test_fixlist16.py).  Each process prints JSON rows:

* ``lone``: rank 0 alone reads ``p.norm()`` (the logging habit ``if rank == 0:
  print(p.norm())``); what it raised (or gave) and after how many seconds; rank 1 waits
  on the store meanwhile (no collective);
* ``step``: then both run a forward and backward, and read ``p.norm()`` together: the
  norms (one device's);
* ``mixed``: rank 0 reads ``0.weight``'s norm, rank 1 ``2.weight``'s (both shards 3 x 3):
  what each raised (or gave);
* ``after``: both read ``0.weight``'s norm again;
* ``fs_lone`` / ``fs_both``: the same with ``wb.fully_shard`` on the default group (its
  reads gather the 2 processes' chunks): rank 0 alone, then both."""
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import workbench as wb  # noqa: E402

PLAN = {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3))


def attempt(f):
    t0 = time.monotonic()
    try:
        with torch.no_grad():
            out = float(f())
    except Exception as e:     # noqa: BLE001  (what raised, for the test to read)
        out = f"{type(e).__name__}: {e}"
    return out, round(time.monotonic() - t0, 1)


def main():
    wb.distributed.init(timeout_s=5)
    rank = dist.get_rank()
    mesh = wb.distributed.mesh((1, 2), ["dp", "tp"])
    m = mlp()
    wb.parallelize_module(m, mesh, PLAN)
    wb.parallelize(m, mesh)
    ddp = wb.DistributedDataParallel(m, mesh, dim="dp")
    ps = list(ddp.parameters())
    rows = []
    lone_read(rank, rows, "lone", lambda: ps[0].norm())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, generator=g)
    y = ddp(wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()]))
    y.full().pow(2).mean().backward()
    rows.append({"case": "step", "out": [attempt(lambda: p.norm())[0] for p in ps]})
    rows.append({"case": "mixed", "out": attempt(lambda: ps[2 * rank].norm())[0]})
    rows.append({"case": "after", "out": attempt(lambda: ps[0].norm())[0]})
    # wb.fully_shard on the default process group (2 dp ranks): its parameters' reads
    # gather the chunks (FSDP2's DTensor full tensor), the same
    fs = mlp()
    wb.fully_shard(fs)
    qs = list(fs.parameters())
    lone_read(rank, rows, "fs_lone", lambda: qs[0].norm())
    rows.append({"case": "fs_both", "out": [attempt(lambda: q.norm())[0] for q in qs]})
    finish(rank, rows)


def lone_read(rank, rows, case, read):
    """Rank 0 alone makes ``read`` (timed: its row ``case``); the others wait on the
    job's store meanwhile (no collective).  The key names the running script (its
    ``sys.argv[0]``): readsync_check.py reads with the same case names, and the two run
    one after another in one launch (tests/torchrun_support.py LONE_READS)."""
    store = dist.distributed_c10d._get_default_store()
    key = f"lone_read/{os.path.basename(sys.argv[0])}/{case}"
    if rank == 0:
        out, s = attempt(read)
        rows.append({"case": case, "out": out, "s": s})
        store.set(key, "1")
    else:
        store.wait([key], timedelta(seconds=120))


def finish(rank, rows):
    """Print this process's rows as JSON lines, then end the job together."""
    for r in rows:
        print(json.dumps({"rank": rank, **r}), flush=True)
    dist.barrier()
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
