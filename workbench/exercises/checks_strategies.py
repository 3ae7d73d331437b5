"""Checks for the exercises of notebooks 05 (data parallel and ZeRO), 06 (tensor and
sequence parallel) and 08 (hybrid parallel).

As in :mod:`.checks`: a right answer prints one "Correct: ..." line; a wrong one raises
:class:`~.checks.CheckError` saying what is wrong, e.g.

    your buckets are [1052672, 5248000]; expected 2 bucket(s): right sizes, wrong order:
    backward produces the last layer's gradients first, and the buckets fill (and are
    sent) in that order

Expected values are derived here, independently of the code under test: bucket sizes
by filling whole gradients in backward order by hand, bytes and memory from the
published formulas (ring collectives, ZeRO, Korthikanti et al.), a rank's groups from
its coordinates, model-state bytes from the values a rank holds.  The one exception is
:func:`check_best_layout`, whose exercise is to ask the simulator.  The exercise's
numbers are the keyword defaults.
"""
from __future__ import annotations

import math
import numbers
import operator

import torch
from torch import nn

from ..parallel.dist_tensor import DistTensor, from_local, shard_tensor
from ..parallel.module import dist_parameters
from ..parallel.placement import Partial, Replicate, Shard, fmt_placements
from ..sim_mesh.mesh import Mesh
from ..sim_mesh.profiles import get_profile
from ..sim_mesh.trace import trace
from .checks import _chunks, _hint, _number, _ok, _scale_slip, _whole, _zero_bytes
from .feedback import CheckError, exercise, raised

__all__ = ["check_bucket_sizes", "check_zero_max_params", "check_zero3_traffic",
           "check_tp_sp_layer_bytes", "check_sp_f_g", "check_sp_max_microbatch",
           "check_hybrid_groups", "check_hybrid_state_bytes", "check_best_layout"]


