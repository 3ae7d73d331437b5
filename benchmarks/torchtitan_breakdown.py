"""What the planner's step for torchtitan's FSDP2 rows is made of, term by term.

    PYTHONPATH=$PWD python benchmarks/torchtitan_breakdown.py            # ~5 s
    PYTHONPATH=$PWD python benchmarks/torchtitan_breakdown.py --needed   # + ~10 s

For each row of ``benchmarks/published_torchtitan.py`` (``ROWS``: Llama 3.1 8B on 8 and
128 H100s, Llama 2 / 3 on 64 A100s, FSDP2 alone, eager) it prints, in seconds per step,
the terms of ``wb.plan.estimate``'s step, each from the planner's own functions (as
``benchmarks/h100_breakdown.py`` does for Megatron-LM's rows): the compute stream (the
blocks' forward and backward with the op-level or full recompute and torchtitan's eager
kernels, ``plan.titan_eager``; the output layer, final norm and loss; the embedding;
FSDP2's copy-out and reduce-scatter copy-in, ``plan.fsdp2_cost``), FSDP2's collectives
left exposed (forward and backward apart: ``zero_cost.zero_exposed`` over the stage's
units with the root as one unit, ``plan.fsdp2_root``), the optimizer step; no pipeline,
so no bubble.  Then the collectives of one unit (a transformer block; the root: the
embedding, final norm and output layer) beside the compute that may hide them: the bf16
all-gather and the fp32 reduce-scatter (torchtitan's ``MixedPrecisionPolicy(param_dtype=
bf16, reduce_dtype=fp32)``, ``parallelize_llama.py:220-222`` at eb6aa6389; at 9dec370ad2
``config_manager.py:389-392``, ``--training.mixed_precision_reduce`` default "float32",
its only choice) with the
side-stream copies FSDP2 runs in series with them, a block's forward and backward.

Bandwidth, needed against priced (the last table): ``priced`` is the bus bandwidth
(nccl-tests' busbw, ``sim_mesh.cost.bus_bandwidth``) at which the clock runs a block's
reduce-scatter over the row's FSDP group (NCCL's ring across the nodes' NICs, or NVLink
inside one node); ``onset`` the bus bandwidth below which a block's all-gather of the
next block plus its own reduce-scatter no longer fit in its backward (bytes on the wire
over the backward's seconds; the forward's gather alone is the smaller need); ``--needed``
adds ``gap``, the bus bandwidth at which the whole estimate would take the published step
(the profile's link scaled, the estimate re-run, bisected): what the network would have
had to be for it alone to explain the row.  Then, per row, the seconds the prediction lacks
to reach the held-out goal's 15% edge, what each term alone would have to add, and for
the rows beyond it the GEMM rate that would reach the edge and the published step
(``to_edge``, ``gemm_scale``); and the 13B's recompute, published against priced, for
op-level SAC and for the "selective layer" row (``recompute_reading``; the titan14
section below).  Nothing here feeds the planner: a reading of
where the gap could and could not be, not a fit (no parameter is set from ``gap``).

``room``: the published step less the predicted compute and optimizer, i.e. what the
measured run left for everything exposed beside them.  ``serial``: the step were no
FSDP2 collective hidden (all of them end to end, their side copies included, in series
with the compute): the most any overlap model at the priced bandwidth can add.

What it said on 2026-11-28 (the network sources and the reading are in
``published_torchtitan``'s docstring): the rows' FSDP2 collectives hide with 3-17x to
spare (the onset bus bandwidth 24-59 GB/s against the 175-364 priced), the needed bandwidth
for a network explanation (24-49 GB/s on the A100 rows) has no source (RSC's DGX A100s:
one 200 Gb/s HDR port per GPU on a non-blocking fabric, 192 GB/s all-reduce bus
bandwidth measured by NVIDIA; the H100 hosts: 400 Gb/s per GPU), and with no overlap at
all the 8B rows would still be optimistic and the 70B rows pessimistic.  The FSDP2
kernels around the collectives (copy-in, copy-out, chunk-cat, AVG instead of divides)
are those of the rows' releases (``plan.fsdp2_cost``) and priced.

The pairs' relative errors (``PAIRS``, the table before the bandwidths; 2026-11-28).  Three
pairs of rows share GPUs, network and code and differ in one knob, so what the planner
gets wrong in their ratio is a component that scales with that knob, not the network:

1. Llama 2 70B on 64 A100s, op-level SAC at local batch 1 (355 TPS/GPU) over full AC at
   local batch 2 (353): measured 1.006, predicted 1.068 before this reading (401.8 over
   376.4).  Per 1,000 tokens (as priced now) the op row's blocks are 171 ms cheaper (k, o
   and w3 re-run against the forward but w2) and its per-step costs weigh double at half
   the tokens
   (FSDP2's copies +87 ms, exposed collectives +57, optimizer +7).  The term that was
   wrong: full AC re-ran w2's GEMM.  torchtitan wraps each block with
   ``ptd_checkpoint_wrapper(..., checkpoint_impl=CheckpointImpl.NO_REENTRANT,
   checkpoint_fn=checkpoint, use_reentrant=False)`` (pytorch/torchtitan eb6aa6389
   ``torchtitan/parallelisms/parallelize_llama.py``:73-80, the A100 rows' commit; the same
   at 9dec370ad2), PyTorch's non-reentrant checkpoint, whose recompute stops once every
   tensor the forward saved is back (``torch.utils.checkpoint``: the module default
   ``_enable_checkpoint_early_stop = True`` of the releases since 2023, ``early_stop=True``
   in 2.13); autograd saves mm's inputs before its kernel runs, so the last saved tensors are
   w2's inputs and w2 never re-runs (``llama_layer.full_recompute``).  The planner applied
   that early stop to the course's recipe only (``framework="workbench"``) and re-ran the
   whole forward for ``"fsdp"`` as for Megatron-LM's ``CheckpointFunction``.  Counted on
   torchtitan's eager block (``tests/test_i21rel.py``): its backward runs 14 GEMMs, 20 under
   the full-AC wrapper (6 re-run; 7 with early stop off), 17 under op-level SAC (k, o, w3).
   Priced so (``estimate.layer_for``: early stop for "fsdp" too): 1.008 (401.8 / 398.6).
   The full rows move 1.066 -> 1.129 (Llama 2 70B) and 1.076 -> 1.136 (Llama 3 70B): the
   A100 rows now read 1.129 .. 1.191, the recompute kinds alike.
2. Llama 2 13B on 64 A100s at local batch 2, op-level SAC (1,904) over none (2,162):
   measured 0.881, predicted 0.892.  Only the recompute differs: measured 0.514 s a step
   (62.7 ms per 1,000 tokens), priced 0.391 (47.7: k, o, w3 at 255-258 TFLOP/s, 7.9 ms a
   block, the norms, RoPE, silu and product 1.2 ms, the eager kernels 0.75).  Not found:
   the save list and the every-second-mm count are as priced (``tests/test_op_sac.py``,
   here 17 GEMMs), the attention kernel is saved, the early stop cuts only the closing
   add.  A uniform GEMM shortfall does not fit it alone (the re-run GEMMs would have to
   run at 59% of peak while the none row's whole step reads 61.1% MFU).  Unpriced and
   candidates: HBM contention of the recompute with the backward's reduce-scatter and
   all-gather (the recompute opens each block's backward, when the previous block's
   reduce-scatter runs; ``overlap_rate`` prices SMs only), the SAC dispatch mode's host
   time per op.  No change.  (2026-11-29, titan13: the Triton norm priced at its measured
   rate, 0.430 -> 0.432 s; the dispatch mode's host time runs ahead of the GPU, no CPU
   sync inside a step: not this gap, below.)
3. Llama 3.1 8B on 128 over 8 H100s, both local batch 2: measured 0.973, predicted 1.016.
   The per-GPU work is the same; the planner's only terms that differ are the optimizer
   step (foreach AdamW and clipping over the rank's shard, 1/8 against 1/128 of the
   parameters: 51 against 3 ms a step) and the exposed collectives (+7 ms at 16 nodes), so
   128 GPUs come out faster.  Nothing priced grows with the group that much: the root
   unit's gather and reduce (+2 ms), the block's collectives stay hidden (onset 24 GB/s
   against 306 priced).  What grows with the group is the slowest device pacing a
   synchronous step (``plan.variability``): with the A100 spread it holds (PAL, SC'24)
   the expected slowest of 8 is x1.034, of 128 x1.071, which on these steps
   (``variability.stretch``) gives 128 GPUs a TPS/GPU 1.9% lower (measured 2.7%); the
   module applies it to the A100 profiles' range only and has no H100 distribution, so
   it is a reading, not priced.  No change.

What torchtitan runs, re-read on 2026-11-29 against what is priced (titan12).  One term was
priced too cheaply and is now from measurements: the eager kernels' rate.  ``titan_eager``
counted torchtitan's eager RMSNorm / RoPE / repeat_kv kernels exactly but priced every one
at the plain memory rate (0.88 of the A100's bandwidth); Liger-Kernel's published
benchmarks of the same eager code (Hugging Face's RMSNorm and rotary embedding, provider
"huggingface", A100-SXM4-80GB, A100 80GB PCIe, H100 NVL), counted the same way, ran
1.17-2.11x longer than that price.  Priced at those rates (``plan.eager_rates``): the
rows 1.100 .. 1.191 (median 1.145) -> 1.079 .. 1.160 (median 1.122), the 13B pair's
recompute 0.391 -> 0.430 s (measured 0.514; pair 0.892 -> 0.884, measured 0.881).
Checked and already priced, or too small to price (torchtitan at 9dec370ad2 /
eb6aa6389): the logits' fp32 cast (``output(h).float()`` in eb6aa6389's model, ``pred.
float()`` in 9dec370ad2's ``loss_fn``) is inside the measured loss pair (cast +
cross-entropy, ``ops_table/loss_pricing``); the April 2024 op SAC
(``_pt2_selective_checkpoint_context_fn_gen``) has 9dec370ad2's save list and
every-second-mm rule (priced); ``clip_grad_norm_`` (foreach norm and multiply priced,
``plan.optimizer_step``) reduces one scalar across the group (DTensor's norm partial made
replicate by ``total_norm + 1e-6``: microseconds, not priced); ``input_ids.to(device)``
of a pageable tensor synchronizes the host every step (``train.py`` 9dec370ad2:264-265,
eb6aa6389:279-280), after which the GPU waits only for the first launches of the root's
all-gather (about a millisecond, under 0.05% of a step: not priced); the data loading
(``next(data_iterator)``) runs before that sync, while the GPU finishes the previous
step; the loss ``.item()``s and ``dist_mean`` / ``dist_max`` run every ``log_freq`` = 10
steps, ``gc.collect(1)`` every 50 (not in steps 81-90, which the H100 figure reads), the
profiler (``profile_freq`` 100, warm-up 3, active 1) waits in those steps; FSDP2's final
callback makes the compute stream wait for the last reduce-scatter before the optimizer
(priced: ``plan.fsdp2_root``).  Still unpriced: the clusters' power caps (500 W H100s;
350 or 400 W A100s), the HBM2e H100's eager rates were they the NVL's share of its
bandwidth rather than its bytes per second (``plan.eager_rates``).

Re-read on 2026-11-29 (titan13): the Triton RMSNorm, the host, what else runs.

- The norm of the A100 rows.  ``fused_rmsnorm`` in the configs of the 13B and Llama 3 8B
  rows (pytorch/torchtitan@eb6aa6389 ``train_configs/llama_13b.toml``:21,
  @1ea476e9f ``train_configs/llama3_8b.toml``:21), ``rmsnorm`` in the 70Bs' (2D configs,
  ``tensor_parallel_degree = 8``, which both commits refuse with the Triton norm,
  ``parallelize_llama.py``:142-146, until pytorch/torchtitan#364, opened 2024-05-25: the
  1D 70B rows' norm stays ASSUMED; run with ``fused_rmsnorm`` they would read 1.167 ..
  1.172, not 1.105 .. 1.113).  The kernel
  (``torchtitan/models/norms.py``, the same file at both commits; added by #181, whose
  only figure is end to end, "+15% MFU with FSDP2 7B", not used) was priced as one fused
  pass each way at the plain memory rate.  Now at the rates Liger-Kernel's RMSNorm of the
  same design (a program per row forward; a program per SM looping over the rows
  backward, fp32 weight-gradient rows summed after) reached in Liger's published A100
  benchmarks (``plan.eager_rates``: ``TRITON_MEASURED``, 0.69 / 0.56 of the SXM's 2,039
  GB/s forward / backward where the plain rate is 0.88), its bytes counted from its
  source (``plan.titan_eager.triton_norm_kernels``; ``tests/test_titan13.py``): +0.28 ms
  a 13B block with op-level SAC (11 ms a step), +0.22 ms an 8B block (7 ms).  Rows
  (``python -m benchmarks.published``): Llama 3 8B 1.133 -> 1.130, Llama 2 13B 1.155 ->
  1.152 and 1.160 -> 1.157; the 13B pair's recompute 0.430 -> 0.432 s (measured 0.514);
  the summary unchanged (median 1.078, 32 within 15%, 3 beyond 30%).
- The host.  FSDP2 runs "without any CPU synchronization" (pytorch/torchtitan@eb6aa6389
  ``docs/fsdp.md``:10, :72: no ``limit_all_gathers``), so within a step the host waits for
  the GPU nowhere but at the pageable ``input_ids.cuda()`` / ``labels.cuda()`` of its
  start (``train.py``:279-280); after it the GPU waits only while the host's time since
  that sync exceeds the GPU work it has issued.  Published host figures are far below the
  rows' GPU spans: FSDP2's ``pre_forward`` about 1 ms a unit (pytorch/pytorch#173680,
  torch 2.10, "1 ms launches can be ok for some transformer architectures"; in the
  April 2024 code not measured) against a block's forward of 19.9-69.9 ms and backward of
  49-198 ms here (the table above); so FSDP2's hooks, the SAC dispatch mode's Python per
  aten op (no published per-op figure found) and the eager ops' launches stay behind the
  GPU after the first unit's launches (about a millisecond a step, as before).  The
  optimizer step's host time on DTensor (foreach AdamW and ``clip_grad_norm_`` over the
  rank's 291 / 363 / 723 sharded tensors for 8B / 13B / 70B) was measured at up to 187 ms
  on the CPU for a model of many small weights under torch 2.4.0 with a debugger hook on
  (pytorch/pytorch#134191, "uncompiled AdamW + FSDP2 + pydevd: 187 ms on CPU"; FSDP1 6
  ms): it runs while the GPU still drains the backward's queued kernels, by how much the
  host leads then (the depth of CUDA's launch queue) has no source here, and no figure
  for these models' tensors exists: not priced (at most its excess over that lead and
  the optimizer's own GPU time, 6-57 ms, is exposed).
- What else runs on the GPU, re-read at eb6aa6389 (``train.py``, ``models/llama/
  model.py``): ``freqs_cis`` is a persistent buffer sliced per step (a view), the SDPA
  output's ``transpose(1, 2).contiguous()`` copies nothing (flash returns (b, s, h, d)),
  ``repeat_kv`` is a no-op for the Llama 2 MHA models (n_rep = 1), AdamW ``foreach=True``
  (``build_optimizer``, :86-102) runs the 20 fp32 accesses priced, ``clip_grad_norm_
  (..., foreach=True)`` its norm and multiply (priced), ``enable_tensorboard`` and the
  profiler (``enable_profiling = true``, ``profile_freq = 100`` in the 13B config) write
  from the host at log and profile steps only.  Nothing unpriced found that moves a row
  by more than 0.1%.

Re-read on 2026-11-29 (titan14): what the 13B rows lack, and where it could be.

- To the 15% edge (the table "to the 15% edge", ``to_edge``): the none row lacks 6.7 ms
  a step (0.2% of its predicted 3.288 s), the op row 21.8 ms (0.6% of 3.720).  Alone, the
  blocks would have to grow by 0.2% / 0.6%, torchtitan's eager kernels by 4.5% / 9.9%,
  the output layer and loss by 17% / 56%, FSDP2's copies by 5% / 16%, the exposed
  collectives by 6.5% / 21%, the optimizer step by 64% / 209%.
- Checked once more against the A100 rows' code (pytorch/torchtitan@eb6aa6389) and found
  priced as it runs: every block but the last resharded after forward
  (``parallelize_llama.py``:232-236; the root by FSDP2 itself, :239), bf16 gathers and an
  fp32 reduce-scatter (:220-221: the 13B block's reduce-scatter 6.95 ms against its
  all-gather's 3.69, the table above), the op SAC's save list and every-second-mm policy
  (:36-60, ``preserve_rng_state=False`` :71), AdamW ``foreach=True`` (``train.py``:97),
  ``clip_grad_norm_(..., foreach=True)`` (:291-292).  The host: the data loader is a
  ``DataLoader(hf_ds, batch_size=batch_size)`` without workers
  (``torchtitan/datasets/hf_datasets.py``:172), so each step's documents are tokenized by
  the training process (:138) before the step's pageable ``input_ids.cuda()``
  (``train.py``:274-279), while the GPU still runs the previous step; the GPU waits for
  it only on the step after each log step, whose ``loss.item()`` (:306, every
  ``log_freq`` = 10 steps) drains the GPU before ``time_last_log = timer()`` (:369)
  starts the next window.  No figure of the tokenizer's time per step was found (the run
  logged ``time_metrics/data_loading``; the doc does not report it): not priced, at most
  a tenth of one step's data loading a step.
- The recompute gap is not op-SAC's own.  The 13B has a third published row (``AC_13B``),
  "selective layer" (1,914 WPS: every second block under full AC, ``parallelize_llama.py``
  :82-107; ASSUMED '2', ``AC_13B_EVERY``), not a planner row.  It adds 0.491 s a step over
  no checkpointing where the planner's 20 early-stopped full recomputes of a block price
  0.408 (x1.203), as the op row adds 0.513 against 0.431 (x1.190): two kinds of recompute
  that re-run different ops (op: the k, o and w3 GEMMs, the norms, RoPE, SwiGLU's
  kernels; layer: the whole forward up to w2, the attention kernel included) run the same
  1.2x their price, and about three quarters of either is GEMM time.  So neither the SAC
  dispatch mode's host time nor its save list explains the op row (both would leave the
  layer row alone); the forward work a recompute re-runs is priced short, as the none
  row's whole step is (1.152).
- The GEMM rate (the ``GEMM x`` probe, ``gemm_scale``: the profile's ``efficiency
  ["matmul"]`` 0.827 times x on every GEMM, the estimate re-run): the 13B rows take their
  published steps at x = 0.832 / 0.828 (GEMMs at 0.69 of the A100's 312 TFLOP/s, 214) and
  reach the 15% edge at x = 0.997 / 0.992; the other A100 rows take theirs at 0.840 (Llama
  3 8B) and 0.868 .. 0.882 (the 70Bs, whose eager norm is ASSUMED; with the Triton norm,
  reading 1.167 .. 1.172, they would need a lower x).  So one factor fits the six A100 rows within 3% and the two 13B
  recompute readings with them: the A100 rows read like GEMMs at 0.69-0.73 of peak where
  the profile takes 0.827 (a 400 W SXM card's sustained 8192^3 product on random data, H.
  He).  A component that would do it: the clusters' power caps (350 W in Meta's
  production cluster, 400 W on RSC; Touvron et al. 2023, "Llama 2", sec. 2.2.1), or the
  clocks of cards held at their limit by a whole step's sustained load rather than one
  benchmarked product.  No A100 GEMM measurement at 350 W, nor one under sustained load,
  was found (the MAMF table's 300 W A100 PCIe reads 0.93 .. 0.96 of the SXM's best burst:
  not 0.84), and the rows' cluster is not stated: not priced, no row moved.  A probe,
  never a figure the profile takes.

GEMM rates under power limits and sustained load (gemm15, 2026-11-30).  The question: do
component measurements put an A100's sustained GEMM rate at the 0.83-0.88 of the
profile's (the ``GEMM x`` column: 213-228 TFLOP/s where the profile prices 258) that the
six A100 rows would need?  Searched (pages, issues, docs corpora): power-capping and DVFS
studies (Zeus / Perseus, ML.ENERGY, power-capping papers on H100 / H200 / GH200 with
DGEMM), NVIDIA's HPL clock notes, MLPerf pages, GEMM sweeps (Anthony et al. 2024,
arXiv:2401.14489, only its abstract and guidelines in the corpus, no per-shape figure),
cuBLAS / CUTLASS issues.  What was found, each a kernel figure (``A100_GEMM_FIGURES``,
:func:`power_reading`):

- the profile's own point, 258 TFLOP/s: an 8192^3 product through PyTorch's cuBLAS on
  a 400 W A100 SXM, random inputs (H. He, thonking.ai, 2024; 295 on zeros: the card is
  power-limited, random data draws the most power);
- a 500 W A100-SXM4-80GB (the higher-TDP 80GB part), 8192^3 bf16, PyTorch 2.8.0+cu128,
  median of 7 rounds: 289.3 TFLOP/s (tusharhqq/napkin-math-gpu@9da5cf368f
  results/a100-80gb-sxm4.json, "gemm_bf16", power_limit_w 500.0, captured 2026-08-08):
  1.12x the 400 W figure, another library and card;
- a 300 W A100 PCIe against a 400 W A100 SXM, the same GA100 die and 1,410 MHz boost,
  each card's best shape (S. Bekman, ml-engineering, compute/accelerator/README.md,
  "Maximum Achievable Matmul FLOPS comparison table"): 256.4 / 267.9 = 0.957 (CUDA 12.1
  revision), 252.9 / 271.2 = 0.933 (2025 revision, torch 2.5.1+cu124 / 2.6.0+cu126).
  So 100 W less power cost an A100 GEMM 4-7%; a 350 W cap (Meta's production cluster,
  Touvron et al. 2023 sec. 2.2.1; RSC ran 400 W) lies between, bounded by
  ``POWER_CAP_BOUND`` = 0.933, well above the 0.83-0.88 the rows need;
- sustained load: on the H100 the measured file's 8,192^3 product held 683 TFLOP/s for
  12 s at its 700 W cap (1,365-1,440 MHz, ``sim_mesh/measurements/h100-sxm-80gb.json``:
  the profile already prices the sustained rate); at cluster scale Meta saw a diurnal
  1-2% throughput variation from temperature-driven DVFS (Llama 3 paper, Dubey et al.
  2024, sec. 3.3.4: an end-to-end variation, read for its scale only); back-to-back
  kernels can lose 15% within 100 iterations on a B200 (flashinfer-ai/flashinfer PR
  #2899, FlashAttention-4 forward: a benchmark-method effect on another GPU, not priced);
- the clock under the power limit: FlashAttention-2 forward on an A100 (variant not
  stated) ran with its SM clock falling from 1,410 to "~1200MHZ" from the power limit,
  the author's peak at that clock "~265TFLOPs/s" (liangan1/GPU_travel@07d0469e8a
  performance/flash-attn/README.md).  An A100 does 108 SMs x 2,048 FLOP per clock (the
  datasheet's 312 TFLOP/s at 1,410 MHz; NVIDIA/cudnn-frontend PR #715), so 1,200 MHz
  gives 265.4 and the profile's 258 is 0.972 of it (:func:`a100_clock_share`): the
  profile's rate is already a power-limited clock's, not a boost burst.  The rows'
  213-228 TFLOP/s at the same kernel efficiency would need 992-1,058 MHz sustained, a
  further 12-17% off the clock, which no figure found shows for a 400 W card;
- and the layer-level check NVIDIA's own A100s give: Korthikanti et al. 2022 Table 4
  (one 22B layer, tp 8, on 400 W DGX A100s), which the clock meets within 2.1% with the
  profile's GEMM rate (tests/test_table4.py).  At the rows' GEMM factors it would not:
  :func:`table4_at` prices the baseline layer at 21.13-22.01 ms for the rows' x =
  0.827-0.882 (published 19.6: +8 to +12%); at the power-cap bound 0.933, 20.39 ms (+4%).

The attention kernel (FlashAttention-2 through SDPA, ``sim_mesh.fa2_a100``: Dao 2023
Fig. 4, causal head dimension 128 at 4k 173 TFLOP/s forward + backward): searched for
another A100 forward + backward figure at these shapes (issues: the repository's
``benchmark_flash_attention.py`` outputs posted for RTX A5000, H100 PCIe and other GPUs,
none for an A100 at head dimension 128); the one A100 reading, GPU_travel's forward alone
at ~1,200 MHz, is already read in ``fa2_a100``'s docstring.  Nothing re-prices it.

So no component figure supports an A100 GEMM at 0.69-0.73 of peak: the one GEMM factor
that would bring the six torchtitan A100 rows within 3% is contradicted by Table 4 on
NVIDIA's 400 W cards, and a 350 W cap, were the rows' cluster capped (not stated), is
bounded by the 300 W PCIe card's 0.933.  Priced at that bound the rows would read 1.046
.. 1.097 (13B 1.093 / 1.097; :func:`power_reading`, the "x bound" column): inside 15%,
but the bound is a 300 W card's and the rows' power limit unknown, so it is a reading,
not a figure the profile takes.  No row moved.

i2117 (2026-11-30): FSDP2's copies and the Llama step's memory-bound kernels, item by item
against what is priced (``tests/test_i2117.py``; seconds a step of the 13B rows, none /
op, from the first table):

- (a) FSDP2's copy kernels around each collective (pytorch/pytorch
  ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``): ``foreach_all_gather``'s
  copy-in (fp32 -> bf16 ``_foreach_copy_``, then into the gather buffer) and the
  accumulation after each reduce-scatter on the side streams, in series with their
  collectives; ``split_with_sizes_copy`` copy-out and ``_chunk_cat`` (bf16 -> fp32, the
  reduce-dtype cast inside it) on the compute stream; no pre/post divide (NCCL AVG):
  priced, ``plan.fsdp2_cost`` (docstring: source lines, PRs #122888, #120919, #129721), at
  the shares of the memory rate each kernel reached on an H100 (``COPY_RATE``,
  ``benchmarks/fsdp2_copies.py``, 0.61-0.98 of a plain copy), ASSUMED the same on the
  A100s (no A100 timing of these kernels found; #120678's chunk-cat figure is an H100's).
  0.134 s a step (3.6-4.1% of the 13B rows' predicted steps); their side-stream part is hidden (the
  collectives' onset table).  The assumption's range (:func:`copy_share_reading`, last
  table): every compute-stream copy at the lowest measured share (the chunk-cat's 0.61)
  0.163 s, at the plain copy's rate 0.100 s: the 13B rows 1.142 / 1.148 .. 1.164 / 1.167,
  the six A100 rows 1.090 .. 1.167 against 1.105 .. 1.157 priced.  The low end would
  bring both 13B rows inside 15%, but no component figure puts the A100's copy-out below
  the H100's 0.90 share: a reading, not applied (a lead: an A100 run of
  ``benchmarks/fsdp2_copies.py`` settles it; no device this session).
- (b) the memory-bound kernels: RMSNorm (torchtitan's eager norm, or the Triton
  ``fused_rmsnorm`` of the 13B / 8B configs: ``plan.titan_eager``, at Liger-Kernel's
  measured A100 / H100 rates, ``plan.eager_rates``), SwiGLU's silu and product, RoPE,
  the residual adds (``plan.llama_layer`` ops ``silu``, ``swiglu_mul``, ``rope_q`` /
  ``rope_k``, ``residual_add_*``, their backward ops; torchtitan's eager extras at the
  measured rates: 0.149 / 0.219 s); the logits' fp32 cast and cross-entropy over the
  vocabulary (the measured pair, ``ops_table/loss_pricing``; inside ``head``, 0.039 s);
  AdamW ``foreach=True`` with weight decay (``sim_mesh.optimizer_cost.adam_kernels``: 20
  fp32 accesses a parameter in 8 kernels, at the memory rate; fused would be 7 accesses,
  1 kernel: torchtitan's ``build_optimizer`` passes ``foreach=True``, the fused path is
  not taken) and ``clip_grad_norm_(..., foreach=True)`` (``_foreach_norm``, read 4, and
  the unconditional ``_foreach_mul_``, read 4 + write 4; its scalar all-reduce:
  microseconds, not priced, above), ``plan.optimizer_step``: 0.010 s over the rank's 1/64 shard.  All priced;
  to the 15% edge the 13B rows lack 6.7 / 21.8 ms (``to_edge``), which the eager
  kernels would give were they 4.5% / 9.9% slower than their measured rates (no source
  for that), the optimizer 64% / 209% slower (its bytes are counted from torch's
  kernels).
Finding: nothing the brief names for (a) and (b) is unpriced; the one assumption that
would move the 13B rows is the H100 shares of the copy kernels carried to the A100.
No row moved.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import published as P  # noqa: E402
import published_torchtitan as T  # noqa: E402
import workbench as wb  # noqa: E402
from workbench.plan import costs as C  # noqa: E402
from workbench.plan import frameworks as F  # noqa: E402
from workbench.plan import fsdp2_cost as FS  # noqa: E402
from workbench.plan import fsdp2_root as FR  # noqa: E402
from workbench.plan import zero_cost as Z  # noqa: E402
from workbench.plan.edge_cost import edge_times  # noqa: E402
from workbench.sim_mesh.cost import bus_bandwidth, overlap_rate  # noqa: E402
from workbench.sim_mesh.topology import group_of  # noqa: E402


def rows():
    """torchtitan's rows of ``benchmarks/published.py`` (``published_torchtitan.ROWS``)."""
    return list(T.ROWS)


