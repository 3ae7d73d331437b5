"""Checks for the exercises of notebook 16 (dynamic to static).

As in :mod:`.checks`: a right answer prints one "Correct: ..." line, a wrong one raises
:class:`~.feedback.CheckError` with the hint first and the expected value from the third
wrong try on.  Expected values come from formulas written out here (ring collectives send
(p-1)/p of their buffer; a graph launch replaces every kernel's launch), never from
``workbench.compile``'s own counts: a bug there must not become the right answer.  The
graph-break exercise runs the student's function through ``wb.compile`` (whether it
breaks is the question) and holds its results to a plain-torch reference.
"""
from __future__ import annotations

import contextlib
import io
import math
import re

import torch

from ..sim_mesh.profiles import get_profile
from .checks import _check_number, _number, _ok, _scale_slip
from .feedback import CheckError, exercise, raised

__all__ = ["check_no_graph_break", "check_greedy_vs_whole_bytes", "check_sink_saving_us"]


def scale_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """relu(x / m) with m = max(1, the largest |x|): what ``scale_rows`` computes."""
    m = max(1.0, float(x.abs().max()))
    return torch.relu(x / m)


@exercise
def check_no_graph_break(fn) -> None:
    """``fn(x)`` computes ``scale_rows`` (relu of x divided by max(1, max |x|)) with no
    data-dependent Python control flow, so that ``wb.compile`` captures it whole."""
    import workbench as wb
    if not callable(fn):
        kind = type(fn).__name__
        raise CheckError(f"pass your function itself (got {'an' if kind[0] in 'aeiou' else 'a'} "
                         f"{kind})")
    mesh = wb.Mesh.grid((2,))
    g = torch.Generator().manual_seed(16)
    small = torch.rand(4, 6, generator=g) * 1.6 - 0.8           # every |x| < 1
    big = torch.randn(4, 6, generator=g) * 3                    # some |x| > 1
    try:                                 # eagerly first: the student's own errors, as answers
        fn(wb.shard_tensor(small, mesh, [wb.Shard(0)]))
    except Exception as e:
        msg = raised("your function", e)
        if isinstance(e, TypeError) and re.search(r"got \((float|int|bool)\b", str(e)):
            msg += (" (a Python number where a tensor goes: .item() or float() read the "
                    "tensor's value; keep it a tensor, x.abs().amax())")
        raise CheckError(msg) from None
    prog = wb.compile(fn, wb.shard_tensor(small, mesh, [wb.Shard(0)]), method="trace")
    if prog.eager:
        raise CheckError(_break_feedback(prog.breaks[0]))
    for name, x in (("all |x| < 1", small), ("largest |x| > 1", big)):
        want = scale_rows_reference(x)
        try:
            got = prog(wb.shard_tensor(x, mesh, [wb.Shard(0)]))
        except ValueError:               # compiled for other shapes: compile again
            got = wb.compile(fn, wb.shard_tensor(x, mesh, [wb.Shard(0)]), method="trace")(
                wb.shard_tensor(x, mesh, [wb.Shard(0)]))
        if got is None:
            raise CheckError("your function returns None: did you forget `return`?")
        if not isinstance(got, (wb.DistTensor, torch.Tensor)):
            raise CheckError(f"your function returns a {type(got).__name__}, not a tensor")
        got = got.full() if isinstance(got, wb.DistTensor) else got
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            like = lambda ref: got.shape == ref.shape and torch.allclose(  # noqa: E731
                got, ref, rtol=1e-5, atol=1e-6)
            if name.startswith("all") and like(torch.relu(x / x.abs().max())):
                hint = ("divide by max(1, m), not by m (nor by min(1, m)): inputs already "
                        "within [-1, 1] stay as they are; torch.clamp(m, min=1) is max(1, m)")
            elif like(_scaled(x, x.abs().amax(-1, keepdim=True))) or like(
                    _scaled(x, x.abs().amax(0, keepdim=True))):
                hint = ("you scaled each row (or column) by its own largest |x|; scale_rows "
                        "divides the whole tensor by one number, max(1, the largest |x| of "
                        "all its entries): amax() with no dim")
            elif like(_scaled(x, x.amax())):
                hint = ("m is the largest ABSOLUTE value, x.abs().amax(): x.amax() (or x.max()) "
                        "misses a large negative entry")
            elif (got < 0).any():
                hint = "it has negative entries: scale_rows ends with torch.relu"
            else:
                hint = "compare with relu(x / max(1, max|x|))"
            raise CheckError(f"for an input with {name} your function gives another "
                             f"result: {hint}")
    _ok(f"{len(prog.graph.nodes)} ops captured whole, no graph break; the results match "
        "with and without scaling")


