"""``dry_run(model, layout, cluster)``: the real code on the meta device, any mesh size.

    cfg = wb.models.get_config("gpt3-175b")
    dr  = wb.plan.dry_run(cfg, wb.plan.Layout(dp=8, tp=8, pp=16, micro_batch=1,
                          global_batch=1536, recompute="full"), wb.plan.Cluster("a100", 1024))
    dr.step_time, dr.memory, dr.fits, dr.trace, dr.timeline     # as wb.plan.estimate's

What runs for real (no data allocated: every tensor is on the meta device, so only
shapes, dtypes and placements exist):

1. the model (``models.gpt.GPT`` or ``models.llama.Llama``) is built, split into
   pipeline stages and parallelized by the library's own ``Hybrid`` recipe (the one
   ``python -m workbench train`` uses: its TP plan, Megatron's f and g, sequence
   parallelism, vocabulary-parallel embedding and head) on the simulated stage meshes
   (rank = t + tp (d + dp s), Megatron's order, as ``plan.layout``), and its optimizer
   is built by the same recipe (``DataParallel`` / ZeRO over dp); with ``Layout(ep=)``
   a MoE model runs ``Hybrid(ep=)`` (its experts' own optimizer over the expert-data-
   parallel ranks, tokens routed on meta by :mod:`.meta_moe`), with ``Layout(cp=)``
   ``ContextParallel`` (ring attention): :mod:`.dryrun_ep_cp`, which also says what of
   them is refused and what the runtime keeps that the planner does not count;
2. ONE micro-batch forward and backward of each DISTINCT pipeline stage (the first,
   one middle stage standing for all the middle ones, which have the same layers and
   mesh shape, and the last; every stage when ``layout.stages`` makes them uneven, which
   the recipe then splits so: ``Hybrid(stage_sizes=...)``; :mod:`.meta_run`) under
   one trace: every op the real code
   dispatches priced forward and backward from the op table, every collective it
   issues priced on the profile's topology;  the bytes autograd saves per rank;  the
   stage output's send to the next stage (the pipeline executor's ``_send``);
3. the stages' optimizer steps, which issue the data-parallel gradient all-reduce (or
   ZeRO's reduce-scatter and all-gather) as ``DataParallel.step`` does.

What is composed from those measurements (not run op by op):

- ``comm_bytes``: per pipeline rank, each chunk's measured collectives and sends times
  m, with the backward's gradient sends (not run: the stage's backward starts from an
  empty gradient) counted as the mirror of the forward's, plus its optimizer step's;

- the pipeline: ``parallel.schedules.simulate`` of the layout's schedule (m
  micro-batches) with each stage's measured forward and backward, the send of its
  output added to its forward and of its input gradient to its backward (Megatron's
  p2p is blocking in the 1F1B steady state), each on its own link (a middle stage not
  run: its representative's bytes priced on its own ranks, ``_send_seconds``);
- step time = the pipeline's makespan + the slowest stage's measured optimizer-step
  collectives + its AdamW update (priced as the planner does for framework
  "workbench", 28 bytes per updated parameter on the roofline, ``plan.optimizer_step``
  and ``sim_mesh.optimizer_cost``, in place of the update the
  trace would record: ``parallel.step_clock.unpriced``) + with
  pp > 1 and tied embeddings, Megatron's all-reduce of the word-embedding gradient
  between the first and last stage (priced on their ranks);
- memory per pipeline rank: model states from the real sharded parameters (sizes of
  the meta shards the optimizer holds, ``DataParallel.memory(mixed_precision=True)``
  for a 16-bit model: 2-byte weights and gradients, 12 bytes of fp32 master weights and
  Adam states per parameter held; a float32 model: 4, 4 and 8) + the measured
  activation bytes of one micro-batch of each chunk the rank holds, times how many of
  them the schedule keeps in flight at its peak (+ on a forward, - when its backward
  ends, walked in the rank's schedule order); ``timeline`` is those bytes over the
  simulated step, per pipeline rank; with ZeRO-3 (pp = 1 only), the working copies the
  recipe gathered, as its own ledger (``Zero3.live``, :mod:`..parallel.strategies.
  zero3_clock`) measured them over the stage's forward and backward: its peak is added
  to ``buffers`` (the key ``plan.memory`` keeps beside ZeRO's partitioned states) and the
  ledger is kept in ``gathered`` (its ``timeline`` on the modeled
  clock), plus one layer's whole 16-bit gradient before its reduce-scatter (not in the
  ledger: an assumption, as ``plan.memory``); ``workspace``, the transient peak beyond
  the saved tensors (the loss's fp32 copies, a recomputed layer), is priced by
  ``plan.memory.workspace_bytes``, not measured here; ``comm_buffers``, NCCL's / HCCL's
  device buffers for the layout's communicators, is ``plan.comm_memory``'s model (the
  simulated collectives allocate none).  On the small GPT of tests/test_dryrun.py
  the peak is every module at once (157 MB: the tied embedding's 105 MB and the rest,
  within one prefetch of 5e7 elements); at GPT-3's layer shape on tp 8, fc1 and fc2
  (302 MB).

The dry run runs THIS library's recipe whatever the layout's ``framework`` (None or
"workbench"; another is refused), while ``plan.estimate`` of a layout left at
``framework=None`` prices Megatron-LM (ZeRO 0/1) or DeepSpeed (ZeRO 2/3): compare it with
``layout.replace(framework="workbench")`` (``plan.agree.compare`` does, and reports the
difference the layout's own framework makes as ``framework_gap``).  They differ by design
there: Megatron-LM's fp32 ``main_grad`` buffer (2 bytes per parameter in ``buffers``),
its in-place vocabulary-parallel cross-entropy (``workspace``: 2 bytes per logit beside
the saved fp32 softmax, where this recipe's ``F.cross_entropy`` on upcast logits holds 8,
and its vocabulary-parallel path 10: ``frameworks.loss_extra_bytes``, read by both
sides), DeepSpeed's ZeRO-3 buckets and persistence threshold.  Llama 3 8B on 8 H100s, dp
8, ZeRO-3, micro-batch 1: 75.6 GB here against 70.9 GB estimated for DeepSpeed, of which
6 x 8192 x 128256 = 6.3 GB is the loss.

Against ``plan.estimate(..., attention="flash")`` (tests/test_dryrun.py): memory agrees
within 5% on every layout tried (TP, SP, PP, interleaved, recompute, ZeRO 1-3); step
time within 10% on each of them, ZeRO-2 and ZeRO-3 with and without TP included
(0.965-1.040 on 14 layouts), and ZeRO's own share of the step within 2%.
The Llama's ``recompute="op"`` (torchtitan's op-level policy, run by PyTorch's selective
checkpointing: ``models.op_sac``; ``meta_run`` counts what the policy saves and prices
only the kernels that re-run) against the estimate (tests/test_plan_llama.py, five
layouts): step 0.990-1.059 (no recompute on the same layouts: 1.00-1.04), memory within
1% beyond the simulator's unfused final norm.  With sequence parallelism the dry run
re-runs the attention branch's reduce-scatter and keeps neither branch output, where
torchtitan saves ``reduce_scatter_tensor``'s outputs (the estimate): the simulator's
collective is no aten op the policy can save (tp 4: 1.037 against 1.001 without
recompute).  With ZeRO-3 the recompute's module-by-module gathers, issued in forward
order as the block's backward starts, without prefetch, are exposed in the recipe; the
estimate of framework "workbench" prices that order (``zero_cost``'s ``regather``, the
recipe's modules and per-parameter reduce-scatters: ``zero_cost.recipe_blocks``; GPT
22B, dp 8, full recompute: 1.078 -> 0.999).
ZeRO-2/3 as DeepSpeed runs them (``plan.zero_cost``): gradients reduce-scattered every
micro-batch and waited for at its end, so the tied word embedding's gradient, complete
only after the embedding's backward, is an exposed tail of every micro-batch.
As in Megatron-LM, a column-parallel linear's input-gradient all-reduce (sequence
parallel: reduce-scatter) runs beside its weight-gradient GEMM
(``strategies.tensor_parallel``: the op table records a matmul's backward as dgrad then
wgrad), as ``plan.layer_cost`` prices it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..parallel import schedules as S
from ..recipes.hybrid import Hybrid      # the dense recipe (built by dryrun_ep_cp.recipe)
from ..parallel.step_clock import unpriced
from ..sim_mesh.cost import price
from . import optimizer_step as OS
from ..sim_mesh.trace import trace as _trace
from .layout import Cluster, Layout, check_layout
from . import dryrun_ep_cp as _ep_cp
from .meta_moe import use_meta_routing
from .memory import workspace_bytes
from .comm_memory import comm_buffer_bytes
from .ep_cp import token_cfg
from .meta_run import is_meta, run_stage

__all__ = ["DryRun", "dry_run"]

_MIXED = ("bfloat16", "float16")          # mixed precision: fp32 master weights and Adam


@dataclass(frozen=True)
class DryRun:
    """What :func:`dry_run` measured and composed (module docstring)."""
    layout: Layout
    step_time: float              # seconds per optimizer step
    memory: dict                  # bytes on the busiest rank, keys as Estimate.memory
    fits: bool                    # memory["total"] <= the profile's usable memory
    # the Trace of the real runs (step 2 and 3); not compared: two equal dry runs are
    # equal (their numbers, timelines and stages), each with its own trace and ledgers
    trace: object = field(repr=False, compare=False)
    timeline: dict = field(repr=False)     # per pipeline rank: times, bytes (module doc)
    stages: dict = field(repr=False)       # per distinct stage: what was measured
    per_rank: list = field(repr=False)     # memory dict per pipeline rank
    breakdown: dict = field(repr=False)    # seconds: pipeline, dp_sync, optimizer, tied
    pipeline: object = field(repr=False, compare=False)   # the schedule simulator's result
    comm_bytes: int = 0                    # bytes the busiest rank sends per step
    gathered: dict = field(default_factory=dict, repr=False,
                           compare=False)  # ZeRO-3: stage -> its ledger
    framework: str = "workbench"           # what ran: this library's recipe (module doc)
    # seconds of layer-stage c's send to c + 1, on its own link (``_send_seconds``)
    sends: list = field(default_factory=list, repr=False)

    def __str__(self):
        gb = self.memory["total"] / 1e9
        return (f"dry run {self.layout.short()} (this library's recipe): "
                f"{self.step_time:.3f} s/step, peak "
                f"{gb:.2f} GB per rank ({'fits' if self.fits else 'does NOT fit'})")


def _check(model, lay: Layout, cl: Cluster, routing="balanced", seed=0):
    from ..models.config import ModelConfig
    if isinstance(seed, bool) or not isinstance(seed, int):
        # what torch.manual_seed takes, checked before anything is built (was: its
        # RuntimeError "manual_seed expected a long" from inside the model's construction)
        raise ValueError(f"dry_run: seed={seed!r} must be an int (the model's "
                         f"initialisation seed, as torch.manual_seed takes), e.g. seed=0")
    if not isinstance(model, ModelConfig):
        raise ValueError(f"dry_run: model={model!r} must be a ModelConfig, e.g. "
                         f"wb.models.get_config('llama3-8b') or "
                         f"wb.plan.presets.get_config('mixtral-8x7b')")
    if not (isinstance(routing, str) and routing == "balanced") and not (
            getattr(model, "moe_experts", 0) and isinstance(lay, Layout) and lay.ep > 1):
        raise ValueError(f"dry_run: routing={routing!r} sets a MoE's rows per expert over "
                         f"ep > 1 ranks, but the model has moe_experts="
                         f"{getattr(model, 'moe_experts', 0)} and layout ep="
                         f"{getattr(lay, 'ep', None)}; leave routing='balanced'")
    if isinstance(lay, Layout) and lay.framework not in (None, "workbench"):
        raise ValueError(f"dry_run: layout framework={lay.framework!r}; the dry run runs "
                         f"this library's own Hybrid recipe: give framework='workbench' "
                         f"(or None), and compare it with estimate(..., "
                         f"layout.replace(framework='workbench'))")
    if isinstance(lay, Layout) and lay.recompute_num_layers != 1:
        raise ValueError(f"dry_run: layout recompute_num_layers={lay.recompute_num_layers}; "
                         f"the course's blocks checkpoint one block each (plan."
                         f"recompute_chunks), so the dry run cannot run chunks of layers: "
                         f"give recompute_num_layers=1, or use wb.plan.estimate")
    if getattr(model, "arch", None) in ("gpt", "llama") and model.dtype in _MIXED:
        # the planner's checks, same errors, of the layout as the runtime runs it
        own = isinstance(lay, Layout) and lay.framework is None
        check_layout(model, lay.replace(framework="workbench") if own else lay, cl)
    else:
        if not isinstance(lay, Layout) or not isinstance(cl, Cluster):
            raise ValueError("dry_run(model, layout, cluster): give a wb.plan.Layout and a "
                             "wb.plan.Cluster")
        if lay.world != cl.devices:
            raise ValueError(f"Layout dp x tp x pp x cp = {lay.dp} x {lay.tp} x {lay.pp} x "
                             f"{lay.cp} = {lay.world} but the cluster has devices="
                             f"{cl.devices}; make them equal")
    _ep_cp.check(model, lay)                   # MoE and cp: what the runtime runs


def _distinct(n: int, uneven: bool = False) -> dict[int, int]:
    """layer-stage -> the stage that is run for it (first, one middle, last; uneven
    stages: each itself)."""
    rep = {0: 0, n - 1: n - 1}
    for s in range(1, n - 1):
        rep[s] = s if uneven else 1
    return rep


def _send_seconds(h, c: int, d: dict, prof) -> float:
    """Seconds of layer-stage ``c``'s send to c + 1: as measured where ``c`` was run
    (``d``, its measurement, is its own), else the representative's bytes per sender
    priced on ``c``'s own pairs of ranks, each sender to its peer at once as the trace's
    sends run (``schedules.execute._send``): a middle stage stands for the others' layers,
    not for their links (was: stage 1's send on every middle crossing, an intra-node one
    for an inter-node one with tp 4, pp 4 on 8-GPU nodes; plan_random_layouts.py)."""
    n = len(h.stage_layers)
    if c == n - 1:
        return 0.0
    if d["stage"] == c:
        return d["send"]
    pairs = [(a, b) for a, b in zip(h.meshes[c % h.pp].ranks, h.meshes[(c + 1) % h.pp].ranks)
             if a != b]
    return max((price("send_recv", d["send_pair_bytes"], pair, prof) for pair in pairs),
               default=0.0)


def _peak_and_timeline(sched, sim, act):
    """Per pipeline rank: peak activation bytes, and (times, bytes) over the step.
    ``act[stage]``: one micro-batch's bytes of that layer-stage on its rank."""
    peaks, timeline = [], {}
    for r, row in enumerate(sched.actions):
        cur, peak, pts = 0, 0, [(0.0, 0)]
        for a, t0, t1 in zip(row, sim.starts[r], sim.ends[r]):
            st = sched.stage(r, a.chunk)
            if a.kind == "F":
                cur += act[st]
                pts.append((t0, cur))
            elif a.kind == ("W" if sched.split_backward else "B"):
                cur -= act[st]
                pts.append((t1, cur))
            peak = max(peak, cur)
        peaks.append(peak)
        timeline[r] = {"times": [p[0] for p in pts], "bytes": [p[1] for p in pts]}
    return peaks, timeline


