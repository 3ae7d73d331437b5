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
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace

from ..sim_mesh.cost import overlap_rate, wire_bytes
from ..sim_mesh import nccl_tuning as NT
from . import costs as C
from . import frameworks as F
from . import stage_sync as S
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
from . import in_flight_peak as _peak
from . import layer_cost as LC
from .layout import Cluster, Layout, attention_for, check_layout
from .text_width import wrap
from .edge_cost import edge_times
from .memory import (_regather, memory_margin, stage_memory, stage_params,
                     stage_workspace_terms, workspace_assumptions)

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


def pipeline_bubble(stage_times, v: int = 1) -> float:
    """Idle time of a 1F1B / GPipe pipeline (interleaved: ``v`` chunks per device) whose
    stage s takes ``stage_times[s]`` per micro-batch (forward + backward):
    (sum - max) / v (Zheng et al. 2022, Alpa's pipeline latency; equal stages give the published
    (p - 1)(t_f + t_b) / v).  The step is m max(stage_times) + this."""
    times = list(stage_times)
    return (sum(times) - max(times)) / v


def _simulate(lay: Layout, stages: dict, m: int, links, rows=None):
    """``parallel.schedules.simulate`` of ``lay``'s schedule over ``m`` micro-batches,
    each pipeline rank's forward and backward taken from ``stages`` (estimate's
    ``details["stages"]``) with its own crossings on ``links`` (``details["p2p_links"]``),
    or from ``rows`` (``details["per_rank"]``: each rank's own, DeepSpeed's engine's as it
    prices them); this library's recipe (:func:`_recipe_chunks`): per layer-stage, as the
    dry run composes it."""
    from ..parallel.schedules import simulate
    rows = _rows(lay, stages, links) if rows is None else rows
    sched = _schedule(lay.schedule, lay.pp, m, lay.v)
    if lay.engine == "workbench" and lay.pp > 1:
        f, b = _recipe_chunks(lay, rows, links)
        return simulate(sched, f=f, b=b)
    return simulate(sched, f=[d["forward"] / lay.v for d in rows],
                    b=[(d["time"] - d["forward"]) / lay.v for d in rows])


def _crossings(lay: Layout, stage: int, links) -> tuple[float, float]:
    """(forward, backward) seconds of the stage crossings pipeline rank ``stage`` is
    charged per micro-batch, each on its own link (``links[r]``: one crossing of rank r ->
    r + 1, ``_p2p``): v forward on the link to the next rank, v backward on the link from
    the previous one (a blocking receive waits on the link: the last rank's forward waits
    on pp - 2 -> pp - 1, the first's backward on 0 -> 1); interleaved chunks cross pp - 1
    -> 0 too; this library's recipe as its dry run composes it: one fewer on the first
    rank's backward and the last's forward (``_recipe_chunks``)."""
    pp, v = lay.pp, lay.v
    if pp == 1:
        return 0.0, 0.0
    if v > 1:
        lf, lb = links[stage], links[(stage - 1) % pp]
    else:
        lf, lb = links[min(stage, pp - 2)], links[max(stage - 1, 0)]
    recipe = lay.engine == "workbench"
    return (v - (recipe and stage == pp - 1)) * lf, (v - (recipe and stage == 0)) * lb


def _rows(lay: Layout, stages: dict, links, ds=None) -> list:
    """Per pipeline rank r, its stage dict (``stage`` r) with its own crossings
    (``_crossings``): the middle stages share one dict, stage 1's, whose crossings are
    swapped for each rank's own.  ``ds``: DeepSpeed's pipeline engine
    (``deepspeed_step.pipeline_step``), whose rows are per stage already (each with its
    own transfers): taken as they are."""
    out = []
    for r in range(lay.pp):
        d = stages[_stage_name(r, lay.pp, lay.stages is not None)]
        if ds is not None:
            out.append(dict(d, stage=r, crossings=ds["stages"][r]["transfers"],
                            **{k: ds["stages"][r][k] for k in DS.STAGE_KEYS}))
            continue
        (f0, b0), (f1, b1) = d["crossings"], _crossings(lay, r, links)
        out.append(dict(d, stage=r, forward=d["forward"] - f0 + f1,
                        time=d["time"] - f0 - b0 + f1 + b1, comm=d["comm"] - f0 - b0 + f1 + b1,
                        crossings=(f1, b1)))
    return out


