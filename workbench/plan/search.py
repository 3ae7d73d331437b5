"""``search(model, cluster, global_batch)``: every layout that fits, fastest first.

Enumerates tensor parallelism t (dividing the devices, the heads, d_ff and the
vocabulary), pipeline parallelism p (dividing the devices left and the layers), data
parallelism d = devices / (t p) (dividing the global batch), the micro-batch (dividing
global_batch / d, up to ``max_micro_batch``), the schedule (1F1B, GPipe, interleaved
1F1B with every v dividing the layers per stage, where m is a multiple of p), sequence
parallelism (when t > 1), the ZeRO stage (0-1 with pipelines, 0-3 without; with one
data-parallel rank, dp x cp = 1, only 0 and 2, Megatron-LM's and DeepSpeed's: ZeRO has
nothing to split there) and the recompute mode (none, selective, full, and for a dense
Llama torchtitan's op-level selective checkpointing, "op").  Layouts whose busiest rank does not fit the device memory are dropped
before their step time is estimated, and only those that can be among the fastest are
estimated (``plan.step_floor``).  Ranked by step time (ties: less memory first).
"""
from __future__ import annotations

import time

from .estimate import check_runs, estimate
from .frameworks import FRAMEWORKS
from .layout import Cluster, Layout, attention_for, check_layout, check_model
from .memory import stage_memory
from .step_floor import best_first, step_floor
from .text_width import wrap
from . import ep_cp as _ep_cp

__all__ = ["search", "Ranking", "candidate_layouts"]

_FIELDS = ("dp", "tp", "pp", "schedule", "v", "sp", "zero", "recompute", "micro_batch",
           "framework", "ep", "cp", "cp_comm")
# ASSUMPTION: step times closer than this share are a tie the model cannot rank (its
# layer clock is held to 5.4% on Korthikanti et al.'s Table 4, and published end-to-end
# runs differ from it by far more: benchmarks/published.py)
TIE = 0.01
# the table's abbreviations (its legend spells them out)
_SCHED = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved_1f1b": "i1f1b"}
_RC = {"selective": "sel"}


def _field(lay, f: str):
    """A layout field as :meth:`SearchResult.explain` names it: the framework the layout
    runs (``Layout.engine``: ``framework=None`` resolved to its ZeRO stage's default),
    the field itself otherwise."""
    return lay.engine if f == "framework" else getattr(lay, f)


def _share(frac: float) -> str:
    """``frac`` as a percentage with the fewest digits (one at least) that keep it off
    ``TIE`` and on its side: a tie of 0.96% and a win of 1.04% print "0.96%" and "1.04%",
    not "1.0%" both (the verdict is taken before rounding)."""
    for d in range(1, 7):
        text = f"{frac:.{d}%}"
        shown = float(text[:-1])
        if shown != round(100 * TIE, d) and (shown < 100 * TIE) == (frac < TIE):
            return text
    return text


