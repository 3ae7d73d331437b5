"""One training step of DeepSpeed's pipeline engine (``framework="deepspeed"``, pp > 1):
what it does beyond the layers, priced term by term, and the step it adds up to.

Source: ``plan.deepspeed_pipe.SOURCE`` (microsoft/DeepSpeed v0.5.4, bc7778ea5b,
2021-10-06), with microsoft/Megatron-DeepSpeed of 2021-11-12 (acc3e9b5) as the model
that ran on it (``megatron/model/gpt_model.py`` ``GPTModelPipe``: one hidden-state
tensor [s, b, h] crosses each stage boundary, the attention mask is not sent).

Per micro-batch, ``runtime/pipe/engine.py`` (with ``runtime/utils.py``
``PartitionedTensor``), when tensor slicing is on (``is_pipe_partitioned =
is_model_parallel``; n = 2 s b h bytes of fp16 activation):

- a crossing (``_exec_send_activations`` / ``_exec_send_grads``): each TP rank sends
  its 1/t slice (``PartitionedTensor._partition_tensor``: a ``narrow().clone()``) and
  before it the slice's meta, an int64 tensor [ndims, s, b, h, t, rank, t + 1 partition
  offsets] (``to_meta``): two blocking sends (``deepspeed_pipe``) to the same TP rank
  of the next stage;
- receiving (``_exec_recv_activations``): both are ``clone()``d out of the receive
  buffer; the forward clones its inputs again and rebuilds the full activation,
  ``PartitionedTensor.full()``: a zeroed n-byte buffer, the own slice copied in, an
  all-gather of n over the TP group, a ``clone()`` of the whole (``from_meta`` reads the
  meta with ``tolist()``, a host sync);
- the sender keeps only its slice after forward (``outputs.data = torch.zeros(1)``), so
  its backward (``_exec_backward_pass``) calls ``full()`` twice: to restore its output
  and to rebuild the received gradient: two all-gathers where Megatron-LM has one;
- the backward's input gradient is partitioned and sent likewise (``SendGrad``).

Without tensor slicing the whole activation crosses and is cloned twice on receipt.

Per micro-batch on the first and the last stage (``LoadMicroBatch``, ``_exec_load_micro_
batch`` -> ``_next_batch`` -> Megatron-DeepSpeed's ``get_batch_pipe``, acc3e9b5
``pretrain_gpt.py:118-150``; :func:`data_load`): ``mpu.broadcast_data``
(``megatron/mpu/data.py:33-110``) broadcasts the sizes (8 int64) and then the tokens
(b (s + 1) int64) from TP rank 0 over the TP group, with a host sync between
(``sizes_cuda.cpu()``, not priced); the tokens and labels are sliced ``contiguous()``
(read + write 8 + 8 bytes per token each) and ``get_ltor_masks_and_position_ids``
(``megatron/utils.py:147-200``; --reset-attention-mask off, Megatron's default) builds the
causal mask on the GPU: ``torch.ones`` (write 4 s^2), ``tril`` (4 + 4), ``< 0.5`` (4 + 1),
and the loss mask ``ones`` (4 per token): :data:`MASK_BYTES`, :data:`TOKEN_BYTES`; the
first stage then ``clone()``s its inputs, the bool mask's s^2 (1 + 1) and the tokens and
positions (8 + 8 each per token).
Activation checkpointing through ``deepspeed.checkpointing`` (Megatron-DeepSpeed's
``--deepspeed-activation-checkpointing``) adds nothing unless ``--partition-activations``
(off by default, ``megatron/arguments.py``), which :func:`partitioned_checkpoint` prices:
``checkpointing.py`` ``partition_activations`` keeps a 1/t ``narrow().clone()`` of each
checkpointed layer's input, and ``gather_partitioned_activations`` rebuilds it in
backward (zeroed buffer, copy, all-gather of n): one all-gather per layer per micro-batch.

Per step, after each stage's last backward (``TrainSchedule``'s last step):
``ReduceTiedGrads`` (the tied embedding's gradient all-reduced between the first and
last stage, ``module.allreduce_tied_weight_gradients``; the last stage waits for the
first there), ``ReduceGrads`` (``engine.py`` ``buffered_allreduce_fallback``: fp16
gradients flattened into buckets of 5e8 elements, all-reduced, scaled by 1/dp,
unflattened back: 12 bytes of copies per parameter beside the all-reduce; ZeRO-1 runs
its optimizer's ``reduce_gradients`` instead, priced as ``estimate`` does), then
``OptimizerStep``.  With fp16 and no ZeRO, DeepSpeed wraps Megatron-DeepSpeed's apex
FusedAdam (``megatron/optimizer/__init__.py`` returns it bare under ``--deepspeed``)
in ``runtime/fp16/fused_optimizer.py`` ``FP16_Optimizer``, whose ``step``:
``CheckOverflow.has_overflow`` (``runtime/utils.py``: ``x.float().sum()`` per gradient,
each read back to the host; a 1-byte all-reduce over the model-parallel group, every
rank of one pipeline: ``deepspeed/__init__.py`` gives a pipeline engine
``mpu=model.mpu()``, the grid of ``pipe/topology.py``, whose
``get_model_parallel_group`` holds all tp x pp ranks of one replica), fp32 flat
gradients (``p.grad.to(fp32)`` then a cat), ``get_grad_norm`` (read; a 4-byte all-reduce
over the model-parallel group) and a 4-byte all-reduce of the norm over the data-parallel
group, unscale and clip (``mul_``), FusedAdam, and the fp32 weights copied back to the
fp16 ones: :data:`FP16_OPTIMIZER_BYTES`.  The model-parallel all-reduce makes every
stage wait for the slowest before its update.  Last, ``_aggregate_total_loss``: a
4-byte all-reduce of the loss over the last stage's data-parallel group and an 8-byte
broadcast over the pipeline group.

With bf16 the engine runs ``BF16_Optimizer`` instead (DeepSpeed 56c522386, 2022, the
release BLOOM-176B trained with): its fp32 gradient accumulation every micro-batch, the
bf16 all-reduce of its whole fp32 gradient buffer, the fp32 tied gradient, its step's
passes and its weight all-gather are ``plan.bf16_optimizer``'s; its step's norm is
all-reduced (4 bytes) over the model-parallel group only (``step_collectives``).
Stages may hold uneven layer counts (``Layout.stages``): Megatron-DeepSpeed's
``--pp-partition-method 'type:transformer|embedding'`` counts each embedding as a layer,
so the first and last stages hold one layer fewer.

Not priced: host-side Python and launch gaps after the host syncs named above (and
``ThroughputTimer.start``'s ``torch.cuda.synchronize()`` at every forward, v0.5.4
``pipe/engine.py:556``), and the one-time shape exchange of the first step
(``first_output_send``).  The phase-by-phase audit: ``benchmarks/mtnlg_audit.py``.
"""
from __future__ import annotations