def _stream(cfg, lay, prof, layer, head, edge):
    """The stage's FSDP2 units as ``estimate`` hands them to ``zero_cost.zero_exposed``
    (one stage: the root unit first, then the blocks), the side-stream copies and the
    collective prices per unit of n parameters."""
    shards = lay.dp * lay.cp
    copies = FS.stage_copies(Z.stage_blocks(cfg, lay, 0, layer, head, edge), cfg.n_layer,
                             True, True, shards, lay.m, prof)
    blocks, stay = FR.root_unit(copies["blocks"], copies["stay"], True, True, shards, prof)
    ranks = tuple(lay.grad_ranks(0, 0))
    g = F.grad_reduce_bytes(lay.engine, cfg.dtype)

    def gather(n):
        return C.group_price("all_gather", 2 * n, ranks, prof) + copies["gather_extra"](n)

    def reduce(n):
        return C.group_price("reduce_scatter", g * n, ranks, prof) + copies["reduce_extra"](n)

    return dict(copies=copies, blocks=blocks, stay=stay, ranks=ranks, grad_bytes=g,
                gather=gather, reduce=reduce)


def breakdown(row) -> dict:
    """The step's terms for one row (module docstring), seconds per step."""
    cfg, lay, cl = P.build(row)
    r = P.predict(row)
    est = r["estimate"]
    prof = FS.sdpa_profile(cl.profile)       # the attention kernel SDPA runs, as estimate
    d = est.details
    if lay.pp != 1 or lay.tp != 1 or lay.cp != 1 or lay.engine != "fsdp":
        raise ValueError(f"breakdown: {row['name']!r} is {lay.short()}; this reads FSDP2 "
                         f"alone (tp = pp = cp = 1), as torchtitan's rows run")
    st = next(iter(d["stages"].values()))
    m, n_layers = d["micro_batches"], cfg.n_layer
    ly, hd = d["layer"], d["head"]
    edge = edge_times(cfg, lay.micro_batch, 1, False, prof)
    eager = d["torchtitan_eager"] or {"forward": 0.0, "backward": 0.0}
    s = _stream(cfg, lay, prof, ly, hd, edge)
    fwd_x, bwd_x = Z.zero_exposed(s["blocks"], 3, s["gather"], s["reduce"],
                                  prefetch_numel=F.FSDP_PREFETCH_UNITS,
                                  rate=overlap_rate(prof, s["ranks"]), stay=s["stay"])
    blk = next(b for b in s["blocks"][1:] if b.numel)    # a transformer block
    root = s["blocks"][0]
    p, gb = len(s["ranks"]), s["grad_bytes"]
    ag_b = C.group_price("all_gather", 2 * blk.numel, s["ranks"], prof)
    rs_b = C.group_price("reduce_scatter", gb * blk.numel, s["ranks"], prof)
    # torchtitan's TPS/GPU: local batch x sequence tokens per GPU per step
    # every FSDP2 collective of the step (with its side-stream copies) end to end: each
    # unit gathered for forward, again for backward unless kept (``stay``), reduced once
    coll = m * sum(s["gather"](b.numel) * (1 + (i not in s["stay"])) + s["reduce"](b.numel)
                   for i, b in enumerate(s["blocks"]) if b.numel)
    published = lay.micro_batch * m * cfg.seq_len / row["published"]
    grp = group_of(s["ranks"], prof)
    wire = (p - 1) / p * (2 + gb) * blk.numel        # a backward's gather + reduce-scatter
    return dict(
        name=row["name"], gpus=row["devices"], profile=row["profile"], seq=cfg.seq_len,
        recompute=lay.recompute, mbs=lay.micro_batch, m=m, ratio=r["ratio"],
        published=published, predicted=est.step_time,
        compute=m * st["compute"],
        blocks=m * n_layers * (ly.fwd_compute + ly.bwd_compute),
        eager=m * n_layers * (eager["forward"] + eager["backward"]),
        head_loss=m * (hd.fwd_compute + hd.bwd_compute + sum(edge["last"])),
        embedding=m * sum(edge["first"]),
        copies=m * (st["copies"]["forward"] + st["copies"]["backward"]),
        grad_accumulation=m * st["grad_accumulation"],
        exposed=st["dp"], exposed_forward=m * fwd_x, exposed_backward=m * bwd_x,
        optimizer=d["optimizer"], bubble=est.breakdown["bubble"], collectives=coll,
        serial=m * st["compute"] + coll + d["optimizer"],
        room=published - m * st["compute"] - d["optimizer"],
        nodes=grp.nodes, per_node=grp.local, block_params=blk.numel,
        root_params=root.numel,
        block_fwd=blk.fwd, block_bwd=blk.bwd,
        block_all_gather=ag_b, block_reduce_scatter=rs_b,
        block_gather_side=s["gather"](blk.numel) - ag_b,
        block_reduce_side=s["reduce"](blk.numel) - rs_b,
        root_all_gather=s["gather"](root.numel), root_reduce_scatter=s["reduce"](root.numel),
        busbw_priced=bus_bandwidth("reduce_scatter", gb * blk.numel, p, rs_b),
        busbw_onset=wire / blk.bwd,
        link="inter_node" if grp.nodes > 1 else "intra_node")


