"""The planner (``wb.plan.estimate``) against published end-to-end training measurements.

    PYTHONPATH=. python benchmarks/published.py            # about a second

Issue 11 holds these figures out: nothing in the profiles or the planner was tuned to
them, and nothing may be.  This script only reads them beside the prediction, so that
a user knows how far to trust an estimate; ``tests/test_published.py`` guards the
spread measured here against regressions (it is not a target).

Every row is plain data: the model shape, the layout, the cluster, the published
figure, where it is printed (``cite``) and what we had to assume (``assume``).  A row
is here only when its number was read from the source itself:

- ``narayanan``: Narayanan et al. SC'21 Table 1 (weak scaling, 1.7B to 1T on up to 3,072
  A100-80GB), as published in NVIDIA/Megatron-LM's README (images/cases_april2021.png,
  commit 50a4b5fa02 of 2021-04-08: hidden size, layers, model-parallel size, GPUs, batch,
  achieved teraFLOP/s per GPU).  The layout beyond tp x pp (tp, pp, micro-batch, heads,
  interleaving) is the authors' own reproduction script, examples/sc21/run_table_1.sh
  (commit de7dc40f88, 2021-08-10), with examples/sc21/CONFIG.sh: --seq-length 2048,
  --fp16, --checkpoint-activations (every layer: full recompute), no sequence
  parallelism (it did not exist yet).  The README text: vocabulary 51,200, sequence
  2048, 8 A100 80GB per node, "the FLOPs are measured for end-to-end training".  The
  teraFLOP/s count the recomputed forward (the paper's eq. 3), as
  ``Estimate.tflops_per_device`` does.  That code (50a4b5fa02, de7dc40f88) predates
  Megatron-LM's asynchronous TP all-reduce (2021-09) and its gradient accumulation
  fusion (2022-02): the rows are priced without them (``MEGATRON_2021``,
  ``plan.megatron_2021``; fp16 without ``--use-contiguous-buffers-in-ddp``, so autograd
  accumulates the gradients).
- ``korthikanti``: the model FLOPs utilisation of NVIDIA/Megatron-LM's README (commit
  2e90a342f5, 2022-05-19; Korthikanti et al. 2022, arXiv 2205.05198, sequence parallel
  + selective recompute), "measured using a data parallel size of one".  The README
  does not give the layout; we take it from the paper's Table 3 (tensor parallel 8;
  pipeline 1 / 8 / 35 / 64; GPUs 8 / 64 / 280 / 512; global batch 4 / 64 / 280 / 512;
  micro-batch 4 / 1 / 1 / 1) as we recall it: we did not find Table 3's text, so this
  is an ASSUMPTION, stated in each row.  The schedule (1F1B, no interleaving) is
  assumed too.  The README's hardware FLOPs utilisation is printed beside ours but
  not compared: it counts selective recompute as s / (3 h) where eq. 7 has s / (6 h)
  (43.7 / 41.5 = 1.053 = (1 + s/3h + V/12hL) / (1 + s/6h + V/12hL) for the 22B), i.e.
  the attention core's forward AND backward again, while ``Estimate.hfu`` counts the
  one recomputed forward.

- ``megatron_h100``: NVIDIA/Megatron-LM README (commit f2e5db402c, 2024-07-15, "New
  scaling figures on H100 GPUs"): images/model_table.png (heads, hidden size, layers,
  tensor / pipeline / data-parallel size, GPUs, batch, per-GPU teraFLOP/s, MFU) and its
  text: GPT models, vocabulary 131,072, sequence 4096, up to 6,144 H100, end-to-end,
  ``--overlap-grad-reduce --overlap-param-gather`` (which needs Megatron's distributed
  optimizer: ``zero=1``) and ``--tp-comm-overlap`` (which needs sequence parallelism:
  ``sp=True`` where tp > 1).  The per-GPU teraFLOP/s are model FLOPs (MFU x 989, the
  H100's dense BF16 peak, in every row).  ASSUMED (not stated): bf16, micro-batch 1,
  no recompute, a fused (flash) attention kernel, no interleaving, untied embeddings
  (the parameter counts in the model-size column need them), learned positions,
  dropout 0.1.  The estimate overlaps the DP sync as those two flags do
  (``overlap_grad_reduce=True``) and the TP communication as ``--tp-comm-overlap`` does
  with Transformer Engine's default userbuffers methods (``tp_comm_overlap=True``,
  ``plan.tp_overlap``: no effect at tp = 1), and prices the layer as Megatron-LM's
  default ``--transformer-impl transformer_engine`` runs it (``transformer_engine=True``,
  ``layer_cost.TE_SOURCES``: QKV bias in the GEMMs' epilogues, q, k, v copied for TE's
  fused attention).  GEMMs, the fused attention (cuDNN's) and the
  loss are priced at rates measured on one H100 (``sim_mesh/measurements``,
  ``benchmarks/gpu_components.py``): component measurements, not these rows.
  The 32B row (tp 8, pp 1: one rank per node in each DP group, one 400G NIC) bounds the
  gradient dtype: an fp32 reduce-scatter of its 4e9 parameters per rank is 0.33 s at 48
  GB/s and may overlap only the last of 4 micro-batches' backward (0.12 s), the bf16
  all-gather (0.16 s) only the first forward (0.06 s): at least 0.31 s exposed beside
  0.71 s of compute, against 0.89 s measured.  In bf16 (Megatron-LM forces fp32 for bf16
  at f2e5db402c, which has no --grad-reduce-in-bf16: that flag first appears in
  d165a8548b, 2025-02-26) the H100 rows would read 0.919 .. 1.234 (figures of 2026-11-28,
  before Megatron-core's buckets were priced).
  Not the TP overlap: all the 32B's TP collectives exposed per step are 0.04 s.  The
  micro-batch is not given: at micro-batch 2 (4) the DP sync would hide under a twice
  (four times) longer last backward and first forward, and the 32B read 0.92 (1.09,
  before the buckets); not used (no source).  At the most generous floor (the ports'
  line rate, no per-call latency, no TP collective exposed:
  ``tp8_audit.line_rate_floor``) the 32B as priced reads 0.881 at best.  The fused attention's rate is TE's own of 2024 (cuDNN 9.3 on an
  H100 SXM, tests/test_h100mg.py): not the small rows' gap either.
  ``benchmarks/h100_breakdown.py`` prints each row's terms (tests/test_h100rows.py): from
  16B to 32B only the DP term jumps (0.12 -> 0.41 s; compute 0.70 -> 0.71, TP exposed
  0.01 -> 0.04): the 16B's DP group has two ranks per node (two NICs: its fp32
  reduce-scatter 0.17 s), the 32B's one (0.32 s), for the same 4e9 gradients per rank.
  Neither is the loss the 1.7B's gap: Megatron-LM's unfused vocabulary-parallel
  cross-entropy (cross_entropy.py at f2e5db402c; --cross-entropy-loss-fusion is off by
  default) moves 52 bytes per logit, which at the measured copy rate is the measured
  pair's time within 2%; nor the loss's per-micro-batch DP all-reduce and NaN check
  (pretrain_gpt.py:136-145, under 0.1 ms); nor TE's ring exchange on the copy engines
  (userbuffers.cu: ``cudaMemcpyAsync`` when ``use_ce``), whose NVLink rate (371-377 GB/s
  one way, 740-749 both, p2pBandwidthLatencyTest on an H100 SXM, NVIDIA/nccl #1264) is
  the profile's intra-node rate (370): the NCCL point-to-point price it has now.  A
  1.75B GPT in plain PyTorch measured 0.393 s for the same 4 micro-batches on one H100
  (h100-sxm-80gb-gpt-step.json), the README's run 0.452 s at dp 48: the gap is in what
  the run does beyond the kernels priced here, not found in the sources read.
  The DP collectives run in Megatron-core's buckets (``plan.megatron_buckets``:
  max(40M, 1M x dp) parameters, formed in reverse parameter order, f2e5db402c
  ``distributed_data_parallel.py:51-54``, ``param_and_grad_buffer.py``), each paying
  NCCL's ring latency: 74 for the 32B where one per layer (50) was priced, 0.771 ->
  0.750; 16B 1.007 -> 0.997; the 1.7B's 26 are its layers (unchanged).  What else was
  checked for these rows (the optimizer's passes, the first and last bucket, the host's
  time beside TE's measured per-module figures: at 2024's, 140 us per TE linear module's
  forward, TE #1191, every row's layer forward stays device-bound, the 1.7B's would need
  3.0x that host time, ``h100_breakdown.host_check``; the tp-8 layer against TE's measured
  one, the SMs NCCL holds for a one-rank-per-node ring): ``h100_breakdown.py`` and
  ``tp8_audit.py``, their docstrings.

- ``mt_nlg``: Megatron-Turing NLG 530B (Smith et al. 2022, arXiv 2201.11990, sec. 2.4):
  global batch 1,920 on 280, 350 and 420 DGX A100 servers, 60.1, 50.2 and 44.4 s per
  iteration, "126, 121 and 113 teraFLOP/s per GPU" (read as quoted by cli99/llm-analysis,
  examples/megatron-turing-nlg/README.md, not from the paper's own text: a secondary
  source).  Layout from the paper's sec. 2.3 as quoted there: 8-way tensor slicing,
  35-way pipeline (so data parallelism 8, 10, 12), 105 layers, h 20,480, 128 heads,
  sequence 2,048.  Precision and GPUs from the paper's own sec. 2.3, read as quoted
  verbatim in public notes: "Model training is done with mixed precision using 16-bit
  bfloat on NVIDIA's Selene supercomputer with 560 DGX A100 nodes. Each cluster node has
  8 NVIDIA 80-GB A100 GPUs" (bf16 on 80 GB parts; cli99's README says 40 GB: a misquote,
  which these rows do not follow).  ASSUMED: micro-batch 1, full recompute (sec. 2.1
  names checkpointing each transformer block as the common strategy), 1F1B (DeepSpeed's
  pipeline engine), vocabulary padded to 51,200.  These rows hold data
  parallelism growing at a fixed model: the DP sync the issue says is underpriced.
  Read together (least squares, not used by the planner): the published steps are
  378 s / dp + 12.7 s, i.e. 0.197 s per micro-batch and stage (1,920 / dp micro-batches)
  and 12.7 s per step whatever dp is; the planner's are 292 s / dp + 5.3 s (0.152 s per
  micro-batch; bubble 34 x 0.152 = 5.2 s, DP all-reduce 0.30 s, optimizer 0.03 s).
  Most of the gap is per micro-batch (compute and p2p, 30%), and about 6 s per step
  besides the bubble that no component priced here explains: the DP all-reduce of 3.8
  GB of fp16 gradients over 8 nodes is 0.3 s at the 24 GB/s per HDR NIC nccl-tests
  reach (the profile's citation), on every stage after its own last backward
  (``plan.stage_sync``); 6 s would be 1.1 GB/s per GPU.
  DeepSpeed's pipeline engine as its source runs it (v0.5.4, 2021-10-06:
  ``plan.deepspeed_pipe``, ``plan.deepspeed_step``) does not close the gap: its
  TrainSchedule with blocking transfers times as 1F1B does (the step parity is an
  order, not a lock-step); it sends the activation partitioned over the TP ranks as
  Megatron-LM does, adding per micro-batch on a middle stage two more blocking
  crossings (0.45 ms each), one more TP all-gather (0.34 ms) and clones (0.5 ms);
  FP16_Optimizer moves 70 bytes per parameter where AdamW's 28 were priced (0.08 s);
  its step collectives are 0.2 ms.  With it the planner's steps are 292 s / dp + 5.4 s
  (0.152 s per micro-batch): the rows move from 1.432 / 1.445 / 1.501 to 1.430 / 1.443
  / 1.498.  ``--partition-activations`` (its cost priced, not applied: the MT-NLG
  config is not public, the flag is off by default) would add 1.3 ms per micro-batch.
  What the sources read here leave unexplained: 0.045 s per micro-batch and stage
  (the same model on Megatron-LM's own pipeline, Narayanan's 'GPT 530B', is 1.19x
  optimistic too, so the layers' time is the first suspect) and ~7 s per step.
  The layers' time was the suspect: Megatron-DeepSpeed's layers (acc3e9b5, 2021-11) and
  Narayanan's Megatron-LM (50a4b5fa02 / de7dc40f88) predate Megatron-LM's asynchronous
  TP all-reduce (2021-09) and its gradient accumulation fusion (2022-02), which the
  layer clock had credited them with: their backward all-reduces of the input
  gradient run on the critical path (1.36 ms per 530B layer) and autograd adds each
  micro-batch's fp16 gradients in a pass of its own (6.3 ms per 3-layer stage)
  (``plan.megatron_2021``).  Priced so, the steps are 321 s / dp + 5.9 s (0.167 s per
  micro-batch and stage, 0.030 s short of the published 0.197): the rows read 1.301 /
  1.313 / 1.364, and Narayanan's 'GPT 530B' 1.081 (Table 1: 1.039 .. 1.127).
  The precision was the next: the rows were priced in fp16 (FP16_Optimizer, autograd's
  16-bit accumulation) where the paper's sec. 2.3 says bf16.  DeepSpeed had no bf16 path
  in 2021 (its first, ZeRO-2 only, is 648f7bfa5 of 2021-11-01, after the run; v0.5.4's
  pipeline engine knows fp16 only), so the run used code not public then; Megatron-
  DeepSpeed of the time (f0131ce0, 2021-08, ``megatron/arguments.py``) says "bfloat16
  requires gradient accumulation and all-reduce to be done in fp32", and the first public
  bf16 pipeline path, written by the same team (``BF16_Optimizer``, 2022,
  ``plan.bf16_optimizer``), accumulates each micro-batch's gradients into an fp32 buffer
  (18 bytes per parameter per micro-batch: 19 ms on a 3-layer 530B stage) and shards
  the optimizer as ZeRO-1 does: ASSUMED as what ran.  Priced so, the steps are
  347 s / dp + 6.5 s (0.181 s per micro-batch and stage): the rows read 1.203 / 1.213
  / 1.259.  Left unexplained: 0.016 s per micro-batch and ~6 s per step.  The published
  steps also fit (m + p - 1) x 0.392 s with m = 960 / dp micro-batches of 2 samples
  (60.4, 51.0, 44.7 s against 60.1, 50.2, 44.4): a micro-batch of 2 (the paper does not
  state it) would read 1.163 / 1.148 / 1.167; that fit is a suspicion, not an input.
  A phase-by-phase audit of the engine's step (``benchmarks/mtnlg_audit.py``) found three
  terms unpriced, now priced from their source lines (each micro-batch's load and TP
  broadcast on the first and last stage, the weight all-gather's shards and PyTorch's
  copy-out, the bf16 norm's all-reduce over tp x pp): 14-19 ms a step, ratios 1.202 /
  1.212 / 1.258 -> 1.201 / 1.212 / 1.258.  What is left, 6.4 s per step whatever dp is,
  is in no phase of the engine's source; the DP sync it would take is 14x the priced.

- ``torchtitan``: torchtitan's FSDP2 runs without torch.compile or Float8 (PyTorch's own
  benchmark tables: Llama 3.1 8B on 8 and 128 H100s of 96 GB HBM2e at 500 W, profile
  ``h100-hbm2e`` whose peak is a range between the NVL's and the SXM's; Llama 2 / 3 on 64
  A100s), its eager Llama block priced from its source (``plan.titan_eager``): the module
  ``published_torchtitan`` (its docstring says what was read where and what is left out).

Each source's collectives are priced by the NCCL release it ran (``NCCL``:
``wb.sim_mesh.nccl_tuning.with_nccl``; NCCL's tuning constants differ by release, e.g.
an inter-node Simple ring step of 9.6 us in 2.8-2.11, 28 us in 2.12-2.13, 14 us from
2.18): Narayanan's rows 2.8.3 (Megatron-LM's README names it), BLOOM 2.10.3 (the
cluster's own benchmark log), the others ASSUMED with the reason printed.  Against the
profiles' own tables (2.12.7 for the A100, NCCL master for the H100) no row moves by
more than 0.002: at these sizes the versions' differences are not where the gaps lie.

Left out for want of a source text: Korthikanti Table 5's iteration times, the 530B
on 2,240 GPUs of its abstract (global batch not stated), the GPT-3 strong-scaling
figure of the 2024 README (a chart, no numbers), NeMo-Megatron-Launcher's 175B tokens/s
(its layout at measurement time is not recorded), MLPerf, Ascend tables.

- ``bloom``: BLOOM-176B (BigScience 2022) on Jean Zay's A100s and Omni-Path, its final
  run and the prequel's layouts at the final shape (Megatron-DeepSpeed, bf16 with
  DeepSpeed's BF16_Optimizer), and the layouts the prequel reports out of memory: the
  module ``published_bloom`` (its docstring says what was read where).

- ``narayanan_zero3``: Narayanan et al. SC'21 Table 2, "ZeRO-3 without Model
  Parallelism" (GPT-3 175B on 384 / 768 / 1,536 A100s at batch 1,536; 530B on 640 at
  batch 2,560, 1,120 and 2,240 at 2,240), the achieved teraFLOP/s per GPU as encoded by
  cli99/llm-analysis's reproduction script (examples/megatron-lm/run_train_zero.sh,
  b60b392f74; its README shows the table as an image): a secondary source.  Priced as
  DeepSpeed of that time ran ZeRO-3 (``framework="deepspeed-0.3"``, ``plan.zero3_2021``:
  v0.3.13-0.3.16 read from its source, host costs per chunk measured; v0.3.13's hooks
  ASSUMED from the dates: from v0.3.14 the trace is off by one and nothing but the
  root prefetches, 2.6-9.3 s slower a step, the breakdown's ``v0.3.14`` / ``v0.3.16``
  columns).  ASSUMED: fp16,
  full recompute in chunks of two layers (the example script's ``--checkpoint-num-layers
  2``, ``Layout.recompute_num_layers``) for the 175B (96 layers), one layer for the 530B
  (105 layers: chunks of two run layer 0 again in the last chunk and v0.3.13-0.3.16
  assert on its second gradient, ``zero3_2021.check_chunks``; 1 is Megatron's default
  and the only divisor of 105 whose peak fits at 640 GPUs), micro-batch = batch / GPUs,
  DeepSpeedExamples' Megatron ZeRO-3 config.  With ``framework="deepspeed"`` (DeepSpeed as it runs today: coalesced
  gathers into one flat tensor, no host synchronisation) the 175B rows read 232 / 222 /
  188, 1.6x to 4.3x the published figures.
  Read together (not used by the planner): from 768 to 2,240 GPUs the published steps
  are flat in the GPU count and in proportion to the bytes each GPU sends (the 175B
  1,276 GB in 66.6 s at 768 and 1,536; the 530B 3,876 GB in 180 and 184 s at 1,120 and
  2,240: 19-21 GB/s per GPU, about one HDR NIC's 24), where the planner's exposed
  communication grows with the GPU count (the host's loops over p chunks per
  collective) and its NCCL rings run at 107-150 GB/s of bus bandwidth (eight NICs per
  node, as nccl-tests measure rings across DGX A100s).  Unexplained.
  Where the predicted steps go (``benchmarks/zero3_2021_breakdown.py``): the
  simulation is nearly serial (prefetching stops once the tied embedding and the
  module running hold ``stage3_max_live_parameters``: it overlaps only fc1's gather at
  175B, nothing at 530B), so a step is the compute + NCCL's gathers and
  reduce-scatters + the host's loops over p chunks + ``_post_step``'s reassembly.  The
  last two grow with p (175B: 12 + 5, 23 + 9, 46 + 19 s of host work at 384, 768,
  1,536) and make the 1,536-GPU step rise; the published step less the predicted one
  is +13, +11, -10 s (175B) and +66, +47, +44 s (530B).  The same DeepSpeed code paths
  (one list all-gather per parameter, one list reduce-scatter per gradient, the
  synchronous reassembly) are in every release to v0.5.x (summer 2021), so the
  release the authors ran does not change this.
  What NCCL 2.8.3 does at 48-280 nodes, read from its source (NVIDIA/nccl v2.8.3-1):
  all_gather and reduce_scatter are rings only (src/graph/tuning.cc:117, the tree
  priced for all_reduce alone), NCCL's bus bandwidth beyond two nodes is the graph's
  inter-node speed x its channels whatever the node count (:120-121), only the ring
  latency grows ((p - N) NVLink steps + (N - 1) network steps, :109-114, :152), and
  the thread threshold that sheds channels for small operations (src/enqueue.cc:
  307-311; NCCL_SIMPLE_THREAD_THRESHOLD 64 bytes a thread, src/include/comm.h:31, x the
  rank count for LL only, tuning.cc:235) sheds none for the matrices (300 MB and up;
  the biases, latency-bound, run on fewer): the clock prices all of this already.  A component measurement of ring all_gather /
  reduce_scatter bus bandwidth on DGX A100s (or any 8 x HDR node) at tens to hundreds
  of nodes was not found (NVIDIA/nccl and nccl-tests issues: few-node figures, 192 GB/s
  all_reduce busbw on DGX A100s (nccl #812, node count not stated), an H100 user's
  reduce_scatter falling 360 -> 260 GB/s from 4 to 128 nodes (nccl #1229, no size, no
  A100); NVIDIA's DGX SuperPOD reference architecture and the Azure NDv4 notes as
  stored here: no per-node-count table), so the network at that scale stays unpriced
  and every estimate whose data-parallel group spans three nodes or more says so
  (``nccl_tuning.scale_assumption``).  Searched again (branch nccl15): the one curve of
  collective bandwidth against 1-64 nodes of 8 GPUs found (the Ultra-Scale Playbook, 256
  MB, fabric not stated) falls 2.9-9x more than NCCL's tuning model at 8-64 nodes, and on
  A100 / HDR InfiniBand the one reading at scale is of other jobs' traffic (De Sensi et
  al., SC24: up to 50% of NCCL allreduce goodput at 1,024 GPUs on Leonardo): neither
  transfers to Selene, both are read against these rows in ``benchmarks/zero3_audit.py``
  (tests/test_nccl15.py), nothing is priced.

Other ZeRO-3 (DeepSpeed or FSDP) rows at scale are missing for want of a source on a profile here:
ZeRO++ (Wang et al. 2023) evaluated on 384 V100s (microsoft/DeepSpeed
blogs/zeropp/japanese/README.md, the evaluation section: 384 NVIDIA V100 GPUs; its
tutorial, docs/_tutorials/zeropp.md: nodes of 16 V100-SXM3; no V100 profile here);
MiCS (Zhang et al. 2022) on AWS p4d (A100 40GB, 400 Gb/s EFA per node; no such
profile); torchtitan's compiled and Float8 rows (``published_torchtitan``: no model of
Inductor's fusions, torchao's float8 recipe not Transformer Engine's); the FSDP paper's
(Zhao et al. 2023) figures were not readable here;
OPT-175B's "up to 147 TFLOP/s per GPU" on 992 A100s (FSDP + Megatron TP) is a maximum
quoted by secondary sources, with neither layout nor recompute stated.
``plan.zero3_count`` counts and prices DeepSpeed ZeRO-3's collectives from its source
instead (tests/test_zero3_count.py).
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import workbench as wb  # noqa: E402
from workbench.sim_mesh import nccl_tuning  # noqa: E402

NARAYANAN = ("Narayanan et al. SC'21 Table 1, as NVIDIA/Megatron-LM README "
             "images/cases_april2021.png (50a4b5fa02); layout: examples/sc21/run_table_1.sh "
             "(de7dc40f88)")
KORTHIKANTI = ("Korthikanti et al. 2022 (arXiv 2205.05198), MFU table of NVIDIA/Megatron-LM "
               "README (2e90a342f5), data parallel size one")
_K_ASSUME = ("layout recalled from Korthikanti Table 3 (text not found): tp 8, pp {pp}, "
             "{gpus} GPUs, global batch {gbs}, micro-batch {mbs}; 1F1B schedule assumed")
_N_ASSUME = ("fp16 as --fp16; full recompute as --checkpoint-activations; dropout 0.1 "
             "(Megatron's default)")
_N_DDP = ("; pp=1 ran torch DDP (--DDP-impl torch), whose buckets all-reduce during the "
          "last micro-batch's backward (Megatron-LM's no_sync before it): "
          "overlap_grad_reduce, in torch 1.8's buckets (plan.ddp_buckets: 1 MiB first, "
          "then 25 MiB, rebuilt in gradient-ready order; 73 .. 121 all-reduces a step, the "
          "last holding the tied word embedding)")
# the code of Table 1 (50a4b5fa02, de7dc40f88) predates Megatron-LM's async TP all-reduce
# (2021-09) and its gradient accumulation fusion (2022-02): plan.megatron_2021
MEGATRON_2021 = dict(async_tensor_model_parallel_allreduce=False,
                     gradient_accumulation_fusion=False)

# Table 1 as printed (README image): name, hidden size, layers, parameters (billion),
# model-parallel size, GPUs, batch, achieved teraFLOP/s per GPU, % of theoretical peak,
# aggregate petaFLOP/s.
TABLE_1 = [
    ("1.7B", 2304, 24, 1.7, 1, 32, 512, 137, 44, 4.4),
    ("3.6B", 3072, 30, 3.6, 2, 64, 512, 138, 44, 8.8),
    ("7.5B", 4096, 36, 7.5, 4, 128, 512, 142, 46, 18.2),
    ("18B", 6144, 40, 18.4, 8, 256, 1024, 135, 43, 34.6),
    ("39B", 8192, 48, 39.1, 16, 512, 1536, 138, 44, 70.8),
    ("76B", 10240, 60, 76.1, 32, 1024, 1792, 140, 45, 143.8),
    ("145B", 12288, 80, 145.6, 64, 1536, 2304, 148, 47, 227.1),
    ("310B", 16384, 96, 310.1, 128, 1920, 2160, 155, 50, 297.4),
    ("530B", 20480, 105, 529.6, 280, 2520, 2520, 163, 52, 410.2),
    ("1T", 25600, 128, 1008.0, 512, 3072, 3072, 163, 52, 502.0),
]
# run_table_1.sh for the same names: heads (NAH), TP, PP, micro-batch (MBS),
# --num-layers-per-virtual-pipeline-stage (None: plain 1F1B).
RUN_TABLE_1 = {
    "1.7B": (24, 1, 1, 16, None), "3.6B": (32, 2, 1, 16, None), "7.5B": (32, 4, 1, 16, None),
    "18B": (48, 8, 1, 8, None), "39B": (64, 8, 2, 4, None), "76B": (80, 8, 4, 2, 5),
    "145B": (96, 8, 8, 2, 5), "310B": (128, 8, 16, 1, 3), "530B": (128, 8, 35, 1, 1),
    "1T": (160, 8, 64, 1, None),
}
# The README's table (name, MFU %, HFU %) with the layout we assume (module docstring):
# hidden, layers, heads, pp, GPUs, global batch, micro-batch.
README_MFU = [
    ("22B", 6144, 48, 64, 1, 8, 4, 4, 41.5, 43.7),
    ("175B", 12288, 96, 96, 8, 64, 64, 1, 51.4, 52.8),
    ("530B", 20480, 105, 128, 35, 280, 280, 1, 56.0, 57.0),
    ("1T", 25600, 128, 160, 64, 512, 512, 1, 56.3, 57.0),
]

# Megatron-LM README 2024 (model_table.png): name, heads, hidden, layers, tp, pp, dp,
# GPUs, batch, per-GPU (model) teraFLOP/s, MFU %, aggregate petaFLOP/s.
TABLE_H100 = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 41, 19.6),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 47, 44.7),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 49, 93.9),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 46, 176.5),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 42, 322.3),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 43, 645.9),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 44, 997.2),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 48, 1457.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 47, 2825.6),
]
H100_CITE = ("NVIDIA/Megatron-LM README images/model_table.png (f2e5db402c, 2024-07-15), "
             "GPT, vocabulary 131,072, sequence 4096")


def _narayanan_rows():
    for name, h, l, _, _, gpus, gbs, tflops, _, _ in TABLE_1:
        a, tp, pp, mbs, vls = RUN_TABLE_1[name]
        v = l // (pp * vls) if vls else 1
        yield dict(source="narayanan", name=f"GPT {name}", profile="a100", devices=gpus,
                   model=dict(d_model=h, n_layer=l, n_head=a, dtype="float16"),
                   layout=dict(dp=gpus // (tp * pp), tp=tp, pp=pp, sp=False, zero=0,
                               recompute="full", micro_batch=mbs, global_batch=gbs,
                               schedule="interleaved_1f1b" if v > 1 else "1f1b", v=v),
                   metric="tflops_per_device", published=float(tflops), published_hfu=None,
                   cite=NARAYANAN, assume=_N_ASSUME + (_N_DDP if pp == 1 else ""),
                   megatron_args=MEGATRON_2021, overlap_grad_reduce=pp == 1)


def _korthikanti_rows():
    for name, h, l, a, pp, gpus, gbs, mbs, mfu, hfu in README_MFU:
        yield dict(source="korthikanti", name=f"GPT {name}", profile="a100", devices=gpus,
                   model=dict(d_model=h, n_layer=l, n_head=a, dtype="bfloat16"),
                   layout=dict(dp=1, tp=8, pp=pp, sp=True, zero=0, recompute="selective",
                               micro_batch=mbs, global_batch=gbs, schedule="1f1b", v=1),
                   metric="mfu", published=mfu / 100, published_hfu=hfu / 100,
                   cite=KORTHIKANTI,
                   assume=_K_ASSUME.format(pp=pp, gpus=gpus, gbs=gbs, mbs=mbs)
                   + "; bf16 (fp16 has the same A100 peak); dropout 0.1")


def _h100_rows():
    for name, a, h, l, tp, pp, dp, gpus, gbs, tflops, _, _ in TABLE_H100:
        yield dict(source="megatron_h100", name=f"GPT {name}", profile="h100", devices=gpus,
                   model=dict(d_model=h, n_layer=l, n_head=a, dtype="bfloat16",
                              vocab_size=131072, seq_len=4096, tie_embeddings=False),
                   layout=dict(dp=dp, tp=tp, pp=pp, sp=tp > 1, zero=1, recompute="none",
                               micro_batch=1, global_batch=gbs, schedule="1f1b", v=1),
                   attention="flash", overlap_grad_reduce=True, tp_comm_overlap=True,
                   transformer_engine=True, metric="model_tflops_per_device",
                   published=float(tflops), published_hfu=None, cite=H100_CITE,
                   assume="bf16, micro-batch 1, no recompute, flash attention, 1F1B assumed")


MT_NLG = [(280, 60.1, 126.0), (350, 50.2, 121.0), (420, 44.4, 113.0)]   # nodes, s, TFLOP/s
MT_NLG_CITE = ("Smith et al. 2022 (MT-NLG 530B) sec. 2.4, as quoted by cli99/llm-analysis "
               "examples/megatron-turing-nlg/README.md (secondary source); precision and "
               "GPUs: sec. 2.3 ('mixed precision using 16-bit bfloat', '8 NVIDIA 80-GB A100 "
               "GPUs'), as quoted verbatim in public notes")


def _mt_nlg_rows():
    for nodes, _, tflops in MT_NLG:
        gpus = 8 * nodes
        # bf16: the paper's sec. 2.3 (module docstring); DeepSpeed's pipeline engine runs
        # bf16 only through BF16_Optimizer (plan.bf16_optimizer), whose states are zero=1
        yield dict(source="mt_nlg", name="MT-NLG 530B", profile="a100", devices=gpus,
                   model=dict(d_model=20480, n_layer=105, n_head=128, dtype="bfloat16"),
                   layout=dict(dp=gpus // 280, tp=8, pp=35, sp=False, zero=1,
                               recompute="full", micro_batch=1, global_batch=1920,
                               schedule="1f1b", v=1, framework="deepspeed"),
                   metric="tflops_per_device", published=tflops, published_hfu=None,
                   cite=MT_NLG_CITE,
                   assume="bf16 (sec. 2.3) run as DeepSpeed's BF16_Optimizer of 2022 does "
                          "(the 2021 code is not public); micro-batch 1, full recompute, "
                          "1F1B, vocabulary 51,200 ASSUMED")


# Narayanan et al. SC'21 Table 2, "ZeRO-3 without Model Parallelism" (sec. 5.2):
# parameters (billion), GPUs, global batch, achieved teraFLOP/s per GPU, training days
# for 300B tokens, as encoded by cli99/llm-analysis examples/megatron-lm/run_train_zero.sh
# (b60b392f74: --total_num_gpus, --global_batch_size, --achieved_tflops, and the days
# in the comment above each command; its README reproduces the table as an image)
ZERO3_2021 = [(175, 384, 1536, 144.0, 90), (175, 768, 1536, 88.0, 74),
              (175, 1536, 1536, 44.0, 74), (530, 640, 2560, 138.0, 169),
              (530, 1120, 2240, 98.0, 137), (530, 2240, 2240, 48.0, 140)]
ZERO3_2021_CITE = ("Narayanan et al. SC'21 Table 2 (ZeRO-3 without model parallelism), as "
                   "encoded by cli99/llm-analysis examples/megatron-lm/run_train_zero.sh "
                   "(b60b392f74, secondary source)")
_Z3_SHAPES = {175: (12288, 96, 96), 530: (20480, 105, 128)}


def _zero3_2021_rows():
    for size, gpus, gbs, tflops, _ in ZERO3_2021:
        h, l, a = _Z3_SHAPES[size]
        # the example script's chunks of 2 where they divide the layers; at 105 layers
        # v0.3.13-0.3.16 would assert (zero3_2021.check_chunks): Megatron's default 1
        k = 2 if l % 2 == 0 else 1
        yield dict(source="narayanan_zero3", name=f"GPT {size}B", profile="a100",
                   devices=gpus, model=dict(d_model=h, n_layer=l, n_head=a, dtype="float16"),
                   layout=dict(dp=gpus, tp=1, pp=1, sp=False, zero=3, recompute="full",
                               micro_batch=gbs // gpus, global_batch=gbs, schedule="1f1b",
                               v=1, framework="deepspeed-0.3", recompute_num_layers=k),
                   metric="tflops_per_device", published=tflops, published_hfu=None,
                   cite=ZERO3_2021_CITE,
                   assume=f"fp16, full recompute in chunks of {k} layer(s) (the "
                          "example script's --checkpoint-num-layers 2 where 2 divides the "
                          "layers, else Megatron's default 1), one micro-batch per step, "
                          "DeepSpeed "
                          "v0.3.13's hooks (v0.3.14-0.3.16's trace is off by one: "
                          "zero3_2021.VERSIONS) with DeepSpeedExamples' Megatron ZeRO-3 "
                          "config ASSUMED")


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))      # its sibling modules
import published_bloom as _bloom  # noqa: E402  (BLOOM-176B on Jean Zay: its own module)
import published_torchtitan as _titan  # noqa: E402  (torchtitan's FSDP2 runs: its own module)

ROWS = [*_narayanan_rows(), *_korthikanti_rows(), *_h100_rows(), *_mt_nlg_rows(),
        *_zero3_2021_rows(), *_bloom.ROWS, *_titan.ROWS]
NOTES = {"narayanan": _N_ASSUME + _N_DDP.replace(";", " (rows with pp=1:", 1) + "); "
                      "Megatron-LM's layer of 2021 (plan.megatron_2021): TP input-gradient "
                      "all-reduces not overlapped, gradients accumulated by autograd",
         "korthikanti": "layout recalled from Korthikanti Table 3 (text not found), 1F1B "
                        "assumed; bf16 (so Megatron-LM's fp32 gradient buffer); dropout "
                        "0.1",
         "megatron_h100": "sp and zero=1 implied by the README's overlap flags; bf16, "
                          "micro-batch 1, no recompute, flash attention, 1F1B, untied "
                          "embeddings ASSUMED; gradients reduced in fp32 as Megatron-LM "
                          "forces for bf16 (--grad-reduce-in-bf16 not given: ASSUMED); "
                          "the DP sync overlapped as the README's "
                          "--overlap-grad-reduce --overlap-param-gather (estimate's "
                          "overlap_grad_reduce); the TP collectives overlapped as "
                          "--tp-comm-overlap with Transformer Engine's default userbuffers "
                          "methods (estimate's tp_comm_overlap, plan/tp_overlap.py: "
                          "userbuffers at NCCL's price ASSUMED); GEMMs, the attention "
                          "(cuDNN's fused kernel, as Transformer Engine runs it) and the loss "
                          "at the rates measured on an H100 (sim_mesh/measurements): the "
                          "range column goes down to FlashAttention-2's measured rates; "
                          "attention dropout (Megatron-LM's default 0.1, arguments.py:947 at "
                          "f2e5db402c) inside cuDNN's fused kernel at 1.034x its measured "
                          "dropout-free time (NVIDIA/TransformerEngine #3312: H200, TE 2.15, "
                          "sbhd, sequence 1024, forward + backward; UNCERTAIN: one shape, "
                          "not the rows' TE; the FlashAttention-2 end of the range "
                          "unpriced); the layer as Megatron-LM's default "
                          "--transformer-impl transformer_engine runs it (estimate's "
                          "transformer_engine, layer_cost.TE_SOURCES)",
         "narayanan_zero3": "figures encoded by a secondary source; fp16, full "
                            "recompute, micro-batch = batch / GPUs (one per step) ASSUMED; "
                            "recompute in chunks of 2 layers as DeepSpeedExamples' "
                            "ds_pretrain_gpt2-zero3.sh:47 (44be774aad, --checkpoint-num-layers "
                            "2) at 175B, of 1 at 530B (at 105 layers chunks of 2 run layer 0 "
                            "again in the last chunk and v0.3.13-0.3.16 assert on its second "
                            "gradient: zero3_2021.check_chunks; Megatron's default 1) "
                            "ASSUMED; "
                            "memory as v0.3.13 holds it at its backward peak, term by term "
                            "from its source (plan.zero3_2021.backward_peak_bytes, "
                            "benchmarks/zero3_audit.py): 79.3 GB at 530B/640 (chunks of 1) of the "
                            "profile's 80.1 GB usable (the 79.25 GiB CUDA reports); "
                            "DeepSpeed of spring 2021 (framework='deepspeed-0.3', "
                            "plan.zero3_2021) with DeepSpeedExamples' Megatron ZeRO-3 "
                            "config ASSUMED; NCCL across 48-280 nodes at its few-node "
                            "per-NIC rate: its tree latency agrees with NVIDIA/nccl #652 (32 "
                            "nodes), no A100 bus bandwidth measured at 48-280 nodes found "
                            "(UNCERTAIN: sim_mesh.nccl_tuning.scale_assumption)",
         "bloom": _bloom.NOTE,
         "torchtitan": _titan.NOTE,
         "mt_nlg": "figures quoted by a secondary source; bf16 as the paper's sec. 2.3 "
                   "says, priced as DeepSpeed's BF16_Optimizer (2022: fp32 gradient "
                   "accumulation every micro-batch, states sharded as ZeRO-1) since the "
                   "2021 bf16 code is not public; micro-batch 1, full recompute, 1F1B, "
                   "vocabulary 51,200 ASSUMED; DeepSpeed's pipeline engine and data "
                   "parallelism (framework='deepspeed')"}


# The NCCL release each source ran, as (version, why): its collectives are priced by
# that release's tuning model (``wb.sim_mesh.nccl_tuning.with_nccl``), cited or ASSUMED
_TORCH_NCCL = ("ASSUMED: the nvidia-nccl-cu12 release torch's nightlies pinned then "
               "(2.20.5 published 2024-03-06, 2.21.5 2024-04-03, 2.22.3 2024-06-19)")
NCCL = {
    ("narayanan", "a100"): ("2.8.3", "Megatron-LM README at 50a4b5fa02 (line 44): 'tested "
                            "with NGC's PyTorch container version 20.12, which uses ... nccl "
                            "2.8.3' (2.8.3 .. 2.9.9 price alike)"),
    ("narayanan_zero3", "a100"): ("2.8.3", "ASSUMED: the container of the same paper's "
                                  "Megatron rows (NGC 20.12, NCCL 2.8.3; 2.8.3 .. 2.9.9 "
                                  "price alike)"),
    ("korthikanti", "a100"): ("2.12.7", "ASSUMED: the README of 2022-05-19 recommends the "
                              "latest NGC container (22.0x: NCCL 2.12; 2.12.7 .. 2.13.4 "
                              "price alike)"),
    ("mt_nlg", "a100"): ("2.10.3", "ASSUMED: bf16 communication needs NCCL >= 2.10.3 (the "
                         "first release whose nccl.h has ncclBfloat16) and the run was in "
                         "2021, before 2.12.7 (2022-03-02); 2.10.3 and 2.11.4 price alike"),
    ("megatron_h100", "h100"): ("2.21.5", "ASSUMED: the NGC PyTorch containers of mid-2024 "
                                "(NCCL 2.21)"),
    ("bloom", "a100-jeanzay"): ("2.10.3", "the cluster's own all_reduce_bench-a100-n4.txt "
                                "(bigscience, 2022-01-28): 'NCCL version 2.10.3'; the run's "
                                "torch 1.11 was chosen for its bf16-capable NCCL (tr11 "
                                "README), 2.10.3 and 2.11.4 price alike"),
    ("torchtitan", "a100"): ("2.20.5", _TORCH_NCCL + ": torch 2.4 nightlies, April 2024"),
    ("torchtitan", "h100-hbm2e"): ("2.21.5", _TORCH_NCCL + ": torch 2.6 nightlies, "
                                   "December 2024"),
}


def cluster(row):
    """The row's Cluster: its profile with the collective tables of the NCCL release
    its source ran (``NCCL``)."""
    version = NCCL[(row["source"], row["profile"])][0]
    return wb.plan.Cluster(nccl_tuning.with_nccl(row["profile"], version),
                           row["devices"])


def readme_hfu_over_mfu(h, l, s=2048, V=51200) -> float:
    """HFU / MFU as the Megatron-LM README's table has it for selective recompute:
    (1 + s/3h + V/12hL) / (1 + s/6h + V/12hL) (the attention core's forward and
    backward counted again; module docstring).  ``Estimate.hfu / Estimate.mfu`` counts
    one recomputed forward: (1 + s/6h + s/18h + V/12hL) / (1 + s/6h + V/12hL)."""
    head = V / (12 * h * l)
    return (1 + s / (3 * h) + head) / (1 + s / (6 * h) + head)


def build(row):
    """(ModelConfig, Layout, Cluster) of one row: Megatron's GPT; vocabulary 51,200,
    sequence 2048 and tied embeddings unless the row says otherwise; a row naming a
    ``preset`` (``wb.plan.presets``) is that model with ``row["model"]`` applied."""
    if "preset" in row:
        cfg = wb.plan.presets.get_config(row["preset"], **row["model"])
        return cfg, wb.plan.Layout(**row["layout"]), cluster(row)
    cfg = wb.models.ModelConfig(**{**dict(arch="gpt", vocab_size=51200, seq_len=2048,
                                          tie_embeddings=True, dropout=0.1), **row["model"]})
    return cfg, wb.plan.Layout(**row["layout"]), cluster(row)


def _metric(row, est, cl, cfg) -> float:
    if row["metric"] == "model_tflops_per_device":
        return est.mfu * cl.profile.peak(cfg.dtype) / 1e12
    if row["metric"] == "tokens_per_device":      # torchtitan's TPS/GPU
        return est.layout.global_batch * cfg.seq_len / est.step_time / cl.devices
    return getattr(est, row["metric"])


def predict(row) -> dict:
    """The planner's estimate of ``row`` and the ratio predicted / published of the
    published metric: ``tflops_per_device`` (hardware FLOPs), ``mfu``, or
    ``model_tflops_per_device`` (MFU x peak), ``tokens_per_device`` (torchtitan's TPS/GPU);
    ``low`` / ``high``: the metric at the ends
    of ``wb.plan.estimate_range`` (the profile's uncertain figures at their stated
    bounds: on the H100 the measured FlashAttention-2 .. cuDNN fused attention rates;
    ``row["pinned"]``: figures the source pins, held at both ends, ``estimate_range``)."""
    cfg, lay, cl = build(row)
    rng = wb.plan.estimate_range(cfg, lay, cl,
                                 attention=row.get("attention", "materialized"),
                                 overlap_grad_reduce=row.get("overlap_grad_reduce", False),
                                 tp_comm_overlap=row.get("tp_comm_overlap", False),
                                 transformer_engine=row.get("transformer_engine", False),
                                 **row.get("megatron_args", {}),
                                 **row.get("estimate_args", {}),
                                 pinned=row.get("pinned"))
    est = rng.estimate
    pred = _metric(row, est, cl, cfg)
    ends = [_metric(row, e, cl, cfg) for e in (rng.slow, rng.fast, est)]
    return dict(row=row, estimate=est, predicted=pred, ratio=pred / row["published"],
                low=min(ends), high=max(ends))


def summary(ratios) -> dict:
    r = sorted(ratios)
    return dict(n=len(r), median=statistics.median(r), min=r[0], max=r[-1])


def _fmt(metric, x):
    return f"{100 * x:6.1f}%" if metric == "mfu" else f"{x:7.1f}"


def main():
    t0 = time.perf_counter()
    results = [predict(row) for row in ROWS]
    elapsed = time.perf_counter() - t0
    for source, label in (("narayanan", "achieved TFLOP/s per GPU (with recompute)"),
                          ("korthikanti", "MFU (eq. 7; SP + selective recompute)"),
                          ("megatron_h100", "model TFLOP/s per GPU (MFU x 989)"),
                          ("mt_nlg", "TFLOP/s per GPU (with recompute)"),
                          ("narayanan_zero3", "achieved TFLOP/s per GPU (with recompute)"),
                          ("bloom", _bloom.LABEL), ("torchtitan", _titan.LABEL)):
        rows = [r for r in results if r["row"]["source"] == source]
        print(f"\n{rows[0]['row']['cite']}\n  metric: {label}")
        print(f"  {'model':<9}{'GPUs':>6}  {'layout':<44}{'published':>10}{'predicted':>10}"
              f"{'ratio':>7}  memory GB  fits  range of the prediction")
        for r in rows:
            row, est = r["row"], r["estimate"]
            print(f"  {row['name']:<9}{row['devices']:>6}  {est.layout.short():<44}"
                  f"{_fmt(row['metric'], row['published']):>10}"
                  f"{_fmt(row['metric'], r['predicted']):>10}{r['ratio']:>7.3f}"
                  f"  {est.memory['total'] / 1e9:9.1f}  {str(est.fits):<5} "
                  f"{_fmt(row['metric'], r['low']).strip()} .. "
                  f"{_fmt(row['metric'], r['high']).strip()}"
                  f"{' (published inside)' if r['low'] <= row['published'] <= r['high'] else ''}")
            if row["published_hfu"] is not None:
                m = row["model"]
                print(f"  {'':<9}{'':>6}  HFU published {100 * row['published_hfu']:.1f}% "
                      f"(/ MFU = {row['published_hfu'] / row['published']:.4f}; with s/3h: "
                      f"{readme_hfu_over_mfu(m['d_model'], m['n_layer']):.4f}), "
                      f"ours {100 * est.hfu:.1f}% (one recomputed forward)")
        s = summary(r["ratio"] for r in rows)
        print(f"  ratio predicted / published: median {s['median']:.3f}, range "
              f"{s['min']:.3f} .. {s['max']:.3f} over {s['n']} rows")
        print(f"  assumptions: {NOTES[source]}")
        for key in sorted({(source, r["row"]["profile"]) for r in rows}):
            print(f"  NCCL {NCCL[key][0]} on {key[1]}: {NCCL[key][1]}")
    print("\n".join(_bloom.memory_lines()))   # BLOOM's measured memory and OOM layouts
    print("\n".join(_titan.oom_lines()))      # torchtitan's OOM layout
    print("\nbias (ratio predicted / published; > 1: optimistic) by")
    for label, key in (("source", lambda r: r["row"]["source"]),
                       ("GPU", lambda r: r["row"]["profile"]),
                       ("framework", lambda r: r["estimate"].layout.engine)):
        groups = {}
        for r in results:
            groups.setdefault(key(r), []).append(r["ratio"])
        print(f"  {label:<10}" + "; ".join(
            f"{k}: median {summary(v)['median']:.3f} ({summary(v)['min']:.3f} .. "
            f"{summary(v)['max']:.3f}, {len(v)} rows, {sum(x > 1 for x in v)} optimistic)"
            for k, v in sorted(groups.items())))
    s = summary(r["ratio"] for r in results)
    bad = [r["row"]["name"] for r in results
           if not (math.isfinite(r["predicted"]) and r["predicted"] > 0 and r["estimate"].fits)]
    ratios = [r["ratio"] for r in results]
    within = sum(abs(x - 1) <= 0.15 for x in ratios)
    inside = sum(r["low"] <= r["row"]["published"] <= r["high"] for r in results)
    print(f"\nall {s['n']} rows: ratio median {s['median']:.3f}, range {s['min']:.3f} .. "
          f"{s['max']:.3f}; within 15%: {within}; beyond 30%: "
          f"{sum(abs(x - 1) > 0.30 for x in ratios)}; optimistic {sum(x > 1 for x in ratios)}, "
          f"pessimistic {sum(x < 1 for x in ratios)}; published inside the prediction's "
          f"range: {inside}; rows not fitting or not finite: {bad or 'none'}; "
          f"{elapsed:.2f} s for {len(results)} rows (3 estimates each)")
    return results


if __name__ == "__main__":
    main()
