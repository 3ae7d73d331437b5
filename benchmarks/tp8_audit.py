"""Why the Megatron-LM README's GPT 32B on 384 H100 (dp 48, tp 8, pp 1) is the one row far
too pessimistic (0.771) where the GPT 16B on 192 H100 (dp 48, tp 4) is right (1.007): a
per-kernel audit of the two steps side by side, in the style of ``step_audit.py``.

    PYTHONPATH=$PWD python benchmarks/tp8_audit.py        # ~3 s

Both rows put about 4.0 G parameters on a GPU (16B / 4 = 4.05 G, 32B / 8 = 3.97 G), run
four micro-batches of one 4,096-token sequence per step and the same flags (sequence
parallel, distributed optimizer, --overlap-grad-reduce --overlap-param-gather,
--tp-comm-overlap, Transformer Engine; ``published._h100_rows``), so a GPU's compute,
its gradient and its optimizer state are alike.  The families, ms per step as the
planner charges them (this script's output of 2026-11-29, after ``plan.megatron_buckets``):

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
DP sync left exposed (reduce-scatter of the   119.3    412.1  NCCL 2.21.5's tuning model:
fp32 gradients in the last backward, the                       46.5 GB/s busbw over a group
bf16 all-gather beside the first forward)                      of one GPU per node (one
                                                               NIC: 50 GB/s x 0.96, profile
                                                               h100 inter_node), 92.3 GB/s
                                                               over two GPUs (two NICs)
step: the estimate's (families add up)        852.6   1188.6  ratio 0.997 / 0.750
      the published                           849.8    891.7
==========================================  =======  =======  ==============================

Reading.  Going from tp 4 to tp 8 the layer's kernels cost about the same per step
(GEMMs + attention + element-wise 653.9 -> 686.1 ms, +4.9%, for +2.1% GEMM FLOPs per
GPU: the sharded GEMMs at h = 7,168 run a little slower per FLOP on the measured grid,
the element-wise kernels see 1/8 of the tokens); the TP collectives left exposed grow
by 28.7 ms (2.5% of the step): the proj and fc2 reduce-scatters and the proj dgrad's
all-gather at tp 8 move 7/8 of 58.7 MB beside GEMMs of 1/8 the width (userbuffers at
NCCL's price, the stated ASSUMPTION; were they free the row would gain 39 ms, 0.771 ->
0.798: not the gap).  What triples is the data-parallel sync, 119 -> 412 ms.  With tp
innermost (Megatron's rank order, ``Layout.rank``) a dp group at tp 4 holds two GPUs of
each node, so its ring crosses each node once through two NICs, at tp 8 one GPU per
node, whose ring runs through that GPU's one NIC (DGX H100: eight 400 Gb/s NDR ports,
one per GPU); the four (tp 4) or eight (tp 8) groups of a node run at once and use its
eight NICs either way.  So per GPU the same 23.3 GB (fp32 gradients reduce-scattered,
bf16 weights gathered) cross half the NIC bandwidth at tp 8: twice the time, and with
only the last micro-batch's backward and the first forward to hide behind, 3.5 times
the exposed part (110 -> 380 ms before Megatron-core's buckets were priced, 119 -> 412
after: 50 and 34 layer blocks became 74 and 50 buckets, each a collective).  That is the one NIC per GPU, not a tp8 pricing slip: every family
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

Checked again on 2026-11-29 (helper h100s12), against the question whether the 32B's
TP communication with userbuffers is priced too slow; what was read and what it gave:

- The layout as Megatron-LM runs it: h 7,168, 56 heads (7 per rank, head dimension
  128 = ``kv_channels`` h / heads), ``ffn_hidden_size`` 4 h (its default), untied
  embeddings (the 32B parameter count needs them), tp 8 inside a DGX node: as priced.
  The overlap method per GEMM: Megatron's ``_initialize_tp_communicators`` passes no
  config, so TE's defaults (``plan.tp_overlap.METHOD``, TE v1.6-1.9 ``initialize_ub``);
  TE's BF16 pipelined reduce-scatter ran its GEMM chunks one after another on Hopper
  until late 2024 (NVIDIA/TransformerEngine pull request #1311, 2024-11: "enable the
  overlap between GEMM chunks ... We previously blocked this"), as ``tp_overlap.pipeline``
  prices them.  No published per-method userbuffers timing was found.
- The layer at tp 8 is not overpriced: NVIDIA's nvFuser team timed Transformer Engine's
  TransformerLayer at GPT-3's shape (h 12,288, sequence 2,048, batch 1) with tp 8 and
  sequence parallelism, NCCL collectives not overlapped, on 8 H100s: forward 2.5 ms
  (NVIDIA/Fuser pull request #5560) / 2.67 ms (#3546), backward 4.58 ms (#5667), each the
  wall time of one synchronised call (an upper bound of the device time); the planner
  prices that layer at 2.06 / 3.43 ms (tests/test_h100s12.py).  So neither the layer
  nor its TP collectives (39 ms a step exposed; free, the row would read 0.776) hold the
  row down.
- What the planner had wrong in the DP sync, now priced (``plan.megatron_buckets``,
  2026-11-29): Megatron-core reduces and gathers in buckets of max(40M, 1M x dp)
  parameters formed in reverse parameter order (f2e5db402c
  ``distributed_data_parallel.py:51-54``, ``param_and_grad_buffer.py``), 74 for the 32B
  (48M at dp 48; a tp-8 layer holds 77M), where the planner issued one collective per
  layer (50); each pays NCCL 2.21.5's ring latency over 48 nodes (about 0.65 ms at these
  sizes, ``sim_mesh.nccl_tuning``): DP exposed 380 -> 412 ms, the row 0.771 -> 0.750 (the
  wrong way for this row, kept: it is what the source runs).
- The SMs the DP collectives hold: NCCL 2.21.5 builds 4 channels for a ring with one GPU
  per node behind one 400 Gb/s port (``src/graph/topo.cc:358,394,459``: the port 50 GB/s,
  the PCIe Gen5 x16 path 16 x 240 / 80 = 48 GB/s; ``search.cc:836-847``
  ``ncclTopoDupChannels``: one search channel at 48 GB/s doubled to two at 24; ``init.cc:
  1105,1181``: min(tree, ring); ``connect.cc:443``: doubled again; ``:457`` not taken, its
  bwIntra 24 < 45), 8 with two GPUs per node, 16 with four or eight (eight: the logs'
  16 the profile cites), where the profile's ``topology.collective_sms`` ASSUMES 16 for
  every group spanning nodes.  Priced with 4 (kernel_cost.collective_sms patched), the
  32B and 16B rows do not move at all: their sync is communication-bound, the compute's
  slowdown beside it hides under the collectives.  Left as a lead for the profile.
- The gradients' dtype: f2e5db402c forces fp32 for bf16 (``training/arguments.py:
  299-307``) and has no way out: ``--grad-reduce-in-bf16`` first appears in d165a8548b
  (2025-02-26).  Context, not a source for the README's runs: NVIDIA's NeMo documentation
  of the same season (user guide 24.12, "Communication Overlap") says its reduce-scatter
  precision is set by ``grad_sync_dtype`` and "reduction in bf16 ensures improved
  performance at large scale training compared to the default precision of fp32", and
  describes the DP overlap as "chunked by the granularity of a Transformer layer" (the
  planner's former block; Megatron-LM's code at the cited commit chunks by
  ``bucket_size``, which is what is priced).
- The floor (:func:`line_rate_floor`: everything generous at once: the compute and the
  optimizer the planner charges, no TP collective exposed, the reduce-scatter and the
  gather at the port's 50 GB/s line rate with no per-call latency, hidden by the whole
  last backward / first forward): 1.013 s against 0.892 published, ratio 0.881 at best
  with fp32 gradients and micro-batch 1; 1.040 with bf16 gradients, 1.103 with
  micro-batch 2.  Between that floor and the estimate (1.189 s): NCCL's per-call ring
  latency (148 collectives x ~0.65 ms), its 46.5-47.9 GB/s busbw against 50, the gathers
  one bucket ahead, 39 ms of TP collectives.  The per-call latency is NCCL's own tuning
  model's (``tuning.cc``); no measured reduce-scatter over 48 nodes of one GPU each was
  found to hold it to.  Unexplained from sources: the row needs the run to have moved
  about half the gradient bytes, or to have hidden them behind twice the compute.
- Against its neighbours (2026-11-29, h100x14: ``h100_breakdown.dp_room``,
  ``compute_needed``): the same floor taken for every README row, the 32B is the only
  one whose published step leaves less DP time than the floor (0.115 s against 0.278);
  the 70B (tp 8, pp 2: the same one-GPU-per-node DP group, 4.4e9 parameters per GPU)
  leaves 0.322 against 0.313, the 119B-462B more.  Beside the floor and the optimizer
  the 32B's 409.8 model TFLOP a GPU would have 0.591 s: 693 model TFLOP/s over all its
  kernels, above the measured H100's sustained 8,192-cube GEMM (682.6).  The row's
  shapes were re-read from the README's image (f2e5db402c ``images/model_table.png``):
  as priced.
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


def line_rate_floor(r, grad_bytes=None, micro_batch=None) -> dict:
    """The most generous floor of the step from component figures (module docstring's
    "Floor"): the compute and the optimizer the planner charges (no TP collective
    exposed), the gradients' reduce-scatter and the weights' all-gather each at the
    NIC's line rate over the ring (the profile's ``inter_node.bandwidth``, 50 GB/s for
    the DGX H100's 400 Gb/s port per GPU, before NCCL's efficiency), no per-call latency,
    the reduce-scatter hidden by the whole last micro-batch's backward and the gather by
    the whole first forward.  ``grad_bytes`` (default the framework's: fp32 for
    Megatron-LM with bf16) and ``micro_batch`` (default the row's; ``m`` scaled so the
    batch stays) try the two unsourced alternatives."""
    cfg, lay, cl = P.build(r)
    if micro_batch is not None:
        lay = lay.replace(micro_batch=micro_batch)
    res = P.predict(dict(r, layout=dict(r["layout"], micro_batch=lay.micro_batch)))
    d, prof = res["estimate"].details, cl.profile
    st = next(v for v in d["stages"].values() if v["stage"] == 0)
    g = d["grad_reduce_bytes"] if grad_bytes is None else grad_bytes
    ranks = tuple(lay.grad_ranks(0, 0))
    nodes = len({x // prof.devices_per_node for x in ranks})
    # a ring moves (n - 1) / n of a rank's buffer across each node boundary, split over
    # the group's ports on the node (one 400 Gb/s port per GPU, each at the line rate)
    rate = prof.inter_node.bandwidth * (len(ranks) // nodes)
    frac = (len(ranks) - 1) / len(ranks)
    rs, ag = g * st["psi"] * frac / rate, 2 * st["psi"] * frac / rate
    m = d["micro_batches"]
    compute = m * st["compute"] + d["optimizer"]
    last_bwd, first_fwd = st["time"] - st["forward"], st["forward"]
    floor = compute + max(0.0, rs - last_bwd) + max(0.0, ag - first_fwd)
    published = res["estimate"].step_time * res["ratio"]
    return dict(compute=compute, reduce_scatter=rs, all_gather=ag, last_backward=last_bwd,
                first_forward=first_fwd, floor=floor, published=published,
                best_ratio=published / floor)


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
    r32 = SA.row(*ROWS[1])
    for label, kw in (("fp32 gradients, micro-batch 1 (as priced)", {}),
                      ("bf16 gradients (no flag for it at f2e5db402c)", dict(grad_bytes=2)),
                      ("micro-batch 2 (not stated)", dict(micro_batch=2))):
        f = line_rate_floor(r32, **kw)
        print(f"  floor GPT 32B, {label}: compute + optimizer {f['compute']:.3f} s + RS "
              f"{f['reduce_scatter']:.3f} - last bwd {f['last_backward']:.3f} + AG "
              f"{f['all_gather']:.3f} - first fwd {f['first_forward']:.3f} = "
              f"{f['floor']:.3f} s: ratio at best {f['published'] / f['floor']:.3f}")
    return out


if __name__ == "__main__":
    main()