# the pairs of rows that differ in one knob on the same hardware, network and code (module
# docstring, "The pairs' relative errors"): (name, devices, recompute, local batch) of the
# row over that of its reference
PAIRS = ((("Llama 2 70B", 64, "op", 1), ("Llama 2 70B", 64, "full", 2)),
         (("Llama 2 13B", 64, "op", 2), ("Llama 2 13B", 64, "none", 2)),
         (("Llama 3.1 8B", 128, "op", 2), ("Llama 3.1 8B", 8, "op", 2)))


def _key(x) -> tuple:
    return x["name"], x["gpus"], x["recompute"], x["mbs"]


def pairs(out=None) -> list[dict]:
    """Each of ``PAIRS``: the published and the predicted TPS/GPU of the row over its
    reference's (``measured``, ``predicted``), and the step's terms (``breakdown``) in
    seconds per 1,000 tokens of a GPU, the row's less the reference's (``delta``)."""
    by = {_key(x): x for x in (out if out is not None else [breakdown(r) for r in rows()])}
    res = []
    for a, b in PAIRS:
        x, y = by[a], by[b]
        tok_x, tok_y = x["mbs"] * x["m"] * x["seq"], y["mbs"] * y["m"] * y["seq"]
        delta = {k: 1e6 * (x[k] / tok_x - y[k] / tok_y)
                 for k in ("predicted", "published", "blocks", "eager", "head_loss",
                           "copies", "exposed", "optimizer")}
        res.append(dict(row=a, reference=b,
                        measured=(tok_x / x["published"]) / (tok_y / y["published"]),
                        predicted=(tok_x / x["predicted"]) / (tok_y / y["predicted"]),
                        delta=delta))
    return res


