"""Checks for the exercises of notebook 14 (experts and long context).

As in :mod:`.checks`: a right answer prints one "Correct: ..." line, a wrong one raises
:class:`~.feedback.CheckError` (IPython shows its message alone), the hint first and the
expected value from the third wrong try on or with ``wb.exercises.reveal(...)``.
Expected values come from the formulas written out here (GShard's capacity, Lepikhin et
al. 2020 sec. 2.2; the pairwise all-to-all and ring all-gather / reduce-scatter volumes,
Thakur et al. 2005; ring attention's K/V blocks, Liu et al. 2023; DeepSpeed-Ulysses'
all-to-alls, Jacobs et al. 2023 sec. 3.2), never from
``workbench.ops.moe`` or ``workbench.plan``: a bug there must not become the right answer.
The loads an exercise starts from (a router's counts) are arguments of the check.
"""
from __future__ import annotations

import math

from .checks import _hint, _number, _ok
from .feedback import CheckError, exercise

__all__ = ["check_dropped_slots", "check_ep_tp_mb", "check_ring_kv_mb", "check_a2a_mb"]


# MB here is 10^6 bytes; a student who divides by 2^20 (MiB) is 4.6% low, apart from every
# other mistake's value (the nearest, ring's cp / (cp - 1) = 16/15, lies 6.7% high).
MIB = 2 ** 20 / 1e6
MIB_HINT = ("that is in MiB (2^20 bytes); the exercise's MB is 10^6 bytes: divide the bytes "
            "by 1e6")

# A value the notebook prints to 4 significant digits (117.4 MB) and a student rounds to 3
# (117) is right: accept within 0.5% (the largest error of a 3-digit rounding), well inside
# the 4.6% to the nearest mistake above.  Beyond it, but within 3% and matching no mistake,
# the answer is most likely rounded too far: say so first, then "compare each factor".
REL = 0.005
# twice the answer is also every value counted at fp32's 4 bytes: name both causes
FP32 = "count 4 bytes a value (fp32; the values are bf16, 2 bytes each)"
ROUNDED = ("close, but more than 0.5% off: rounded too far? Give 3 significant digits or "
           "more; if not, compare each factor with the formula")


# ---- routing: capacity and dropped tokens ---------------------------------------------------

def _capacity(tokens: int, experts: int, k: int, factor: float) -> int:
    """GShard's expert capacity of one routing group: ceil(factor x tokens x k / E)."""
    return math.ceil(factor * tokens * k / experts)


