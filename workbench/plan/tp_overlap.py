"""Megatron-LM's ``--tp-comm-overlap``: Transformer Engine's "userbuffers" overlap of the
tensor-parallel all-gathers and reduce-scatters of sequence parallelism with the GEMMs
beside them, as its source code runs them.

Sources (read, not copied):

- Megatron-LM ``megatron/training/arguments.py`` at f2e5db402c (2024-07-15, the commit of
  the README's H100 table): ``--tp-comm-overlap`` asserts ``sequence_parallel`` ("Tensor
  parallel communication/GEMM overlap can happen only when sequence parallelism is
  enabled"); ``--disable-tp-comm-overlap-ag`` / ``-rs`` / ``--disable-tp-comm-bulk-dgrad``
  / ``-wgrad`` all default to overlapping, ``--tp-comm-overlap-rs-dgrad`` to not.
  ``megatron/training/initialize.py`` ``_initialize_tp_communicators``: without
  ``--tp-comm-overlap-cfg`` it calls TE's ``initialize_ub`` with ``ub_cfgs = {}``, so every
  GEMM gets TE's default. ``megatron/core/transformer/custom_layers/transformer_engine.py``:
  the column-parallel ``TELayerNormColumnParallelLinear`` (QKV, fc1) gets ``ub_overlap_ag``
  and ``ub_bulk_dgrad`` / ``ub_bulk_wgrad``, the row-parallel ``TERowParallelLinear``
  (proj, fc2) ``ub_overlap_rs`` (forward) and ``ub_overlap_ag`` (its backward).
- TransformerEngine v1.7 (4e7caa1c35, 2024-05-31; the defaults are the same from v1.6 to
  v1.9), ``transformer_engine/pytorch/module/base.py`` ``initialize_ub``: the method of
  each GEMM (``METHOD`` below) and ``add_ub``'s defaults ``num_sm=16``, ``cga_size=2``,
  ``set_sm_margin=0``, ``use_ce=True``, ``num_splits=4`` for "pipeline" (``ring_exchange``
  uses tp chunks). ``transformer_engine/pytorch/csrc/comm_gemm_overlap.h``:

  * ``ring_exchange`` (``UbufP2PCommOverlap::split_overlap_ag``; QKV and fc1 forward,
    proj and fc2 input-gradient GEMMs, each after an all-gather): the GEMM runs in tp
    chunks, the rank's own chunk first; the chunks move rank to rank over point-to-point
    copies on the copy engines (``use_ce = 1; sms = 1``: no SMs), back to back on the
    send / receive streams, and GEMM chunk i waits for the copy that brought it. With g
    a GEMM chunk and c one copy: chunk i starts at max(end of chunk i - 1, i c), so the
    GEMM ends at (tp - 1) max(g, c) + g when g and c are constant: nothing shows while
    c <= g, (tp - 1)(c - g) when the copies are slower (``ring_exchange``).
  * ``pipeline`` (``UbufCommOverlap::split_overlap_rs``; proj and fc2 forward, each
    before a reduce-scatter): the GEMM runs in 4 chunks on all the SMs
    (``set_sm_margin=0``); the reduce-scatter of chunk i starts on the comm stream once
    chunk i and the previous reduce-scatter are done, a userbuffers kernel on ``num_sm``
    = 16 SMs (the last chunk's on ``UB_MAX_SM`` = 32, with nothing left to hide it), so
    the GEMM chunks after the first run beside it on the other SMs (``pipeline``).
  * ``bulk`` (``UbufCommOverlap::bulk_overlap``; QKV's and fc1's input-gradient GEMM
    beside the all-gather of their input for the weight gradient, their weight-gradient
    GEMM beside the reduce-scatter of the input gradient): collective and GEMM start
    together, the collective's kernel on 16 SMs, the GEMM on the rest until it ends
    (``bulk``, the stream model of ``sim_mesh.cost.overlap`` with TE's SM count).

Later TE (``get_default_config``, e.g. d0067d0da6, 2026) changes the defaults: one SM and
``set_sm_margin`` off for ring exchange, ``set_sm_margin`` on for pipeline and bulk (the
GEMM then runs on 116 of 132 SMs throughout), and an "external" overlap for the proj and
fc2 weight-gradient GEMMs; this module prices the 2024 defaults the README's table ran.

ASSUMPTIONS (no source found): a userbuffers collective moves its bytes as fast as the
NCCL collective the profile prices for the same buffer, its per-call latency paid once
per GEMM (a pipeline chunk's reduce-scatter is the whole one's price / 4: the
kernels synchronise through flags in peer memory, not NCCL's launch path); a
ring-exchange copy is priced as the profile's point-to-point send of one chunk between
neighbours; chunks of one GEMM cost the whole GEMM's time split evenly plus one launch
each (TE runs them on up to three streams, which fill each other's partial waves);
copy-engine traffic does not slow the GEMM (HBM contention is not modeled, as in
``sim_mesh.cost.overlap``); a GEMM beside an SM-held collective runs on the SMs left
(the GEMM's tile waves for a bulk pair, the SM share for pipeline chunks).

The head's and embedding's collectives are not TE modules' (Megatron's output layer is
its own ``ColumnParallelLinear``): they stay as ``layer_cost`` prices them.
"""
from __future__ import annotations