from ..sim_mesh.cost import compute_time, wire_bytes
from . import costs as C
from . import bf16_optimizer as BF
from . import deepspeed_pipe as D

__all__ = ["FP16_OPTIMIZER_BYTES", "DP_BUCKET_COPY_BYTES", "MASK_BYTES", "TOKEN_BYTES",
           "meta_bytes", "crossing", "gather", "stage_extras", "data_load",
           "partitioned_checkpoint", "fp16_optimizer",
           "step_collectives", "pipeline_step", "check", "assumptions", "explain_lines"]

# bytes per parameter FP16_Optimizer.step moves (module docstring), read + written
FP16_OPTIMIZER_BYTES = (("overflow check, x.float().sum() per gradient", 2 + 4 + 4),
                        ("fp32 flat gradients, .to(fp32) then cat", 2 + 4 + 4 + 4),
                        ("gradient norm", 4), ("unscale and clip, mul_", 4 + 4),
                        ("FusedAdam: p, g, m, v read; p, m, v written", 16 + 12),
                        ("fp32 weights copied to fp16", 4 + 2))
# buffered_allreduce_fallback: flatten (read 2, write 2), scale (2 + 2), unflatten (2 + 2)
DP_BUCKET_COPY_BYTES = 12
# get_batch_pipe's GPU work per micro-batch (module docstring): bytes per mask element
# (s^2 of them), per token; and the first stage's clones
MASK_BYTES = 4 + (4 + 4) + (4 + 1)
TOKEN_BYTES = (8 + 8) + (8 + 8) + 4
FIRST_CLONE_MASK_BYTES, FIRST_CLONE_TOKEN_BYTES = 1 + 1, (8 + 8) + (8 + 8)
SIZES_BYTES = 8 * 8                       # _MAX_DATA_DIM int64 sizes of the one key


