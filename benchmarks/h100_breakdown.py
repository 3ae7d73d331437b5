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
- host (CPU) time: not priced; checked on 2026-11-29 (h100s13) against the one 2024
  component figure found, section "Host time" below: no row's forward is paced by it.
  The per-bucket NaN check (``param_and_grad_buffer.py:111-118``, ``assert not
  norm.isnan()``) and the loss's (``pretrain_gpt.py:136-141``) drain the queue 26 + 4
  times a step (1.7B), each costing the host's lead-in to the next kernel.  Later figures,
  for scale: a BF16 ``Linear`` forward + backward 311 us, ``LayerNormLinear`` 398 us on a
  GB200's Grace CPU before NVIDIA/TransformerEngine pull request #3523 (2026) trimmed
  them; a plain PyTorch ``Linear`` forward's host time 13.5 us on an H100 DGX's Xeon
  against 33-37 us on Grace (#2053, 2025);
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

Room against the floor (2026-11-29, h100x14; :func:`dp_room`, :func:`compute_needed`,
tests/test_h100x14.py).  Which term makes the 32B slower per FLOP than its neighbours:
the DP sync, and no source re-prices it.  ``tp8_audit.line_rate_floor``'s "ratio at best
0.881" is the published step (0.892 s) over the most generous step the components
allow at micro-batch 1 with fp32 gradients (1.013 s): the planner's compute and optimizer
(0.735 s; no TP collective exposed), plus the fp32 reduce-scatter of the 3.97e9
gradients per GPU at the port's 50 GB/s line rate (0.311 s, no per-call latency, not
NCCL's 46.5 GB/s) less the whole last micro-batch's backward (0.124 s), plus the bf16
all-gather (0.155 s) less the whole first forward (0.064 s).  Here the same floor for
every row, beside the DP time each published step leaves (``room``: the published step
less every other term the planner charges), seconds a step (figures of 2026-11-29):

=========  ======  ======  ======  ======  =====================================
row        floor    room   priced  room -  DP group
                                   floor
=========  ======  ======  ======  ======  =====================================
1.7B        0.000   0.080   0.010   0.080  8 GPUs a node, 6 nodes
7.1B        0.000   0.137   0.027   0.137  4 a node
16B         0.061   0.116   0.119   0.056  2 a node (two NICs)
32B         0.278   0.115   0.412  -0.162  1 a node (one NIC), 3.97e9 parameters
70B         0.313   0.322   0.439   0.009  1 a node, 4.40e9 (stage 0)
119B        0.285   0.512   0.412   0.227  1 a node
177B-462B   0.30-   0.59-   0.38-   0.18-  1 a node
            0.41    0.82    0.50    0.51
=========  ======  ======  ======  ======  =====================================

The 32B is the only row whose published step is shorter than its DP floor allows; the
70B, whose DP group has the same shape (tp 8: one GPU, one 400 Gb/s port per node, 4.4e9
parameters per GPU, fp32 gradients), leaves about its floor (0.009 s over it).
So the planner's DP physics is not contradicted by the tp-8 rows; the 32B's run did
something the others did not, or not as assumed.  Put the other way
(:func:`compute_needed`): the 32B's GPU runs 409.8 model TFLOP a step (Megatron-LM's
``num_floating_point_operations``, what the table's TFLOP/s counts); beside the DP floor
and the optimizer the published step leaves 0.591 s for them, 693 model TFLOP/s over
all the step's kernels (attention, norms and the loss included; 664 with the causal
attention counted at the half it runs), above the measured H100's sustained GEMM rate
(682.6 TFLOP/s, the median second of an 8,192-cube product at the card's 700 W limit,
``sim_mesh/measurements/h100-sxm-80gb.json``) and 1.20 times the planner's 575.5; the
16B asks 542.5 of its kernels where the planner's give 595.3, the 7.1B 478 (584), the
1.7B 418 (511).  No kernel re-pricing can close that; only an input of the row can: the
micro-batch (not stated: at 2, ``line_rate_floor`` allows 1.103), the gradients'
dtype (fp32 is forced at f2e5db402c, ``training/arguments.py:299-307``; bf16 allows
1.040), or the rank order (f2e5db402c ``parallel_state.py:317`` ``order =
"tp-cp-ep-dp-pp"``, tp innermost: a tp-8 group is a node).  What was checked for the
32B on 2026-11-29 (h100x14), beside what ``tp8_audit.py`` lists:

- the shapes, from the README's image itself (f2e5db402c ``images/model_table.png``,
  read as an image): 56 heads, hidden 7,168, 48 layers, tp 8, pp 1, dp 48, 384 GPUs,
  batch 192, 459.6 TFLOP/s, as ``published.TABLE_H100``; the image gives no ffn or
  query-group column: f2e5db402c's defaults are ffn 4 h (``arguments.py:378-387``; with
  --swiglu 2/3 of it in three matrices, the same FLOPs) and one query group per head
  (``arguments.py:636-639``); the parameter count the name "32B" implies (31.5e9 with
  untied embeddings) rules out a few query groups (27e9 at 8 groups of 128).  The README's text of
  f2e5db402c and of today (d98e8a64dd) gives no micro-batch, no script for the table;
  NVIDIA/Megatron-LM #1571 (2025) and #1031 (2024) ask for the runs' flags, unanswered
  in what the corpus holds.
- the schedule: f2e5db402c ``schedules.py:390-391`` runs all micro-batches but the last
  inside ``no_sync``: the reduce-scatter may overlap only the last backward, as priced.
