"""Instructions per step under callgrind: a deterministic companion to sim_overhead.py
on a loaded machine (its timings moved 10% between identical runs at load 12-15; this
count moves well under 0.1%).

    OMP_NUM_THREADS=1 valgrind --tool=callgrind --instr-atstart=no \\
        python benchmarks/sim_instr.py {wb,one,gpt,gpt1,ew} [N]

then divide valgrind's "Collected" count by N (compare at one N: switching collection
on and off adds a fixed ~1-2M, e.g. the toy step reads 1,695K at N=100, 1,682K at
N=200).  Collection is switched on around the N
timed steps only (``callgrind_control -i on/off`` on this process), after warm-up, so
imports and first-call planning are not counted.  Workloads (sim_overhead.py's own):
``wb`` the toy TP MLP step on 8 simulated ranks, ``one`` the same step on one device,
``gpt`` Hybrid(dp2, tp2) forward+backward of gpt-tiny (``gpt1`` the same model's step on
one device), ``ew`` the elementwise 2x2 chain.

Instruction counts track the simulator's Python overhead (GEMM kernels count the same on
both sides; sgemm instructions are ~0.75M of a toy step either way); they are not time:
compare two versions with the same command, and confirm a change with sim_overhead.py.
Measured (perf11, torch 2.13, N=200): toy step one device 1,130K (N=100); workbench
1,712K before perf11, 1,682K after; gpt 72.24M -> 72.18M (N=20); ew 517.8K both (N=300).
perf12 (dispatch's fast path, the row-parallel backward's as_strided; base = perf12's
parent, both measured here): toy step 1,694K -> 1,625K (N=200); gpt 72.34M -> 72.28M (N=20).
perf13 (sizes as ints to torch's view / expand, transpose for movedim(1, 0), one-input
pointwise without align, sum's keepdim positional; base = perf13's parent, measured here
on a machine at load 12-46): toy step 1,634K -> 1,592K after the first commit (N=200; one
device 1,128K), 1,581K after the second (the linear's branch conditions read once); gpt
72.73M -> 72.64M (N=20; the second commit leaves a 2-d mesh's linear as it was).
sim_overhead.py --only step --timer cpu --rounds 5, base then perf13 back to back, twice
(load 7-18): toy 2.43x -> 2.06x (468.5 -> 367.3 us), 2.33x -> 2.10x (383.9 -> 334.0 us),
still above the 2.0x target; --only ops --rounds 3: GPT Hybrid 2.6x both (15.31 -> 13.66
ms, its torch floor 5.74 -> 5.33 ms: within the load's noise).
perf14 (dispatch's fast path takes view ops, then a replicated input the gradient flows
back through; base = perf14's parent, both measured here, N=20): gpt 72.77M -> 72.57M ->
72.23M (general-path calls 38 -> 20 -> 4 of 53 a step) -> 72.14M (grid.Stacked.expand
gives expand ints); gpt1 (the same step on one device) 40.38M.  Toy step (wb 200): 1,580.0K
-> 1,581.4K (the fast path's one more check per input; one device 1,128K).  Results checked
bit for bit with ``benchmarks/sim_bits.py``.
perf15 (the fast path takes an input its plan moves: the row-parallel bias's R -> P,
general-path calls 4 -> 0 a step; the toy step's per-call trims: F.linear's dtype check,
dispatch._summed per placements tuple, versions.explained a class, no autocast policy
call while none is on; base = perf15's parent, both measured here at load 13-32): gpt
73.32M -> 73.05M (N=20); toy step (wb 200) 1,663.3K -> 1,619.7K, one device (one 200)
1,127.6K (1.475x -> 1.436x of one device's instructions).  Of the gpt step, torch's bmm
(baddbmm_with_gemm_, the 2-d mesh's linears through ``_linear_plain``'s batched
``torch.matmul``) is 22.2M (30%): mostly the sgemm kernels' arithmetic, which folding
the ranks into one GEMM would not remove; matmul's broadcast copies (clone 3.3M) and
``sum_to`` of the broadcast backward (5.3M) would go.  The folded forward (one F.linear
over dp*B*T rows and tp*n columns) gave the same bits here on the GPT shapes, but its
autograd backward sums the weight's gradient over B*T rows in one GEMM where the batched
path sums each sequence then over B, and the input's over tp inside the GEMM where the
batched path sums per rank then across tp: bits change, not done (it needs a backward of
its own that keeps those sums).  sim_overhead.py --only step --timer
cpu --rounds 5, base then perf15, twice (load 18-37): toy 2.34x -> 2.22x, 2.44x -> 2.22x
(still above the 2.0x target at this load).
perf18 (inplace18's detach_() guards: versions.guard_kernel one answer per call shape, the
row-parallel linear's check in its own backward instead of a prehook; base = d6b4f7b7,
measured here): toy step (wb 100) 1,672.3K -> 1,660.6K -> 1,648.3K (before inplace18:
1,621.9K); gpt 10: 75.19M -> 74.88M (inplace18's own cost there, matmul._batched's
source lookups and the dispatcher's moved() registrations, left as it was).
"""
from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import benchmarks.sim_overhead as B  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    which = argv[0] if argv else "wb"
    n = int(argv[1]) if len(argv) > 1 else 100
    torch.manual_seed(0)
    T, H = 32, 64
    X = torch.randn(T, H)
    W1, W2 = torch.randn(4 * H, H) / H ** 0.5, torch.randn(H, 4 * H) / H ** 0.5
    if which == "wb":
        step = B.workbench_step(X, W1, W2)
    elif which == "one":
        step = B.single_step(X, W1, W2)
    elif which in ("gpt", "gpt1", "ew"):
        cases = B.ops_cases()
        step = cases[2][1] if which == "gpt" else cases[2][2] if which == "gpt1" else \
            cases[0][1]
    else:
        raise SystemExit(f"workload {which!r}: use one of wb, one, gpt, gpt1, ew")
    for _ in range(5 if which.startswith("gpt") else 30):
        step()
    ctl = ["callgrind_control", "-i"]
    subprocess.run(ctl + ["on", str(os.getpid())], capture_output=True)
    for _ in range(n):
        step()
    subprocess.run(ctl + ["off", str(os.getpid())], capture_output=True)
    print(f"{which}: {n} steps; divide callgrind's Collected count by {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
