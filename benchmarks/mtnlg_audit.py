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

Checked (mtn14, 2026-11-29): what makes the tp 8 rows optimistic; :func:`main_tp` prints
the tables this rests on (``python benchmarks/mtnlg_audit.py``, its second half).  No
sourced component was found that prices the gap; the rows stay as they are.

- Where the gap sits.  Spread over the slowest stage's layer passes ((m + p - 1) x its
  layers, :func:`per_layer_gap`), the published step less the estimate is 12.2-15.7 ms per
  layer and micro-batch at tp 8 and micro-batch 1-2 (MT-NLG dp 8 / 10 / 12 on Selene;
  BLOOM 176B a64 and 184B a64 tp 8 mb 2 on Jean Zay), 10.4-10.8 ms at tp 8 mb 4 (178B,
  184B), 6.7-8.2 ms at tp 4 mb 2 (ten rows; the 178B with 104 heads, 24.4 ms, is an outlier
  of its own), whatever the hidden size (12,288-20,480), the pipeline depth (6-35), the
  cluster: a per-layer cost that does not grow with the bytes a layer moves.  Megatron-LM's
  own runs of the same 530B shape on Selene leave much less (spread over m x layers per
  GPU, :func:`same_shape_gap`: Narayanan's 'GPT 530B' 4.7 ms, Korthikanti's 1.3 ms, MT-NLG
  14.0-19.0 ms): the missing term is in the Megatron-DeepSpeed
  / DeepSpeed-engine path at tp 8, not in the 530B layer's kernels.
- BLOOM's tp 8 / tp 4 pair (02-28, final shape, 64 heads, mb 2; :data:`TP_PAIR`):
  published 121.6 s against 102.0 s (+19.6 s), the planner 101.5 s against 95.8 s (+5.8 s):
  the TP collectives +5.0 s (six 117 MB all-reduces per layer pass, 0.93 ms at 8 ranks,
  0.78 ms at 4: the ring's 2 (p - 1) / p, ``tests/test_mtn14.py``), the layers' compute
  +4.7 s (half-width GEMMs lose more to tile quantization: QKV 0.889 of the rate against
  0.957, fc1 0.922 / 0.976, the projection's weight gradient 0.907 / 0.968,
  ``kernel_cost.gemm_efficiency``), ``full()``'s all-gathers +0.2 s, the p2p crossings
  equal (half the slice, twice the micro-batches), the bubble -3.0 s (shorter slots), the
  tail -1.3 s (dp 4).  Nothing else the engine runs per micro-batch grows with tp.
- Jean Zay's node is one NVLink domain (a node of two 4-GPU NVLink boards would send a tp 8
  group's all-reduces through PCIe): the cluster's own NCCL 2.10.3 log (bigscience
  358e3c8f ``experiments/bandwidth/all_reduce_bench-a100-n4.txt``) connects all 112
  intra-node ring edges "via P2P/IPC/read", GPU 3 (bus 4c000) -> GPU 4 (88000) included,
  none without /read; NCCL 2.10.3 turns P2P read on only for an NVLink path between two
  sm80 GPUs (NVIDIA/nccl v2.10.3-1 ``src/graph/paths.cc:295-299``, "Enable P2P Read for
  Ampere/NVLink only"), and the job sets no NCCL_P2P_READ_ENABLE
  (``all_reduce_bench-a100-n4.slurm``).  As the profile has it.
- The TP all-reduce's mid-size gap (``tests/test_clock10.py``, KNOWN GAP: AZ_A100's
  one-thread ``-g 8`` run 167-174 GB/s bus bandwidth at 64-128 MiB where the clock prices
  211-222): NVIDIA/nccl issue #583's reporter reran ``mpirun -np 8 all_reduce_perf``
  (one process per GPU, 8 A100-SXM4-40GB, 2021-10-19) and wrote that it "didn't get
  better", so the dip is not ``-g 8``'s launch alone; but the index holds that thread as
  an excerpt that stops before the table: no second curve to calibrate from, nothing
  changed.  Were AZ_A100's figures applied to the TP all-reduces (x 1.27-1.29 at 84-117 MB),
  MT-NLG dp 8 would read about 1.18 and BLOOM tp 8 about 1.17: still beyond 15%, while
  Megatron-LM's tp 8 rows, which are right, would move as much.  For the whole tp 8 gap to
  be the all-reduces', they would run at 45-68 GB/s bus bandwidth (the table's "needed"),
  below any 8-A100 NVSwitch measurement read here.
