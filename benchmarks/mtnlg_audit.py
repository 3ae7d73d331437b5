"""Every phase of a DeepSpeed pipeline-engine step, what the planner charges for it, and
the component figure it rests on: an audit of the MT-NLG 530B rows (and BLOOM's final
run, the other ``framework='deepspeed'`` pipeline), which are optimistic and more so as
data parallelism grows at a fixed global batch.

    PYTHONPATH=$PWD python benchmarks/mtnlg_audit.py        # ~3 s

Rows (``benchmarks/published.py``): Smith et al. 2022's MT-NLG 530B at dp 8 / 10 / 12, tp 8,
pp 35, global batch 1,920, micro-batch 1 (ASSUMED), bf16 priced as DeepSpeed's
``BF16_Optimizer`` (ASSUMED: the 2021 code is not public), and BLOOM-176B's final run.
For each, the script splits the estimate's step into the engine's phases with the
planner's own functions (``deepspeed_step.stage_extras``, ``data_load``,
``bf16_optimizer.micro_batch_seconds``, ``dp_sync``) and prints them, per step, beside the
estimate's step (they add up to it) and the published one.

What a step of the engine runs, read at microsoft/DeepSpeed v0.5.4 (bc7778ea5b,
``runtime/pipe/engine.py``: "v054") and 56c522386 (the bf16 path, 2022: "56c"), with
Megatron-DeepSpeed acc3e9b5 (2021-11) as the model; what the planner charges for it (ms
per step of the dp 8 row, this script's output of 2026-11-28) and the component figure
it rests on:

==========================================  ======  =====================================
phase (source)                              dp 8    component figure; verdict
==========================================  ======  =====================================
layers fwd, recompute, bwd; embedding,      35,179  GEMM / attention rates measured on an
head, fp32 loss (GPTModelPipe)                      A100 (layer clock, Korthikanti Table 4
                                                    within 5.4%); priced, not re-audited
their TP all-reduces (2021 Megatron:         3,113  NCCL 2.10.3's tuning model on NVLink;
not overlapped, plan.megatron_2021)                 priced
LoadMicroBatch (v054:695, 56c:775) ->           13  bytes at the copy rate; two TP
get_batch_pipe (pretrain_gpt.py:118-150):           broadcasts at NCCL's price; was NOT
broadcast_data's two TP broadcasts, the             priced: added (``data_load``)
causal mask built on the GPU, clones
PartitionedTensor meta + slice clones,          46  copy rate; priced
zeros + copy-in + clone of full()
PartitionedTensor.full() all-gathers (one       83  NCCL on NVLink; priced
in forward, two in backward: v054:565-600,
650-670)
p2p: meta + 1/t slice, blocking, 4 per         217  24 GB/s per HDR NIC (profile); priced.
slot on a middle stage (p2p.py:20-83:               torch < 1.8 would broadcast on 2-rank
dist.send/recv from torch 1.8, else                 groups: the planner's NCCL model prices
broadcast on a 2-rank group)                        a 2-rank broadcast as the send (0.4455
                                                    ms for the 10.5 MB slice either way)
update_hp_grads after each backward          4,878  18 B per parameter at the copy rate;
(56c:748-760, bf16_optimizer.py:383-400)            priced (BF16_Optimizer ASSUMED)
the schedule's fill and drain (TrainSchedule 5,891  simulated rendezvous (plan.deepspeed_
simulated, plan.deepspeed_pipe)                     pipe, held to hand timelines); priced
ReduceTiedGrads: the fp32 tied gradient,        22  NCCL between two nodes; priced
first <-> last stage (56c:233-248)
ReduceGrads: _bf16_reduce_grads (56c:263)      319  bf16 all-reduce of 2 psi over dp nodes
-> allreduce_bucket (engine.py:2063-2088):          at NCCL 2.10.3's ring over one HDR NIC
cast, all-reduce, 1/dp, copy back                   per GPU (24 GB/s bus); priced
weight all-gather (all_gather_dp_groups,       155  NCCL; the shards (4 at MT-NLG's stage 0)
utils.py:981-1019): shards of 5e8 elements,         and PyTorch's copy-out of its flat
gathered into a list of views                       buffer (4 B per parameter) were NOT
                                                    priced: added (``bf16_optimizer``)
optimizer passes: norm, Adam on the             14  copy rate, Adam's measured rate; priced
partition, update_lp_params, clear_hp_grads
step collectives: the norm's 4-byte            0.1  NCCL's latency over 35 nodes; the norm
all-reduce over tp x pp (utils.py:923-930),         (0.07 ms) was NOT priced for bf16:
the loss's all-reduce and broadcast                 added (``step_collectives``)
(v054:468-498)
step: the estimate's / the published        49,931 / 59,972: ratio 1.201
==========================================  ======  =====================================

Run per step but not priced, with what bounds each: host syncs, each a drain of the GPU's
queue then a relaunch: ``ThroughputTimer.start``'s ``torch.cuda.synchronize()`` at every
forward of every stage (v054:556, ``utils/timer.py:137-142``; 56c:621), ``from_meta``'s
``tolist()`` on each received or restored partitioned tensor (56c ``runtime/utils.py:
678``), ``broadcast_data``'s ``sizes_cuda.cpu()`` (``megatron/mpu/data.py:54``), the norm's
``.item()`` per gradient (``runtime/utils.py:924``): 4 per slot on a middle stage, 1,096 a
step at dp 8; no measurement of a sync's gap was found, so not priced.  The host's Python
per instruction: not priced (ASSUMPTION: the host stays ahead of 0.1-20 ms kernels).

What the code of the run could change, not applied (no source for the 2021 bf16 path):
Megatron-DeepSpeed of 2021 says "bfloat16 requires gradient accumulation and all-reduce
to be done in fp32" (acc3e9b5 ``megatron/arguments.py:145-148``, for Megatron's own DDP,
not used under --deepspeed); an fp32 all-reduce would add 0.30 s a step (0.6%).

Reading.  Every phase the engine's source runs in a step is priced from a source line and
a component figure; the three terms found missing (the micro-batch load, the weight
all-gather's shards and copy-out, the bf16 norm's all-reduce) add 14-19 ms to a 35-50 s
step and move no row by more than 0.001.  The published steps read together (least squares
over m + p - 1 slots: held-out figures, not an input) are 0.1937 s per slot + 6.70 s per
step, the planner's 0.1811 + 0.30: 0.0126 s per slot (7%, the layers' time, or the
micro-batch assumption: the steps also fit (m + p - 1) x 0.392 s with 2-sample
micro-batches, ``published.py``) and 6.4 s per step that no phase of the engine accounts
for.  The largest per-step term, the DP sync, is 0.5 s; to explain the rest it would
have to run about 14x slower than nccl-tests' HDR rate, and the host syncs above 5.8 ms
each.  The ratios grow with dp because that fixed 6.4 s is a larger share of a shorter
step (m = 240, 192, 160), not because the DP sync grows: priced, it grows 0.50 -> 0.52 s
from dp 8 to 12, as a ring over more nodes does.

Checked again (ds12, 2026-11-29) for sourced components not in the table above; none
found that moves a row, so the rows stay as they are:

- The engine's instruction set per step, read line by line at 56c522386
  (``runtime/pipe/engine.py``, ``pipe/schedule.py`` ``TrainSchedule.steps``): LoadMicroBatch,
  Forward/BackwardPass, Send/RecvActivation, Send/RecvGrad, ReduceTiedGrads, ReduceGrads,
  OptimizerStep; every one is a row of the table.  What the engine holds through a
  backward (the restored output, the rebuilt gradient, the last stage's fp32 logits) is
  memory (``plan.deepspeed_pipe_memory.backward_held_bytes``), not time: the copies that
  make them (``full()``'s zeros, copy-in, all-gather and clone) are already the
  "PartitionedTensor" rows.
- ``CUDA_LAUNCH_BLOCKING=1`` (BLOOM's rows: tr11-176B-ml.slurm line 203, the 02-28 runs
  likewise): every launch waits for its kernel, so no kernel overlaps the host's work.
  It is not priced, and a source says it need not be: BigScience measured it on the same
  cluster with the same framework (bigscience-workshop/bigscience 9e64edec2a
  ``train/tr11-176B-ml/chronicles-prequel.md``, "dealing with JZ hanging on the large
  model", 200B, TP 8, PP 10, micro-batch 1): 84.59 TFLOPs blocking / 84.44 async at 160
  GPUs (GBS 512), 90.29 / 90.25 (GBS 2048): no difference at two or more replicas
  ("it surprisingly has no impact on this framework at this scale"); the one 6.3% gap
  (91.04 / 97.20) is a single replica at GBS 512.  The rows here run 4-8 replicas.
- BLOOM's a64-tp8-mb2 row (1.198 where its tp4 sibling is 1.065; published 121.63 s
  against 102.03 s, the planner 101.5 s against 95.8 s, the TP collectives 8.6 s against
  3.6 s, the layers' compute 73.5 s against 68.8 s, ``python benchmarks/mtnlg_audit.py``'s
  functions on those rows): the head dimension is the sibling's (a64: 224); Megatron's
  fused-softmax condition the prequel states, (heads / TP) x MBS % 4 == 0, holds (8 x 2);
  the TP 8 all-reduces run inside one node over NVLink, priced at the A100 node's NCCL
  figures because the cluster's own logs hold no single-node A100 measurement
  (``experiments/bandwidth/``: only the 32-rank, 2-channel all-reduce across 4 nodes and
  V100 nodes; its intra-node edges "via P2P/IPC/read").  The 14 s a step the row lacks
  has no source here.
- MT-NLG's 6.4 s a step: the run's DeepSpeed config and its 2021 bf16 code are not
  public (Smith et al. 2022 name neither bucket sizes nor the optimizer's code); the
  terms a config would set (``allgather_bucket_size``, ``reduce_bucket_size``, the
  ZeRO-1 optimizer's ``reduce_scatter``, which DeepSpeed's stage-1/2 optimizer runs as
  one ``dist.reduce`` per rank's slice, v054 ``runtime/zero/stage2.py`` ``average_tensor``)
  would change the DP sync, whose whole priced cost is 0.5 s: it cannot reach 6.4 s at
  nccl-tests' HDR rate.

Nothing here feeds the planner.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import published as P  # noqa: E402
from step_audit import row  # noqa: E402
from workbench.plan import bf16_optimizer as BF  # noqa: E402
from workbench.plan import costs as C  # noqa: E402
from workbench.plan import deepspeed_step as DS  # noqa: E402
from workbench.sim_mesh.cost import compute_time  # noqa: E402

ROWS = (("mt_nlg", "MT-NLG 530B", 2240), ("mt_nlg", "MT-NLG 530B", 2800),
        ("mt_nlg", "MT-NLG 530B", 3360), ("bloom", "BLOOM 176B", 384))

# host syncs per micro-batch on a middle stage of a tensor-sliced pipeline (module
# docstring, "Run but not priced"): ThroughputTimer.start's torch.cuda.synchronize() at
# each forward, PartitionedTensor.from_meta's tolist() on the received activation (forward)
# and on the kept output and the received gradient (backward)
HOST_SYNCS_PER_MICRO_BATCH = 1 + 1 + 2


def _stage_split(cfg, lay, prof, ds, s: int) -> dict:
    """Seconds per micro-batch of stage ``s`` by family: the engine's own terms
    (``deepspeed_step.stage_extras``, ``bf16_optimizer.micro_batch_seconds``) taken out
    of the stage's compute and communication, the rest being the layers, embedding, head
    and loss and their TP collectives."""
    r = ds["stages"][s]
    n = 2 * cfg.seq_len * lay.micro_batch * cfg.d_model
    e = DS.stage_extras(s, n, lay, prof, cfg.dtype)
    psi = _psi(cfg, lay, s)
    hp = BF.micro_batch_seconds(psi, lay.stage_layers(cfg.n_layer)[s], prof) \
        if ds["bf16"] else 0.0
    crossings = sum(r["transfers"])           # its own boundaries' (deepspeed_step)
    l_copy, l_comm, _ = DS.data_load(cfg, lay, prof, s == 0) if s in (0, lay.pp - 1) \
        else (0.0, 0.0, 0)
    return {"layers, embedding, head, loss: compute":
            r["compute"] - e["fwd_copy"] - e["bwd_copy"] - hp - l_copy,
            "their TP collectives":
            r["comm"] - e["fwd_comm"] - e["bwd_comm"] - crossings - l_comm,
            "LoadMicroBatch: masks, slices (get_batch_pipe)": l_copy,
            "LoadMicroBatch: TP broadcasts (broadcast_data)": l_comm,
            "PartitionedTensor copies (clone, zeros, narrow)": e["fwd_copy"] + e["bwd_copy"],
            "PartitionedTensor.full() all-gathers": e["fwd_comm"] + e["bwd_comm"],
            "p2p crossings (meta + slice, blocking)": crossings,
            "BF16_Optimizer update_hp_grads": hp}


def _psi(cfg, lay, s: int) -> float:
    from workbench.plan.memory import stage_params
    return stage_params(cfg, lay.tp, lay.pp, s, lay.stage_layers(cfg.n_layer)[s])


def _tail(cfg, lay, prof, ds) -> dict:
    """Stage 0's step tail (it ends its schedule last in 1F1B), by term, seconds: the
    tied gradient's all-reduce, ReduceGrads (the bf16 all-reduce and its copies) and the
    weight all-gather with its copy-out (``bf16_optimizer.dp_sync``)."""
    psi, ranks = _psi(cfg, lay, 0), tuple(lay.dp_ranks(0, 0))
    out = {"ReduceTiedGrads (fp32 tied gradient, first <-> last stage)": ds["tied"]}
    if lay.dp == 1 or not ds["bf16"]:
        out["ReduceGrads + weight all-gather"] = ds["stages"][0]["dp"]
        return out
    k = BF.allgather_shards(psi)
    out["ReduceGrads: bf16 all-reduce of the fp32 buffer"] = \
        C.group_price("all_reduce", 2 * psi, ranks, prof)
    out["ReduceGrads: cast, 1/dp, copy back"] = \
        compute_time(0.0, BF.REDUCE_COPY_BYTES * psi, prof, "float32", launches=3)
    out["weight all-gather, shard by shard"] = \
        k * C.group_price("all_gather", 2 * psi / k, ranks, prof)
    out["its copy-out of the flat buffer"] = compute_time(
        0.0, BF.ALLGATHER_COPY_BYTES * psi, prof, "bfloat16", launches=k * lay.dp)
    return out


def audit(r) -> dict:
    """Seconds per step of each phase of row ``r`` on the planner's clock (the slowest
    stage's work per micro-batch times m, the rest of the schedule, the tail past it,
    the optimizer and the step's small collectives), with the estimate's and the
    published step."""
    cfg, lay, cl = P.build(r)
    res = P.predict(r)
    est, prof = res["estimate"], cl.profile
    ds = est.details["deepspeed_pipe"]
    if not ds:
        raise ValueError(f"mtnlg_audit: row {r['name']!r} does not run DeepSpeed's "
                         f"pipeline engine")
    m, slow = lay.m, ds["slowest_stage"]
    phases = {f"per micro-batch x {m}: {k}": m * v
              for k, v in _stage_split(cfg, lay, prof, ds, slow).items()}
    phases["the schedule's fill and drain, and waits (bubble)"] = est.breakdown["bubble"]
    phases["tail past the schedule: tied + DP sync exposed"] = ds["after_last"]
    phases["optimizer step's passes (norm, Adam, copies, zero)"] = ds["optimizer"]
    phases["step collectives (norm over tp x pp, loss)"] = ds["collectives"]
    return dict(name=f"{r['name']} / {r['devices']}", ratio=res["ratio"], m=m,
                p=lay.pp, predicted=est.step_time, published=est.step_time * res["ratio"],
                phases=phases, listed=sum(phases.values()), slowest=slow,
                tail=_tail(cfg, lay, prof, ds), crossing=ds["crossing"],
                dp_stage0=ds["stages"][0]["dp"],
                shards=BF.allgather_shards(_psi(cfg, lay, 0)) if ds["bf16"] else None)


def fit_slots(out) -> tuple[float, float]:
    """Least squares of step = a (m + p - 1) + c over the rows in ``out`` (held-out
    figures read together, not an input of the planner): (a, c)."""
    xs = [x["m"] + x["p"] - 1 for x in out]
    ys = [x["published"] for x in out]
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    a = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return a, (sy - a * sx) / n


def main():
    out = [audit(row(*k)) for k in ROWS]
    print("A DeepSpeed pipeline step, phase by phase, as the planner prices it: ms per "
          "step (benchmarks/mtnlg_audit.py)")
    w = 62
    print(f"  {'':<{w}}" + "".join(f"{x['name']:>20}" for x in out))
    for k in out[0]["phases"]:
        label = k.split(": ", 1)[1] if k.startswith("per micro-batch") else k
        label = ("per mb x m: " + label) if k.startswith("per micro-batch") else label
        print(f"  {label[:w]:<{w}}" + "".join(
            f"{1e3 * list(x['phases'].values())[list(out[0]['phases']).index(k)]:>20.1f}"
            for x in out))
    for label, key in (("sum of the above", "listed"), ("estimate's step", "predicted"),
                       ("published step", "published")):
        print(f"  {label:<{w}}" + "".join(f"{1e3 * x[key]:>20.1f}" for x in out))
    print(f"  {'ratio predicted / published':<{w}}" + "".join(f"{x['ratio']:>20.3f}"
                                                             for x in out))
    print("  stage 0's tail, by term (ms; all-gather shards: "
          + ", ".join(str(x["shards"]) for x in out) + "):")
    for k in out[0]["tail"]:
        print(f"    {k[:w - 2]:<{w - 2}}" + "".join(
            f"{1e3 * x['tail'].get(k, float('nan')):>20.1f}" for x in out))
    mt = [x for x in out if x["name"].startswith("MT-NLG")]
    a, c = fit_slots(mt)
    pa, pc = fit_slots([dict(x, published=x["predicted"]) for x in mt])
    print(f"  MT-NLG read together (least squares over (m + p - 1), held-out, not an "
          f"input): published {a:.4f} s per slot + {c:.2f} s per step; predicted "
          f"{pa:.4f} + {pc:.2f}")
    syncs = HOST_SYNCS_PER_MICRO_BATCH * (mt[0]["m"] + mt[0]["p"] - 1)
    print(f"  unpriced host syncs on a middle stage: {HOST_SYNCS_PER_MICRO_BATCH} per "
          f"micro-batch slot, {syncs} a step at dp 8; to explain the {c - pc:.1f} s per "
          f"step alone each would cost {1e3 * (c - pc) / syncs:.1f} ms")
    return out


if __name__ == "__main__":
    main()