# capture's message for an op it cannot place: "<qualname> at <file>:<line> (<code>) has no
# entry in the op table ..." (workbench/compile/capture.py); its break has no line of its own
_NO_ENTRY = re.compile(r"^(?P<fn>[\w.]+) at (?P<loc>\S+:\d+) \((?P<code>.*)\) has no entry "
                       r"in the op table")
_CELL = re.compile(r"/tmp/ipykernel_\d+/\d+\.py")          # a notebook cell's file


def _break_feedback(brk) -> str:
    """What to tell a student whose function still runs eagerly: Python read a tensor's
    value (a break at a source line), or capture met an op the op table lacks."""
    m = _NO_ENTRY.match(brk.reason)
    # capture stopped for another reason (a global written, a reseed, a random draw, an
    # autograd.Function: capture.py's refusals, some with a line): its own words, no advice
    # about reading values; a value read says "data-dependent" (capture.py's own break and
    # torch.export's "Could not guard on data-dependent expression")
    if m is None and (not brk.line or "data-dependent" not in brk.reason):
        return f"wb.compile still falls back to eager: {_CELL.sub('<cell>', brk.reason)}"
    if m is None:
        return (f"wb.compile still falls back to eager: {brk.reason} at line {brk.line} "
                f"({brk.code!r}). Python must not read a tensor's value (an `if` on a tensor, "
                "Python's max() or min() of one, bool(), .item()): compute both branches "
                "with tensor ops instead, torch.clamp(m, min=1) or torch.where(...)")
    fn = m["fn"].rsplit(".", 1)[-1]
    loc = _CELL.sub("<cell>", m["loc"])
    instead = "torch.clamp, torch.maximum or torch.where"
    code = f" ({m['code'].strip()})" if m["code"].strip() else ""
    return (f"wb.compile still falls back to eager: capture takes only the ops of the op "
            f"table, and {fn}() at {loc}{code} is not one of them. Write it with ops the "
            f"table has: {instead}")


