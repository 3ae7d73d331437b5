"""Checks for the course's exercises: each says WHAT is wrong, not only that something is.

A check prints one "Correct: ..." line when the answer is right and raises
:class:`CheckError` (an AssertionError) with a diagnosis otherwise, e.g.

    your path [P(sum), S(1)] -> [R, S(1)] -> [S(0), S(1)] -> [S(0), R] moves 192 B
    per rank (all_reduce 128 B, local_slice 0 B, all_gather 64 B); the cheapest
    moves 128 B: try reduce_scatter

Every expected value comes from the library itself (``estimates``, ``cost``,
``layout``, ``plan_reshard``), so a check can never disagree with what the
notebook shows.  The exercise's numbers are the keyword defaults of its check.
"""
from __future__ import annotations

import math

from ..parallel import layout as _layout
from ..parallel.dist_tensor import TensorSpec, notation as _notation
from ..parallel.placement import Placement, fmt_placements, normalize_placements
from ..parallel.reshard import plan_reshard
from ..sim_mesh import cost as _cost
from ..sim_mesh import estimates as _est
from ..sim_mesh.mesh import Mesh
from ..sim_mesh.profiles import get_profile

__all__ = ["CheckError", "check_welcome_mesh", "check_tp_group", "check_training_days",
           "check_zero2_memory_gb", "check_allreduce_seconds", "check_rank1_layout",
           "check_notation", "check_nested_rows", "check_cheapest_path",
           "check_allgather_times", "check_uneven_receive"]


class CheckError(AssertionError):
    """An exercise answer is not right yet; the message says what is wrong."""


def _ok(msg: str) -> None:
    print("Correct: " + msg)


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CheckError(f"{name} should be a number, got {value!r}")
    return float(value)


def _hint(got: float, want: float, wrong, rel: float = 0.02) -> str:
    """The text of the first common mistake whose value matches ``got``: ``wrong`` holds
    (value that mistake gives, what to say)."""
    for value, text in wrong:
        if math.isclose(got, value, rel_tol=rel):
            return text
    return f"it is {got / want:.3g} x the expected value" if want else "it should be 0"


def _check_number(name, got, want, unit, wrong, rel=0.01, what=""):
    got = _number(name, got)
    if math.isclose(got, want, rel_tol=rel):
        _ok(f"{name} = {got:.4g} {unit}{what}")
        return
    raise CheckError(f"your {name} is {got:.4g} {unit}; expected {want:.4g} {unit}: "
                     + _hint(got, want, wrong))


# ---- 00 welcome -----------------------------------------------------------------------------

def check_welcome_mesh(mesh) -> None:
    """A 2 x 4 mesh of ranks 0..7 in row-major order, dims named ("dp", "tp")."""
    if not isinstance(mesh, Mesh):
        raise CheckError(f"mesh is a {type(mesh).__name__}, not a Mesh: wrap the ranks, e.g. "
                         "wb.Mesh([[...], [...]], dim_names=[...])")
    if mesh.shape != (2, 4):
        hint = (" (dp must come first: 2 rows of 4)" if mesh.shape == (4, 2) else "")
        raise CheckError(f"your mesh has shape {mesh.shape}; expected (2, 4): 2 data-parallel "
                         f"groups of 4 tensor-parallel ranks{hint}")
    if mesh.dim_names != ("dp", "tp"):
        raise CheckError(f"your mesh's dim_names are {mesh.dim_names}; expected ('dp', 'tp')")
    if mesh.tolist() != [[0, 1, 2, 3], [4, 5, 6, 7]]:
        raise CheckError(f"your ranks are {mesh.tolist()}; expected [[0, 1, 2, 3], [4, 5, 6, 7]]: "
                         "ranks of one tp group are neighbours (they share a node), "
                         "try wb.Mesh.grid((2, 4), ['dp', 'tp'])")
    _ok(f"{mesh}")


def check_tp_group(group, rank: int = 5) -> None:
    """The ranks ``rank`` talks to along "tp" on the 2 x 4 (dp, tp) mesh."""
    mesh = Mesh.grid((2, 4), ["dp", "tp"])
    want = mesh.group_of(rank, "tp")
    try:
        got = tuple(int(r) for r in group)
    except TypeError:
        raise CheckError(f"group should be a sequence of ranks, got {group!r}") from None
    if got == want:
        _ok(f"rank {rank}'s tp group is {want}")
        return
    if got == mesh.group_of(rank, "dp"):
        raise CheckError(f"{got} is rank {rank}'s dp group (one rank per dp row, same tp column); "
                         f"along tp, ranks share the dp coordinate: mesh.group_of({rank}, 'tp')")
    if set(got) == set(want):
        raise CheckError(f"{got} has the right ranks in the wrong order; give them in mesh order "
                         f"{want}")
    raise CheckError(f"your group {got} is not rank {rank}'s tp group: rank {rank} sits at "
                     f"coordinate {mesh.coordinate(rank)}; its tp group is the ranks with the "
                     "same dp coordinate")