from dataclasses import replace

from ..sim_mesh import cost as _cost

__all__ = ["METHOD", "te_name", "UB_COMM_SMS", "UB_MAX_SM", "PIPELINE_SPLITS", "ASSUMPTION",
           "ring_exchange", "pipeline", "bulk", "sm_rate", "apply", "check",
           "check_estimate"]

UB_COMM_SMS = 16       # TE v1.7 base.py add_ub(num_sm=16): a userbuffers kernel's SMs
UB_MAX_SM = 32         # comm_gemm_overlap.h: the last reduce-scatter chunk's SMs
PIPELINE_SPLITS = 4    # base.py: num_splits=4 if method == "pipeline"

# this planner's collective -> (TE's method, the GEMM(s) it overlaps, where that GEMM
# stands: "next" after the collective, "previous" before it, or "beside" it, started
# together); TE names a userbuffers communicator after its GEMM (``te_name``)
METHOD = {
    "sp_all_gather_1": ("ring_exchange", ("qkv_gemm",), "next"),
    "sp_all_gather_2": ("ring_exchange", ("fc1_gemm",), "next"),
    "sp_grad_all_gather": ("ring_exchange", ("fc2_dgrad", "proj_dgrad"), "next"),
    "tp_out_1": ("pipeline", ("proj_gemm",), "previous"),
    "tp_out_2": ("pipeline", ("fc2_gemm",), "previous"),
    "sp_regather_fc1": ("bulk", ("fc1_dgrad",), "beside"),
    "tp_grad_fc1": ("bulk", ("fc1_wgrad",), "beside"),
    "sp_regather_qkv": ("bulk", ("qkv_dgrad",), "beside"),
    "tp_grad_qkv": ("bulk", ("qkv_wgrad",), "beside"),
}


def te_name(gemm: str) -> str:
    """TE's userbuffers name of this planner's GEMM ("qkv_gemm" -> "qkv_fprop")."""
    return gemm.replace("_gemm", "_fprop")


ASSUMPTION = ("TP communication overlapped as Megatron-LM's --tp-comm-overlap with "
              "Transformer Engine's default userbuffers methods (plan/tp_overlap.py: ring "
              "exchange for the all-gathers before a GEMM, a 4-chunk pipeline for the "
              "reduce-scatters after one, bulk beside the backward GEMMs, 16 SMs per "
              "userbuffers kernel); userbuffers collectives at NCCL's price of the same "
              "buffer, latency paid once per GEMM (ASSUMPTION)")


