"""Checks for the course's exercises: each says WHAT is wrong, not only that something is.

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

from ..parallel import layout as _layout
from ..parallel.dist_tensor import TensorSpec
from ..parallel.placement import Placement, fmt_placements, normalize_placements
from ..parallel.reshard import plan_reshard
from ..sim_mesh.mesh import Mesh
from ..sim_mesh.profiles import get_profile
from .feedback import CheckError, exercise

__all__ = ["CheckError", "check_welcome_mesh", "check_tp_group", "check_training_days",
           "check_zero2_memory_gb", "check_allreduce_seconds", "check_rank1_layout",
           "check_notation", "check_nested_rows", "check_cheapest_path",
           "check_allgather_times", "check_uneven_receive"]

SECONDS_PER_DAY = 86_400
# Ascend 910B (Atlas 800T A2) server: HCCS full mesh, 7 links per NPU, 196 GB/s each way
# in all, so 28 GB/s per link (Huawei Atlas 800T A2 datasheet: 392 GB/s bidirectional);
# a ring sends to one neighbour, so it uses ONE link per direction.  alpha = 3 us, the
# figure the ascend-910b profile takes for HCCS.
HCCS_LINKS, HCCS_TOTAL, HCCS_ALPHA = 7, 196e9, 3e-6
# A100 (DGX A100): NVLink 3 through NVSwitch, 600 GB/s bidirectional = 300 GB/s each way
# per GPU, all of it usable by a ring (NVIDIA A100 datasheet); alpha = 3 us as above.
NVLINK_A100, NVLINK_ALPHA = 300e9, 3e-6


def _ok(msg: str) -> None:
    print("Correct: " + msg)


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CheckError(f"{name} should be a number, got {value!r}")
    return float(value)


def _hint(got: float, want: float, wrong, rel: float = 0.02) -> str:
    """The text of the first common mistake whose value matches ``got``: ``wrong`` holds
    (value that mistake gives, what to say).  Otherwise only the direction: the ratio
    would give the expected value away."""
    for value, text in wrong:
        if math.isclose(got, value, rel_tol=rel):
            return text
    if not want:
        return "it should be 0"
    return ("too high" if got > want else "too low") + ": compare each factor with the formula"


def _check_number(name, got, want, unit, wrong, rel=0.01, what=""):
    got = _number(name, got)
    if math.isclose(got, want, rel_tol=rel):
        _ok(f"{name} = {got:.4g} {unit}{what}")
        return
    raise CheckError(f"your {name} is {got:.4g} {unit}: " + _hint(got, want, wrong),
                     expected=f"{want:.4g} {unit}")


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
        raise CheckError(f"mesh is a {type(mesh).__name__}, not a Mesh: wrap the ranks, e.g. "
                         "wb.Mesh([[...], [...]], dim_names=[...])")
    if mesh.shape != (2, 4):
        hint = (" (dp must come first: 2 rows of 4)" if mesh.shape == (4, 2) else
                ": 2 data-parallel groups of 4 tensor-parallel ranks")
        raise CheckError(f"your mesh has shape {mesh.shape}{hint}", expected="shape (2, 4)")
    if mesh.dim_names != ("dp", "tp"):
        raise CheckError(f"your mesh's dim_names are {mesh.dim_names}: name the mesh dims as "
                         "the exercise does, data parallel first", expected="('dp', 'tp')")
    if mesh.tolist() != [[0, 1, 2, 3], [4, 5, 6, 7]]:
        raise CheckError(f"your ranks are {mesh.tolist()}: ranks of one tp group are "
                         "neighbours (they share a node); try wb.Mesh.grid((2, 4), ['dp', 'tp'])",
                         expected="[[0, 1, 2, 3], [4, 5, 6, 7]]")
    _ok(f"{mesh}")


@exercise
def check_tp_group(group, rank: int = 5) -> None:
    """The ranks ``rank`` talks to along "tp" on the 2 x 4 (dp, tp) mesh."""
    row, col = divmod(rank, 4)                          # row-major 2 x 4, by hand
    want = tuple(range(4 * row, 4 * row + 4))
    dp_group = (col, col + 4)
    try:
        got = tuple(int(r) for r in group)
    except TypeError:
        raise CheckError(f"group should be a sequence of ranks, got {group!r}") from None
    if got == want:
        _ok(f"rank {rank}'s tp group is {want}")
        return
    if got == dp_group:
        raise CheckError(f"{got} is rank {rank}'s dp group (one rank per dp row, same tp "
                         f"column); along tp, ranks share the dp coordinate: "
                         f"mesh.group_of({rank}, 'tp')", expected=str(want))
    if set(got) == set(want):
        raise CheckError(f"{got} has the right ranks in the wrong order; give them in mesh "
                         "order", expected=str(want))
    raise CheckError(f"your group {got} is not rank {rank}'s tp group: rank {rank} sits at "
                     f"coordinate {(row, col)}; its tp group is the ranks with the same dp "
                     "coordinate", expected=str(want))


# ---- 01 why distribute -------------------------------------------------------------------------

@exercise
def check_training_days(days, params: float = 7e9, tokens: float = 2e12, n_devices: int = 1024,
                        profile: str = "ascend-910b", utilization: float = 0.4) -> None:
    """Days to train ``params`` on ``tokens`` with 6ND (Kaplan et al. 2020) on n devices
    at bf16 peak x utilisation: 6ND / (n x peak x u) / 86,400."""
    peak = get_profile(profile).peak("bfloat16")        # the exercise's given, not a result
    flops = 6 * params * tokens
    want = flops / (n_devices * peak * utilization) / SECONDS_PER_DAY
    fp32 = get_profile(profile).peak("float32")
    _check_number("training time", days, want, "days", [(want * r, t) for r, t in [
        (1 / 3, "one third of it: did you count only the forward pass (2ND)? "
                "Training is 6ND: 2 per parameter per token forward, 4 backward"),
        (4 / 3, "did you count 8ND? That is with full recompute (a second forward); the "
                "exercise counts 6ND"),
        (utilization, f"did you forget the utilisation? The devices deliver only "
                      f"{utilization:.0%} of their peak"),
        (1 / utilization ** 2, "did you multiply by the utilisation instead of dividing?"),
        (86400, "that is seconds: divide by 86,400 s per day"),
        (24, "that is hours: divide by 24"),
        (peak / fp32, f"did you use the float32 peak ({fp32 / 1e12:g} TFLOP/s)? Training runs "
                      f"in bf16: {peak / 1e12:g} TFLOP/s"),
    ]], what=f" (6ND = {flops:.3g} FLOPs)")


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
    hints = [(others[s], f"that is ZeRO stage {s}" + (" (no partitioning: 16 bytes per "
             "parameter on every device)" if s == 0 else "") + f"; stage {stage} partitions "
             + _ZERO_SPLIT[stage]) for s in others]
    hints += [(want * 1e9, "that is bytes: divide by 1e9 for GB"),
              (want * 1e9 / 2**30, "that is GiB (2**30 bytes); the papers use GB = 1e9 bytes"),
              (2 * params / 1e9, "that counts only the bf16 weights (2 bytes per "
               "parameter); add gradients (2) and Adam's fp32 master weights, momentum and "
               "variance (12)")]
    _check_number("memory", gb, want, "GB", hints,
                  what=f" = 2 psi + 14 psi / {n_d}" if stage == 2 else "")


@exercise
def check_allreduce_seconds(seconds, nbytes: float = 14e9, p: int = 8,
                            link_bandwidth: float = HCCS_TOTAL / HCCS_LINKS,
                            alpha: float = HCCS_ALPHA) -> None:
    """Ring all-reduce of ``nbytes`` over the p NPUs of one 910B server:
    2(p-1) a + 2(p-1)/p n / B, with B ONE HCCS link (a ring uses one per direction)."""
    b = 1 / link_bandwidth
    want = 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * b
    _check_number("all-reduce time", seconds, want, "s", [
        (2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / HCCS_TOTAL,
         f"that uses {HCCS_TOTAL / 1e9:g} GB/s, the {HCCS_LINKS} HCCS links added together. A "
         f"ring sends to one neighbour and receives from another: one link per direction, "
         f"{link_bandwidth / 1e9:g} GB/s. Only a mesh algorithm (every NPU sending to all "
         f"{p - 1} peers at once) reaches the sum"),
        ((p - 1) * alpha + (p - 1) / p * nbytes * b,
         "half of it: an all-reduce sends 2(p-1)/p n per rank (a reduce-scatter then an "
         "all-gather)"),
        (2 * (p - 1) * alpha + 2 * nbytes * b,
         f"did you drop the (p-1)/p factor? Each rank sends {p - 1} of {p} chunks, twice"),
        (2 * want, "twice too much: the gradients are bf16, 2 bytes each (14e9 bytes for 7e9)"),
    ])


# ---- 02 meshes and placements ---------------------------------------------------------------------

def _rows_cols(bounds) -> str:
    (r0, rn), (c0, cn) = bounds
    return f"rows {r0}:{r0 + rn}, cols {c0}:{c0 + cn}"


@exercise
def check_rank1_layout(placements, shape=(8, 6)) -> None:
    """Rank 1 of the 2 x 2 (dp, tp) mesh holds rows 4:8, cols 0:3; rank 2 rows 0:4, cols 3:6."""
    mesh = Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    try:
        ps = normalize_placements(placements, mesh, len(shape))
    except (ValueError, TypeError) as e:
        raise CheckError(str(e)) from None
    want = {1: ((4, 4), (0, 3)), 2: ((0, 4), (3, 3))}          # by hand, from the exercise
    for rank, w in want.items():
        got = _layout.shard_bounds(shape, mesh, ps, rank)      # what YOUR placements give
        if got != w:
            raise CheckError(f"with {fmt_placements(ps)} rank {rank} (coordinate "
                             f"{mesh.coordinate(rank)}) holds {_rows_cols(got)}; it should hold "
                             f"{_rows_cols(w)}: which mesh dim must split the rows, and which "
                             "the columns?", expected="[Shard(1), Shard(0)]")
    _ok(f"{fmt_placements(ps)}: rows split over tp, columns over dp")


@exercise
def check_notation(text) -> None:
    """The scaling-book notation of a bf16 (16, 64) tensor on (dp, tp) with [P(sum), S(1)]:
    dtype, then the dims with the mesh dims that shard them as subscripts, then {U_...}
    for the mesh dims it is partial over."""
    want = "bf16[I, J_tp]{U_dp}"                                # by hand
    if not isinstance(text, str):
        raise CheckError(f"give the notation as a string, e.g. 'f32[I_dp, J]', got {text!r}")
    got = text.replace(" ", "")
    if got == want.replace(" ", ""):
        _ok(want)
        return
    if "{U_" not in got:
        msg = "Partial over dp is written {U_dp} after the brackets (unreduced over dp)"
    elif not got.startswith("bf16["):
        msg = "the dtype comes first, short: bf16 for torch.bfloat16"
    elif "J_tp" not in got:
        msg = "Shard(1) on tp subscripts the second dim: J_tp"
    elif "I_" in got:
        msg = "dim 0 is not sharded: plain I (Partial is not a subscript)"
    else:
        msg = "compare each part: dtype, [dims with subscripts], {U_...}"
    raise CheckError(f"your notation is {text!r}: {msg}", expected=repr(want))


@exercise
def check_nested_rows(sizes, rows: int = 10) -> None:
    """Rows each rank of the 2 x 2 mesh holds under [Shard(0), Shard(0)], in rank order:
    torch.chunk over dp first, then each piece over tp."""
    want = [n for piece in _chunks(rows, 2) for n in _chunks(piece, 2)]   # rank r = (r//2, r%2)
    try:
        got = [int(n) for n in sizes]
    except TypeError:
        raise CheckError(f"sizes should be a list of 4 ints, got {sizes!r}") from None
    if got == want:
        _ok(f"{want}: dp splits {rows} rows first, then tp splits each piece (torch.chunk)")
        return
    if got == _chunks(rows, 4):
        msg = (f"that splits {rows} rows 4 ways at once; with two mesh dims the rows are split "
               f"by dp first {tuple(_chunks(rows, 2))}, then each piece by tp")
    elif sum(got) != rows:
        msg = f"your sizes add up to {sum(got)}, not {rows}: every row lives on exactly one rank"
    elif sorted(got) == sorted(want):
        msg = "right sizes, wrong order: rank r sits at coordinate (r // 2, r % 2)"
    else:
        msg = ("torch.chunk gives each piece ceil(n / k) rows until the rows run out, "
               "not an even split")
    raise CheckError(f"your sizes are {got}: {msg}", expected=str(want))


# ---- 03 collectives and reshard -------------------------------------------------------------------

@exercise
def check_cheapest_path(path, shape=(8, 8), profile: str = "a100") -> None:
    """A path of placements from [P(sum), S(1)] to [S(0), R] on the 2 x 2 (dp, tp) mesh,
    one mesh dim changed per hop, that moves as few bytes per rank as possible."""
    mesh = Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    elem, (rows, cols) = 4, shape                               # f32
    # by hand: reduce-scatter the (rows, cols/2) partial sums over dp, (p-1)/p of them,
    # then all-gather the (rows/2, cols) row block over tp, (p-1)/p of it
    best = (rows * cols // 2 * elem) // 2 + (rows // 2 * cols * elem) // 2
    try:
        hops = [normalize_placements(list(p) if not isinstance(p, (str, Placement)) else [p],
                                     mesh, len(shape), "path entry") for p in path]
    except (ValueError, TypeError) as e:
        raise CheckError(f"path entry not understood: {e}") from None
    s0, t0 = (normalize_placements(x, mesh, 2) for x in (["P(sum)", "S(1)"], ["S(0)", "R"]))
    if len(hops) < 2 or hops[0] != s0 or hops[-1] != t0:
        raise CheckError(f"the path must start at {fmt_placements(s0)} and end at "
                         f"{fmt_placements(t0)}; yours goes from "
                         f"{fmt_placements(hops[0]) if hops else '(nothing)'} to "
                         f"{fmt_placements(hops[-1]) if hops else '(nothing)'}")
    total, parts = 0, []
    for k, (a, b) in enumerate(zip(hops, hops[1:]), 1):
        changed = [mesh.dim_names[i] for i in range(mesh.ndim) if a[i] != b[i]]
        if len(changed) != 1:
            raise CheckError(f"hop {k} {fmt_placements(a)} -> {fmt_placements(b)} changes "
                             f"{len(changed)} mesh dims {changed}: one collective edits one "
                             "mesh dim; split the hop")
        plan = plan_reshard(TensorSpec(shape, mesh, a), mesh, b, profile=profile)
        total += plan.total_bytes
        parts += [f"{s.kind} {s.bytes} B" for s in plan.steps]
    route = " -> ".join(fmt_placements(h) for h in hops)
    if total <= best:
        _ok(f"{route} moves {total} B per rank, the fewest possible")
        return
    hint = ("try reduce_scatter: it sums AND splits in one step, half an all-reduce's bytes"
            if "reduce_scatter" not in " ".join(parts) else
            "use the same collectives in another order: reduce first, while the pieces are small")
    raise CheckError(f"your path {route} moves {total} B per rank ({', '.join(parts)}): {hint}",
                     expected=f"{best} B per rank, [P(sum), S(1)] -> [S(0), S(1)] -> [S(0), R]")


@exercise
def check_allgather_times(t_910b, t_a100, nbytes: int = 64 * 2**20, p: int = 8) -> None:
    """Ring all-gather of ``nbytes`` (gathered output) over the p devices of one server:
    (p-1) a + (p-1)/p n / B, with B one HCCS link on the 910B (a ring uses one link per
    direction) and NVLink's 300 GB/s on the A100 (through NVSwitch a ring gets all of it)."""
    links = {"910B": (HCCS_ALPHA, HCCS_TOTAL / HCCS_LINKS), "A100": (NVLINK_ALPHA, NVLINK_A100)}
    want = {k: (p - 1) * a + (p - 1) / p * nbytes / bw for k, (a, bw) in links.items()}
    got = {"910B": _number("t_910b", t_910b), "A100": _number("t_a100", t_a100)}
    shown = ", ".join(f"{k} {w * 1e6:.1f} us" for k, w in want.items())
    if math.isclose(got["910B"], want["A100"], rel_tol=0.01) and \
            math.isclose(got["A100"], want["910B"], rel_tol=0.01):
        raise CheckError("your two times are swapped: the 910B's ring runs on one HCCS link "
                         f"({HCCS_TOTAL / HCCS_LINKS / 1e9:g} GB/s each way), the A100's on "
                         f"NVLink ({NVLINK_A100 / 1e9:g} GB/s)", expected=shown)
    for name, w in want.items():
        if math.isclose(got[name], w, rel_tol=0.01):
            continue
        a, bw = links[name]
        hint = _hint(got[name], w, [
            ((p - 1) * a + (p - 1) / p * nbytes / HCCS_TOTAL, f"that uses "
             f"{HCCS_TOTAL / 1e9:g} GB/s, the {HCCS_LINKS} HCCS links added together; a ring "
             f"sends to one neighbour, so it uses one link per direction ("
             f"{HCCS_TOTAL / HCCS_LINKS / 1e9:g} GB/s). Only a mesh algorithm reaches the sum"),
            (2 * (p - 1) * a + 2 * (p - 1) / p * nbytes / bw, "twice too much: that is the "
             "all-reduce formula; an all-gather sends each chunk once"),
            ((p - 1) * a + nbytes / bw, f"did you drop the (p-1)/p factor? Each rank "
             f"receives {p - 1} of {p} chunks"),
            ((p - 1) * a + (p - 1) / p * nbytes * 1e6 / 2**20 / bw,
             "did you use MB (1e6 bytes) for MiB (2**20 bytes)?"),
            ((p - 1) * a, "that is the latency term alone; add (p-1)/p n / B"),
            ((p - 1) / p * nbytes / bw, "right, less the latency term: add (p-1) alpha"),
        ], rel=0.002)
        raise CheckError(f"your {name} time is {got[name]:.4g} s: {hint}", expected=shown)
    _ok(f"{shown} (ratio {want['910B'] / want['A100']:.1f}): a ring on one HCCS link is slow; "
        "HCCL's mesh algorithm uses all seven")


