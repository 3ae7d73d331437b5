"""Run under torchrun (gloo, 2 processes, a dp 2 mesh, init timeout_s=5):
``ZeroRedundancyOptimizer(partition="chunks")`` over DistTensor parameters, a user's
reads of ``p.grad`` before ``opt.step()`` (ZeRO-1: each process's share, Partial("sum")
over dp, so a read all-reduces) that not every process makes (tests/test_readsync.py).
Each process prints JSON rows:

* ``lone``: rank 0 alone reads ``p.grad.norm()`` (``if rank == 0: print(p.grad.norm())``):
  what it raised (or gave) and after how many seconds; rank 1 waits on the store;
* ``both``: then both read every ``p.grad.norm()`` (one device's gradient norms);
* ``after_step``: both step, then every parameter's sum (one device's AdamW step);
* ``zero2``: the same model under ZeRO-2 (``overlap_comm=True``): what ``p.grad`` is on
  each process before the step (its reduced shard lives in the optimizer);
* ``scaler_zero1`` / ``scaler_zero2``: torch's ShardedGradScaler on ZeRO-1 / ZeRO-2, a
  user's AMP loop (``scaler.scale(loss).backward(); scaler.unscale_(opt);
  scaler.step(opt); scaler.update()``) over three batches, the second with an inf: after
  each step every parameter's sum and the scale (tests/test_readsync.py);
* ``scaler_lone``: rank 0 alone reads a shard's ``.grad`` (its first read reduce-scatters):
  what it raised and after how many seconds;
* ``scaler_fully_shard`` / ``scaler_ddp``: the same AMP loop on ``wb.fully_shard``
  (ShardedGradScaler) and ``wb.DistributedDataParallel`` (torch's GradScaler)."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import workbench as wb  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixlist16_check import attempt, finish, lone_read, mlp  # noqa: E402  (the same MLP, read, end)


def build(mesh, overlap):
    m = mlp()
    wb.parallelize(m, mesh)
    ps = [p for _, p in wb.dist_parameters(m)]
    opt = wb.ZeroRedundancyOptimizer(ps, torch.optim.AdamW, mesh, "dp", partition="chunks",
                                     lr=1e-2, overlap_comm=overlap)
    return m, ps, opt


def backward(m, mesh, rank):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)
    out = m(wb.shard_tensor(x, mesh, [wb.Shard(0)]))
    ((out.full() - y) ** 2).mean().backward()


def main():
    wb.distributed.init(timeout_s=5)
    rank = dist.get_rank()
    mesh = wb.distributed.mesh((2,), ["dp"])
    m, ps, opt = build(mesh, False)
    backward(m, mesh, rank)
    rows = []
    lone_read(rank, rows, "lone", lambda: ps[0].grad.norm())
    rows.append({"case": "both", "out": [attempt(lambda: p.grad.norm())[0] for p in ps]})
    opt.step()
    rows.append({"case": "after_step", "out": [attempt(lambda: p.sum())[0] for p in ps]})
    m2, ps2, opt2 = build(mesh, True)
    backward(m2, mesh, rank)
    rows.append({"case": "zero2", "out": [attempt(lambda: p.grad.norm())[0] for p in ps2]})
    opt2.step()
    rows += scaler_rows(rank, mesh)
    finish(rank, rows)


def batches():
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)) for _ in range(3)]
    out[1][0][3, 1] = float("inf")       # rank 0's half of the second batch
    return out


def scaler_rows(rank, mesh):
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
        rows.append({"case": f"scaler_zero{stage}", "out": steps})
    m, ps, opt = build(mesh, False)
    backward(m, mesh, rank)
    lone_read(rank, rows, "scaler_lone", lambda: opt.shards[0].grad.sum())
    opt.step()                              # the job goes on
    # the same loop on wb.fully_shard (ShardedGradScaler, as FSDP2's users) and on
    # wb.DistributedDataParallel (torch's plain GradScaler), each process its half batch
    for kind in ("fully_shard", "ddp"):
        m = mlp()
        if kind == "fully_shard":
            wb.fully_shard(m)
            w, sc = m, ShardedGradScaler("cpu", init_scale=2.0 ** 10)
        else:
            w, sc = wb.DistributedDataParallel(m), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        opt = torch.optim.AdamW(w.parameters(), lr=1e-2)
        steps = []
        for x, y in batches():
            opt.zero_grad()
            sc.scale(((w(x.chunk(2)[rank]) - y.chunk(2)[rank]) ** 2).mean()).backward()
            sc.unscale_(opt)
            sc.step(opt)
            sc.update()
            with torch.no_grad():
                steps.append({"sums": [float(p.sum()) for p in w.parameters()],
                              "scale": sc.get_scale()})
        rows.append({"case": f"scaler_{kind}", "out": steps})
    return rows


if __name__ == "__main__":
    main()
