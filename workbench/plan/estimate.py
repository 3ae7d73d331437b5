"""``estimate(model, layout, cluster)``: step time, memory and utilisation, analytically.

Step time = m x the slowest stage's time per micro-batch + the pipeline bubble + the
data-parallel synchronisation + the optimizer step, where

- a stage's time per micro-batch is its layers' forward and backward (with recompute and
  their TP collectives: ``costs``), the head on the last stage (this library's recipe:
  with its cross-entropy's all-reduce of the target count over dp and cp,
  ``_loss_count``), the embedding's collective on the first, and the point-to-point
  sends of a 1F1B pipeline: one activation forward and one gradient backward per chunk
  (v per micro-batch), of 2 s b h / t bytes each (Narayanan et al. 2021 sec. 4.1
  scatter/gather: 1/t over the inter-stage link, then an all-gather of 2 s b h inside
  the TP group; with sequence parallelism the activation is already split, so no
  all-gather), each crossing on its
  own link, the slowest of its rank pairs (``_p2p``, ``_crossings``: inside a node or
  across it; each pipeline rank's own row, ``details["per_rank"]``, the middle ranks'
  from their one entry with their own crossings); this library's recipe
  (``framework="workbench"``) sends each TP rank's whole activation instead, each send
  once, on its sender, and its pipeline is simulated layer-stage by layer-stage as the dry
  run composes it (``_recipe_chunks``);
- bubble (stages of unequal time T_i, each with its own crossings; the pipeline latency of Alpa's inter-operator pass,
  Zheng et al. 2022, held exactly to ``parallel.schedules.simulate`` in the tests):
  (sum_i T_i - max_i T_i) / v, which for equal stages is (p - 1) T / v, the published
  1F1B / GPipe (p-1)(t_f + t_b) and interleaved 1/v of it
  (``parallel.schedules.formulas``; Narayanan et al. 2021); with uneven ``stages`` the
  schedule itself is simulated (the formula holds for GPipe and for a 1F1B whose
  slowest stage is the last; one whose slowest stage comes earlier bubbles less);
- data-parallel sync after the pipeline flush, exposed (Megatron-LM as in Narayanan et
  al. 2021 does not overlap it; on a later stage only past the pipeline's slack, since
  each stage reduces once its own last backward is done: ``stage_sync``): an
  all-reduce of the rank's 16-bit gradients; ZeRO-1:
  a reduce-scatter of them and an all-gather of the updated 16-bit weights (the same
  volume, ZeRO sec. 7.2.1); with ``overlap_grad_reduce=True`` (later Megatron-LM's
  ``--overlap-grad-reduce`` / ``--overlap-param-gather``, torch DDP) those run module by
  module (ZeRO-1 on the first stage: in Megatron-core's buckets of max(40M, 1M x dp)
  parameters, ``plan.megatron_buckets``) beside the last micro-batch's backward and,
  ZeRO-1's gather, the next forward, on the stream model below; ZeRO-2 and ZeRO-3 (pp = 1), DeepSpeed's: every
  micro-batch, each module's gradient reduce-scattered once backward has completed it
  (ZeRO-3 also gathers each module's weights before its forward and its backward,
  prefetched; 1.5x the volume, ZeRO sec. 7.2.2), waited for at the end of each backward,
  on one comm stream against the stage's modules (``zero_cost``): the embedding's
  gather comes first and its gradient (tied to the head's) last, so neither hides;
  ZeRO-2 then all-gathers the updated weights once.  Tied embeddings: an all-reduce
  of the word-embedding gradient between the first and last stage (Megatron-LM).
  Each priced with ``sim_mesh.cost.price`` on the group's ranks (rank order in
  ``layout``);
- optimizer: the step the layout's framework runs (``plan.optimizer_step``: its passes
  over the gradient buffer and, ZeRO-partitioned, AdamW with its copies: Megatron-LM's
  50 bytes per parameter in Korthikanti et al.'s bf16 code, 64 in Narayanan et al.'s fp16
  pipelines, where the fused Adam alone moves 28), memory bound, on the roofline.

``framework="deepspeed"`` with pp > 1: DeepSpeed's pipeline engine instead of the sum
above: its TrainSchedule simulated with blocking transfers (each boundary's on its own
link), its partitioned p2p, its step tail and FP16_Optimizer (``plan.deepspeed_step``;
the bubble is then the slowest stage's idle time in that simulation).

MFU = model FLOPs (Korthikanti et al. 2022 eq. 7, no recompute) / (step time x peak x
devices); HFU counts the recomputed FLOPs too; ``tflops_per_device`` is hardware FLOPs
per second per device (Narayanan et al. 2021's "teraFLOP/s per GPU", which counts the
recompute).  Memory: ``memory.stage_memory`` on every pipeline rank (the middle ones
differ in their communication buffers and in-flight micro-batches); the busiest is
reported (its live peak; ``details["reserved_memory"]`` adds what PyTorch's
caching allocator keeps cached beyond it, ``plan.allocator``, what nvidia-smi reads less
the context, for DeepSpeed's BF16_Optimizer pipelines only: None, not modelled, for every
other framework, whose reserved memory nvidia-smi reads above the live peak by an amount
no source here gives).

Models: Megatron's GPT (``arch="gpt"``) and the Llama (``arch="llama"``: Llama 2 / 3
presets), whose block ``layer_cost`` prices with ``llama_layer``'s ops; held to the dry
run of the course's Llama in tests/test_plan_llama.py.  ``dry_run`` runs this library's
recipe: hold it to ``layout.replace(framework="workbench")``, not to the default
framework, which keeps more (Megatron-LM's fp32 gradient buffer) or less (its in-place
cross-entropy) by design (``plan.agree``, tests/test_plan_dryrun_agree.py).

The parts live beside this module, which keeps :class:`Estimate` and :func:`estimate`
and their import path: each pipeline rank's row, crossings and memory
(:mod:`.estimate_ranks`), the schedule and its bubble (:mod:`.estimate_schedule`), this
library's loss (:mod:`.estimate_loss`), the data-parallel sync (:mod:`.estimate_dp_sync`)
and the layer priced with its checks (:mod:`.estimate_layer`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..sim_mesh import nccl_tuning as NT
from . import costs as C
from . import frameworks as F
from . import zero_cost as Z
from . import fsdp2_cost as FS
from . import fsdp2_root as FR
from . import deepspeed_step as DS
from . import zero3_2021 as Z21
from . import ep_cp as EC
from . import tp_overlap as TPO
from . import comm_memory as CM
from . import allocator as AL
from . import megatron_2021 as M21
from . import megatron_hook_add as HA
from . import ddp_buckets as DB
from . import megatron_buckets as MB
from . import titan_eager as TE
from . import optimizer_step as OS
from . import fp8 as _fp8
from . import layer_cost as LC
from .layout import Cluster, Layout, attention_for, check_layout
from .text_width import wrap
from .edge_cost import edge_times
from .memory import (memory_margin, stage_memory, stage_params, stage_workspace_terms,
                     workspace_assumptions)
from .estimate_ranks import (_crossings, _p2p, _rank_memory, _rows, _stage_kinds,  # noqa: F401
                             _stage_name, _tie_order)
from .estimate_schedule import (_makespan, pipeline_bubble, _recipe_chunks, _schedule,  # noqa: F401
                                _simulate)
from .estimate_loss import _loss_count, _loss_lead, _loss_queues  # noqa: F401
from .estimate_dp_sync import _dp_nodes, _dp_sync, _hide_in_pipeline  # noqa: F401
from .estimate_layer import _check_ep_cp_async, check_runs, layer_for  # noqa: F401


__all__ = ["Estimate", "estimate", "pipeline_bubble"]


@dataclass(frozen=True)
class Estimate:
    """What :func:`estimate` predicts for one layout (see the module docstring)."""
    layout: Layout
    step_time: float                 # seconds per optimizer step
    memory: dict                     # bytes on the busiest rank, live (details
                                     # ["reserved_memory"]: the allocator's reserved
                                     # peak where modelled, else None)
    fits: bool                       # memory["total"] <= the profile's usable memory
    tflops_per_device: float         # hardware TFLOP/s per device (with recompute)
    mfu: float
    hfu: float
    comm_bytes: float                # bytes one rank (of the slowest stage) sends per step
    breakdown: dict                  # seconds: compute, communication, bubble (sum: step)
    details: dict = field(default_factory=dict, repr=False, compare=False)

    def pipeline(self, m: "int | None" = None):
        """The pipeline of one step as the schedule simulator runs it
        (``parallel.schedules.simulate``), each rank's forward and backward per
        micro-batch (per chunk when interleaved) taken from this estimate: a
        ``SimulationResult`` to draw (``viz.pipeline``) or to read the bubble from.
        ``m``: simulate that many micro-batches instead of the step's (a readable
        figure; the bubble, which does not grow with m once m >= p, stays)."""
        lay, st = self.layout, self.details["stages"]
        if m is None:
            m = lay.m
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or (
                lay.schedule == "interleaved_1f1b" and m % lay.pp):
            raise ValueError(f"pipeline(m={m!r}): give a number of micro-batches >= 1"
                             + (f", a multiple of pp={lay.pp} (interleaved)"
                                if lay.schedule == "interleaved_1f1b" else ""))
        return _simulate(lay, st, m, self.details["p2p_links"], self.details["per_rank"])

    def explain(self) -> str:
        """How the step time and the memory were put together, term by term; lines wrapped
        at ``WIDTH`` (100) characters, continuations indented (``text_width.wrap``)."""
        d, lay, b = self.details, self.layout, self.breakdown
        slow, busy = d["per_rank"][d["slowest_stage"]], d["per_rank"][d["busiest_stage"]]
        ly, ms = d["layer"], 1e3
        rc = " with recompute" if lay.recompute != "none" else ""
        # what a layer's communication is: TP's collectives, EP's all-to-alls, CP's ring
        # or its head all-to-alls (cp_comm="a2a", DeepSpeed-Ulysses)
        cp_kind = "CP all-to-all" if lay.cp_comm == "a2a" else "CP ring"
        kinds = [k for k, on in (("TP", lay.tp > 1), ("EP all-to-all", lay.ep > 1),
                                 (cp_kind, lay.cp > 1)) if on]
        comm = " + ".join(kinds) if kinds else "TP"
        gb = {k: v / 1e9 for k, v in self.memory.items()}
        bub = ("(DeepSpeed's TrainSchedule simulated: the slowest stage's idle time)"
               if d.get("deepspeed_pipe") else "(uneven stages: the schedule simulated, "
               "less m x the slowest stage)" if lay.stages is not None and lay.pp > 1
               else "(the recipe's layer-stages simulated, less m x the slowest stage)"
               if lay.engine == "workbench" and lay.pp > 1
               else "(sum of stage times - slowest) / v")
        return wrap("\n".join([
            f"{lay.short()}: {self.step_time:.3f} s = compute {b['compute']:.3f} + "
            f"communication {b['communication']:.3f} + bubble {b['bubble']:.3f}",
            f"  one layer, one micro-batch: forward {ly.fwd_compute * ms:.2f} ms compute + "
            f"{ly.fwd_comm * ms:.2f} ms {comm} comm, backward{rc} "
            f"{ly.bwd_compute * ms:.2f} + {ly.bwd_comm * ms:.2f} ms ({d['layer_time_source']})",
            f"  slowest stage {slow['stage']}: {slow['time'] * ms:.1f} ms per micro-batch "
            f"(compute {slow['compute'] * ms:.1f}, communication {slow['comm'] * ms:.1f}, of "
            f"which p2p {sum(slow['crossings']) * ms:.2f}) x m = "
            f"{d['micro_batches']}",
            f"  bubble {bub} = {b['bubble']:.3f} s; DP sync "
            f"{d['dp_sync']:.3f} s, tied-embedding sync {d['tied_embedding_sync']:.3f} s, "
            f"optimizer {d['optimizer']:.3f} s",
            f"  memory on stage {busy['stage']}: params {gb['params']:.1f} + grads "
            f"{gb['grads']:.1f} + optimizer {gb['optimizer']:.1f}"
            + (f" + buffers {gb['buffers']:.1f}" if self.memory.get("buffers") else "")
            + (f" + {d['comm_buffers']['library']} buffers {gb['comm_buffers']:.1f}"
               if self.memory.get("comm_buffers") else "")
            + f" + activations {gb['activations']:.1f}"
            + (f" + workspace {gb['workspace']:.1f} (peak: loss or recompute)"
               if self.memory.get("workspace") else "")
            + f" = {gb['total']:.1f} GB"
            f" ({'fits' if self.fits else 'does NOT fit'} in {d['usable_memory'] / 1e9:.1f} GB "
            f"usable: {d['memory_margin']})"
            + (f"; reserved {d['reserved_memory'] / 1e9:.1f} GB with the caching "
               f"allocator's cached segment {busy['allocator_cache'] / 1e9:.1f} "
               f"(plan.allocator)" if busy.get("allocator_cache") else ""),
            f"  MFU {self.mfu:.1%} (model FLOPs {d['model_flops']:.3g}), HFU {self.hfu:.1%}, "
            f"{self.tflops_per_device:.0f} TFLOP/s per device, "
            f"{self.comm_bytes / 1e9:.1f} GB sent per device per step",
            f"  assumed: {'; '.join(self.assumptions())}"] + EC.explain_lines(self)
            + DS.explain_lines(self)))

    def assumptions(self) -> list[str]:
        """What this estimate rests on beyond cited measurements: the framework behaviour
        chosen, the attention kernel, and every profile figure its citation marks as an
        ASSUMPTION or UNCERTAIN (``profiles/*.json``)."""
        return list(self.details["assumptions"])

    def __str__(self):
        b = self.breakdown
        return wrap(f"{self.layout.short()}: {self.step_time:.3f} s/step, "
                    f"{self.tflops_per_device:.0f} TFLOP/s/device, MFU {self.mfu:.1%}, "
                    f"memory {self.memory['total'] / 1e9:.1f} GB"
                    f"{'' if self.fits else ' (does NOT fit)'}; compute {b['compute']:.3f} s, "
                    f"communication {b['communication']:.3f} s, bubble {b['bubble']:.3f} s")


def estimate(model, layout: Layout, cluster: Cluster, attention: "str | None" = None,
             overlap: bool = True, overlap_grad_reduce: bool = False,
             fp8: bool = False, tp_comm_overlap: bool = False,
             async_tensor_model_parallel_allreduce: "bool | None" = None,
             gradient_accumulation_fusion: "bool | None" = None,
             torchtitan_eager: "str | None" = None,
             transformer_engine: bool = False) -> Estimate:
    """Predict one training step of ``model`` (a ``ModelConfig``, arch "gpt" or "llama":
    ``plan.llama_layer``) with ``layout`` on ``cluster`` (module docstring).
    ``attention="flash"`` counts a fused attention kernel's activations and time instead
    of Table 2's materialized softmax (``workbench.models.GPT`` runs
    ``wb.ops.flash_attention``: compare it so); None: "materialized" for a GPT, "flash"
    for a Llama (``layout.attention_for``);
    ``overlap=False`` assumes ZeRO-2/3's per-micro-batch collectives do not overlap
    compute (DeepSpeed's ``overlap_comm`` off).  ``overlap_grad_reduce=True``: ZeRO-0/1's
    data-parallel sync overlaps compute as Megatron-LM's ``--overlap-grad-reduce`` (and,
    with ZeRO-1, ``--overlap-param-gather``) and torch DDP's buckets do: gradients reduced
    during the last micro-batch's backward, module by module (``_dp_sync``); the default
    is Megatron-LM of Narayanan et al. 2021, which reduces after the pipeline flush.
    ``fp8=True``: the layers' GEMMs in FP8 as Transformer Engine runs them (``plan.fp8``;
    profiles with an FP8 peak: the H100); MFU stays against the 16-bit peak.
    ``tp_comm_overlap=True``: the layers' TP all-gathers and reduce-scatters overlap
    their GEMMs as Megatron-LM's ``--tp-comm-overlap`` runs them with Transformer
    Engine's userbuffers (``plan.tp_overlap``; needs ``sp`` where tp > 1); the default
    is Megatron-LM without it.  ``async_tensor_model_parallel_allreduce`` and
    ``gradient_accumulation_fusion``: Megatron-LM's arguments (None: on, as Megatron-LM
    since 2021-09 / 2022-02; False: its layer before, e.g. Narayanan et al. 2021's code;
    DeepSpeed's pipeline engine runs Megatron-DeepSpeed's layers, which have neither:
    ``plan.megatron_2021``).  ``torchtitan_eager``: a Llama block as torchtitan runs it
    without torch.compile, its ``norm_type`` ("rmsnorm": the eager RMSNorm;
    "fused_rmsnorm"): ``plan.titan_eager``; None: the fused block (the course's Llama).
    ``transformer_engine=True``: a GPT layer as Megatron-LM runs it with Transformer Engine
    (its default ``--transformer-impl`` since 2024; ``layer_cost.TE_SOURCES``: the QKV bias
    in its GEMMs' epilogues, the fused attention's q, k, v copies); needs
    ``framework="megatron"`` and ``attention="flash"``; the default prices Megatron's own
    linears (Korthikanti et al. 2022's layer).  ``tp_comm_overlap`` and ``fp8`` are TE's
    features too, but do not imply it."""
    check_layout(model, layout, cluster)
    if not isinstance(transformer_engine, bool):
        raise ValueError(f"transformer_engine={transformer_engine!r} must be True or False")
    TE.check(model, torchtitan_eager, layout)
    async_tp, fusion = M21.resolve(layout, async_tensor_model_parallel_allreduce,
                                   gradient_accumulation_fusion)
    if not isinstance(fp8, bool):
        raise ValueError(f"fp8={fp8!r} must be True or False")
    if fp8:
        _fp8.check_framework(layout)       # the recipe has no FP8 path (plan.fp8)
    if not isinstance(overlap_grad_reduce, bool):
        raise ValueError(f"overlap_grad_reduce={overlap_grad_reduce!r} must be True or False")
    if not isinstance(overlap, bool):      # "no" would read as True
        raise ValueError(f"overlap={overlap!r} must be True or False")
    attention = attention_for(model, attention)
    check_runs(model, layout, cluster, attention, fp8, overlap_grad_reduce, tp_comm_overlap)
    cfg, lay, prof = model, layout, cluster.profile
    if lay.engine == "fsdp":      # the attention kernel SDPA runs (plan.fsdp2_cost)
        prof = FS.sdpa_profile(prof)
    tcfg = EC.token_cfg(cfg, lay)                  # s / cp tokens per rank
    b, tp, sp, v, pp = lay.micro_batch, lay.tp, lay.sp, lay.v, lay.pp
    if fp8 and "float8" not in prof.peak_flops:
        raise ValueError(f"fp8=True on profile {prof.name!r}, which has no FP8 peak "
                         f"(peak_flops['float8']): FP8 tensor cores are the H100's; use "
                         f"Cluster('h100', ...) or fp8=False")
    if transformer_engine and (lay.engine != "megatron" or attention != "flash"
                               or cfg.arch != "gpt"):
        raise ValueError(f"transformer_engine=True prices Megatron-LM's GPT layer with "
                         f"Transformer Engine's fused attention; got framework="
                         f"{lay.engine!r}, attention={attention!r}, arch={cfg.arch!r}: use "
                         f"framework='megatron', attention='flash' and a GPT model, or "
                         f"transformer_engine=False")
    layer = layer_for(cfg, lay, prof, attention, fp8, tp_comm_overlap, async_tp,
                      transformer_engine)
    eager = None
    if torchtitan_eager is not None:    # torchtitan's eager kernels (plan.titan_eager)
        eager = TE.extra_seconds(cfg, lay, prof, torchtitan_eager)
        layer = replace(layer, fwd_compute=layer.fwd_compute + eager["forward"],
                        bwd_compute=layer.bwd_compute + eager["backward"])
    unfused = None
    if lay.engine == Z21.FRAMEWORK and cfg.arch == "gpt":   # Megatron-LM-v1.1.5's eager
        unfused = Z21.unfused_seconds(cfg, b, prof, lay.recompute)   # softmax, GeLU, bda
        layer = replace(layer, fwd_compute=layer.fwd_compute + unfused["forward"],
                        bwd_compute=layer.bwd_compute + unfused["backward"])
    head = C.head_cost(tcfg, b, tp, sp, prof)
    emb_t, emb_sent = C.embedding_comm(tcfg, b, tp, sp, prof)
    links, p2p_sent = _p2p(tcfg, lay, prof) if pp > 1 else ([0.0], 0.0)
    count_t, count_sent = _loss_count(lay, prof)     # the recipe's loss: its target count
    p2p_t = max(links)                              # the slowest link's crossing
    per_stage = lay.stage_layers(cfg.n_layer)
    edge = edge_times(tcfg, b, tp, sp, prof)       # embeddings; final norm, fp32 cast, loss
    # this library's ZeRO-3 re-gathers a recomputed layer module by module (zero_cost)
    regather = lay.engine == "workbench" and lay.zero == 3 and lay.recompute in ("full", "op")
    remat = layer.bwd_compute - layer_for(cfg, lay.replace(recompute="none"), prof, attention,
                                          fp8, tp_comm_overlap, async_tp,
                                          transformer_engine).bwd_compute \
        if regather else 0.0

    stages = {}
    opt_passes = OS.passes(cfg, lay, fusion, overlap_grad_reduce)    # plan.optimizer_step
    for name, s, count in _stage_kinds(pp, lay.stages is not None):
        n_layers = per_stage[s]
        comp = n_layers * (layer.fwd_compute + layer.bwd_compute)
        # each crossing on its own link; the middle stages' one dict (count of them, same
        # layers) is stage s's, crossings and memory alike: each middle rank's own
        # crossings, time and memory are its row in details["per_rank"] (_rows,
        # _rank_memory), from which the slowest and the busiest rank are read (was: this
        # dict carried the slowest middle rank's crossings with stage 1's memory)
        cross = _crossings(lay, s, links)
        comm = n_layers * (layer.fwd_comm + layer.bwd_comm) + sum(cross)
        # bytes sent: a crossing's send and the receiver's TP all-gather (p2p_sent),
        # both ways per chunk but the first stage's input and the last's output
        # (2v - 1 on them; the time keeps 2v: a blocking receive waits on the link)
        sent = n_layers * layer.comm_bytes + (2 * v - (s in (0, pp - 1))) * p2p_sent
        # the recipe's sends as the dry run composes them (_recipe_chunks, _crossings):
        # none from the last layer-stage's forward nor from the first's backward
        fwd = n_layers * (layer.fwd_compute + layer.fwd_comm) + cross[0]
        edge_f = edge_t = 0.0          # the embedding's and the head's (_recipe_chunks)
        if s == 0:
            edge_f += emb_t + edge["first"][0]
            edge_t += emb_t + sum(edge["first"])
        if s == pp - 1:
            edge_f += head.fwd_compute + head.fwd_comm + edge["last"][0] + count_t
            edge_t += head.fwd_compute + head.fwd_comm + head.bwd_compute + head.bwd_comm \
                + sum(edge["last"]) + count_t
        if s == 0:
            comm, sent, fwd = comm + emb_t, sent + emb_sent, fwd + emb_t
            comp, fwd = comp + sum(edge["first"]), fwd + edge["first"][0]
        if s == pp - 1:
            comp, comm = comp + head.fwd_compute + head.bwd_compute, comm + head.fwd_comm \
                + head.bwd_comm
            comm, sent = comm + count_t, sent + head.comm_bytes + count_sent
            fwd += head.fwd_compute + head.fwd_comm + count_t
            comp, fwd = comp + sum(edge["last"]), fwd + edge["last"][0]
        psi = stage_params(cfg, tp, pp, s, n_layers)
        acc = M21.accumulate_seconds(cfg, lay, psi, n_layers, prof, fusion) \
            + HA.hook_add_seconds(cfg, lay, s, n_layers, prof, fusion)
        comp += acc             # after each backward (plan.megatron_2021, megatron_hook_add)
        blocks = Z.stage_blocks(cfg, lay, s, layer, head, edge,
                                per_module=lay.zero == 3 and lay.engine == "deepspeed",
                                recipe=lay.engine == "workbench", remat=remat,
                                ring=EC.ring_program(cfg, lay, prof, attention, fp8)) \
            if (lay.zero >= 2 or overlap_grad_reduce) and lay.dp * lay.cp > 1 else None
        if blocks and MB.applies(cfg, lay, s, overlap_grad_reduce):
            blocks = MB.buckets(cfg, lay, s, blocks)    # Megatron-core's DP buckets
        elif blocks and DB.applies(cfg, lay, s, overlap_grad_reduce, async_tp, fusion):
            blocks = DB.buckets(cfg, lay, s, blocks,      # torch DDP (2021, pp = 1)
                                F.grad_reduce_bytes(lay.engine, cfg.dtype))
        side = copies = None
        if lay.engine == "fsdp":  # FSDP2's copy kernels (plan.fsdp2_cost)
            copies = FS.stage_copies(blocks or Z.stage_blocks(cfg, lay, s, layer, head, edge),
                                     n_layers, s == 0, s == pp - 1, lay.dp * lay.cp, lay.m,
                                     prof)
            blocks, side = copies["blocks"] if blocks else None, (
                copies["gather_extra"], copies["reduce_extra"], copies["stay"])
            if blocks:      # the root's parameters: one unit, first and last (fsdp2_root)
                blocks, stay = FR.root_unit(blocks, side[2], s == 0, s == pp - 1,
                                            lay.dp * lay.cp, prof)
                side = side[:2] + (stay,)
            comp, fwd = comp + copies["forward"] + copies["backward"], fwd + copies["forward"]
        # this library's recipe at ep = 1: the experts' gradients in the dense ones'
        # buckets, one collective (ep_cp.merged_expert_params)
        merged = EC.merged_expert_params(cfg, lay, n_layers) if blocks is None else 0.0
        dp_t, dp_sent = _dp_sync(psi + merged, lay, prof, s, blocks, overlap,
                                 overlap_grad_reduce,
                                 F.grad_reduce_bytes(lay.engine, cfg.dtype),
                                 head_live=cfg.tie_embeddings, side=side,
                                 lead=_loss_lead(cfg, lay, head, edge) if s == pp - 1
                                 else ((0.0, 0.0), None)) \
            if lay.engine != Z21.FRAMEWORK else Z21.dp_sync(cfg, lay, prof, layer, head, edge)
        e_t, e_sent, e_upd = EC.expert_sync(cfg, lay, prof, s, n_layers,
                                            F.grad_reduce_bytes(lay.engine, cfg.dtype))
        if not merged:
            dp_t, dp_sent = dp_t + e_t, dp_sent + e_sent
        updated = psi / (lay.dp * lay.cp if lay.zero >= 1 else 1) + e_upd
        opt = OS.step_seconds(opt_passes, psi, updated, prof,
                              M21.TENSORS_PER_LAYER * max(n_layers, 1))
        # Megatron-LM without gradient accumulation fusion: fresh 16-bit weight gradients
        # (memory._fresh_gradients); None otherwise (the cached default)
        mem_fusion = False if lay.engine == "megatron" and not fusion else None
        mem = stage_memory(cfg, lay, s, attention, prof, mem_fusion)
        stages[name] = dict(stage=s, count=count, compute=comp, comm=comm, time=comp + comm,
                            forward=fwd, psi=psi, expert_dp=e_t, edge=(edge_f, edge_t),
                            crossings=cross,
                            sent=sent, dp=dp_t, dp_sent=dp_sent, optimizer=opt,
                            grad_accumulation=acc,
                            memory=mem,
                            # the workspace's instants (the loss, the layers' backward)
                            # and their terms (memory.workspace_terms)
                            workspace_terms=stage_workspace_terms(cfg, lay, s, attention,
                                                                  prof, mem_fusion),
                            # what PyTorch's caching allocator keeps reserved beyond the
                            # pipeline phase's live peak (plan.allocator), and the
                            # reserved peak: nvidia-smi's reading less the context;
                            # None where not modelled (all but BF16_Optimizer pipelines)
                            allocator_cache=AL.cached_bytes(cfg, lay, s, psi, n_layers),
                            reserved_memory=AL.reserved_bytes(cfg, lay, s, psi, n_layers, mem,
                                                              attention),
                            copies=copies)

    tied = 0.0
    if pp > 1 and cfg.tie_embeddings:
        tied = C.group_price("all_reduce", 2 * cfg.vocab_size * cfg.d_model / tp,
                             (lay.rank(0, 0, 0), lay.rank(0, 0, pp - 1)), prof)
    ds = DS.pipeline_step(cfg, lay, prof, stages, [_stage_name(k, pp, lay.stages is not None)
                                                   for k in range(pp)],
                          p2p_sent, tied) if lay.engine == "deepspeed" and pp > 1 else None
    if ds is None and lay.engine in ("megatron", "deepspeed") and pp > 1 \
            and lay.dp * lay.cp > 1 and v == 1:
        _hide_in_pipeline(stages, lay, prof, F.grad_reduce_bytes(lay.engine, cfg.dtype),
                          overlap_grad_reduce, links)
    if ds is not None:                 # the engine's own stage times (plan.deepspeed_step)
        tied = ds["tied"]              # its tied gradient's dtype (bf16: BF16_Optimizer's fp32)
        for name, d in stages.items():
            d.update({k: ds["stages"][d["stage"]][k] for k in DS.STAGE_KEYS})
    # each pipeline rank's own row (its crossings, time and memory): the slowest and the
    # busiest rank are read from them, ties to the first entry of ``stages``
    rows = _rows(lay, stages, links, ds)
    for r, d in enumerate(rows):
        if stages[_stage_name(r, pp, lay.stages is not None)]["stage"] != r:
            _rank_memory(cfg, lay, d, r, attention, prof, mem_fusion)
    order = _tie_order(lay, stages)
    slow = max((rows[r] for r in order), key=lambda d: d["time"])
    # the fill and drain walk every stage once, each with its own crossings (_rows)
    bubble = pipeline_bubble([d["time"] for d in rows], v)
    m = lay.m
    if (lay.stages is not None or lay.engine == "workbench") and pp > 1 and ds is None:
        # uneven stages: (sum - max) is exact only when the slowest stage is the last (or
        # GPipe); a 1F1B whose slowest stage comes earlier overlaps more (stages (24, 8,
        # 8, 8), m = 4: the formula 26% above the schedule), so simulate the schedule;
        # this library's recipe: its layer-stages as the dry run composes them
        # (_recipe_chunks), whose sends on the sender the formula does not hold
        bubble = _makespan(lay, stages, m, links) - m * slow["time"]
    sync = max(d["dp"] for d in stages.values()) + tied
    opt = max(d["optimizer"] for d in stages.values())
    breakdown = {"compute": m * slow["compute"] + opt, "communication": m * slow["comm"] + sync,
                 "bubble": bubble} if ds is None else dict(ds["breakdown"])
    step = sum(breakdown.values())
    busiest = max((rows[r] for r in order), key=lambda d: d["memory"]["total"])
    comm_mem = CM.comm_buffer_bytes(cfg, lay, busiest["stage"], prof)   # plan.comm_memory
    model_f, hw_f = C.model_and_hardware_flops(cfg, lay.global_batch, lay.recompute)
    peak, n = prof.peak(cfg.dtype), cluster.devices
    details = {
        "layer_time_source": C.LAYER_TIME_SOURCE if cfg.arch == "gpt" else
        C.LLAMA_LAYER_TIME_SOURCE, "layer": layer, "head": head,
        "p2p": p2p_t if ds is None else ds["stages"][slow["stage"]]["p2p"] / 2,
        "p2p_links": links,        # seconds of one crossing of pipeline rank r -> r + 1
        "micro_batches": m, "stages": stages, "slowest_stage": slow["stage"],
        # per pipeline rank: its stage's dict with its own crossings, time and memory
        "per_rank": rows,
        "busiest_stage": busiest["stage"], "dp_sync": sync - tied, "tied_embedding_sync": tied,
        "optimizer": opt, "model_flops": model_f, "hardware_flops": hw_f,
        "tokens_per_second": lay.global_batch * cfg.seq_len / step,
        "rank_order": "Megatron: rank = t + tp (d + dp s), tp innermost, pp outermost",
        "framework": lay.engine,
        "assumptions": F.assumptions(cfg, lay, prof, attention, overlap, overlap_grad_reduce)
        + (("FP8 GEMMs as Transformer Engine runs them (plan/fp8.py); MFU against the "
            "16-bit peak",) if fp8 else ()) + EC.assumptions(cfg, lay)
        + ((TPO.ASSUMPTION,) if tp_comm_overlap and tp > 1 else ())
        + ((LC.TE_ASSUMPTION,) if transformer_engine else ())
        + M21.assumption(cfg, lay, async_tp or tp == 1, fusion) + HA.assumption(lay, fusion, cfg)
        + (FS.assumptions(slow["copies"], m, prof is not cluster.profile)
           if slow["copies"] else ())
        + ((FR.ASSUMPTION,) if slow["copies"] and lay.dp * lay.cp > 1 else ())
        + (DS.assumptions(lay, cfg) if ds is not None else ())
        + ((TE.assumption(torchtitan_eager, eager, cfg.n_layer),) if eager else ())
        + ((Z21.UNFUSED_SOURCE,) if unfused else ())
        + (OS.assumption(lay, opt_passes), CM.assumption(comm_mem, prof))
        + ((AL.assumption(busiest["allocator_cache"]),) if busiest["allocator_cache"]
           else ())
        + workspace_assumptions(cfg, busiest["workspace_terms"])
        + NT.scale_assumption(prof, _dp_nodes(lay, prof)) + NT.assumptions(prof),
        "optimizer_passes": opt_passes,
        "comm_buffers": comm_mem,
        "fsdp2_copies": {k: slow["copies"][k] for k in ("forward", "backward", "bytes")}
        if slow["copies"] else None,
        "deepspeed_pipe": ds,
        "torchtitan_eager": eager,
        "ep_cp": EC.layer_detail(cfg, lay, prof, attention, fp8) if EC.applies(cfg, lay)
        else None,
        "model": cfg,
        "usable_memory": prof.usable_memory(),
        # the busiest rank's reserved memory (plan.allocator): its pipeline phase's live
        # peak plus the segment the caching allocator keeps for a transient no cached block
        # can serve (the transient counted once where it sets the live peak); None where
        # the allocator is not modelled (every framework but DeepSpeed's BF16_Optimizer
        # pipelines): memory["total"] is then the live peak only, not nvidia-smi's reading
        "reserved_memory": busiest["reserved_memory"],
        "memory_margin": memory_margin(prof),
        "grad_reduce_bytes": F.grad_reduce_bytes(lay.engine, cfg.dtype),
        "grad_accumulation": slow["grad_accumulation"],   # per micro-batch (megatron_2021)
        "mfu_causal": (model_f - 1.5 * cfg.n_layer * C.layer_flops(cfg, lay.global_batch)[1])
        / (step * peak * n),       # the causal core counted half (costs.model_and_hardware_flops)
    }
    return Estimate(layout=lay, step_time=step, memory=dict(busiest["memory"]),
                    fits=busiest["memory"]["total"] <= prof.usable_memory(),
                    tflops_per_device=hw_f / (step * n) / 1e12, mfu=model_f / (step * peak * n),
                    hfu=hw_f / (step * peak * n),
                    comm_bytes=m * slow["sent"] + slow["dp_sent"], breakdown=breakdown,
                    details=details)