- DeepSpeed's activation checkpointing, which Megatron-DeepSpeed runs per layer with
  ``--deepspeed-activation-checkpointing`` (BLOOM's slurm; 56c522386 ``activation_
  checkpointing/checkpointing.py`` ``CheckpointFunction``): the CPU and CUDA RNG states
  read and set on the host, ``torch.cuda.synchronize()`` only under
  ``--synchronize-each-layer`` (off), ``see_memory_usage`` returns unless forced
  (``runtime/utils.py:818-820``), the engine's ``mem_status`` returns at once
  (``pipe/engine.py:1249-1250``): no device work per layer beyond the recomputed forward.
- ``CUDA_LAUNCH_BLOCKING=1`` (BLOOM only; MT-NLG's gap is as large without it): the
  planner counts 59 kernel launches per layer pass (``layer_cost.layer_ops``), so the
  12.5 ms would be 210 us per launch; BigScience measured the flag's effect as 0-6%
  (above).  Not a source for the gap.
- A shape lead, not applied: BigScience's 02-20 rows ("tile and wave quantization",
  :data:`PREQUEL_0220`, 96 heads ASSUMED) ran the 200B with h 14,400 in 221.2 s and the
  187B with h 13,824 in 160.3 s at tp 8 (1.38x the time for 1.07x the size); the planner
  gives 147.5 / 131.6 s (1.12x): with 96 heads the head dimension is 150 against 144, and
  attention's GEMMs with K = 150 (300 bytes in fp16) miss the 16-byte multiples NVIDIA's
  GEMM guide asks of tensor-core dimensions (DU-09799-001, "Tensor Core Requirements"),
  which the A100's tile model (no measured grid on that profile) does not price.  The aligned 13,824 rows
  read 1.218 / 1.183 / 1.147 at mb 1 / 2 / 4: the same tp 8 pattern as above.  What would
  settle it is a per-GEMM measurement on an A100 at the tp 8 shards (K = 1,792 / 2,560,
  N = 5,376 / 7,680) and at head dimension 150 / 224: none was found.
- NCCL across nodes at scale (branch nccl15, 2026-11-30): the MT-NLG rows' inter-node
  collectives are the p2p crossings and the DP tail (ReduceTiedGrads, ReduceGrads over dp
  8-12 nodes, the weight all-gather): 0.71 / 0.68 / 0.66 s of 49.9 / 41.2 / 35.4 s steps.
  Even at the worst production-noise loss measured on A100 / HDR InfiniBand (De Sensi et
  al., SC24, arXiv 2408.14090: "up to 50%" of NCCL allreduce goodput at 1,024 GPUs on
  Leonardo), i.e. those seconds doubled and none hidden, they would add at most 8% of
  the 10.0 / 8.7 / 9.1 s gaps (:func:`internode_share`, tests/test_nccl15.py): the
  fabric at scale is not these rows' gap, as the per-layer reading above says.

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


# the BLOOM pair that differs by tp alone among the 02-28 rows at the final shape (tp 8 /
# dp 4 against tp 4 / dp 8, 64 heads, micro-batch 2): module docstring, "Checked (mtn14)"
TP_PAIR = (("bloom", "176B a64-tp8-mb2", 384), ("bloom", "176B a64-tp4-mb2", 384))
# Megatron of 2021 runs six TP all-reduces per layer and micro-batch under full recompute:
# two in the forward (attention's and the MLP's RowParallelLinear), two in the recomputed
# forward, two in the backward (the ColumnParallelLinears' input gradients, not overlapped:
# ``plan.megatron_2021``)
TP_ALL_REDUCES_PER_LAYER = 2 + 2 + 2


