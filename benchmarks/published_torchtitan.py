"""torchtitan's published FSDP runs (PyTorch team, 2024) beside the planner.

    PYTHONPATH=. python benchmarks/published_torchtitan.py    # this block alone, seconds

A source of ``benchmarks/published.py`` (which imports ``ROWS``, ``OOM_ROWS``, ``NOTE``,
``LABEL`` and prints :func:`oom_lines`): held out as the others are; nothing in the
profiles or the planner is tuned to these figures.  Source: pytorch/torchtitan, read in
its mirror (``git show <commit>:<path>``):

- ``benchmarks/llama3_h100_202412_torchtitan.md`` (added 820504e20, 2025-06-13; the runs
  of 2024-12 on torch 1963fc83a1, torchtitan 9dec370ad2): Tables 1 and 3, first rows,
  "FSDP" alone (no torch.compile, no Float8): Llama 3.1 8B, 8 and 128 GPUs, local batch
  2 (global 16 and 256), selective activation checkpointing, TPS/GPU 5,762 and 5,605.
  The 8B config of 9dec370ad2 (``train_configs/llama3_8b.toml``): sequence 8192,
  ``selective_ac_option = 'op'`` (``recompute="op"``, ``plan.llama_layer``),
  ``compile = false``, ``norm_type = "rmsnorm"`` (torchtitan's eager RMSNorm,
  ``torchtitan/models/norms.py``).  Hardware: Grand Teton, "96GB HBM2e with 2.4 TB/sec",
  "400 Gb/s per GPU", "the default 500W power limit", and footnote 2, "the actual peak
  TFLOPs number is between SXM and NVL, and we don't know its exact value": profile
  ``h100-hbm2e`` (its compute peak a range, ``plan.ranges``).  "throughput numbers
  (TPS/GPU) are calculated and logged every 10 iterations, and always read at the
  (arbitrarily determined) 90th iteration."  The text derives "33% to 39% MFU" for
  these rows (with and without torch.compile) against the SXM's 989 TFLOP/s.
- ``docs/performance.md`` as first written: eb6aa6389 (2024-04-16, Llama 2 13B / 70B)
  and 1ea476e9f (2024-04-24, Llama 3 8B / 70B): "FSDP2 (1D parallelism)" on "64 A100
  (80GB)", local batch per row, tokens per second per GPU ("WPS") and MFU.  The configs
  of the same commits (``train_configs/llama_13b.toml`` / ``llama_70b.toml`` at
  eb6aa6389, ``llama3_8b.toml`` / ``llama3_70b.toml`` at 1ea476e9f): sequence 4096
  (Llama 2) and 8192 (Llama 3), ``compile = false``, 13B and Llama 3 8B with
  ``fused_rmsnorm`` (a Triton kernel), the 70Bs with ``rmsnorm`` (ASSUMED for the
  tables' rows: those two configs describe 2D runs, ``tensor_parallel_degree = 8``,
  local batch 16 / 8, full checkpointing, not the 1D rows; local batch and checkpointing
  are the tables'; both commits refuse the Triton norm with TP, "fused_rmsnorm not yet
  compatible with TP" (``torchtitan/parallelisms/parallelize_llama.py``:142-146, until
  pytorch/torchtitan#364, opened 2024-05-25), so those 2D configs had no choice; were the
  1D 70B rows run with ``fused_rmsnorm`` as the 1D 13B and 8B configs were, they would
  read 1.167 / 1.170 / 1.172 instead of 1.105 / 1.107 / 1.113: the assumption is worth
  0.06 on them, in the optimistic direction, 2026-11-29); op-level SAC as at 9dec370ad2
  (``parallelize_llama.py``'s ``no_recompute_list`` and "every second mm").
  The network of those A100s is not stated: priced as the ``a100`` profile's DGX A100
  (one 200 Gb/s HDR InfiniBand port per GPU), UNCERTAIN; Meta's two A100 clusters of the time both
  had 200 Gbps endpoints (Touvron et al. 2023, "Llama 2", sec. 2.2.1: RSC on InfiniBand,
  the production cluster on RoCE), with per-GPU power caps of 400 W (RSC) and 350 W
  (production): which one ran these rows is not stated, and the profile's GEMM rate is a
  400 W card's (a 350 W cap would slow the GEMMs; not measured here, not priced).
  RSC's fabric: DGX A100s on "an NVIDIA Quantum 200 Gb/s InfiniBand two-level Clos fabric
  that has no oversubscription" (Meta, "Introducing the AI Research SuperCluster",
  2022-01-24), i.e. the profile's eight HDR ports per node, where NVIDIA measures 192 GB/s
  all-reduce bus bandwidth (NVIDIA/nccl #812, A. Ladd); the production cluster's NICs per
  node are not published: the network is UNCERTAIN, not ASSUMED slower (below).
  eb6aa6389's table also reports the 70B at
  local batch 2 with selective op checkpointing "OOM" (``OOM_ROWS``).

Every row: torchtitan's FSDP2 (``framework="fsdp"``: ``fully_shard`` per block, bf16
parameters, fp32 gradient reduction, ``plan.fsdp2_cost``), the attention
``F.scaled_dot_product_attention`` runs (FlashAttention-2), untied Llama shapes
(``models.config`` presets), torchtitan's Llama block as its eager code runs it with the
config's ``norm_type`` (``estimate(torchtitan_eager=...)``, ``plan.titan_eager``).  The
metric is torchtitan's: tokens per second per GPU (global batch x sequence / step time /
GPUs).

What the comparison says (measured when this module was written; the band in
``tests/test_published.py`` guards it, never a target):

- On the fused Llama block (the course's operators) the rows read 1.144 .. 1.375; the
  H100 rows 1.497 / 1.539 on the h100 (SXM, 700 W) profile, 1.334 / 1.375 on h100-hbm2e.
  Traced with ``Estimate.explain()``: 1.9 s of the 8B's 2.1 s step is the blocks' compute
  (forward 15.3 ms, backward with op-level recompute 38.0 ms per block on the SXM
  profile), FSDP2's collectives hide behind it (0.03 s exposed), its copies are 48 ms.  The
  block's element-wise kernels were priced as the fused operators run them (one pass per
  RMSNorm and RoPE), but torchtitan's ``RMSNorm`` (``norm_type = "rmsnorm"``) runs 8
  kernels and 36 bytes per element forward, 92 backward (one pass: 4 and 6), its RoPE
  three fp32 kernels per tensor, ``repeat_kv`` copies the keys and values to the query
  heads, SwiGLU's product backward is two kernels, and autograd sums the input gradients
  of q, k, v and of w1, w3 (three adds the fused QKV and gate/up GEMMs do not run):
  +12.5 ms per 8B block and micro-batch on h100-hbm2e (its 26 forward kernels re-run by
  the op-level SAC), 0.40 s per step.  Priced so (``plan.titan_eager``): 1.081 .. 1.218,
  the H100 rows 1.123 / 1.157 (range 1.055 .. 1.224, NVL .. SXM with the attention kernel
  pinned at FlashAttention-2, which SDPA ran in torch 1963fc83a1: the published figures
  lie below it; the h100 profile's cuDNN bound stretched it to 1.293 / 1.332).
  The measured 16% of torch.compile (5,762 -> 6,667 TPS/GPU, fusing those kernels) is
  of the same size: not used, it is compiled-row data.
- Memory (the tables' Memory(GiB), ``train.py``'s logged ``max_reserved_gib``, the
  caching allocator's reserved peak): the planner's busiest rank 74.7 / 60.7 GiB against
  82.4 / 67.0 (0.907 / 0.906; reserved holds more than what is allocated).
- Still optimistic everywhere, the A100 rows most (1.081 .. 1.218, the a100 profile
  prices attention at FlashAttention-2's best 73% of peak and GEMMs at 0.827, no
  measurement of the A100 GEMMs at these shapes).  Unpriced and candidates, in order:
  the 500 W limit of the H100 rows against the measured card's 700 W (the peak's range
  spans NVL .. SXM datasheet figures, not a power-capped clock); eager mode's host
  launch overhead (about 1 us per kernel assumed; PyTorch's dispatcher in eager mode
  costs more per op, not measured here); the A100 cluster's network (not stated).
- The network, read term by term (``benchmarks/torchtitan_breakdown.py``, 2026-11-28):
  FSDP2's collectives of a step take 0.16-0.21 s (8B, H100), 0.36 (8B), 0.58 (13B) and
  2.9-3.0 s (70B, A100) end to end, of which 0.03-0.50 s are exposed; a block's bf16
  all-gather and fp32 reduce-scatter (torchtitan's ``reduce_dtype=torch.float32``,
  ``parallelize_llama.py:220-222`` at eb6aa6389) hide behind its backward down to a bus
  bandwidth of 24-59 GB/s, where the clock prices 175-187 (A100, 8 nodes) and 306-364
  (H100). For the network alone to explain a row, the FSDP group's bus bandwidth would
  have to be 24-49 GB/s on the A100 rows (x0.13-0.26 of the priced one), 26 GB/s on the
  H100 row at 16 nodes and 40 GB/s over NVLink for the one-node row (``--needed``); no
  source gives such a network: RSC's fabric is the profile's (above), the H100 hosts
  have "400 Gb/s per GPU" (the benchmark file; so do the Grand Teton nodes of Meta's 24K
  H100 clusters, eight 400G backend NICs, two per PCIe switch: G. Lockwood's notes on
  them, a secondary source), the one-node row has no network. The pattern does not fit
  one either: at the same local batch Llama 2 13B without recompute (less compute to
  hide behind) reads 1.176, with op-level recompute 1.191 (a network gap would shrink
  with more compute; measured op - none 0.514 s, priced 0.391), and with no overlap at
  all (every collective in series with compute) the 8B rows still read 1.036-1.082 while
  the 70B rows turn pessimistic (0.911-0.971). So the A100 network stays the profile's,
  UNCERTAIN in the rows' assumption line. Measured beside it, not used: an H100 RoCE
  cluster's ring all_gather of 2 GB at 32 nodes at 200 GB/s bus bandwidth, against 340
  for all_reduce (NVIDIA/nccl #1218, 16 channels forced); at that rate the 8B/128 row's
  root unit (gathered before the forward, reduced after the backward,
  ``plan.fsdp2_root``) would be exposed about 13 ms longer, 0.5% of its step.
- The single-GPU compute under these rows, held to component measurements (later): on
  the H100 the planner's one-GPU step of a 1.7B GPT is the measured one
  (``benchmarks/gpu_step.py --compare``: 0.3925 / 0.3927 s) and its Llama 3 8B layer 0.93
  of the measured plain-PyTorch layer (``tests/test_measured.py``); on the A100 the layer
  holds Korthikanti's Table 4 within 3%, and the GEMM shape model it relies on (tile and
  wave quantization from one large product's rate) errs both ways against the H100's 240
  measured layer GEMMs (median measured / model 1.03), so neither explains 1.07 .. 1.19.
  The A100's fp32 loss now runs at the H100's measured rate scaled by the HBM bandwidths
  (``parallel/ops_table/loss_pricing.py``; it was priced 3.9x faster): Llama 3 8B 1.163 ->
  1.155, the others by 0.002 at most.  Still unpriced, without an A100 source: the power
  cap of the cluster (Touvron et al. 2023, "Llama 2", sec. 2.2.1: 400 W on RSC, 350 W in
  production; which ran these rows is not stated; the MAMF table's A100 PCIe, a 300 W
  part, reads 0.93 .. 0.96 of the 400 W SXM's best burst), FSDP2's eager host overhead.
- The eager kernels' rate (2026-11-29, ``plan.eager_rates``): ``titan_eager`` priced each
  counted kernel at the plain memory rate, 1.17-2.11x faster than Liger-Kernel's
  published benchmarks of the same eager RMSNorm and RoPE code ran on A100s (and an H100
  NVL); at the measured rates the rows read 1.079 .. 1.160 (median 1.122; were 1.100 ..
  1.191, 1.145): the 8B rows 1.079 / 1.130 (H100), 1.133 (A100), the 13B 1.155 / 1.160,
  the 70Bs 1.105 .. 1.113.  What else torchtitan runs per step, checked and priced or
  negligible: ``benchmarks/torchtitan_breakdown.py``'s docstring.
- torchtitan's Triton RMSNorm (``fused_rmsnorm``, the 13B and Llama 3 8B A100 rows'
  configs; 2026-11-29, ``plan.eager_rates``): priced at the rates Liger-Kernel's RMSNorm of
  the same design reached on A100s (0.69 / 0.56 of the datasheet bandwidth forward /
  backward) instead of the plain 0.88: Llama 3 8B 1.133 -> 1.130, Llama 2 13B 1.155 ->
  1.152 and 1.160 -> 1.157.  The host's time (FSDP2's hooks, the SAC dispatch mode, the
  DTensor optimizer) read against published figures: hidden behind the GPU but for about
  a millisecond a step, the optimizer's not priced (``benchmarks/torchtitan_breakdown.py``'s
  docstring).
- Full AC's recompute, read from the pairs of rows that differ only in recompute and
  local batch (``benchmarks/torchtitan_breakdown.py``, "The pairs' relative errors",
  2026-11-28): torchtitan's non-reentrant checkpoint stops its recompute before w2's GEMM
  (early stop), which the planner had priced for the course's recipe only; priced for
  ``framework="fsdp"`` too, the Llama 2 70B pair (op at local batch 1 over full at 2)
  reads 1.008 against the measured 1.006 (was 1.068), the full rows 1.129 / 1.136 (were
  1.066 / 1.076): the A100 rows 1.129 .. 1.191, whatever their recompute.
- The two 13B rows beyond 15% (2026-11-29, titan14; ``benchmarks/torchtitan_breakdown.py``,
  its titan14 section): they lack 6.7 ms (none) and 21.8 ms (op) a step, 0.2% / 0.6% of
  the predicted step.  Their recompute, read against the 13B's "selective layer" row of the
  same table (1,914 WPS, not a planner row), runs 1.2x its price for both kinds (op 0.513
  s published against 0.431 priced, layer 0.491 against 0.408), so the op row's gap is
  not op-SAC's own; one factor on every GEMM (0.83 of the profile's rate) would take
  both 13B rows to their published steps and the other A100 rows need 0.84 .. 0.88: no
  A100 GEMM measurement at the clusters' 350 W cap or under sustained load was found, so
  nothing is priced and no row moved.

Left out, for want of what the planner prices or of a pinned configuration:

- every torch.compile row (Tables 1 and 3 rows 2-3, Tables 2, 4, 5, 6; the async-TP
  tables of ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``, all compiled; the
  H200 rows of ``llama3-8b_h200_202506_trainy-whitefiber.md``, compiled with Float8, on a
  GPU without a profile here): the planner has no model of what Inductor fuses;
- Float8 (torchao's dynamic float8 linears, tensorwise / rowwise, Float8 all-gather):
  ``estimate(fp8=True)`` prices Transformer Engine's recipe, not torchao's; every Float8
  row is compiled too;
- "selective layer" checkpointing (``selective_ac_option = '2'``, every second block):
  the planner checkpoints every block or none (A100: 8B at 2,904, 13B at 1,914 WPS;
  the 70B at local batch 2 "OOM");
- docs/performance.md of 2024-08 (0809984f5): Llama 3.1 405B on 128 H100 (2D, "94GB"):
  its config (``llama3_405b.toml``) sets ``compile = true`` and async TP, so the row
  headed "Optimizations: None" may have run compiled: not pinned.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import workbench as wb  # noqa: E402

TT = "pytorch/torchtitan"
H100_CITE = (f"{TT} benchmarks/llama3_h100_202412_torchtitan.md (820504e20; runs of 2024-12, "
             f"torchtitan 9dec370ad2), Tables 1 and 3, 'FSDP' rows")
A100_CITE = (f"{TT} docs/performance.md (eb6aa6389 2024-04-16: Llama 2; 1ea476e9f "
             f"2024-04-24: Llama 3), FSDP2 on 64 A100 80GB")
CITE = f"{H100_CITE}; {A100_CITE}"
LABEL = "tokens per second per GPU (torchtitan's TPS/GPU, 'WPS')"
_FSDP = ("torchtitan's FSDP2 (fully_shard per block, bf16 params, fp32 reduce), eager "
         "(compile = false), SDPA's FlashAttention-2")
_H100_ASSUME = (f"{_FSDP}; sequence 8192 and op-level SAC from llama3_8b.toml (9dec370ad2); "
                f"norm_type rmsnorm (eager); profile h100-hbm2e: peak between NVL and SXM "
                f"(the midpoint ASSUMED, both ends in the range)")
_A100_ASSUME = (f"{_FSDP}; local batch and checkpointing from the doc's table, sequence and "
                f"norm_type from the configs of its commit (the 70Bs' configs are 2D runs': "
                f"their norm_type ASSUMED for the 1D rows); "
                f"the A100 cluster's network UNCERTAIN: priced as the a100 profile's DGX "
                f"A100 (one 200 Gb/s HDR port per GPU, RSC's fabric; which of Meta's two "
                f"A100 clusters ran the rows is not stated, both with 200 Gbps endpoints); "
                f"benchmarks/torchtitan_breakdown.py --needed prints the bus bandwidth each "
                f"row's gap would need beside the priced one")


# torch 1963fc83a1 (2024-12-23, the H100 runs' own): SDPA's priority puts FlashAttention-2
# first on the H100 (cuDNN opt-in since pytorch/pytorch#138522, 2024-10, until 2.9;
# plan.fsdp2_cost), so the range's fast end keeps it rather than the h100 profile's
# cuDNN bound, which that release did not run
_SDPA_PINNED = {"measured.attention_backend": "flash"}


def _row(name, preset, seq, devices, mbs, recompute, tps, profile, cite, assume,
         mfu=None, norm=None, memory_gib=None):
    pinned = _SDPA_PINNED if profile == "h100-hbm2e" else None
    return dict(source="torchtitan", name=name, preset=preset, profile=profile, pinned=pinned,
                devices=devices, model=dict(seq_len=seq),
                layout=dict(dp=devices, zero=3, recompute=recompute, micro_batch=mbs,
                            global_batch=mbs * devices, framework="fsdp"),
                attention="flash", estimate_args=dict(torchtitan_eager=norm),
                metric="tokens_per_device", published=tps,
                published_hfu=None, published_mfu=mfu, norm_type=norm, cite=cite,
                published_memory_gib=memory_gib,
                assume=assume + (f"; norm_type {norm}" if norm else ""))


# benchmarks/llama3_h100_202412_torchtitan.md: table, GPUs, local batch, TPS/GPU, and its
# Memory(GiB) column (train.py's logged max_reserved_gib, the caching allocator's peak)
H100_ROWS = [("Table 1", 8, 2, 5762.0, 82.4), ("Table 3", 128, 2, 5605.0, 67.0)]
# docs/performance.md (eb6aa6389 / 1ea476e9f): name, preset, sequence, local batch,
# recompute, WPS, MFU %, the config's norm_type
A100_ROWS = [("Llama 3 8B", "llama3-8b", 8192, 1, "op", 2973.0, 58.2, "fused_rmsnorm"),
             ("Llama 3 70B", "llama3-70b", 8192, 1, "full", 331.0, 51.7, "rmsnorm"),
             ("Llama 2 13B", "llama2-13b", 4096, 2, "none", 2162.0, 61.1, "fused_rmsnorm"),
             ("Llama 2 13B", "llama2-13b", 4096, 2, "op", 1904.0, 53.8, "fused_rmsnorm"),
             ("Llama 2 70B", "llama2-70b", 4096, 1, "op", 355.0, 50.8, "rmsnorm"),
             ("Llama 2 70B", "llama2-70b", 4096, 2, "full", 353.0, 50.5, "rmsnorm")]

ROWS = [_row("Llama 3.1 8B", "llama3-8b", 8192, gpus, mbs, "op", tps, "h100-hbm2e", CITE,
             f"{table}; {_H100_ASSUME}", norm="rmsnorm", memory_gib=mem)
        for table, gpus, mbs, tps, mem in H100_ROWS] + [
    _row(name, preset, seq, 64, mbs, rc, tps, "a100", CITE, _A100_ASSUME, mfu, norm)
    for name, preset, seq, mbs, rc, tps, mfu, norm in A100_ROWS]

# eb6aa6389's table: "70B | 2 | selective op | OOM | OOM" on 64 A100 80GB
OOM_ROWS = [_row("Llama 2 70B OOM", "llama2-70b", 4096, 64, 2, "op", None, "a100",
                 f"{TT} docs/performance.md (eb6aa6389): 70B, batch 2, selective op: OOM",
                 _A100_ASSUME, norm="rmsnorm")]

NOTE = ("torchtitan's FSDP2 rows without torch.compile or Float8 (module "
        "published_torchtitan: what is left out and why); H100 rows on profile "
        "h100-hbm2e (96 GB HBM2e, 2.4 TB/s, 500 W; the compute peak between NVL and SXM: "
        "the midpoint ASSUMED, the range spans both; SDPA's FlashAttention-2 at both ends, "
        "as torch 1963fc83a1 ran it; 400 Gb/s RDMA per GPU as stated, the fabric not "
        "named), A100 rows on the a100 profile (network UNCERTAIN: 200 Gb/s per GPU as "
        "RSC's DGX A100s, the cluster not stated; the bus bandwidth each row's gap would "
        "need: benchmarks/torchtitan_breakdown.py --needed); tokens per second per GPU as "
        "torchtitan logs them")


def estimate(row):
    """The planner's estimate of ``row`` (``published.build``'s model, layout and cluster)."""
    cfg = wb.plan.presets.get_config(row["preset"], **row["model"])
    cl = wb.plan.Cluster(row["profile"], row["devices"])
    return wb.plan.estimate(cfg, wb.plan.Layout(**row["layout"]), cl,
                            attention=row["attention"], **row["estimate_args"])


def oom_lines() -> list[str]:
    """The out-of-memory verdicts, as ``published.py`` prints them."""
    out = [f"\n{TT} docs/performance.md (eb6aa6389): layouts reported out of memory"]
    for row in OOM_ROWS:
        e = estimate(row)
        flag = "" if not e.fits else "  <- disagrees (called fitting)"
        out.append(f"  {row['name']:<18}{e.layout.short():<44}{e.memory['total'] / 1e9:7.1f} GB"
                   f" of {e.details['usable_memory'] / 1e9:.1f} usable  fits {e.fits}{flag}")
    return out


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from published import predict, summary   # noqa: E402  (the shared comparison)
    res = [predict(r) for r in ROWS]
    for r in res:
        row = r["row"]
        print(f"{row['name']:<14}{row['profile']:<11}{row['devices']:>4}  "
              f"{r['estimate'].layout.short():<42}{row['published']:8.0f}"
              f"{r['predicted']:8.0f}{r['ratio']:7.3f}  {r['low']:.0f} .. {r['high']:.0f}")
    s = summary(r["ratio"] for r in res)
    print(f"ratio median {s['median']:.3f}, range {s['min']:.3f} .. {s['max']:.3f}")
    print("\n".join(oom_lines()))


if __name__ == "__main__":
    main()
