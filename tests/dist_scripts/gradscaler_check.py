"""Run under torchrun (gloo, 2 processes, a dp 2 mesh): torch's ShardedGradScaler on
``ZeroRedundancyOptimizer(partition="chunks")`` (ZeRO-1 and ZeRO-2), a user's AMP loop
(``scaler.scale(loss).backward(); scaler.unscale_(opt); scaler.step(opt);
scaler.update()``) over three batches, the second with an inf (tests/test_gradscaler.py).
Each process prints JSON rows ``zero{1,2}``: after each step every parameter's sum and
the scale; ``lone``: rank 0 alone reads a shard's ``.grad`` (its first read
reduce-scatters), what it raised and after how many seconds (init timeout_s=5)."""
import os
import sys

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import workbench as wb  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixlist16_check import finish, lone_read  # noqa: E402  (rows printed, lone read)
from readsync_check import backward, build  # noqa: E402  (the MLP under ZeRO-1 / 2)


def batches():
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)) for _ in range(3)]
    out[1][0][3, 1] = float("inf")       # rank 0's half of the second batch
    return out


def main():
    wb.distributed.init(timeout_s=5)
    rank = torch.distributed.get_rank()
    mesh = wb.distributed.mesh((2,), ["dp"])
    rows = []
    for stage in (1, 2):
        m, ps, opt = build(mesh, stage == 2)
        sc = ShardedGradScaler("cpu", init_scale=2.0 ** 10)
        steps = []
        for x, y in batches():
            opt.zero_grad()
            out = m(wb.shard_tensor(x, mesh, [wb.Shard(0)]))
            sc.scale(((out.full() - y) ** 2).mean()).backward()
            sc.unscale_(opt)
            sc.step(opt)
            sc.update()
            with torch.no_grad():
                steps.append({"sums": [float(p.sum()) for p in ps], "scale": sc.get_scale()})
        rows.append({"case": f"zero{stage}", "out": steps})
    m, ps, opt = build(mesh, False)
    backward(m, mesh, rank)
    lone_read(rank, rows, "lone", lambda: opt.shards[0].grad.sum())
    opt.step()                              # the job goes on
    finish(rank, rows)


if __name__ == "__main__":
    main()
