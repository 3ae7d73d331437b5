"""Checks for the exercises of notebook 15 (from training to serving).

As in :mod:`.checks`: a right answer prints one "Correct: ..." line, a wrong one raises
:class:`~.feedback.CheckError` with the hint first and the expected value from the third
wrong try on.  Expected values come from hand formulas written out here (a decode step reads every
weight once; ``torch.chunk`` sizes by hand; a static batch's slots), never from
``workbench.checkpoint`` or ``workbench.serve``: a bug there must not become the right
answer.
"""
from __future__ import annotations

import math

from .checks import _chunks, _hint, _number, _ok, _rank
from .feedback import CheckError, exercise

__all__ = ["check_decode_floor_ms", "check_load_reads", "check_static_useful_share"]

READ_ONCE = ("the step reads each weight once: the weights' bytes over the bandwidth, "
             "in milliseconds")

@exercise
def check_decode_floor_ms(bf16_ms, int8_ms, weight_params: float, bandwidth: float) -> None:
    """The memory-bound floor of one decode step: every weight read once per step from
    device memory, ``weight_params`` at 2 bytes (bf16) and at 1 byte (int8), at
    ``bandwidth`` bytes/s."""
    want = weight_params * 2 / bandwidth * 1e3
    bf16, int8 = _number("bf16_ms", bf16_ms), _number("int8_ms", int8_ms)
    if math.isclose(bf16, want / 2, rel_tol=0.01) and math.isclose(int8, want, rel_tol=0.01):
        raise CheckError(f"your bf16 floor ({bf16:.4g} ms) is half your int8 one: did you swap "
                         "the two answers? A bf16 weight is 2 bytes, an int8 one 1",
                         expected=f"{want:.4g} ms")
    for name, got, right in (("bf16", bf16, want), ("int8", int8, want / 2)):
        if not math.isclose(got, right, rel_tol=0.01) and math.isclose(got, right, rel_tol=0.05):
            raise CheckError(f"your {name} decode floor is {got:.4g} ms: close, but not within "
                             "1%: did you round? Give it unrounded", expected=f"{right:.4g} ms")
    if not math.isclose(bf16, want, rel_tol=0.01):
        wrong = [(want * 8, "that counts bits: a bf16 weight is 2 bytes"),
                 (want * 1e12, f"the bandwidth is in bytes per second ({bandwidth / 1e12:g} "
                               f"TB/s is {bandwidth:.3g} B/s): divide the bytes by it as it is"),
                 (want * 2, "that counts 4 bytes per weight (fp32); a bf16 weight is 2 bytes"),
                 (want / 2, "that counts 1 byte per bf16 weight; bf16 is 2 bytes")]
        raise CheckError(f"your bf16 decode floor is {bf16:.4g} ms: "
                         + _hint(bf16, want, wrong, fallback=READ_ONCE), expected=f"{want:.4g} ms")
    if math.isclose(int8, want, rel_tol=0.01):
        raise CheckError("your int8 floor equals the bf16 one: int8 weights are 1 byte each, "
                         "so the step reads half the bytes", expected=f"{want / 2:.4g} ms")
    if not math.isclose(int8, want / 2, rel_tol=0.01):
        wrong = [(want / 4, "that is int4 (half a byte per weight); int8 is 1 byte")]
        raise CheckError(f"your int8 decode floor is {int8:.4g} ms: "
                         + _hint(int8, want / 2, wrong, fallback=READ_ONCE),
                         expected=f"{want / 2:.4g} ms")
    _ok(f"a decode step reads every weight once: at least {bf16:.3g} ms in bf16, "
        f"{int8:.3g} ms with int8 weights")