def gap_rows() -> list:
    """Every published row the DeepSpeed pipeline engine ran that has a step time: the
    MT-NLG rows, BLOOM's time rows and the 02-28 prequel's other shapes
    (``published_bloom.MEMORY_ROWS``, whose sec/it the planner's time comparison leaves
    out: read here as held-out figures, not an input)."""
    import published_bloom as B
    return [r for r in P.ROWS if r["source"] == "mt_nlg"] + list(B.ROWS) + list(B.MEMORY_ROWS)


def per_layer_gap(r) -> dict:
    """Row ``r``'s gap, the published step less the estimate's, spread over the slowest
    stage's layer passes, (m + p - 1) slots x its layers: ms per layer and micro-batch,
    beside what the planner charges that layer pass for its six TP all-reduces
    (:data:`TP_ALL_REDUCES_PER_LAYER` x ``cost.price`` of the [s, b, h] all-reduce over
    the TP group) and the bus bandwidth those all-reduces would have to run at for the
    whole gap to be theirs (a reading, not a claim)."""
    from workbench.sim_mesh import cost
    cfg, lay, cl = P.build(r)
    res = P.predict(r)
    est = res["estimate"]
    ds = est.details["deepspeed_pipe"]
    slow = ds["slowest_stage"]
    layers = lay.stage_layers(cfg.n_layer)[slow]
    slots = lay.m + lay.pp - 1
    published = est.step_time * res["ratio"]
    n = 2 * cfg.seq_len * lay.micro_batch * cfg.d_model
    ar = cost.price("all_reduce", n, lay.tp_ranks(0, slow), cl.profile)
    gap = (published - est.step_time) / (slots * layers)
    busbw_needed = 2 * (lay.tp - 1) / lay.tp * n / (ar + gap / TP_ALL_REDUCES_PER_LAYER)
    return dict(name=f"{r['name']} / {r['devices']}", tp=lay.tp, mb=lay.micro_batch,
                dp=lay.dp, pp=lay.pp, layers=layers, ratio=res["ratio"], gap=gap,
                tp_all_reduces=TP_ALL_REDUCES_PER_LAYER * ar, all_reduce=ar,
                busbw=cost.bus_bandwidth("all_reduce", n, lay.tp, ar),
                busbw_needed=busbw_needed)


# bigscience 9e64edec2a train/tr11-176B-ml/chronicles-prequel.md, "tile and wave
# quantization" (02-20): 80 layers, DP 4, TP 8, PP 10, GBS 2,048, fp16 (before the BF16
# optimizer): NHIDDEN, MBS, sec/it.  NHEADS is not in that table: 96 ASSUMED (the 02-17
# 200B's), so head dimensions 150 and 144
PREQUEL_0220 = ((14400, 1, 221.21), (13824, 1, 160.29), (13824, 2, 151.07),
                (13824, 4, 147.43))


def prequel_0220() -> list:
    """(hidden, micro-batch, published s, estimated s) of the 02-20 rows at tp 8 (held-out
    figures read as a diagnostic, not an input; not in ``published.py``: their heads are
    not stated)."""
    import published_bloom as B
    out = []
    for h, mb, sec in PREQUEL_0220:
        r = B._row(f"h{h}", h, 80, 96, 4, 8, 10, mb, 1.0, None, "prequel 02-20",
                   dtype="float16", stages=False)
        r["model"]["embed_norm"] = False
        out.append((h, mb, sec, P.predict(r)["estimate"].step_time))
    return out


def same_shape_gap() -> list:
    """(source, name, GPUs, ratio, gap ms per layer and micro-batch) of the 530B rows of
    Megatron-LM's runs (Narayanan, Korthikanti) and MT-NLG, the gap spread over m x the
    layers per GPU (no bubble term: the interleaved schedule's slots differ)."""
    out = []
    for r in P.ROWS:
        if r["source"] in ("narayanan", "korthikanti", "mt_nlg") and "530B" in r["name"]:
            cfg, lay, _ = P.build(r)
            res = P.predict(r)
            est = res["estimate"]
            gap = est.step_time * (res["ratio"] - 1) / (lay.m * cfg.n_layer / lay.pp)
            out.append((r["source"], r["name"], r["devices"], res["ratio"], gap))
    return out