def check(cfg, lay, overlap_grad_reduce: bool = False) -> None:
    """Refuse what DeepSpeed's 2021 pipeline engine did not run."""
    if overlap_grad_reduce:
        raise ValueError(f"overlap_grad_reduce=True with framework='deepspeed' and "
                         f"pp={lay.pp}: DeepSpeed's pipeline engine reduces the gradients "
                         f"after the flush (its ReduceGrads instruction: "
                         f"buffered_allreduce_fallback), it has no overlapped reduction; "
                         f"use overlap_grad_reduce=False, or framework='megatron' "
                         f"(--overlap-grad-reduce)")
    if lay.schedule != "1f1b" or lay.v != 1:
        raise ValueError(f"framework='deepspeed' with pp={lay.pp}: DeepSpeed's pipeline "
                         f"engine runs its TrainSchedule (1F1B order), not "
                         f"schedule={lay.schedule!r} v={lay.v}; use schedule='1f1b', v=1")
    if BF.applies(cfg, lay) and lay.zero != 1:
        raise ValueError(f"framework='deepspeed' with bf16 and pp={lay.pp}, zero={lay.zero}: "
                         f"DeepSpeed's pipeline engine runs bf16 with BF16_Optimizer only "
                         f"({BF.SOURCE}), which shards the fp32 master weights and Adam's "
                         f"states over dp as ZeRO-1 does; use zero=1 (or fp16)")
    if lay.sp or lay.cp > 1 or getattr(cfg, "moe_experts", 0):
        raise ValueError(f"framework='deepspeed' with pp={lay.pp}: the 2021 pipeline "
                         f"engine (plan.deepspeed_step) is priced without sequence or "
                         f"context parallelism or MoE (sp={lay.sp}, cp={lay.cp}); use "
                         f"framework='megatron'")


def meta_bytes(tp: int) -> int:
    """Bytes of one ``PartitionedTensor.to_meta()`` of a 3-d tensor (int64)."""
    return 8 * (1 + 3 + 2 + tp + 1)


def _copy(nbytes: float, prof, dtype, launches: int = 1) -> float:
    return compute_time(0.0, nbytes, prof, dtype, launches=launches)


def crossing(n: float, lay, prof, link: int = 0) -> float:
    """Seconds of one activation (or gradient) of ``n`` bytes crossing the stage boundary
    ``link`` -> ``link`` + 1: the meta then the slice (the whole tensor when tp = 1), two
    blocking sends, every rank of the stage to its peer at once (``costs.crossing_price``:
    the slowest pair's; was the first boundary's pair t = d = 0 for every boundary, an
    NVLink one for all where stages smaller than a node share it)."""
    if isinstance(link, bool) or not isinstance(link, int) or not 0 <= link < lay.pp - 1:
        raise ValueError(f"crossing: link={link!r} must be a stage boundary in [0, "
                         f"{lay.pp - 2}] (pp={lay.pp})")
    pairs = lay.crossing_pairs(link, link + 1)
    if lay.tp == 1:
        return C.crossing_price(n, pairs, prof)
    return C.crossing_price((meta_bytes(lay.tp), n / lay.tp), pairs, prof)


def gather(n: float, lay, prof, dtype) -> tuple[float, float]:
    """(copy seconds, all-gather seconds) of ``PartitionedTensor.full()`` of n bytes:
    zeros (write n), own slice copied in (2 n / t), all-gather, clone (2 n)."""
    copies = _copy(n, prof, dtype) + _copy(2 * n / lay.tp, prof, dtype) \
        + _copy(2 * n, prof, dtype)
    return copies, C.group_price("all_gather", n, tuple(lay.tp_ranks()), prof)