def _tie_order(lay: Layout, stages: dict) -> list:
    """The pipeline ranks in the order of their entries in ``stages`` (first, last, the
    middle ones), then by rank: the slowest or busiest of equals is the first so met."""
    names = list(stages)
    return sorted(range(lay.pp),
                  key=lambda r: (names.index(_stage_name(r, lay.pp, lay.stages is not None)),
                                 r))


def _rank_memory(cfg, lay: Layout, row: dict, r: int, attention: str, prof,
                 fusion) -> None:
    """Rank r's own memory in its row (``_rows``), where its entry is another rank's (a
    middle stage's: the communication library's buffers are per rank, each with its own
    neighbours' links, ``comm_memory``; the schedule's in-flight micro-batches too)."""
    psi, n_layers = row["psi"], lay.stage_layers(cfg.n_layer)[r]
    mem = stage_memory(cfg, lay, r, attention, prof, fusion)
    row.update(memory=mem, workspace_terms=stage_workspace_terms(cfg, lay, r, attention, prof,
                                                                 fusion),
               allocator_cache=AL.cached_bytes(cfg, lay, r, psi, n_layers),
               reserved_memory=AL.reserved_bytes(cfg, lay, r, psi, n_layers, mem, attention))


# the (frozen) parallel.schedules Schedule of a shape, built once (in_flight_peak.schedule,
# which the memory's walk of an interleaved rank reads too)
_schedule = _peak.schedule


def _makespan(lay: Layout, stages: dict, m: int, links) -> float:
    """``_simulate(...).makespan``, from the schedules' event-driven core alone (the
    timeline ``simulate`` also builds is not read here; a search prices many layouts)."""
    from ..parallel.schedules._engine import run
    rows = _rows(lay, stages, links)
    sched = _schedule(lay.schedule, lay.pp, m, lay.v)
    if lay.engine == "workbench" and lay.pp > 1:
        f, b = _recipe_chunks(lay, rows, links)
    else:
        f = [d["forward"] / lay.v for d in rows]
        b = [(d["time"] - d["forward"]) / lay.v for d in rows]
        f, b = [f[s % lay.pp] for s in range(sched.stages)], [b[s % lay.pp]
                                                             for s in range(sched.stages)]
    stage = [[sched.stage(r, c) for c in range(sched.v)] for r in range(sched.p)]
    cost = {"F": f, "B": b}
    durations = [[cost[a.kind][stage[r][a.chunk]] for a in row]
                 for r, row in enumerate(sched.actions)]
    out = run(sched, durations, 0.0)
    if out.blocked:          # a library schedule never deadlocks: a bug, say so
        raise RuntimeError(f"estimate: the {lay.schedule} schedule of pp={lay.pp}, m={m}, "
                           f"v={lay.v} deadlocked in parallel.schedules' engine")
    return max(row[-1] for row in out.ends if row)