@exercise
def check_load_reads(ranks, rank: int = 1, rows: int = 16, saved: int = 8,
                     loaded: int = 3) -> None:
    """The saved ranks whose files rank ``rank`` reads when ``rows`` rows saved
    ``Shard(0)`` over ``saved`` ranks are loaded ``Shard(0)`` over ``loaded`` ranks
    (``torch.chunk`` sizes both times)."""
    ranks = _rank_numbers(ranks)
    def bounds(n, k):
        sizes, out, start = _chunks(rows, n), [], 0
        for s in sizes:
            out.append((start, start + s))
            start += s
        return out[k] if k < len(out) else (rows, rows)
    lo, hi = bounds(loaded, rank)
    want = [s for s in range(saved) if (b := bounds(saved, s))[0] < hi and b[1] > lo
            and b[1] > b[0]]
    got = sorted(set(ranks))
    if got == want:
        _ok(f"rank {rank} reads rows {lo}..{hi - 1} from the files of saved ranks {want}")
        return
    chunk = (f"rank {rank} holds chunk {rank} of torch.chunk({rows}, {loaded}): ceil({rows} / "
             f"{loaded}) rows per chunk, the last one shorter")
    overlap = f"the saved ranks whose chunk of torch.chunk({rows}, {saved}) overlaps it"
    if not got:
        raise CheckError(f"an empty list: rank {rank} holds rows, so it reads at least one "
                         f"file; {chunk}; list {overlap}", expected=str(want))
    if got == list(range(lo, hi)):
        raise CheckError(f"those are rank {rank}'s rows; give the saved ranks whose files hold "
                         f"them (saved rank s holds chunk s of torch.chunk({rows}, {saved}))",
                         expected=str(want))
    if any(not 0 <= r < saved for r in got):
        raise CheckError(f"the saved ranks are 0..{saved - 1}; {chunk}; list {overlap}",
                         expected=str(want))
    if got == list(range(saved)):
        raise CheckError("that is every file: a rank reads only the saved pieces that "
                         "overlap its own rows", expected=str(want))
    if got == [rank]:
        raise CheckError(f"rank {rank} of the {loaded} is not saved rank {rank}: the layouts "
                         f"differ; {chunk}; list {overlap}", expected=str(want))
    extra = [r for r in got if r not in want]
    missing = len(want) - (len(got) - len(extra))
    if extra:
        held = "; ".join(f"saved rank {r} holds rows {a}..{b - 1}" for r in extra
                         for a, b in [bounds(saved, r)])
        more = f"; and {missing} more saved rank(s) overlap rank {rank}'s rows" if missing else ""
        raise CheckError(f"{held}: rank {rank} holds none of those ({chunk}){more}",
                         expected=str(want))
    raise CheckError(f"{got} overlap rank {rank}'s rows, but {missing} more saved rank(s) do "
                     f"too: {chunk}", expected=str(want))


def _rank_numbers(ranks) -> list:
    """``ranks`` as a list of Python ints: a list, tuple, set, range, NumPy array or 1-d
    tensor of integers (NumPy's and torch's integers too: ``checks._rank``); anything
    else (a string, a number, floats, bools, a bool mask) is a CheckError."""
    bad = CheckError(f"give a list of rank numbers (ints), got {ranks!r}")
    if isinstance(ranks, (str, bytes, dict)) or not hasattr(ranks, "__iter__") or \
            getattr(ranks, "ndim", 1) != 1:
        raise bad
    out = []
    for r in ranks:
        try:
            out.append(_rank(r))     # a bool mask's elements are no rank numbers
        except TypeError:
            raise bad from None
    return out


@exercise
def check_static_useful_share(share, outputs=(12, 3, 7, 2)) -> None:
    """The share of a static batch's decode tokens that its requests needed: each
    request needs ``output - 1`` decode steps (the prefill samples the first token),
    the batch runs ``max(outputs) - 1`` decode steps for every slot."""
    n, top = len(outputs), max(outputs)
    want = sum(o - 1 for o in outputs) / (n * (top - 1))
    got = _number("share", share)
    if math.isclose(got, want, rel_tol=0.005):
        _ok(f"the requests needed {got:.4g} of the decode tokens the batch computed")
        return
    o_not_o_minus_1 = sum(outputs) / (n * (top - 1))
    padded = ("that is the padded share; give the useful share (needed over computed)"
              if not math.isclose(o_not_o_minus_1, 1 - want) else
              "that is the padded share, or counts o decode tokens for a request of o "
              "tokens: the prefill samples the first, so it needs o - 1; give the useful "
              "share")
    wrong = [(sum(outputs) / (n * top), "the prefill samples each request's first token, so "
              "a request of o tokens needs o - 1 decode steps, and the batch runs max - 1"),
             (want * (top - 1) / top, "the batch runs max - 1 decode steps per slot (the "
              "prefill sampled every first token), not max"),
             (1 / want, "that is computed over needed: give needed over computed"),
             (1 - want, padded),
             (o_not_o_minus_1, "a request of o tokens needs o - 1 decode tokens: the "
              "prefill samples its first"),
             (sum(o - 1 for o in outputs), "that is the count of decode tokens the requests "
              "needed; the share divides it by those the batch computed"),
             (n * (top - 1), "that is the count of decode tokens the batch computed; the "
              "share is the needed ones over it")]
    if math.isclose(got, want, rel_tol=0.02) and \
            not any(math.isclose(got, v, rel_tol=0.005) for v, _ in wrong):
        raise CheckError(f"your share is {got:.4g}: close, but not within 0.5%: did you "
                         "round? Compute it from the token counts, unrounded",
                         expected=f"{want:.4g}")
    raise CheckError(f"your share is {got:.4g}: "
                     + _hint(got, want, wrong, 0.005, share=True,
                             fallback="count each request's decode tokens and the batch's, "
                                      "slot by slot" if 0 <= got <= 1 else
                                      "a share lies between 0 and 1: the decode tokens the "
                                      "requests needed over those the batch computed"),
                     expected=f"{want:.4g}")
