"""Why the Megatron-LM README's GPT 32B on 384 H100 (dp 48, tp 8, pp 1) is the one row far
too pessimistic (0.771) where the GPT 16B on 192 H100 (dp 48, tp 4) is right (1.007): a
per-kernel audit of the two steps side by side, in the style of ``step_audit.py``.

    PYTHONPATH=$PWD python benchmarks/tp8_audit.py        # ~3 s

Both rows put about 4.0 G parameters on a GPU (16B / 4 = 4.05 G, 32B / 8 = 3.97 G), run
four micro-batches of one 4,096-token sequence per step and the same flags (sequence
parallel, distributed optimizer, --overlap-grad-reduce --overlap-param-gather,
--tp-comm-overlap, Transformer Engine; ``published._h100_rows``), so a GPU's compute,
its gradient and its optimizer state are alike.  The families, ms per step as the
planner charges them (this script's output of 2026-11-28):

==========================================  =======  =======  ==============================
kernel family (what runs it, f2e5db402c /    16B/192  32B/384  component figure; verdict
Transformer Engine v1.8)
==========================================  =======  =======  ==============================
layer GEMMs (TE's Linear / LayerNormLinear;   542.6    579.3  meas. GEMM grid at the layers'
fwd, dgrad, wgrad into main_grad)                              tp-sharded shapes; priced
attention (cuDNN fused, 12 / 7 heads)          66.3     65.8  meas. cudnn rates; priced
layer element-wise (LayerNorm, bias-GeLU,      45.0     41.0  bytes at meas. rates, 1/tp of
bias-dropout-add, q/k/v copies)                                the tokens under sp; priced
TP collectives left exposed (userbuffers:      10.5     39.2  NCCL's price of the buffer
ring exchange / 4-chunk pipeline / bulk)                       (ASSUMED, plan/tp_overlap.py)
output layer GEMMs + its TP collectives        30.3     17.9  meas. GEMM grid; NCCL model
final norm, fp32 cast, loss; embedding        11.5      7.0  as ``step_audit.py``; priced
(+ its TP reduce-scatter); DDP hook            4.1      3.5  ``megatron_hook_add``; priced
optimizer (Megatron's passes, FusedAdam)      23.1     22.8  meas. fused Adam; priced
DP sync left exposed (reduce-scatter of the   110.3    380.1  NCCL 2.21.5's tuning model:
fp32 gradients in the last backward, the                       46.5 GB/s busbw over a group
bf16 all-gather beside the first forward)                      of one GPU per node (one
                                                               NIC: 50 GB/s x 0.96, profile
                                                               h100 inter_node), 92.3 GB/s
                                                               over two GPUs (two NICs)
step: the estimate's (families add up)        843.6   1156.6  ratio 1.007 / 0.771
      the published                           849.8    891.7
==========================================  =======  =======  ==============================

Reading.  Going from tp 4 to tp 8 the layer's kernels cost about the same per step
(GEMMs + attention + element-wise 653.9 -> 686.1 ms, +4.9%, for +2.1% GEMM FLOPs per
GPU: the sharded GEMMs at h = 7,168 run a little slower per FLOP on the measured grid,
the element-wise kernels see 1/8 of the tokens); the TP collectives left exposed grow
by 28.7 ms (2.5% of the step): the proj and fc2 reduce-scatters and the proj dgrad's
all-gather at tp 8 move 7/8 of 58.7 MB beside GEMMs of 1/8 the width (userbuffers at
NCCL's price, the stated ASSUMPTION; were they free the row would gain 39 ms, 0.771 ->
0.798: not the gap).  What triples is the data-parallel sync, 110 -> 380 ms.  With tp
innermost (Megatron's rank order, ``Layout.rank``) a dp group at tp 4 holds two GPUs of
each node, so its ring crosses each node once through two NICs, at tp 8 one GPU per
node, whose ring runs through that GPU's one NIC (DGX H100: eight 400 Gb/s NDR ports,
one per GPU); the four (tp 4) or eight (tp 8) groups of a node run at once and use its
eight NICs either way.  So per GPU the same 23.3 GB (fp32 gradients reduce-scattered,
bf16 weights gathered) cross half the NIC bandwidth at tp 8: twice the time, and with
only the last micro-batch's backward and the first forward to hide behind, 3.4 times
the exposed part.  That is the one NIC per GPU, not a tp8 pricing slip: every family
is priced from its component figure.

Bound (component figures only, :func:`bound`).  The published step is 0.892 s.  The
fp32 reduce-scatter alone moves 4 x 3.97 G x 47/48 = 15.5 GB per GPU through one NIC at
48 GB/s: 0.324 s, of which at most the last micro-batch's backward (0.124 s, as the
planner prices it) can hide; everything else the planner charges (the kernels from
H100 measurements, the TP collectives left exposed, the optimizer) is 0.776 s: at least
0.976 s, beyond the published step, so no overlap
model reaches the published row while the gradients are reduced in fp32
(``frameworks.grad_reduce_bytes``: Megatron-LM forces fp32 reduction for bf16 unless
--grad-reduce-in-bf16 is given; the README does not list the runs' full flags, the
stated ASSUMPTION).  Either the run reduced 16-bit gradients, or its kernels ran faster
than the single-H100 measurements; neither has a source here, so nothing is changed.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import published as P  # noqa: E402
import step_audit as SA  # noqa: E402
from workbench.plan import costs as C  # noqa: E402
from workbench.plan import megatron_2021 as M21  # noqa: E402
from workbench.plan import optimizer_step as OS  # noqa: E402
from workbench.plan.edge_cost import edge_times  # noqa: E402

ROWS = (("megatron_h100", "GPT 16B", 192), ("megatron_h100", "GPT 32B", 384))


def audit(r) -> dict:
    """Seconds per step of each kernel family of a one-stage (pp = 1) row ``r`` with
    tensor parallelism, TP collectives apart, with the estimate's step and the published
    one; the families add up to the estimate's step (``listed``)."""
    cfg, lay, cl = P.build(r)
    res = P.predict(r)
    est = res["estimate"]
    d, prof = est.details, cl.profile
    if lay.pp != 1 or lay.engine != "megatron":
        raise ValueError(f"tp8_audit: Megatron rows with pp = 1 only, got pp={lay.pp} "
                         f"engine={lay.engine!r}")
    m, n = d["micro_batches"], cfg.n_layer
    ops = SA._layer_ops(cfg, lay, prof, r.get("attention", "flash"),
                        r.get("tp_comm_overlap", False), r.get("transformer_engine", False))
    fam = {"layer GEMMs": 0.0, "attention": 0.0, "layer element-wise": 0.0,
           "TP collectives exposed (layers)": 0.0}
    for o in ops:
        k = ("layer GEMMs" if o["op_class"] == "matmul" else
             "attention" if o["op_class"] == "attention" else
             "TP collectives exposed (layers)" if o["op_class"] in SA._COMM else
             "layer element-wise")
        fam[k] += n * m * o["exposed"]
    hd = C.head_cost(cfg, lay.micro_batch, lay.tp, lay.sp, prof)
    fam["output-layer GEMMs"] = m * (hd.fwd_compute + hd.bwd_compute)
    fam["output-layer TP collectives"] = m * (hd.fwd_comm + hd.bwd_comm)
    edge = edge_times(cfg, lay.micro_batch, lay.tp, lay.sp, prof)
    fam["final norm, fp32 cast, loss"] = m * sum(edge["last"])
    fam["embedding"] = m * sum(edge["first"])
    fam["embedding TP collective"] = m * C.embedding_comm(cfg, lay.micro_batch, lay.tp,
                                                          lay.sp, prof)[0]
    st = next(v for v in d["stages"].values() if v["stage"] == 0)
    fam["grad accumulation (DDP hook)"] = m * st["grad_accumulation"]
    psi, tensors = st["psi"], M21.TENSORS_PER_LAYER * max(n, 1)
    updated = psi / (lay.dp * lay.cp if lay.zero >= 1 else 1)
    table = d["optimizer_passes"]
    fam["optimizer"] = OS.step_seconds(list(table), psi, updated, prof, tensors)
    fam["DP sync exposed"] = d["dp_sync"] + d["tied_embedding_sync"]
    fam["bubble"] = est.breakdown["bubble"]
    ranks = tuple(lay.grad_ranks(0, 0))
    nb = 1e9
    t = C.group_price("reduce_scatter", nb, ranks, prof)
    return dict(name=f"{r['name']} / {r['devices']}", ratio=res["ratio"],
                predicted=est.step_time, published=est.step_time * res["ratio"],
                families=fam, listed=sum(fam.values()), psi=psi, dp_sent=st["dp_sent"],
                dp_gpus_per_node=len(ranks) // len({x // prof.devices_per_node
                                                    for x in ranks}),
                dp_busbw=C.wire_bytes("reduce_scatter", nb, len(ranks)) / t)


