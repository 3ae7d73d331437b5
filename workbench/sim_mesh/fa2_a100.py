"""FlashAttention-2 on the A100 80GB SXM4, priced per shape from its author's benchmark.

A profile whose ``attention_table`` is ``NAME`` prices a fused attention kernel given its
shape (``kernel_cost.AttentionShape``) in 16 bits at the rate this table gives for its
sequence, head dimension, mask and direction, instead of one efficiency for every shape.
FlashAttention-2's rate depends on the shape (Dao 2023, Fig. 4): a causal kernel over 512
tokens runs at half the rate of a full one over 16k.

Source: T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning" (arXiv 2307.08691, 2023), sec. 4.1, Fig. 4 "Attention forward + backward
speed on A100 GPU" (A100 80GB SXM4, 16-bit, hidden 2048 = 32 heads of 64 or 16 heads of
128, batch = 16k tokens / sequence), the FlashAttention-2 bars; the figure is the
Dao-AILab/flash-attention repository's assets/flash2_a100_fwd_bwd_benchmark.png (commit
4f285b35, "FlashAttention-2 release", 2023-07-17), produced by its
benchmarks/benchmark_flash_attention.py (fwd + bwd time of ``flash_attn_qkvpacked_func``,
FLOPs ``4 seqlen^2 head_dim heads``, halved when causal, x 3.5 for forward + backward).
The numbers are the labels printed on the bars (TFLOP/s, integers); three labels are
covered by the legend and were read off the chart (precision about +-1 TFLOP/s, the
bar height against the labelled bars of the same panel at 0.544 TFLOP/s per pixel):
panel (a) 1k (a bar of 153.1, "1?3" visible: 153), panel (b) 512 (151.5: 151) and
panel (b) 1k (173.3; its faint label reads 173).

PyTorch's SDPA flash backend is this code: aten/src/ATen/native/transformers/cuda/
flash_attn/ (pytorch/pytorch, flash_api.cpp at ef3d5c9e: "Copyright (c) 2024, Tri Dao",
the FlashAttention-2 API, fp16 and bf16 only; kernels/flash_fwd_hdim128_bf16_causal_sm80.cu
and siblings), so torchtitan's attention on an A100 runs the kernels of this figure.

Forward and backward apart.  Fig. 4 times forward + backward together; its Figs. 5 and 6
(forward alone, backward alone) are not in the repository and were not read here.  The
split takes one ratio r = backward rate / forward rate for every shape, from the paper's
own two figures at its best shape: sec. 4, "FlashAttention-2 reaches up to 230 TFLOPs/s,
73% of the theoretical maximum", read as the forward at Fig. 4(b)'s 16k (ASSUMPTION: the
230 is the forward, the faster half: FlashAttention-2's forward outruns its backward in
every full-attention row of the H100 file in ``sim_mesh/measurements``, the same code,
by 1.19 .. 1.41x), where forward + backward runs at 203:

    3.5 / 203 = 1 / 230 + 2.5 / B  ->  B = 193.9,  r = B / 230 = 0.843

and at each shape, with C its Fig. 4 rate, F = C (1 + 2.5 / r) / 3.5 and B = r F (so
forward + backward takes exactly Fig. 4's time).  ASSUMPTION: r is the same at every
shape (the H100 file's rows of the same code at batch x heads >= 16 give 0.74 .. 0.98).
UNCERTAIN, and read but not used: a forward-only measurement of the same kernels on an A100
of unstated variant (liangan1/GPU_travel performance/flash-attn/README.md at 07d0469e8a,
``flash_attn_func`` fp16, head dimension 128, 32 query heads, clocks falling from 1,410 to
about 1,200 MHz "due to the power limit"): 143.7 / 156.3 TFLOP/s causal and 179.1 / 184.0
full at sequence 1k (batch 16) / 4k (batch 1), 0.80 .. 0.95 of this split's forward
(150.7 / 196.0 causal, 196.0 / 222.1 full).  Against Fig. 4's forward + backward they
would put the backward above the forward at 4k (r 1.09 full, 1.16 causal), which no row
of the same code on the H100 does at 32 heads (r 0.74 .. 0.87): read as a slower card than
Dao's, the split is kept.  Only the forward / backward balance is at stake (the pair
takes Fig. 4's time either way): a recompute that re-runs the forward would take up to
1 / 0.80 of what this table gives.

Between grid points the rate is interpolated linearly in log2(sequence) and
log2(head dimension), as ``sim_mesh.measured`` does; beyond the grid (sequence < 512 or
> 16k, head dimension < 64 or > 128) the edge's rate holds (ASSUMPTION, like the
measured tables).  ASSUMPTIONS also: the rate depends on the shape of one head's
problem only (the figure's calls hold 16k tokens x 16 or 32 heads; FlashAttention-2
spreads batch, heads and query blocks over the SMs, Dao 2023 sec. 3.2); bf16 runs as
fp16 (the same tensor-core rate, A100 datasheet); grouped-query attention at the rate
of its query heads.  FLOPs as the figure counts them: causal half of s^2, which the
planner's s (s + 1) / 2 pairs match within 1 / s.
"""
from __future__ import annotations