def _scaled(profile, link: str, x: float):
    """``profile`` with ``link``'s bandwidth times ``x`` (a probe, never a profile)."""
    ln = getattr(profile, link)
    return dataclasses.replace(profile, **{link: dataclasses.replace(
        ln, bandwidth=ln.bandwidth * x)})


def needed_scale(row, iters: int = 24) -> "float | None":
    """The factor on the row's bounding link (inter-node across nodes, NVLink inside one)
    at which ``estimate`` takes the published step (bisected on log scale in 1e-3 .. 1;
    None if even a thousand times slower a network leaves the estimate faster)."""
    cfg, lay, cl = P.build(row)
    r = P.predict(row)
    target = r["estimate"].step_time * r["ratio"]
    link = "inter_node" if group_of(tuple(lay.grad_ranks(0, 0)), cl.profile).nodes > 1 \
        else "intra_node"

    def step(x):
        c = wb.plan.Cluster(_scaled(cl.profile, link, x), row["devices"])
        return wb.plan.estimate(cfg, lay, c, attention=row["attention"],
                                **row["estimate_args"]).step_time

    lo, hi = 1e-3, 1.0
    if step(lo) < target:
        return None
    if step(hi) >= target:
        return 1.0
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if step(mid) >= target else (lo, mid)
    return (lo * hi) ** 0.5


