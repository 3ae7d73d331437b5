"""Checks for the exercises of notebooks 10 (overlap) and 12 (profiling).

As in :mod:`.checks`: a right answer prints one "Correct: ..." line, a wrong one raises
:class:`~.feedback.CheckError` (IPython shows its message alone), the hint first and the
expected value from the third wrong try on or with ``wb.exercises.reveal(...)``.
Expected values come from the formula or a hand schedule written out here, never from
the library code the exercise is about (``overlap.py``, ``cost.compute_time``,
``Trace.busy``): a bug there must not become the right answer. The profile is read for
its numbers only (data with cited sources), as a student reads it.
"""
from __future__ import annotations

import math

from ..sim_mesh.profiles import get_profile, list_profiles
from .checks import _check_number, _number, _ok, _whole
from .feedback import CheckError, exercise

__all__ = ["check_hidden_share", "check_multi_copy_forward_ms", "check_best_chunks",
           "check_fusion_us", "check_top_op", "check_idle_share"]


# ---- 10 overlap ----------------------------------------------------------------------------

@exercise
def check_hidden_share(share, compute_ms: float = 1.4, comm_ms: float = 2.0,
                       k: int = 4) -> None:
    """Share of the communication hidden when an op with compute C and communication M
    is cut into k chunks that pipeline: (1 - 1/k) min(1, C/M) (latency ignored)."""
    want = (1 - 1 / k) * min(1.0, compute_ms / comm_ms)
    ratio = compute_ms / comm_ms
    if _number("hidden share", share) < 0:
        raise CheckError(f"your hidden share is {_number('hidden share', share):.4g}: a share "
                         "of the communication is between 0 (none hidden) and 1 (all of it); "
                         "check the sign of each factor", expected=f"{want:.4g} of M")
    hidden_ms = want * comm_ms
    _check_number("hidden share", share, want, "of M", [
        (hidden_ms, f"that is the hidden TIME in ms; the share is that time over "
                    f"M = {comm_ms:g} ms"),
        ((1 - 1 / k), "that is the share when compute covers all the communication; here "
                      "C < M, so at most C/M of it can hide"),
        (min(1.0, ratio), "that is the limit for infinitely many chunks; the first chunk's "
                          "compute and the last chunk's communication never overlap: "
                          "multiply by (1 - 1/k)"),
        ((1 - 1 / k) / ratio, "you used M/C; the compute that covers the communication is "
                              "C, so the ratio is C/M"),
        (1 / k, "1/k is the share of the LAST chunk, the one that stays exposed"),
        (min(1.0, ratio) / k, "you multiplied by 1/k, the last chunk that stays exposed; "
                              "the chunks that can hide are the other (1 - 1/k)"),
        (1 - ratio, "that is the part of M that is longer than C, not the hidden share"),
        (1 - want, "that is the share left EXPOSED; the hidden share is the rest of M"),
        ((1 - want) * comm_ms, "that is the EXPOSED time in ms; give the HIDDEN share of the "
                               "communication, a fraction of M"),
    ] + [((1 - 1 / j) * min(1.0, ratio), f"that is the share for k = {j} chunks; here "
                                         f"k = {k}") for j in (k - 1, k + 1) if j >= 1],
        rel=1e-3, hint_rel=0.005,
        fallback=("a share of the communication is at most 1 (all of it hidden): compare "
                  "each factor with the formula" if _number("hidden share", share) > 1
                  else "compare each factor with the formula"))


