"""Every phase of a DeepSpeed v0.3.13 ZeRO-3 step, what the planner charges for it, and
the figure it rests on: an audit of Narayanan et al.'s GPT 530B rows against the GPT 175B
rows at the same micro-batch.

    PYTHONPATH=$PWD python benchmarks/zero3_audit.py        # ~3 s

Rows (``benchmarks/published.py``, ``narayanan_zero3``): GPT 175B (h 12,288, 96 layers)
on 384 / 768 / 1,536 A100s and GPT 530B (h 20,480, 105 layers) on 640 / 1,120 / 2,240,
micro-batch 4 / 2 / 1, one micro-batch a step, fp16, full recompute, ``framework=
"deepspeed-0.3"`` (``plan.zero3_2021``: DeepSpeed v0.3.13, 12a53b4383, with
DeepSpeedExamples' Megatron ZeRO-3 config 44be774aad and Megatron-LM-v1.1.5-ZeRO3
7b5abd576e).  The script splits each estimate's step into the engine's phases with the
planner's own functions (``zero3_2021.dp_sync_parts``: the simulated micro-batches'
work by kind, ``_post_step``, ``step_host_seconds``) and prints them, per step; they add
up to the estimate's step (``tests/test_i21z3530.py``).  The simulation runs host, compute
stream and NCCL stream as three lanes, so the work of one phase runs beside another's:
the ``hidden`` line is what ran beside, the balance.

What the engine does that differs between 175B and 530B, read at v0.3.13
(s3 = ``runtime/zero/stage3.py``, pp = ``runtime/zero/partition_parameters.py``, ck =
``runtime/activation_checkpointing/checkpointing.py``), whether the planner prices it,
and its charge (s per step, 175B / 384 vs 530B / 640, this script's output of
2026-11-28, after the terms this audit added):

==========================================  ===========  ==================================
phase (source)                              175B / 530B  figure; verdict
==========================================  ===========  ==================================
per-layer sizes vs stage3_max_live (1e9)    578 / 0      the live counter as s3:293-299,
and prefetch bucket (6.04e7): at 530B the   prefetches   :312-334, :357-411 keep it
tied embedding alone (1.05e9) holds the     a micro-     (zero3_2021.simulate); priced:
counter above the limit, so nothing is      batch        530B is fully serial; fc1/fc2
prefetched; fc1 / fc2 (1.68e9) are                       (1.68e9) gathered whole
gathered whole (s3:357-411), and the                     (``:357-411``), reuse distance
reuse distance (1e9) keeps no matrix                     keeps none: 11 gathers a layer
gather buffer per parameter: torch.zeros    0.46 / 1.38  2 B/elem at HBM, then the
of the whole parameter, then                             host's synchronize; priced
torch.cuda.synchronize (pp:607-611)
allocator near the limit (530B / 640 at     -            no figure for cudaMalloc retries;
74.8 of 75.2 GB usable as priced)                        NOT priced; the 530B rows at 25
                                                         and 42 GB are as optimistic
all-gather, one NCCL call per parameter     6.1 / 17.4   NCCL 2.8.3's tuning model; at
on a list of p chunks (pp:596-636), not a                530B every matrix is 0.4-1.7e9
coalesced bucket; c10d's flat buffer and                 elements: bandwidth-bound, a
copy-out per chunk                          1.3 / 3.8    bucket would not change it;
                                                         priced
DeepSpeed's loops over p chunks (pp:623-    2.8+3.3 /    measured per chunk (AG 6.9,
629, :741-768) and c10d's recordStream +    5.1+6.1;     RS 7.5, c10d 6.1 us); priced;
copy_ per chunk (host)                      5.2 / 9.5    grow with p, not with h
reduce-scatter per gradient, every matrix   2.6 / 7.1    NCCL 2.8.3; the pre-division
above reduce_bucket_size (6.7e7): its own                (s3:1496-1505) 0.4 / 1.2 s,
bucket, contiguous_gradients' copy skipped               hidden; priced
(s3:1431-1468, :1689-1716)
the fp16 optimizer: overflow check          0.02 / 0.04  bytes at HBM (80 B/param of the
float(x.float().sum()) per partition                     partition); the 2 host waits
(s3:2461-2506), norm g.double().norm(2)                  per tensor and 2 scalar
+ .item() per partition (s3:1941-1997),                  all-reduces were NOT priced:
flatten, unscale, Adam, copy                             added, 0.03 s
_post_step: persistent parameters           4.7 / 8.5    measured per-chunk copies;
gathered and reassembled (s3:2339-2349)                  priced
partition_activations at mp 1 (ck:446-     0.10 / 0.18   4 + 14 B/elem at the copy rate;
455, :284-309): clone; zeros, copy,                      was NOT priced: added
one-rank all-gather
CPU-side Python per sub-module hook         -            no measurement found; NOT priced
(s3:1062-1180; ~11 modules a layer, 6                    (ASSUMPTION: cheap beside the
hook calls each a micro-batch)                           100 ms GEMMs they wait for)
compute: layers, embedding, head, loss      51.3 / 145.5 layer clock (Korthikanti Table 4
                                                         within 5.4%); its fused kernels
                                                         replaced by the example's eager
                                                         ones since (re-audit below:
                                                         52.6 / 147.6)
step: the estimate's / the published        67.6 / 188.4 ratio 1.207 / 1.356
                                            81.6 / 255.5
==========================================  ===========  ==================================

Reading.  Every phase v0.3.13 runs in a step is priced from a source line and a
component figure; the three found unpriced (the optimizer's per-tensor host waits and
scalar all-reduces, the other host waits of the loop, partition_activations' copies)
add 0.05-0.08 s to 67-188 s steps and move the six rows by 0.001 or less (before /
after: 1.208 / 1.224 / 0.894 / 1.357 / 1.376 / 1.356 -> 1.207 / 1.223 / 0.893 / 1.356 /
1.375 / 1.356).  What differs at 530B is priced already: no prefetch at all (the tied
embedding fills the live limit), 11 gathers a layer, 3x the bytes; the host loops grow
with p, not with h.  So the 530B step is, as priced, the sum of its parts (compute 145.5
s, NCCL 24.5 s, host loops 20.6 s, ``_post_step`` 8.5 s, less 17.4 s run beside) and
the published one is 67 s longer.

What the published steps would need, one term at a time (held-out figures read, not an
input; the script's last lines): the NCCL seconds x 3.65 / 2.79 / 2.51 at 640 / 1,120 /
2,240 GPUs (a bus bandwidth of 43 / 52 / 49 GB/s where NCCL 2.8.3's tuning model over
eight HDR NICs a node gives 158 / 145 / 123), the compute x 1.44 / 1.65 / 2.29, or each
of the 4,316 host waits 15.1 / 11.1 / 11.1 ms longer.  None is one figure across the
530B rows and the 175B rows beside them (NCCL x 2.32 / 2.01 / 0.28, compute x 1.23 /
1.40 / 0.28, waits 3.0 / 2.6 / -2.4 ms: the 175B / 1,536 step is already too long,
from its host loops over 1,536 chunks).  The NCCL reading is the nearest to one figure
for the 530B rows (43-52 GB/s, about two HDR NICs' worth a node where a ring over eight
is priced), as the published table's own note found (19-21 GB/s of bytes sent per GPU
over the whole step); no nccl-tests measurement of A100 rings at 80-280 nodes was
found to support it (``sim_mesh.nccl_tuning.scale_assumption``), so nothing is changed.

The figures above were read before the rows took the example script's
``--checkpoint-num-layers 2`` (``Layout.recompute_num_layers``, branch i21mem); with it
the script prints 626 / 0 prefetches, partition_activations 0.05 / 0.09 s, steps 68.2 /
190.0 s, ratios 1.197 / 1.345 (the chunk's first layer's fc2 is no longer kept for its
backward: one more gather per chunk); for the 530B rows at 640 / 1,120 / 2,240 the
published step needs NCCL x 3.56 / 2.70 / 2.35, compute x 1.45 / 1.65 / 2.22, or each
host wait 14.7 / 10.6 / 9.9 ms longer: the reading below stands.

Memory (``memory_audit``, printed last): every term of a rank's memory at GPT 530B /
640 (micro-batch 4, chunks of 2 layers), as ``memory.stage_memory`` counts it and as
v0.3.13 holds it at its backward peak, read from the source: the weight gradient of
fc2 of a chunk's last layer, the chunk's first backward op, when both layers'
recomputed activations are live (ck = checkpointing.py; GB = 1e9 B; script output of
2026-11-28):

=============================================  =====  =====  ===============================
term (source)                                  plan.  v0.3   verdict
=============================================  =====  =====  ===============================
params, grads, optimizer partitions: 2 + 2 +   13.24  13.24  agree: s3:873-900 (fp16 flat,
12 B / partitioned parameter                                 ds_tensor views), s3:1606-1635
                                                             grads_in_partition
NCCL communicator buffers                      0.91   0.91   plan.comm_memory, not re-read
reduce bucket: two ipg buffers (overlap_comm,  0.13   0.27   UNDER: s3:2535-2546, config.py
True by default at stage 3)                                  :89-94, constants.py:55
gathered parameters: the root's tied           6.71   5.45   OVER: the planner's window
embedding (held all micro-batch) + fc2 (kept                 holds fc1 + fc2 (today's
from its recompute); nothing prefetched (the                 prefetch); v0.3.13 at 530B
live counter above 1e9, s3:293-297, :312-334)                prefetches nothing
fc2's weight gradient, whole (above the        3.36   3.36   agree (s3:1452-1453)
bucket: kept out of it)
the previous extra-large gradient (the last    0      2.52   UNDER: reduced at the next
chunk's qkv), freed at fc2's hook                            hook, freed at the one after
                                                             (s3:1433-1436, :1693-1694,
                                                             pp:848)
the head's gradient of the tied embedding,     0      2.10   UNDER: one leaf, two uses:
held by autograd until the embedding's                       measured (tests/test_i21mem.py)
backward
c10d's flat buffer (whole parameter) of a      0      0      not live at this instant: fc2's
list all-gather / reduce-scatter                             reduce-scatter starts at its
                                                             bias's hook, after the previous
                                                             gradient and fc2's input are
                                                             freed (77.83 there)
checkpointed inputs, one per chunk (53)        17.78  17.78  agree: ck:441-455, :538
embedding dropout mask                         0.17   0.17   agree
head: final-LN and head inputs, fp32 logits    2.35   0      OVER: freed by the head's
                                                             backward, before the layers'
the chunk's two layers recomputed, less its    29.19  32.55  UNDER: the planner subtracts the
input                                                        unreduced gradient (3.36), but
                                                             fc2's wgrad is allocated while
                                                             all of them are live
sum                                            73.84  78.34  usable 75.22 (a100.json)
=============================================  =====  =====  ===============================

Reading.  Two terms are overcounted (the prefetched module, 1.26 GB; the head's saved
tensors at the backward peak, 2.35 GB), four undercounted (the second ipg buffer, the
previous extra-large gradient, the tied embedding's gradient in autograd's buffer, the
unreduced-gradient subtraction: 8.1 GB); c10d's flat buffer is real but not live at
this row's peak (at micro-batch 2 and 1, 1,120 and 2,240 GPUs, it is: 47.6 and 31.5 GB
at fc2's bias hook against 47.4 and 31.0 at its weight gradient).  So the audit does not
support counting c10d's buffer alone: v0.3.13's peak, 78.3 GB (79.7 with fc2's
input-gradient temporary, which the planner leaves out everywhere), is within the
profile's usable 80.1 GB since memory_bytes is the 79.25 GiB CUDA reports (a100.json;
it was the datasheet's 80e9 B, usable 75.2).  Since then the planner counts the
source's terms (``zero3_2021.backward_peak_bytes``; the table's "plan." column is what
it counted before): the larger of this instant and fc2's bias hook, 78.3 / 47.6 / 31.5
GB at 640 / 1,120 / 2,240 GPUs (was 73.8 / 41.7 / 24.7).  The peak is read at the step the clock
prices (``zero3_2021.COUNTER_STEP`` = 2); the live counter drifts down each step
(``zero3_2021`` docstring): once the check opens before the matrices (step 80 at 530B)
the module after the one running is prefetched too (as the planner's window counts,
beside the held embedding it leaves out), and the source's peak rises by fc1's 3.36 GB,
prefetched during fc2's backward.

Re-audit of 2026-11-29 (helper z3x14): what DeepSpeed v0.3.13 and the example's
Megatron-LM-v1.1.5-ZeRO3 run, candidate by candidate, read again at the tags (s3, pp as
above; ex = DeepSpeedExamples 44be774aad Megatron-LM-v1.1.5-ZeRO3; rows before / after:
175B 384 / 768 / 1,536 and 530B 640 / 1,120 / 2,240):

- **Megatron's unfused kernels: NOT priced before, priced now.**  The example script
  (ex examples/ds_pretrain_gpt2-zero3.sh, gpt_options) passes none of
  ``--scaled-upper-triang-masked-softmax-fusion``, ``--scaled-masked-softmax-fusion``,
  ``--bias-gelu-fusion``, ``--bias-dropout-fusion`` (ex megatron/arguments.py:249-260,
  ``store_true``), so the layer runs ``masked_fill_`` + ``torch.nn.Softmax`` (ex
  fused_softmax.py:118-128, gpt2_model.py:31-33), ``F.gelu(x + bias)`` (ex
  transformer.py:127-132) and the unscripted ``bias_dropout_add`` (:422-426) where the
  planner's layer (Korthikanti's Megatron-LM) prices the fused kernels: + 2 e S bytes in
  forward and in backward (S = b a s^2 scores), + 2 e T f and + 2 x 4 e T h in forward,
  the forward again in the recompute (``zero3_2021.unfused_bytes``, checked against
  PyTorch's own kernels under a dispatch mode: tests/test_z3x14.py).  14 ms a layer at
  175B / mb 4, 20 ms at 530B / mb 4: + 1.4 s / + 2.1 s a step.  Rows 1.197 / 1.207 / 0.874
  / 1.345 / 1.357 / 1.319 -> 1.173 / 1.192 / 0.871 / 1.330 / 1.346 / 1.315.
- **chunks of 2 at 530B's 105 layers cannot have run: the 530B rows now run chunks of
  1.**  ex transformer.py:949-969 runs ``custom(l, l + 2)``, whose ``_get_layer(105)`` is
  layer 0 again (``_get_layer_index`` modulo the layers, :938-947): layer 0 is in the
  first and the last chunk, two separate ``torch.autograd.backward`` calls
  (checkpointing.py:686), so its parameters reach their AccumulateGrad hook (s3:1404-1409)
  twice in one backward and ``reduce_independent_p_g_buckets_and_remove_grads`` asserts
  "Multiple gradient reduction is currently not supported" (s3:1446-1449; the flag set at
  :1713, cleared in the epilogue only, :1293-1294; v0.3.16 :1898-1901).  The planner
  refuses it (``zero3_2021.check_chunks``; the hook firing twice checked on PyTorch's
  reentrant checkpoint, tests/test_z3x14.py); the 530B rows take Megatron's default
  ``--checkpoint-num-layers`` 1 (ex arguments.py:237), the only divisor of 105 whose peak
  fits at 640 GPUs (79.3 GB of 80.1; 3, 5, 7: 88.7, 116.9, 147.8).  The 175B rows (96
  layers) keep the example's 2.  530B rows 1.330 / 1.346 / 1.315 -> 1.341 / 1.364 /
  1.352 (more optimistic: one gather fewer per chunk, the fc2 kept for its backward).
- gradient reduction: ``average_tensor`` (s3:1496-1514) pre-divides and calls
  ``reduce_gradients_at_owner`` -> ``_reduce_scatter_gradients`` (pp:702-771): one
  ``torch.distributed.reduce_scatter`` per parameter on a list of p chunk views, not
  stage 2's per-partition ``dist.reduce`` calls (its ``average_tensor``); ``reduce_scatter``
  is True by default (zero/constants.py:50-51, zero/config.py:85-87) and the example's
  JSON does not turn it off; the script's ``--zero-reduce-scatter``,
  ``--zero-reduce-bucket-size 5e7`` and ``--zero-allgather-bucket-size 5e9`` are parsed
  (ex arguments.py:504-515) and never read (only ``args.zero_stage``, ex
  pretrain_gpt2.py:44): the JSON's 6.71e7 reduce bucket holds.  Already priced as
  such.  (deepspeedai/DeepSpeed #1173, 2021-06, v0.3.16+: Nsight showed NCCL all-reduce
  kernels and no reduce-scatter kernel in ZeRO-3; the v0.3.13 source calls
  reduce_scatter, so that observation is not explained here and not priced.)
- all-gather granularity: one list all-gather per parameter (pp:596-636); stage 3 takes
  no ``allgather_bucket_size`` (engine.py:768-800 passes prefetch bucket, max reuse
  distance, max live parameters only); priced.
- prefetch / max live / reuse distance: the JSON's (1e9, 1e9, 6.04e7), the misspelt
  persistence key leaving 1e5; priced (``zero3_2021``).
- ``torch.cuda.synchronize`` / stream waits per fetch and release, the fp16 overflow
  check, the norm's ``.item()`` and all-reduces: priced (the tables above).
- ``param.ds_tensor`` copies: ``_allgather_param``'s copy of the rank's own partition
  into its chunk (pp:623-629), numel / p elements: 3 us for fc1 at 640 ranks, not priced
  (negligible); c10d's chunk copies are priced.
- host Python per module hook: still no measurement found (searched DeepSpeed #1069,
  #1170, #1174: #1174 reports a whole forward, 480 ms for a 5B BERT on one p4d node with
  v0.3.16, not a per-hook figure).  NOT priced.
- NCCL at 48-280 nodes: no A100 / HDR all-gather or reduce-scatter bus bandwidth measured
  at that scale found (searched again: NVIDIA/nccl #1218 is H100 over RoCE at 32 nodes,
  all_gather of 2 GB at 200 GB/s; #1211, #1413 (NVIDIA: reduce-scatter "shows a
  noticeable decline as the cluster size increases", no figure); nccl-tests #169 is
  all_reduce over PCIe RoCE at 2-6 nodes).  NOT changed.  Searched again (branch nccl15,
  2026-11-30; ``tests/test_nccl15.py``): still no A100 / HDR all-gather or reduce-scatter
  bus bandwidth against the node count.  Two component readings at scale were found:
  (1) the Ultra-Scale Playbook's 256 MB curve on 1-64 nodes of 8 GPUs (GPU, fabric and
  NCCL release not stated next to it): normalised to one node its all_gather /
  reduce_scatter fall 2.9x to 9x more at 8-64 nodes than NCCL's tuning model gives, so a
  fall of the size these rows would need is measured somewhere, but no figure transfers
  to Selene's A100 / HDR fat tree; (2) De Sensi et al., "Exploring GPU-to-GPU
  Communication" (SC24, arXiv 2408.14090; read through its published summaries, the
  paper's figures were not reachable here): on Leonardo (A100, InfiniBand HDR,
  Dragonfly+) production noise from other jobs costs "up to 50%" of NCCL allreduce
  goodput at 1,024 GPUs, partly recovered on a non-default IB service level (which
  NVIDIA's own Megatron-LM scripts select: ``export NCCL_IB_SL=1``, NVIDIA/Megatron-LM
  6df14fa6c4 examples/multimodal/llama_3p1_nemotron_nano_vl_8b_v1/text_generation.sh:3).
  Read against the rows (the script's last line, held-out figures read, not an input):
  at that worst case (the NCCL seconds x 2) the 175B rows at 384 / 768 would close 76 /
  99% of their gap, the 530B rows 38 / 56 / 66%, and the 175B / 1,536 row, already too
  slow, would move further off: not one figure either, and no measurement says Selene's
  fabric lost that much in 2021.  NOT changed (no bound: the noise is measured at one
  scale on another topology, and only as an upper figure).

What is left, after both (the script's last lines): 12.1 / 65.0 s at 175B / 384 and
530B / 640 (steps 69.5 / 190.6 s predicted, 81.6 / 255.5 published).  As NCCL bus
bandwidth: 63 / 43 GB/s where 146 / 158 are priced (62 / 52 / 49 at 768 / 1,120 / 2,240;
the 175B / 1,536 row already too slow, from its host loops over 1,536 chunks); as a fixed
cost per NCCL collective: 5.3 / 26.8 ms (not one figure: the gap grows with the bytes,
not with the calls); as compute: x 1.23 / 1.44; as host waits: 3.0 / 15.1 ms each.  The
NCCL reading is still the nearest to one figure (43-63 GB/s across five rows, about a
quarter to a third of eight HDR NICs), and still without a component source.  The
summary (``python -m benchmarks.published``): within 15% 32, beyond 30% 3 (the 530B
rows), range 0.750 .. 1.357 -> 0.750 .. 1.364, before and after.

The memory table below was read with chunks of 2 at 530B / 640; with the row's chunks of
1 the script prints 105 checkpointed inputs (35.23 GB) and one recomputed layer (16.11),
79.34 GB in all (78.84 at fc2's bias hook), the other terms unchanged.

Message sizes and hooks (i2117, 2026-11-30; :func:`message_sizes`, printed after the
needs; ``tests/test_i2117.py``).  The question: are ZeRO-3's per-submodule fetches and
releases (Python hooks, ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``,
``stage3_param_persistence_threshold``; one collective per parameter) latency-bound at
these message sizes, and is that priced?  Each is priced already (the 2026-11-28 table and
the z3x14 list above: the prefetch and live-parameter checks as v0.3.13's coordinator runs
them, one list collective per parameter, the persistence threshold's default 1e5 since the
example's key is misspelt).  By size, on the clock (NCCL 2.8.3's tuning model over the
row's DP group, the ``costs.group_price`` the simulation calls):

- the matrices (qkv, proj, fc1, fc2: 0.2-1.7e9 elements, 0.2-5.2 MB per rank's chunk) are
  bandwidth-bound: the price of a call of one element per rank is 3-25% of theirs at
  384-1,120 ranks, 10-33% at 1,536-2,240.  A coalesced bucket would not change them.
- the persistent parameters (the two LayerNorms' weights and biases and the four biases,
  8 of a layer's 12, each below 1e5 elements: 16-256 B per rank's chunk) are latency-bound
  (the floor is 99-100% of their price): 0.42 ms a reduce-scatter at 384 ranks, 0.69 at
  640, 2.42 at 2,240 (a ring's per-step latency times p - 1; reduce-scatter has no tree in
  NCCL).  They are reduce-scattered every micro-batch (their gradient hooks, as the
  matrices'), gathered only by ``_post_step``: 0.32 / 0.58 s a step (175B / 384, 530B /
  640), 0.64 / 1.02 (768 / 1,120), 1.27 / 2.03 (1,536 / 2,240), priced, against gaps of
  12.1 / 65.0 / 10.8 / 48.1 / -9.9 / 47.9 s.  At 384 and 640 ranks the per-call floor is
  the tuning model's, unchecked at that scale (the NCCL paragraph above); were it twice as
  long, the rows would gain 0.3-2.0 s of 10-65.
- the hooks' own Python: v0.3.13's fetch synchronizes the host with every stream
  (``_synchronize_communication``), so the Python of a hook runs with the device idle
  and is exposed whole.  Not priced (no per-hook figure, above).  At least two hooks a
  step run per traced module with parameters (pre and post, forward, recompute and
  backward): 3,476 a step at 175B, 3,800 at 530B (modules without parameters have hooks
  too: a lower count).  To add the published excess alone each would need 3.5 / 17.1 ms
  (384 / 640), 3.1 / 12.7 ms (768 / 1,120), 12.6 ms (2,240).  For scale, the one
  measured host time of a whole module's forward found (Megatron-core's
  ``TEColumnParallelLinear``, 140 us, TransformerEngine #1191, ``h100_breakdown``) is 25-120
  times below that; at 140 us a hook the 530B / 640 row would gain 0.53 s of 65.
Finding: what the brief's item (c) names is priced, from v0.3.13's source and NCCL's
tuning model; the latency-bound calls are 1-4% of the gaps; no component figure moves the
rows.  Not changed; the summary is as before.

Nothing here feeds the planner (it reads the same source lines itself).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import published as P  # noqa: E402
from workbench.plan import costs as C  # noqa: E402
from workbench.plan import zero3_2021 as Z  # noqa: E402
from workbench.plan.edge_cost import edge_times  # noqa: E402
from workbench.plan.estimate import EC  # noqa: E402

# (175B GPUs, 530B GPUs) at micro-batch 4, 2, 1 (published.py's narayanan_zero3 rows)
PAIRS = ((384, 640), (768, 1120), (1536, 2240))

# the simulation's work kinds (zero3_2021.simulate), in the step's order, with what runs
# them and the figure each is priced from
WORK = (
    ("fill", "gather buffer: torch.zeros of the whole parameter (pp:607-609)",
     "2 B/elem at HBM"),
    ("sync", "torch.cuda.synchronize after it, _synchronize_communication (pp:611, "
     "s3:483-493)", "SYNC_S 9.6 us, meas."),
    ("ag_loop", "DeepSpeed's all-gather loop: narrow, get_rank, append, per rank "
     "(pp:623-629)", "AG_LOOP_S 6.9 us, meas."),
    ("rs_loop", "DeepSpeed's reduce-scatter loop per rank (pp:741-768)",
     "RS_LOOP_S 7.5 us, meas."),
    ("record_copy", "c10d's recordStream + copy_ per chunk (host, ProcessGroupNCCL)",
     "RECORD_COPY_S 6.1 us, meas."),
    ("chunk_copy", "c10d's chunk copies on the GPU (out of / into its flat buffer)",
     "4 B/elem at HBM"),
    ("nccl_ag", "NCCL all-gather, one per parameter (list of p chunks)",
     "NCCL 2.8.3 tuning model"),
    ("nccl_rs", "NCCL reduce-scatter, one per gradient (s3:1689-1716)",
     "NCCL 2.8.3 tuning model"),
    ("predivide", "average_tensor's div_ of the ipg buffer + large grads (s3:1496-1505)",
     "4 B/elem at HBM"),
    ("release", "release: torch.ones(1).half().to(device), blocking (pp:531)",
     "RELEASE_S 21 us, meas."),
    ("norm", "v0.3.15+ debug-print norm + .item() per fetch (not in v0.3.13)",
     "0 at v0.3.13"),
    ("checkpoint_copies", "partition_activations at mp 1: clone; zeros, copy, 1-rank "
     "all-gather (ck:446-455, :284-309)", "4 + 14 B/elem, copy rate"),
)
# the step's host terms outside the hooks (zero3_2021.step_host_seconds)
HOST = (
    ("waits", "host waits: .item() / float() per gradient partition (overflow, norm), "
     "timers, loss f-string", "SYNC_S each"),
    ("h2d", "blocking one-element host-to-device copies (ByteTensor, FloatTensor, "
     "zeros(1).cuda(), batch sizes)", "RELEASE_S each"),
    ("loops", "per-tensor host loops: averaged_gradients narrow, unflatten narrow + view",
     "NARROW_S, meas."),
    ("all_reduces", "scalar all-reduces: overflow flag, norm (dp), reduce_losses (world)",
     "NCCL 2.8.3 tuning model"),
)


def audit(name: str, devices: int) -> dict:
    """Seconds per step of each phase of the ``narayanan_zero3`` row ``name`` on
    ``devices`` GPUs on the planner's clock; ``listed`` (their sum) equals the estimate's
    step."""
    row = next(r for r in P.ROWS if r["source"] == "narayanan_zero3"
               and r["name"] == name and r["devices"] == devices)
    cfg, lay, cl = P.build(row)
    res = P.predict(row)
    est, prof = res["estimate"], cl.profile
    if lay.engine != Z.FRAMEWORK:
        raise ValueError(f"zero3_audit: row {name!r} does not run {Z.FRAMEWORK!r}")
    tcfg = EC.token_cfg(cfg, lay)
    edge = edge_times(tcfg, lay.micro_batch, lay.tp, lay.sp, prof)
    d = Z.dp_sync_parts(cfg, lay, prof, est.details["layer"], est.details["head"], edge)
    first, rest, m = d["first"], d["rest"], lay.m
    stage = next(iter(est.details["stages"].values()))
    phases = {"compute: layers fwd, recompute, bwd; embedding, head, loss":
              m * first["compute"],
              "compute: the estimate's rest (gradient accumulation)":
              m * stage["compute"] - m * first["compute"]}
    work = {k: first["work"][k] + (m - 1) * rest["work"][k] for k, _, _ in WORK}
    for k, label, _ in WORK:
        phases[label] = work[k]
    micro = first["seconds"] + (m - 1) * rest["seconds"] - m * first["compute"]
    phases["hidden: work run beside other work (negative), compute slowed beside NCCL"] = \
        micro - sum(work.values())
    phases["_post_step: persistent parameters gathered, reassembled (s3:2339-2349)"] = \
        d["post"]
    for k, label, _ in HOST:
        phases[label] = d["host"][k]
    phases["optimizer passes: overflow check, norm, flatten, unscale, Adam, copy"] = \
        est.details["optimizer"]
    rest_step = est.step_time - sum(phases.values())
    phases["the estimate's other terms"] = rest_step
    return dict(name=f"{name} / {devices}", mb=lay.micro_batch, m=m, p=lay.dp,
                ratio=res["ratio"], predicted=est.step_time,
                published=est.step_time * res["ratio"], phases=phases,
                listed=sum(phases.values()), work=work,
                exposed=micro, compute=m * first["compute"],
                sent=first["sent"] + (m - 1) * rest["sent"],
                gathers=first["gathers"], prefetches=first["prefetches"],
                reduce_scatters=first["reduce_scatters"])


def needs(a: dict) -> dict:
    """What the row would need for the published step, one term at a time (held-out
    figures read, not an input of the planner): the NCCL seconds scaled by ``nccl``,
    the compute by ``compute``, or each host wait (``sync`` + ``release`` events) costing
    ``per_wait`` seconds more."""
    gap = a["published"] - a["predicted"]
    nccl = a["work"]["nccl_ag"] + a["work"]["nccl_rs"]
    waits = a["work"]["sync"] / Z.SYNC_S + a["work"]["release"] / Z.RELEASE_S
    calls = a["gathers"] + a["reduce_scatters"] if a["m"] == 1 else None   # one a step
    return {"gap": gap, "nccl": (nccl + gap) / nccl, "compute": (a["compute"] + gap)
            / a["compute"], "per_wait": gap / waits, "waits": waits,
            "per_call": gap / calls if calls else float("nan"),
            "busbw": a["sent"] / nccl / 1e9, "busbw_needed": a["sent"] / (nccl + gap) / 1e9}


def message_sizes(name: str, devices: int) -> dict:
    """The row's per-parameter collectives by message size (module docstring, "Message
    sizes and hooks"): each distinct parameter of a layer (``zero3_2021._layer_modules``)
    with its elements, the bytes of one rank's chunk (fp16, ``2 n / p``), the seconds one
    call costs on the clock (``costs.group_price`` over the row's DP group, as
    ``zero3_2021.dp_sync_parts`` prices it) and its latency share: the price of a call of
    one element per rank over this price (NCCL's per-call floor on the tuning model).  The
    persistent parameters (fewer than ``PERSISTENCE_NUMEL`` elements: biases, norms) are
    reduce-scattered every micro-batch (one call each, s3:1404-1409) and never gathered
    inside it; ``small_seconds``: their calls a step (layers x micro-batches).  ``hooks``:
    the module hooks a step that can run DeepSpeed's fetch or release (pre- and post-,
    forward and backward: two per entry of the recorded trace, ``gpt_trace``: modules
    with parameters only, so a lower count) and ``per_hook`` the host seconds each would
    need to add the published step's excess (held out, read, not an input)."""
    row = next(r for r in P.ROWS if r["source"] == "narayanan_zero3"
               and r["name"] == name and r["devices"] == devices)
    cfg, lay, cl = P.build(row)
    res = P.predict(row)
    est, prof = res["estimate"], cl.profile
    ranks = tuple(lay.grad_ranks(0, 0))
    p = len(ranks)
    floor = {k: C.group_price(k, 2 * p, ranks, prof) for k in ("all_gather", "reduce_scatter")}
    calls = []
    for mod, params in Z._layer_modules(cfg):
        for pid, n in params:
            small = n < Z.PERSISTENCE_NUMEL
            rs = C.group_price("reduce_scatter", 2 * n, ranks, prof)
            ag = None if small else C.group_price("all_gather", 2 * n, ranks, prof)
            calls.append(dict(param=pid, numel=n, chunk_bytes=2 * n / p, persistent=small,
                              reduce_scatter=rs, rs_latency_share=floor["reduce_scatter"] / rs,
                              all_gather=ag,
                              ag_latency_share=None if ag is None
                              else floor["all_gather"] / ag))
    m = lay.m
    small_s = m * cfg.n_layer * sum(c["reduce_scatter"] for c in calls if c["persistent"])
    tcfg = EC.token_cfg(cfg, lay)
    edge = edge_times(tcfg, lay.micro_batch, lay.tp, lay.sp, prof)
    trace = Z.gpt_trace(cfg, est.details["layer"], est.details["head"], edge, lay.recompute,
                        Z.partition_activation_seconds(cfg, lay.micro_batch, prof),
                        lay.recompute_num_layers)
    hooks = 2 * len(trace) * m
    gap = est.step_time * (res["ratio"] - 1.0)
    return dict(name=f"{name} / {devices}", p=p, calls=calls, floor=floor,
                small_seconds=small_s, gap=gap, hooks=hooks,
                per_hook=gap / hooks if gap > 0 else None)