def _scaled(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """relu(x / max(1, m)) for another choice of m: a mistake's result."""
    return torch.relu(x / torch.clamp(m, min=1.0))


# Bytes are whole numbers a student computes exactly: a mistake is named only within 0.5%
# of its value (at p = 8 the whole tensor, 6,144 B, lies 1.6% from the op-by-op 6,048 B,
# and the default 2% named it "the op-by-op count")
HINT_REL = 0.005


def _ring(nbytes: float, p: int) -> float:
    """Bytes each rank sends in a ring all-gather / all-to-all of a ``nbytes`` buffer."""
    return (p - 1) / p * nbytes


@exercise
def check_greedy_vs_whole_bytes(greedy, whole, rows: int = 16, cols: int = 32, p: int = 4,
                                elem: int = 4) -> None:
    """Bytes each rank sends for softmax over dim 1 of a (rows, cols) tensor sharded on
    dim 1 over p ranks, then resharded to Replicate: op by op (all_to_all to S(0), then
    all_gather) and compiled (one all_gather before the softmax)."""
    full = rows * cols * elem
    want_g = _ring(full / p, p) + _ring(full, p)
    want_w = _ring(full, p)
    # section 2's own case (16 x 32 float32 on 4 ranks): the formula checked, not yet applied
    s2 = 16 * 32 * 4
    s2_g, s2_w = _ring(s2 / 4, 4) + _ring(s2, 4), _ring(s2, 4)
    other = (rows, cols, p, elem) != (16, 32, 4, 4)
    same_case = (f"that is section 2's case (16 x 32 on 4 ranks); now apply your formula to "
                 f"a ({rows}, {cols}) tensor on {p} ranks")
    with contextlib.redirect_stdout(io.StringIO()):     # one "Correct" line for both
        _check_number("op-by-op bytes", greedy, want_g, "B", verb="are", wrong=[
            *([(s2_g, same_case)] if other else []),
            (want_w, "that is the compiled program's count; op by op, the softmax first moves "
                     "its input to S(0) with an all_to_all (each rank sends (p-1)/p of its "
                     "shard), and the all_gather to Replicate comes after"),
            (full / p + full, "each collective sends (p-1)/p of its buffer, not all of it "
                              "(a rank keeps its own piece)"),
            (_ring(full, p) * 2, "the all_to_all moves one rank's shard (rows x cols/p), not "
                                 "the whole tensor"),
            (_ring(full / p, p) * 2, "the all_gather's buffer is the whole gathered tensor: each "
                                     "rank sends (p-1)/p of it, not (p-1)/p of one shard"),
            (_ring(full / p, p) + full, "the all_gather: a rank keeps its own shard and "
                                        "sends the other p - 1, (p-1)/p of the tensor, not "
                                        "all of it"),
            (full / p / p + full / p, "each collective sends (p-1)/p of its buffer (all but "
                                      "the rank's own piece), not 1/p of it"),
            (_ring(full / p, p) + (p - 1) * full, "the all_gather sends p - 1 shards of "
                                                  "full/p bytes, (p-1)/p of the tensor, not p - 1 "
                                                  "whole copies of it"),
            (full / p + want_w, "the all_to_all: a rank keeps its own piece of its shard and "
                                "sends the other (p-1)/p of its shard, not all of it"),
            (want_g * p, "count the bytes ONE rank sends (per rank), not every rank's "
                         "sends added up (nor bits)"),
            (want_g / elem, "count bytes (4 per float32), not elements")],
            hint_rel=HINT_REL)
    _check_number("compiled bytes", whole, want_w, "B", verb="are", wrong=[
        *([(s2_w, same_case)] if other else []),
        (want_g, "that is the op-by-op count; compiled, the softmax runs on the gathered "
                 "tensor, so the only collective is one all_gather"),
        (full, "an all_gather sends (p-1)/p of the buffer from each rank"),
        (full / p, "that is one shard, 1/p of the tensor; in an all_gather each rank sends "
                   "the p - 1 shards the others lack, (p-1)/p of it"),
        (_ring(full / p, p), "that is (p-1)/p of one shard; an all_gather's buffer is the whole "
                             "gathered tensor: each rank sends p - 1 shards of full/p bytes"),
        ((p - 1) * full, "each rank sends p - 1 shards of full/p bytes, (p-1)/p of the tensor, "
                         "not p - 1 whole copies of it"),
        (want_w / elem, "count bytes (4 per float32), not elements")],
        what=f" (op by op: {float(greedy):.4g} B)", hint_rel=HINT_REL)


@exercise
def check_sink_saving_us(us, kernels: int, profile: str = "ascend-910b") -> None:
    """Microseconds a graph sink saves on a step of ``kernels`` kernels launched one by
    one: every launch is dropped, one launch of the whole graph is paid."""
    lt = get_profile(profile).launch_overhead
    want = (kernels - 1) * lt * 1e6
    got = _number("launch time saved", us)
    if got > kernels * lt * 1e6 * 1.02:
        more = f"your launch time saved is {got:.4g} us, more than all {kernels} launches of " \
               "the step take"
        # a unit slip or a double count is no sign of the bucketing pass: say which it is
        slip = _scale_slip(got, want, 0.02, False) or _scale_slip(got, want + lt * 1e6, 0.02,
                                                                  False)
        if slip:
            raise CheckError(f"{more}: {slip}", expected=f"{want:.4g} us")
        if any(math.isclose(got, 2 * n * lt * 1e6, rel_tol=0.02) for n in (kernels - 1, kernels)):
            raise CheckError(f"{more}: its {kernels} kernels are the forward and backward "
                             "kernels together, each launched once: count each launch once",
                             expected=f"{want:.4g} us")
        raise CheckError(f"{more}: the sink removes launches only (the O1 -> O2 difference of "
                         "the table holds the bucketing pass's saving too)")
    other = [] if profile == "a100" else [
        ((kernels - 1) * get_profile("a100").launch_overhead * 1e6,
         f"that is (kernels - 1) x {get_profile('a100').launch_overhead * 1e6:g} us, the "
         f"A100's launch overhead (the notebook's PROFILE), or a count of launches rather "
         f"than their time; this step runs on {profile}: multiply by its profile's "
         f"launch_overhead (seconds)")]
    _check_number("launch time saved", us, want, "us", other + [
        (kernels * lt * 1e6, "the graph itself is still launched once: one launch remains"),
        ((kernels - 1) * lt * 1e3, "launch_overhead is in seconds: times 1e6 for us"),
        ((kernels - 1) * lt, "launch_overhead is in seconds: times 1e6 for us"),
        (lt * 1e6, "that is one launch; the step launches every kernel")])
