"""Every kernel of one step, what the planner charges for it, and the component figure it
rests on: a per-kernel audit of two held-out rows that are optimistic.

    PYTHONPATH=$PWD python benchmarks/step_audit.py        # ~5 s

Rows (``benchmarks/published.py``): torchtitan's Llama 3.1 8B on 8 H100 (FSDP2, local
batch 2, sequence 8192, op-level SAC, eager; published 5,762 TPS/GPU) and the
Megatron-LM README's GPT 1.7B on 48 H100 (dp 48, micro-batch 1, four micro-batches,
distributed optimizer; published 408.8 model TFLOP/s per GPU).  For each, the script
prices the step's kernels family by family with the planner's own functions (the
layer's op list from ``layer_cost`` as ``estimate`` calls it, ``titan_eager``,
``fsdp2_cost``, ``edge_cost``, ``head_cost``, ``optimizer_step``, ``megatron_hook_add``)
and prints them, per step, beside the estimate's step and the published one.  Nothing
here feeds the planner.

What a real step runs, from the code of the runs (pytorch/torchtitan 9dec370ad2
``train.py``, ``torchtitan/models/llama/model.py``, ``torchtitan/utils.py``; the FSDP2 of
torch in December 2024; NVIDIA/Megatron-LM f2e5db402c ``pretrain_gpt.py``,
``megatron/core/tensor_parallel/cross_entropy.py``, ``megatron/core/optimizer/``), what
the planner charges for it (ms per step, this script's output of 2026-11-28, after the
Adam update moved to its measured rate) and the component figure the charge rests on.
"meas." = ``sim_mesh/measurements/h100-sxm-80gb.json`` (one H100 SXM at 700 W); the
torchtitan row's HBM2e card takes its rates x ``compute_scale`` 0.9221 (GEMMs,
attention) and x 2.4 / 3.35 (memory-bound kernels), both ASSUMED in
``profiles/h100-hbm2e.json``:

==========================================  =======  =======  ==============================
kernel (what runs it)                        8B / 8     1.7B  component figure; verdict
==========================================  =======  =======  ==============================
layer GEMMs: fwd, op-SAC recompute (wk,      1232.8    174.5  meas. ``model_gemms`` at the
wo, w3), dgrad, wgrad (Megatron: into                         layers' own shapes; priced
fp32 main_grad, read + write)
attention: SDPA's FlashAttention-2 (torch     461.1     61.3  meas. flash / cudnn rates at
1963fc83a1) / TE's cuDNN fused attention                      s 8192 / 4096, causal; priced
fused-block element-wise: norms, RoPE,        198.9     44.3  bytes at the copy rate (0.901
silu / GeLU, SwiGLU product, bias,                            of HBM, meas.); LayerNorm,
dropout, residual adds (fwd, rec., bwd)                       dropout at meas. rates;
                                                              priced
torchtitan's eager extras: RMSNorm as 8       400.0        -  aten ops counted by
kernels, RoPE in fp32 complex, repeat_kv,                     ``titan_eager``, bytes at the
the product's two gradients, the q/k/v                        copy rate; priced (one pass
and w1/w3 input-gradient sums                                 per op ASSUMED)
FSDP2 copy-out, reduce-scatter chunk-cat       66.8        -  meas. ``fsdp2_copies.py``;
(compute stream)                                              priced
output layer GEMMs: fwd, dgrad, wgrad          80.6     38.6  meas. GEMM grid; priced
final norm, fp32 cast, cross-entropy fwd       50.6     36.9  meas. pair (cast + CE, fwd +
+ bwd (torchtitan: F.cross_entropy(                           bwd) 58.3 G logits/s;
x.float()), train.py:131-134; Megatron:                       Megatron's CE: below; priced
vocab-parallel CE in fp32 torch ops)                          right
embedding lookup and dense backward             0.7      1.3  op table; the real backward
                                                              zero-fills the V x h gradient
                                                              (1.05 GB at 8B), sums
                                                              partials: < 0.5 ms more,
                                                              unpriced, negligible
Megatron DDP hook: param.grad added into          -      4.5  ``plan.megatron_hook_add``
main_grad (embeddings, norms, biases)                         (ddp:215-225); priced
clip_grad_norm_ (foreach norm + mul, a          5.6      9.7  bytes at the copy rate; the
scalar all-reduce) / Megatron's zero_,                        scalar all-reduces (tens of
NaN-check norm, *= 1/dp, l2norm, copies                       us) unpriced, negligible
AdamW: torch foreach (80 B per parameter       45.6      0.4  meas. fused AdamW 2,459.8
of the shard), TE FusedAdam (28 B)                            GB/s, 0.815 of the copy: was
                                                              at the copy's rate (8% cheap);
                                                              fixed (``optimizer_step``)
FSDP2 / DDP collectives left exposed           33.5      9.8  NCCL 2.21's tuning model;
                                                              priced (not audited here)
step: the estimate's                         2576.0    381.2  ratio 1.104 / 1.185
      the published                          2843.5    451.9
==========================================  =======  =======  ==============================

Megatron's cross-entropy (``_VocabParallelCrossEntropy``, f2e5db402c
``cross_entropy.py``) is priced at the rate measured for PyTorch's ``F.cross_entropy``
(``loss_pricing``, an ASSUMPTION there); its kernels, counted from the source, move
``MEGATRON_CE_BYTES`` per fp32 logit: forward the cast (:27, 2 + 4), ``max`` (:29, 4),
``-= logits_max`` (:43, 4 + 4), ``exp(out=)`` (:63, 4 + 4), ``sum`` (:64, 4), ``div_``
(:77, 4 + 4): 38; backward ``mul_(grad_output)`` (:113, 4 + 4) and autograd's cast of
the fp32 gradient to the bf16 logits (4 + 2): 14; the per-row gathers and
``index_put_`` are per token.  At the copy rate that is 9.25 ms for 4,096 x 131,072
logits on the H100, where the pair measured 9.20 ms (:func:`megatron_loss_check`): the
assumption holds within 1%.  (PyTorch's pair moves 36 B per logit by the same count,
at 0.70 of the copy rate: its softmax reads the row more than once.  Were Megatron's
simple passes as slow per byte, 13.3 ms: an upper bound, 16 ms per 1.7B step.)

Charged but not run, found reading the code (priced since: ``layer_cost.TE_SOURCES``,
``estimate(..., transformer_engine=True)`` for the README's rows, Megatron-LM's default
``--transformer-impl``): with Transformer Engine, the 1.7B's QKV bias is added in its
GEMM's epilogue and its gradient comes out of the weight-gradient GEMM (Megatron builds
``linear_qkv`` with ``skip_bias_add=False``, f2e5db402c
``megatron/core/transformer/attention.py:379-390``, so ``te_return_bias`` is False;
NVIDIA/TransformerEngine v1.8 ``pytorch/module/layernorm_linear.py:268-275`` passes the
bias to ``tex.gemm``, and ``:636-645`` takes ``grad_bias`` from the wgrad GEMM,
``cpp_extensions/gemm.py:213-247``), where the planner's op list (Megatron's own linear,
held to Korthikanti's Table 4) charges a ``qkv_bias_add`` and a ``qkv_bias_grad``
kernel: 0.052 ms per layer and micro-batch, 5.0 ms of the 1.7B step. Reading on
(TE_SOURCES), TE's path also copies q, k, v to contiguous bshd for its fused attention
(+3.5 ms; Megatron's ``TEDotProductAttention`` with the default ``apply_rope_fusion``)
and drops the context permute at micro-batch 1 (-2.3 ms): -3.8 ms net, ratio 1.173 ->
1.185 (the table above is after it; TE v1.8 ASSUMED, the runs' release is not stated).

Run per step but not priced, with what bounds each:

- host syncs: torchtitan reads ``loss.item()`` every 10th step only (``train.py:337``,
  ``metrics.log_freq``), but copies ``input_ids`` from pageable memory with a blocking
  ``.to(device_type)`` each step (``train.py:264-265``): the GPU drains once a step and
  waits for the first kernel the host issues next; Megatron asserts ``not loss[0].isnan()``
  every micro-batch (``pretrain_gpt.py:136-141``, on by default, ``arguments.py:1016``)
  and all-reduces two floats over the 48 data-parallel ranks on the compute stream
  (``pretrain_gpt.py:145``: 41 us by the planner's NCCL model, 0.16 ms a step; the
  clipping norm's scalar all-reduce over 8 ranks in torchtitan, 15 us); and before each
  gradient bucket's reduce-scatter in the last backward, ``assert not norm.isnan()`` on
  the bucket's norm (``megatron/core/distributed/param_and_grad_buffer.py:111-118``),
  a host sync per bucket of max(40M, 1M x dp) = 48M parameters
  (``distributed_data_parallel.py:51-54``): about 37 for the 1.7B.  A sync costs
  a launch latency plus the first kernels' host time (no measurement of that gap
  found; tens of us ASSUMED): 41 syncs a step, about 1-2 ms of the 1.7B's 452 ms, one
  a step of the 8B's 2.8 s; not priced;
- the data loader (torchtitan tokenizes on the host inside the loop, ``train.py:259``)
  runs while the GPU drains the previous step's queue, bar the sync above: not priced;
- the host's Python and dispatcher time per op: at 0.01 .. 10 ms of GPU time per kernel
  the host stays ahead in these rows (ASSUMPTION, not measured): not priced.

Reading.  Every kernel family these steps run is priced from a component figure; the two
charges re-derived here move the rows by 0.3% at most (Adam: 8B / 8 1.107 -> 1.104,
1.7B 1.174 -> 1.173; Megatron's cross-entropy: unchanged).  The optimism left (8B / 8:
0.27 s of 2.84 s; 1.7B: 0.067 s of 0.452 s) is not a forgotten kernel.  What cannot be
priced from a component figure here, by size: the 8B row's 500 W card, on which GEMMs
and attention are 69% of the step (1,774 ms) and are priced from a 700 W card that
sustained 683 TFLOP/s only at its power cap (``compute_scale`` is the datasheet peaks'
midpoint, not a 500 W measurement: the gap is 15% of that time); for the 1.7B, whose
one-GPU step in plain PyTorch the planner prices at the measured time
(``benchmarks/gpu_step.py --compare``: 0.3925 / 0.3927 s), what the 48-GPU run adds
beside the kernels: Transformer Engine's modules in place of plain PyTorch's (not
measured here), NCCL's reduce-scatter and all-gather sharing SMs and HBM with the last
backward and the first forward beyond ``overlap_rate``'s SM share, and the per-micro-
batch synchronisation of 48 ranks.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import published as P  # noqa: E402
from workbench.plan import costs as C  # noqa: E402
from workbench.plan import fsdp2_cost as FS  # noqa: E402
from workbench.plan import megatron_2021 as M21  # noqa: E402
from workbench.plan import optimizer_step as OS  # noqa: E402
from workbench.plan.edge_cost import edge_times  # noqa: E402
from workbench.plan.estimate import layer_for  # noqa: E402

ROWS = (("torchtitan", "Llama 3.1 8B", 8), ("megatron_h100", "GPT 1.7B", 48))
_COMM = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

# bytes read + written per fp32 logit by the kernels of Megatron-LM's vocabulary-parallel
# cross-entropy (f2e5db402c megatron/core/tensor_parallel/cross_entropy.py, line of each;
# per-row gathers and index_put_ left out: per token) and, counted alike, by PyTorch's
# pair the H100 file measured (the cast, aten _log_softmax, nll_loss_backward's zeroed
# gradient, _log_softmax_backward_data, the cast back)
MEGATRON_CE_BYTES = {"forward": {".float() (:27)": 2 + 4, "max (:29)": 4,
                                 "-= logits_max (:43)": 4 + 4, "exp(out=) (:63)": 4 + 4,
                                 "sum (:64)": 4, "div_ (:77)": 4 + 4},
                     "backward": {"mul_(grad_output) (:113)": 4 + 4,
                                  "autograd's cast to bf16": 4 + 2}}
PYTORCH_CE_BYTES = {"forward": {".float()": 2 + 4, "_log_softmax": 4 + 4},
                    "backward": {"nll_loss_backward (zeros)": 4,
                                 "_log_softmax_backward_data": 4 + 4 + 4,
                                 "autograd's cast to bf16": 4 + 2}}


def row(source: str, name: str, devices: int) -> dict:
    """The ``benchmarks/published.py`` row of that source, name and GPU count."""
    for r in P.ROWS:
        if r["source"] == source and r["name"] == name and r["devices"] == devices:
            return r
    raise ValueError(f"step_audit: no published row {source!r} {name!r} on {devices} GPUs")


def _per_logit(table) -> int:
    return sum(sum(v.values()) for v in table.values())


def megatron_loss_check(profile="h100", tokens: int = 4096, vocab: int = 131072) -> dict:
    """Megatron's cross-entropy priced from its kernels' bytes (``MEGATRON_CE_BYTES``) at
    the profile's copy rate, beside the pair's time the planner charges for it (the rate
    measured for PyTorch's, ``loss_pricing.cross_entropy_times`` plus the cast) and that
    pair's bytes (``PYTORCH_CE_BYTES``) over its measured time as a share of the copy
    rate; seconds for ``tokens`` x ``vocab`` logits."""
    from workbench.parallel.ops_table.loss_pricing import cross_entropy_rate
    from workbench.sim_mesh.profiles import get_profile
    prof = get_profile(profile)
    logits = tokens * vocab
    copy = prof.memory_bandwidth * prof.memory_efficiency
    pair = logits / cross_entropy_rate(prof)
    return {"megatron_at_copy_rate": _per_logit(MEGATRON_CE_BYTES) * logits / copy,
            "pair_charged": pair,
            "pair_share_of_copy_rate": _per_logit(PYTORCH_CE_BYTES) * logits / pair / copy,
            "megatron_at_pair_rate": pair * _per_logit(MEGATRON_CE_BYTES)
            / _per_logit(PYTORCH_CE_BYTES)}


def _layer_ops(cfg, lay, prof, attention, tp_comm_overlap, transformer_engine=False):
    """The op list ``estimate`` prices one layer with (``costs.layer_cost``, its cache
    bypassed, calls ``_layer_times`` once; its ops are read here)."""
    got = []
    inner, cached = C._layer_times, C.layer_cost

    def spy(*a, **k):
        lt = inner(*a, **k)
        got.append(lt)
        return lt
    C._layer_times, C.layer_cost = spy, cached.__wrapped__
    try:
        layer_for(cfg, lay, prof, attention, False, tp_comm_overlap,
                  transformer_engine=transformer_engine)
    finally:
        C._layer_times, C.layer_cost = inner, cached
    if len(got) != 1:
        raise RuntimeError(f"step_audit: layer_for priced {len(got)} op lists, expected 1")
    return got[0].ops


def audit(r) -> dict:
    """Seconds per step of each kernel family of row ``r`` (module docstring), with the
    estimate's step and the published one."""
    cfg, lay, cl = P.build(r)
    res = P.predict(r)
    est = res["estimate"]
    d, prof = est.details, cl.profile
    if lay.engine == "fsdp":
        prof = FS.sdpa_profile(prof)
    if lay.pp != 1 or lay.tp != 1:
        raise ValueError("step_audit: rows with tp = pp = 1 only (one stage, no TP ops)")
    m, n = d["micro_batches"], cfg.n_layer
    ops = _layer_ops(cfg, lay, prof, r.get("attention", "flash"),
                     r.get("tp_comm_overlap", False), r.get("transformer_engine", False))
    fam = {"layer GEMMs": 0.0, "attention": 0.0, "layer element-wise": 0.0,
           "TP collectives": 0.0}
    for o in ops:
        k = ("layer GEMMs" if o["op_class"] == "matmul" else
             "attention" if o["op_class"] == "attention" else
             "TP collectives" if o["op_class"] in _COMM else "layer element-wise")
        fam[k] += n * m * o["exposed"]
    eager = d.get("torchtitan_eager")
    fam["torchtitan eager extras"] = n * m * (eager["forward"] + eager["backward"]) \
        if eager else 0.0
    cp = d.get("fsdp2_copies")
    fam["FSDP2 copies (compute stream)"] = \
        m * (cp["forward"] + cp["backward"]) if cp else 0.0
    hd = C.head_cost(cfg, lay.micro_batch, lay.tp, lay.sp, prof)
    fam["output-layer GEMMs"] = m * (hd.fwd_compute + hd.bwd_compute)
    edge = edge_times(cfg, lay.micro_batch, lay.tp, lay.sp, prof)
    fam["final norm, fp32 cast, loss"] = m * sum(edge["last"])
    fam["embedding"] = m * sum(edge["first"])
    st = next(v for v in d["stages"].values() if v["stage"] == 0)
    fam["grad accumulation (DDP hook)"] = m * st["grad_accumulation"]
    psi, tensors = st["psi"], M21.TENSORS_PER_LAYER * max(n, 1)
    updated = psi / (lay.dp * lay.cp if lay.zero >= 1 else 1)
    table = d["optimizer_passes"]
    adam = [p for p in table if p.kernel]
    fam["optimizer: Adam"] = OS.step_seconds(adam, psi, updated, prof, tensors)
    fam["optimizer: other passes"] = OS.step_seconds(
        [p for p in table if not p.kernel], psi, updated, prof, tensors)
    fam["DP / FSDP collectives exposed"] = d["dp_sync"] + d["tied_embedding_sync"]
    fam["bubble"] = est.breakdown["bubble"]
    return dict(name=f"{r['name']} / {r['devices']}", ratio=res["ratio"],
                predicted=est.step_time, published=est.step_time * res["ratio"],
                families=fam, listed=sum(fam.values()))


def print_families(out, script: str, label_w: int, col_w: int) -> None:
    """The audits' table: each kernel family's ms per step for each row, their sum, the
    estimate's and the published step, and the ratio."""
    names = list(out[0]["families"])
    print(f"The step's kernel families as the planner prices them, ms per step ({script})")
    print(f"  {'':<{label_w}}" + "".join(f"{x['name']:>{col_w}}" for x in out))
    for k in names:
        print(f"  {k:<{label_w}}" + "".join(f"{1e3 * x['families'][k]:>{col_w}.1f}"
                                             for x in out))
    for label, key in (("sum of the above", "listed"), ("estimate's step", "predicted"),
                       ("published step", "published")):
        print(f"  {label:<{label_w}}" + "".join(f"{1e3 * x[key]:>{col_w}.1f}" for x in out))
    print(f"  {'ratio predicted / published':<{label_w}}" +
          "".join(f"{x['ratio']:>{col_w}.3f}" for x in out))


def main():
    out = [audit(row(*k)) for k in ROWS]
    print_families(out, "benchmarks/step_audit.py", 32, 20)
    ce = megatron_loss_check()
    print(f"Megatron's cross-entropy, 4,096 x 131,072 logits on the H100: "
          f"{_per_logit(MEGATRON_CE_BYTES)} B per logit at the copy rate "
          f"{1e3 * ce['megatron_at_copy_rate']:.2f} ms; charged (PyTorch's measured pair) "
          f"{1e3 * ce['pair_charged']:.2f} ms, whose {_per_logit(PYTORCH_CE_BYTES)} B per "
          f"logit ran at {ce['pair_share_of_copy_rate']:.2f} of the copy rate (Megatron's "
          f"bytes at that share: {1e3 * ce['megatron_at_pair_rate']:.2f} ms)")
    return out


if __name__ == "__main__":
    main()