def _two_copy_schedule(a: float, f: float, m: float, *, wait_both: bool = False,
                       compute_end: bool = False) -> float:
    """Forward of a layer in two copies A, B (attention a, FFN f, all-reduce m, per copy),
    by hand: one compute stream (A.attn, B.attn, A.ffn, B.ffn) and one comm stream
    (A.ar1, B.ar1, A.ar2, B.ar2), each FIFO; a block waits for its copy's all-reduce.
    Two slips a student makes: ``wait_both``, A's FFN waits for B's attention all-reduce
    too; ``compute_end``, the end of the compute stream taken for the forward's end."""
    c_a1 = a
    c_b1 = c_a1 + a
    r_a1 = c_a1 + m
    r_b1 = max(r_a1, c_b1) + m
    c_a2 = max(c_b1, r_b1 if wait_both else r_a1) + f
    r_a2 = max(r_b1, c_a2) + m
    c_b2 = max(c_a2, r_b1) + f
    return c_b2 if compute_end else max(r_a2, c_b2) + m


@exercise
def check_multi_copy_forward_ms(total_ms, attention_ms: float = 1.0, ffn_ms: float = 2.0,
                                all_reduce_ms: float = 1.5) -> None:
    """Forward time of the two-copy layer, each copy's attention ``attention_ms``, FFN
    ``ffn_ms`` and each all-reduce ``all_reduce_ms`` (per copy)."""
    a, f, m = attention_ms, ffn_ms, all_reduce_ms
    want = _two_copy_schedule(a, f, m)
    _check_number("forward time", total_ms, want, "ms", [
        (2 * a + 2 * f + m, "only the last all-reduce is exposed when every all-reduce is "
                            "shorter than the block after it; here one is longer"),
        (2 * a + 2 * f, "the last all-reduce (B's FFN) has nothing left to hide behind"),
        (2 * a + 2 * f + 4 * m, "that is one copy of the whole batch, where every "
                                "all-reduce blocks; with two, one copy's all-reduce runs "
                                "while the other copy computes"),
        (_two_copy_schedule(a, f, m, wait_both=True),
         "a copy's FFN waits for ITS OWN attention all-reduce only: A's FFN need not wait "
         "for B's"),
        (_two_copy_schedule(a, f, m, compute_end=True),
         "that is when the compute stream ends; B's FFN all-reduce still runs after it"),
    ], rel=1e-3, fallback="walk the two streams in order: a block starts when the compute "
                          "stream is free and (an FFN) its copy's attention all-reduce has "
                          "ended; an all-reduce when its block has ended and the comm "
                          "stream is free")


@exercise
def check_best_chunks(k, compute_ms: float = 1.0, comm_ms: float = 2.0,
                      launch_us: float = 5.0, latency_us: float = 40.0,
                      ks=(1, 2, 4, 8, 16, 32)) -> None:
    """The k in ``ks`` that minimises c + m + (k-1) max(c, m), with per-chunk compute
    c = C/k + launch and communication m = M/k + latency (each chunk pays its own)."""
    whole = _whole(k)               # 4.0, numpy.int64(4) and torch.tensor(4) are 4
    if whole is None:
        raise CheckError(f"k should be one of {list(ks)}, an int; got {k!r}")
    k = whole
    if k not in ks:
        raise CheckError(f"k={k} is not one of the candidates {list(ks)}")

    def total(j):
        c = compute_ms / j + launch_us / 1e3
        m = comm_ms / j + latency_us / 1e3
        return c + m + (j - 1) * max(c, m)
    want = min(ks, key=total)
    if k == want:
        _ok(f"k = {k}: {total(k):.3f} ms, against {total(1):.3f} ms unsplit")
        return
    if k > want:
        hint = ("past the best k every chunk pays the link latency again, more than the "
                "chunking hides: compare the totals of your k and a smaller one")
    else:
        hint = "more chunks would still hide more than their extra latency costs"
    raise CheckError(f"k = {k} gives {total(k):.3f} ms: {hint}", expected=f"k = {want}")


# ---- 12 profiling --------------------------------------------------------------------------