def stage_extras(s: int, n: float, lay, prof, dtype) -> dict:
    """Seconds stage ``s`` spends per micro-batch on the engine's p2p bookkeeping:
    ``fwd_copy``, ``fwd_comm`` (all-gathers), ``bwd_copy``, ``bwd_comm``, and the number
    of ``crossings`` it waits on (module docstring)."""
    p, t = lay.pp, lay.tp
    first, last = s == 0, s == p - 1
    out = dict(fwd_copy=0.0, fwd_comm=0.0, bwd_copy=0.0, bwd_comm=0.0,
               crossings=2 * ((not first) + (not last)))
    if t == 1:                      # not partitioned: two clones of the received tensor
        out["fwd_copy"] = 0.0 if first else 2 * _copy(2 * n, prof, dtype)
        return out
    g_copy, g_comm = gather(n, lay, prof, dtype)
    part = _copy(2 * n / t, prof, dtype)            # narrow().clone() of a slice
    if not first:                   # recv clones of meta and slice, inputs.clone(), full()
        out["fwd_copy"] += 2 * part + g_copy
        out["fwd_comm"] += g_comm
        out["bwd_copy"] += part                      # the input gradient partitioned
    if not last:
        out["fwd_copy"] += part                      # the output partitioned
        out["bwd_copy"] += 2 * g_copy                # output restored, gradient rebuilt
        out["bwd_comm"] += 2 * g_comm
    return out


def data_load(cfg, lay, prof, first: bool) -> tuple[float, float, int]:
    """(copy seconds, broadcast seconds, bytes sent by TP rank 0) of one micro-batch's
    ``LoadMicroBatch`` on the first (``first``) or the last stage (module docstring)."""
    s, tokens = cfg.seq_len, lay.micro_batch * cfg.seq_len
    nbytes = MASK_BYTES * s * s + TOKEN_BYTES * tokens
    launches = 7                  # contiguous x2, ones, tril, < 0.5, loss-mask ones, arange
    if first:
        nbytes += FIRST_CLONE_MASK_BYTES * s * s + FIRST_CLONE_TOKEN_BYTES * tokens
        launches += 3
    copy = _copy(nbytes, prof, cfg.dtype, launches=launches)
    if lay.tp == 1:
        return copy, 0.0, 0
    tp = tuple(lay.tp_ranks())
    data = 8 * lay.micro_batch * (s + 1)
    comm = C.group_price("broadcast", SIZES_BYTES, tp, prof) \
        + C.group_price("broadcast", data, tp, prof)
    return copy, comm, wire_bytes("broadcast", SIZES_BYTES, lay.tp) \
        + wire_bytes("broadcast", data, lay.tp)


def partitioned_checkpoint(n_layers: int, n: float, lay, prof, dtype) -> tuple[float, float]:
    """(copy seconds, all-gather seconds) per micro-batch that ``--partition-activations``
    would add to a stage of ``n_layers`` checkpointed layers (module docstring); not in
    the estimate, whose assumption is the flag's default, off."""
    if lay.tp == 1:
        return 0.0, 0.0
    g_copy, g_comm = gather(n, lay, prof, dtype)
    keep = _copy(2 * n / lay.tp, prof, dtype)
    # gather_partitioned_activations: zeros, copy in, all-gather (no clone of the whole)
    g_copy -= _copy(2 * n, prof, dtype)
    return n_layers * (keep + g_copy), n_layers * g_comm


def fp16_optimizer(psi: float, prof) -> float:
    """Seconds of ``FP16_Optimizer.step``'s memory passes over ``psi`` parameters."""
    return _copy(psi * sum(b for _, b in FP16_OPTIMIZER_BYTES), prof, "float32",
                 launches=len(FP16_OPTIMIZER_BYTES))


def step_collectives(lay, prof, fp16: bool, bf16: bool = False) -> float:
    """Seconds of the step's small collectives (module docstring): with ``fp16`` the
    overflow flag and the norm over the model-parallel group and the norm over the
    data-parallel group; with ``bf16`` (``BF16_Optimizer``) the norm over the
    model-parallel group alone (its gradients are already all-reduced over dp:
    ``plan.bf16_optimizer``); always the loss's all-reduce and broadcast."""
    if fp16 and bf16:
        raise ValueError("step_collectives: fp16=True and bf16=True: the engine runs "
                         "FP16_Optimizer or BF16_Optimizer, not both; pass one")
    mp = tuple(lay.rank(t, 0, s) for s in range(lay.pp) for t in range(lay.tp))
    dp = tuple(lay.dp_ranks(0, lay.pp - 1))
    pipe = tuple(lay.rank(0, 0, s) for s in range(lay.pp))
    t = C.group_price("broadcast", 8, pipe, prof)
    if lay.dp > 1:
        t += C.group_price("all_reduce", 4, dp, prof)
    if fp16:
        t += C.group_price("all_reduce", 1, mp, prof) + C.group_price("all_reduce", 4, mp, prof)
        if lay.dp > 1:
            t += C.group_price("all_reduce", 4, dp, prof)
    if bf16:
        t += C.group_price("all_reduce", 4, mp, prof)
    return t


