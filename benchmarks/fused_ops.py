"""Fused operators side by side: the readable reference, the fast path, the unfused composition.

    python benchmarks/fused_ops.py            # about a minute on a 2-core CPU

For each op at two sizes it prints the best wall time of the forward pass
and of forward + backward on each path, and the bytes the fused kernel and the
unfused composition move (``wb.ops.cost``: the numbers the cost model uses).
The "fast" path is what ``wb.ops`` picks automatically on this machine
(``native`` here; ``npu`` on an Ascend device).

The line to watch: FlashAttention-2's readable reference (Python loops over
128 x 128 tiles, batched over heads) against PyTorch's fused
``scaled_dot_product_attention`` at sequence length 1024.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

import workbench.npu as npu
import workbench.ops as ops

PATHS = ("reference", "fast", "unfused")


@dataclass
class Case:
    op: str
    size: str
    make: Callable[[], tuple]          # -> (args, kwargs); float tensors that need grad have it
    differentiable: bool = True


def attention(B, H, S, D, causal=False):
    def make():
        q, k, v = (torch.randn(B, H, S, D, device=DEVICE, requires_grad=True) for _ in range(3))
        return (q, k, v), dict(causal=causal)
    return make


def rows(n, d, *extra):
    def make():
        x = torch.randn(n, d, device=DEVICE, requires_grad=True)
        return (x, *(t() for t in extra)), {}
    return make


def rotary(B, H, S, D):
    def make():
        x = torch.randn(B, H, S, D, device=DEVICE, requires_grad=True)
        return (x, *ops.rope_cos_sin(S, D, device=DEVICE)), {}
    return make


def linear(n, d_in, d_out):
    def make():
        x = torch.randn(n, d_in, device=DEVICE, requires_grad=True)
        w = (torch.randn(d_out, d_in, device=DEVICE) / d_in ** 0.5).requires_grad_()
        return (x, w, torch.zeros(d_out, device=DEVICE, requires_grad=True)), {}
    return make


def adamw(n):
    def make():
        params = [torch.randn(n, device=DEVICE)]
        state = [[torch.randn(n, device=DEVICE)], [torch.zeros(n, device=DEVICE)],
                 [torch.zeros(n, device=DEVICE)]]
        return (params, *state, 1), dict(lr=1e-3)
    return make


DEVICE = npu.device()
CASES = [
    Case("flash_attention", "B1 H8 S512 D64", attention(1, 8, 512, 64)),
    Case("flash_attention", "B1 H8 S1024 D64", attention(1, 8, 1024, 64)),
    Case("flash_attention", "B1 H8 S1024 D64 causal", attention(1, 8, 1024, 64, causal=True)),
    Case("rms_norm", "1024 x 1024", rows(1024, 1024, lambda: torch.ones(1024, device=DEVICE,
                                                                         requires_grad=True))),
    Case("rms_norm", "4096 x 4096", rows(4096, 4096, lambda: torch.ones(4096, device=DEVICE,
                                                                         requires_grad=True))),
    Case("swiglu", "1024 x 2*2816", rows(1024, 2 * 2816)),
    Case("swiglu", "2048 x 2*5504", rows(2048, 2 * 5504)),
    Case("rotary_embedding", "B1 H32 S512 D128", rotary(1, 32, 512, 128)),
    Case("rotary_embedding", "B2 H32 S2048 D128", rotary(2, 32, 2048, 128)),
    Case("linear", "512 x 1024 -> 1024", linear(512, 1024, 1024)),
    Case("linear", "2048 x 2048 -> 2048", linear(2048, 2048, 2048)),
    Case("adamw", "1M params", adamw(1 << 20), differentiable=False),
    Case("adamw", "16M params", adamw(1 << 24), differentiable=False),
]


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    elif DEVICE.type == "npu":
        torch.npu.synchronize()


def best_ms(fns: dict[str, Callable[[], None]], budget_s: float = 1.5) -> dict[str, float]:
    """Best-of-N wall time of each function, in ms, the paths interleaved round by round.

    Interleaving and taking the minimum keep a busy shared machine from
    favouring whichever path happened to run in a quiet moment.
    """
    warm = {}
    for name, fn in fns.items():                  # warm-up, and a first timing
        t0 = time.perf_counter()
        fn()
        sync()
        warm[name] = time.perf_counter() - t0
    rounds = max(3, min(10, int(budget_s / max(sum(warm.values()), 1e-4))))
    best = dict(warm)
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: t * 1e3 for name, t in best.items()}


def measure(case: Case) -> dict[str, tuple[float, float | None]]:
    """(forward ms, forward+backward ms) of every path."""
    fn = getattr(ops, case.op)
    forward, forward_backward = {}, {}
    for path in PATHS:
        args, kwargs = case.make()
        backend = "auto" if path == "fast" else path

        def fwd(args=args, kwargs=kwargs, backend=backend):
            with ops.use(backend), torch.no_grad():
                fn(*args, **kwargs)

        def fwd_bwd(args=args, kwargs=kwargs, backend=backend):
            with ops.use(backend):
                fn(*args, **kwargs).sum().backward()
        forward[path], forward_backward[path] = fwd, fwd_bwd
    f = best_ms(forward)
    fb = best_ms(forward_backward) if case.differentiable else dict.fromkeys(PATHS)
    return {p: (f[p], fb[p]) for p in PATHS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--only", default=None, help="run only this op, e.g. flash_attention")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(f"device {DEVICE}, torch {torch.__version__}, {torch.get_num_threads()} threads{load}; "
          f"best-of-N ms; MB moved per forward (wb.ops.cost)")
    head = (f"{'op':<17}{'size':<24}" + "".join(f"{p + ' fwd':>14}" for p in PATHS)
            + "".join(f"{p + ' f+b':>14}" for p in PATHS)
            + f"{'MB fused':>10}{'MB unfused':>12}{'x':>6}")
    print(head)
    print("-" * len(head))
    flash = {}
    for case in CASES:
        if opts.only and case.op != opts.only:
            continue
        timings = measure(case)
        args, kwargs = case.make()
        c = ops.cost(case.op, *args, **kwargs)
        fwd = "".join(f"{timings[p][0]:>14.2f}" for p in PATHS)
        fb = "".join(f"{timings[p][1]:>14.2f}" if timings[p][1] is not None else f"{'-':>14}"
                     for p in PATHS)
        print(f"{case.op:<17}{case.size:<24}{fwd}{fb}"
              f"{c.bytes_fused / 1e6:>10.1f}{c.bytes_unfused / 1e6:>12.1f}{c.traffic_ratio:>6.1f}")
        if case.op == "flash_attention":
            flash[case.size] = timings
    print()
    for size, t in flash.items():
        print(f"flash_attention {size}: reference / fast path = "
              f"{t['reference'][0] / t['fast'][0]:.2f}x forward, "
              f"{t['reference'][1] / t['fast'][1]:.2f}x forward+backward (target: within 4x)")
    if load:
        print(f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
              "(a busy machine inflates the many-small-kernel reference paths most)")


if __name__ == "__main__":
    main()