@exercise
def check_fusion_us(unfused_us, fused_us, n: int = 1000, nbytes: int = 4096,
                    profile: str = "ascend-910b") -> None:
    """Modeled microseconds of ``n`` elementwise kernels each moving ``nbytes`` (one launch
    each) and of one fused kernel moving all of it (one launch), on the roofline:
    bytes / (memory bandwidth x memory efficiency) + launches x launch overhead."""
    prof = get_profile(profile)
    bw = prof.memory_bandwidth * prof.memory_efficiency
    launch = prof.launch_overhead
    want_u = n * (nbytes / bw + launch) * 1e6
    want_f = (n * nbytes / bw + launch) * 1e6
    move = n * nbytes / bw * 1e6
    peak_bw = n * nbytes / prof.memory_bandwidth * 1e6 + n * launch * 1e6
    # the launches dwarf the bytes: leaving out the memory efficiency moves the answer by
    # only 1e-4 of it (5002.6 vs 5003.0 us), so accept no more than rounding, and name
    # each mistake within a fifth of its distance from the answer (at most 2%): a
    # mistake far from it (the bytes alone, 3.012 us) is still named when rounded
    tight = 0.2 * abs(peak_bw - want_u) / want_u
    # another profile's numbers (12's cell above the exercise loops over three profiles and
    # leaves p at the last, h100): every factor right, the profile not; the closest names it
    others = []
    for name in list_profiles():
        o = get_profile(name)
        if name != profile and o.memory_bandwidth and o.launch_overhead:
            o_bw = o.memory_bandwidth * o.memory_efficiency
            text = (f"that is another profile's figure ({name}'s); the exercise asks for "
                    f"{profile}'s: p = wb.get_profile({profile!r})")
            others.append((n * (nbytes / o_bw + o.launch_overhead) * 1e6,
                           (n * nbytes / o_bw + o.launch_overhead) * 1e6, text))
    _check_number("unfused time", unfused_us, want_u, "us", [
        (v, text, min(0.02, 0.2 * abs(v - want_u) / want_u)) for v, text in [
            (move, "that is the memory traffic only: each of the n kernels also pays a "
                   "launch"),
            (want_f, "that is the fused kernel: one launch; the unfused ops pay n launches"),
            (peak_bw, "use the memory bandwidth a kernel reaches: x memory_efficiency"),
            (n * launch * 1e6, "that is the launches alone: each kernel also moves its "
                               "bytes"),
            *[(u, text) for u, _, text in others if not math.isclose(u, want_u, rel_tol=1e-3)]]
    ], rel=min(1e-3, tight))
    _check_number("fused time", fused_us, want_f, "us", [
        (move, "the fused kernel is still one launch: add launch_overhead once"),
        (want_u, "one fused kernel launches once, not n times"),
        (n * nbytes / prof.memory_bandwidth * 1e6 + launch * 1e6,
         "use the memory bandwidth a kernel reaches: x memory_efficiency"),
        (launch * 1e6, "that is the launch alone: the fused kernel also moves all the bytes"),
        *[(f, text, 0.005) for _, f, text in others if not math.isclose(f, want_f, rel_tol=1e-2)],
    ], rel=1e-3)


def _compute_events(tr):
    events = getattr(tr, "events", None)
    if events is None:
        raise CheckError(f"pass the Trace of the step (wb.trace(...) as tr), got "
                         f"{type(tr).__name__}")
    return [e for e in events if e.stream == "compute"]


