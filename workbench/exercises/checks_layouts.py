"""Checks for the exercises of notebooks 02 (meshes and placements) and 03 (collectives and
reshard).  As in :mod:`.checks`: the hint first, the expected value after repeated tries,
every expected value derived by hand or from the ring formula, not by the library.
"""
from __future__ import annotations

import math
import re

from ..parallel import layout as _layout
from ..parallel.dist_tensor import TensorSpec
from ..parallel.placement import Placement, fmt_placements, normalize_placements
from ..parallel.reshard import plan_reshard
from ..sim_mesh.mesh import Mesh
from .checks import HCCS_ALPHA, HCCS_LINKS, HCCS_TOTAL, _chunks, _hint, _number, _ok
from .feedback import CheckError, exercise

__all__ = ["check_rank1_layout", "check_notation", "check_nested_rows", "check_cheapest_path",
           "check_allgather_times", "check_uneven_receive"]

# A100 (DGX A100): NVLink 3 through NVSwitch, 600 GB/s bidirectional = 300 GB/s each way
# per GPU, all of it usable by a ring (NVIDIA A100 datasheet); alpha = 3 us, the figure the
# a100 profile takes for NVLink.
NVLINK_A100, NVLINK_ALPHA = 300e9, 3e-6


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
    # J_{tp} reads as J_tp; no whitespace counts (a trailing newline read "compare each part")
    got = re.sub(r"_\{(\w+)\}", r"_\1", re.sub(r"\s", "", text))
    if got == want.replace(" ", ""):
        _ok(want)
        return
    dtype = got.split("[", 1)[0]
    if got.startswith("TensorSpec("):
        # the whole repr pasted read "the dtype comes first", as did another dtype
        msg = ("that is TensorSpec's repr, with the shape; the notation is only the dtype, "
               "[dims] and {U_...}")
    elif any(f"_{name}" in got for name in ("x", "y")):
        msg = "mesh22's dims are named dp and tp (x and y were the other mesh's names)"
    elif "{U_" not in got:
        msg = "Partial over dp is written {U_dp} after the brackets (unreduced over dp)"
    elif dtype and dtype != "bf16" and "[" in got:
        msg = ("write the dtype's short name, lower case: bf16 for torch.bfloat16"
               if dtype.lower().removeprefix("torch.") in ("bf16", "bfloat16") else
               f"{dtype} is not this tensor's dtype: it is torch.bfloat16, short bf16")
    elif not got.startswith("bf16["):
        msg = "the dtype comes first, short: bf16 for torch.bfloat16"
    elif re.search(r"[\[,]\d", got):
        msg = ("name the dims with letters, I for dim 0 and J for dim 1, not with their sizes "
               "(the shape stands apart: TensorSpec's repr prints it first)")
    elif re.search(r"\[J", got):
        msg = "the dims come in order: I for dim 0, then J for dim 1"
    elif "J_tp" not in got:
        msg = "Shard(1) on tp subscripts the second dim: J_tp"
    elif "I_" in got:
        msg = "dim 0 is not sharded: plain I (Partial is not a subscript)"
    elif "{U_dp}" not in got:
        msg = "the Partial placement is the first one, on mesh dim dp: {U_dp}"
    else:
        msg = "compare each part: dtype, [dims with subscripts], {U_...}"
    raise CheckError(f"your notation is {text!r}: {msg}", expected=repr(want))


