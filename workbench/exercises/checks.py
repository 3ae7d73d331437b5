"""Checks for the course's exercises of notebooks 00 and 01, and the helpers every check
module shares: each check says WHAT is wrong, not only that something is.

A check prints one "Correct: ..." line when the answer is right and raises
:class:`CheckError` (an AssertionError) with a diagnosis otherwise, e.g.

    your path [P(sum), S(1)] -> [R, S(1)] -> [S(0), S(1)] -> [S(0), R] moves 192 B
    per rank (all_reduce 128 B, local_slice 0 B, all_gather 64 B): try reduce_scatter

The hint comes first; the expected value only from the third wrong try on, or with
``wb.exercises.reveal(...)`` (see :mod:`.feedback`).  Every expected value is derived
here, independently of the code under test: from the published formula or a hand
count, never by calling the library function the exercise is about (a bug there
would otherwise become the right answer).  Tests check that library and formula
agree.  The exercise's numbers are the keyword defaults of its check.
"""
from __future__ import annotations

import math
import numbers
import operator

from ..sim_mesh.mesh import Mesh
from ..sim_mesh.profiles import get_profile
from ..text_width import wrap
from .feedback import CheckError, exercise

__all__ = ["CheckError", "check_welcome_mesh", "check_tp_group", "check_training_days",
           "check_zero2_memory_gb", "check_allreduce_seconds"]

SECONDS_PER_DAY = 86_400
# Ascend 910B (Atlas 800T A2) server: HCCS full mesh, 7 links per NPU, 196 GB/s each way
# in all, so 28 GB/s per link (Huawei Atlas 800T A2 datasheet: 392 GB/s bidirectional);
# a ring sends to one neighbour, so it uses ONE link per direction.  alpha = 3 us, the
# figure the ascend-910b profile takes for HCCS.
HCCS_LINKS, HCCS_TOTAL, HCCS_ALPHA = 7, 196e9, 3e-6


def _ok(msg: str) -> None:
    """Print the one "Correct: ..." line, within text_width.WIDTH characters, continuations
    indented (JupyterLab breaks a longer line mid-word)."""
    print(wrap("Correct: " + msg))


def _number(name: str, value) -> float:
    """``value`` as a float: a Python or NumPy real number (``numbers.Real``: a float32
    from NumPy is a number too), finite, not a bool.  A tensor or an array is told to
    pass its number (``.item()``) rather than only that it is no number."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool") \
            or not isinstance(value, numbers.Real) or not math.isfinite(value):
        how = (": pass a Python number, e.g. x.item()" if hasattr(value, "item")
               and not isinstance(value, numbers.Real) else
               ": give the number itself, not a str (no quotes)" if isinstance(value, str)
               else "")
        raise CheckError(f"{name} should be a number, got {value!r}{how}")
    return float(value)


def _whole(value) -> int | None:
    """``value`` as an int where it is a whole number: a Python, NumPy or torch integer
    (``operator.index``) or a float with no fraction (4.0 is the answer 4); None for
    anything else (a bool, a string, 4.5)."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return operator.index(value)
    except TypeError:
        pass
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    return None


FORMULA = "compare each factor with the formula"


def _hint(got: float, want: float, wrong, rel: float = 0.02, fallback: str = FORMULA,
          share: bool = False) -> str:
    """The text of the common mistake whose value lies closest to ``got`` (within its
    tolerance): ``wrong`` holds (value that mistake gives, what to say).  Otherwise only
    the direction, and ``fallback``, what to redo (an exercise without a formula names its
    own method): the ratio would give the expected value away.  A unit slip is named (``share``: the
    answer is a fraction, so 100 times it is a percentage).  A mistake given as (value,
    text, tolerance) is matched within its own tolerance instead of ``rel`` (one that
    lies very close to the expected value, where ``rel`` would swallow rounded answers)."""
    near = [(abs(got - value) / max(abs(value), abs(got), 1e-300), i, text)
            for i, (value, text, *own) in enumerate(wrong)
            if math.isclose(got, value, rel_tol=own[0] if own else rel)]
    if near:        # the closest mistake (two may lie within rel of one answer)
        return min(near)[2]
    if not want:
        return "it should be 0"
    slip = _scale_slip(got, want, rel, share)
    if slip:
        return slip
    return ("too high" if got > want else "too low") + ": " + fallback