@exercise
def check_top_op(name, tr) -> None:
    """The op name with the most modeled compute time in trace ``tr`` (all its events,
    each counted once however many ranks ran it)."""
    if not isinstance(name, str):
        raise CheckError(f"name should be an op name (a str: an event's .name, e.g. 'add'), "
                         f"got {name!r}")
    per = {}
    count = {}
    for e in _compute_events(tr):
        per[e.name] = per.get(e.name, 0.0) + e.duration
        count[e.name] = count.get(e.name, 0) + 1
    if not per:
        raise CheckError("that trace has no compute events: record a step in it first")
    want = max(per, key=per.get)
    most = max(count, key=count.get)
    if name == want:
        # a counted answer is right too where every kernel is about one launch: say so
        note = ("; it is also the most frequent op, as every kernel here is mostly its "
                "launch; with larger kernels the count and the time differ: sum the "
                "durations" if want == most else "")
        _ok(f"{name}: {per[name] * 1e6:.1f} us of compute in {count[name]} events{note}")
        return
    if name not in per:
        raise CheckError(f"no compute event in the trace is called {name!r}; the names are "
                         f"the events' .name, the ops the library ran (not aten's kernels): "
                         f"{', '.join(sorted(per))}", expected=repr(want))
    hint = (" it is the most FREQUENT op; sum the durations, not the counts"
            if name == most and most != want else
            " it is the alphabetically last name: max(d) of a dict compares its keys; "
            "max(d, key=d.get) compares their values" if name == max(per) else
            " it is the op with the LEAST compute time" if name == min(per, key=per.get)
            else " sum each name's durations")
    raise CheckError(f"{name!r} has {per[name] * 1e6:.1f} us of compute:{hint}",
                     expected=repr(want))


@exercise
def check_idle_share(share, tr, rank: int = 0) -> None:
    """The share of the step (first event's start to last event's end, all ranks) during
    which ``rank``'s compute stream is idle."""
    got = _number("idle share", share)
    events = getattr(tr, "events", None)
    if not events:
        raise CheckError("pass the Trace of the step, with its events")
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    spans = sorted((e.start, e.end) for e in events if e.stream == "compute" and rank in e.ranks)
    busy, end = 0.0, t0                  # merge the rank's compute intervals, by hand
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    want = 1 - busy / (t1 - t0)
    summed = sum(e.duration for e in events if e.stream == "compute" and rank in e.ranks)
    between = (max(e for _, e in spans) - spans[0][0] - busy) if spans else 0.0  # idle_gaps
    head, tail = (spans[0][0] - t0, t1 - max(e for _, e in spans)) if spans else (0.0, 0.0)
    step = t1 - t0
    # these two mistakes give the right value where no kernels overlap and the stream
    # idles neither before its first kernel nor after its last (the course's step): each
    # is named only within a fifth of its distance from the answer, so that a rounded
    # answer (0.13 for 0.1276) is not read as one of them
    distinct = [(v, text, min(0.02, 0.2 * abs(v - want) / want)) for v, text in [
        (1 - summed / step, "close: merge overlapping compute intervals first"),
        (between / step, f"that counts only the gaps BETWEEN rank {rank}'s kernels (what "
                         f"idle_gaps returns); the compute stream also idles "
                         f"{tail * 1e6:.1f} us after its last kernel, while the "
                         "step's last collectives finish"
                         + (f", and {head * 1e6:.1f} us before its first" if head else "")),
    ] if not math.isclose(v, want, rel_tol=1e-3)]
    _check_number("idle share", got, want, "of the step", [
        (1 - want, "that is the BUSY share; idle is 1 - busy / step"),
        (want * 1e6, "you divided microseconds (idle_gaps and the Chrome trace count in "
                     "us) by seconds (tr.time()): put both in one unit"),
        (want / 1e6, "you divided seconds (tr.time(), Event.duration) by microseconds "
                     "(the Chrome trace's us): put both in one unit"),
        *distinct,
        (want * step / busy, "that is idle time over BUSY time; the share is of the whole "
                             "step: divide by the step's length"),
        (want * (t1 - t0) * 1e6, "that is the idle TIME in microseconds: divide it by the "
                                 "step's length for a share between 0 and 1"),
        (want * (t1 - t0), "that is the idle TIME in seconds: divide it by the step's "
                           "length for a share between 0 and 1"),
    ], rel=1e-3, fallback=f"take the step from the first event's start to the last event's "
                          f"end (all ranks), merge rank {rank}'s compute intervals into its "
                          "busy time, and idle = 1 - busy / step")