# the edge of the held-out goal: a row is within 15% when |ratio - 1| <= 0.15
# (``published.summary``), ratio = predicted over published TPS/GPU = the published step
# over the predicted one
EDGE = 1.15
# the terms of ``breakdown`` a row's missing seconds are set against (``to_edge``)
TERMS = ("blocks", "eager", "head_loss", "copies", "exposed", "optimizer")


def to_edge(x) -> dict:
    """What the predicted step of row ``x`` (a ``breakdown``) lacks to reach the 15% edge:
    ``seconds`` = published step / ``EDGE`` - predicted step (> 0 where the row is more
    than 15% optimistic, <= 0 where it is within), and per term of ``TERMS`` the share by
    which that term alone would have to grow (``seconds`` / term).  A reading of where the
    gap could be, never a figure the planner takes."""
    need = x["published"] / EDGE - x["predicted"]
    return dict(seconds=need, share={k: need / x[k] if x[k] > 0 else float("inf")
                                     for k in TERMS})


# FSDP2's copy kernels on the compute stream (plan.fsdp2_cost.stage_copies): the
# all-gather copy-out and the reduce-scatter's chunk-cat; the side streams' copy-in and
# accumulation run in series with the collectives (priced there, hidden where they are)
COMPUTE_STREAM_COPIES = ("all_gather_copy_out", "reduce_scatter_copy_in")