# the keys of a stage's row (pipeline_step's "stages") that stand for the planner's own
STAGE_KEYS = ("compute", "comm", "time", "forward", "sent", "dp", "optimizer")


def pipeline_step(cfg, lay, prof, stages: dict, names: list, p2p_sent: float,
                  tied: float) -> dict:
    """The step of DeepSpeed's pipeline engine from ``estimate``'s stages (``names[s]``:
    stage s's entry, its layers' compute and TP communication with the planner's own
    crossings inside, its ``crossings`` seconds and ``p2p_sent`` bytes a crossing, taken
    out here; each boundary's crossing is priced on its own ranks, :func:`crossing`)
    and the tied-embedding all-reduce
    ``tied``: each stage's forward and backward with the engine's bookkeeping
    (:func:`stage_extras`), run through ``deepspeed_pipe.simulate``; then on each stage
    ReduceTiedGrads (first and last stage, after both finished), ReduceGrads, and the
    optimizer step once every stage is there.  Returns the step, its breakdown (the
    bubble: the slowest stage's idle time in the schedule) and the per-stage figures."""
    p, m, dtype = lay.pp, lay.m, cfg.dtype
    n = 2 * cfg.seq_len * lay.micro_batch * cfg.d_model       # [s, b, h] in 16 bits
    x = [crossing(n, lay, prof, k) for k in range(p - 1)]     # per boundary k -> k + 1
    fp16 = dtype == "float16" and lay.zero == 0
    bf16 = BF.applies(cfg, lay)           # BF16_Optimizer (plan.bf16_optimizer)
    if bf16 and tied:                     # its tied gradient is the fp32 one
        tied = C.group_price("all_reduce", BF.tied_bytes(cfg, lay.tp),
                             (lay.rank(0, 0, 0), lay.rank(0, 0, p - 1)), prof)
    rows = []
    for s in range(p):
        d, e = stages[names[s]], stage_extras(s, n, lay, prof, dtype)
        sends = (s > 0) + (s < p - 1)
        gathers = (s > 0) + 2 * (s < p - 1) if lay.tp > 1 else 0
        # the planner's crossings (seconds; bytes: 2 a stage, 1 on the first and last)
        pf, pb = d["crossings"]
        # this stage's transfers: before its forward step with s - 1 (RecvActivation,
        # SendGrad), before its backward step with s + 1 (SendActivation, RecvGrad)
        xf, xb = 2 * x[s - 1] if s > 0 else 0.0, 2 * x[s] if s < p - 1 else 0.0
        sent = d["sent"] - (2 - (s in (0, p - 1))) * p2p_sent \
            + sends * (n / lay.tp + (meta_bytes(lay.tp)
                                                                  if lay.tp > 1 else 0)) \
            + gathers * wire_bytes("all_gather", n, lay.tp)
        hp = BF.micro_batch_seconds(d["psi"], lay.stage_layers(cfg.n_layer)[s], prof) \
            if bf16 else 0.0              # update_hp_grads after each backward
        load_copy, load_comm, load_sent = data_load(cfg, lay, prof, s == 0) \
            if s in (0, p - 1) else (0.0, 0.0, 0)     # LoadMicroBatch, before the forward
        e["fwd_copy"] += load_copy
        e["fwd_comm"] += load_comm
        sent += load_sent
        comp = d["compute"] + e["fwd_copy"] + e["bwd_copy"] + hp
        comm = d["comm"] - pf - pb + e["fwd_comm"] + e["bwd_comm"] + xf + xb
        dp = d["dp"]
        if bf16:
            dp = BF.dp_sync(d["psi"], lay, prof, s)
        elif lay.zero == 0 and lay.dp > 1:
            dp += _copy(DP_BUCKET_COPY_BYTES * d["psi"], prof, dtype, launches=3)
        opt = d["optimizer"]   # FP16_Optimizer / BF16_Optimizer: plan.optimizer_step
        rows.append(dict(
            stage=s, forward=d["forward"] - pf + e["fwd_copy"] + e["fwd_comm"],
            backward=d["time"] - d["forward"] - pb + e["bwd_copy"] + e["bwd_comm"] + hp,
            compute=comp, comm=comm, time=comp + comm, crossings=e["crossings"], dp=dp,
            transfers=(xf, xb), p2p=xf + xb + e["fwd_comm"] + e["bwd_comm"],
            sent=sent, optimizer=opt))
    finish = D.simulate([r["forward"] for r in rows], [r["backward"] for r in rows], m, x)
    ends = []
    for s, r in enumerate(rows):
        start = max(finish[0], finish[-1]) + tied if s in (0, p - 1) and tied else finish[s]
        ends.append(start + r["dp"])
    last, done = max(finish), max(ends)
    opt = max(r["optimizer"] for r in rows)
    coll = step_collectives(lay, prof, fp16, bf16)
    slow = max(rows, key=lambda r: r["time"])
    breakdown = {"compute": m * slow["compute"] + opt,
                 "communication": m * slow["comm"] + (done - last) + coll,
                 "bubble": last - m * slow["time"]}
    # crossing: the slowest boundary's seconds; links: each boundary's
    return dict(step=done + coll + opt, breakdown=breakdown, stages=rows, finish=finish,
                crossing=max(x), links=x, dp_sync=max(r["dp"] for r in rows),
                after_last=done - last,
                optimizer=opt, collectives=coll, slowest_stage=slow["stage"], fp16=fp16,
                bf16=bf16, tied=tied)