def _phase_table(out, w: int = 62) -> None:
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


def main_tp():
    """The BLOOM tp 8 / tp 4 pair phase by phase, and every DeepSpeed-pipeline row's gap
    per layer and micro-batch (module docstring, "Checked (mtn14)")."""
    pair = [audit(row(*k)) for k in TP_PAIR]
    print("BLOOM's 02-28 pair at the final shape, tp 8 (dp 4, m = 256) against tp 4 "
          "(dp 8, m = 128): ms per step")
    _phase_table(pair)
    print("The gap (published - estimated step) per layer and micro-batch of the slowest "
          "stage, (m + p - 1) x its layers, beside the planner's six TP all-reduces of "
          "that layer pass (held-out figures read together, not an input):")
    print(f"  {'row':<36}{'tp':>3}{'mb':>3}{'dp':>4}{'pp':>4}{'L':>4}{'ratio':>7}"
          f"{'gap ms':>8}{'6 TP AR ms':>11}{'busbw GB/s':>11}{'needed':>8}")
    gaps = sorted((per_layer_gap(r) for r in gap_rows()),
                  key=lambda g: (-g["tp"], g["mb"], g["name"]))
    for g in gaps:
        print(f"  {g['name'][:35]:<36}{g['tp']:>3}{g['mb']:>3}{g['dp']:>4}{g['pp']:>4}"
              f"{g['layers']:>4}{g['ratio']:>7.3f}{1e3 * g['gap']:>8.1f}"
              f"{1e3 * g['tp_all_reduces']:>11.2f}{g['busbw'] / 1e9:>11.0f}"
              f"{g['busbw_needed'] / 1e9:>8.0f}")
    print("The 530B shape on Selene, gap per layer and micro-batch over m x layers per GPU:")
    for src, name, n, ratio, gap in same_shape_gap():
        print(f"  {src:<12}{name:<14}{n:>6}  ratio {ratio:.3f}  {1e3 * gap:6.2f} ms")
    print("BigScience's 02-20 rows at tp 8 (80 layers, dp 4, pp 10, fp16; 96 heads "
          "ASSUMED): published / estimated step")
    for h, mb, sec, est in prequel_0220():
        print(f"  h {h:>6} mb {mb}: {sec:8.2f} s / {est:8.2f} s = {sec / est:.3f}")
    return pair, gaps


def internode_share(a: dict, factor: float = 2.0) -> dict:
    """The row's inter-node NCCL seconds on the clock (its p2p crossings and the tail past
    the schedule: tied gradient, DP reduction, weight all-gather) and the share of its gap
    (published - predicted; held out, read, not an input) they would add scaled by
    ``factor`` with none of the added time hidden (an upper bound): ``factor`` 2 is De
    Sensi et al.'s (SC24) worst production-noise loss on A100 / HDR at 1,024 GPUs."""
    p2p = next(v for k, v in a["phases"].items() if "p2p crossings" in k)
    tail = a["phases"]["tail past the schedule: tied + DP sync exposed"]
    gap = a["published"] - a["predicted"]
    return dict(seconds=p2p + tail, gap=gap, share=(factor - 1.0) * (p2p + tail) / gap)


def main():
    out = [audit(row(*k)) for k in ROWS]
    print("A DeepSpeed pipeline step, phase by phase, as the planner prices it: ms per "
          "step (benchmarks/mtnlg_audit.py)")
    w = 62
    _phase_table(out, w)
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
    shares = [internode_share(x) for x in mt]
    print("  inter-node NCCL (p2p + tail) s / gap s / share of the gap at x 2 (De Sensi et "
          "al. SC24's worst noise loss, none hidden): " + "; ".join(
              f"{x['seconds']:.2f} / {x['gap']:.1f} / {x['share']:.3f}" for x in shares))
    return out


if __name__ == "__main__":
    main()
    main_tp()
