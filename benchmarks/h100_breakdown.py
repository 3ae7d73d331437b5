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
2026-11-27: the 32B row (tp 8, pp 1) is the one whose DP term jumps (0.11 s at 16B,
0.38 s at 32B, in steps of 0.85 and 1.16 s): its DP group has one rank per node, so its
fp32 reduce-scatter of 4e9 gradients runs through one 400 Gb/s NIC (0.32 s) where the
16B's (two ranks per node, tp 4) runs through two (0.17 s), against a last backward of
0.12 s in both; the published 32B step leaves 0.11 s of room, which no overlap of a
0.32 s reduce-scatter with a 0.12 s backward gives.

The 1.7B row's step kernel by kernel, each charge beside the component figure it rests
on (and torchtitan's Llama 3.1 8B on 8 H100 beside it): ``benchmarks/step_audit.py``.
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