# De Sensi et al. (SC24, arXiv 2408.14090): production noise costs "up to 50%" of NCCL
# allreduce goodput at 1,024 A100s on Leonardo (InfiniBand HDR, Dragonfly+): the NCCL
# seconds at most x 2 (a reading, never applied to the planner)
NOISE_FACTOR = 2.0


def noise_share(a: dict, factor: float = NOISE_FACTOR) -> float:
    """The share of the row's gap (published - predicted; held out, read, not an input)
    that its NCCL all-gather and reduce-scatter seconds scaled by ``factor`` would add,
    were none of the added time hidden; nan where the estimate is already slower."""
    gap = a["published"] - a["predicted"]
    if gap <= 0:
        return float("nan")
    return (factor - 1.0) * (a["work"]["nccl_ag"] + a["work"]["nccl_rs"]) / gap


def main():
    out = [audit(n, k) for pair in PAIRS for n, k in zip(("GPT 175B", "GPT 530B"), pair)]
    print("A DeepSpeed v0.3.13 ZeRO-3 step, phase by phase, as the planner prices it: "
          "seconds per step (benchmarks/zero3_audit.py; pp = partition_parameters.py, "
          "s3 = stage3.py at v0.3.13 12a53b4383)")
    w = 78
    print(f"  {'':<{w}}" + "".join(f"{x['name']:>17}" for x in out))
    print(f"  {'micro-batch size, micro-batches':<{w}}"
          + "".join(f"{str(x['mb']) + ' x ' + str(x['m']):>17}" for x in out))
    for k in out[0]["phases"]:
        print(f"  {k[:w]:<{w}}" + "".join(f"{x['phases'][k]:>17.2f}" for x in out))
    for label, key in (("sum of the above", "listed"), ("estimate's step", "predicted"),
                       ("published step", "published")):
        print(f"  {label:<{w}}" + "".join(f"{x[key]:>17.2f}" for x in out))
    print(f"  {'ratio predicted / published':<{w}}" + "".join(f"{x['ratio']:>17.3f}"
                                                             for x in out))
    label = "all-gathers (prefetched) / reduce-scatters a micro-batch"
    print(f"  {label:<{w}}" + "".join(
        f" {x['gathers']:>5}({x['prefetches']:>3}) /{x['reduce_scatters']:>5}" for x in out))
    print("  figures: " + "; ".join(f"{lab.split(':')[0].split(' (')[0]}: {fig}"
                                   for _, lab, fig in WORK + HOST))
    print("  what the published step needs, one term at a time (held out, not an input):")
    for label, key, fmt in (("published - predicted, s", "gap", "{:>17.1f}"),
                            ("NCCL seconds x", "nccl", "{:>17.2f}"),
                            ("  its bus bandwidth priced, GB/s", "busbw", "{:>17.1f}"),
                            ("  the bus bandwidth that would need, GB/s", "busbw_needed",
                             "{:>17.1f}"),
                            ("compute x", "compute", "{:>17.2f}"),
                            ("host waits (sync + release) in the step", "waits", "{:>17.0f}"),
                            ("each host wait longer by, ms", "per_wait", "{:>17.2f}"),
                            ("each NCCL collective (gathers + reduce-scatters) longer by, "
                             "ms", "per_call", "{:>17.2f}")):
        vals = [needs(x)[key] * (1e3 if key in ("per_wait", "per_call") else 1)
                for x in out]
        print(f"    {label:<{w - 2}}" + "".join(fmt.format(v) for v in vals))
    ms = [message_sizes(n, k) for pair in PAIRS for n, k in zip(("GPT 175B", "GPT 530B"),
                                                                pair)]
    print("  a layer's per-parameter collectives on the clock (message_sizes): one rank's "
          "fp16 chunk, ms a call, the one-element call's share (latency)")
    for i, x in enumerate(ms):
        print(f"    {x['name']} (p {x['p']}): " + "; ".join(
            f"{c['param']} {c['chunk_bytes']:.0f} B RS {1e3 * c['reduce_scatter']:.2f} ms "
            f"({c['rs_latency_share']:.2f})"
            + ("" if c["all_gather"] is None else
               f" AG {1e3 * c['all_gather']:.2f} ({c['ag_latency_share']:.2f})")
            for c in x["calls"]))
    for label, key, scale, fmt in (
            ("persistent parameters' reduce-scatters a step (latency-bound), s",
             "small_seconds", 1, "{:>17.2f}"),
            ("module hooks a step (2 per traced module with parameters)", "hooks", 1,
             "{:>17.0f}"),
            ("each hook's host Python longer by, ms", "per_hook", 1e3, "{:>17.2f}")):
        print(f"    {label[:w - 2]:<{w - 2}}" + "".join(
            fmt.format(x[key] * scale) if x[key] is not None else f"{'-':>17}" for x in ms))
    label = (f"share of the gap at NCCL x {NOISE_FACTOR:g} (De Sensi et al. SC24: production "
             f"noise, A100 / HDR, 1,024 GPUs)")
    print(f"    {label[:w - 2]:<{w - 2}}" + "".join(f"{noise_share(x):>17.2f}" for x in out))
    return out


