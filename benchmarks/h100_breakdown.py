"""What the planner's step for the Megatron-LM README's H100 rows is made of.

    PYTHONPATH=$PWD python benchmarks/h100_breakdown.py      # ~3 s

For each ``megatron_h100`` row of ``benchmarks/published.py`` (NVIDIA/Megatron-LM
f2e5db402c, images/model_table.png) it prints, in seconds per step, the terms of
``wb.plan.estimate``'s step on the slowest stage: the compute (the layers' forward and
backward, the head and the loss on the last stage, the embedding's kernels on the first,
the gradient accumulation Megatron-LM's DDP hook adds), the tensor-parallel communication
left exposed (``plan.tp_overlap``'s userbuffers pricing, the head's and embedding's
collectives), the data-parallel synchronisation left exposed (the fp32 reduce-scatter
of the gradients beside the last micro-batch's backward, the bf16 all-gather of the
weights beside the next forward: ``--overlap-grad-reduce --overlap-param-gather``),
the pipeline bubble and the optimizer step; then the DP group (the nodes it spans and its
ranks per node, i.e. the NICs each reduce-scatter has: one per rank on a DGX H100) and
the reduce-scatter's and all-gather's whole prices beside the windows that may hide
them (the last micro-batch's backward, the first micro-batch's forward).  ``room``: the
published step less the predicted compute and optimizer, i.e. what the measured run
left for everything exposed beside them.

Nothing here feeds the planner: it shows which term moves from row to row.  Read on
2026-11-27 (figures of 2026-11-29, after ``plan.megatron_buckets``): the 32B row (tp 8,
pp 1) is the one whose DP term jumps (0.12 s at 16B, 0.41 s at 32B, in steps of 0.85 and
1.19 s): its DP group has one rank per node, so its
fp32 reduce-scatter of 4e9 gradients runs through one 400 Gb/s NIC (0.32 s) where the
16B's (two ranks per node, tp 4) runs through two (0.17 s), against a last backward of
0.12 s in both; the published 32B step leaves 0.11 s of room, which no overlap of a
0.32 s reduce-scatter with a 0.12 s backward gives.

The 1.7B row's step kernel by kernel, each charge beside the component figure it rests
on (and torchtitan's Llama 3.1 8B on 8 H100 beside it): ``benchmarks/step_audit.py``.
The 32B's: ``benchmarks/tp8_audit.py`` (its docstring's checks of 2026-11-29).

The small rows (1.7B at tp 1: 1.185; 7.1B at tp 2: 1.159), checked on 2026-11-29
against Megatron-LM f2e5db402c and Transformer Engine of mid-2024; each term the
question named is already priced, from its source, and none leaves the 71 ms (1.7B) or
110 ms (7.1B) a step the published runs took beyond the estimate:

- the vocabulary-131,072 head and the fp32 loss: 76 / 57 ms a step, the output layer's
  GEMMs at the measured grid's rates, Megatron's unfused ``_VocabParallelCrossEntropy``
  at 52 bytes per logit, 1% from the measured pair (``step_audit.megatron_loss_check``);
- the distributed optimizer's gathers and reduce-scatters (--overlap-param-gather,
  --overlap-grad-reduce): what shows is the first bucket's gather (dispatched from
  ``zero_grad`` before the forward, the embedding's 268M / tp parameters) and the last
  bucket's reduce-scatter (the embedding's, complete at the end of the backward), the
  rest hidden one bucket ahead: 10 / 27 ms (``estimate._dp_sync``).  In Megatron-core's
  buckets (``plan.megatron_buckets``: max(40M, 1M x 48) = 48M parameters): 26 for the
  1.7B (a layer, 50M, fills one), the same as its layer blocks; 47 for the 7.1B, whose
  sync is not communication-bound there: +0.1 ms;
- the optimizer step of the 1.7B over dp 48: 10 ms, nearly all of it the passes over
  the whole fp32 gradient buffer every rank runs (``zero_``, the per-bucket NaN-check
  norm, ``*= 1/dp``: 7 GB each, ``plan.optimizer_step``); the sharded Adam on 36M
  parameters is 0.4 ms;
- Transformer Engine's fused kernels (the QKV bias in the GEMM epilogue, its gradient
  from the wgrad GEMM, q/k/v copied for cuDNN's attention): ``layer_cost.TE_SOURCES``;
- host (CPU) time: not priced.  The host keeps ahead of the device while its time per
  layer is under the device's (2.9 ms at 1.7B, 4.8 ms at 7.1B, one micro-batch); the
  per-bucket NaN check (``param_and_grad_buffer.py:111-118``, ``assert not
  norm.isnan()``) and the loss's (``pretrain_gpt.py:136-141``) drain the queue 26 + 4
  times a step (1.7B), each costing the host's lead-in to the next kernel (tens of us
  ASSUMED: about 1-2 ms a step, ``step_audit``).  Transformer Engine's host time per
  module, measured: a BF16 ``Linear`` forward + backward 311 us, ``LayerNormLinear``
  398 us on a GB200's Grace CPU before NVIDIA/TransformerEngine pull request #3523
  (2026) trimmed them, where a plain PyTorch ``Linear`` forward's host time is 13.5 us on
  an H100 DGX's Xeon against 33-37 us on Grace (#2053, 2025); a Megatron layer's four
  TE linear modules (two ``LayerNormLinear``, two ``Linear``) take 1.42 ms of Grace host
  time at those figures, about 0.55 ms on the Xeon at that ratio, beside the 1.7B's
  2.9 ms of device time; the attention module's host time is not measured there.  The
  2024 releases (TE 1.7-1.8) are slower on the host than those of 2025-26 (#2053 and
  #3523 trim it), by an amount not measured; the host would have to take four to five
  times the 2025-26 figures to pace the 1.7B: the one lead left for the small rows, not
  a priced term;
- the batch's copy to the device: f2e5db402c builds the causal mask in the data loader
  by default (``--no-create-attention-mask-in-dataloader`` is opt-out,
  ``training/arguments.py:1576``), a 4,096 x 4,096 bool per sample, which
  ``get_batch_on_this_tp_rank`` (``training/utils.py:318-322``) copies host to device on
  the compute stream before each forward (and broadcasts over tp) though TE's causal
  kernel never reads it: 16.8 MB a micro-batch, about 0.35 ms at the PCIe Gen5 x16
  link's 48 GB/s (NCCL's figure for the link, ``src/graph/topo.cc:459``): 1.4 ms of the
  1.7B's step, 0.3%; not priced;
- the 1.75B GPT in plain PyTorch on one H100 (h100-sxm-80gb-gpt-step.json, 0.393 s
  for the four micro-batches) is priced at its measured time: the gap is in what the
  48-GPU Megatron + TE run adds beside the device's kernels, not in them.

NCCL across the rows' 48 nodes (nccl12, 2026-11-29): the SMs a data-parallel
collective holds now follow NCCL 2.21.5's graph search (``sim_mesh.nccl_channels``: 4 at
one rank per node (tp 8), 8 at two (tp 4), 16 at four or eight, where the all-ranks 16 was
assumed); no H100 row moved by 0.001 (why the tp 8 rows' compute, now faster beside
those collectives, does not shorten their step was not traced).  The per-call price of a reduce-scatter over 48 one-GPU-per-node H100 ranks on
NCCL 2.21.5's tuning model: 134 us at 8 B, 184 us at 1 MiB, 691 us at 16 MiB, 2.0 ms at
64 MiB (``sim_mesh.cost.price``): the ~0.65 ms per call is the MB-sized bucket's
bandwidth term, the latency a fifth of it.  No nccl-tests output at 32-64 nodes with one
GPU per node giving small or medium message times was found (searched: NVIDIA/nccl and
nccl-tests issues, vendors' pages; only the 32-node A100 tree latency of NVIDIA/nccl #652
and the bus bandwidths without sizes of #1229, both held in tests/test_nccl_scale.py), so
that latency stays the tuning model's, unchecked at this scale.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import published as P  # noqa: E402
from workbench.plan import costs as C  # noqa: E402
from workbench.plan import frameworks as F  # noqa: E402
from workbench.plan.edge_cost import edge_times  # noqa: E402


def rows():
    """The README's H100 rows of ``benchmarks/published.py``."""
    return [r for r in P.ROWS if r["source"] == "megatron_h100"]


