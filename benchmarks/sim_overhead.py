"""How much does simulating 8 tensor-parallel ranks cost over one device?

A 2-layer MLP (column-parallel then row-parallel linear, Megatron style), forward
and backward, timed side by side in one run:

* one device (plain torch);
* workbench: 8 simulated ranks, ``wb.parallelize``-style DistTensors;
* PyTorch DTensor under ``LocalTensorMode`` (8 ranks in one process, fake process group).

Printed as ratios to the single-device step, at toy size (tokens 32, hidden 64)
and large size (tokens 1024, hidden 512). Targets (issue 3): workbench at most
3x single-device at toy size and at most 1.15x at large size.

    python benchmarks/sim_overhead.py
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import workbench as wb

TP = 8


def timeit(fn, min_time=1.0, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    t_end = time.perf_counter() + min_time
    while time.perf_counter() < t_end or len(times) < 10:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def single_step(X, W1, W2):
    w1 = W1.clone().requires_grad_()
    w2 = W2.clone().requires_grad_()

    def step():
        w1.grad = w2.grad = None
        y = F.linear(torch.relu(F.linear(X, w1)), w2)
        y.sum().backward()
    return step


def workbench_step(X, W1, W2):
    mesh = wb.Mesh.grid(TP, ["tp"])
    x = wb.shard_tensor(X, mesh, [wb.Replicate()])
    w1 = wb.shard_tensor(W1, mesh, [wb.Shard(0)]).requires_grad_()     # column parallel
    w2 = wb.shard_tensor(W2, mesh, [wb.Shard(1)]).requires_grad_()     # row parallel

    def step():
        w1.grad = None
        w2.grad = None
        y = F.linear(torch.relu(F.linear(x, w1)), w2)
        y.sum().backward()
    return step


def dtensor_step(X, W1, W2):
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=TP, store=FakeStore())
    mesh = DeviceMesh("cpu", torch.arange(TP))
    mode = LocalTensorMode(TP)
    with mode:
        lt = lambda t: LocalTensor({r: t.clone() for r in range(TP)})  # noqa: E731
        x = distribute_tensor(lt(X), mesh, [Replicate()])
        w1 = distribute_tensor(lt(W1), mesh, [Shard(0)]).requires_grad_()
        w2 = distribute_tensor(lt(W2), mesh, [Shard(1)]).requires_grad_()

    def step():
        with mode:
            w1.grad = None
            w2.grad = None
            y = F.linear(torch.relu(F.linear(x, w1)), w2)
            y.sum().backward()
    return step


def check_equal(X, W1, W2):
    """The simulated gradients equal one device's (a benchmark of a wrong thing is worthless)."""
    mesh = wb.Mesh.grid(TP, ["tp"])
    x = wb.shard_tensor(X, mesh, [wb.Replicate()])
    w1 = wb.shard_tensor(W1, mesh, [wb.Shard(0)]).requires_grad_()
    w2 = wb.shard_tensor(W2, mesh, [wb.Shard(1)]).requires_grad_()
    F.linear(torch.relu(F.linear(x, w1)), w2).sum().backward()
    a, b = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    F.linear(torch.relu(F.linear(X, a)), b).sum().backward()
    torch.testing.assert_close(w1.grad.full(), a.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w2.grad.full(), b.grad, rtol=1e-4, atol=1e-4)


def main() -> int:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {TP} simulated ranks")
    print(f"{'size':<26}{'one device':>12}{'workbench':>12}{'ratio':>8}{'DTensor':>12}{'ratio':>8}"
          f"{'wb speedup':>12}  target")
    ok = True
    for name, (T, H), target in [("toy (T=32, H=64)", (32, 64), 3.0),
                                 ("large (T=1024, H=512)", (1024, 512), 1.15)]:
        X = torch.randn(T, H)
        W1, W2 = torch.randn(4 * H, H) / H ** 0.5, torch.randn(H, 4 * H) / H ** 0.5
        check_equal(X, W1, W2)
        t1 = timeit(single_step(X, W1, W2))
        tw = timeit(workbench_step(X, W1, W2))
        try:
            td = timeit(dtensor_step(X, W1, W2), min_time=1.0, warmup=2)
        except Exception as e:  # noqa: BLE001 - report, keep the rest
            print(f"  (DTensor LocalTensorMode unavailable: {type(e).__name__}: {e})")
            td = float("nan")
        r = tw / t1
        hit = r <= target
        ok &= hit
        print(f"{name:<26}{t1 * 1e6:>10.0f}us{tw * 1e6:>10.0f}us{r:>7.2f}x{td * 1e6:>10.0f}us"
              f"{td / t1:>7.1f}x{td / tw:>11.1f}x  <= {target}x {'PASS' if hit else 'MISS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