import bisect
import math

__all__ = ["NAME", "SEQS", "HEAD_DIMS", "FWD_BWD", "BEST_FORWARD", "BWD_OVER_FWD",
           "split", "rate", "table"]

NAME = "fa2-a100-sxm4"
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
# (causal, head_dim) -> forward + backward TFLOP/s at SEQS: Dao 2023 Fig. 4, the
# FlashAttention-2 bars (labels; read off the chart where the legend covers them)
FWD_BWD = {
    (False, 64): (132, 153, 162, 171, 175, 176),    # Fig. 4(a); 1k read off the chart
    (False, 128): (151, 173, 187, 196, 201, 203),   # Fig. 4(b); 512, 1k read off the chart
    (True, 64): (88, 119, 140, 156, 165, 171),      # Fig. 4(c)
    (True, 128): (99, 133, 155, 173, 182, 189),     # Fig. 4(d)
}
# sec. 4: "reaches up to 230 TFLOPs/s, 73% of the theoretical maximum" (the forward at
# Fig. 4(b)'s 16k: ASSUMPTION, module docstring)
BEST_FORWARD = 230.0
BWD_OVER_FWD = 2.5 / (3.5 / FWD_BWD[(False, 128)][-1] - 1.0 / BEST_FORWARD) / BEST_FORWARD


def split(fwd_bwd: float, r: float = BWD_OVER_FWD) -> tuple[float, float]:
    """(forward, backward) rates whose forward + backward (FLOPs 1 : 2.5) runs at
    ``fwd_bwd``, the backward at ``r`` times the forward (module docstring)."""
    fwd = fwd_bwd * (1.0 + 2.5 / r) / 3.5
    return fwd, r * fwd


def _check(seq, head_dim, causal, backward):
    for name, v in (("seq", seq), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={v!r} must be an int > 0 (the attention's "
                             f"{'sequence length' if name == 'seq' else 'head dimension'})")
    for name, v in (("causal", causal), ("backward", backward)):
        if not isinstance(v, bool):
            raise ValueError(f"{name}={v!r} must be True or False")


def _weights(axis, x):
    """[(index, weight)] of the linear interpolation of log2(x) on log2(axis), held at
    the edges."""
    logs = [math.log2(v) for v in axis]
    lx = min(max(math.log2(x), logs[0]), logs[-1])
    j = min(max(bisect.bisect_right(logs, lx) - 1, 0), len(logs) - 2)
    w = (lx - logs[j]) / (logs[j + 1] - logs[j])
    return [(j, 1.0 - w), (j + 1, w)]


def rate(seq: int, head_dim: int, causal: bool, backward: bool) -> float:
    """FLOP/s of FlashAttention-2 on the A100 80GB SXM4 for one call of this shape, the
    forward (``backward=False``) or the backward (module docstring: Fig. 4, split at
    ``BWD_OVER_FWD``, interpolated in log2 of sequence and head dimension)."""
    _check(seq, head_dim, causal, backward)
    c = 0.0
    for i, wd in _weights(HEAD_DIMS, head_dim):
        row = FWD_BWD[(causal, HEAD_DIMS[i])]
        c += wd * sum(w * row[j] for j, w in _weights(SEQS, seq))
    fwd, bwd = split(c)
    return (bwd if backward else fwd) * 1e12


def table() -> list[dict]:
    """The grid as rows (causal, head_dim, seq, and the forward + backward, forward and
    backward TFLOP/s), for display."""
    out = []
    for (causal, d), row in FWD_BWD.items():
        for s, c in zip(SEQS, row):
            f, b = split(c)
            out.append({"causal": causal, "head_dim": d, "seq": s, "fwd_bwd_tflops": c,
                        "fwd_tflops": round(f, 1), "bwd_tflops": round(b, 1)})
    return out