def _rank(r) -> int:
    """``r`` as a rank number: a Python, NumPy or torch integer (``operator.index``).  A
    bool is no rank, nor an element of a bool array or tensor (a mask), which
    ``operator.index`` would read as 0 or 1: TypeError, as for a float."""
    if isinstance(r, bool) or str(getattr(r, "dtype", "")) in ("bool", "torch.bool"):
        raise TypeError(f"{r!r} is a bool, not a rank")
    return operator.index(r)


def _scale_slip(got: float, want: float, rel: float, share: bool) -> str | None:
    """The diagnosis when ``got`` is ``want`` in another unit: a percentage given for a
    share, or off by exactly 10^3, 10^6 or 10^9 (s/ms/us, B/KB/MB/GB)."""
    ratio = got / want
    if share and math.isclose(ratio, 100, rel_tol=rel):
        return "that reads as a percentage: give the share as a fraction between 0 and 1"
    if share:
        # a share has no unit, so 1,000x or 1,024x off is no unit slip (check_mfu(mfu/1024)
        # read "a unit slip? (B, KiB, MiB, GiB)"): something was divided or multiplied
        # once too often, such as the device count
        for factor in (1e3, 1e6, 1e9, 2**10, 2**20, 2**30):
            for r, how, op in ((factor, "large", "multiplied"), (1 / factor, "small", "divided")):
                if math.isclose(ratio, r, rel_tol=min(rel, 0.01)):
                    return (f"{factor:,.0f} times too {how}: a share has no unit; was "
                            f"something {op} in once too often (the device count?)")
        return None
    for factor, words in ((1e3, "1,000"), (1e6, "a million"), (1e9, "a billion")):
        for r, how in ((factor, "large"), (1 / factor, "small")):
            if math.isclose(ratio, r, rel_tol=rel):
                return (f"{words} times too {how}: a unit slip? (s, ms, us; B, KB, MB, GB): "
                        "give it in the unit the exercise asks for")
    # binary units lie 2.4% (KiB), 4.9% (MiB), 7.4% (GiB) from the decimal ones: distinct
    for factor, words in ((2**10, "1,024"), (2**20, "2^20"), (2**30, "2^30")):
        for r, how in ((factor, "large"), (1 / factor, "small")):
            if math.isclose(ratio, r, rel_tol=min(rel, 0.01)):
                return (f"{words} times too {how}: a unit slip? (B, KiB, MiB, GiB): give "
                        "it in the unit the exercise asks for")
    return None


def _check_number(name, got, want, unit, wrong, rel=0.01, what="", hint_rel=0.02,
                  fallback=FORMULA, verb="is"):
    """Accept ``got`` within ``rel`` of ``want``; otherwise name the mistake among
    ``wrong`` it matches within ``hint_rel`` (no wider than the mistakes lie apart).
    ``verb``: "are" for a plural ``name`` ("your ZeRO-2 model states are 50 GB")."""
    got = _number(name, got)
    sep = " " if unit else ""                     # a share has no unit: no stray space
    if math.isclose(got, want, rel_tol=rel):
        _ok(f"{name} = {got:.4g}{sep}{unit}{what}")
        return
    mine, right = _apart(got, want)
    raise CheckError(f"your {name} {verb} {mine}{sep}{unit}: "
                     + _hint(got, want, wrong, hint_rel, fallback,
                             share=unit == "" or unit.startswith("of ")),
                     expected=f"{right}{sep}{unit}")


def _apart(got: float, want: float) -> tuple:
    """``got`` and ``want`` to 4 significant digits, or to as many more as tell them apart
    (a wrong 5002.6 beside an expected 5003.0 must not read "5003, expected 5003")."""
    for digits in range(4, 10):
        mine, right = f"{got:.{digits}g}", f"{want:.{digits}g}"
        if mine != right:
            break
    return mine, right


def _rounded_too_far(want: float, step: float, unit: str) -> list:
    """Hints for ``want`` cut (or rounded the wrong way) to the ``step`` an exercise asks
    for, or rounded (up or down) to 10, 100 or 1,000 times it: 8 days for 7.583 asked to
    0.1 day read "too high: compare each factor", which sent the student to a formula that
    was right (browser review nb18).  Each is matched only at its own value (tolerance
    1e-9)."""
    out, seen = [], set()
    for k in (0, 1, 2, 3):
        coarse = step * 10 ** k
        for value in (math.floor(want / coarse) * coarse, math.ceil(want / coarse) * coarse):
            value = round(value, 12)
            if value and value not in seen and abs(value - want) > step / 2:
                seen.add(value)
                # k = 0: cut (0.87 for 0.875042) or rounded the wrong way
                out.append((value, (f"that is rounded too far: give it to {step:g} {unit}, as "
                                    "the exercise asks") if k else
                            (f"that is not the nearest {step:g} {unit}: round to the nearest, "
                             "do not cut"), 1e-9))
    return out