def assumptions(lay, cfg) -> tuple:
    """What the DeepSpeed pipeline estimate assumes beyond its source."""
    out = [f"DeepSpeed pipeline engine as {D.SOURCE}: TrainSchedule with blocking "
           f"p2p (torch >= 1.8 send/recv), activations partitioned over TP"
           f"{' (tp > 1)' if lay.tp > 1 else ''}; --partition-activations off "
           f"(Megatron-DeepSpeed's default; the MT-NLG config is not public), no "
           f"contiguous or CPU checkpointing; host syncs and launch gaps not priced"]
    if BF.applies(cfg, lay):
        out.append(BF.ASSUMPTION)
    elif not (cfg.dtype == "float16" and lay.zero == 0):
        out.append("DeepSpeed pipeline: FP16_Optimizer's passes priced for fp16 without "
                   "ZeRO only; this optimizer priced as the planner's AdamW (28 bytes per "
                   "parameter)" + ("; ZeRO-1's reduce_gradients as a reduce-scatter and "
                                  "an all-gather of the updated weights (its source not "
                                  "read here)" if lay.zero == 1 else ""))
    return tuple(out)


def explain_lines(est) -> list[str]:
    """Lines ``Estimate.explain`` adds for the DeepSpeed pipeline engine."""
    ds = est.details.get("deepspeed_pipe")
    if not ds:
        return []
    ms = 1e3
    mid = ds["stages"][min(1, len(ds["stages"]) - 1)]
    return [f"  DeepSpeed pipeline engine ({D.SOURCE}): one crossing (meta + 1/t slice) "
            f"{ds['crossing'] * ms:.2f} ms on the slowest boundary, {mid['crossings']} per "
            f"micro-batch on stage "
            f"{mid['stage']}; schedule ends {max(ds['finish']):.3f} s (simulated "
            f"TrainSchedule), then tied + DP sync {ds['after_last']:.3f} s exposed, "
            f"optimizer {ds['optimizer']:.3f} s"
            f"{' (FP16_Optimizer passes)' if ds['fp16'] else ''}"
            f"{' (BF16_Optimizer: fp32 gradients, bf16 all-reduce)' if ds.get('bf16') else ''}"
            f", step collectives "
            f"{ds['collectives'] * ms:.2f} ms"]
