"""Benchmark (modeled): how much communication the decomposed collectives and multi-copy hide.

    python benchmarks/overlap.py [--tp 8] [--ks 1 2 4 8 16]

Everything runs on meta tensors, so the sizes are real-model sizes at no cost; the
times are the modeled clock on each profile (ascend-910b, a100), not this CPU's.
Prints, per decomposed op, the hidden share against k for two matmul sizes (the
compute/communication ratio C/M changes with the size and the profile), next to
the two-stage-pipeline formula (1 - 1/k) min(1, C/M) evaluated on the chunks'
own totals, then the multi-copy layer's forward and backward hidden shares, and those
shares over hidden sizes beside the claims quoted for MindSpore's multi-copy parallel.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
import workbench as wb  # noqa: E402
from workbench.parallel.strategies.overlap import OPS  # noqa: E402
from workbench.parallel.strategies.overlap_sweep import overlap_sweep  # noqa: E402
from workbench.parallel.strategies.overlap_multicopy import multi_copy_estimate  # noqa: E402

PROFILES = ["ascend-910b", "a100"]
SHAPES = [(4096, 4096, 4096), (16384, 8192, 8192)]       # global (M, K, N)
LAYER = dict(batch=2, seq=2048, hidden=4096, heads=32, ffn=16384)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks (one node)")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    mesh = wb.Mesh.grid(args.tp, ("tp",))
    for name in OPS:
        print(overlap_sweep(name, SHAPES, mesh, "tp", args.ks, PROFILES))
        print()
    print(f"multi-copy layer {LAYER}, tp={args.tp}, bf16")
    print(f"{'profile':<13}{'copies':>7}{'fwd ms':>9}{'fwd hidden':>11}"
          f"{'bwd ms':>9}{'bwd hidden':>11}")
    for prof in PROFILES:
        for copies in (1, 2):
            r = multi_copy_estimate(**LAYER, mesh=mesh, axis="tp", copies=copies, profile=prof)
            print(f"{prof:<13}{copies:>7}{r.forward.total * 1e3:>9.3f}"
                  f"{r.forward.hidden_share:>11.1%}{r.backward.total * 1e3:>9.3f}"
                  f"{r.backward.hidden_share:>11.1%}")
    print()
    print("multi-copy, 2 copies, against the quoted claims (about 50% forward, 90% backward "
          "hidden); seq 2048, micro-batch 2, FFN 4H, 128 per head")
    print(f"{'profile':<13}{'H':>6}{'fwd C/M':>9}{'fwd hidden':>11}{'bwd hidden':>11}"
          f"{'bwd, 1 copy':>12}")
    for prof in PROFILES + ["h100"]:
        for h in (1024, 2048, 4096, 8192):
            two, one = (multi_copy_estimate(2, 2048, h, h // 128, 4 * h, mesh, "tp", copies=c,
                                            profile=prof) for c in (2, 1))
            print(f"{prof:<13}{h:>6}{two.forward.compute / two.forward.comm:>9.2f}"
                  f"{two.forward.hidden_share:>11.1%}{two.backward.hidden_share:>11.1%}"
                  f"{one.backward.hidden_share:>12.1%}")


if __name__ == "__main__":
    main()
