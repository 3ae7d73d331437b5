"""How many collectives DeepSpeed ZeRO-3 runs in one step, and what each costs on the clock.

DeepSpeed's ``PartitionedParameterCoordinator`` (deepspeed/runtime/zero/
partitioned_param_coordinator.py, microsoft/DeepSpeed 38327e07f6) runs a module's
parameters through a trace recorded in the first step (each module's forward, then each
module again in backward, reverse order) and, from the second step on, for every module
in that trace (``fetch_sub_module``):

1. gathers those of its parameters not available, in ONE call (``__all_gather_params``
   -> ``all_gather_coalesced``, partition_parameters.py: one ``all_gather_into_tensor``
   per dtype into a flat buffer);
2. prefetches from the trace's parameter queue while the elements prefetched are fewer
   than min(stage3_max_live_parameters - available, stage3_prefetch_bucket_size) (1e9
   and 5e7 by default, runtime/zero/config.py), again as ONE coalesced call for the whole
   set; parameters already available are passed over without counting (their later
   use is marked as fetched for);
3. after the module ran, releases its parameters (``release_sub_module``) unless they
   are persistent (fewer than stage3_param_persistence_threshold, 1e5, elements: never
   partitioned) or the trace uses them again within stage3_max_reuse_distance (1e9)
   elements of the modules after it (``__params_to_release``), or the prefetcher has
   already passed a later use of them.

So at the turn from forward to backward the last modules stay gathered (their reuse is
near), the prefetcher runs through them into the backward's queue and gathers the
backward's next modules early; from then on gathered parameters stay near
stage3_max_live_parameters, the budget left for prefetching is what that limit leaves,
and the backward gathers one module at a time (GPT-3 175B, tp 8: forward 3 gathers a
layer, the projection and fc1 coalesced; backward 4; tests/test_zero3_count.py).

Gradients are reduce-scattered in buckets of ``reduce_bucket_size`` (5e8) elements
(stage3.py ``__reduce_and_partition_ipg_grads`` -> ``reduce_scatter_coalesced``,
runtime/comm/coalesced_collectives.py: one ``reduce_scatter`` per bucket), every
micro-batch.

:func:`zero3_collectives` replays that rule on a model's modules (``memory.zero3_modules``
's shapes: a GPT layer's LayerNorms, q, k, v, o, fc1, fc2; the tied head re-using the
word embedding) and prices every collective with the clock (``sim_mesh.topology.choose``,
NCCL's tuning model: per collective, base latency + (p - 1) ring steps x step latency,
the inter-node steps at the network's, + bytes / bus bandwidth; ``fixed_seconds`` is the
latency part).  It counts; the step's overlap is ``plan.zero_cost``'s (which gathers
block by block, one collective each: it does not coalesce a prefetch set, nor keep the
last modules for backward: the counts here say what that leaves out).  On GPT-3 175B
(A100, micro-batch 1, global batch 1,536) the collectives one after another come to 38.31 s a
step here and 39.32 s in the estimate at dp 256 / tp 4 on 1,024 GPUs, 61.08 s vs 62.46 s
at dp 192 on 1,536 GPUs (5.97 s of it latency: 191 inter-node ring steps per
collective), 197.45 s vs 202.69 s at dp 48 on 384: within 3%.

This is DeepSpeed as it runs today; its spring-2021 releases (v0.3.13-0.3.16), one
collective per parameter on a list of dp chunks, are ``plan.zero3_2021``
(``framework="deepspeed-0.3"``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..sim_mesh import cost as _cost
from ..sim_mesh import topology as _topo
from .zero_cost import PERSISTENCE_NUMEL, PREFETCH_NUMEL, REDUCE_BUCKET_NUMEL

__all__ = ["MAX_LIVE_NUMEL", "MAX_REUSE_NUMEL", "Gather", "trace_gathers", "gpt_modules",
           "zero3_collectives"]

# deepspeed/runtime/zero/config.py: stage3_max_live_parameters, stage3_max_reuse_distance
MAX_LIVE_NUMEL = 1_000_000_000
MAX_REUSE_NUMEL = 1_000_000_000


@dataclass(frozen=True)
class Gather:
    """One coalesced all-gather: the trace position that issued it, backward or not,
    its elements (before ZeRO's split) and whether it was a prefetch."""
    step: int
    backward: bool
    numel: int
    prefetch: bool


def trace_gathers(modules, prefetch=PREFETCH_NUMEL, max_live=MAX_LIVE_NUMEL,
                  max_reuse=MAX_REUSE_NUMEL, persist=PERSISTENCE_NUMEL) -> list[Gather]:
    """The all-gathers of one forward and backward, DeepSpeed's rule (module docstring).
    ``modules``: forward order, each a sequence of (parameter id, elements); a parameter
    two modules use (a tied embedding) has the same id in both.  Steady state: the
    trace is complete and nothing is gathered when the step starts."""
    fwd = [tuple(m) for m in modules]
    trace = fwd + fwd[::-1]
    size = {pid: n for m in fwd for pid, n in m}
    queue = [(pid, i) for i, m in enumerate(trace) for pid, _ in m if size[pid] >= persist]
    head, avail, live, out = 0, set(), 0, []
    fetched_for = {}                          # parameter -> last trace step a fetch served

    def gather(pids, step, pre):
        nonlocal live
        need = [p for p in dict.fromkeys(pids) if p not in avail and size[p] >= persist]
        if need:
            avail.update(need)
            live += sum(size[p] for p in need)
            out.append(Gather(step, step >= len(fwd), sum(size[p] for p in need), pre))

    for i, m in enumerate(trace):
        pids = [p for p, _ in m]
        gather(pids, i, False)
        while head < len(queue) and queue[head][1] <= i:     # this module's own entries
            fetched_for[queue[head][0]] = max(fetched_for.get(queue[head][0], -1),
                                              queue[head][1])
            head += 1
        budget, ahead, chosen = min(max_live - live, prefetch), 0, []
        while head < len(queue) and ahead < budget:
            pid, at = queue[head]
            head += 1
            fetched_for[pid] = max(fetched_for.get(pid, -1), at)
            if pid not in avail and pid not in chosen:
                chosen.append(pid)
                ahead += size[pid]
        gather(chosen, i, True)
        # release (``__params_to_release``): not if the prefetcher passed a later use,
        # nor if the trace uses it again within max_reuse elements
        keep, seen = set(), 0
        for later in trace[i + 1:]:
            if seen >= max_reuse:
                break
            for pid, n in later:
                keep.add(pid)
                seen += n
        for pid in dict.fromkeys(pids):
            if pid in avail and pid not in keep and fetched_for.get(pid, -1) <= i:
                avail.discard(pid)
                live -= size[pid]
    return out


def gpt_modules(cfg, tp: int):
    """A pipeline-free GPT's modules as DeepSpeed's hooks see them, forward order: the
    word and position embeddings (and their LayerNorm, ``embed_norm``), per layer LayerNorm, the fused QKV, the projection,
    LayerNorm, fc1, fc2 (weights and biases, tensor-parallel shards), the final
    LayerNorm, and the head (tied: the word embedding again, Megatron-DeepSpeed's
    ``parallel_lm_logits`` on ``word_embeddings.weight``; untied: its own weight)."""
    if cfg.arch != "gpt":
        raise ValueError(f"gpt_modules: arch={cfg.arch!r}; it lists a GPT's modules")
    h, f, V, s = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len
    mods = [[("wte", V * h // tp)], [("wpe", s * h)]]
    if cfg.embed_norm:                       # BLOOM's LayerNorm on the embeddings
        mods.append([("emb_ln.w", h), ("emb_ln.b", h)])
    for k in range(cfg.n_layer):
        mods += [[(f"{k}.ln1.w", h), (f"{k}.ln1.b", h)],
                 [(f"{k}.qkv.w", 3 * h * h // tp), (f"{k}.qkv.b", 3 * h // tp)],
                 [(f"{k}.proj.w", h * h // tp), (f"{k}.proj.b", h)],
                 [(f"{k}.ln2.w", h), (f"{k}.ln2.b", h)],
                 [(f"{k}.fc1.w", h * f // tp), (f"{k}.fc1.b", f // tp)],
                 [(f"{k}.fc2.w", f * h // tp), (f"{k}.fc2.b", h)]]
    mods.append([("lnf.w", h), ("lnf.b", h)])
    mods.append([("wte" if cfg.tie_embeddings else "head", V * h // tp)])
    return mods


def fixed_seconds(kind: str, nbytes: float, ranks, profile) -> float:
    """The latency part of one collective's price (``cost.price``): the same collective
    with the same algorithm and protocol on zero bytes (NCCL's tuning model: base +
    steps x step latency; the bandwidth term is linear in the bytes)."""
    g = _topo.group_of(list(ranks), profile)
    if g.p == 1 or nbytes == 0:
        return 0.0
    choice = _topo.choose(kind, nbytes, g, profile)
    proto = _topo.protocol_of(kind, nbytes, g, profile,
                              "tree" if choice.algorithm == "tree" else "ring")
    if proto:
        if g.nodes > 1 or choice.algorithm == "tree":
            return _topo._net_protocols(kind, 0.0, g, profile, choice.algorithm)[proto]
        return _topo._ring_protocols(kind, 0.0, g.p, profile)[proto]
    return _topo.algorithm_time(kind, 1e-30, g, profile, choice.algorithm)


def zero3_collectives(cfg, lay, cluster, bytes_per_element: int = 2) -> dict:
    """DeepSpeed ZeRO-3's collectives for ``lay`` (pp = 1) on ``cluster``, priced on the
    data-parallel group of TP rank 0 (module docstring): per micro-batch and per step,
    how many all-gathers forward and backward, how many reduce-scatters, their seconds
    if run one after another (``seconds``) and the part of it that is per-collective
    latency (``fixed``); ``per_layer``: the gathers a middle layer issues forward and
    backward; ``kept_for_backward``: elements the reuse distance keeps gathered from the
    forward into the backward (no second gather)."""
    if lay.pp != 1 or lay.zero != 3:
        raise ValueError(f"zero3_collectives: layout {lay.short()}; it counts ZeRO-3 "
                         f"without pipelines (zero=3, pp=1)")
    prof, ranks = cluster.profile, tuple(lay.dp_ranks(0, 0))
    mods = gpt_modules(cfg, lay.tp)
    gathers = trace_gathers(mods)
    total = sum(n for m in mods for _, n in dict(m).items())
    grads = sum(n for n in {p: n for m in mods for p, n in m}.values())
    buckets = -(-grads // REDUCE_BUCKET_NUMEL)
    rs_each = grads / buckets
    n_fwd = len(mods)
    mid = cfg.n_layer // 2
    lo, hi = 2 + 6 * mid, 2 + 6 * (mid + 1)          # a middle layer's trace positions
    back_lo, back_hi = 2 * n_fwd - hi, 2 * n_fwd - lo

    def price(kind, numel):
        return _cost.price(kind, bytes_per_element * numel, list(ranks), prof)

    def fixed(kind, numel):
        return fixed_seconds(kind, bytes_per_element * numel, ranks, prof)

    ag = sum(price("all_gather", g.numel) for g in gathers)
    ag_fixed = sum(fixed("all_gather", g.numel) for g in gathers)
    rs = buckets * price("reduce_scatter", rs_each)
    rs_fixed = buckets * fixed("reduce_scatter", rs_each)
    gathered_fwd = sum(g.numel for g in gathers if not g.backward)
    gathered_bwd = sum(g.numel for g in gathers if g.backward)
    mb = {"forward_gathers": sum(not g.backward for g in gathers),
          "backward_gathers": sum(g.backward for g in gathers),
          "reduce_scatters": buckets, "seconds": ag + rs, "fixed": ag_fixed + rs_fixed}
    m = lay.m
    return {
        "ranks": len(ranks), "nodes": _topo.group_of(list(ranks), prof).nodes,
        "per_layer": {"forward_gathers": sum(lo <= g.step < hi for g in gathers),
                      "backward_gathers": sum(back_lo <= g.step < back_hi for g in gathers)},
        "per_micro_batch": mb,
        "per_step": {k: m * v for k, v in mb.items()},
        "kept_for_backward": gathered_fwd - gathered_bwd,
        "parameters": total,
        "gathers": gathers,
    }