@exercise
def check_dropped_slots(dropped, loads, tokens: int = 256, k: int = 2,
                        capacity_factor: float = 1.0) -> None:
    """Token-slots dropped when experts with these ``loads`` (token-slots routed to each,
    k per token) take at most ceil(capacity_factor x tokens x k / E) each."""
    loads = [int(x) for x in loads]
    E = len(loads)
    if sum(loads) != tokens * k:
        raise ValueError(f"check_dropped_slots: the loads add up to {sum(loads)}, not tokens x "
                         f"k = {tokens * k}: pass the router's per-expert counts")
    got = _number("dropped token-slots", dropped)
    C = _capacity(tokens, E, k, capacity_factor)
    want = sum(max(0, n - C) for n in loads)
    if got == want:
        _ok(f"{want} token-slots dropped (capacity {C} per expert)")
        return
    wrong = {}
    if capacity_factor != 1.0:
        wrong[sum(max(0, n - _capacity(tokens, E, k, 1.0)) for n in loads)] = (
            f"that is the count at capacity factor 1.0; this layer's is {capacity_factor:g}: "
            f"C = ceil({capacity_factor:g} x tokens x k / E)")
    wrong |= {
        sum(max(0, n - tokens // E) for n in loads):
            "your capacity leaves out k: each token takes k slots, so an expert's even "
            "share is tokens x k / E",
        sum(max(0, n - math.ceil(capacity_factor * tokens / E)) for n in loads):
            f"your capacity leaves out k: each token takes k slots, so C = "
            f"ceil({capacity_factor:g} x tokens x k / E)",
        sum(max(0, n - math.floor(capacity_factor * tokens * k / E)) for n in loads):
            "round the capacity up (ceil), as GShard and Megatron-Core do",
        sum(1 for n in loads if n > C): "that counts the experts over capacity; count the "
                                         "token-slots beyond it, load - capacity for each",
        sum(max(0, n - C) for n in loads) // k: "dropping is per token-slot: a token keeps "
                                                "its other experts; do not divide by k",
        sum(max(0, C - n) for n in loads): "that is the unused capacity (the padding) of "
                                           "the underloaded experts, not what overflows",
        tokens * k - want: "that is the token-slots kept; the question asks for those "
                           "dropped",
    }
    if want and max(loads) <= _capacity(tokens * k, E, k, capacity_factor):
        # the tokens x k slots taken as the tokens: a capacity no expert reaches
        wrong.setdefault(0, f"no expert over its capacity: yours is at least the busiest "
                            f"expert's {max(loads)} slots; did you take the {tokens * k} "
                            f"token-slots as tokens? C = ceil(c x tokens x k / E) with the "
                            f"{tokens} tokens")
    hint = wrong.get(int(got)) if float(got).is_integer() else None
    if hint is None and want and math.isclose(got * k, want, rel_tol=1e-9):
        hint = ("dropping is per token-slot: a token keeps its other experts; do not divide "
                "by k")
    if hint is None and 0 < got < 1 and math.isclose(got * tokens * k, want, rel_tol=1e-3):
        hint = (f"that is the dropped share of the {tokens * k} token-slots; give the count "
                f"of slots")
    if hint is None and want and math.isclose(got, 100 * want / (tokens * k), rel_tol=1e-2):
        hint = (f"that is the dropped share in percent of the {tokens * k} token-slots; "
                f"give the count of slots")
    if hint is None and got > 1 and not float(got).is_integer():
        hint = "a count of token-slots is a whole number"
    raise CheckError(f"your count is {got:g} token-slots: "
                     + (hint or ("too high" if got > want else "too low")
                        + ": capacity = ceil(capacity_factor x tokens x k / E), then sum "
                          "max(0, load - capacity) over the experts"),
                     expected=f"{want} token-slots")


# ---- expert parallelism's all-to-all against tensor parallelism's collectives ---------------

def _ep_tp_bytes(tokens, h, k, p, e):
    """(EP, TP) bytes one rank sends in one MoE layer's forward, p ranks: EP: dispatch and
    combine all-to-alls of the rank's tokens x k rows of h, (p-1)/p of each leaves the
    rank; TP with sequence parallelism on the p ranks' p x tokens: an all-gather and a
    reduce-scatter of the group's p tokens x h, (p-1)/p of each per rank."""
    ep = 2 * tokens * k * h * e * (p - 1) / p
    tp = 2 * p * tokens * h * e * (p - 1) / p
    return ep, tp


@exercise
def check_ep_tp_mb(ep_mb, tp_mb, tokens: int = 4096, h: int = 4096, k: int = 2, p: int = 8,
                   bytes_per_value: int = 2) -> None:
    """MB one rank sends per MoE layer forward with the experts over p ranks by EP (each
    rank ``tokens`` of its own) and by TP with sequence parallelism (the same p x tokens
    on the group): the same expert FLOPs per rank."""
    e = bytes_per_value
    want_ep, want_tp = (x / 1e6 for x in _ep_tp_bytes(tokens, h, k, p, e))
    one_way = tokens * k * h * e * (p - 1) / p / 1e6
    _verify("EP volume", ep_mb, want_ep, "MB", [
        (one_way, "that is one all-to-all: the dispatch sends the rows out and the combine "
                  "sends the results back, two per layer forward"
                  + _or_did_you([(k == 2, "send one row per token (each token goes to "
                                          "k experts: k rows of h)"),
                                 (e == 2, "count values, not bytes (2 bytes each)")])),
        (2 * tokens * h * e * (p - 1) / p / 1e6, "each token goes to k experts: k rows of h "
                                                  "per token leave in the dispatch"),
        (2 * tokens * k * h * e / 1e6, "the rows for the rank's own experts stay: (p-1)/p "
                                       "of the buffer leaves the rank"),
        (2 * one_way / e, "count bytes: bytes_per_value per value"),
        (want_ep / MIB, MIB_HINT),
        (want_tp, "that is TP's figure: did you swap the two answers? EP's all-to-alls carry "
                  "the rank's own tokens x k rows"),
        (2 * want_ep, "that counts the backward's two all-to-alls too (the gradients' way "
                      "back); the exercise asks for the forward's dispatch and combine"
                      + _or_did_you([(e == 2, FP32)])),
        (p * want_ep, f"that is summed over the {p} ranks; give what one rank sends"),
    ])
    four = ("count four collectives (the attention's all-gather and reduce-scatter too, or "
            "the backward's: the MoE layer's forward has one all-gather before the experts "
            "and one reduce-scatter after)")
    _verify("TP volume", tp_mb, want_tp, "MB", [
        (want_tp / 2, "sequence parallelism gathers the input (all-gather) and scatters the "
                      "output (reduce-scatter): two collectives"
                      + _or_did_you([(e == 2, "count values, not bytes (2 bytes each)")])),
        (want_tp / p, "TP's collectives carry the whole group's p x tokens, not the rank's "
                      "tokens: every rank computes a slice of every token"),
        (2 * p * tokens * h * e / 1e6, "a ring all-gather or reduce-scatter sends (p-1)/p "
                                       "of its buffer per rank"),
        (want_tp * k, "TP does not copy a token per expert: all experts' slices see the same "
                      "gathered tokens" + _or_did_you([(k == 2, four), (e == 2, FP32)])),
        (want_tp * 2, "did you " + four + "?" + _or_did_you([(e == 2, FP32)])),
        (want_tp / MIB, MIB_HINT),
        (p * want_tp, f"that is summed over the {p} ranks; give what one rank sends"),
    ])
    _ok(f"EP sends {want_ep:.4g} MB, TP {want_tp:.4g} MB per rank: k / p = {k}/{p} of it")


def _or_did_you(causes) -> str:
    """"; or did you A, or B?" for the other mistakes that give the same number (those
    whose condition holds), "" if none does."""
    said = [text for holds, text in causes if holds]
    return "; or did you " + ", or ".join(said) + "?" if said else ""


def _verify(name, got, want, unit, wrong, rel=REL):
    """As ``_check_number`` without the "Correct" line (a check of two answers prints one)."""
    got = _number(name, got)
    if not math.isclose(got, want, rel_tol=rel):
        raise CheckError(f"your {name} is {got:.4g} {unit}: " + _rounded_or_hint(got, want, wrong),
                         expected=f"{want:.4g} {unit}")


def _rounded_or_hint(got, want, wrong):
    """The mistake ``got`` matches; else, within 3% of ``want``, a rounding too coarse.  A
    mistake given as (value, text, tolerance) matches within its own tolerance (``_hint``)."""
    if math.isclose(got, want, rel_tol=0.03) and \
            not any(math.isclose(got, v, rel_tol=own[0] if own else 0.02)
                    for v, _, *own in wrong):
        return ROUNDED
    return _hint(got, want, wrong)


# ---- ring attention's K/V blocks ------------------------------------------------------------

@exercise
def check_ring_kv_mb(kv_mb, seq_len: int = 131072, cp: int = 16, kv_heads: int = 8,
                     head_dim: int = 128, tp: int = 1, micro_batch: int = 1,
                     bytes_per_value: int = 2, layers: int = 32) -> None:
    """MB of K and V one rank sends around the ring in one layer's forward: cp - 1 steps,
    each one block of s / cp tokens, K and V of kv_heads / tp heads of head_dim.
    ``layers`` (Llama 3 8B's 32) only names the mistake of counting every layer."""
    e, s_l = bytes_per_value, seq_len // cp
    block = 2 * micro_batch * s_l * (kv_heads // tp) * head_dim * e
    want = (cp - 1) * block / 1e6
    # "128K" read as 128,000 tokens: 2.3% low, so matched within REL only (a rounding 1-2%
    # low must still read as a rounding)
    kk = seq_len // 1024
    decimal_k = [((cp - 1) * 2 * micro_batch * (kk * 1000 // cp) * (kv_heads // tp) * head_dim
                  * e / 1e6, f"that takes {kk}K tokens as {kk * 1000:,}; the sequence is "
                  f"{seq_len:,} tokens ({kk} x 1,024)", REL)] if seq_len % 1024 == 0 else []
    _verify("K/V sent", kv_mb, want, "MB", [
        (cp * block / 1e6, "the block a rank holds at the first step is its own: cp - 1 "
                           "steps pass a block on"),
        (block / 1e6, "that is one step; the ring runs cp - 1 of them"),
        ((cp - 1) * block / 2 / 1e6, "both K and V travel: two tensors per block"
                                     + _or_did_you([(e == 2, "count values, not bytes "
                                                             "(2 bytes each)")])),
        ((cp - 1) * block * 4 / 1e6, "grouped-query attention: K and V have kv_heads "
                                     "heads, not the query heads"),
        ((cp - 1) * 2 * micro_batch * seq_len * (kv_heads // tp) * head_dim * e / 1e6,
         "a block holds the rank's s / cp tokens, not the whole sequence"),
        (want / MIB, MIB_HINT),
        (want * layers, f"that is all {layers} layers; the exercise asks for one layer's "
                        "forward"),
        (want * 2, "that counts a backward too; the exercise asks for one layer's forward"
                   + _or_did_you([(e == 2, FP32)])),
        *decimal_k,
    ])
    _ok(f"K/V sent = {want:.4g} MB")


# ---- DeepSpeed-Ulysses' all-to-alls ---------------------------------------------------------

@exercise
def check_a2a_mb(a2a_mb, seq_len: int = 131072, cp: int = 8, heads: int = 32,
                 kv_heads: int = 8, head_dim: int = 128, micro_batch: int = 1,
                 bytes_per_value: int = 2, layers: int = 32) -> None:
    """MB one rank sends in one layer's forward with ``cp_comm="a2a"`` (DeepSpeed-Ulysses,
    Jacobs et al. 2023 sec. 3.2): four all-to-alls, q and the output (``heads``), k and v
    (``kv_heads``), each of the rank's s / cp tokens, of which it keeps its own 1 / cp and
    sends (cp - 1) / cp.  ``layers`` only names the mistake of counting every layer."""
    e, s_l = bytes_per_value, seq_len // cp
    unit = micro_batch * s_l * head_dim * e               # one head of the rank's block
    keep = (cp - 1) / cp
    want = keep * unit * (2 * heads + 2 * kv_heads) / 1e6
    ring = (cp - 1) * 2 * unit * kv_heads / 1e6           # the ring's K/V, for the same cp
    same_as_ring = math.isclose(ring, keep * unit * 4 * heads / 1e6, rel_tol=1e-9)
    kk = seq_len // 1024
    decimal_k = [(want * (kk * 1000 // cp) / s_l, f"that takes {kk}K tokens as "
                  f"{kk * 1000:,}; the sequence is {seq_len:,} tokens ({kk} x 1,024)", REL)] \
        if seq_len % 1024 == 0 else []
    _verify("all-to-all volume", a2a_mb, want, "MB", [
        (want / keep, "a rank keeps the 1 / cp of each block that stays its own: it sends "
                      "(cp - 1) / cp of it"),
        (keep * unit * (heads + 2 * kv_heads) / 1e6, "the output goes back too: four "
                                                     "all-to-alls, q, k, v and o"),
        (keep * unit * 2 * heads / 1e6, "k and v travel too: four all-to-alls, q, k, v and o"),
        (keep * unit * 4 * heads / 1e6, "grouped-query attention: k and v have kv_heads "
                                        "heads, q and the output the query heads"
                                        + _or_did_you([(same_as_ring, "count the ring's "
                                                        "cp - 1 K/V hops")])),
        *([] if same_as_ring else [(ring, "that is the ring's cp - 1 K/V hops; the "
                                          "all-to-all moves q, k, v and o once each")]),
        (keep * unit * 4 * kv_heads / 1e6, "q and the output have the query heads, not "
                                           "kv_heads"),
        (want * cp, "a rank's block holds its s / cp tokens, not the whole sequence"),
        (want / MIB, MIB_HINT),
        (want * layers, f"that is all {layers} layers; the exercise asks for one layer's "
                        "forward"),
        (want * 2, "that counts the backward's four too; the exercise asks for one layer's "
                   "forward" + _or_did_you([(e == 2, FP32)])),
        (want / 2, "count bytes, not values (2 bytes each)" if e == 2 else
         "count bytes, not values"),
        *decimal_k,
    ])
    _ok(f"all-to-all volume = {want:.4g} MB a rank, the ring's {ring:.4g} MB for the same cp")