def _recipe_chunks(lay: Layout, rows: list, links) -> tuple[list, list]:
    """(forward, backward) seconds of each of the pp x v layer-stages of this library's
    recipe as ``plan.dryrun`` composes its pipeline: layer-stage k's forward with the send
    of its output (none from the last), its backward with the send of its input's
    gradient (none from the first), each send priced once, on the sender, on its own link
    (``links[r]``: a crossing of pipeline rank r -> r + 1; layer-stage k sits on rank
    k mod pp); the embedding on the first layer-stage and the head and loss on the last,
    not spread over a rank's v chunks.  ``rows``: per pipeline rank, its stage dict
    (``edge``: the (forward, total) seconds of the embedding or the head it holds;
    ``crossings``: the (forward, backward) seconds of sends inside it, taken out here)."""
    pp, v = lay.pp, lay.v
    n = pp * v
    f, b = [0.0] * n, [0.0] * n
    for r, d in enumerate(rows):
        ef, et = d["edge"]
        sf, sb = d["crossings"]
        cf = (d["forward"] - ef - sf) / v
        cb = (d["time"] - d["forward"] - (et - ef) - sb) / v
        for c in range(v):
            k = c * pp + r                 # parallel.schedules' layer-stage of chunk c
            edge = (r == 0 and c == 0) or (r == pp - 1 and c == v - 1)
            f[k] = max(0.0, cf + (ef if edge else 0.0) + (links[r] if k < n - 1 else 0.0))
            b[k] = max(0.0, cb + (et - ef if edge else 0.0)
                       + (links[(r - 1) % pp] if k > 0 else 0.0))
    return f, b