- the TP overlap and the GEMM rates at tp-8 shapes: the TP collectives exposed are 41 ms
  a step (free, the row reads 0.776); the layer GEMMs run at 628 TFLOP/s where the 16B's
  run at 656 (the measured ``model_gemms`` at the layers' own shapes: 4,096 x 2,688 x
  7,168 fwd 740.7, 4,096 x 7,168 x 896 fwd 551.7): 24 ms a step between them.

The small rows' GEMMs (2026-11-29, h100x14; :func:`gemm_rates`).  The README explains
its MFU growing with size (41% at 1.7B to 47-48%) by "larger GEMMs have higher
arithmetic intensity and are consequently more efficient to execute".  The measured
H100 table (``model_gemms`` at the layers' own shapes; cuBLAS 13.0 under torch 2.11,
measured 2026-11-26) shows the opposite order at these tp-sharded shapes: the layer
GEMMs as priced run at 680.3 TFLOP/s (1.7B: 4,096 x 6,144 x 2,048 fwd 658.6, x 2,048 x
2,048 626.7, x 8,192 x 2,048 661.5, x 2,048 x 8,192 767.4), 669.5 (7.1B), 656.6 (16B),
627.8 (32B).  To take the whole gap to the published step the layer and output-layer
GEMMs would have to run at 511.0 (1.7B) and 545.3 (7.1B) TFLOP/s, 25% and 19% below the
table.  A table of the runs' own software (mid-2024: TE v1.8 on cuBLAS 12.5-12.6) at
these shapes would settle whether the 2026 library is that much faster at h 2,048; none
was found (searched: the issues and pages corpora for H100 bf16 GEMM rates by shape of
2024; ml-engineering's MAMF table gives only each card's best shape: H100 SXM 792.1).
So nothing is re-priced: the table the planner uses is a measurement, its software is
newer than the runs' (stated in the profile's notes), and this is the one component
whose 2024 figure would move the small rows.  Also read: at tp 1 the 1.7B has no TP
collective to overlap (as priced); --tp-comm-overlap with --sequence-parallel passes
f2e5db402c ``arguments.py:199-200``'s assertion before sequence parallelism is turned off
at tp 1 (``:468-469``), so the README's flags may have been given to it unchanged.