# ---- 01 why distribute -------------------------------------------------------------------------

def check_training_days(days, params: float = 7e9, tokens: float = 2e12, n_devices: int = 1024,
                        profile: str = "ascend-910b", utilization: float = 0.4) -> None:
    """Days to train ``params`` on ``tokens`` with 6ND on n devices at bf16 peak x utilisation."""
    peak = get_profile(profile).peak("bfloat16")
    want = _est.training_days(_est.training_flops(params, tokens), n_devices, peak, utilization)
    fp32 = get_profile(profile).peak("float32")
    _check_number("training time", days, want, "days", [(want * r, t) for r, t in [
        (1 / 3, "one third of it: did you count only the forward pass (2ND)? "
                "Training is 6ND: 2 per parameter per token forward, 4 backward"),
        (utilization, f"did you forget the utilisation? The devices deliver only "
                      f"{utilization:.0%} of their peak"),
        (1 / utilization ** 2, "did you multiply by the utilisation instead of dividing?"),
        (86400, "that is seconds: divide by 86,400 s per day"),
        (24, "that is hours: divide by 24"),
        (peak / fp32, f"did you use the float32 peak ({fp32 / 1e12:g} TFLOP/s)? Training runs "
                      f"in bf16: {peak / 1e12:g} TFLOP/s"),
    ]], what=f" (6ND = {_est.training_flops(params, tokens):.3g} FLOPs)")


def check_zero2_memory_gb(gb, params: float = 7e9, n_d: int = 8, stage: int = 2) -> None:
    """Model-state GB (1e9 bytes) per device with mixed-precision Adam under ZeRO ``stage``."""
    want = _est.zero_model_state_bytes(params, n_d, stage) / 1e9
    others = {s: _est.zero_model_state_bytes(params, n_d, s) / 1e9 for s in (0, 1, 2, 3) if s != stage}
    hints = [(others[s], f"that is ZeRO stage {s}" + (" (no partitioning: 16 bytes per "
             "parameter on every device)" if s == 0 else "") + f"; stage {stage} partitions "
             + {1: "the optimizer states", 2: "optimizer states and gradients",
                3: "optimizer states, gradients and weights"}.get(stage, "nothing"))
             for s in others]
    hints += [(want * 1e9, "that is bytes: divide by 1e9 for GB"),
              (want * 1e9 / 2**30, "that is GiB (2**30 bytes); the papers use GB = 1e9 bytes"),
              (2 * params / 1e9, "that counts only the bf16 weights (2 bytes per "
               "parameter); add gradients (2) and Adam's fp32 master weights, momentum and "
               "variance (12)")]
    _check_number("memory", gb, want, "GB", hints,
                  what=f" = 2 psi + 14 psi / {n_d}" if stage == 2 else "")


def check_allreduce_seconds(seconds, nbytes: float = 14e9, p: int = 8,
                            profile: str = "ascend-910b") -> None:
    """Ring all-reduce of ``nbytes`` over p ranks of one node: 2(p-1) a + 2(p-1)/p n / B."""
    prof = get_profile(profile)
    link = prof.intra_node
    want = _cost.collective_time("all_reduce", nbytes, p, link, "ring")
    a, b = link.latency, 1 / link.bandwidth
    _check_number("all-reduce time", seconds, want, "s", [
        ((p - 1) * a + (p - 1) / p * nbytes * b,
         "half of it: an all-reduce sends 2(p-1)/p n per rank (a reduce-scatter then an "
         f"all-gather); or did you use {2 * link.bandwidth / 1e9:g} GB/s? Links are counted "
         f"{link.bandwidth / 1e9:g} GB/s each way"),
        (2 * (p - 1) * a + 2 * nbytes * b,
         f"did you drop the (p-1)/p factor? Each rank sends {p - 1} of {p} chunks, twice"),
        (2 * want, "twice too much: the gradients are bf16, 2 bytes each (14e9 bytes for 7e9)"),
        (_cost.collective_time("all_reduce", nbytes, p, prof.inter_node, "ring"),
         f"did you use the inter-node link ({prof.inter_node.bandwidth / 1e9:g} GB/s)? All "
         f"{p} ranks share one node"),
    ])


# ---- 02 meshes and placements ---------------------------------------------------------------------

def _rows_cols(bounds) -> str:
    (r0, rn), (c0, cn) = bounds
    return f"rows {r0}:{r0 + rn}, cols {c0}:{c0 + cn}"


