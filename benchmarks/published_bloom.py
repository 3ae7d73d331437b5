"""BLOOM-176B's published runs (BigScience, Jean Zay, 2022) beside the planner.

    PYTHONPATH=. python benchmarks/published_bloom.py      # this block alone, a few seconds

A source of ``benchmarks/published.py`` (which imports ``ROWS``, ``OOM_ROWS``, ``NOTE``,
``LABEL`` and prints :func:`memory_lines`): held out as the others are; nothing in the
profiles or the planner is tuned to these figures.  Source: the BigScience repository,
bigscience-workshop/bigscience (9e64edec2a, 2024-07-29):

- ``train/tr11-176B-ml/README.md`` and ``tr11-176B-ml.slurm``: the run that trained
  BLOOM-176B on 48 nodes of 8 A100 80GB (Jean Zay, 4 Omni-Path links per node: profile
  ``a100-jeanzay``): TP 4, PP 12, DP 8, micro-batch 2, global batch 2,048, 70 layers,
  hidden 14,336, 112 heads, sequence 2,048, vocabulary padded to 250,880
  (``--pad-vocab-size-to``), ``--bf16``, ``--checkpoint-activations`` with
  ``--deepspeed-activation-checkpointing`` (full recompute, no partitioned activations),
  ZeRO stage 0 in the DeepSpeed config because "BF16_Optimizer implements its own ZeRO
  Stage 1" (``framework="deepspeed"``, ``zero=1``, ``plan.bf16_optimizer``), ``--pp-partition-
  method 'type:transformer|embedding'``: "pp rank 0: [embed | 5 transformer blocks] ...
  pp rank 11: [5 transformer blocks | embed]" (``stages=(5, 6, ..., 6, 5)``), tied
  embeddings, ALiBi, an embedding LayerNorm, dropout 0.1 (Megatron's defaults,
  "inherited"), ``CUDA_LAUNCH_BLOCKING=1``.  Measured: the log line of the first epoch's
  end, "iteration 85376 ... elapsed time per iteration (s): 104.70 ... TFLOPs: 149.77".
  The TFLOPs are hardware FLOPs with the recomputed forward (math/README.md, "Calculate
  TFLOPs": the 4 x 2 coefficient; Megatron-DeepSpeed PR 251, Narayanan et al.'s eq. 3):
  eq. 3 at 104.70 s gives 149.76, ``Estimate.tflops_per_device``'s count.
- ``train/tr11-176B-ml/chronicles-prequel.md``, "Rebalancing layers" (2022-02-28): the
  same cluster, "from now on the testing is happening with BF16 optimizer" and the
  embedding partitioned as a layer; the table "NHIDDEN=14336; NLAYERS=70" (the final
  shape) gives per layout the memory ("Mem"), seconds per iteration and TFLOPs; its
  tables for NHIDDEN=12288 / NLAYERS=100 and NHIDDEN=14336 / NLAYERS=82 list layouts
  that ran out of memory.  Measured at iteration 2 ("I take the snapshot of a single
  iteration (always 2nd)"), global batch 2,048, the TFLOPs formula of PR 251 (in use
  since 02-21, "TFLOPs calculation improved").
- the same file, "GBS Variations" (2022-02-25): fp16 (before the BF16 optimizer), ZeRO-1,
  the embedding beside the first and last stages' layers, NHIDDEN=14336 / NLAYERS=72 /
  NHEADS=64: three layouts reported "OOM".

"Mem" is what ``nvidia-smi`` showed on the first node ("was quickly getting the memory
snapshot with: pdsh -w jean-zay-iam01 ... nvidia-smi"; the 02-17 tables: "max memory
used by the first (last) nodes with the word embedding matrix"): the caching allocator's
reserved memory plus the CUDA context, of the ranks of pipeline stage 0 (Megatron-
DeepSpeed's rank order puts tp x dp = 32 consecutive ranks, 4 nodes, on stage 0).  It is
compared with the planner's stage-0 reserved memory plus the profile's context (1,573
MiB, measured by BigScience on a 40GB A100): the live peak plus the segment PyTorch
1.11's caching allocator keeps for BF16_Optimizer's bf16 gradient copy at the DP sync
(``plan.allocator``: 2 bytes per parameter in one block, larger than any block freed
before it), so a ratio below 1 is what the fragmentation of the other cached segments
leaves (not measured, not counted).  ASSUMPTION: "GB" there is nvidia-smi's MiB / 1024
(GiB); read as 1e9 bytes the ratios rise by 7.4%.

What the comparison says (measured when this module was written; ``tests/
test_published_bloom.py`` guards the spread, never a target):

- time: 1.032 .. 1.198 (median 1.064; the final run 1.063).  The network: the cluster's
  all-reduce benchmark (January 2022, 40.54 Gbps bus bandwidth) ran, by NCCL's own log
  in the same file, 2 ring channels through ONE Omni-Path adapter per direction per
  node (GPU 0 <- NET/IB/1, GPU 7 -> NET/IB/3): 0.405 of one adapter, where the profile
  used to read it as 0.101 of the node's four (bloom3; before: 0.758 .. 0.917, median
  0.782, every row pessimistic).  At 0.405 one activation crossing a stage boundary
  costs 11.6 ms (two GPUs per adapter; 4 per micro-batch on a middle stage: 48 of its
  671 ms), the DP sync 4.2 s and the fp32 tied-gradient all-reduce 1.4 s; the layers'
  compute is 595 ms per micro-batch.  The range's fast end is the 0.846 the same NCCL
  reached on one adapter of the cluster's V100 nodes the same day (4 ring channels);
  the run may have been slower than 0.405 where it lost (DP rings of the node's 4 TP
  ranks sharing adapters as NCCL picks them, CUDA_LAUNCH_BLOCKING=1's launch gaps): not
  sourced, not priced.  The TP 8 row (1.198) is the one beyond 15%.
- memory: stage 0's reserved memory plus the context is 0.923 .. 0.988 of nvidia-smi's
  reading (0.915 .. 0.984 before ds12 counted what the pipeline engine holds beyond the
  layers, below; 0.812 .. 0.855 with the live peak alone, before ``plan.allocator``;
  0.767 .. 0.827 before bloom3 counted DeepSpeed's partitioned pipeline outputs and the
  embedding LayerNorm's saved input).  What the planner counts there (final layout,
  GiB): bf16 weights 7.5, bf16 gradients 7.5, Adam on the 1/8 partition 5.6,
  BF16_Optimizer's fp32 gradients 14.9, NCCL 1.2 (``plan.comm_memory``: the cluster's own
  NCCL 2.10.3 log, 2 channels across nodes, no GPUDirect RDMA, rings and trees connected
  at init; the TP group and DeepSpeed's slice group 0.56 each), activations 8.9 (12
  micro-batches in flight: 5 layer inputs, the embedding's dropout mask, the input its
  LayerNorm saves, bigscience-workshop/Megatron-DeepSpeed b1359ee0 ``--embed-layernorm``:
  ``ModelConfig.embed_norm``, and the engine's 1/4 output partition; the 13 pipe
  buffers' loaded tokens, positions and 4 MiB causal mask, 0.05, and the 1/4 slice its
  gradient is received into, 0.03: ``plan.deepspeed_pipe_memory``), the embedding gradient's fp32 cast in ``update_hp_grads`` 3.4 beside the
  micro-batch's restored output and rebuilt gradient the engine holds until after it,
  0.22 (DeepSpeed 56c522386 ``_exec_backward_pass``: ``deepspeed_pipe_memory.
  backward_held_bytes``); and the allocator's cached segment for the DP sync's bf16
  copy of the fp32 gradients, 7.5 (made after the pipeline's activations are freed, but
  no freed block is as large: ``torch`` 1.11 does not merge blocks of different
  segments, so it is a cudaMalloc of its own, kept cached).  Not counted: the
  fragmentation of the segments the activations and the per-tensor bf16 weights
  BF16_Optimizer frees when it flattens them (8 GB) leave, the layers' backward's
  activation-gradient temporaries (no source gives their peak).  The prequel's other
  shapes (195B, 184B, 178B, 203B, 12 rows with a reading) go from 0.807 .. 0.856 to
  0.928 .. 0.988 alike; the micro-batch-4 rows are the lowest (0.923 here), as
  fragmentation that grows with the activations would leave.  The last stage also keeps
  the fp32 logits of its two pipe buffers' latest micro-batches (GPTModelPipe ends in
  ``float16_to_fp32``; its loss works in place on that tensor; the last stage's
  backward never clears its output buffer): 1.9 GiB more at its loss and its DP sync,
  on a stage that is not the busiest here.
- out of memory: 5 of the 6 layouts reported OOM are called not fitting.  The 206B
  (NHIDDEN=14336, NLAYERS=82, 128 heads, DP 8, TP 4, PP 12, micro-batch 2) is called
  fitting, 56.0 GiB live on its busiest rank (stage 0) of 73.8 usable.  Its shape is the
  table's (``NHIDDEN=14336; NLAYERS=82; Model size: 206B``: 82 (12 h^2 + 13 h) + V h
  with V = 250,880 is 205.8e9; stages (82 + 2) / 12 = 7 slots, so [6, 7, .., 7, 6]);
  128 heads are 32 a rank, (32 x 2) % 4 == 0: Megatron's fused softmax runs as in the
  rows that ran.  The same table's neighbours rule out any per-parameter or
  per-activation term: the 203B (NHIDDEN=13312, NLAYERS=94: 4.56e9 parameters on stage
  0 where the 206B has 4.60e9, the same 128 heads, 32 a rank) ran at 67 GB and the 195B
  at micro-batch 4 at 79 GB; the planner prices the 203B's and the 206B's stage 0 alike
  (65.9 and 66.2 GiB reserved with the context, every other stage within 1.5%), so a
  term that took the 206B past 79.25 GiB would take the 203B and the 195B mb4 past it
  too.  Read for it, at the commits the rows ran (DeepSpeed 56c522386; bigscience-
  workshop/Megatron-DeepSpeed b1359ee0; torch 1.11's caching allocator) and found
  either counted, too small, or not at the peak: the pipeline engine's buffers
  (``num_pipe_buffers`` = min(pp - stage + 1, m): partitioned outputs, loaded inputs,
  the persistent ``grad_layer`` and ``pipe_recv_buf`` of 1/t slices, the restored output
  and gradients in backward: counted since ds12, 0.30 GiB on stage 0); the attention
  mask (built once into ``args.attn_mask``, not sent between stages); the fp32 tied
  embedding gradient (a view into BF16_Optimizer's flat fp32 buffer, all-reduced in
  place by ``ReduceTiedGrads``); the ZeRO-1 all-gather (``all_gather_dp_groups``' 5e8-
  element shards, the ds_config sets no bucket size: its flat 1 GB temporary falls in
  the sync's cached 2 psi segment, freed by then); ``buffered_allreduce_fallback``'s
  one-tensor bucket (a view; its bf16 cast is the counted sync copy); the loss's fp32
  logits at V / 4 = 62,720 (the last stage, 50-52 GiB here); NCCL (counted from the
  cluster's log); allocator fragmentation (an ASSUMPTION kept back from the usable
  memory, 5% in a100-jeanzay.json, not moved to flip a row); torch 1.11 releases cached segments before it
  reports out of memory, so they do not decide ``fits``.  The OOM is reported, not
  fitted (``tests/test_published_bloom.py``: xfail, strict).  The 79 GB reading of a run
  that ran also says the card holds more than the datasheet's 80 GB read as 8e10
  bytes: the profile's ``memory_bytes`` is the 79.25 GiB CUDA reports (a100-jeanzay.json;
  usable 73.8 GiB, 69.2 with 8e10 B); the closest OOM row, the 181B dp32-tp2-pp6-mb1,
  is 75.3 GiB live: not fitting either way.

Left out: the 24-node phase after 2022-07-04 (DP 4; no throughput published for it),
the batch-size ramp-up figures (8 TFLOPs at batch 16: a pipeline never filled), the
TFLOPs of the prequel's other model shapes (heads and layers per stage differ from the
final model's; their fused-softmax constraints moved TFLOPs by up to 30% between head
counts, which the planner does not model: their memory readings are ``MEMORY_ROWS``,
compared as the final shape's) and its fp16 / 02-17..02-27 tables (a different
optimizer and partitioning: only their OOM verdicts are used).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import workbench as wb  # noqa: E402

BIGSCIENCE = "bigscience-workshop/bigscience (9e64edec2a)"
CITE = (f"{BIGSCIENCE} train/tr11-176B-ml/README.md (final run, iteration 85376) and "
        f"chronicles-prequel.md (2022-02-28 'Rebalancing layers'; 2022-02-25 OOM rows)")
LABEL = "achieved TFLOP/s per GPU (hardware, with recompute: eq. 3)"
VOCAB = 250880                          # --pad-vocab-size-to 250880
_ASSUME = ("bf16, BF16_Optimizer (DeepSpeed's own ZeRO-1, plan.bf16_optimizer), full "
           "recompute, embedding partitioned as a layer, tied embeddings, dropout 0.1, "
           "the embedding LayerNorm (--embed-layernorm: ModelConfig.embed_norm; the final "
           "run's slurm, ASSUMED for the 02-28 rows, whose flags the text does not list); "
           "ALiBi priced as learned positions (ASSUMPTION: well under 1% of a stage's "
           "work)")


def _stages(n_layer: int, pp: int) -> tuple:
    """'type:transformer|embedding': the two embeddings weigh as layers, so each stage
    holds (n_layer + 2) / pp slots and the first and last give one to the embedding."""
    per = (n_layer + 2) // pp
    if per * pp != n_layer + 2:
        raise ValueError(f"n_layer + 2 = {n_layer + 2} does not split over pp={pp}")
    return (per - 1,) + (per,) * (pp - 2) + (per - 1,)


def _row(name, h, l, a, dp, tp, pp, mbs, tflops, mem_gib, cite, gbs=2048, dtype="bfloat16",
         stages=True, assume=_ASSUME):
    return dict(source="bloom", name=name, profile="a100-jeanzay", devices=dp * tp * pp,
                model=dict(d_model=h, n_layer=l, n_head=a, dtype=dtype, vocab_size=VOCAB,
                           embed_norm=assume is _ASSUME),
                layout=dict(dp=dp, tp=tp, pp=pp, sp=False, zero=1, recompute="full",
                            micro_batch=mbs, global_batch=gbs, schedule="1f1b", v=1,
                            framework="deepspeed",
                            stages=_stages(l, pp) if stages and pp > 1 else None),
                metric="tflops_per_device", published=tflops, published_hfu=None,
                published_mem_gib=mem_gib, cite=cite, assume=assume)


_FINAL = f"{BIGSCIENCE} train/tr11-176B-ml/README.md, iteration 85376: 104.70 s, 149.77 TFLOPs"
_P0228 = f"{BIGSCIENCE} train/tr11-176B-ml/chronicles-prequel.md, 02-28, NHIDDEN=14336; NLAYERS=70"
# chronicles-prequel.md, 02-28, NHIDDEN=14336 / NLAYERS=70: DP, TP, PP, MBS, NHEADS, Mem
# (GB), sec/it, TFLOPs
PREQUEL_0228 = [(4, 8, 12, 2, 64, 40, 121.63, 128.92), (8, 4, 12, 2, 64, 59, 102.03, 153.68),
                (8, 4, 12, 2, 112, 59, 104.50, 150.05), (8, 4, 12, 2, 128, 60, 105.89, 148.08),
                (8, 4, 12, 4, 64, 73, 102.27, 153.33)]

# the same section's other shapes with a memory reading: name, NHIDDEN, NLAYERS, and per
# layout DP, TP, PP, MBS, NHEADS, Mem (GB), sec/it, TFLOPs (rows whose Mem is blank are
# left out)
PREQUEL_0228_SHAPES = [
    ("195B", 12288, 106, [(8, 4, 12, 2, 64, 67, 116.54, 149.75),
                          (8, 4, 12, 2, 96, 65, 118.79, 146.90),
                          (8, 4, 12, 2, 128, 67, 121.42, 143.73),
                          (8, 4, 12, 4, 96, 79, 120.34, 145.01)]),
    ("184B", 12288, 100, [(8, 8, 6, 2, 64, 61, 139.72, 117.91),
                          (8, 8, 6, 4, 64, 72, 120.96, 136.20)]),
    ("178B", 13312, 82, [(4, 8, 12, 4, 64, 52, 111.79, 141.76),
                         (8, 4, 12, 2, 64, 63, 104.45, 151.71),
                         (8, 4, 12, 2, 104, 62, 123.71, 128.10),
                         (8, 4, 12, 2, 128, 60, 108.78, 145.68),
                         (8, 4, 12, 4, 64, 74, 104.82, 151.18)]),
    ("203B", 13312, 94, [(8, 4, 12, 2, 128, 67, 124.10, 146.12)])]

ROWS = [_row("BLOOM 176B", 14336, 70, 112, 8, 4, 12, 2, 149.77, None, _FINAL)] + [
    _row(f"176B a{a}-tp{tp}-mb{mbs}", 14336, 70, a, dp, tp, pp, mbs, tflops, mem, _P0228)
    for dp, tp, pp, mbs, a, mem, _, tflops in PREQUEL_0228]

# memory readings only (not in the time comparison: module docstring)
MEMORY_ROWS = [_row(f"{n} a{a}-dp{dp}-tp{tp}-mb{mbs}", h, l, a, dp, tp, pp, mbs, tflops, mem,
                    f"{BIGSCIENCE} train/tr11-176B-ml/chronicles-prequel.md, 02-28, "
                    f"NHIDDEN={h}; NLAYERS={l}")
               for n, h, l, rows in PREQUEL_0228_SHAPES
               for dp, tp, pp, mbs, a, mem, _, tflops in rows]

_OOM = f"{BIGSCIENCE} train/tr11-176B-ml/chronicles-prequel.md"
_FP16 = ("fp16 with DeepSpeed's ZeRO-1 (02-21: ZS=1), before the BF16 optimizer; the "
         "embedding beside the first and last stages' layers (partitioning "
         "'type:transformer', the rebalancing came 02-28): ASSUMED from the text's order; "
         "no embedding LayerNorm (ASSUMED: the 02-25 flags are not listed)")
# layouts the prequel reports "OOM": name, hidden, layers, heads, DP, TP, PP, MBS, GBS, dtype
OOM = [("184B", 12288, 100, 64, 16, 4, 6, 2, 2048, "bfloat16"),     # 02-28
       ("184B", 12288, 100, 64, 16, 4, 6, 1, 2048, "bfloat16"),     # 02-28
       ("206B", 14336, 82, 128, 8, 4, 12, 2, 2048, "bfloat16"),     # 02-28
       ("181B", 14336, 72, 64, 48, 8, 1, 1, 2016, "float16"),       # 02-25
       ("181B", 14336, 72, 64, 32, 2, 6, 2, 2048, "float16"),       # 02-25
       ("181B", 14336, 72, 64, 32, 2, 6, 1, 2048, "float16")]       # 02-25
OOM_ROWS = [_row(f"{n} OOM dp{dp}-tp{tp}-pp{pp}-mb{mbs}", h, l, a, dp, tp, pp, mbs, None, None,
                 f"{_OOM}, {'02-28' if dt == 'bfloat16' else '02-25'}", gbs=gbs, dtype=dt,
                 stages=dt == "bfloat16", assume=_ASSUME if dt == "bfloat16" else _FP16)
            for n, h, l, a, dp, tp, pp, mbs, gbs, dt in OOM]

NOTE = ("the final run's log line and the 2022-02-28 prequel rows at the final shape "
        "(iteration 2, CUDA_LAUNCH_BLOCKING=1 as the hang workaround); " + _ASSUME
        + "; on profile a100-jeanzay: NCCL over Omni-Path at the efficiency the "
        "cluster's own all-reduce benchmark measured on one adapter (0.405 of its line "
        "rate, January 2022, rings through one adapter per direction as NCCL's log "
        "shows; the range's fast end 0.846, the V100 nodes'); Megatron-DeepSpeed's "
        "pipeline as DeepSpeed v0.5.4's "
        "engine (plan.deepspeed_pipe) with the BF16_Optimizer of DeepSpeed 56c522386")


def memory(row) -> dict:
    """The planner's memory of ``row`` on pipeline stage 0 (the ranks whose memory the
    prequel read): ``predicted`` (its reserved memory, ``plan.allocator.reserved_bytes``:
    the pipeline phase's live peak plus the caching allocator's cached segment ``cache``,
    plus the profile's CUDA context, bytes; None where the allocator is not modelled: the
    fp16 rows, which run DeepSpeed's FP16_Optimizer, not BF16_Optimizer),
    ``live`` (the live peak plus the context), ``measured`` (the Mem column in bytes, GiB
    read) or None, their ratio, and ``fits`` (the busiest rank's live peak)."""
    cfg = wb.models.ModelConfig(**{**dict(arch="gpt", seq_len=2048, tie_embeddings=True,
                                          dropout=0.1), **row["model"]})
    cl = wb.plan.Cluster(row["profile"], row["devices"])
    est = wb.plan.estimate(cfg, wb.plan.Layout(**row["layout"]), cl)
    first = est.details["stages"]["first" if row["layout"]["pp"] > 1 else "only"]
    # reserved: the pipeline phase's live peak plus the caching allocator's cached segment
    # for BF16_Optimizer's bf16 gradient copy (plan.allocator), then the CUDA context
    live = first["memory"]["total"]
    reserved = first["reserved_memory"]            # None: not modelled (plan.allocator)
    pred = None if reserved is None else reserved + cl.profile.runtime_memory["context_bytes"]
    gib = row.get("published_mem_gib")
    meas = None if gib is None else gib * 2 ** 30
    return dict(row=row, estimate=est, predicted=pred, measured=meas, fits=est.fits,
                live=live + cl.profile.runtime_memory["context_bytes"],
                cache=first["allocator_cache"],
                ratio=None if meas is None or pred is None else pred / meas,
                busiest=est.memory["total"], usable=est.details["usable_memory"])


def memory_lines() -> list[str]:
    """The memory comparison and the OOM verdicts, as ``published.py`` prints them."""
    out = [f"\n{CITE}\n  memory: the planner's stage-0 reserved memory (live peak + the "
           f"caching allocator's cached sync segment, plan.allocator) + CUDA context "
           f"against nvidia-smi ('Mem', GiB read); fits: the busiest rank's live peak "
           f"within the usable memory; predicted '-': the allocator not modelled "
           f"(FP16_Optimizer rows)"]
    out.append(f"  {'row':<29}{'layout':<52}{'Mem':>6}{'predicted':>10}{'ratio':>7}"
               f"{'busiest':>9}  fits  published")
    for row in ROWS + MEMORY_ROWS + OOM_ROWS:
        m = memory(row)
        if row["published_mem_gib"] is None and row["published"] is not None:
            continue                         # the final run: no memory published
        meas = f"{m['measured'] / 2 ** 30:5.0f}G" if m["measured"] else "   OOM"
        ratio = f"{m['ratio']:7.3f}" if m["ratio"] else "       "
        ok = "ran" if row["published"] is not None else "OOM"
        flag = "" if (m["fits"] == (ok == "ran")) else "  <- disagrees"
        out.append(f"  {row['name']:<29}{m['estimate'].layout.short():<52}{meas:>6}"
                   + (f"{m['predicted'] / 2 ** 30:9.1f}G" if m["predicted"] is not None
                      else f"{'-':>10}")
                   + f"{ratio}{m['busiest'] / 2 ** 30:8.1f}G  "
                   f"{str(m['fits']):<5} {ok}{flag}")
    return out


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from published import predict, summary   # noqa: E402  (the shared comparison)
    res = [predict(r) for r in ROWS]
    for r in res:
        print(f"{r['row']['name']:<12}{r['estimate'].layout.short():<52}"
              f"{r['row']['published']:8.2f}{r['predicted']:8.1f}{r['ratio']:7.3f}  "
              f"{r['low']:.1f} .. {r['high']:.1f}")
    s = summary(r["ratio"] for r in res)
    print(f"ratio median {s['median']:.3f}, range {s['min']:.3f} .. {s['max']:.3f}")
    print("\n".join(memory_lines()))


if __name__ == "__main__":
    main()