@exercise
def check_nested_rows(sizes, rows: int = 10) -> None:
    """Rows each rank of the 2 x 2 mesh holds under [Shard(0), Shard(0)], in rank order:
    torch.chunk over dp first, then each piece over tp."""
    want = [n for piece in _chunks(rows, 2) for n in _chunks(piece, 2)]   # rank r = (r//2, r%2)
    tp_first = [_chunks(_chunks(rows, 2)[t], 2)[d] for d in (0, 1) for t in (0, 1)]
    small_first = [n for piece in _chunks(rows, 2)[::-1] for n in _chunks(piece, 2)[::-1]]
    try:
        if isinstance(sizes, (str, bytes)):
            raise TypeError(sizes)
        raw = list(sizes)
        if any(isinstance(n, bool) for n in raw):       # True read as 1 row
            raise TypeError(sizes)
        got = [int(n) for n in raw]
        whole = all(float(n) == g for n, g in zip(raw, got))
    except (TypeError, ValueError):
        raise CheckError(f"sizes should be a list of 4 ints, e.g. [1, 2, 3, 4], got "
                         f"{sizes!r}") from None
    if not whole:
        raise CheckError(f"your sizes {raw} are not whole numbers: a rank holds whole rows "
                         "(torch.chunk gives each piece ceil(n / k) rows until they run out), "
                         "never part of one")
    if len(got) != 4:
        raise CheckError(f"give one size per rank: mesh22 has 4 ranks, your list has "
                         f"{len(got)}")
    if got == want:
        _ok(f"{want}: dp splits {rows} rows first, then tp splits each piece (torch.chunk)")
        return
    if got == _chunks(rows, 4):
        msg = (f"that splits {rows} rows 4 ways at once; with two mesh dims the rows are split "
               f"by dp first {tuple(_chunks(rows, 2))}, then each piece by tp")
    elif got == tp_first and tp_first != want:
        msg = ("that splits by tp first; the mesh dims split in order, left to right: dp "
               "(mesh dim 0) cuts the rows in two, then tp cuts each piece")
    elif got == small_first and small_first != want:
        piece = _chunks(rows, 2)[0]                     # dp's first piece, which tp cuts
        msg = ("torch.chunk gives the FIRST pieces ceil(n / k) rows and the last what is left: "
               f"{piece} rows in 2 are {tuple(_chunks(piece, 2))}, not the other way round")
    elif sum(got) != rows:
        msg = f"your sizes add up to {sum(got)}, not {rows}: every row lives on exactly one rank"
    elif sorted(got) == sorted(want):
        msg = "right sizes, wrong order: rank r sits at coordinate (r // 2, r % 2)"
    elif [got[0] + got[1], got[2] + got[3]] != _chunks(rows, 2):
        # ([5, 5, 0, 0], [4, 3, 2, 1] read "torch.chunk ..., not an even split")
        msg = (f"ranks 0, 1 share dp's first piece and ranks 2, 3 its second, but yours add "
               f"up to {got[0] + got[1]} and {got[2] + got[3]}: dp (mesh dim 0) cuts the "
               f"{rows} rows with torch.chunk first")
    else:
        # the dp pieces are right, tp's cut of them is not ([4, 1, 4, 1])
        msg = ("each pair of ranks holds dp's piece, but tp's cut of it is not torch.chunk's: "
               "ceil(n / 2) rows for the first piece, what is left for the second")
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
    if not isinstance(path, (list, tuple)) or (
            path and all(isinstance(p, (str, Placement)) for p in path)):
        raise CheckError(f"path is a list of placement lists, one per hop, e.g. [[P, S(1)], "
                         f"..., [S(0), R]]; got {path!r}")
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
    total, parts, nested = 0, [], ""
    for k, (a, b) in enumerate(zip(hops, hops[1:]), 1):
        changed = [mesh.dim_names[i] for i in range(mesh.ndim) if a[i] != b[i]]
        if not changed:
            raise CheckError(f"hops {k} and {k + 1} are the same placements "
                             f"{fmt_placements(a)}: drop the repeated entry")
        if len(changed) != 1:
            raise CheckError(f"hop {k} {fmt_placements(a)} -> {fmt_placements(b)} changes "
                             f"{len(changed)} mesh dims {changed}: one collective edits one "
                             "mesh dim; split the hop")
        plan = plan_reshard(TensorSpec(shape, mesh, a), mesh, b, profile=profile)
        total += plan.total_bytes
        parts += [f"{s.kind} {s.bytes} B" for s in plan.steps]
        moving = [s for s in plan.steps if s.bytes]
        if len(moving) > 1 and not nested:
            # one placement changed, several collectives: the tensor dim is sharded by
            # both mesh dims, so the other mesh dim's pieces move too (DTensor's nesting)
            nested = (f"; hop {k} {fmt_placements(a)} -> {fmt_placements(b)} changes one "
                      f"mesh dim's placement yet takes {len(moving)} collectives: a tensor dim "
                      "sharded by both mesh dims is split by the first, then each piece by the "
                      "second, so the other mesh dim's pieces move too")
    route = " -> ".join(fmt_placements(h) for h in hops)
    if total <= best:
        _ok(f"{route} moves {total} B per rank, the fewest possible")
        return
    kinds = [s.split()[0] for s in parts if not s.endswith(" 0 B")]     # those that move
    if "reduce_scatter" not in kinds:
        hint = "try reduce_scatter: it sums AND splits in one step, half an all-reduce's bytes"
    elif kinds[0] != "reduce_scatter":
        hint = (f"your path moves the partial sums ({kinds[0]}) before it reduces them: "
                "reduce first, while the pieces are small")
    else:
        # it reduces first, then detours ("use the same collectives in another order:
        # reduce first" was the hint, for a path that did)
        hint = (f"you reduce first, good; after that your path takes {len(kinds) - 1} "
                f"collectives ({', '.join(kinds[1:])}) where one will do")
    raise CheckError(f"your path {route} moves {total} B per rank ({', '.join(parts)}): "
                     f"{hint}{nested}",
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
        a, bw = links[name]
        # within 0.2%, and less than one alpha: the latency term is under 1% of the 910B's
        # time, so 0.2% passed a ring that pays alpha p times instead of p-1 (0.14% off);
        # 0.7 alpha keeps it out (0.1% there; the A100's 217 us, rounded, still passes)
        if math.isclose(got[name], w, rel_tol=min(0.002, 0.7 * a / w)):
            continue
        wrong = [
            ((p - 1) * a + (p - 1) / p * nbytes / HCCS_TOTAL, f"that uses "
             f"{HCCS_TOTAL / 1e9:g} GB/s, the {HCCS_LINKS} HCCS links added together; a ring "
             f"sends to one neighbour, so it uses one link per direction ("
             f"{HCCS_TOTAL / HCCS_LINKS / 1e9:g} GB/s). Only a mesh algorithm reaches the sum"),
            (2 * (p - 1) * a + 2 * (p - 1) / p * nbytes / bw, "twice too much: that is the "
             "all-reduce formula; an all-gather sends each chunk once"),
            ((p - 1) * a + nbytes / bw, f"did you drop the (p-1)/p factor? Each rank "
             f"receives {p - 1} of {p} chunks"),
            *([((p - 1) * a + (p - 1) / p * nbytes / (HCCS_TOTAL / p), f"did you split the "
                f"{HCCS_TOTAL / 1e9:g} GB/s over the {p} NPUs? Each NPU has {HCCS_LINKS} links "
                f"and a ring uses one of them ({HCCS_TOTAL / HCCS_LINKS / 1e9:g} GB/s)")]
              if name == "910B" else []),
            ((p - 1) * a + (p - 1) / p * nbytes / (2 * bw), f"that uses {2 * bw / 1e9:g} GB/s, "
             f"the link's two directions added; a ring sends one way on it: "
             f"{bw / 1e9:g} GB/s"),
            (p * a + (p - 1) / p * nbytes / bw, f"a ring of p = {p} ranks takes p-1 steps "
             "(each rank holds its own chunk already): (p-1) alpha, not p alpha"),
            (p * a + nbytes / bw, f"that counts p steps of n/p; a ring of p ranks takes p-1 "
             "(each rank holds its own chunk already)"),
            # 03's section 1 leaves p = 4 in the notebook: reused, it read "compare each factor"
            *([(3 * a + 3 / 4 * nbytes / bw, f"that is a ring of p = 4 (the notebook's p from "
                f"section 1); the server has {p} devices")] if p != 4 else []),
            ((p - 1) * a + (p - 1) / p * nbytes * 1e6 / 2**20 / bw,
             "did you use MB (1e6 bytes) for MiB (2**20 bytes)?"),
            ((p - 1) * a * 1e6 + (p - 1) / p * nbytes / bw, "alpha is 3 us = 3e-6 s: give "
             "every term in seconds"),
            (a + (p - 1) / p * nbytes / bw, f"a ring takes p-1 = {p - 1} steps and each "
             "pays alpha: (p-1) alpha, not alpha once"),
            ((p - 1) * a + (p - 1) / p * nbytes * 8 / bw, "8 times too much: n is in bytes "
             "and the bandwidth in bytes per second, no bits"),
            *([((p - 1) * a + (p - 1) / p * nbytes / (bw * _nccl_share()), "that takes NCCL's "
               f"share of NVLink (x{_nccl_share():g}, the a100 profile's efficiency); the "
               f"exercise asks the ring formula at NVLink's {NVLINK_A100 / 1e9:g} GB/s")]
              if name == "A100" else []),
            ((p - 1) * a, "that is the latency term alone; add (p-1)/p n / B"),
            ((p - 1) / p * nbytes / bw, "right, less the latency term: add (p-1) alpha"),
            ((p - 1) * a + (p - 1) / p * nbytes / p / bw, f"n is the gathered output "
             f"({nbytes:,} B), not one rank's shard of it"),
            (_simulated(nbytes, p, name), "that is the simulator's price (cost.price: what "
             "the vendor's library runs, with its own algorithm and efficiency); the "
             "exercise asks what the ring formula predicts"),
        ]
        # name every mistake the value matches: 196 GB/s split over 8 NPUs gives exactly
        # the time without (p-1)/p, and read only "did you drop the (p-1)/p factor?"
        named = [text for value, text in wrong if math.isclose(got[name], value, rel_tol=0.001)]
        hint = "; or ".join(named) if named else _hint(got[name], w, [], rel=0.001)
        if got[name] != 0 and float(f"{got[name]:.3g}") == got[name]:
            hint += (" (if you rounded: give the time unrounded, the latency term is under "
                     "1% of it)")
        raise CheckError(f"your {name} time is {got[name]:.4g} s: {hint}", expected=shown)
    _ok(f"{shown} (ratio {want['910B'] / want['A100']:.1f}): one HCCS link is slow; HCCL's mesh "
        "uses all 7")


def _nccl_share() -> float:
    """The share of NVLink the a100 profile gives NCCL (a student's slip: the profile's
    efficiency applied where the exercise asks the ring formula at the link's rate)."""
    from ..sim_mesh.profiles import get_profile
    return get_profile("a100").intra_node.efficiency


def _simulated(nbytes: int, p: int, name: str) -> float:
    """The simulator's all-gather time on the profile behind ``name`` (a student's slip:
    the measured price where the formula's prediction is asked)."""
    from ..sim_mesh import cost
    return cost.price("all_gather", nbytes, range(p),
                      {"910B": "ascend-910b", "A100": "a100"}[name])


@exercise
def check_uneven_receive(bytes_per_rank, shape=(10, 4), p: int = 4, elem: int = 4) -> None:
    """Bytes each rank receives when a (10, 4) f32 tensor sharded S(0) on 4 ranks is
    all-gathered: the rows it does not hold."""
    rows = _chunks(shape[0], p)                                 # torch.chunk, by hand
    row_bytes = math.prod(shape[1:]) * elem
    want = [(shape[0] - n) * row_bytes for n in rows]
    mean = (p - 1) * shape[0] * row_bytes // p                  # (p-1)/p n
    # the plan's figure, the busiest rank's: p-1 shards padded to the largest
    # (sim_mesh.grid.gather_sent)
    plan = (p - 1) * max(rows) * row_bytes
    try:
        if isinstance(bytes_per_rank, (str, bytes)):
            raise TypeError(bytes_per_rank)
        raw = list(bytes_per_rank)
        # numbers only: int("112") read a string as 112, int(112.7) a fraction as 112
        vals = [float(b) if not isinstance(b, (str, bytes, bool)) else None for b in raw]
        if None in vals:
            raise TypeError(raw)
    except (TypeError, ValueError):
        raise CheckError(f"give a list of {p} byte counts (numbers), got "
                         f"{bytes_per_rank!r}") from None
    if len(vals) != p:
        raise CheckError(f"give one byte count per rank: {p} ranks, your list has {len(vals)}")
    if not all(math.isfinite(v) and v == int(v) for v in vals):
        kilo = any(all(math.isclose(v * k, w, rel_tol=0.01) for v, w in zip(vals, want))
                   for k in (1e3, 2**10))
        raise CheckError(f"your bytes {raw} are not whole numbers: "
                         + ("those look like KB; give bytes" if kilo else
                            "a rank receives whole f32 values, 4 bytes each"))
    got = [int(v) for v in vals]
    if got == want:
        _ok(f"{want}: fewer rows, more received; the plan reports the busiest rank's {plan} B")
        return
    implied = [shape[0] - g // row_bytes for g in got]          # the rows each would hold
    if got == [mean] * p:
        msg = (f"{mean} B is (p-1)/p n: the mean over ranks. With uneven shards ({rows} "
               "rows) each rank receives the rows it lacks")
    elif got == [plan] * p:
        msg = (f"{plan} B is the plan's figure, the busiest rank's ({p - 1} shards, each "
               f"padded to {max(rows)} rows). With uneven shards ({rows} rows) each rank "
               "receives the rows it lacks")
    elif got == [w // elem for w in want]:
        msg = f"those are elements: multiply by {elem} bytes per f32"
    elif got == [w // row_bytes for w in want]:
        msg = f"those are rows: give bytes ({shape[1]} f32 values of {elem} bytes per row)"
    elif got == [n * row_bytes for n in rows]:
        msg = "those are the bytes each rank holds; it receives the other rows"
    elif got == [w * 8 for w in want]:
        msg = "those are bits: give bytes (8 bits each)"
    elif got == [shape[0] * row_bytes] * p:
        msg = "that is the whole tensor: each rank holds its own rows already"
    elif sorted(got) == sorted(want):
        msg = "right amounts, wrong order: give them in rank order, rank 0 first"
    elif got == [n * row_bytes * (p - 1) for n in rows]:
        msg = (f"those are each rank's own rows times the {p - 1} other ranks (what it "
               f"would send them directly); the question is what it receives: the rows it "
               f"lacks")
    elif all(g % row_bytes == 0 for g in got) and sum(implied) == shape[0] and \
            all(n >= 0 for n in implied):
        # the rows it lacks, for another split ([112, 112, 128, 128]: 3, 3, 2, 2 rows)
        msg = (f"those fit shards of {implied} rows; u's shards are torch.chunk's "
               "(see the rows per rank printed above)")
    else:
        # ("rank r receives (10 - its rows) x 16 B; its rows are [3, 3, 3, 1]" was the
        # answer's recipe)
        msg = "each rank receives the rows it does not hold, in bytes"
    raise CheckError(f"your bytes are {got}: {msg}", expected=str(want))