def copy_share_reading(row) -> dict:
    """FSDP2's compute-stream copies a step (module docstring, "i2117") at the shares of
    the memory rate priced (``fsdp2_cost.COPY_RATE``, measured on an H100 and ASSUMED on
    the A100s), were every one of them at the lowest share measured (``low``: the chunk-
    cat's) or at the plain copy's (``plain``: share 1), and the ratio the row would read
    at each (the step changes by the copies' difference: they are on the critical path).
    Bytes from the estimate's own count (``details["fsdp2_copies"]["bytes"]``, per micro-
    batch); the launch term left out (the same at every share).  A range of the
    assumption, never a figure the planner takes."""
    cfg, lay, cl = P.build(row)
    r = P.predict(row)
    est = r["estimate"]
    d = est.details
    prof = FS.sdpa_profile(cl.profile)
    rate = prof.memory_bandwidth * prof.memory_efficiency
    by, m = d["fsdp2_copies"]["bytes"], d["micro_batches"]
    low = min(FS.COPY_RATE.values())

    def at(share):
        return m * sum(by[k] / rate / (FS.COPY_RATE[k] if share is None else share)
                       for k in COMPUTE_STREAM_COPIES)

    published = est.step_time * r["ratio"]
    priced, slow, fast = at(None), at(low), at(1.0)
    return dict(name=row["name"], gpus=row["devices"], recompute=lay.recompute,
                ratio=r["ratio"], priced=priced, low=slow, plain=fast, low_share=low,
                ratio_low=published / (est.step_time + slow - priced),
                ratio_plain=published / (est.step_time + fast - priced))


def _gemm_scaled(profile, x: float):
    """``profile`` with its GEMM efficiency times ``x`` (a probe, never a profile)."""
    eff = dict(profile.efficiency)
    eff["matmul"] = eff["matmul"] * x
    return dataclasses.replace(profile, efficiency=eff)


def gemm_scale(row, step: float, iters: int = 24) -> float:
    """The factor on the profile's GEMM efficiency (``efficiency["matmul"]``: every
    GEMM of the blocks, the recompute and the output layer) at which ``estimate`` takes
    ``step`` seconds (bisected on log scale in 0.25 .. 1)."""
    cfg, lay, cl = P.build(row)
    if dict(cl.profile.measured).get("file"):
        raise ValueError(f"gemm_scale: profile {cl.profile.name!r} prices GEMMs from its "
                         f"measurements ({cl.profile.measured['file']}), not from "
                         f"efficiency['matmul']: the probe reads profiles without them")

    def est(x):
        c = wb.plan.Cluster(_gemm_scaled(cl.profile, x), row["devices"])
        return wb.plan.estimate(cfg, lay, c, attention=row["attention"],
                                **row["estimate_args"]).step_time

    lo, hi = 0.25, 1.0
    if est(hi) >= step:
        return 1.0
    if est(lo) < step:
        raise ValueError(f"gemm_scale: {row['name']!r} stays under {step:.3f} s even with "
                         f"GEMMs at a quarter of the profile's rate")
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if est(mid) >= step else (lo, mid)
    return (lo * hi) ** 0.5


# pytorch/torchtitan eb6aa6389 docs/performance.md, the Llama 2 13B rows on 64 A100s at
# local batch 2 (WPS): no checkpointing, "selective layer" (selective_ac_option = '2':
# every second block under full AC, ``parallelize_llama.py``:92-110 at that commit; not a
# row of the planner, which checkpoints every block or none), "selective op"
AC_13B = {"none": 2162.0, "layer": 1914.0, "op": 1904.0}
# the doc does not give the option's value: ASSUMED '2', the config's own example ("2 ==
# checkpoint every 2nd one", ``parallelize_llama.py``:86-87); with '1' (every block) the
# published 0.491 s would be 0.60 of the planner's 40 recomputes, with '3' 1.85 of its 13
AC_13B_EVERY = 2


def recompute_reading() -> dict:
    """The 13B's recompute, measured against priced, for its two checkpointing kinds
    (``AC_13B``): seconds a step each adds over no checkpointing, published (from the
    WPS) and priced (the planner's blocks: op-level SAC on every block; full AC with its
    early stop on every ``AC_13B_EVERY``-th block, its blocks priced as the full-AC
    estimate prices them)."""
    base = next(r for r in rows() if r["name"] == "Llama 2 13B"
                and r["layout"]["recompute"] == "none")
    tokens = base["layout"]["micro_batch"] * base["model"]["seq_len"]
    out = {}
    b = {rc: breakdown(dict(base, layout=dict(base["layout"], recompute=rc)))
         for rc in ("none", "op", "full")}
    for kind, rc, share in (("op", "op", 1.0), ("layer", "full", 1.0 / AC_13B_EVERY)):
        measured = tokens / AC_13B[kind] - tokens / AC_13B["none"]
        priced = share * (b[rc]["blocks"] - b["none"]["blocks"])
        out[kind] = dict(measured=measured, priced=priced, ratio=measured / priced,
                         blocks=int(round(share * base_layers(base))))
    out["none_ratio"] = b["none"]["ratio"]
    return out