def check_rank1_layout(placements, shape=(8, 6)) -> None:
    """Rank 1 of the 2 x 2 (dp, tp) mesh holds rows 4:8, cols 0:3; rank 2 rows 0:4, cols 3:6."""
    mesh = Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    try:
        ps = normalize_placements(placements, mesh, len(shape))
    except (ValueError, TypeError) as e:
        raise CheckError(str(e)) from None
    want = {1: ((4, 4), (0, 3)), 2: ((0, 4), (3, 3))}
    for rank, w in want.items():
        got = _layout.shard_bounds(shape, mesh, ps, rank)
        if got != w:
            raise CheckError(f"with {fmt_placements(ps)} rank {rank} (coordinate "
                             f"{mesh.coordinate(rank)}) holds {_rows_cols(got)}; it should hold "
                             f"{_rows_cols(w)}: which mesh dim must split the rows, and which "
                             "the columns?")
    _ok(f"{fmt_placements(ps)}: {_notation(shape, mesh, ps)}")


def check_notation(text, shape=(16, 64), placements=("P(sum)", "S(1)"), dtype="bf16") -> None:
    """The scaling-book notation of a bf16 (16, 64) tensor on (dp, tp) with [P(sum), S(1)]."""
    import torch
    mesh = Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    ps = normalize_placements(list(placements), mesh, len(shape))
    want = _notation(shape, mesh, ps, {"bf16": torch.bfloat16}.get(dtype, torch.float32))
    if not isinstance(text, str):
        raise CheckError(f"give the notation as a string, e.g. 'f32[I_dp, J]', got {text!r}")
    got = text.replace(" ", "")
    if got == want.replace(" ", ""):
        _ok(want)
        return
    if "{U_" not in got:
        msg = "Partial over dp is written {U_dp} after the brackets (unreduced over dp)"
    elif not got.startswith(want.split("[")[0] + "["):
        msg = f"the dtype comes first, short: {want.split('[')[0]}"
    elif "J_tp" not in got:
        msg = "Shard(1) on tp subscripts the second dim: J_tp"
    elif "I_" in got:
        msg = "dim 0 is not sharded: plain I (Partial is not a subscript)"
    else:
        msg = "compare each part: dtype, [dims with subscripts], {U_...}"
    raise CheckError(f"your notation is {text!r}; expected {want!r}: {msg}")


def check_nested_rows(sizes, rows: int = 10) -> None:
    """Rows each rank of the 2 x 2 mesh holds under [Shard(0), Shard(0)], in rank order."""
    mesh = Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    ps = normalize_placements(["S(0)", "S(0)"], mesh, 1)
    want = [_layout.local_shape((rows,), mesh, ps, r)[0] for r in mesh.ranks]
    try:
        got = [int(n) for n in sizes]
    except TypeError:
        raise CheckError(f"sizes should be a list of 4 ints, got {sizes!r}") from None
    if got == want:
        _ok(f"{want}: dp splits {rows} rows first, then tp splits each piece (torch.chunk)")
        return
    m4 = Mesh.grid(4)
    flat = [_layout.local_shape((rows,), m4, normalize_placements(["S(0)"], m4, 1), r)[0]
            for r in range(4)]
    if got == flat:
        msg = (f"that splits {rows} rows 4 ways at once; with two mesh dims the rows are split "
               f"by dp first ({rows - rows // 2}, {rows // 2}), then each piece by tp")
    elif sum(got) != rows:
        msg = f"your sizes add up to {sum(got)}, not {rows}: every row lives on exactly one rank"
    elif sorted(got) == sorted(want):
        msg = "right sizes, wrong order: rank r sits at coordinate (r // 2, r % 2)"
    else:
        msg = ("torch.chunk gives each piece ceil(n / k) rows until the rows run out, "
               "not an even split")
    raise CheckError(f"your sizes are {got}; expected {want}: {msg}")


# ---- 03 collectives and reshard -------------------------------------------------------------------