def bound(r) -> dict:
    """Seconds per step, from component figures: the kernels the planner charges
    (every family but the DP sync), the DP gradient reduce-scatter alone at the
    planner's NCCL price, the last micro-batch's backward that can hide it, and the
    published step (module docstring's Bound)."""
    a = audit(r)
    cfg, lay, cl = P.build(r)
    d = P.predict(r)["estimate"].details
    st = next(v for v in d["stages"].values() if v["stage"] == 0)
    g = d["grad_reduce_bytes"] * st["psi"]
    rs = C.group_price("reduce_scatter", g, tuple(lay.grad_ranks(0, 0)), cl.profile)
    kernels = a["listed"] - a["families"]["DP sync exposed"]
    return dict(kernels=kernels, reduce_scatter=rs,
                last_backward=st["time"] - st["forward"],
                published=a["published"],
                floor=kernels + rs - (st["time"] - st["forward"]))


def main():
    out = [audit(SA.row(*k)) for k in ROWS]
    SA.print_families(out, "benchmarks/tp8_audit.py", 34, 16)
    print(f"  {'parameters per GPU (G)':<34}" + "".join(f"{x['psi'] / 1e9:>16.2f}"
                                                        for x in out))
    print(f"  {'DP bytes sent per GPU (GB)':<34}" + "".join(f"{x['dp_sent'] / 1e9:>16.1f}"
                                                            for x in out))
    print(f"  {'DP group: GPUs per node':<34}" + "".join(f"{x['dp_gpus_per_node']:>16d}"
                                                         for x in out))
    print(f"  {'DP reduce-scatter busbw, 1 GB':<34}" + "".join(
        f"{x['dp_busbw'] / 1e9:>11.1f} GB/s" for x in out))
    for k in ROWS:
        b = bound(SA.row(*k))
        print(f"  bound {k[1]}: kernels {b['kernels']:.3f} s + DP reduce-scatter "
              f"{b['reduce_scatter']:.3f} s - last backward {b['last_backward']:.3f} s "
              f"= {b['floor']:.3f} s, published {b['published']:.3f} s")
    return out


if __name__ == "__main__":
    main()