def breakdown(row) -> dict:
    """The step's terms for one row (module docstring), seconds per step."""
    cfg, lay, cl = P.build(row)
    r = P.predict(row)
    est, prof = r["estimate"], cl.profile
    d = est.details
    slow = d["per_rank"][d["slowest_stage"]]
    s, m, pp = slow["stage"], d["micro_batches"], lay.pp
    n_layers = lay.stage_layers(cfg.n_layer)[s]
    ly, hd = d["layer"], d["head"]
    edge = edge_times(cfg, lay.micro_batch, lay.tp, lay.sp, prof)
    last, first = s == pp - 1, s == 0
    layers = n_layers * (ly.fwd_compute + ly.bwd_compute)
    head = (hd.fwd_compute + hd.bwd_compute + sum(edge["last"])) if last else 0.0
    emb = sum(edge["first"]) if first else 0.0
    acc = slow["grad_accumulation"]
    # the DP group of the first stage and its collectives alone (no overlap)
    ranks = tuple(lay.grad_ranks(0, 0))
    nodes = len({x // prof.devices_per_node for x in ranks})
    psi = d["stages"][next(k for k, v in d["stages"].items() if v["stage"] == 0)]["psi"]
    g = F.grad_reduce_bytes(lay.engine, cfg.dtype)
    rs = C.group_price("reduce_scatter", g * psi, ranks, prof)
    ag = C.group_price("all_gather", 2 * psi, ranks, prof)
    published = est.step_time * r["ratio"]
    compute = m * slow["compute"]
    b = est.breakdown
    return dict(name=row["name"], gpus=row["devices"], layout=lay.short(), m=m,
                ratio=r["ratio"], published=published, predicted=est.step_time,
                compute=compute, layers=m * layers, head_loss=m * head, embedding=m * emb,
                grad_accumulation=m * acc, tp_exposed=m * slow["comm"],
                dp_exposed=d["dp_sync"] + d["tied_embedding_sync"], bubble=b["bubble"],
                optimizer=d["optimizer"], nodes=nodes, per_node=len(ranks) // nodes,
                grad_bytes=g, params=psi, reduce_scatter=rs, all_gather=ag,
                last_backward=slow["time"] - slow["forward"], first_forward=slow["forward"],
                room=published - compute - d["optimizer"])


def main():
    out = [breakdown(row) for row in rows()]
    print("Megatron-LM README H100 rows (f2e5db402c): the predicted step's terms, seconds "
          "per step (benchmarks/h100_breakdown.py)")
    print(f"  {'model':<9}{'ratio':>6}{'publ.':>7}{'pred.':>7}{'compute':>8}{'layers':>7}"
          f"{'head+loss':>10}{'acc':>6}{'TP exp':>7}{'DP exp':>7}{'bubble':>7}{'opt':>6}"
          f"{'room':>7}")
    for x in out:
        print(f"  {x['name']:<9}{x['ratio']:>6.3f}{x['published']:>7.3f}{x['predicted']:>7.3f}"
              f"{x['compute']:>8.3f}{x['layers']:>7.3f}{x['head_loss']:>10.3f}"
              f"{x['grad_accumulation']:>6.3f}{x['tp_exposed']:>7.3f}{x['dp_exposed']:>7.3f}"
              f"{x['bubble']:>7.3f}{x['optimizer']:>6.3f}{x['room']:>7.3f}")
    print("  the DP group (first stage): nodes x ranks per node; its collectives alone beside "
          "the windows that may hide them")
    print(f"  {'model':<9}{'layout':<40}{'m':>3}{'nodes':>6}{'/node':>6}{'params':>8}"
          f"{'RS (fp32)':>10}{'AG (bf16)':>10}{'last bwd':>9}{'1st fwd':>8}")
    for x in out:
        print(f"  {x['name']:<9}{x['layout']:<40}{x['m']:>3}{x['nodes']:>6}{x['per_node']:>6}"
              f"{x['params'] / 1e9:>7.2f}B{x['reduce_scatter']:>10.3f}{x['all_gather']:>10.3f}"
              f"{x['last_backward']:>9.3f}{x['first_forward']:>8.3f}")
    return out


if __name__ == "__main__":
    main()