def _as_framework(model, lay, cluster, framework, attention, overlap_grad_reduce,
                  tp_comm_overlap):
    """``lay`` run by ``framework``, or None where that framework does not run it (its
    ZeRO stage, or a layout ``check_layout`` / ``estimate.check_runs`` refuse for it: e.g.
    FSDP2's ZeRO-3 only, Megatron-LM's ZeRO 0-1, DeepSpeed's 1F1B pipeline engine)."""
    try:
        out = lay if lay.framework == framework else lay.replace(framework=framework)
        check_layout(model, out, cluster)
        check_runs(model, out, cluster, attention, False, overlap_grad_reduce,
                   tp_comm_overlap)
    except ValueError:
        return None
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model, cluster: Cluster, global_batch: int, max_micro_batch: int = 16,
                      cp: int = 1):
    """Every layout :func:`search` considers (a generator of :class:`Layout`).  ``cp``: the
    context-parallel ranks each will get (``plan.ep_cp``); ZeRO partitions over the dp x
    cp ranks, so where there is one, stage 1 is stage 0's layout and stage 3 stage 2's
    (the same framework, ``Layout.engine``, nothing to split): only 0 and 2 are listed."""
    n = cluster.devices
    # torchtitan's op-level selective checkpointing: modeled (and run by the course's
    # model) for the dense Llama block only (plan.llama_layer, models.op_sac)
    modes = ("none", "selective", "full") + \
        (("op",) if model.arch == "llama" and not getattr(model, "moe_experts", 0) else ())
    for tp in _divisors(n):
        if model.n_head % tp or model.n_kv_head % tp or model.d_ff % tp or \
                model.vocab_size % tp:
            continue
        for pp in _divisors(n // tp):
            if model.n_layer % pp:
                continue
            dp = n // (tp * pp)
            if global_batch % dp:
                continue
            for b in _divisors(global_batch // dp):
                if b > max_micro_batch:
                    break
                m = global_batch // (dp * b)
                scheds = [("1f1b", 1)]
                if pp > 1:
                    scheds.append(("gpipe", 1))
                    if m % pp == 0:
                        scheds += [("interleaved_1f1b", v)
                                   for v in _divisors(model.n_layer // pp)[1:]]
                for schedule, v in scheds:
                    # sp splits each rank's sequence (s / cp) over tp (check_layout)
                    for sp in ((False, True) if tp > 1 and not (model.seq_len // cp) % tp
                               else (False,)):
                        for zero in ((0, 1, 2, 3) if pp == 1 else (0, 1)):
                            if dp * cp == 1 and zero in (1, 3):
                                continue        # as zero - 1 (docstring)
                            for rc in modes:
                                yield Layout(dp=dp, tp=tp, pp=pp, sp=sp, zero=zero,
                                             recompute=rc, micro_batch=b,
                                             global_batch=global_batch, schedule=schedule,
                                             v=v)


def _cp(lay) -> str:
    """The table's cp cell: the degree, "a" after it for ``cp_comm="a2a"``."""
    return f"{lay.cp}a" if lay.cp > 1 and lay.cp_comm == "a2a" else str(lay.cp)


class Ranking(list):
    """``[(Layout, Estimate), ...]``, fastest first, with how the search went
    (``tried``, ``fitting``, ``seconds``) and :meth:`explain`."""

    def __init__(self, items, tried=0, fitting=0, seconds=0.0, cluster=None, least=None,
                 framework=None):
        super().__init__(items)
        self.tried, self.fitting, self.seconds, self.cluster = tried, fitting, seconds, cluster
        self.least = least          # (bytes, Layout): the smallest busiest rank tried
        self.framework = framework  # the framework the search was held to (None: each
        #                             ZeRO stage's default)

    def table(self) -> str:
        """One row per layout, at most ``WIDTH`` (100) characters wide, and a legend:
        the schedule and the recompute mode abbreviated (``_SCHED``, ``_RC``), each
        unit stated once."""
        # expert / context parallel columns when a layout here uses them (plan.ep_cp)
        xc = any(lay.ep > 1 or lay.cp > 1 for lay, _ in self)
        # cp "4a": cp_comm="a2a", the all-to-all (DeepSpeed-Ulysses); "4": the ring
        a2a = any(lay.cp > 1 and lay.cp_comm == "a2a" for lay, _ in self)
        head = (f"{'#':>2} {'dp':>4} {'tp':>2} {'pp':>3} " + (f"{'ep':>2} {'cp':>3} " if xc else "")
                + f"{'sched':<5} {'v':>2} {'sp':<3} {'zero':>4} {'rc':<4} {'mb':>2} "
                f"{'step':>6} {'TFLOP/s':>7} {'MFU':>5} {'GB':>5} {'compute':>7} {'comm':>6} "
                f"{'bubble':>6}")
        rows = [head]
        for i, (lay, e) in enumerate(self, 1):
            b = e.breakdown
            rows.append(f"{i:>2} {lay.dp:>4} {lay.tp:>2} {lay.pp:>3} "
                        + (f"{lay.ep:>2} {_cp(lay):>3} " if xc else "")
                        + f"{_SCHED[lay.schedule]:<5} {lay.v:>2} {'yes' if lay.sp else 'no':<3} "
                        f"{lay.zero:>4} {_RC.get(lay.recompute, lay.recompute):<4} "
                        f"{lay.micro_batch:>2} {e.step_time:>6.3f} {e.tflops_per_device:>7.1f} "
                        f"{e.mfu:>5.1%} {e.memory['total'] / 1e9:>5.1f} {b['compute']:>7.3f} "
                        f"{b['communication']:>6.3f} {b['bubble']:>6.3f}")
        legend = ("step = compute + comm (communication) + bubble, seconds per step; GB: "
                  "the busiest rank's memory\nTFLOP/s per device; "
                  + "; ".join(f"{a}: {s}, v chunks per device" for s, a in _SCHED.items()
                              if s != a)
                  + "; rc: recompute, " + ", ".join(f"{a}: {r}" for r, a in _RC.items())
                  + (", op: op-level selective (torchtitan's)"
                     if any(lay.recompute == "op" for lay, _ in self) else "")
                  + ("; cp\u00a0Na: N ranks by all-to-all (cp_comm='a2a', DeepSpeed-Ulysses), a "
                     "bare N by the ring" if a2a else ""))
        return "\n".join(rows + [wrap(legend)])

    def explain(self) -> list[str]:
        """Why each layout beats the next: the layout fields that differ and, term by
        term (compute, communication, bubble), what #i saves and what it pays; two step
        times closer than ``TIE`` are printed as a tie.  One string per pair, wrapped at
        ``WIDTH`` characters (continuations indented: ``text_width.wrap``)."""
        out = []
        for i in range(len(self) - 1):
            (la, ea), (lb, eb) = self[i], self[i + 1]
            # no-break spaces: a field's change stays on one line (text_width.wrap)
            diff = [f"{f}\u00a0{_field(lb, f)} -> {_field(la, f)}" for f in _FIELDS
                    if _field(la, f) != _field(lb, f)]
            delta = {k: ea.breakdown[k] - eb.breakdown[k] for k in ea.breakdown}
            saves = [k for k in delta if delta[k] < 0]
            pays = [k for k in delta if delta[k] > 0]
            terms = ", ".join(f"{k} {delta[k]:+.3f} s" for k in delta if delta[k])
            gap = eb.step_time - ea.step_time
            head = f"#{i + 1} beats #{i + 2}"
            if gap <= 0 and ea.memory["total"] >= eb.memory["total"]:
                head = f"#{i + 1} and #{i + 2} tie"      # listed in the search's order
                why = "the same step time and memory"
            elif 0 < gap < TIE * eb.step_time:
                head = f"#{i + 1} and #{i + 2} tie"
                why = (f"{gap:.3f} s/step ({_share(gap / eb.step_time)}), under the {TIE:.0%} "
                       f"the model can rank (an assumption)")
            elif gap <= 0:
                head = f"#{i + 1} and #{i + 2} tie on step time; #{i + 1} comes first with"
                why = (f"less memory ({ea.memory['total'] / 1e9:.3f} vs "
                       f"{eb.memory['total'] / 1e9:.3f} GB)")
            else:
                why = f"{gap:.3f} s/step ({_share(gap / eb.step_time)})"
                if saves:
                    main = min(saves, key=delta.get)
                    why += (f": its lower {main} outweighs its higher {' and '.join(pays)}"
                             if pays else f": mostly lower {main}")
            sep = ": " if head.endswith("tie") else " " if head.endswith("with") else " by "
            out.append(wrap(f"{head}{sep}{why}; changes from #{i + 2}: "
                            f"{', '.join(diff) or 'none'} ({terms or 'no term differs'})"))
        return out

    def __str__(self):
        cl = f" on {self.cluster}" if self.cluster else ""
        fw = f" run by {self.framework}" if self.framework else ""
        lines = [f"{self.fitting} of {self.tried} layouts{fw} fit{cl}; searched in "
                 f"{self.seconds:.1f} s"]
        if not self and self.least:
            need, lay = self.least
            return wrap(lines[0] + (f"\nnone fits: the least memory, {need / 1e9:.1f} GB on "
                                    f"the busiest rank, is {lay.short()}; add devices or "
                                    f"shrink the global batch or model"))
        return wrap("\n".join(lines + [self.table(), *self.notes(), *self.explain()]))

    def notes(self) -> list:
        """The lines printed under the table: the MFU caveat at long context, the rows that
        run ZeRO-2/3 over dp x cp on this library's runtime, what zero 2 means without data
        parallelism."""
        return [*_ep_cp.table_notes(self), *_zero_note(self)]


def _zero_note(ranking) -> list:
    """The line under the table where a layout without data parallelism lists ZeRO 2."""
    if any(lay.dp * lay.cp == 1 and lay.zero == 2 for lay, _ in ranking):
        return ["note: with dp x cp = 1 ZeRO has nothing to split: zero 2 there stands for "
                "DeepSpeed's engine (the default for ZeRO 2-3), zero 0 for Megatron-LM's"]
    return []


def _need(model, lay: Layout, attention: str, profile, limit: float, least) -> float:
    """The busiest rank's bytes (``memory.stage_memory`` of the first, a middle and the
    last stage), or, once the first stage alone holds more than both ``limit`` and
    ``least`` (the least so far), that stage's: more stages could only raise it, and
    such a layout neither fits nor holds the least."""
    last = lay.pp - 1
    need = stage_memory(model, lay, 0, attention, profile)["total"]
    if need > limit and least is not None and need >= least:
        return need
    for s in {last, min(1, last)} - {0}:
        need = max(need, stage_memory(model, lay, s, attention, profile)["total"])
    return need


def search(model, cluster: Cluster, global_batch: int, top: int = 5,
           max_micro_batch: int = 16, attention: "str | None" = None,
           overlap: bool = True, overlap_grad_reduce: bool = False,
           tp_comm_overlap: bool = False, framework: "str | None" = None) -> Ranking:
    """The ``top`` fastest layouts of ``model`` on ``cluster`` that fit in device memory,
    as a :class:`Ranking` of ``(Layout, Estimate)`` (module docstring; ``attention``,
    ``overlap``, ``overlap_grad_reduce`` and ``tp_comm_overlap`` as in
    :func:`~workbench.plan.estimate.estimate`; with ``tp_comm_overlap`` only the layouts
    it is priced for: Megatron-LM's, sequence parallel where tp > 1, tp inside a node,
    without ep or cp).  ``framework`` (``Layout``'s: "megatron", "deepspeed", "fsdp",
    "workbench", "deepspeed-0.3"): only the layouts that framework runs, each priced as it
    runs them (e.g. "fsdp": FSDP2's ZeRO-3, torchtitan's recipe); None: each layout's
    ZeRO stage's default (Megatron-LM for ZeRO 0-1, DeepSpeed for 2-3)."""
    for name, v in (("overlap", overlap), ("overlap_grad_reduce", overlap_grad_reduce),
                    ("tp_comm_overlap", tp_comm_overlap)):
        if not isinstance(v, bool):         # "no" would read as True
            raise ValueError(f"search: {name}={v!r} must be True or False")
    if framework is not None and framework not in FRAMEWORKS:
        raise ValueError(f"search: framework={framework!r}; use one of {list(FRAMEWORKS)} "
                         f"or None (each ZeRO stage's default)")
    if tp_comm_overlap and framework not in (None, "megatron"):
        raise ValueError(f"search: tp_comm_overlap=True is Megatron-LM's (framework="
                         f"{framework!r}); use framework='megatron' or None")
    if tp_comm_overlap and model.arch != "gpt":
        raise ValueError(f"search: tp_comm_overlap=True is modeled for Megatron's GPT "
                         f"layer only (model.arch={model.arch!r}); use tp_comm_overlap=False")
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster={cluster!r} must be a workbench.plan.Cluster")
    for name, v in (("global_batch", global_batch), ("top", top),
                    ("max_micro_batch", max_micro_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"search: {name}={v!r} must be an int >= 1")
    check_model(model)
    attention = attention_for(model, attention)
    t0 = time.perf_counter()
    limit = cluster.profile.usable_memory()     # less the context and fragmentation
    node = cluster.profile.devices_per_node
    fit: list[Layout] = []
    tried, least = 0, None
    for lay in _ep_cp.candidates(model, cluster, global_batch, max_micro_batch, attention,
                                 candidate_layouts):    # with ep and cp (plan.ep_cp)
        if framework is not None:
            lay = _as_framework(model, lay, cluster, framework, attention,
                                overlap_grad_reduce, tp_comm_overlap)
            if lay is None:
                continue    # a layout the framework does not run
        if tp_comm_overlap and (lay.engine != "megatron" or lay.tp > node or lay.tp > 1 and (
                not lay.sp or _ep_cp.applies(model, lay))):
            continue        # refused by estimate (plan.tp_overlap.check_estimate)
        tried += 1
        need = _need(model, lay, attention, cluster.profile, limit,
                     None if least is None else least[0])
        if least is None or need < least[0]:
            least = (need, lay)
        if need <= limit:
            fit.append(lay)
    if tried == 0 and framework is not None:
        raise ValueError(f"search: framework={framework!r} runs no layout of "
                         f"{cluster.devices} devices that divides the model (n_head="
                         f"{model.n_head}, n_layer={model.n_layer}) and global_batch="
                         f"{global_batch}; try framework=None or another global_batch")
    if tried == 0:
        raise ValueError(f"search: no layout of {cluster.devices} devices divides the model "
                         f"(n_head={model.n_head}, n_layer={model.n_layer}) and "
                         f"global_batch={global_batch}; try a global_batch that is a multiple "
                         f"of the device count")
    # the fastest (ties: less memory first), estimating only layouts that can be among
    # them (plan.step_floor)
    best = best_first(fit, top, lambda lay: estimate(
        model, lay, cluster, attention, overlap, overlap_grad_reduce,
        tp_comm_overlap=tp_comm_overlap), lambda lay: step_floor(
        model, lay, cluster, attention, tp_comm_overlap))
    return Ranking(best, tried=tried, fitting=len(fit),
                   seconds=time.perf_counter() - t0, cluster=cluster, least=least,
                   framework=framework)