def dry_run(model, layout: Layout, cluster: Cluster, seed: int = 0,
            routing="balanced") -> DryRun:
    """Run ``model`` (a ModelConfig) with ``layout`` on ``cluster`` on the meta device
    (module docstring); the same arguments as ``wb.plan.estimate``.  ``routing``: a MoE's
    rows per expert on meta tensors ("balanced", the planner's assumption, or per-rank
    counts: :mod:`.meta_moe`)."""
    _check(model, layout, cluster, routing, seed)
    lay, prof = layout, cluster.profile
    cfg = model.replace(recompute=lay.recompute)
    h = _ep_cp.recipe(lay)         # Hybrid (with ep for a MoE) or ContextParallel
    h.device, h.profile = torch.device("meta"), prof
    h.check(cfg, lay.global_batch)
    with torch.random.fork_rng(devices=[]):
        mdl = h.build_model(cfg, seed)
        layer_numel = _layer_numel(mdl, h)              # per rank, before any ZeRO split
        opts = _ep_cp.stage_optimizers(h, h.build_optimizer(mdl, lr=1e-4, weight_decay=0.0),
                                        mdl)
    if getattr(h, "ep", 1) > 1:                         # MoE routing on meta (plan.meta_moe)
        use_meta_routing(mdl, cfg, lay.micro_batch, routing)
    if not is_meta(mdl):
        raise RuntimeError("dry_run: a parameter of the built model is not on the meta "
                           "device; the dry run would allocate it (a bug in the model's "
                           "construction under `with torch.device('meta')`)")
    n = len(h.stage_layers)
    rep = _distinct(n, lay.stages is not None)
    measured, opt_t = {}, {}
    with _trace(prof) as tr:
        stage_bytes, step_bytes = {}, {}          # per distinct stage: bytes per rank
        for s in sorted(set(rep.values())):
            b0 = tr.bytes_per_rank()
            measured[s] = run_stage(h, mdl, s, cfg, lay.micro_batch, tr,
                                    h._stage_params(mdl, s))
            stage_bytes[s] = _minus(tr.bytes_per_rank(), b0)
        for s in sorted(set(rep.values())):
            b0 = tr.bytes_per_rank()
            ranks = h.meshes[s % lay.pp].ranks
            t0 = max(tr.now(r, "comm") for r in ranks)
            t0 = max(t0, max(tr.now(r) for r in ranks))
            with unpriced():                 # the update: priced below, as the planner
                for o in opts[s]:            # the DP / ZeRO collectives, as issued
                    o.step()                 # (with ep: the dense layers', the experts')
            t1 = max(max(tr.now(r), tr.now(r, "comm")) for r in ranks)
            mixed = cfg.dtype in _MIXED
            # a middle stage of 0 layers has no optimizer: no state, no sync, no update
            mem = _sum_memory([o.memory(mixed_precision=mixed) for o in opts[s]],
                              lay.dp // lay.ep, lay.zero)
            upd = mem.optimizer / (12 if mixed else 8)    # parameters this rank updates
            # the recipe's step (plan.optimizer_step, as the estimate of "workbench"):
            # no pass over the whole gradient buffer, so psi = upd
            opt_t[s] = {"sync": t1 - t0, "adamw": OS.step_seconds(
                            OS.passes(cfg, lay.replace(framework="workbench")), upd, upd, prof),
                        "states": mem,
                        "ledger": getattr(opts[s][0], "live", None) if opts[s] else None}
            step_bytes[s] = _minus(tr.bytes_per_rank(), b0)
    # ---- compose the step ------------------------------------------------------------
    st = [measured[rep[s]] for s in range(n)]
    sends = [_send_seconds(h, c, st[c], prof) for c in range(n)]
    f = [d["forward"] + sends[c] for c, d in enumerate(st)]
    # the exposed tail of the gradient reductions the backward's hooks issued (ZeRO-2/3's
    # reduce-scatters, DDP's buckets: meta_run.sync_tail), every micro-batch's, filed
    # under "dp_sync" as the estimate files it (estimate._dp_sync: ZeRO-2/3 "per
    # micro-batch on one comm stream", m x the exposed part); it was in "pipeline" (toy GPT
    # tp 8 dp 2 ZeRO-2 on 910Bs: the estimate's sync 157 us against the dry run's 47).
    # At pp 1 the step is unchanged (m backwards in a row); with pipelines the schedule
    # runs each backward without its tail
    tails = [d.get("sync_tail", 0.0) for d in st]
    b = [d["backward"] - tails[c] + (sends[c - 1] if c else 0.0) for c, d in enumerate(st)]
    sched = h._schedule(lay.m)
    sim = S.simulate(sched, f=f, b=b)
    # a pipeline rank reduces the gradients of every chunk it holds (interleaved: v)
    sync = max(sum(opt_t[rep[c]]["sync"] for c in _chunks(r, lay.pp, n))
               + lay.m * sum(tails[c] for c in _chunks(r, lay.pp, n))
               for r in range(lay.pp))
    adamw = max(sum(opt_t[rep[c]]["adamw"] for c in _chunks(r, lay.pp, n))
                for r in range(lay.pp))
    tied = 0.0
    if lay.pp > 1 and cfg.tie_embeddings:
        tied = price("all_reduce", 2 * cfg.vocab_size * cfg.d_model / lay.tp,
                     [lay.rank(0, 0, 0), lay.rank(0, 0, lay.pp - 1)], prof)
    step = sim.makespan + sync + adamw + tied
    # ---- memory per pipeline rank ----------------------------------------------------
    act = [d["activation_bytes"] for d in st]
    peaks, timeline = _peak_and_timeline(sched, sim, act)
    per_rank = []
    for r in range(lay.pp):
        mem = {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0}
        unreduced = 0.0
        for c in _chunks(r, lay.pp, n):
            ms = opt_t[rep[c]]["states"]
            mem["params"] += ms.params
            mem["grads"] += ms.grads
            mem["optimizer"] += ms.optimizer
        if lay.zero == 3 and lay.dp * lay.cp > 1:      # ZeRO shards over dp x cp
            # ZeRO-3's working copies (not optimizer state, not saved for backward): the
            # gathered weights the recipe's ledger (Zero3.live) measured at its peak over
            # the stage's forward and backward; plus one layer's whole 16-bit gradient
            # before its reduce-scatter (an assumption, as plan.memory: not in the ledger)
            item = torch.empty((), dtype=cfg.torch_dtype, device="meta").element_size()
            mem["buffers"] += sum(opt_t[rep[c]]["ledger"].peak for c in _chunks(r, lay.pp, n)
                                  if opt_t[rep[c]]["ledger"] is not None)
            unreduced = item * layer_numel
            mem["buffers"] += unreduced
        # the communication library's buffers: modeled (plan.comm_memory) for this
        # library's recipe's communicators, as the estimate with framework "workbench"
        mem["comm_buffers"] = comm_buffer_bytes(cfg, lay.replace(framework="workbench"), r,
                                                prof)["point"]
        mem["activations"] = peaks[r]
        # the transient peak beyond the saved tensors (the loss's fp32 copies on the
        # last stage, a recomputed layer), priced as plan.memory does for this library's
        # recipe (framework "workbench": the models' F.cross_entropy), not measured
        mem["workspace"] = workspace_bytes(token_cfg(cfg, lay),
                                           lay.replace(framework="workbench"), r, "flash",
                                           unreduced)
        mem["total"] = sum(mem.values())
        per_rank.append(mem)
    busiest = max(per_rank, key=lambda m: m["total"])
    comm = max(sum(lay.m * _chunk_bytes(c, n, rep, h, measured, stage_bytes)
                   + _stage_max(step_bytes[rep[c]], h, rep[c]) for c in _chunks(r, lay.pp, n))
               for r in range(lay.pp))
    return DryRun(layout=lay, step_time=step, memory=dict(busiest),
                  fits=busiest["total"] <= prof.usable_memory(), trace=tr, timeline=timeline,
                  stages=measured, per_rank=per_rank, pipeline=sim, sends=sends,
                  breakdown={"pipeline": sim.makespan, "dp_sync": sync, "optimizer": adamw,
                             "tied_embedding_sync": tied}, comm_bytes=int(comm),
                  gathered={s: d["ledger"] for s, d in opt_t.items()
                            if lay.zero == 3 and d["ledger"] is not None})


def _layer_numel(model, h) -> int:
    """Elements one rank holds of the largest transformer layer (tensor-parallel shards)."""
    from ..parallel.module import dist_parameters
    best = 0
    for i in {ls[0] for ls in h.stage_layers if ls}:     # a stage may hold none
        nd = h.meshes[0].ndim
        best = max(best, sum(math.prod(p._local.shape[nd:])
                             for _, p in dist_parameters(model.layers[i])))
    return best


def _sum_memory(mems, dp: int = 1, zero: int = 0):
    """One stage's optimizer memory: its dense and (expert parallelism) experts' states;
    none for a stage without parameters (no optimizer: a middle stage of 0 layers)."""
    if not mems:
        from ..parallel.strategies.data_parallel import MemoryReport
        return MemoryReport(params=0, grads=0, optimizer=0, n_params=0, dp=dp, stage=zero)
    if len(mems) == 1:
        return mems[0]
    import dataclasses
    return dataclasses.replace(mems[0], **{f: sum(getattr(m, f) for m in mems)
                                           for f in ("params", "grads", "optimizer",
                                                     "n_params")})


def _minus(after: dict, before: dict) -> dict:
    return {r: b - before.get(r, 0) for r, b in after.items() if b != before.get(r, 0)}


def _chunk_bytes(c: int, n: int, rep: dict, h, measured: dict, stage_bytes: dict) -> int:
    """Bytes one rank of layer-stage ``c`` sends per micro-batch: its own collectives
    (measured on its representative), the forward send to c + 1 and the receive-side
    bytes of the one from c - 1 (``meta_run``'s ``send_bytes``: the sender's and the
    receiving mesh's), and their mirrors that the backward runs and the trace does not:
    the gradient sent back to c - 1 (as c - 1's send) and received from c + 1."""
    s = rep[c]
    sent = measured[s].get("send_bytes", {})
    own = _stage_max({r: b - sent.get(r, 0) for r, b in stage_bytes[s].items()}, h, s)
    out = own
    if c < n - 1:        # the forward send, and the gradient's receive-side all-gather
        out += _stage_max(sent, h, s) + _stage_max(sent, h, s + 1)
    if c > 0:            # the forward receive, and the gradient sent back
        prev = measured[rep[c - 1]].get("send_bytes", {})
        out += _stage_max(prev, h, rep[c - 1] + 1) + _stage_max(prev, h, rep[c - 1])
    return out


def _stage_max(per_rank: dict, h, s: int) -> int:
    return max(per_rank.get(r, 0) for r in h.meshes[s % h.pp].ranks)


def _chunks(r: int, pp: int, n: int) -> list[int]:
    """The layer-stages pipeline rank r holds (r, r + pp, ...: interleaved chunks)."""
    return list(range(r, n, pp))