def check(tp: int, sp: bool, where: str = "estimate") -> None:
    """Refuse ``tp_comm_overlap=True`` where Megatron-LM does: tensor parallelism without
    sequence parallelism (``arguments.py``'s assertion)."""
    if tp > 1 and not sp:
        raise ValueError(f"{where}: tp_comm_overlap=True with tp={tp} and sp=False: "
                         f"Megatron-LM's --tp-comm-overlap needs sequence parallelism "
                         f"(Transformer Engine overlaps its all-gathers and reduce-scatters); "
                         f"give the layout sp=True, or tp_comm_overlap=False")


def check_estimate(model, lay, profile, fp8: bool, tp_comm_overlap, ep_cp: bool) -> None:
    """What ``estimate(..., tp_comm_overlap=True)`` refuses: a flag that is not a bool,
    a framework other than Megatron-LM, tp > 1 without sp (``check``), a TP group wider
    than a node (userbuffers maps its peers' buffers over NVLink: TE's ``initialize_ub``,
    d0067d0da6, builds one communicator per "TP domain" of tp ranks, "TP model on single
    NVLink domain"), and what is not modeled here (FP8, a Llama block, expert or context
    parallelism: ``ep_cp``)."""
    if not isinstance(tp_comm_overlap, bool):
        raise ValueError(f"tp_comm_overlap={tp_comm_overlap!r} must be True or False")
    if not tp_comm_overlap:
        return
    if lay.engine != "megatron":
        raise ValueError(f"tp_comm_overlap=True with framework {lay.engine!r}: it is "
                         f"Megatron-LM's --tp-comm-overlap; use framework='megatron' "
                         f"(zero<=1) or tp_comm_overlap=False")
    check(lay.tp, lay.sp)
    if lay.tp > profile.devices_per_node:
        raise ValueError(f"tp_comm_overlap=True with tp={lay.tp} over nodes of "
                         f"{profile.devices_per_node}: Transformer Engine's userbuffers "
                         f"need the TP group inside one NVLink domain; use tp <= "
                         f"{profile.devices_per_node} or tp_comm_overlap=False")
    if lay.tp > 1 and (fp8 or model.arch != "gpt" or ep_cp):
        raise ValueError(f"tp_comm_overlap=True is modeled for Megatron's GPT layer in 16 "
                         f"bits without expert or context parallelism (got arch="
                         f"{model.arch!r}, fp8={fp8}, ep={lay.ep}, cp={lay.cp}); use "
                         f"tp_comm_overlap=False")


