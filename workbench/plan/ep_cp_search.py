"""What the planner says about expert (ep) and context (cp) parallelism: the layouts
``search`` tries with them, the assumptions and explanation lines an estimate adds, the
note under a ranking's table (``plan.ep_cp`` holds the costs)."""
from __future__ import annotations

from . import costs as C
from . import moe_cost as M

__all__ = ["CP_MIN_TOKENS", "CP_A2A_MIN_SEQ", "candidates", "assumptions", "table_notes",
           "explain_lines"]

# search: the ring (cp_comm="p2p") is tried while each rank keeps at least this many tokens
# of a sequence.  ASSUMPTION (a bound on the search, not a law): below it the K/V exchange
# of a ring step outlasts the half block it hides behind on the profiles here
# (context_cost); Megatron-Core's guide recommends CP for sequences of 8K tokens and more.
CP_MIN_TOKENS = 4096
# The all-to-all (cp_comm="a2a", DeepSpeed-Ulysses) hides nothing: its four all-to-alls per
# layer wait before the kernel at every length (context_cost), so the ring's per-rank
# reason does not carry over.  What they cost against the attention they split is set by
# the whole sequence: a rank sends ~4 b (s / cp) (H / tp) d e bytes and computes ~2 b
# (H / tp / cp) s^2 d FLOPs, a ratio ~ 1 / s whatever cp (Jacobs et al. 2023 sec. 3.2).
# So a2a is tried at every cp its heads allow (each tp rank's query and K/V heads divide
# by cp: context_cost.check_cp_comm) on sequences of at least this many tokens.
# ASSUMPTION (a bound on the search, not a law): Megatron-Core's guide's "Long Sequences
# (8K+ Tokens)" for CP (NVIDIA/Megatron-LM d98e8a64 docs/user-guide/parallelism-guide.md:31).
CP_A2A_MIN_SEQ = 8192


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model, cluster, global_batch, max_micro_batch, attention, base):
    """``search``'s layouts with ep and cp: for each cp (dividing the devices, the
    sequence in 2 cp chunks, flash attention; the ring at least ``CP_MIN_TOKENS`` per rank,
    the all-to-all ``cp_comm="a2a"`` on ``CP_A2A_MIN_SEQ`` tokens or more where each tp
    rank's heads divide by cp) the dense candidates (``base``) of devices / cp, each with
    every ep dividing its dp and the experts; ZeRO <= 1 with either (ZeRO-2 and ZeRO-3
    over dp x cp with framework='workbench', as its runtime shards, with any recompute
    of one layer per checkpoint: ``ep_cp.check_zero_cp`` prices them all since zerocp5),
    sequence parallelism with a MoE's TP."""
    from .layout import Cluster
    moe = M.moe_of(model)
    n, s = cluster.devices, model.seq_len
    hq, hkv = model.n_head, getattr(model, "n_kv_head", None) or model.n_head
    ring = {c for c in _divisors(n) if c > 1 and s // c >= CP_MIN_TOKENS}
    a2a = {c for c in _divisors(n) if c > 1 and s >= CP_A2A_MIN_SEQ and hkv % c == 0}
    cps = [c for c in _divisors(n) if c == 1 or (
        attention == "flash" and s % (2 * c) == 0 and c in ring | a2a)]
    for cp in cps:
        cl = cluster if cp == 1 else Cluster(cluster.profile, n // cp)
        for lay in base(model, cl, global_batch, max_micro_batch, cp=cp):
            if moe is None and cp == 1:
                yield lay
                continue
            if moe is not None and lay.tp > 1 and not lay.sp:
                continue
            if lay.sp and (s // cp) % lay.tp:      # refused by layout.check_layout
                continue
            eps = [1] if moe is None else [e for e in _divisors(lay.dp)
                                           if moe.experts % e == 0]
            if lay.zero >= 2 and cp > 1:    # what plan.ep_cp accepts: this library's
                # runtime's ZeRO-2 and ZeRO-3 over dp x cp (recipes.context_parallel), the
                # only framework priced running them with cp, every recompute since zerocp5
                # (dp = 1 with recompute and ZeRO-3 with "op" were left out of the search
                # while ep_cp.check_zero_cp refused them): tried as framework="workbench"
                # (table_notes says so; chunks of k > 1 layers it refuses: Layout); with
                # ep, refused there
                if moe is not None or lay.recompute_num_layers != 1:
                    continue
                lay = lay.replace(framework="workbench")
            elif lay.zero >= 2 and moe is not None:
                continue
            comms = [m for m, ok in (("p2p", cp in ring), ("a2a", cp in a2a and (
                hq // lay.tp) % cp == 0 and (hkv // lay.tp) % cp == 0)) if ok] \
                if cp > 1 else ["p2p"]
            for ep in eps:
                for comm in comms:
                    yield lay.replace(ep=ep, cp=cp, cp_comm=comm)


def assumptions(model, lay) -> tuple:
    """What an estimate with EP or CP assumes beyond its citations."""
    out = []
    moe = M.moe_of(model)
    if moe is not None:
        cap = ("dropless" if moe.capacity_factor is None else
               f"capacity factor {moe.capacity_factor:g}: the rows over capacity dropped, "
               f"none padded (Megatron-Core's default)")
        out += [f"MoE: routing perfectly balanced over the {moe.experts} experts ({cap}); "
                f"real routers are not (plan/moe_cost.py)",
                "MoE: the all-to-all dispatch and combine are not overlapped with the "
                "experts (Megatron-Core's default alltoall dispatcher)"]
        if lay.ep > 1 and lay.engine != "workbench":
            out.append(f"MoE: the per-expert counts ({moe.experts} int64 a rank, forward) "
                       f"priced as this library's all-to-all over ep; Megatron-Core "
                       f"all-gathers them over tp x ep (plan/moe_cost.py): both "
                       f"latency-bound")
    mat, core = C.layer_flops(model, 1)
    if core > 0.2 * (mat + core):
        out.append(f"MFU and HFU count attention as 4 b s^2 h per layer (Korthikanti eq. 7), "
                   f"{core / (mat + core):.0%} of the layers' FLOPs at s = {model.seq_len}, "
                   f"twice what the causal kernel the time is priced on computes: read them "
                   f"as up to 2x high (HFU can pass 100%)")
    if lay.cp > 1 and lay.cp_comm == "a2a":
        out.append("CP: DeepSpeed-Ulysses' four all-to-alls per layer forward and four "
                   "backward on the critical path, as Transformer Engine waits for q, k, v "
                   "before the kernel (plan/context_cost.py); reordering the 2 cp chunks "
                   "after the all-to-all assumed free")
    elif lay.cp > 1:
        out.append("CP: ring attention's K/V exchange double-buffered behind each half "
                   "block, which the copy's SMs stretch (plan/context_cost.py: those of "
                   "a collective over the cp group, ASSUMPTION, NCCL's p2p channels not "
                   "logged); routing of the sequence into 2 cp chunks (causal balancing) "
                   "assumed free")
    return tuple(out)


def table_notes(ranking) -> list:
    """Lines ``Ranking`` prints under its table: the MFU caveat at long context, and which
    rows run ZeRO-2/3 with cp on this library's runtime (``candidates``)."""
    if not ranking:
        return []
    lay, est = ranking[0]
    note = next((a for a in est.assumptions() if a.startswith("MFU and HFU count")), None)
    out = [f"note: {note}"] if note else []
    own = [i for i, (l, _) in enumerate(ranking, 1) if l.cp > 1 and l.zero >= 2]
    if own:
        out.append(f"note: row{'s' if len(own) > 1 else ''} {', '.join(map(str, own))}: "
                   f"ZeRO-{'/'.join(sorted({str(ranking[i - 1][0].zero) for i in own}))} "
                   f"over dp x cp as this library's runtime runs it (framework='workbench', "
                   f"recipes/context_parallel.py), the only one priced with cp")
    return out


def explain_lines(est) -> list:
    """The lines ``Estimate.explain`` adds for EP and CP."""
    d, lay = est.details.get("ep_cp"), est.layout
    if not d:
        return []
    ms, out = 1e3, []
    if "ep_ranks" in d and lay.ep == 1:
        out.append(f"  experts: all {M.moe_of(est.details['model']).experts} on every rank "
                   f"(ep=1): no all-to-all")
    elif "ep_ranks" in d:
        out.append(f"  experts over ep={lay.ep}: {d['a2a_count']} all-to-alls per layer and "
                   f"micro-batch (dispatch, combine, their gradients; the counts) "
                   f"{d['a2a_seconds'] * ms:.2f} ms, {d['a2a_bytes'] / 1e6:.1f} MB sent, "
                   f"{d['ep_link']}")
    u = d.get("cp_a2a")
    if u is not None:
        out.append(f"  all-to-all attention over cp={lay.cp} (DeepSpeed-Ulysses): 4 "
                   f"all-to-alls forward {u.forward * ms:.2f} ms, 4 backward "
                   f"{u.backward * ms:.2f} ms, {u.sent_forward / 1e6:.1f} MB sent each way")
    r = d["ring"]
    if r is not None:
        hidden = "hidden" if r.hop <= r.half_forward else "NOT hidden"
        out.append(f"  ring attention over cp={lay.cp}: {r.steps} steps of a half block "
                   f"{r.half_forward * ms:.2f} ms beside a K/V hop {r.hop * ms:.2f} ms, the "
                   f"exchange {hidden}: {r.forward * ms:.2f} ms forward, {r.backward * ms:.2f} "
                   f"ms backward")
    return out