# gemm15: A100 bf16 / fp16 GEMM rates at known power limits (module docstring, "GEMM
# rates under power limits"): (label, TFLOP/s, board power W, source)
A100_GEMM_FIGURES = (
    ("A100 SXM 400 W, 8192^3, random data (the profile's efficiency.matmul)", 258.0, 400,
     "H. He, 'Strangely, Matrix Multiplications on GPUs Run Faster When Given "
     "\"Predictable\" Data', thonking.ai, 2024"),
    ("A100-SXM4-80GB 500 W, 8192^3 bf16, median of 7 rounds", 289.3, 500,
     "tusharhqq/napkin-math-gpu@9da5cf368f results/a100-80gb-sxm4.json 'gemm_bf16' "
     "(289.297, power_limit_w 500.0, torch 2.8.0+cu128, 2026-08-08)"),
    ("A100 SXM 400 W, best shape (MAMF, CUDA 12.1)", 267.9, 400,
     "stas00/ml-engineering compute/accelerator/README.md, MAMF table"),
    ("A100 PCIe 300 W, best shape (MAMF, CUDA 12.1)", 256.4, 300,
     "stas00/ml-engineering compute/accelerator/README.md, MAMF table"),
    ("A100 SXM 400 W, best shape (MAMF, 2025 revision, torch 2.6.0+cu126)", 271.2, 400,
     "stas00/ml-engineering compute/accelerator/README.md, MAMF table (2025)"),
    ("A100 PCIe 300 W, best shape (MAMF, 2025 revision, torch 2.5.1+cu124)", 252.9, 300,
     "stas00/ml-engineering compute/accelerator/README.md, MAMF table (2025)"),
)
# the lower of the two 300 W / 400 W ratios of the same table: the most a power limit
# between them (350 W) can take from a 400 W card's GEMM rate, read as a bound
POWER_CAP_BOUND = 252.9 / 271.2
# Korthikanti et al. 2022 Table 4, the baseline row (no SP, no recompute): forward,
# backward, combined ms of one 22B layer (h 6144, 64 heads, s 2048, b 4, tp 8, fp16)
TABLE4_BASELINE = (7.7, 11.9, 19.6)
TABLE4_LAYER = dict(h=6144, a=64, s=2048, b=4, tp=8, dtype="float16")
# an A100's tensor-core FLOP per clock (bf16 / fp16 dense): 108 SMs x 2,048, the
# datasheet's 312 TFLOP/s at its 1,410 MHz boost (NVIDIA/cudnn-frontend PR #715)
A100_FLOP_PER_CLOCK = 108 * 2048
# the SM clock an A100 held under FlashAttention-2's sustained load, power-limited
# (liangan1/GPU_travel@07d0469e8a performance/flash-attn/README.md: "~1200MHZ")
A100_POWER_LIMITED_CLOCK = 1200e6


def a100_clock_share(tflops: float, clock: float = A100_POWER_LIMITED_CLOCK) -> float:
    """``tflops`` over the A100's tensor-core peak at ``clock`` (Hz): the kernel's
    efficiency were the card at that clock."""
    return tflops * 1e12 / (A100_FLOP_PER_CLOCK * clock)


def table4_at(x: float) -> tuple:
    """Korthikanti Table 4's baseline layer (``TABLE4_LAYER``) priced by the clock with
    the a100 profile's GEMM rate times ``x`` (``_gemm_scaled``): forward, backward,
    combined, ms.  x = 1 is the profile (tests/test_table4.py: within 2.1%)."""
    from workbench.plan.layer_cost import layer_times
    from workbench.sim_mesh.profiles import get_profile
    r = layer_times(profile=_gemm_scaled(get_profile("a100"), x), **TABLE4_LAYER)
    return r.forward * 1e3, r.backward * 1e3, r.combined * 1e3


def step_at(row, x: float) -> float:
    """The row's estimated step (s) with every GEMM's rate times ``x`` (a probe)."""
    cfg, lay, cl = P.build(row)
    c = wb.plan.Cluster(_gemm_scaled(cl.profile, x), row["devices"])
    return wb.plan.estimate(cfg, lay, c, attention=row["attention"],
                            **row["estimate_args"]).step_time


def power_reading(iters: int = 12) -> list:
    """Per A100 row (profile ``a100``): its ratio, the GEMM factor that takes the
    published step (``gemm_scale``), Table 4's baseline layer at that factor (combined
    ms against the published 19.6), and the row's ratio were every GEMM at
    ``POWER_CAP_BOUND`` (a 300 W card's share of a 400 W card's rate: the most a 350 W
    cap could take, module docstring).  A reading: nothing here is priced."""
    out = []
    for row in rows():
        if row["profile"] != "a100":
            continue
        b = breakdown(row)
        x = gemm_scale(row, b["published"], iters)
        out.append(dict(name=row["name"], recompute=b["recompute"], ratio=b["ratio"],
                        x_published=x, table4=table4_at(x)[2],
                        ratio_at_bound=b["ratio"] * b["predicted"]
                        / step_at(row, POWER_CAP_BOUND)))
    return out