def check_cheapest_path(path, shape=(8, 8), start=("P(sum)", "S(1)"), target=("S(0)", "R"),
                        profile: str = "a100") -> None:
    """A path of placements from ``start`` to ``target`` on the 2 x 2 (dp, tp) mesh, one
    mesh dim changed per hop, that moves as few bytes as the planner's cheapest plan."""
    mesh = Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    try:
        hops = [normalize_placements(list(p) if not isinstance(p, (str, Placement)) else [p],
                                     mesh, len(shape), "path entry") for p in path]
    except (ValueError, TypeError) as e:
        raise CheckError(f"path entry not understood: {e}") from None
    s0, t0 = (normalize_placements(list(x), mesh, len(shape)) for x in (start, target))
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
    best = plan_reshard(TensorSpec(shape, mesh, s0), mesh, t0, profile=profile)
    route = " -> ".join(fmt_placements(h) for h in hops)
    if total <= best.total_bytes:
        _ok(f"{route} moves {total} B per rank, as the planner's cheapest plan")
        return
    missing = [k for k in best.collectives() if k not in " ".join(parts)]
    hint = f"try {' and '.join(dict.fromkeys(missing))}" if missing else \
        "use the same collectives in another order"
    raise CheckError(f"your path {route} moves {total} B per rank ({', '.join(parts)}); the "
                     f"cheapest moves {best.total_bytes} B: {hint}")


def check_allgather_times(t_910b, t_a100, nbytes: int = 64 * 2**20, p: int = 8) -> None:
    """Ring all-gather of ``nbytes`` (gathered output) over p ranks of one node on the
    Ascend 910B and A100 profiles: (p-1) a + (p-1)/p n / B."""
    want = {name: _cost.collective_time("all_gather", nbytes, p, get_profile(name).intra_node)
            for name in ("ascend-910b", "a100")}
    got = {"ascend-910b": _number("t_910b", t_910b), "a100": _number("t_a100", t_a100)}
    if math.isclose(got["ascend-910b"], want["a100"], rel_tol=0.01) and \
            math.isclose(got["a100"], want["ascend-910b"], rel_tol=0.01):
        raise CheckError("your two times are swapped: the 910B's HCCS gives 196 GB/s each way, "
                         "the A100's NVLink 300 GB/s")
    for name, w in want.items():
        if not math.isclose(got[name], w, rel_tol=0.01):
            link = get_profile(name).intra_node
            a, b = link.latency, 1 / link.bandwidth
            hint = _hint(got[name], w, [
                (2 * (p - 1) * a + 2 * (p - 1) / p * nbytes * b, "twice too much: that is the "
                 "all-reduce formula; an all-gather sends each chunk once"),
                ((p - 1) * a + nbytes * b, f"did you drop the (p-1)/p factor? Each rank "
                 f"receives {p - 1} of {p} chunks"),
                ((p - 1) * a + (p - 1) / p * nbytes * 1e6 / 2**20 * b,
                 "did you use MB (1e6 bytes) for MiB (2**20 bytes)?"),
                ((p - 1) * a, "that is the latency term alone; add (p-1)/p n / B"),
                ((p - 1) / p * nbytes * b, "right, less the latency term: add (p-1) alpha"),
            ], rel=0.002)
            raise CheckError(f"your {name} time is {got[name]:.4g} s; expected {w:.4g} s "
                             f"({link}): {hint}")
    _ok(f"910B {want['ascend-910b'] * 1e6:.1f} us, A100 {want['a100'] * 1e6:.1f} us "
        f"(ratio {want['ascend-910b'] / want['a100']:.2f})")


def check_uneven_receive(bytes_per_rank, shape=(10, 4), p: int = 4, elem: int = 4) -> None:
    """Bytes each rank receives when a (10, 4) f32 tensor sharded S(0) on 4 ranks is
    all-gathered: the rows it does not hold."""
    mesh = Mesh.grid(p, ["dp"])
    ps = normalize_placements(["S(0)"], mesh, len(shape))
    rows = [_layout.local_shape(shape, mesh, ps, r)[0] for r in mesh.ranks]
    row_bytes = math.prod(shape[1:]) * elem
    want = [(shape[0] - n) * row_bytes for n in rows]
    try:
        got = [int(b) for b in bytes_per_rank]
    except TypeError:
        raise CheckError(f"give a list of {p} byte counts, got {bytes_per_rank!r}") from None
    if got == want:
        _ok(f"{want}: the ranks with fewer rows receive more; the plan reports their "
            f"mean, (p-1)/p n = {_cost.wire_bytes('all_gather', shape[0] * row_bytes, p)} B")
        return
    mean = _cost.wire_bytes("all_gather", shape[0] * row_bytes, p)
    if got == [mean] * p:
        msg = (f"{mean} B is the plan's figure, (p-1)/p n: the mean over ranks. With uneven "
               f"shards ({rows} rows) each rank receives the rows it lacks")
    elif got == [w // elem for w in want]:
        msg = f"those are elements: multiply by {elem} bytes per f32"
    elif got == [n * row_bytes for n in rows]:
        msg = "those are the bytes each rank holds (and sends); it receives the other rows"
    else:
        msg = f"rank r receives (10 - its rows) x {row_bytes} B; its rows are {rows}"
    raise CheckError(f"your bytes are {got}; expected {want}: {msg}")