def _index(value) -> int | None:
    """``value`` as an int: a Python, NumPy or torch integer (``operator.index``: a 0-d
    integer tensor read off ``Mesh.mesh``, as off torch's ``DeviceMesh.mesh``, is a rank);
    None for a bool (or a bool tensor: a mask, not a number), a float or anything else."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _int(name, value, what="an int") -> int:
    """``value`` as an int (Python, NumPy or torch integers; not bools, not floats)."""
    got = _index(value)
    if got is None:
        raise CheckError(f"{name} should be {what}, got {value!r}")
    return got


def _ints(name, value, what="ints") -> list[int]:
    if isinstance(value, torch.Tensor):
        # a 1-d integer tensor (a column of Mesh.mesh, as of torch's DeviceMesh.mesh) is
        # read as its ints; a mask, a float or a 2-d tensor is not a list of ints
        if value.dim() != 1 or value.dtype == torch.bool or value.is_floating_point() \
                or value.is_complex():
            raise CheckError(f"{name} should be a list of {what}, got a tensor of "
                             f"{value.dtype} and shape {tuple(value.shape)}: pass a list "
                             "of ints (its .tolist() if it holds them)")
        return [int(v) for v in value.tolist()]
    if isinstance(value, dict):
        raise CheckError(f"{name} should be a list of {what}, got a dict (a list of it would "
                         f"be its keys): pass a list, e.g. list(d.values())")
    try:
        items = list(value)
    except TypeError:
        raise CheckError(f"{name} should be a list of {what}, got {value!r}") from None
    if not all(_index(v) is not None for v in items):
        whole = all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                    and float(v).is_integer() for v in items)
        text = any(isinstance(v, str) for v in items)
        shown = value if isinstance(value, (list, tuple)) else items   # (not a spent iterator)
        raise CheckError(f"{name} should be a list of {what}, got {shown!r}"
                         + (": give each as an int (int(x)), not a float" if whole else
                            ": give each as an int, not a str (no quotes)" if text else ""))
    return [_index(v) for v in items]


def _other_n(total, n, nb_n, letter, where) -> list:
    """The (value, message) of the slip that takes the notebook's group size ``nb_n`` (a
    variable already defined above the exercise) for the exercise's ``n``: ``total`` (the
    bytes before the (n-1)/n factor) times (nb_n-1)/nb_n."""
    if n == nb_n:
        return []
    return [((nb_n - 1) * total / nb_n, f"that takes {letter} = {nb_n} ({where}); the "
             f"exercise has {letter} = {n}")]


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


# ---- 06 tensor and sequence parallel: bytes per layer -------------------------------------------

_BITS = ("8 times too large: that is bits, not bytes (each activation is elem bytes of 8 "
         "bits): give the bytes")
# with t = 8 (the exercise's), 8 times is also every rank's bytes summed
_BITS_OR_RANKS = ("8 times too large: that is bits, not bytes, or the sum over all 8 ranks: "
                  "give the bytes one rank sends")

@exercise
def check_tp_sp_layer_bytes(tp_bytes, sp_bytes, seq: int = 2048, batch: int = 1,
                            hidden: int = 12288, tp: int = 8, elem: int = 2,
                            model_layers: int = 96) -> None:
    """Bytes each rank sends per transformer layer per training step, counting Megatron's
    f and g only, as Korthikanti et al. 2022 (sec. 4.2.2) compare them and as notebook
    06's exercise 1 asks: tensor parallel (4 all-reduces of b s h) and tensor + sequence
    parallel (4 all-gathers and 4 reduce-scatters of b s h), ``elem``-byte activations,
    ring algorithms.  Not counted: the 2 backward re-gathers of the column-parallel inputs
    that Megatron-LM and the course's recipe send on top with sequence parallelism
    (``parallel.ops_table.linear_regather``; PyTorch's DTensor styles send none); an
    answer that includes them is refused with a hint.  ``model_layers`` (GPT-3's 96) names
    an answer for the whole model instead of one layer."""
    n = batch * seq * hidden * elem
    whole_model = (f"that is all {model_layers} layers of the model; the question asks for "
                   "one layer")
    want_tp = 4 * (2 * (tp - 1) * n // tp)                      # 4 ring all-reduces
    want_sp = 4 * 2 * ((tp - 1) * n // tp)                      # 4 all-gathers + 4 r-scatters
    regathers = 2 * ((tp - 1) * n // tp)        # backward re-gathers: not asked (docstring)
    a, b = _number("tp_bytes", tp_bytes), _number("sp_bytes", sp_bytes)
    t = tp
    if elem > 1 and all(math.isclose(v, w / elem, rel_tol=1e-4)
                        for v, w in ((a, want_tp), (b, want_sp))):
        # both 1/elem of their bytes: n counted values (each half-answer has hints of its own)
        forward = ("; or only the forward: backward sends as many again (f's all-reduces; "
                   "SP's conjugates)" if elem == 2 else "")
        raise CheckError(f"both are 1/{elem} of the bytes: n counts the activation's values; "
                         f"each is {elem} bytes (bf16)" + forward,
                         expected=f"TP {want_tp:.4g} B, TP+SP {want_sp:.4g} B")
    if not math.isclose(a, want_tp, rel_tol=1e-4):
        raise CheckError(f"your TP bytes are {a:.4g}: " + _hint(
            a, want_tp, [(want_tp / 2, "half of it: either only the forward's 2 all-reduces "
                          "(g after attention and after the MLP; backward has 2 more, f's), or "
                          "(t-1)/t n per all-reduce, an all-gather's share: an all-reduce "
                          "sends 2 (t-1)/t n"),
                         (8 * n, f"did you drop (t-1)/t? Each all-reduce sends 2 (t-1)/t n = "
                          f"{2 * (t - 1) / t:g} n per rank"),
                         (2 * want_tp, f"the activations are {elem} bytes each (bf16)"),
                         (want_tp / 4, "that is one all-reduce; a layer has 4 per step: 2 "
                          "forward (g), 2 backward (f)"),
                         (want_tp / t, "each all-reduce moves the whole b s h activation, "
                          "not a 1/t slice"),
                         (8 * want_tp, _BITS if tp != 8 else _BITS_OR_RANKS), (model_layers * want_tp, whole_model)]
            + _other_n(8 * n, tp, 2, "t", "section 1's t"),
            rel=1e-4), expected=f"TP {want_tp:.4g} B")
    if not math.isclose(b, want_sp, rel_tol=1e-4):
        raise CheckError(f"your TP+SP bytes are {b:.4g}: " + _hint(
            b, want_sp, [(want_sp + regathers, "that includes the 2 backward re-gathers "
                          "of the column-parallel inputs (section 4); the question counts "
                          "f and g only, as Korthikanti et al. compare them: leave the "
                          "re-gathers out"),
                         (want_sp / 2, "half of it: SP's f and g send 4 all-gathers AND 4 "
                          "reduce-scatters per layer per step, each (t-1)/t n"),
                         (want_sp / t, "the all-gathers and reduce-scatters move (t-1)/t of "
                          "the whole b s h, not of a 1/t slice"),
                         (8 * n, f"did you drop (t-1)/t? Each all-gather or reduce-scatter "
                          f"sends (t-1)/t n = {(t - 1) / t:g} n per rank: a rank already "
                          "holds its own 1/t"),
                         (2 * want_sp, "twice too much: each all-gather or reduce-scatter "
                          "sends (t-1)/t n, half an all-reduce"),
                         (8 * want_sp, _BITS if tp != 8 else _BITS_OR_RANKS), (model_layers * want_sp, whole_model)]
            + _other_n(8 * n, tp, 2, "t", "section 1's t"), rel=1e-4),
                         expected=f"TP+SP {want_sp:.4g} B")
    _ok(f"{want_tp / 2**20:.0f} MiB per layer per step both ways, counting f and g: "
        "sequence parallelism replaces each all-reduce by an all-gather + a reduce-scatter "
        f"of the same total (Megatron's 2 backward re-gathers, {regathers / 2**20:.0f} MiB, "
        "come on top)")


# ---- 06 sequence parallel: f and g ----------------------------------------------------------

def _run(fn, x, what):
    with trace() as tr:
        try:
            out = fn(x)
        except Exception as e:          # the student's code: any error is an answer
            raise CheckError(raised(f"your {what}", e)) from None
    return out, [(e.name, e.bytes, e.args.get("buffer_bytes")) for e in tr.collectives()]


def _same_mesh(what, out, mesh) -> None:
    """f and g change a layout on the tensor-parallel group they are given, never the group:
    a result on another mesh (the notebook's 2-rank ``mesh`` instead of ``x.mesh``) is a
    different program, whatever its placements say."""
    if out.mesh != mesh:
        arg = "x" if what == "f" else "y"
        raise CheckError(f"{what} returned a DistTensor on {out.mesh}, but its input lives on "
                         f"{mesh}: {what} changes the layout on the input's own tensor-parallel "
                         f"group, so reshard onto {arg}.mesh, not onto another mesh")


@exercise
def check_sp_f_g(f, g, tp: int = 4, shape=(2, 8, 16)) -> None:
    """Megatron-SP's f (sequence-sharded [Shard(1)] -> whole [Replicate()] before the
    column-parallel linear) and g (partial sums [Partial()] -> [Shard(1)] after the
    row-parallel one), each one collective of (t-1)/t n bytes per rank."""
    if not callable(f) or not callable(g):
        raise CheckError("pass two functions, f(x) and g(y), each taking and returning a "
                         "DistTensor")
    mesh = Mesh.grid(tp, ["tp"])
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(shape, generator=gen)
    parts = [torch.randn(shape, generator=gen) for _ in range(tp)]
    Y = sum(parts)
    n = math.prod(shape) * 4
    share = (tp - 1) * n // tp
    # f
    x = shard_tensor(X, mesh, [Shard(1)])
    out, colls = _run(f, x, "f")
    if not isinstance(out, DistTensor):
        raise CheckError(f"f returned a {type(out).__name__}; return a DistTensor, e.g. "
                         "wb.reshard(x, x.mesh, [...])")
    _same_mesh("f", out, mesh)
    if out.placements != (Replicate(),):
        raise CheckError(f"f returns {fmt_placements(out.placements)}; the column-parallel "
                         "linear multiplies every token by its weight columns, so every rank "
                         "needs the whole sequence: [Replicate()]")
    if not torch.equal(out.full(), X):
        raise CheckError("f's result is not the input gathered: keep the values, change only "
                         "the layout")
    if not colls:
        raise CheckError("f recorded no communication: a device holds only its shard, so "
                         "the other pieces must be sent to it; wb.reshard moves them (and the "
                         "trace counts it)")
    if [c[0] for c in colls] != ["all_gather"]:
        raise CheckError(f"f sends {', '.join(c[0] for c in colls)}; S(1) -> R is one "
                         "all-gather of (t-1)/t n bytes per rank")
    # g
    y = from_local(parts, mesh, [Partial("sum")])
    out, colls_g = _run(g, y, "g")
    if not isinstance(out, DistTensor):
        raise CheckError(f"g returned a {type(out).__name__}; return a DistTensor")
    _same_mesh("g", out, mesh)
    ps = out.placements
    if ps != (Shard(1),):
        hint = {(Replicate(),): "that is tensor parallelism's g, an all-reduce (2 (t-1)/t n "
                                "per rank); with SP the result stays sharded over the sequence: "
                                "a reduce-scatter, half the bytes, and the norm and dropout "
                                "after it work on 1/t of the tokens",
                (Shard(0),): "Shard(0) splits the batch; sequence parallelism splits the "
                             "sequence, dim 1 of (batch, sequence, hidden)",
                (Shard(2),): "Shard(2) splits the hidden dim, but RMSNorm and the residual "
                             "need each token's whole hidden vector: split the sequence "
                             "(dim 1)",
                (Partial("sum"),): "still partial sums: reduce them"}.get(
            tuple(ps), "the residual stream is sequence-sharded: [Shard(1)]")
        raise CheckError(f"g returns {fmt_placements(ps)}: {hint}")
    if not torch.allclose(out.full(), Y, atol=1e-5):
        raise CheckError("g's result is not the sum of the partial results: keep the value, "
                         "change only the layout")
    if [c[0] for c in colls_g] != ["reduce_scatter"]:
        raise CheckError(f"g sends {', '.join(c[0] for c in colls_g) or 'nothing'}; "
                         "P(sum) -> S(1) is one reduce-scatter of (t-1)/t n bytes per rank")
    _ok(f"f all-gathers, g reduce-scatters: {share:,d} + {share:,d} B per rank, what TP's "
        f"one all-reduce sends ({2 * share:,d} B)")


# ---- 06 activation memory: the largest micro-batch -----------------------------------------------

def _activation_bytes(seq, hidden, heads, tp, case) -> float:
    """Korthikanti et al. 2022, Table 2: bytes one layer keeps per sequence (16-bit)."""
    sbh, att = seq * hidden, 5 * heads * seq / hidden
    return sbh * {"none": 34 + att, "tp": 10 + 24 / tp + att / tp, "tp+sp": (34 + att) / tp,
                  "tp+selective": 10 + 24 / tp, "tp+sp+selective": 34 / tp, "full": 2}[case]


@exercise
def check_sp_max_microbatch(b, budget_bytes: float = 20e9, layers: int = 12, seq: int = 2048,
                            hidden: int = 12288, heads: int = 96, tp: int = 8,
                            case: str = "tp+sp+selective", in_flight: int = 8) -> None:
    """The largest micro-batch whose activations (Korthikanti et al. 2022, Table 2,
    ``case``) for ``layers`` layers fit in ``budget_bytes`` on the first pipeline stage,
    which under 1F1B holds ``in_flight`` (= p) micro-batches at once."""
    # a whole float is its int, as in notebook 11's check_biggest_micro_batch: 20e9 // x,
    # the floor division of floats, rounds down right and gives 1.0, the answer 1
    whole = _whole(b)
    if whole is None:
        fraction = isinstance(b, numbers.Real) and not isinstance(b, bool) \
            and math.isfinite(b)             # 20e9 / x: a share of a sequence
        raise CheckError(f"b should be a whole number of sequences, got {b!r}"
                         + (": round down" if fraction else ": give an int"))
    b = whole
    per = lambda c: _activation_bytes(seq, hidden, heads, tp, c)  # noqa: E731
    stage = layers * per(case) * in_flight
    want = int(budget_bytes // stage)
    if b == want:
        _ok(f"b = {want}: {in_flight} micro-batches in flight x {layers} layers x "
            f"{per(case) / 1e6:.1f} MB x b = {want * stage / 1e9:.1f} GB of "
            f"{budget_bytes / 1e9:g} GB; b = {want + 1} would need "
            f"{(want + 1) * stage / 1e9:.1f} GB")
        return
    one = layers * per(case)
    others = {c: int(budget_bytes // (layers * per(c) * in_flight)) for c in
              ("tp+selective", "tp+sp", "tp", "none", "full")}
    if b == int(budget_bytes // one):
        msg = (f"that fits ONE micro-batch's activations; under 1F1B the first stage "
               f"keeps {in_flight} micro-batches in flight (its warm-up of p - 1 forwards "
               "and the steady state's first forward come before its first backward; "
               "notebook 7)")
    elif b == want + 1:
        msg = (f"b = {b} needs {b * stage / 1e9:.2f} GB, more than {budget_bytes / 1e9:g} GB: "
               f"round down")
        if b == int(budget_bytes * 2**30 / 1e9 // stage):   # the unit slip gives it too
            msg += (f"; and 1 GB is 1e9 bytes here, not 2**30 (a GiB): the budget is "
                    f"{budget_bytes:,.0f} bytes")
    elif b == int(budget_bytes // (per(case) * in_flight)):
        msg = f"that fits ONE layer; the stage holds {layers}"
    elif b == int(budget_bytes * 2**30 / 1e9 // stage):
        msg = f"the budget is {budget_bytes / 1e9:g} GB = {budget_bytes:.3g} bytes, not GiB"
    elif sum(b == others[c] for c in ("tp+selective", "tp+sp", "tp", "none")) > 1:
        # several slips give this b (0: nothing fits): name them together, not one guess
        msg = (f"b = {b} is what you get without sequence parallelism or without selective "
               f"recompute (one sequence of either needs over {budget_bytes / 1e9:g} GB); the "
               f"exercise has both: 34 sbh / t per layer, in bytes already (Table 2 counts "
               f"16-bit activations: no factor of 2 or 4 bytes on top)")
    elif b == others["tp+selective"]:
        msg = ("that is tensor parallelism with selective recompute but without SP: 10 sbh "
               "of the 34 (norms, dropouts, residuals) stays whole on every rank; SP splits "
               "it too: 34 sbh / t")
    elif b == others["tp+sp"]:
        msg = ("that keeps the attention scores (5as/(ht) sbh); selective recompute "
               "recomputes them in backward: 34 sbh / t")
    elif b in (others["tp"], others["none"]):
        msg = "use the formula for TP + SP + selective recompute: 34 sbh / t per layer"
    else:
        msg = (f"per layer and sequence: 34 s h / t = {per(case) / 1e6:.1f} MB; times "
               f"{layers} layers and {in_flight} micro-batches in flight, how many sequences "
               f"fit in {budget_bytes / 1e9:g} GB?")
    raise CheckError(f"your b is {b}: {msg}", expected=str(want))


# ---- 08 hybrid: a rank's groups ----------------------------------------------------------------

@exercise
def check_hybrid_groups(dp_group, tp_group, pp_peer, rank: int = 6) -> None:
    """In Hybrid(dp=2, tp=2, pp=2): ``rank``'s data-parallel group, tensor-parallel group
    (in mesh order) and the rank holding the same (dp, tp) position on the other stage."""
    # by hand: stage s holds ranks 4s..4s+3 as a 2 x 2 (dp, tp) mesh in row-major order
    stage, local = divmod(rank, 4)
    i, j = divmod(local, 2)
    mesh = Mesh([[4 * stage, 4 * stage + 1], [4 * stage + 2, 4 * stage + 3]], ["dp", "tp"])
    other = Mesh([[4 * (1 - stage) + k for k in (0, 1)], [4 * (1 - stage) + k for k in (2, 3)]],
                 ["dp", "tp"])
    want_dp = (4 * stage + j, 4 * stage + 2 + j)                 # same tp coordinate
    want_tp = (4 * stage + 2 * i, 4 * stage + 2 * i + 1)         # same dp coordinate
    want_peer = 4 * (1 - stage) + local
    got_dp = tuple(_ints("dp_group", dp_group, "ranks"))
    got_tp = tuple(_ints("tp_group", tp_group, "ranks"))
    where = (f"rank {rank} is on stage {stage}, Mesh({mesh.tolist()}, ['dp', 'tp']), at "
             f"coordinate {(i, j)}")
    shown = f"dp {want_dp}, tp {want_tp}, peer {want_peer}"
    if (got_dp, got_tp) == (want_tp, want_dp):
        raise CheckError(f"dp and tp are swapped: {where}; dp groups are the columns of the "
                         "stage mesh (mesh dim 0), tp groups its rows (mesh dim 1)",
                         expected=shown)
    for name, got, want in (("dp", got_dp, want_dp), ("tp", got_tp, want_tp)):
        if got == want:
            continue
        if sorted(got) == sorted(want):
            raise CheckError(f"your {name} group {got} has the right ranks in the wrong "
                             f"order; give them in mesh order", expected=shown)
        raise CheckError(f"your {name} group is {got}: {where}; its {name} group is the "
                         f"ranks of that stage mesh along mesh dim '{name}'", expected=shown)
    pp_peer = _int("pp_peer", pp_peer, "one rank (an int)")
    if pp_peer != want_peer:
        hint = (" (that is a rank of the same stage)" if pp_peer in mesh.ranks else "")
        raise CheckError(f"your pipeline peer is {pp_peer}{hint}: {where}; its peer holds the "
                         f"same coordinate on the other stage's mesh {other.tolist()}",
                         expected=shown)
    _ok(f"rank {rank}: dp group {want_dp} (gradients), tp group {want_tp} (activations), "
        f"pipeline peer {want_peer} (activations and their gradients between stages)")


# ---- 08 hybrid: model-state bytes per rank ----------------------------------------------------

def _stage_model(dp, tp, pp, preset):
    from ..models.config import get_config
    from ..recipes.hybrid import Hybrid
    st = Hybrid(dp=dp, tp=tp, pp=pp)
    with torch.random.fork_rng(devices=[]):
        model = st.build_model(get_config(preset), 0)
    return model, st


def _state_bytes(dp, tp, pp, zero, stage, preset, mixed=False, split=None):
    """By hand: the values the stage's first rank holds (its tp shards), times 4 B weight
    + 4 B gradient + 8 B Adam m, v (fp32; mixed: 2 + 2 + 12), the ZeRO-split parts cut
    by torch.chunk over dp (Rajbhandari et al. 2020); this rank is dp coordinate 0.
    ``split``: which of (weights, gradients, Adam's m and v) are cut over dp, in place of
    ``zero``'s (ZeRO-k cuts the last k of them... ZeRO-1 Adam's, ZeRO-2 the gradients too,
    ZeRO-3 everything)."""
    key = (dp, tp, pp, preset)
    if key not in _MODELS:          # one build per layout (a wrong answer prices 9 counts)
        _MODELS.clear()
        _MODELS[key] = _stage_model(dp, tp, pp, preset)
    model, st = _MODELS[key]
    rank = st.meshes[stage].ranks[0]
    w, g, opt = (2, 2, 12) if mixed else (4, 4, 8)
    cut = _ZERO_SPLITS[zero] if split is None else split
    total = 0
    for _, p in dist_parameters(model):
        if rank not in p.mesh.ranks:
            continue
        n = p.local(rank).numel()
        share = _chunks(n, dp)[0]
        total += sum(b * (share if c else n) for b, c in zip((w, g, opt), cut))
    return total, model, st


_MODELS: dict = {}


_SPLITS = {0: "nothing is split over dp (plain data parallelism)",
           1: "ZeRO-1 splits Adam's m and v (8 B per value) over the dp ranks",
           2: "ZeRO-2 splits Adam's m and v and the gradients over the dp ranks",
           3: "ZeRO-3 splits weights, gradients and Adam's m and v over the dp ranks"}
# which of (weights, gradients, Adam's m and v) ZeRO-k cuts over dp
_ZERO_SPLITS = {0: (False, False, False), 1: (False, False, True), 2: (False, True, True),
                3: (True, True, True)}
_PARTS = ("the weights", "the gradients", "Adam's m and v")


def _split_text(split, short: bool = False) -> str:
    """What a (weights, gradients, Adam) cut counts: a ZeRO stage's count, or the parts it
    cuts and keeps whole (``short``: a phrase to name beside another)."""
    cut = " and ".join(p for p, c in zip(_PARTS, split) if c)
    whole = " and ".join(p for p, c in zip(_PARTS, split) if not c)
    for z, zcut in _ZERO_SPLITS.items():
        if zcut == split:
            if short:
                return "no ZeRO (nothing split)" if z == 0 else f"ZeRO-{z}'s ({cut} split)"
            return f"the count {'without ZeRO' if z == 0 else f'of ZeRO-{z}'}: {_SPLITS[z]}"
    if short:
        return f"{cut} split over dp with {whole} whole"
    return f"the count with {cut} split over dp and {whole} whole"


@exercise
def check_hybrid_state_bytes(nbytes, stage: int = 0, zero: int = 2, dp: int = 2, tp: int = 2,
                             pp: int = 2, preset: str = "tiny") -> None:
    """Model-state bytes (fp32 weights, gradients, Adam m and v) each rank of pipeline
    ``stage`` holds in Hybrid(dp, tp, pp, zero), as ``memory()`` counts them.

    A wrong answer is named by the split it counts: a ZeRO stage's, or another cut of
    (weights, gradients, Adam).  Two cuts can give the same count (the weights and the
    gradients are 4 B each, Adam's m and v 8 B: cutting the weights and gradients cuts as
    many bytes as ZeRO-1's cut of Adam); such an answer is named as both, since the
    count alone cannot tell which mistake it is."""
    got = _number("nbytes", nbytes)
    want, model, st = _state_bytes(dp, tp, pp, zero, stage, preset)
    if got == want:
        rank = st.meshes[stage].ranks[0]
        _ok(f"{want:,d} B on each rank of stage {stage} (rank {rank}: its tp shard of the "
            f"parameters; {_SPLITS[zero]})")
        return
    here = f"here {_SPLITS[zero]}"
    splits = {}
    for cut in [(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)]:
        if cut != _ZERO_SPLITS[zero]:
            splits.setdefault(_state_bytes(dp, tp, pp, zero, stage, preset, split=cut)[0],
                              []).append(cut)
    wrong = []
    for value, cuts in splits.items():
        cuts.sort(key=lambda c: c not in _ZERO_SPLITS.values())   # a ZeRO stage first
        if len(cuts) == 1:
            wrong.append((value, f"that is {_split_text(cuts[0])}; {here}"))
        else:
            wrong.append((value, f"that count fits {len(cuts)} splits (the same bytes either "
                          "way, so the count cannot tell which you made): "
                          + " or ".join(_split_text(c, short=True) for c in cuts) + f"; {here}"))
    wrong.append((_state_bytes(dp, tp, pp, zero, stage, preset, mixed=True)[0],
                  "that is the mixed-precision count (2 + 2 + 12 B); this run is fp32: 4 B "
                  "weight, 4 B gradient, 8 B Adam m and v"))
    if pp > 1:
        wrong.append((_state_bytes(dp, tp, pp, zero, 1 - stage, preset)[0],
                      f"that is stage {1 - stage}; stage {stage} holds "
                      + ("the last block, the final norm and the LM head" if stage else
                         "the embedding and the first block")))
    rank = st.meshes[stage].ranks[0]
    held = sum(p.local(rank).numel() for _, p in dist_parameters(model)
               if rank in p.mesh.ranks)
    whole = sum(p.numel() for _, p in dist_parameters(model) if rank in p.mesh.ranks)
    per_value = want / held
    wrong.append((whole * per_value, "that counts the whole stage; each rank holds only its "
                  f"tp shard (1/{tp}) of the attention and MLP weights, and copies of the "
                  "rest"))
    everything = sum(p.numel() for _, p in dist_parameters(model))
    if pp > 1:
        wrong.append((everything * per_value, f"that counts the whole model; a rank of stage "
                      f"{stage} holds only that stage's parameters, and of those its tp shard "
                      "(p.local(rank) for the parameters on its mesh)"))
    # the ZeRO-cut parts split over the stage mesh's dp x tp ranks, not over dp alone
    w_g_o = (4, 4, 8)
    over_mesh = sum(sum(b * (_chunks(n, dp * tp)[0] if c else n)
                        for b, c in zip(w_g_o, _ZERO_SPLITS[zero]))
                    for n in (p.local(rank).numel() for _, p in dist_parameters(model)
                              if rank in p.mesh.ranks))
    if zero and tp > 1:
        wrong.append((over_mesh, f"that splits over the stage's {dp * tp} ranks (dp x tp); "
                      f"ZeRO splits over the dp group ({dp} ranks): the tp ranks hold "
                      "different shards, nothing to split between them"))
    wrong.append((want / 4, "that is the number of fp32 values (weights, gradients, Adam's "
                  "m and v), not bytes: each value is 4 B"))
    # a count of bytes is whole: show the answer as given (315.52 must not read "316 B")
    shown = f"{got:,.0f}" if got == int(got) else f"{got:,}"
    for value, text in wrong:
        if math.isclose(got, value, rel_tol=1e-6):
            raise CheckError(f"your count is {shown} B: {text}", expected=f"{want:,d} B")
    slip = _scale_slip(got, want, 1e-6, share=False) if got else None
    if slip:                                   # kB or MB given for bytes
        raise CheckError(f"your count is {shown} B: {slip}", expected=f"{want:,d} B")
    raise CheckError(f"your count is {shown} B: count the values a "
                     f"rank of stage {stage} holds (p.local(rank).numel() for its parameters), "
                     f"then 4 B weight + 4 B gradient + 8 B Adam per value; {_SPLITS[zero]} "
                     f"(dp={dp})", expected=f"{want:,d} B")


# ---- 08 hybrid: the fastest layout ---------------------------------------------------------------

_LAYOUT_TIMES: dict = {}


def _layouts(world, cfg, batch):
    from ..recipes.hybrid import Hybrid
    out = []
    for dp in range(1, world + 1):
        for tp in range(1, world // dp + 1):
            if world % (dp * tp):
                continue
            pp = world // (dp * tp)
            try:
                Hybrid(dp=dp, tp=tp, pp=pp).check(cfg, batch)
            except ValueError:
                continue
            out.append((dp, tp, pp))
    return out


def _layout_ms(layout, preset, batch, profile) -> float:
    key = (layout, preset, batch, profile)
    if key not in _LAYOUT_TIMES:
        from ..recipes.hybrid import Hybrid
        from ..train import train
        st = Hybrid(*layout)
        st.profile = profile
        _LAYOUT_TIMES[key] = train(preset, steps=1, seed=0, batch_size=batch, strategy=st,
                                   timing=False)[0]["modeled_ms"]
    return _LAYOUT_TIMES[key]


@exercise
def check_best_layout(layout, preset: str = "tiny", batch: int = 8,
                      profile: str = "ascend-910b", world: int = 8) -> None:
    """The (dp, tp, pp) layout of ``world`` ranks (no SP, no ZeRO) with the shortest
    modeled training step of ``preset`` on ``profile``."""
    from ..models.config import get_config
    from ..recipes.hybrid import Hybrid
    if isinstance(layout, Hybrid):
        layout = (layout.dp, layout.tp, layout.pp)
    # three whole numbers: int() would truncate (8.9, 1, 1) to the answer and read the
    # string "811" digit by digit
    if isinstance(layout, (str, bytes)):
        raise CheckError(f"give the layout as (dp, tp, pp), a tuple of three ints, got "
                         f"{layout!r}")
    try:
        items = list(layout)
    except TypeError:
        raise CheckError(f"give the layout as (dp, tp, pp), got {layout!r}") from None
    if len(items) != 3:
        raise CheckError(f"give the layout as (dp, tp, pp), got {layout!r}")
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in items):
        raise CheckError(f"give the layout as (dp, tp, pp), a tuple of three ints, got "
                         f"{layout!r}")
    got = tuple(int(v) for v in items)
    cfg = get_config(preset)
    if math.prod(got) != world:
        raise CheckError(f"dp x tp x pp = {math.prod(got)}; the layout must use all "
                         f"{world} ranks")
    try:
        Hybrid(*got).check(cfg, batch)
    except ValueError as e:
        raise CheckError(f"Hybrid(dp={got[0]}, tp={got[1]}, pp={got[2]}) does not fit the "
                         f"model: {e}") from None
    times = {lay: _layout_ms(lay, preset, batch, profile) for lay in _layouts(world, cfg, batch)}
    best = min(times, key=times.get)
    if times[got] > times[best] * (1 + 1e-9):
        # what the trace shows at this size: a kernel costs mostly its launch, a message its
        # latency; tp and pp add those without shortening a rank's (launch-bound) compute
        launch_us = get_profile(profile).launch_overhead * 1e6
        why = []
        if got[2] > 1:
            why.append("a pipeline makes each stage wait for the other, and every "
                       "micro-batch pays each kernel's launch again")
        if got[1] > 1:
            why.append(f"tensor parallelism splits a kernel's arithmetic but not its "
                       f"{launch_us:g} us launch, and adds all-reduces in every block")
        raise CheckError(f"{got} takes {times[got]:.3f} ms per step on {profile}; another "
                         f"layout of {world} ranks is faster. Time every "
                         f"layout that fits ({len(times)} of them): at this size a kernel "
                         f"costs mostly its launch and a message its latency, not their size"
                         + "".join(f"; {w}" for w in why),
                         expected=f"{best}: {times[best]:.3f} ms")
    order = sorted(times, key=times.get)
    _ok(f"{best} = (dp, tp, pp): {times[best]:.3f} ms; then " + ", ".join(
        f"{lay} {times[lay]:.3f}" for lay in order[1:]) + " ms")
