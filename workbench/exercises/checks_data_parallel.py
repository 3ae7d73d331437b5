"""Checks for the exercises of notebook 05 (data parallel and ZeRO): the gradient buckets
of bucketed data parallelism, the largest model whose ZeRO states fit, and ZeRO-3's 1.5x
traffic.

Expected values are derived here by hand: bucket sizes by filling whole gradients in
backward order, memory and bytes from the published formulas (ZeRO: Rajbhandari et al.
2020; ring collectives)."""
from __future__ import annotations

import math
import numbers

from torch import nn

from ..sim_mesh.profiles import get_profile
from .answers import _ints, _other_n
from .checks import _hint, _number, _ok, _zero_bytes
from .feedback import CheckError, exercise

__all__ = ["check_bucket_sizes", "check_zero_max_params", "check_zero3_traffic"]


# ---- 05 data parallel: gradient buckets --------------------------------------------------------

def _mlp(widths) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(nn.GELU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def _fill(sizes, limit) -> list[int]:
    """Buckets in the order ``sizes`` come: close one once it holds >= limit bytes."""
    out, cur = [], 0
    for s in sizes:
        cur += s
        if cur >= limit:
            out.append(cur)
            cur = 0
    return out + ([cur] if cur else [])


def _fill_below(sizes, limit) -> list[int]:
    """Buckets closed BEFORE the gradient that would take them past ``limit`` (a bucket
    never above the cap): the usual misreading of DDP's rule, which closes a bucket after
    the gradient that brings it to the cap or more."""
    out, cur = [], 0
    for s in sizes:
        if cur and cur + s > limit:
            out.append(cur)
            cur = 0
        cur += s
    return out + ([cur] if cur else [])


def _torch_default(sizes) -> list[int]:
    """torch DDP's default rebuilt buckets over ``sizes`` (in the order backward produced
    them): the first closes at 1 MiB, the next at 25 MiB (``parallel.strategies.ddp_buckets``,
    ``torch_policy``: ``_DEFAULT_FIRST_BUCKET_BYTES``, ``_DEFAULT_BUCKET_CAP_MB``)."""
    first = _fill(sizes, 2**20)[0]
    k = next(i for i in range(len(sizes) + 1) if sum(sizes[:i]) == first)
    return [first] + _fill(sizes[k:], 25 * 2**20) if k < len(sizes) else [first]


@exercise
def check_bucket_sizes(sizes, bucket_bytes: int = 2 * 2**20,
                       widths=(256, 1024, 1024, 256)) -> None:
    """The bytes of each gradient bucket bucketed DP all-reduces, in the order sent, for
    the MLP of ``widths`` (Linear layers with biases, fp32) and ``bucket_bytes``."""
    grads_fwd = []                                              # registration order, by hand
    for a, b in zip(widths, widths[1:]):
        grads_fwd += [a * b * 4, b * 4]                         # fp32 weight, bias
    want = _fill(grads_fwd[::-1], bucket_bytes)                 # backward: last layer first
    total = sum(grads_fwd)
    _unit_slip(sizes, total)
    got = _ints("sizes", sizes, "bucket sizes in bytes")
    names = [f"{'W' if k % 2 == 0 else 'b'}{k // 2 + 1}" for k in range(len(grads_fwd))]
    if got == want:
        _ok(f"{len(want)} all-reduces of {', '.join(f'{b:,d}' for b in want)} B per step "
            f"(backward order {', '.join(reversed(names))}), instead of {len(grads_fwd)} "
            "without buckets")
        return
    if got == _torch_default(grads_fwd[::-1]) and got != want:
        msg = ("those are PyTorch DDP's default buckets (a first bucket closed at 1 MiB, "
               f"then 25 MiB ones); here every bucket closes at bucket_bytes = "
               f"{bucket_bytes:,d} B, as torch's do with bucket_cap_mb={bucket_bytes / 2**20:g}")
    elif got == want[::-1]:
        msg = ("right sizes, wrong order: backward produces the last layer's gradients "
               "first, and the buckets fill (and are sent) in that order")
    elif sum(got) == total // 4:
        msg = "those are numbers of values: a fp32 gradient takes 4 bytes per value"
    elif sum(got) == total // 2:
        msg = ("those are 2 bytes per value (bf16 or fp16); the MLP trains in fp32: 4 bytes "
               "per gradient value")
    elif sum(got) == total - 4 * sum(widths[1:]):
        msg = "the biases are missing: every parameter has a gradient to reduce"
    elif sum(got) != total:
        msg = (f"your buckets hold {sum(got):,d} B in all; the gradients are {total:,d} B "
               f"(fp32, biases included): every gradient goes in exactly one bucket")
    elif got == _fill(grads_fwd, bucket_bytes):
        msg = ("those are the buckets of the forward (registration) order; backward "
               "produces the gradients last layer first, and the buckets fill in that order")
    elif len(got) == 1:
        msg = (f"one bucket would hold all {total:,d} B; with bucket_bytes = "
               f"{bucket_bytes:,d} a bucket is sent as soon as it holds that much")
    elif got == _fill_below(grads_fwd[::-1], bucket_bytes):
        msg = ("each of your buckets stops before the gradient that would take it past "
               "bucket_bytes; DDP's bucket takes that gradient too, and closes once it holds "
               "bucket_bytes or more")
    elif all(b == bucket_bytes for b in got[:-1]):
        msg = ("a bucket never splits a gradient: it takes whole gradients and closes "
               "after the one that brings it to bucket_bytes or more")
    else:
        msg = (f"fill a bucket with whole gradients in backward order "
               f"({', '.join(reversed(names))}) and close it as soon as it holds at least "
               f"bucket_bytes = {bucket_bytes:,d} B; what remains at the end is the last "
               "bucket")
    raise CheckError(f"your buckets are {got}: {msg}", expected=str(want))


def _unit_slip(sizes, total) -> None:
    """Bucket sizes given in MiB or MB (fractions, or whole numbers far below a byte
    count), said as such rather than only "should be a list of ints"."""
    if not isinstance(sizes, (list, tuple)):
        return                          # (an iterator is read once, by _ints)
    items = [float(v) for v in sizes if isinstance(v, numbers.Real) and not isinstance(v, bool)]
    if not items or len(items) != len(sizes):
        return
    for scale, unit in ((2**20, "MiB"), (1e6, "MB"), (2**10, "KiB"), (1e3, "KB")):
        if math.isclose(sum(items) * scale, total, rel_tol=0.01):
            raise CheckError(f"your bucket sizes add up to {sum(items):g}: that reads as "
                             f"{unit}; give each bucket's size in bytes, as an int")


# ---- 05 ZeRO: the largest model whose states fit ------------------------------------------------

_STAGE_PARTS = {0: "nothing is partitioned: 16 B per parameter on every device",
                1: "stage 1 keeps 4 B of bf16 weights and gradients whole, 12 B of "
                   "optimizer states split: 4 + 12 / N_d B per parameter",
                2: "stage 2 keeps 2 B of bf16 weights whole, 14 B split: 2 + 14 / N_d",
                3: "stage 3 splits all 16 B: 16 / N_d B per parameter"}


@exercise
def check_zero_max_params(psi, n_d: int = 64, profile: str = "ascend-910b") -> None:
    """The most parameters whose mixed-precision Adam model states fit in one device's
    memory under ZeRO stages 0, 1, 2, 3 with ``n_d`` data-parallel ranks (activations
    and buffers ignored)."""
    if isinstance(psi, dict):
        raise CheckError("psi should be a list of 4 numbers, stages 0 to 3; got a dict (a list "
                         "of it would be its keys): pass a list, e.g. list(d.values())")
    try:
        got = [float(_number(f"psi[{s}]", v)) for s, v in enumerate(psi)]
    except TypeError:
        raise CheckError(f"psi should be a list of 4 numbers, stages 0 to 3; got {psi!r}") \
            from None
    if len(got) != 4:
        raise CheckError(f"psi has {len(got)} entries; give one per ZeRO stage 0, 1, 2, 3")
    prof = get_profile(profile)
    mem = prof.memory_bytes
    per = {s: _zero_bytes(1, n_d, s) for s in range(4)}
    want = [mem / per[s] for s in range(4)]
    for s in range(4):
        if math.isclose(got[s], want[s], rel_tol=0.01):
            continue
        wrong = [(want[t], f"that is stage {t}'s limit; {_STAGE_PARTS[s]}")
                 for t in range(4) if t != s and not math.isclose(want[t], want[s])]
        # usable memory (60.02 GB) and 64 GiB in GB (59.6) lie 0.7% apart: match tightly
        wrong += [(want[s] * prof.usable_memory() / mem,
                   f"that is the usable memory (NPU.usable_memory(), "
                   f"{prof.usable_memory() / 1e9:.1f} GB); this exercise takes all of "
                   f"NPU.memory_bytes, {mem:,.0f} bytes") if prof.usable_memory() < mem else (math.nan, ""),
                  (want[s] * 2**30 / 1e9, f"did you take 64 GiB? The profile's memory is "
                   f"{mem:,.0f} bytes (64 GB)"),
                  (want[s] * 1e9 / 2**30, "did you convert to GiB? Keep bytes: "
                   f"{mem:,.0f}"),
                  (want[s] / 1e9, "give a number of parameters, not billions"),
                  (mem / 4, "4 B per parameter is an fp32 weight alone; mixed-precision Adam "
                   "keeps 16 B (2 bf16 weight + 2 bf16 gradient + 12 fp32 master weight, "
                   "momentum, variance); " + _STAGE_PARTS[s]),
                  (want[s] * 80e9 / mem, f"80 GB is an A100's memory; the 910B's is "
                   f"NPU.memory_bytes, {mem:,.0f} bytes"),
                  (mem * per[s], "multiply? psi = memory / bytes per parameter"),
                  (mem / 16 / n_d, "dividing the memory by N_d goes the wrong way: ZeRO "
                   "divides the bytes per parameter, so the model can grow; "
                   + _STAGE_PARTS[s])]
        # a part counted both whole and split: each stage's whole bytes with the split of the next
        for whole, split, what in ((4, 14, "split the gradients (14 / N_d) but still counted "
                                    "them whole (4 B)"),
                                   (2, 16, "split the weights too (16 / N_d) but still counted "
                                    "them whole (2 B)")):
            wrong.append((mem / (whole + split / n_d), f"you {what}; {_STAGE_PARTS[s]}"))
        # K = 8: fp32 momentum and variance without the fp32 master weight
        k8 = {0: 12, 1: 4 + 8 / n_d, 2: 2 + 10 / n_d, 3: 12 / n_d}[s]
        wrong.append((mem / k8, "that counts 12 B of model states per parameter where "
                      "mixed-precision Adam keeps 16: 2 (bf16 weight) + 2 (bf16 gradient) + "
                      "K = 12 (fp32 master weight, momentum and variance, 4 B each); "
                      + _STAGE_PARTS[s]))
        if s:
            wrong.append((mem / _zero_bytes(1, n_d - 1, s), f"that divides by N_d - 1 = "
                          f"{n_d - 1}; the parts ZeRO splits are shared by all N_d = {n_d} "
                          f"devices"))
        if n_d != 8:
            wrong.append((mem / _zero_bytes(1, 8, s), f"that is N_d = 8, the notebook's mesh; "
                          f"the exercise has N_d = {n_d} devices"))
        raise CheckError(f"your stage {s} limit is {got[s]:.4g} parameters: "
                         + _hint(got[s], want[s], wrong, rel=0.003,
                                 fallback=f"compare each factor with the formula: "
                                          f"{_STAGE_PARTS[s]}"),
                         expected=f"{want[s]:.4g} for stage {s}")
    _ok(f"on {n_d} devices of {mem / 1e9:g} GB: " + ", ".join(
        f"stage {s} {w / 1e9:.3g}e9" for s, w in enumerate(want)) + " parameters")


# ---- 05 ZeRO-3: 1.5x the traffic --------------------------------------------------------------

@exercise
def check_zero3_traffic(dp_bytes, zero3_bytes, params: float = 7.5e9, n_d: int = 64,
                        elem: int = 2) -> None:
    """Bytes each rank sends per step, ring algorithms, ``elem``-byte values: plain DP
    (all-reduce of the gradients) and ZeRO-3 (all-gather the parameters for forward and
    again for backward, reduce-scatter the gradients)."""
    n = int(params * elem)
    want_dp = 2 * (n_d - 1) * n // n_d                          # ring all-reduce
    want_z3 = 3 * ((n_d - 1) * n // n_d)                        # 2 all-gathers + reduce-scatter
    a, b = _number("dp_bytes", dp_bytes), _number("zero3_bytes", zero3_bytes)
    share = (n_d - 1) / n_d
    if math.isclose(a, want_z3, rel_tol=1e-4) and math.isclose(b, want_dp, rel_tol=1e-4):
        raise CheckError("your two numbers are right but swapped: the first argument is what "
                         "plain DP sends, the second ZeRO-3's")
    bits = "8 times too large: that is bits, not bytes; give the bytes"
    if not math.isclose(a, want_dp, rel_tol=1e-4):
        raise CheckError(f"your DP bytes are {a:.4g}: " + _hint(
            a, want_dp, [(2 * n, f"did you drop (N-1)/N? Each rank sends {n_d - 1} of "
                          f"{n_d} chunks, twice (reduce-scatter, then all-gather)"),
                         (share * n, f"that is (N-1)/N n with n = {n:,d} bytes: an "
                          f"all-gather's share (an all-reduce sends it twice: 2 (N-1)/N n), "
                          f"or an all-reduce of {params:,.0f} bytes (bf16 takes {elem} bytes "
                          f"per parameter)"),
                         (n_d * want_dp, f"that is summed over the {n_d} ranks; give what "
                          f"each rank sends"),
                         (2 * want_dp, f"the gradients are {elem} bytes each (bf16), "
                          f"{n:,d} bytes in all"),
                         (want_dp / n_d, "each rank sends 2 (N-1)/N of the WHOLE gradient, "
                          "not of its shard"),
                         (8 * want_dp, bits)] + _other_n(2 * n, n_d, 8, "N", "the notebook's p"),
            rel=1e-4), expected=f"DP {want_dp:.4g} B")
    if not math.isclose(b, want_z3, rel_tol=1e-4):
        raise CheckError(f"your ZeRO-3 bytes are {b:.4g}: " + _hint(
            b, want_z3, [(2 * want_dp, "2x DP counts an all-reduce's worth twice; ZeRO-3 "
                          "sends three (N-1)/N n pieces: all-gather (forward), all-gather "
                          "(backward), reduce-scatter"),
                         (want_dp, "that is what ZeRO-1 and 2 send (reduce-scatter + "
                          "all-gather = one all-reduce); ZeRO-3 gathers the parameters "
                          "again before backward, having freed them after forward"),
                         (3 * n, "did you drop (N-1)/N? Each collective sends (N-1)/N n"),
                         (2 * want_z3, f"the values are {elem} bytes each (bf16)"),
                         (n_d * want_z3, f"that is summed over the {n_d} ranks; give what "
                          f"each rank sends"),
                         (1.5 * share * n, "1.5x is ZeRO-3 against DP, whose all-reduce sends "
                          "2 (N-1)/N n; ZeRO-3 sends three (N-1)/N n pieces"),
                         (8 * want_z3, bits)] + _other_n(3 * n, n_d, 8, "N", "the notebook's p"),
            rel=1e-4), expected=f"ZeRO-3 {want_z3:.4g} B")
    _ok(f"DP {want_dp / 1e9:.2f} GB, ZeRO-3 {want_z3 / 1e9:.2f} GB per rank per step: "
        f"{want_z3 / want_dp:.1f}x")