@exercise
def check_uneven_receive(bytes_per_rank, shape=(10, 4), p: int = 4, elem: int = 4) -> None:
    """Bytes each rank receives when a (10, 4) f32 tensor sharded S(0) on 4 ranks is
    all-gathered: the rows it does not hold."""
    rows = _chunks(shape[0], p)                                 # torch.chunk, by hand
    row_bytes = math.prod(shape[1:]) * elem
    want = [(shape[0] - n) * row_bytes for n in rows]
    mean = (p - 1) * shape[0] * row_bytes // p                  # (p-1)/p n
    try:
        got = [int(b) for b in bytes_per_rank]
    except TypeError:
        raise CheckError(f"give a list of {p} byte counts, got {bytes_per_rank!r}") from None
    if got == want:
        _ok(f"{want}: the ranks with fewer rows receive more; the plan reports their "
            f"mean, (p-1)/p n = {mean} B")
        return
    if got == [mean] * p:
        msg = (f"{mean} B is the plan's figure, (p-1)/p n: the mean over ranks. With uneven "
               f"shards ({rows} rows) each rank receives the rows it lacks")
    elif got == [w // elem for w in want]:
        msg = f"those are elements: multiply by {elem} bytes per f32"
    elif got == [n * row_bytes for n in rows]:
        msg = "those are the bytes each rank holds (and sends); it receives the other rows"
    else:
        msg = f"rank r receives (10 - its rows) x {row_bytes} B; its rows are {rows}"
    raise CheckError(f"your bytes are {got}: {msg}", expected=str(want))