def base_layers(row) -> int:
    """The row's transformer blocks."""
    cfg, _, _ = P.build(row)
    return cfg.n_layer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--needed", action="store_true",
                    help="also bisect the bus bandwidth that would explain each row's gap")
    args = ap.parse_args(argv)
    out = [breakdown(row) for row in rows()]
    print("torchtitan FSDP2 rows (benchmarks/published_torchtitan.py): the predicted step's "
          "terms, seconds per step")
    print(f"  {'model':<13}{'GPUs':>5} {'rc':<5}{'ratio':>6}{'publ.':>7}{'pred.':>7}"
          f"{'compute':>8}{'blocks':>7}{'eager':>6}{'head':>6}{'emb':>6}{'copies':>7}"
          f"{'exp fwd':>8}{'exp bwd':>8}{'opt':>6}{'room':>7}")
    for x in out:
        print(f"  {x['name']:<13}{x['gpus']:>5} {x['recompute']:<5}{x['ratio']:>6.3f}"
              f"{x['published']:>7.3f}{x['predicted']:>7.3f}{x['compute']:>8.3f}"
              f"{x['blocks']:>7.3f}{x['eager']:>6.3f}{x['head_loss']:>6.3f}"
              f"{x['embedding']:>6.3f}{x['copies']:>7.3f}{x['exposed_forward']:>8.3f}"
              f"{x['exposed_backward']:>8.3f}{x['optimizer']:>6.3f}{x['room']:>7.3f}")
    print("  (blocks: with their recompute and eager kernels; eager: that part of blocks; "
          "head: output layer, final norm, loss)")
    print("  FSDP2's collectives end to end (+ side copies) and the step were none of them "
          "hidden: the bound on what any overlap model can add")
    print(f"  {'model':<13}{'GPUs':>5} {'rc':<5}{'coll.':>7}{'exposed':>8}{'serial':>8}"
          f"{'publ.':>7}{'ratio if serial':>16}")
    for x in out:
        print(f"  {x['name']:<13}{x['gpus']:>5} {x['recompute']:<5}{x['collectives']:>7.3f}"
              f"{x['exposed']:>8.3f}{x['serial']:>8.3f}{x['published']:>7.3f}"
              f"{x['published'] / x['serial']:>16.3f}")
    print("  one unit's collectives (ms; + the side-stream copies FSDP2 runs in series) "
          "beside a block's compute")
    print(f"  {'model':<13}{'GPUs':>5} {'rc':<5}{'nodes':>6}{'/node':>6}{'block':>7}"
          f"{'AG bf16':>9}{'RS fp32':>9}{'+side':>7}{'fwd':>7}{'bwd':>7}{'root':>7}"
          f"{'root AG':>8}{'root RS':>8}")
    for x in out:
        print(f"  {x['name']:<13}{x['gpus']:>5} {x['recompute']:<5}{x['nodes']:>6}"
              f"{x['per_node']:>6}{x['block_params'] / 1e6:>6.0f}M"
              f"{1e3 * x['block_all_gather']:>9.2f}{1e3 * x['block_reduce_scatter']:>9.2f}"
              f"{1e3 * (x['block_gather_side'] + x['block_reduce_side']):>7.2f}"
              f"{1e3 * x['block_fwd']:>7.1f}{1e3 * x['block_bwd']:>7.1f}"
              f"{x['root_params'] / 1e6:>6.0f}M{1e3 * x['root_all_gather']:>8.2f}"
              f"{1e3 * x['root_reduce_scatter']:>8.2f}")
    print("  pairs (same GPUs, network and code): TPS/GPU of the row over its reference's, "
          "and the step's terms, row less reference, ms per 1,000 tokens of a GPU (d publ, "
          "d pred: the published and the predicted step's)")
    print(f"  {'row':<24}{'reference':<24}{'publ.':>7}{'pred.':>7}{'d publ':>7}{'d pred':>7}{'blocks':>7}"
          f"{'eager':>7}{'copies':>7}{'exposed':>8}{'opt':>6}")
    for p in pairs(out):
        d = p["delta"]
        print(f"  {' '.join(map(str, p['row'])):<24}{' '.join(map(str, p['reference'])):<24}"
              f"{p['measured']:>7.3f}{p['predicted']:>7.3f}{d['published']:>7.1f}{d['predicted']:>7.1f}"
              f"{d['blocks']:>7.1f}{d['eager']:>7.1f}{d['copies']:>7.1f}{d['exposed']:>8.1f}"
              f"{d['optimizer']:>6.1f}")
    print(f"  to the 15% edge: the seconds a step the prediction lacks (published / {EDGE} - "
          f"predicted; <= 0: within), and how much each term alone would have to grow")
    print(f"  {'model':<13}{'GPUs':>5} {'rc':<5}{'ratio':>6}{'lacks s':>9}"
          + "".join(f"{k:>10}" for k in TERMS) + f"{'GEMM x':>8}{'(publ.)':>8}")
    for x, row in zip(out, rows()):
        e = to_edge(x)
        extra = ""
        if e["seconds"] > 0:             # beyond the edge: the GEMM rate that would reach it
            extra = (f"{gemm_scale(row, x['published'] / EDGE, 16):>8.3f}"
                     f"{gemm_scale(row, x['published'], 16):>8.3f}")
        print(f"  {x['name']:<13}{x['gpus']:>5} {x['recompute']:<5}{x['ratio']:>6.3f}"
              f"{e['seconds']:>9.4f}"
              + "".join(f"{'-' if e['seconds'] <= 0 else f'+{100 * v:.1f}%':>10}"
                        for v in e["share"].values()) + extra)
    print("  (GEMM x: the factor on every GEMM's rate at which the row reaches the edge, and "
          "the published step; a probe, not a figure the profile takes)")
    rr = recompute_reading()
    print(f"  Llama 2 13B's recompute, seconds a step over no checkpointing (eb6aa6389 "
          f"docs/performance.md: {AC_13B['none']:.0f} / {AC_13B['layer']:.0f} / "
          f"{AC_13B['op']:.0f} WPS none / selective layer / selective op; the none row "
          f"reads {rr['none_ratio']:.3f})")
    for kind in ("op", "layer"):
        r = rr[kind]
        print(f"  {kind:<6} {r['blocks']:>3} blocks  published {r['measured']:.3f}  priced "
              f"{r['priced']:.3f}  x{r['ratio']:.3f}")
    print("  A100 GEMM rates at known power limits (gemm15; module docstring): TFLOP/s")
    for label, tf, _w, src in A100_GEMM_FIGURES:
        print(f"    {tf:6.1f}  {label}  [{src}]")
    print(f"  He's 258 TFLOP/s is {a100_clock_share(258.0):.3f} of an A100's peak at the "
          f"{A100_POWER_LIMITED_CLOCK / 1e6:.0f} MHz a power-limited card holds (GPU_travel)")
    t4 = table4_at(1.0)[2]
    print(f"  the GEMM factor each A100 row needs (published step), Korthikanti Table 4's "
          f"layer at it (ms, published {TABLE4_BASELINE[2]}; at x = 1: {t4:.2f}), and the "
          f"row's ratio at the power-cap bound x = {POWER_CAP_BOUND:.3f} (a reading)")
    print(f"  {'model':<13}{'rc':<5}{'ratio':>6}{'x publ.':>8}{'Table 4':>8}{'x bound':>8}")
    for r in power_reading():
        print(f"  {r['name']:<13}{r['recompute']:<5}{r['ratio']:>6.3f}{r['x_published']:>8.3f}"
              f"{r['table4']:>8.2f}{r['ratio_at_bound']:>8.3f}")
    print("  bus bandwidth of the FSDP group (GB/s, nccl-tests' busbw): the clock's, and "
          "the least that hides a block's backward collectives"
          + ("; gap: what would make the estimate the published step" if args.needed else ""))
    for x in out:
        extra = ""
        if args.needed:
            k = needed_scale(next(r for r in rows() if r["name"] == x["name"]
                                  and r["devices"] == x["gpus"]
                                  and r["layout"]["recompute"] == x["recompute"]
                                  and r["layout"]["micro_batch"] == x["mbs"]))
            extra = ("  gap: beyond 1000x slower" if k is None else
                     f"  gap {x['busbw_priced'] * k / 1e9:7.1f} (x{k:.3f} on {x['link']})")
        print(f"  {x['name']:<13}{x['gpus']:>5} {x['recompute']:<5}"
              f"priced {x['busbw_priced'] / 1e9:7.1f}  onset {x['busbw_onset'] / 1e9:6.1f}"
              f"{extra}")
    print("  FSDP2's compute-stream copies (copy-out, chunk-cat) a step at the H100's "
          "measured shares of the copy rate (priced; ASSUMED on the A100s), all at the "
          "lowest share, all at the plain copy's: s, and the ratio at each "
          "(copy_share_reading)")
    print(f"  {'model':<13}{'GPUs':>5} {'rc':<5}{'priced':>8}{'low':>8}{'plain':>8}"
          f"{'ratio':>7}{'at low':>8}{'at plain':>9}")
    for row in rows():
        y = copy_share_reading(row)
        print(f"  {y['name']:<13}{y['gpus']:>5} {y['recompute']:<5}{y['priced']:>8.3f}"
              f"{y['low']:>8.3f}{y['plain']:>8.3f}{y['ratio']:>7.3f}{y['ratio_low']:>8.3f}"
              f"{y['ratio_plain']:>9.3f}")
    return out


if __name__ == "__main__":
    main()
