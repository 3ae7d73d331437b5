"""CPU time per dispatched op, measured with ``time.process_time`` (wall clock on a
shared machine is too noisy to compare two versions of the dispatcher).

Three chains on 8 simulated ranks, forward and backward, beside one device:

* even: the toy tensor-parallel MLP of ``sim_overhead.py`` (T=32, H=64);
* uneven: an elementwise chain (tanh, mul, add, sum) on 30 rows sharded over 8 ranks
  (the per-cell path: one local call per rank);
* traced: the even chain under a trace (pricing and the backward compute event).

    PYTHONPATH=. python benchmarks/dispatch_cpu.py [calls]

(``PYTHONPATH=.``: a script run by path otherwise imports the installed ``workbench``,
not the checkout it sits in.)
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import workbench as wb

TP = 8
OPS_PER_STEP = 4        # linear, relu, linear, sum (forward; their backward rides along)


def cpu_per_call(fn, calls):
    for _ in range(5):
        fn()
    t = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t) / calls


def one_device(X, W1, W2):
    w1, w2 = W1.clone().requires_grad_(), W2.clone().requires_grad_()

    def step():
        w1.grad = w2.grad = None
        F.linear(torch.relu(F.linear(X, w1)), w2).sum().backward()
    return step


def simulated(X, W1, W2, x_ps, traced=False):
    mesh = wb.Mesh.grid(TP, ["tp"])
    x = wb.shard_tensor(X, mesh, x_ps)
    w1 = wb.shard_tensor(W1, mesh, [wb.Shard(0)]).requires_grad_()
    w2 = wb.shard_tensor(W2, mesh, [wb.Shard(1)]).requires_grad_()

    def step():
        w1.grad = w2.grad = None
        F.linear(torch.relu(F.linear(x, w1)), w2).sum().backward()

    if not traced:
        return step

    def traced_step():
        with wb.trace():
            step()
    return traced_step


def one_device_chain(X):
    x = X.clone().requires_grad_()

    def step():
        x.grad = None
        (torch.tanh(x) * 3 + x).sum().backward()
    return step


def uneven_chain(X):
    mesh = wb.Mesh.grid(TP, ["tp"])
    x = wb.shard_tensor(X, mesh, [wb.Shard(0)]).requires_grad_()
    assert not x.is_even

    def step():
        x.grad = None
        (torch.tanh(x) * 3 + x).sum().backward()
    return step


def main() -> int:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    torch.manual_seed(0)
    H = 64
    W1, W2 = torch.randn(4 * H, H) / H ** 0.5, torch.randn(H, 4 * H) / H ** 0.5
    X, Xu = torch.randn(32, H), torch.randn(30, H)
    t1 = cpu_per_call(one_device(X, W1, W2), calls)
    tu = cpu_per_call(one_device_chain(Xu), calls)
    print(f"one device        {t1 * 1e6:8.0f} us CPU/step (MLP), {tu * 1e6:.0f} us (chain)")
    for name, fn, ref in [("even (TP MLP)", simulated(X, W1, W2, [wb.Replicate()]), t1),
                          ("uneven (30 rows)", uneven_chain(Xu), tu),
                          ("even, traced", simulated(X, W1, W2, [wb.Replicate()], traced=True),
                           t1)]:
        t = cpu_per_call(fn, calls)
        print(f"{name:<18}{t * 1e6:8.0f} us CPU/step  {t / OPS_PER_STEP * 1e6:6.0f} us/op  "
              f"{t / ref:5.2f}x one device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