def _seconds(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 \
            or v == float("inf"):
        raise ValueError(f"{name}={v!r} must be seconds >= 0")
    return float(v)


def _chunks(n):
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be the number of chunks, an int >= 1")
    return n


def ring_exchange(gemm_chunk: float, copy: float, n: int) -> tuple[float, float]:
    """(GEMM seconds, exposed seconds) of TE's ring-exchange all-gather + GEMM in ``n``
    (= tp) chunks of ``gemm_chunk`` seconds each, the n - 1 copies of ``copy`` seconds
    back to back from the start on the copy engines (module docstring): GEMM chunk i
    starts at max(end of chunk i - 1, i x copy). Exposed: the GEMM's waits."""
    g, c, n = _seconds("gemm_chunk", gemm_chunk), _seconds("copy", copy), _chunks(n)
    t = g
    for i in range(1, n):
        t = max(t, i * c) + g
    return n * g, t - n * g


def pipeline(gemm_chunk: float, comm_chunk: float, n: int,
             rate: float = 1.0) -> tuple[float, float]:
    """(GEMM seconds, exposed seconds) of TE's pipelined GEMM + reduce-scatter in ``n``
    chunks (module docstring): the reduce-scatter of chunk i starts when GEMM chunk i
    and the previous reduce-scatter are done; GEMM chunks run at ``rate`` (1 = alone)
    while a reduce-scatter holds its SMs; the last reduce-scatter is exposed."""
    g, c, n = _seconds("gemm_chunk", gemm_chunk), _seconds("comm_chunk", comm_chunk), _chunks(n)
    if not 0 < rate <= 1:
        raise ValueError(f"rate={rate!r} must be in (0, 1]")
    t, comm_end, busy = 0.0, 0.0, []
    for _ in range(n):
        t = _cost.finish_beside(t, g, rate, busy)
        start = max(t, comm_end)
        comm_end = start + c
        busy.append((start, comm_end))
    return t, comm_end - t


def bulk(gemm: float, comm: float, rate: float = 1.0) -> tuple[float, float]:
    """(GEMM seconds, exposed seconds) of a GEMM and a collective started together, the
    GEMM at ``rate`` while the collective holds its SMs (``sim_mesh.cost.overlap``'s
    stream model): r C >= G: the GEMM ends at G / r and C - G / r shows; else the GEMM
    takes G + (1 - r) C and hides it."""
    g, c = _seconds("gemm", gemm), _seconds("comm", comm)
    if not 0 < rate <= 1:
        raise ValueError(f"rate={rate!r} must be in (0, 1]")
    if rate * c >= g:
        return g / rate, c - g / rate
    return g + (1 - rate) * c, 0.0


def sm_rate(profile, sms: int = UB_COMM_SMS, gemm=None) -> float:
    """The rate of a GEMM beside a kernel holding ``sms`` SMs: with the GEMM's output
    shape, ``gemm_efficiency`` on the SMs left over that on all; without, the SM share
    (sm_count - sms) / sm_count; 1 on a profile without an SM count."""
    total = profile.topology.sm_count
    if not total:
        return 1.0
    if gemm is None:
        return (total - sms) / total
    return _cost.gemm_efficiency(gemm, profile, total - sms) / _cost.gemm_efficiency(gemm, profile)


def _find(out, i, names, where):
    """Index of the GEMM collective ``out[i]`` overlaps, in its phase."""
    phase = out[i].phase
    order = range(i + 1, len(out)) if where == "next" else range(i - 1, -1, -1)
    for j in order:
        if out[j].phase != phase:
            break
        if out[j].name in names and out[j].op_class == "matmul":
            return j
    raise ValueError(f"tp_overlap: no GEMM {names} {where} {out[i].name!r} in its phase")


def apply(out: list, gemms: dict, profile, ranks: tuple, dtype: str) -> list:
    """``layer_cost``'s priced ops (``OpCost``, execution order) with the TP collectives
    re-priced as ``--tp-comm-overlap`` runs them (module docstring). ``gemms`` maps
    (phase, GEMM name) to its output shape; ``dtype`` prices a GEMM alone again (a bulk
    pair's GEMM was stretched beside NCCL's SMs)."""
    out, tp = list(out), len(ranks)
    launch = profile.compute_path(dtype)[3]
    for i, o in enumerate(out):
        if o.op_class not in _cost.KINDS or o.name not in METHOD:
            continue
        method, names, where = METHOD[o.name]
        j = _find(out, i, names, "previous" if where == "beside" else where)
        gm = out[j]
        shape = gemms[(gm.phase, gm.name)]
        alone = _cost.compute_time(gm.flops, gm.bytes, profile, dtype, "matmul",
                                   gm.launches, None, shape)
        if method == "ring_exchange":
            copy = _cost.choose("send_recv", o.bytes / tp, ranks[:2], profile).seconds
            busy, exposed = ring_exchange((alone + (tp - 1) * launch) / tp, copy, tp)
        elif method == "pipeline":
            n = PIPELINE_SPLITS
            busy, exposed = pipeline((alone + (n - 1) * launch) / n, o.seconds / n, n,
                                     sm_rate(profile))
        else:
            busy, exposed = bulk(alone, o.seconds, sm_rate(profile, UB_COMM_SMS, shape))
        out[j] = replace(gm, seconds=busy, exposed=busy)
        out[i] = replace(o, exposed=exposed, algorithm=f"userbuffers {method} ({te_name(gm.name)})",
                         overlaps=gm.name)
    return out