Weight gradients into fp32 (2026-11-29, h100x14; :func:`wgrad_accum_bound`).  Megatron
accumulates every weight gradient into the fp32 ``main_grad`` inside its GEMM: TE's
``fuse_wgrad_accumulation`` for the layers' linear modules (f2e5db402c
``core/transformer/custom_layers/transformer_engine.py:153, 263``, set from
``--gradient-accumulation-fusion``, on unless ``--no-gradient-accumulation-fusion``:
``training/arguments.py:1163``) and APEX's ``wgrad_gemm_accum_fp32`` for the output
layer (``core/tensor_parallel/layers.py:490-493``): fp32 C read and written with beta 1.
The measured wgrad the planner prices them at (``gpu_components.py`` ``LAYOUTS``:
dY^T X) writes bf16: 6 bytes more per weight element and micro-batch.  The roofline
counts the fp32 bytes (``layer_cost._backward``'s ``wgrad``: 8 per element), but the
GEMMs are compute-bound at these shapes, so nothing is added (the output layer's wgrad
bytes are counted at bf16 in ``costs.head_cost``, equally without effect).  Were the
epilogue's traffic not hidden at all, at the measured copy rate (3,018.5 GB/s) it would
add 11.7 ms a step to the 1.7B (9.6 layers + 2.1 output layer), 26.1 to the 7.1B, 30.4
to the 16B and 30.3 to the 32B: 1.185 -> 1.150, 1.159 -> 1.117, 0.997 -> 0.962, 0.750
-> 0.732.  No measurement of a bf16 GEMM into fp32 C with beta 1 on an H100 was found
(searched: the issues corpus); Hopper's cuBLASLt kernels overlap a tile's epilogue with
the next tile's main loop, so the true cost lies between 0 and that bound.  Not priced
(it would move all four one-stage rows alike, the 16B and 32B the wrong way).  The
device check that settles it: ``torch.addmm(c, dy.t(), x, out_dtype=torch.float32)``
(CUDA only) against ``dy.t() @ x`` at the ``model_gemms`` shapes, on an H100.

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

Host time (2026-11-29, h100s13).  Does the host pace the small rows' layers?  Within a
layer the device waits only when the host's launch time for a span exceeds the work
already queued; the queue runs ahead otherwise (no CUDA graph in these runs:
f2e5db402c's training loop never fills ``TransformerBlock.cuda_graphs``,
``transformer_block.py:132-136, 410``; ``enable_cuda_graph`` is a config field no
argument of ``megatron/training`` sets).  :func:`queue_idle` is that model (each span's kernels
issued when the host's work for it ends, the device running them when issued and free);
:func:`forward_spans` splits the planner's own forward ops of a row's layer among the
modules Megatron-core's Transformer Engine spec runs (``FORWARD_MODULES``,
``gpt_layer_specs.py:46-71, 115-120``); :func:`host_check` runs a micro-batch's forward
from an empty queue.  (Already priced and not re-added: the device-side gap between
back-to-back kernels, ``launch_overhead`` 1 us per launch in ``profiles/h100.json``,
the CUDA Graphs blog's figure, ``sim_mesh.kernel_cost``; what this checks is the host's
Python and dispatch before each launch.)  The one host figure of 2024 found: Megatron-core's
``TEColumnParallelLinear``, BF16, TP 1, 140 us per forward (its own
``ColumnParallelLinear`` 74 us; 115 us after the pull request: NVIDIA/TransformerEngine
#1191, 2024-09-18, whose changes postdate TE v1.8-v1.11, so 140 us stands for the
README's mid-2024 runs; the measuring machine is not stated).  Taken for all four
linear modules (a ``LayerNormLinear`` does at least a ``Linear``'s host work) with the
attention module, the bias-dropout-adds, the activation and Megatron's Python around
them at zero (no figure), the host's forward is at least 0.56 ms a layer, against
the device's 0.93 ms (1.7B), 1.58 ms (7.1B) and 1.3-6.7 ms (16B-462B): the device waits
only for the lead-in (0.14 ms per micro-batch's forward from an empty queue, the first
module's host time); nothing is priced (``python benchmarks/h100_breakdown.py``, last
table).  To close the 1.7B's gap (71 ms a step) by the forward alone its host would
need 1.66 ms a layer, 3.0 times the bound (7.1B: 2.49 ms, 4.5 times): the attention
module and Megatron's Python would have to take 1.1 ms (1.7B) or 1.9 ms (7.1B) a layer
of host time beyond the four linear modules.  The backward: no 2024 figure; the
device's 1.99 ms a layer (1.7B) is above even the four modules' forward + backward at
the GB200 Grace figures of #3523 (1.42 ms, 2026).  The syncs: at one TE module's
forward (140 us, ASSUMED the same in the backward) per sync, 30 a step take at most
4.2 ms of the 1.7B's 452 ms (7.1B: 51, 7.1 ms of 800 ms): under 1.1% of either step,
printed, not priced (the host time from a sync to the next kernel is not measured).
Searched, nothing found (issues and pages corpora, TE's commit log 2023-2025): a 2024
host figure for ``LayerNormLinear``, ``DotProductAttention`` (TE v1.8 selects its
backend in Python on every forward, ``attention.py`` ``DotProductAttention.forward``;
#1074, 2024-08, removed logging from the forward and backward "due to CPU overhead",
no figure), any TE module's backward, Megatron-core's per-layer Python, or a whole
Megatron layer's host time on a DGX H100 (#127, 2023, times a TE ``Linear``'s forward
and backward with CUDA events; #445, 2023-10, a TE ``Linear``'s "cost_time", 0.57 ms
against PyTorch's 0.18 ms at 1,024 x 1,024 on an H100, host and device not separated;
#761 and #836, 2024, FP8 runs, profiles shown as images).  So host time stays unpriced: the sourced part cannot pace
these layers, the rest has no figure.

Independent H100 GEMM figures against the measured file (gemm15, 2026-11-30;
:func:`independent_gemm_checks`, ``INDEPENDENT_H100_GEMMS``).  Were the measured table
(``sim_mesh/measurements/h100-sxm-80gb.json``, 700 W, random data, timed groups of back-
to-back calls) faster than what others measure, or the runs' mid-2024 cuBLAS slower
than 2026's, the small rows' GEMMs would be priced short.  Neither is what the component
figures found say.  On the same part (H100 80GB HBM3 SXM): 8,192^3 bf16 711.5 TFLOP/s,
median of 7 rounds, torch 2.8.0+cu128 (tusharhqq/napkin-math-gpu@668e7f6f8c
results/h100-sxm.json, "gemm_bf16", 2026-08), against the file's 686.6 (0.965); 2,048^3 /
4,096^3 / 8,192^3 676.6 / 788.7 / 797.5, torch 2.7.0+cu128, method not stated
(zzc0721/torch-performance-test-data issue #79, 2025-10), against the file's 540.4 /
584.5 / 686.6 (0.80 / 0.74 / 0.86); each card's best shape (MAMF, S. Bekman,
ml-engineering compute/accelerator/README.md): 792.1 with CUDA 12.1 (2024) and 794.5 with
torch 2.7.0+cu126 (2025), against the file's grid best 751.4 (0.95); NGC 24.07 (July
2024: the rows' era) "813 TFLOP/s consistently" at the best iteration without warm-up
(stas00/ml-engineering PR #59, 2024-08; the maintainer: a cold GPU's first matmul, "not
sustainable").  So the file is the lowest reading at every shape compared (it holds the
card at its power cap, the others are shorter bursts), and the libraries of 2023-2024
reached the same best-shape rates as 2026's: no source says the small rows' GEMMs ran
slower than priced, and the 511 / 545 TFLOP/s the 1.7B / 7.1B would need (``gemm_rates``)
stay 25% / 19% below every figure.  Sustained load is in the file already
(:func:`sustained_clock_check`): its 8,192^3 product, sampled every second for 12 s at
the 700 W cap (throttle reason 0x4, SW power cap), ran at 679-688 TFLOP/s with the SM
clock at 1,365-1,440 MHz, 0.88-0.93 of the tensor cores' peak at the logged clock (132
SMs x 4,096 FLOP per clock: the datasheet's 989.4 TFLOP/s at 1,830 MHz); the clock, not
the kernel, is what the power cap takes (1,980 MHz at most).  The fp32 ``main_grad``
epilogue (above): searched
again, only other GPUs' figures: fp32 accumulation through ``torch.addmm(...,
out_dtype=torch.float32)`` added 0.7% to a fused linear-cross-entropy pass on a B200
(M 8,192, H 4,096, V 131,072; linkedin/Liger-Kernel PR #1391, 2026-08: a whole pass, not
the GEMM alone), FlagGems' ``wgrad_gemm_accum_fp32`` on an H20 is given only against
Apex's (flagos-ai/FlagGems PR #5003, about 1.0x): consistent with an epilogue mostly
hidden; the one Hopper figure of beta = 1 is CUTLASS's grouped GEMM at K = 256, 4.2x
slower than beta = 0 (NVIDIA/cutlass #1352, 2024; the maintainers: small-K cases, its
epilogue "not optimized for that"), where the rows' wgrad K is the micro-batch's 4,096
tokens: no H100 figure at these shapes; it stays unpriced.  No row moved.

Kernel launches (i2117, 2026-11-30; :func:`launch_bound`, ``tests/test_i2117.py``).  The
question: are the small rows (1.7B at h 2,048, 7.1B at h 4,096) in a launch-bound regime
the planner does not price?  Priced already: every op of the layer carries its kernel
count, and ``sim_mesh.kernel_cost.compute_time`` adds the profile's ``launch_overhead``
(1 us a launch, the device-side gap between back-to-back kernels of the CUDA Graphs blog,
Gray 2019, ``profiles/h100.json``) per kernel: the layers' 35 kernels a layer (forward and
backward, no recompute) x 24 layers x 4 micro-batches are 3,360 launches and 3.4 ms of
the 1.7B's step (7.1B: 4,200, 4.2 ms).  The host's side of each launch is the "Host
time" paragraph's (not priced; the queue runs ahead).  To take the whole gap to the
published step by launches alone, each would need a device-side gap of 22.0 us (1.7B)
or 27.1 us (7.1B): 22-27 times the profile's figure and 7-9 times the host-side cost of
a raw ``cuLaunchKernel`` of a no-op kernel (3.0 us, ``CULAUNCH_HOST_GB200``: tritonbench
#1017, GB200, 2026; a host figure, for scale only).  And it cannot be one figure across
the rows: at 27.1 us a launch the 1.7B reads 0.963 and the 7.1B 1.000, but the 16B
(4,480 launches, already 0.997) falls to 0.876, the 32B from 0.750 to 0.654 (beyond 30%)
and the 70B from 0.949 to 0.837: the tp-4 and tp-8 rows run as many kernels a layer at
larger shapes and are priced right or pessimistic, so a per-launch cost that closes the
small rows opens the large ones.  Finding: launch overhead is priced, from its source;
no component figure puts it near what the small rows would need; not changed.  (The
count leaves out the output layer, loss, embedding and optimizer kernels, tens a step
beside thousands: the needed figure is an upper reading.)
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import published as P  # noqa: E402
import step_audit as SA  # noqa: E402
import tp8_audit as T8  # noqa: E402
from workbench.plan import costs as C  # noqa: E402
from workbench.plan import frameworks as F  # noqa: E402
from workbench.plan import megatron_buckets as MB  # noqa: E402
from workbench.plan import zero_cost as Z  # noqa: E402
from workbench.plan.edge_cost import edge_times  # noqa: E402
from workbench.sim_mesh import measured as MS  # noqa: E402

# Host (CPU) time of one forward of a Megatron-core linear module, BF16, TP = 1, measured
# by Transformer Engine's developers in September 2024 (NVIDIA/TransformerEngine pull
# request #1191, description of 2024-09-18, Megatron-LM 6b35ca80e8): Megatron-core's
# ``TEColumnParallelLinear`` (TE's ``Linear`` under Megatron's wrapper) 140 us, its own
# ``ColumnParallelLinear`` 74 us; 115 us after #1191 (merged 2024-10-03, after TE v1.11).
# TE v1.8 (2024-07-24) carries the same module code #1191 trimmed (its changes: no import
# of ``cpu_offload`` per forward, memoized NCCL group properties, no ``nn.Module``
# ``__setattr__`` / parameter getter per call), so 140 us stands for mid-2024.  The
# hardware of the measurement is not stated in the description read.
TE_LINEAR_FWD_HOST_2024 = 140e-6
MCORE_LINEAR_FWD_HOST_2024 = 74e-6
TE_LINEAR_FWD_HOST_AFTER_1191 = 115e-6
HOST_SOURCE = ("NVIDIA/TransformerEngine pull request #1191 (2024-09-18): Megatron-core "
               "TEColumnParallelLinear 140 us host time per forward, BF16, TP=1 "
               "(ColumnParallelLinear 74 us; 115 us after the PR)")

# A Megatron GPT layer's forward as Megatron-core with Transformer Engine's spec issues
# it (f2e5db402c megatron/core/models/gpt/gpt_layer_specs.py:46-71, 115-120): each module
# with the planner's forward ops it launches (``layer_cost``'s names; the TP collectives
# of a sequence-parallel layout inside the linear modules that run them) and whether its
# host time has a 2024 figure (``TE_LINEAR_FWD_HOST_2024``: the four TE linear modules;
# a ``LayerNormLinear`` does at least a ``Linear``'s host work, so the figure is a lower
# bound for the two of them).  TEDotProductAttention, the bias-dropout-adds and the
# activation (Megatron's Python around them) have no 2024 host figure: zero here, so
# the host time of the layer is a LOWER BOUND.
FORWARD_MODULES = (
    ("linear_qkv: TELayerNormColumnParallelLinear",
     ("layernorm_1", "sp_all_gather_1", "qkv_gemm"), True),
    ("core_attention: TEDotProductAttention", ("qkv_transpose", "flash_attention"), False),
    ("linear_proj: TERowParallelLinear", ("proj_gemm", "tp_out_1"), True),
    ("self_attn_bda", ("bias_dropout_add_1",), False),
    ("linear_fc1: TELayerNormColumnParallelLinear",
     ("layernorm_2", "sp_all_gather_2", "fc1_gemm"), True),
    ("activation: bias_gelu", ("bias_gelu",), False),
    ("linear_fc2: TERowParallelLinear", ("fc2_gemm", "tp_out_2"), True),
    ("mlp_bda", ("bias_dropout_add_2",), False),
)


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


def dp_room(x, profile=None) -> dict:
    """The DP sync a published row leaves room for, beside the least its DP sync can be
    exposed from component figures (module docstring, "Room against the floor"): ``x`` a
    :func:`breakdown` row.  ``room``: the published step less every other term the
    planner charges (compute, optimizer, TP collectives exposed, bubble: the estimate's
    step less its DP term).  ``floor``: the fp32 reduce-scatter of the first stage's
    gradients and the bf16 all-gather of its weights, each at the line rate of the NICs
    its DP group has on a node (one 400 Gb/s NDR port per GPU, 50 GB/s: the profile's
    ``inter_node.bandwidth``, DGX H100 user guide) over (n - 1) / n of the buffer (a
    ring), no per-call latency, the reduce-scatter hidden by the whole last micro-batch's
    backward and the gather by the whole first forward (``tp8_audit.line_rate_floor``'s
    terms for any pp).  ``room < floor``: no overlap model priced from these components
    reaches the published step."""
    if profile is None:
        profile = P.build(next(r for r in rows() if r["name"] == x["name"]))[2].profile
    n = x["nodes"] * x["per_node"]
    rate = profile.inter_node.bandwidth * x["per_node"]
    frac = (n - 1) / n
    rs = x["grad_bytes"] * x["params"] * frac / rate
    ag = 2 * x["params"] * frac / rate
    floor = max(0.0, rs - x["last_backward"]) + max(0.0, ag - x["first_forward"])
    room = x["published"] - (x["predicted"] - x["dp_exposed"])
    return dict(name=x["name"], rs_line=rs, ag_line=ag, floor=floor, room=room,
                priced=x["dp_exposed"], short=room - floor)


def compute_needed(x, measured: str = "h100-sxm-80gb.json") -> dict:
    """For a one-stage (pp = 1) :func:`breakdown` row ``x``: the model FLOPs a GPU runs a
    step (the published model TFLOP/s times the published step: Megatron-LM's
    ``num_floating_point_operations`` over the GPUs, which the metric is), the time the
    published step leaves them beside the DP sync's line-rate floor (:func:`dp_room`)
    and the optimizer, the model-FLOP rate that asks of the whole step's kernels
    (GEMMs, attention, element-wise, loss together), beside the rate the planner's
    compute gives and two figures of the measured H100 (``measured``): the median of its
    sustained 8,192-cube GEMM seconds (``sustained``, the card at its 700 W limit) and
    the fastest product of its ``model_gemms`` table (``best_gemm``)."""
    if x["bubble"] != 0.0:
        raise ValueError(f"h100_breakdown.compute_needed: {x['name']} has a bubble of "
                         f"{x['bubble']:.3f} s (pp > 1); one-stage rows only")
    data = json.loads(MS._path(measured).read_text(encoding="utf-8"))
    best = max(max(g["fwd"], g["dgrad"], g["wgrad"]) for g in data["model_gemms"]) * 1e12
    sustained = MS.summary(measured)["sustained_tflops"] * 1e12
    y = dp_room(x)
    flops = x["published"] * next(r["published"] for r in rows()
                                  if r["name"] == x["name"]) * 1e12
    left = x["published"] - y["floor"] - x["optimizer"]
    return dict(name=x["name"], model_flops=flops, left=left, needed=flops / left,
                planner=flops / x["compute"], sustained=sustained, best_gemm=best)


def gemm_rates(row) -> dict:
    """For a one-stage row: the layer GEMMs' model FLOPs a step (24 h^2 / tp per token
    and layer, forward and backward: QKV, proj, fc1, fc2 at ffn 4 h), the seconds the
    planner charges them (``tp8_audit.audit``'s family, from the measured
    ``model_gemms`` at the layers' own shapes, the wgrad's fp32 ``main_grad``
    accumulation included) and the rate that makes; with the output layer's GEMMs, the
    rate both would need to take the whole gap the estimate leaves to the published
    step (``gap``: published less predicted; None for a pessimistic row)."""
    cfg, lay, cl = P.build(row)
    a = T8.audit(row)
    fam = a["families"]
    m = P.predict(row)["estimate"].details["micro_batches"]
    flops = 6 * lay.micro_batch * cfg.seq_len * cfg.n_layer * 12 * cfg.d_model ** 2 \
        / lay.tp * m
    t = fam["layer GEMMs"]
    both = t + fam["output-layer GEMMs"]
    gap = a["published"] - a["predicted"]
    return dict(name=row["name"], flops=flops, seconds=t, rate=flops / t, gap=gap,
                needed=flops / t * both / (both + gap) if gap > 0 else None)


# gemm15: independent bf16 GEMM figures on the H100 80GB HBM3 SXM (module docstring,
# "Independent H100 GEMM figures"): ((m, n, k) or None for each card's best shape,
# TFLOP/s, source)
INDEPENDENT_H100_GEMMS = (
    ((8192, 8192, 8192), 711.5, "tusharhqq/napkin-math-gpu@668e7f6f8c results/h100-sxm.json "
     "'gemm_bf16' 711.466, median of 7 rounds, torch 2.8.0+cu128"),
    ((2048, 2048, 2048), 676.6, "zzc0721/torch-performance-test-data #79, torch 2.7.0+cu128"),
    ((4096, 4096, 4096), 788.7, "zzc0721/torch-performance-test-data #79, torch 2.7.0+cu128"),
    ((8192, 8192, 8192), 797.5, "zzc0721/torch-performance-test-data #79, torch 2.7.0+cu128"),
    (None, 792.1, "ml-engineering MAMF table, H100 SXM, CUDA 12.1 (6144x17920x2816)"),
    (None, 794.5, "ml-engineering MAMF table (2025), H100 SXM, torch 2.7.0+cu126"),
    (None, 813.0, "stas00/ml-engineering PR #59, NGC 24.07, best iteration without warm-up"),
)


def independent_gemm_checks(measured: str = "h100-sxm-80gb.json") -> list:
    """Each ``INDEPENDENT_H100_GEMMS`` figure beside the measured file's rate for the same
    product (its ``gemm_grid`` entry; the grid's best where the figure is a card's best
    shape): dicts of shape, independent and file TFLOP/s, their ratio, source."""
    path = os.path.join(os.path.dirname(MS.__file__), "measurements", measured)
    with open(path) as f:
        grid = json.load(f)["gemm_grid"]
    rate = {tuple(r[:3]): r[3] for r in grid}
    best = max(rate.values())
    out = []
    for shape, tf, src in INDEPENDENT_H100_GEMMS:
        got = best if shape is None else rate[shape]
        out.append(dict(shape=shape, independent=tf, file=got, ratio=got / tf, source=src))
    return out

# an H100 SXM's tensor-core FLOP per clock (bf16 dense): 132 SMs x 4,096, the
# datasheet's 989.4 TFLOP/s at 1,830 MHz (G. Lockwood, glennklockwood.com "peak FLOPS":
# 512 FMA per tensor core per clock, 4 per SM)
H100_FLOP_PER_CLOCK = 132 * 4096


def sustained_clock_check(measured: str = "h100-sxm-80gb.json") -> list:
    """Each second of the measured file's sustained 8,192^3 product: its TFLOP/s, the SM
    clock nvidia-smi logged (MHz), the tensor cores' peak at that clock and the share
    the product reached of it."""
    path = os.path.join(os.path.dirname(MS.__file__), "measurements", measured)
    with open(path) as f:
        samples = json.load(f)["sustained"]["per_second"]
    out = []
    for x in samples:
        mhz = float(x["clocks.sm"].split()[0])
        peak = H100_FLOP_PER_CLOCK * mhz * 1e6 / 1e12
        out.append(dict(tflops=x["tflops"], mhz=mhz, peak=peak, share=x["tflops"] / peak,
                        throttle=x["clocks_throttle_reasons.active"]))
    return out


def wgrad_accum_bound(row) -> dict:
    """For a one-stage row: the most the weight gradients' fp32 accumulation could add a
    step beyond what is priced (module docstring, "Weight gradients into fp32").  Megatron
    accumulates each weight-gradient GEMM's result into the fp32 ``main_grad`` inside the
    GEMM (TE's ``fuse_wgrad_accumulation`` for the layers' linear modules, APEX's
    ``wgrad_gemm_accum_fp32`` for the output layer: fp32 C read and written, beta 1),
    where the measured wgrad (``gpu_components.py`` ``LAYOUTS["wgrad"]``: dY^T X) writes
    a bf16 result: 4 + 4 - 2 = 6 bytes more per weight element and micro-batch.  The
    planner's roofline counts the fp32 bytes, but these GEMMs are compute-bound, so they
    add nothing; were that traffic not hidden at all behind the GEMM's main loop, it
    would take its bytes at the measured copy rate (the profile's memory bandwidth x
    ``memory_efficiency``).  Returns seconds a step (layers, output layer) and the ratio
    the row would read were all of it added."""
    cfg, lay, cl = P.build(row)
    if lay.pp != 1:
        raise ValueError(f"h100_breakdown.wgrad_accum_bound: {row['name']} has pp={lay.pp}; "
                         f"one-stage rows only")
    r = P.predict(row)
    est, prof = r["estimate"], cl.profile
    m = est.details["micro_batches"]
    h, L, V = cfg.d_model, cfg.n_layer, cfg.vocab_size
    rate = prof.memory_bandwidth * prof.memory_efficiency
    layers = m * 6 * L * 12 * h * h / lay.tp / rate
    head = m * 6 * V * h / lay.tp / rate
    published = est.step_time * r["ratio"]
    return dict(name=row["name"], layers=layers, head=head, ratio=r["ratio"],
                ratio_if_added=published / (est.step_time + layers + head))


# Host time of one raw ``cuLaunchKernel`` of a no-op Triton kernel, measured on a GB200
# (meta-pytorch/tritonbench pull request #1017, 2026-04-14, "nop_triton_direct_culaunch":
# 3.0 us with no argument, 3.3 us with 19): the driver's own cost per launch, host side,
# the floor under any eager framework's per-kernel host time; Grace, not the DGX H100's
# Xeon (PyTorch's ``Linear`` forward: 13.5 us on a DGX H100 against 33-37 on Grace,
# NVIDIA/TransformerEngine #2053, module docstring): a component figure for scale, never
# a price (the device-side gap the clock charges is the profile's ``launch_overhead``).
CULAUNCH_HOST_GB200 = 3.0e-6


def launch_bound(row) -> dict:
    """Kernel launches a step as the planner prices the row's layers and what a launch
    would have to cost to take the gap to the published step (module docstring, "Kernel
    launches").  ``launches``: the stage's layer ops' kernels (``step_audit._layer_ops``,
    each op's ``launches``, forward and backward) x its layers x the micro-batches: the
    output layer, loss, embedding and optimizer kernels are left out (a lower count, so
    ``needed`` is an upper reading).  ``priced``: those launches at the profile's
    ``launch_overhead`` (``sim_mesh.kernel_cost.compute_time`` adds it per launch).
    ``needed``: the device-side gap per launch that would add the published step's excess
    (``gap`` / launches + ``launch_overhead``; None where the row is pessimistic);
    ``ratio_at``: the ratio the row would read were every launch charged ``at`` seconds
    rather than the profile's figure (the step grows by launches x the difference)."""
    cfg, lay, cl = P.build(row)
    r = P.predict(row)
    est, prof = r["estimate"], cl.profile
    d = est.details
    ops = SA._layer_ops(cfg, lay, prof, row.get("attention", "flash"),
                        row.get("tp_comm_overlap", False), row.get("transformer_engine", False))
    s = d["per_rank"][d["slowest_stage"]]["stage"]
    per_layer = sum(o["launches"] for o in ops)
    n = per_layer * lay.stage_layers(cfg.n_layer)[s] * d["micro_batches"]
    published = est.step_time * r["ratio"]
    gap = published - est.step_time
    lo = prof.launch_overhead
    return dict(name=row["name"], layout=lay.short(), per_layer=per_layer, launches=n,
                launch_overhead=lo, priced=n * lo, gap=gap, ratio=r["ratio"],
                needed=gap / n + lo if gap > 0 else None,
                ratio_at=lambda at: published / (est.step_time + n * (at - lo)))


def queue_idle(spans) -> float:
    """Seconds the device waits for the host over ``spans``, a sequence of (host seconds,
    device seconds) in issue order, starting from an empty launch queue (just after a
    host sync): the host issues span k's kernels once its own work for span k is done
    (at the end of it: an upper bound on the wait, the kernels of a real module leave
    before its bookkeeping ends), the device runs them when both they are issued and its
    previous work is done; the queue otherwise runs ahead without bound (no CUDA graph:
    f2e5db402c's training loop never fills ``TransformerBlock.cuda_graphs``,
    ``transformer_block.py:132-136, 410``, and has no flag for it).  The result is the
    device's finish less its work: the lead-in to the first kernel plus every span the
    host reached late."""
    host_t = dev_t = work = 0.0
    for k, (h, d) in enumerate(spans):
        if h < 0 or d < 0:
            raise ValueError(f"queue_idle: span {k} has host {h!r} and device {d!r} "
                             f"seconds; both must be >= 0")
        host_t += h
        dev_t = max(dev_t, host_t) + d
        work += d
    return dev_t - work


def forward_spans(row, host_per_linear: float = TE_LINEAR_FWD_HOST_2024) -> list:
    """One layer's forward as (module, host seconds, device seconds), issue order
    (``FORWARD_MODULES``): the device seconds are the planner's own forward ops of the
    row's layer (``step_audit._layer_ops``, as ``estimate`` prices them; ``exposed``
    time), each op placed in exactly one module; the host seconds ``host_per_linear``
    for each TE linear module, 0 for the modules without a 2024 figure."""
    cfg, lay, cl = P.build(row)
    ops = SA._layer_ops(cfg, lay, cl.profile, row.get("attention", "flash"),
                        row.get("tp_comm_overlap", False), row.get("transformer_engine", False))
    fwd = {o["name"]: o["exposed"] for o in ops if o["phase"] == "forward"}
    placed = [n for _, names, _ in FORWARD_MODULES for n in names]
    left = sorted(set(fwd) - set(placed))
    if left:
        raise ValueError(f"h100_breakdown.forward_spans: forward ops {left} of "
                         f"{row['name']} are in no module of FORWARD_MODULES; place them")
    return [(name, host_per_linear if sourced else 0.0, sum(fwd.get(n, 0.0) for n in names))
            for name, names, sourced in FORWARD_MODULES]


def host_check(row) -> dict:
    """The host against the device for one row's layer forward and its syncs (module
    docstring, "Host time"): seconds per layer and micro-batch, or per step."""
    cfg, lay, cl = P.build(row)
    r = P.predict(row)
    est = r["estimate"]
    d = est.details
    spans = forward_spans(row)
    s = d["per_rank"][d["slowest_stage"]]["stage"]
    n_layers, m = lay.stage_layers(cfg.n_layer)[s], d["micro_batches"]
    host = sum(h for _, h, _ in spans)
    device = sum(x for _, _, x in spans)
    # a micro-batch's forward through the stage's layers from an empty queue
    idle = queue_idle([(h, x) for _ in range(n_layers) for _, h, x in spans])
    published = est.step_time * r["ratio"]
    gap = published - est.step_time
    # syncs a step: the loss's NaN check each micro-batch (pretrain_gpt.py:136-141) and
    # each bucket's in the last backward (param_and_grad_buffer.py:111-118)
    edge = edge_times(cfg, lay.micro_batch, lay.tp, lay.sp, cl.profile)
    blocks = Z.stage_blocks(cfg, lay, s, d["layer"], d["head"], edge)
    n_buckets = len(MB.buckets(cfg, lay, s, blocks)) if MB.applies(cfg, lay, s, True) \
        else 1
    return dict(name=row["name"], layout=lay.short(), m=m, layers=n_layers,
                device_forward=device, host_forward_bound=host,
                layer_forward=d["layer"].fwd_compute, idle_per_forward=idle,
                lead_in=spans[0][1], host_paces=host > device,
                gap=gap, published=published, predicted=est.step_time,
                # the host per layer forward at which the forwards' waits alone would
                # add the published step's excess (optimistic rows only)
                host_to_close_gap=device + gap / (m * n_layers) if gap > 0 else None,
                syncs=m + n_buckets, sync_bound=(m + n_buckets) * TE_LINEAR_FWD_HOST_2024)


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
    print("  the DP sync each published step leaves room for (published - every other "
          "priced term) beside its line-rate floor (dp_room: NIC line rate, no latency, the "
          "whole last backward / first forward hiding it), seconds per step")
    print(f"  {'model':<9}{'RS line':>8}{'AG line':>8}{'floor':>7}{'room':>7}{'priced':>8}"
          f"{'room-floor':>11}")
    for x in out:
        y = dp_room(x)
        print(f"  {y['name']:<9}{y['rs_line']:>8.3f}{y['ag_line']:>8.3f}{y['floor']:>7.3f}"
              f"{y['room']:>7.3f}{y['priced']:>8.3f}{y['short']:>11.3f}")
    print("  one-stage rows: the model-FLOP rate the published step asks of all the step's "
          "kernels beside the DP floor and the optimizer (compute_needed), TFLOP/s")
    print(f"  {'model':<9}{'TFLOP/GPU':>10}{'left s':>8}{'needed':>8}{'planner':>8}"
          f"{'sustained':>10}{'best GEMM':>10}")
    for x in out:
        if x["bubble"] == 0.0:
            y = compute_needed(x)
            print(f"  {y['name']:<9}{y['model_flops'] / 1e12:>10.1f}{y['left']:>8.3f}"
                  f"{y['needed'] / 1e12:>8.1f}{y['planner'] / 1e12:>8.1f}"
                  f"{y['sustained'] / 1e12:>10.1f}{y['best_gemm'] / 1e12:>10.1f}")
    print("  one-stage rows: the layer GEMMs as priced (measured model_gemms at their "
          "shapes), and the rate the layer + output-layer GEMMs would need to take the "
          "whole gap to the published step (gemm_rates)")
    print(f"  {'model':<9}{'TFLOP':>8}{'ms':>8}{'TFLOP/s':>9}{'gap ms':>8}{'needed':>8}")
    for r in rows():
        if r["layout"]["pp"] == 1:
            g = gemm_rates(r)
            need = f"{g['needed'] / 1e12:>8.1f}" if g["needed"] else f"{'-':>8}"
            print(f"  {g['name']:<9}{g['flops'] / 1e12:>8.1f}{1e3 * g['seconds']:>8.1f}"
                  f"{g['rate'] / 1e12:>9.1f}{1e3 * g['gap']:>8.1f}{need}")
    print("  the measured file's bf16 GEMMs beside independent H100 SXM figures (TFLOP/s; "
          "independent_gemm_checks; best: each card's best shape, the file's grid best)")
    for c in independent_gemm_checks():
        shape = "best" if c["shape"] is None else "x".join(map(str, c["shape"]))
        print(f"  {shape:<16}{c['file']:>7.1f}{c['independent']:>7.1f}{c['ratio']:>7.3f}  "
              f"{c['source']}")
    sc = sustained_clock_check()
    print(f"  the file's sustained 8192^3 product, {len(sc)} one-second samples at the power "
          f"cap: {min(x['tflops'] for x in sc):.1f}-{max(x['tflops'] for x in sc):.1f} "
          f"TFLOP/s at {min(x['mhz'] for x in sc):.0f}-{max(x['mhz'] for x in sc):.0f} MHz, "
          f"{min(x['share'] for x in sc):.3f}-{max(x['share'] for x in sc):.3f} of the peak "
          f"at the logged clock (sustained_clock_check)")
    print("  one-stage rows: the most the fp32 main_grad accumulation inside the wgrad "
          "GEMMs could add, unhidden (wgrad_accum_bound; not priced: compute-bound), ms a step")
    print(f"  {'model':<9}{'layers':>8}{'head':>8}{'ratio':>7}{'if added':>9}")
    for r in rows():
        if r["layout"]["pp"] == 1:
            w = wgrad_accum_bound(r)
            print(f"  {w['name']:<9}{1e3 * w['layers']:>8.1f}{1e3 * w['head']:>8.1f}"
                  f"{w['ratio']:>7.3f}{w['ratio_if_added']:>9.3f}")
    print("  kernel launches a step (the layers' kernels as priced; head, loss, embedding, "
          "optimizer left out) at the profile's device-side gap, and the gap per launch the "
          "published step would need (launch_bound; us)")
    bl = [launch_bound(r) for r in rows()]
    at = max(x["needed"] for x in bl[:2])
    print(f"  {'model':<9}{'/layer':>7}{'launches':>9}{'priced ms':>10}{'gap ms':>8}"
          f"{'needed us':>10}{'ratio':>7}{f'at {1e6 * at:.1f} us':>11}")
    for x in bl:
        need = f"{1e6 * x['needed']:>10.1f}" if x["needed"] is not None else f"{'-':>10}"
        print(f"  {x['name']:<9}{x['per_layer']:>7}{x['launches']:>9}{1e3 * x['priced']:>10.2f}"
              f"{1e3 * x['gap']:>8.1f}{need}{x['ratio']:>7.3f}{x['ratio_at'](at):>11.3f}")
    print("  host vs device, one layer's forward (ms): TE linear modules at "
          f"{1e6 * TE_LINEAR_FWD_HOST_2024:.0f} us each ({HOST_SOURCE}); the attention "
          "module and Megatron's Python unmeasured (0): the host is a LOWER BOUND")
    print(f"  {'model':<9}{'device':>8}{'host>=':>8}{'paces':>6}{'idle/fwd':>9}"
          f"{'host to close gap':>18}{'x bound':>8}{'syncs':>6}{'sync bound':>11}")
    for x in (host_check(row) for row in rows()):
        need = x["host_to_close_gap"]
        close = (f"{1e3 * need:>18.3f}{need / x['host_forward_bound']:>8.2f}"
                 if need is not None else f"{'-':>18}{'':>8}")
        print(f"  {x['name']:<9}{1e3 * x['device_forward']:>8.3f}"
              f"{1e3 * x['host_forward_bound']:>8.3f}{str(x['host_paces']):>6}"
              f"{1e3 * x['idle_per_forward']:>9.3f}{close}{x['syncs']:>6}"
              f"{1e3 * x['sync_bound']:>11.2f}")
    return out


if __name__ == "__main__":
    main()