# -- memory ------------------------------------------------------------------------
# The peak of a v0.3.13 step, read from the source (module docstring, "Memory"): the
# weight gradient of the last layer's fc2 in a checkpointed chunk, the chunk's first
# backward op, when its k layers' recomputed activations are all live.
def memory_audit(name: str = "GPT 530B", devices: int = 640) -> dict:
    """Bytes per rank of each memory term of the ``narayanan_zero3`` row, as the planner
    counts them (``memory.stage_memory``) and as DeepSpeed v0.3.13 holds them at its
    backward peak (the module docstring's "Memory" table): ``terms`` maps a term to
    (planner bytes, source bytes, source lines); ``planner`` / ``source`` their sums;
    ``alt``: the source's bytes at the next hook (fc2's bias), where c10d's flat
    buffer of fc2's gradient is live; ``usable``: the profile's usable memory."""
    from workbench.plan import memory as M
    from workbench.plan.recompute_chunks import largest_chunk, saved_inputs
    from workbench.plan.zero_cost import PREFETCH_NUMEL
    row = next(r for r in P.ROWS if r["source"] == "narayanan_zero3"
               and r["name"] == name and r["devices"] == devices)
    cfg, lay, cl = P.build(row)
    if lay.engine != Z.FRAMEWORK or lay.pp != 1 or lay.tp != 1:
        raise ValueError(f"memory_audit: row {name!r} / {devices} is not {Z.FRAMEWORK!r} "
                         f"at tp = pp = 1")
    prof = cl.profile
    mem = M.stage_memory(cfg, lay, 0, "materialized", prof)
    s, b, h, V, f = cfg.seq_len, lay.micro_batch, cfg.d_model, cfg.vocab_size, cfg.d_ff
    k, L, p = lay.recompute_num_layers, cfg.n_layer, lay.dp
    mods = M.zero3_modules(cfg, 1, 1, 0, p, L)
    bucket, grad = M._zero3_unreduced_grad_numel(cfg, lay, mods)
    gathered = M.zero3_gathered_numel(mods, PREFETCH_NUMEL)
    big = [n for _, ps in Z._layer_modules(cfg) for _, n in ps if n > Z.REDUCE_BUCKET_NUMEL]
    largest, last_reduced = max(big), big[0]     # fc2 (f h); qkv (3 h^2), last in backward
    none = M.layer_activation_bytes(cfg, b, 1, False, "none")
    inp = 2 * s * b * h
    live = largest_chunk(L, 1, k)
    remat_planner = max(0.0, live * none - inp - 2 * grad)
    head = 4 * s * b * h + 4 * s * b * V
    emb = s * b * h if cfg.dropout > 0 else 0.0
    ids = 8 * s * b + 8 * s                  # mp 1: no out-of-range mask
    saved = saved_inputs(L, 1, k) * inp
    terms = {
        "params, grads, optimizer: 2 + 2 + 12 B per partitioned parameter":
            (mem["params"] + mem["grads"] + mem["optimizer"],
             mem["params"] + mem["grads"] + mem["optimizer"],
             "s3:873-900 fp16 flat, ds_tensor views; s3:1606-1635 grads_in_partition; "
             "fp32 flat + Adam m, v"),
        "NCCL's communicator buffers": (mem["comm_buffers"], mem["comm_buffers"],
                                        "plan.comm_memory (not re-audited)"),
        "reduce bucket (ipg_buffer): 2 buffers with overlap_comm":
            (2 * bucket, 2 * 2 * Z.REDUCE_BUCKET_NUMEL,
             "s3:2535-2546; overlap_comm True for ZeRO-3 (zero/config.py:89-94, "
             "constants.py:55)"),
        "gathered parameters: tied embedding held + the module running (+ prefetched)":
            (2 * gathered, 2 * (V * h + largest),
             "root's external wte (Megatron-LM-v1.1.5-ZeRO3 gpt2_model.py), no prefetch: "
             "counter > 1e9 (s3:293-297, :312-334); fc2 kept for its backward (reuse "
             "distance 0)"),
        "the module's weight gradient, whole until its reduce (extra-large)":
            (2 * grad, 2 * largest, "s3:1452-1453 kept out of the bucket"),
        "the previous extra-large gradient, freed at the next reduce_ipg_grads":
            (0.0, 2 * last_reduced,
             "s3:1433-1436 -> :1693-1694 partition_previous_reduced_grads -> "
             "pp:848 param.grad.data = partition"),
        "the head's gradient of the tied embedding, held by autograd until the "
        "embedding's backward adds its own":
            (0.0, 2 * V * h if cfg.tie_embeddings else 0.0,
             "one leaf, two uses (gpt2_model.py parallel_lm_logits): autograd sums them "
             "in the leaf's input buffer before its AccumulateGrad"),
        "c10d's flat buffer of a list reduce-scatter / all-gather (whole parameter)":
            (0.0, 0.0, "ProcessGroupNCCL 1.8 flatten; not live at this instant: "
             "see 'alt'"),
        "checkpointed chunk inputs (partition at mp 1 = whole), one per chunk":
            (saved, saved, "ck:441-455, :538; initialize.py:105-106"),
        "embedding dropout mask": (emb, emb, "Megatron embedding dropout"),
        "the lookups' saved indices: int64 token ids, position ids (one expanded row)":
            (ids, ids, "F.embedding keeps its indices; get_ltor_masks_and_position_ids "
             "expands one arange of s (Megatron-LM-v1.1.5-ZeRO3 megatron/utils.py)"),
        "head: final-LN and head inputs, fp32 logits (freed by the head's backward)":
            (head, 0.0, "autograd frees them before the layers' backward"),
        "the chunk's recomputed layers (k x none, less its input)":
            (remat_planner, live * none - inp,
             "ck:629-686; the planner subtracts the unreduced gradient, which fc2's "
             "wgrad allocates while all of them are live"),
    }
    # the planner counts v0.3.13's terms since (zero3_2021.backward_peak_bytes): its side
    # of each term, at fc2's weight gradient (stage_memory's total: the larger of this
    # instant and fc2's bias hook, 'alt')
    z = Z.backward_peak_bytes(cfg, lay, live * none - inp, head, 0.0)["terms"]
    mine = {"reduce bucket": z["reduce buckets"], "gathered parameters": z["gathered"],
            "the module's weight gradient": z["largest gradient"],
            "the previous extra-large gradient": z["previous gradient"],
            "the head's gradient of the tied embedding": z["tied head gradient"],
            "head:": 0.0, "the chunk's recomputed layers": live * none - inp}
    terms = {k: ((next((w for p_, w in mine.items() if k.startswith(p_)), v[0])), v[1], v[2])
             for k, v in terms.items()}
    planner = sum(v[0] for v in terms.values())
    source = sum(v[1] for v in terms.values())
    # fc2's bias hook: reduce_ipg_grads frees the previous gradient (pp:848) and c10d
    # flattens fc2's gradient (a whole copy); fc2's saved input (2 s b f) is released
    alt = source - 2 * last_reduced + 2 * largest - 2 * s * b * f
    return dict(name=f"{name} / {devices}", terms=terms, planner=planner, source=source,
                alt=alt, total=mem["total"], usable=prof.usable_memory(),
                temporaries=2 * s * b * f)


def print_memory(a: dict) -> None:
    print(f"\nMemory of {a['name']} per rank at v0.3.13's backward peak (fc2's weight "
          f"gradient in a chunk's backward), GB: the planner's / the source's")
    w = 80
    for term, (mine, src, where) in a["terms"].items():
        print(f"  {term[:w]:<{w}} {mine / 1e9:>7.2f} {src / 1e9:>7.2f}  {where}")
    label = f"sum (the planner: stage_memory total {a['total'] / 1e9:.2f})"
    print(f"  {label:<{w}} {a['planner'] / 1e9:>7.2f} {a['source'] / 1e9:>7.2f}")
    print(f"  at fc2's bias hook (c10d's flat buffer live, the previous gradient and "
          f"fc2's input freed): {a['alt'] / 1e9:.2f}; gradient temporaries neither "
          f"counts (fc2's input gradient): {a['temporaries'] / 1e9:.2f}; usable "
          f"{a['usable'] / 1e9:.2f} (a100.json: the 79.25 GiB CUDA reports, less 5% and "
          f"0.78 GB)")


if __name__ == "__main__":
    main()
    print_memory(memory_audit())