def _dp_nodes(lay: Layout, prof) -> int:
    """Nodes the first stage's data-parallel group spans (``Layout.grad_ranks``): the
    widest collective group of a layout (tensor parallelism stays inside a node)."""
    return len({r // prof.devices_per_node for r in lay.grad_ranks(0, 0)})


def _stage_name(s: int, pp: int, uneven: bool) -> str:
    """The key of stage ``s`` in ``details["stages"]``."""
    if pp == 1:
        return "only"
    if s in (0, pp - 1):
        return "first" if s == 0 else "last"
    return f"stage {s}" if uneven else "middle"


def _stage_kinds(pp: int, uneven: bool = False) -> list[tuple[str, int, int]]:
    """(name, a representative stage, how many stages are like it): uneven stages each
    their own."""
    if uneven:
        return [(_stage_name(s, pp, True), s, 1) for s in range(pp)]
    if pp == 1:
        return [("only", 0, 1)]
    out = [("first", 0, 1), ("last", pp - 1, 1)]
    return out + ([("middle", 1, pp - 2)] if pp > 2 else [])


def _p2p(cfg, lay: Layout, prof) -> tuple[list, float]:
    """(seconds of one activation (or gradient) crossing on each link, bytes of one
    crossing): ``links[r]`` is pipeline rank r -> r + 1 (and, interleaved, pp - 1 -> 0:
    chunks cross it too), each priced on its own ranks, so that with fewer than a node's
    devices per stage (tp x dp x cp below it) a crossing inside a node is NVLink's and one
    leaving it the network's (was: every crossing at the slowest link's price, one
    inter-node crossing of 15 charged on all of them; plan_random_layouts.py).
    Megatron-LM's scatter/gather (module docstring) where tp > 1 without sequence
    parallelism; this library's recipe (framework "workbench") has none: each TP rank
    sends its whole replicated activation to its peer (``Hybrid``'s stage send,
    ``sim_mesh.collectives.send_recv`` of the stage output's local tensor), measured on
    the dry run's trace (Llama 2 7B, tp 8, pp 2 across two 910B nodes: 1.352 ms a crossing
    against 0.331 ms priced as scatter/gather)."""
    n = 2 * cfg.seq_len * lay.micro_batch * cfg.d_model
    ends = [(s, s + 1) for s in range(lay.pp - 1)] + ([(lay.pp - 1, 0)] if lay.v > 1 else [])
    # every TP / CP / DP rank sends to its peer at once: the crossing is its slowest pair's
    # (C.crossing_price; was the t = d = c = 0 pair's, NVLink's where a stage straddling
    # two nodes sends some of its pairs across: tp 2, dp 3, pp 2 on 8-GPU nodes)
    pairs = [lay.crossing_pairs(a, b) for a, b in ends]
    if lay.tp > 1 and not lay.sp and lay.engine == "workbench":
        return [C.crossing_price(n, ps, prof) for ps in pairs], n
    gather = sent = 0.0
    if lay.tp > 1 and not lay.sp:
        gather = C.group_price("all_gather", n, tuple(lay.tp_ranks()), prof)
        sent = wire_bytes("all_gather", n, lay.tp)
    return [C.crossing_price(n / lay.tp, ps, prof) + gather
            for ps in pairs], n / lay.tp + sent


def _loss_count(lay: Layout, prof) -> tuple[float, float]:
    """(seconds, bytes sent) per micro-batch of this library's cross-entropy's global
    target count on the last stage: an all-reduce of one int64 over each mesh dim the
    targets are sharded on, dp then cp, one after the other (each sums the last's),
    before the loss divides by it (``parallel/ops_table/cross_entropy.py``,
    ``_cross_entropy_local``), so exposed; on the dry run's trace a "small" Llama of one
    layer at dp 16 on two A100 nodes: 27.5 us a micro-batch, the estimate 1.21x below it
    without (``benchmarks/plan_random_layouts.py`` seed 13).  Other frameworks: none here
    (Megatron-LM's loss is local to the rank; its logging average over dp is not priced)."""
    if lay.engine != "workbench":
        return 0.0, 0.0
    last = lay.pp - 1
    t = sent = 0.0
    for n, ranks in ((lay.dp, [lay.rank(0, d, last, 0) for d in range(lay.dp)]),
                     (lay.cp, [lay.rank(0, 0, last, c) for c in range(lay.cp)])):
        if n > 1:
            t += C.group_price("all_reduce", 8, tuple(ranks), prof)
            sent += wire_bytes("all_reduce", 8, n)
    return t, sent


def _loss_lead(cfg, lay: Layout, head, edge) -> tuple:
    """(forward, backward) seconds of the last stage that run beside ZeRO-3's backward
    prefetch, which this library's recipe issues as the forward's last module ends
    (``zero_cost.zero_exposed``'s ``lead``): the loss (the logits' cast and the
    cross-entropy, forward and backward); where ZeRO's group is the cp group
    (``ep_cp.shares_zero_stream``) the cross-entropy's count all-reduce on that group
    (``parallel/ops_table/cross_entropy.py`` ``_cross_entropy_local``) queues behind the
    prefetch, so only what runs before it beside it: the cast, and a tied head's GEMM (its
    weight is the embedding module's: the last module is the final norm, the prefetch
    starts as it ends); the cross-entropy and the cast's backward then run before the
    head's backward (its pre-backward hook prefetches on), measured on the dry run's
    trace (tests/test_zerocp3.py).  Returns (lead, beside) for ``zero_exposed``."""
    # a tied head's GEMM beside the prefetch wherever the loss runs beside it too (dp >= 2
    # with cp >= 2: the count's groups are not ZeRO's dp x cp one); was left before the
    # prefetch, measured on the dry run's trace (GPT dp 2 cp 4 ZeRO-3: the final norm ends
    # and the prefetch starts at 968 us, the head's 133 us GEMM beside it; the estimate
    # started it 146 us later, dry run / estimate 0.948, tests/test_zerocp5.py)
    head_f = head.fwd_compute if cfg.tie_embeddings and lay.pp == 1 else 0.0
    if _loss_queues(lay, cfg.tie_embeddings):
        return (edge["loss"][0] + head_f, edge["loss"][1]), edge["cast"][0] + head_f
    return (edge["loss"][0] + head_f, edge["loss"][1]), None


def _loss_queues(lay: Layout, tied: bool) -> bool:
    """Whether this library's loss splits around ZeRO's backward prefetch (``_loss_lead``'s
    ``beside``): its count all-reduce queues behind the prefetch on ZeRO's stream while
    the ops before it run beside.  Where ZeRO's group is the cp group
    (``ep_cp.shares_zero_stream``); and with a tied head on one stage at ZeRO-3 where the
    count's group is ZeRO's (``ep_cp.loss_waits``: dp alone): the head's GEMM belongs to
    the embedding module, so the last module to end is the final norm and the prefetch is
    issued then (``parallel/strategies/zero3_clock.py``), before the cross-entropy's
    all-reduce (dry run's trace, GPT dp 2 ZeRO-3: the prefetch from 674 us, the
    all-reduce at 1350 us behind it; tests/test_zerocp4.py)."""
    if lay.engine != "workbench":
        return False
    return EC.shares_zero_stream(lay) or (tied and lay.pp == 1 and lay.zero == 3
                                          and EC.loss_waits(lay))


def _dp_sync(psi, lay: Layout, prof, stage: int, blocks, overlap: bool = True,
             overlap_grad_reduce: bool = False, grad_bytes: int = 2,
             head_live: bool = True, side=None, lead=((0.0, 0.0), None)):
    """(exposed seconds, bytes sent) of the data-parallel synchronisation of a stage
    (module docstring); ZeRO-2/3: per micro-batch on one comm stream against the
    ``blocks`` of the stage (``zero_cost``); ``overlap=False`` exposes them whole.
    ``overlap_grad_reduce`` (ZeRO-0/1, Megatron-LM's --overlap-grad-reduce and
    --overlap-param-gather): the gradients reduced module by module during the last
    micro-batch's backward, ZeRO-1's updated weights gathered beside the next step's
    first forward (all gathers issued at once), on the same stream model.
    ``grad_bytes``: bytes per gradient element reduced (``frameworks.grad_reduce_bytes``:
    Megatron-LM reduces bf16 models' gradients in fp32); gathered weights are 16-bit.
    ``head_live``: the head's weight is still gathered when the loss is computed (tied
    to the embedding); if not, this library's recipe re-gathers it before the loss and
    the loss waits behind the backward's prefetch (``zero_cost``'s ``loss_waits``).
    ``side``: (seconds added to a gather of n elements, to a reduce-scatter of n: the
    copies FSDP2 runs in series with them; the indices of the blocks kept gathered from
    forward to backward), ``fsdp2_cost.stage_copies``.  ``lead``: ((the loss's forward,
    backward) seconds, run beside ZeRO-3's backward prefetch where it does not wait for it
    (this library's recipe: ``zero_cost.zero_exposed``'s ``lead``; ``ep_cp.loss_waits``
    says when the loss waits), the seconds of it before the loss's collective where that
    waits and ZeRO's group is the cp group, else None) (``_loss_lead``)."""
    if lay.dp * lay.cp == 1:
        return 0.0, 0.0
    ranks = tuple(lay.grad_ranks(0, stage))      # dp x cp ranks (``plan.ep_cp``)
    g, dp, m = grad_bytes * psi, len(ranks), lay.m
    priced = {}     # group_price's cache key hashes all the ranks: ask it once per size

    def p(kind, nbytes=g):
        t = priced.get((kind, nbytes))
        if t is None:
            t = priced[kind, nbytes] = C.group_price(kind, nbytes, ranks, prof)
        return t

    ag_x, rs_x, stay = side if side else (lambda n: 0.0, lambda n: 0.0, ())

    def gather(n):
        return p("all_gather", 2 * n) + ag_x(n)

    w = 2 * psi                                   # the 16-bit weights
    rs, ag = wire_bytes("reduce_scatter", g, dp), wire_bytes("all_gather", w, dp)
    if lay.zero <= 1 and overlap_grad_reduce:
        kind = "all_reduce" if lay.zero == 0 else "reduce_scatter"
        r = overlap_rate(prof, ranks)    # the SMs NCCL holds for this group
        _, bwd = Z.zero_exposed(blocks, 2, gather, lambda n: p(kind, grad_bytes * n), rate=r)
        if lay.zero == 0:
            return bwd, wire_bytes("all_reduce", g, dp)
        # Megatron-core gathers one bucket ahead (``_finish_param_sync_helper``: "We
        # can't pre-launch all-gathers for all buckets at once", f2e5db402c), the first
        # from zero_grad, just before the forward; a block is one of its buckets on the
        # first stage with ZeRO-1 (plan.megatron_buckets), else a layer
        ahead = 1 if lay.engine == "megatron" else float("inf")
        fwd, _ = Z.zero_exposed(blocks, 3, gather, lambda n: 0.0,
                                prefetch_numel=ahead, rate=r)
        return bwd + fwd, rs + ag
    if lay.zero == 0:
        return p("all_reduce"), wire_bytes("all_reduce", g, dp)
    if lay.zero == 1:
        return p("reduce_scatter") + p("all_gather", w), rs + ag
    if not overlap:
        blocks = [dataclasses.replace(b, fwd=0.0, bwd=0.0, remat=0.0, wait_fwd=0.0,
                                      wait_bwd=0.0, after_fwd=(), after_bwd=(),
                                      after_remat=(), shared=(0.0, 0.0)) for b in blocks]
    bucket = Z.REDUCE_BUCKET_NUMEL if lay.engine == "deepspeed" else None
    # FSDP2: one block ahead (a budget of one element: ``_prefetch`` issues one block)
    ahead = F.FSDP_PREFETCH_UNITS if lay.engine == "fsdp" else Z.PREFETCH_NUMEL
    # the recipe's loss waits for the backward's prefetch where its count's all-reduce is
    # on ZeRO's group (ep_cp.loss_waits), else runs beside it (lead)
    # (with a tied head too where ZeRO's group is the cp group: the backward's prefetch is
    # issued as the head's forward ends, before the loss's count all-reduce on that group,
    # ep_cp.shares_zero_stream; measured on the dry run's trace, tests/test_zerocp3.py;
    # and at ZeRO-3 with dp alone, the prefetch issued as the final norm ends:
    # _loss_queues, tests/test_zerocp4.py)
    shared = _loss_queues(lay, head_live)
    waits = lay.engine == "workbench" and (not head_live or shared) and EC.loss_waits(lay)
    recipe3 = lay.engine == "workbench" and lay.zero == 3 and (not waits or shared) \
        and overlap
    fwd, bwd = Z.zero_exposed(blocks, lay.zero, gather,
                              lambda n: p("reduce_scatter", grad_bytes * n) + rs_x(n),
                              rate=overlap_rate(prof, ranks) if overlap else 1.0, bucket=bucket,
                              prefetch_numel=ahead, loss_waits=waits,
                              stay=stay, regather=lay.engine == "workbench"
                              and lay.recompute in ("full", "op"),
                              lead=lead[0] if recipe3 else (0.0, 0.0),
                              beside=lead[1] if recipe3 and waits else None)
    if lay.zero == 2:       # then the updated 16-bit weights, gathered once per step
        # (fwd: the cp exchange's waits where it shares ZeRO's stream, else 0)
        return m * (fwd + bwd) + p("all_gather", w), m * rs + ag
    again = wire_bytes("all_gather", w - 2 * sum(blocks[i].numel for i in stay), dp)
    return m * (fwd + bwd), m * (ag + again + rs)


def _hide_in_pipeline(stages, lay: Layout, prof, grad_bytes: int,
                      overlap_grad_reduce: bool, links) -> None:
    """Megatron-LM's (and DeepSpeed's pipeline engine's) sync on stages after the first,
    less the pipeline's slack (``stage_sync``), the stages before it each with its own
    crossings on ``links`` (``_rows``): each such stage's ``dp`` replaced."""
    rows = _rows(lay, stages, links)   # each stage's own crossings (was: every middle
    fwd = [d["forward"] for d in rows]     # stage's slack summed with the slowest middle
    bwd = [d["time"] - d["forward"] for d in rows]      # stage's)
    for d in stages.values():
        if d["stage"] > 0:
            sf, sb = S.slacks(d["stage"], fwd, bwd)
            d["dp"] = S.after_flush(d["psi"], lay, prof, d["stage"], grad_bytes, sf, sb,
                                    overlap_grad_reduce) + d["expert_dp"]   # MoE: whole


def layer_for(cfg, lay: Layout, prof, attention: str, fp8: bool = False,
              tp_comm_overlap: bool = False, async_allreduce: bool = True,
              transformer_engine: bool = False):
    """One layer's ``costs.LayerCost`` for one micro-batch on a rank of ``lay``, as
    :func:`estimate` prices it (``prof``: the profile it prices on), with EP and CP
    (``plan.ep_cp``) or without; ``async_allreduce=False``: ``plan.megatron_2021``;
    ``transformer_engine``: Megatron-LM's TE spec (``layer_cost.TE_SOURCES``)."""
    if EC.applies(cfg, lay):
        if transformer_engine:
            raise ValueError(f"layout {lay.short()}: transformer_engine=True is modeled "
                             f"for Megatron-LM's dense GPT layer (layer_cost.TE_SOURCES), "
                             f"not with expert / context parallelism: give "
                             f"transformer_engine=False")
        _check_ep_cp_async(lay, async_allreduce)
        return EC.layer_cost(cfg, lay, prof, attention, fp8)
    return C.layer_cost(cfg, lay.micro_batch, lay.tp, lay.sp, lay.recompute, prof, attention,
                        fp8, tp_comm_overlap and lay.tp > 1, async_allreduce or lay.tp == 1,
                        lay.engine != "workbench",   # the recipe: 16-bit param.grad,
                        # torch.utils.checkpoint's early stop: the recipe's and torchtitan's
                        # (non-reentrant; torchtitan_breakdown's "relative errors")
                        lay.engine in ("workbench", "fsdp"),
                        split_qkv=lay.engine == "workbench",    # the GPT's wq, wk, wv;
                        # torchtitan's DTensor TP keeps the gathered input: no re-gather
                        regather=_regather(cfg, lay), transformer_engine=transformer_engine)


def check_runs(model, layout, cluster, attention: str, fp8: bool = False,
               overlap_grad_reduce: bool = False, tp_comm_overlap: bool = False) -> None:
    """Raise ValueError naming the fix where the layout's framework does not run it with
    these options (beyond ``check_layout``): expert / context parallelism's
    (``ep_cp.check_estimate``), Megatron-LM's TP overlap's (``tp_overlap``), DeepSpeed's
    pipeline engine's (``deepspeed_step.check``)."""
    EC.check_estimate(model, layout, attention, fp8, overlap_grad_reduce)
    TPO.check_estimate(model, layout, cluster.profile, fp8, tp_comm_overlap,
                       EC.applies(model, layout))
    if layout.engine == "deepspeed" and layout.pp > 1:
        DS.check(model, layout, overlap_grad_reduce)    # its pipeline engine: deepspeed_step
    if EC.applies(model, layout):
        # DeepSpeed's layers run no async TP all-reduce (megatron_2021.resolve)
        _check_ep_cp_async(layout, M21.resolve(layout, None, None)[0])


def _check_ep_cp_async(lay: Layout, async_allreduce: bool) -> None:
    """Expert / context parallelism is priced with the asynchronous TP all-reduce only."""
    if not async_allreduce and lay.tp > 1:
        raise ValueError(f"layout {lay.short()}: expert / context parallelism is priced "
                         f"with Megatron-LM's asynchronous TP all-reduce (2021-09 on); "
                         f"async_tensor_model_parallel_allreduce=False is not modeled there: "
                         f"leave it None, or use tp=1")


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