def _chunks(n: int, k: int) -> list:
    """Sizes of ``torch.chunk`` of n items into k pieces, by hand: ceil(n / k) each until
    the items run out, then empty pieces."""
    size = -(-n // k) if n else 0
    return [max(0, min(size, n - i * size)) for i in range(k)]


# ---- 00 welcome -----------------------------------------------------------------------------

@exercise
def check_welcome_mesh(mesh) -> None:
    """A 2 x 4 mesh of ranks 0..7 in row-major order, dims named ("dp", "tp")."""
    if not isinstance(mesh, Mesh):
        raise CheckError(f"your mesh is a {type(mesh).__name__}, not a Mesh: wrap the ranks, e.g. "
                         "wb.Mesh([[...], [...]], dim_names=[...])")
    if mesh.shape != (2, 4):
        hint = (" (dp must come first: 2 rows of 4)" if mesh.shape == (4, 2) else
                ": 2 data-parallel groups of 4 tensor-parallel ranks")
        raise CheckError(f"your mesh has shape {mesh.shape}{hint}", expected="shape (2, 4)")
    if mesh.dim_names != ("dp", "tp"):
        raise CheckError(f"your mesh's dim_names are {mesh.dim_names}: name the mesh dims as "
                         "the exercise does, data parallel first", expected="('dp', 'tp')")
    if mesh.tolist() != [[0, 1, 2, 3], [4, 5, 6, 7]]:
        if sorted(r for row in mesh.tolist() for r in row) != list(range(8)):
            hint = "the 8 devices are ranks 0 to 7"
        else:
            hint = ("ranks of one tp group are neighbours (they share a node): number them row "
                    "by row, as wb.Mesh.grid does")
        raise CheckError(f"your ranks are {mesh.tolist()}: {hint}",
                         expected="[[0, 1, 2, 3], [4, 5, 6, 7]]")
    _ok(f"{mesh}")


@exercise
def check_tp_group(group, rank: int = 5) -> None:
    """The ranks ``rank`` talks to along "tp" on the 2 x 4 (dp, tp) mesh."""
    row, col = divmod(rank, 4)                          # row-major 2 x 4, by hand
    want = tuple(range(4 * row, 4 * row + 4))
    dp_group = (col, col + 4)
    try:
        if isinstance(group, (str, bytes, dict)):
            raise TypeError
        if isinstance(group, (set, frozenset)):     # {7, 6, 5, 4} iterates 4, 5, 6, 7
            raise CheckError(f"your group {group!r} is a set, and a set has no order: give "
                             "the ranks as a tuple or a list, in mesh order")
        got = tuple(_rank(r) for r in group)    # ints only: 4.2 and True are no ranks
    except TypeError:
        raise CheckError(f"group should be a sequence of ranks (ints), got {group!r}") from None
    if got == want:
        _ok(f"rank {rank}'s tp group is {want}")
        return
    if got == dp_group:
        raise CheckError(f"{got} is rank {rank}'s dp group (one rank per dp row, same tp "
                         f"column); along tp, ranks share the dp coordinate: "
                         f"ask the 2 x 4 mesh of exercise 1, mesh8.group_of({rank}, 'tp')",
                         expected=str(want))
    if set(got) == set(want):
        raise CheckError(f"{got} has the right ranks in the wrong order; give them in mesh "
                         "order", expected=str(want))
    if set(got) == set(want) - {rank} and len(got) == len(want) - 1:
        # the exercise asks "with which ranks does rank 5 exchange": its peers alone read
        # "its tp group is the ranks with the same dp coordinate", which they are (nbr17b)
        raise CheckError(f"{got} are rank {rank}'s peers along tp; its group also holds rank "
                         f"{rank} itself (as mesh8.group_of({rank}, 'tp') gives it), in mesh "
                         "order", expected=str(want))
    raise CheckError(f"your group {got} is not rank {rank}'s tp group: rank {rank} sits at "
                     f"coordinate {(row, col)}; its tp group is the ranks with the same dp "
                     "coordinate", expected=str(want))


# ---- 01 why distribute -------------------------------------------------------------------------

# the precision notebook 01's exercises ask for (its prompts say it); tests/test_nb18.py
# holds each prompt to its constant
DAYS_STEP = 0.1      # exercise 1, check_training_days (accepted within 0.25%, see there)
GB_STEP = 0.01       # exercise 2, check_zero2_memory_gb (accepted within GB_STEP / 2); also
                     # notebook 11's exercise 1, checks_plan.check_zero_states_gb
SECONDS_STEP = 0.01  # exercise 3, check_allreduce_seconds (accepted within SECONDS_STEP / 2)


@exercise
def check_training_days(days, params: float = 7e9, tokens: float = 2e12, n_devices: int = 1024,
                        profile: str = "ascend-910b", utilization: float = 0.4) -> None:
    """Days to train ``params`` on ``tokens`` with 6ND (Kaplan et al. 2020) on n devices
    at bf16 peak x utilisation: 6ND / (n x peak x u) / 86,400."""
    peak = get_profile(profile).peak("bfloat16")        # the exercise's given, not a result
    flops = 6 * params * tokens
    want = flops / (n_devices * peak * utilization) / SECONDS_PER_DAY
    fp32 = get_profile(profile).peak("float32")
    # 01 sets peak = A100.peak("bfloat16") in its section 1: reused, it gives an
    # answer 0.3% off (312 for 313 TFLOP/s), which the 1% tolerance passed.  Only a wrong
    # constant lands 0.25-1% off; a rounded answer (7.6 for 7.583) stays within 0.25%.
    a100 = get_profile("a100").peak("bfloat16")
    slips = [] if a100 == peak else [(want * peak / a100, "that uses the A100's bf16 peak "
                                      f"({a100 / 1e12:g} TFLOP/s: the notebook's variable peak is "
                                      f"the A100's); the devices here are {profile}", 0.001)]
    # section 1 prices GPT-3 on 1000 A100s: 1,000 devices reused lies 2.4% off and read
    # "too high: compare each factor" (browser review nbr17b); named only within 0.2%, so
    # that 7.8 (rounded, or a slip) is not read as it
    if n_devices != 1000:
        slips.append((want * n_devices / 1000, f"that uses 1,000 devices (section 1's cluster); "
                      f"the exercise has {n_devices:,}", 0.002))
    slips += _rounded_too_far(want, DAYS_STEP, "days")      # the exercise asks to 0.1 day
    _check_number("training time", days, want, "days", slips + [(want * r, t) for r, t in [
        (1 / 3, "one third of it: did you count only the forward pass (2ND)? "
                "Training is 6ND: 2 per parameter per token forward, 4 backward"),
        (4 / 3, "did you count 8ND? That is with full recompute (a second forward); the "
                "exercise counts 6ND"),
        (utilization, f"did you forget the utilisation? The devices deliver only "
                      f"{utilization:.0%} of their peak"),
        (utilization ** 2, "did you multiply by the utilisation instead of dividing? The "
                           "devices deliver u x peak, so the time is FLOPs / (n x peak x u)"),
        (1 / 100, f"100 times too small: did you write the utilisation as a "
                  f"percentage ({utilization * 100:g})? {utilization:.0%} of peak is "
                  f"{utilization:g}"),
        (86400, "that is seconds: divide by 86,400 s per day"),
        (24, "that is hours: divide by 24"),
        (peak / fp32, f"did you use the float32 peak ({fp32 / 1e12:g} TFLOP/s)? Training runs "
                      f"in bf16: {peak / 1e12:g} TFLOP/s"),
        # without the devices read "1,024 times too large: a unit slip? (B, KiB, ...)"
        (n_devices, f"that is the time on one device: the {n_devices:,} devices share the "
                    "FLOPs, so divide by their number too"),
        (1 / 6, "one sixth of it: did you count N x D FLOPs? Training costs 6ND: 2 per "
                "parameter per token forward, 4 backward"),
        (1e12, "a trillion times too large: is the peak in TFLOP/s? The formula wants FLOP/s "
               f"({peak / 1e12:g} TFLOP/s = {peak:.3g} FLOP/s)"),
    ]], rel=0.0025, what=f" (6ND = {flops:.3g} FLOPs)")


_ZERO_SPLIT = {0: "nothing", 1: "the optimizer states", 2: "optimizer states and gradients",
               3: "optimizer states, gradients and weights"}


def _zero_bytes(psi, n_d, stage):
    """Rajbhandari et al. 2020, sec. 3.1: 2 psi bf16 weights, 2 psi gradients, 12 psi Adam
    (fp32 weights, momentum, variance); stage s divides the first s of (12, 2, 2) by N_d."""
    parts = [12 * psi, 2 * psi, 2 * psi]                # optimizer, gradients, weights
    return sum(b / n_d if i < stage else b for i, b in enumerate(parts))


@exercise
def check_zero2_memory_gb(gb, params: float = 7e9, n_d: int = 8, stage: int = 2) -> None:
    """Model-state GB (1e9 bytes) per device with mixed-precision Adam under ZeRO ``stage``."""
    want = _zero_bytes(params, n_d, stage) / 1e9
    others = {s: _zero_bytes(params, n_d, s) / 1e9 for s in (0, 1, 2, 3) if s != stage}
    weights_only = ("it counts only the bf16 weights (2 bytes per parameter); add gradients "
                    "(2) and Adam's fp32 master weights, momentum and variance (12)")
    hints = [(others[s], f"that is ZeRO stage {s}" + (" (no partitioning: 16 bytes per "
             "parameter on every device)" if s == 0 else "") + f"; stage {stage} partitions "
             + _ZERO_SPLIT[stage]
             # 2 psi is also stage 3 on 8 ranks (16 psi / 8): name both, the weights alone
             # read only "that is ZeRO stage 3"
             + (f"; or {weights_only}" if math.isclose(others[s], 2 * params / 1e9) else ""))
             for s in others]
    hints += [(want * 1e9, "that is bytes: divide by 1e9 for GB"),
              (want * 1e9 / 2**30, "that is GiB (2**30 bytes); the papers use GB = 1e9 bytes"),
              (2 * params / 1e9, "that " + weights_only.removeprefix("it "))]
    # the gradients left out (2 psi + 12 psi / N_d) lies 0.2% from the GiB answer and read
    # "that is GiB"; 4-byte weights kept whole read "compare each factor"
    hints.append((_zero_bytes(params, n_d, stage) / 1e9 - 2 * params / (n_d if stage >= 2
                                                                        else 1) / 1e9,
                  "that leaves out the bf16 gradients (2 bytes per parameter)"
                  + (f", which stage {stage} partitions too" if stage >= 2 else "")))
    hints.append((_zero_bytes(params, n_d, stage) / 1e9 + 2 * params / (n_d if stage >= 3
                                                                        else 1) / 1e9,
                  "that keeps 4-byte weights; with mixed precision the weights are bf16 (2 "
                  "bytes), and the fp32 master copy is one of Adam's 12 bytes"))
    adam8 = [8 * params, 2 * params, 2 * params]         # Adam's states less the fp32 master
    hints.append((sum(b / n_d if i < stage else b for i, b in enumerate(adam8)) / 1e9,
                  "that gives Adam 8 bytes per parameter (momentum and variance); mixed "
                  "precision also keeps an fp32 master copy of the weights (4): 12 bytes of "
                  "optimizer state"))
    if stage == 2:
        hints.append((2 * params / 1e9 + 16 * params / n_d / 1e9,
                      "that counts the bf16 weights twice: whole (2 psi) and again in the "
                      f"partitioned part (16 psi / {n_d}); stage 2 partitions only the "
                      "gradients (2 bytes) and Adam's states (12)"))
    # the exercise asks for GB to 0.01: the 1% default tolerance passed 26 for 26.25
    # (browser review nb18); 26, 26.2, 26.3 are told they are rounded too far
    hints += _rounded_too_far(want, GB_STEP, "GB")
    _check_number("memory", gb, want, "GB", hints, rel=GB_STEP / 2 / want,
                  what=f" = 2 psi + 14 psi / {n_d}" if stage == 2 else "")


@exercise
def check_allreduce_seconds(seconds, nbytes: float = 14e9, p: int = 8,
                            link_bandwidth: float = HCCS_TOTAL / HCCS_LINKS,
                            alpha: float = HCCS_ALPHA) -> None:
    """Ring all-reduce of ``nbytes`` over the p NPUs of one 910B server:
    2(p-1) a + 2(p-1)/p n / B, with B ONE HCCS link (a ring uses one per direction)."""
    b = 1 / link_bandwidth
    want = 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * b
    port = get_profile("ascend-910b").inter_node.bandwidth       # only slips' figures
    nvlink = get_profile("a100").intra_node.bandwidth
    _check_number("all-reduce time", seconds, want, "s", [
        (2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / HCCS_TOTAL,
         f"that uses {HCCS_TOTAL / 1e9:g} GB/s, the {HCCS_LINKS} HCCS links added together. A "
         f"ring sends to one neighbour and receives from another: one link per direction, "
         f"{link_bandwidth / 1e9:g} GB/s. Only a mesh algorithm (every NPU sending to all "
         f"{p - 1} peers at once) reaches the sum"),
        ((p - 1) * alpha + (p - 1) / p * nbytes * b,
         f"half of it: an all-reduce sends 2(p-1)/p n per rank (a reduce-scatter then an "
         f"all-gather); n is {nbytes:.3g} bytes (7e9 bf16 gradients, 2 bytes each); and a "
         f"link moves {link_bandwidth / 1e9:g} GB/s each way (56 GB/s counts both "
         f"directions)"),
        (2 * (p - 1) * alpha + 2 * nbytes * b,
         f"did you drop the (p-1)/p factor (each rank sends {p - 1} of {p} chunks, twice), "
         f"or split the {HCCS_TOTAL / 1e9:g} GB/s over {p} links? Each NPU has {p - 1} links, "
         f"one to each peer: {link_bandwidth / 1e9:g} GB/s each"),
        (2 * want, "twice too much: the gradients are bf16, 2 bytes each (14e9 bytes for 7e9)"),
        (2 * (p - 1) * alpha * 1e6 + 2 * (p - 1) / p * nbytes * b,
         f"alpha is {alpha * 1e6:g} us = {alpha:g} s: give every term in seconds"),
        # print(NPU) shows the RoCE port beside HCCS; at 25 GB/s it read "did you drop the
        # (p-1)/p factor, or split the 196 GB/s over 8 links?" (2% away)
        (2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / port,
         f"that uses {port / 1e9:g} GB/s, the port between servers; the {p} NPUs of one "
         f"server talk over HCCS, and a ring uses one HCCS link per direction"),
        # 01's section 3 leaves n = 4 MiB and beta = 1 / (the A100's NVLink) in the
        # notebook: reused, each read only "too low: compare each factor"
        (2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / nvlink,
         f"that uses {nvlink / 1e9:g} GB/s, the A100's NVLink (the notebook's beta is the "
         f"A100's); the 910B's ring runs on one HCCS link"),
        (2 * (p - 1) * alpha + 2 * (p - 1) / p * 4 * 2**20 * b,
         f"n is this model's gradients, {nbytes:.3g} bytes (the notebook's n, 4 MiB, was "
         "section 3's all-reduce)"),
        # both of section 3's n and beta reused (n * beta in the formula): 66.47 us, which
        # read only "too low: compare each factor" (browser review nbr17b)
        (2 * (p - 1) * alpha + 2 * (p - 1) / p * 4 * 2**20 / nvlink,
         f"that is section 3's all-reduce again (the notebook's n, 4 MiB, and beta, the "
         f"A100's {nvlink / 1e9:g} GB/s NVLink): n is this model's gradients, {nbytes:.3g} "
         f"bytes, and the 910B's ring runs on one HCCS link, {link_bandwidth / 1e9:g} GB/s"),
        (2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * 8 * b,
         "8 times too much: n is in bytes and the bandwidth in bytes per second, no bits"),
        # p = 7 (the links of each NPU, which the exercise names) lies 2% low and read "too
        # low: compare each factor" (browser review nbr17b); named only within 0.3%
        (2 * (p - 2) * alpha + 2 * (p - 2) / (p - 1) * nbytes * b,
         f"that takes p = {p - 1}, the HCCS links of each NPU; p is the number of ranks in "
         f"the ring, the {p} NPUs of the server", 0.003),
    # the exercise asks to 0.01 s: the 1% default passed 0.87 for 0.875 (browser review nb18)
    ] + _rounded_too_far(want, SECONDS_STEP, "s"), rel=SECONDS_STEP / 2 / want)
