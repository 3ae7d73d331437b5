"""A pipeline rank's peak of saved activations when its chunks differ in size.

Interleaved 1F1B (Narayanan et al. 2021 sec. 2.2.2; Megatron-LM's
``forward_backward_pipelining_with_interleaving``, megatron/core/pipeline_parallel/
schedules.py, whose order ``parallel.schedules.interleaved_1f1b`` follows) holds ``v``
chunks on a rank.  :func:`~workbench.plan.memory.in_flight` counts how many chunk
micro-batches are in flight at the peak (Korthikanti et al. 2022 sec. 4.2.3), which is
the whole story while every chunk keeps the same bytes.  The first chunk of rank 0 also
keeps the embedding's tensors (its dropout mask, BLOOM's embedding LayerNorm input, the
lookups' indices) and the last chunk of the last rank the head's: then WHICH chunks are
in flight matters, and Megatron's order is not an even mix.  Rank 0 warms up with
2 (p - 1) + (v - 1) p forwards taken p micro-batches per chunk, then alternates one
forward (of an earlier chunk) with one backward (of the last): at p = 4, m = 8, v = 2 its
peak of 11 chunk micro-batches holds 8 of chunk 0 and 3 of chunk 1, not 5.5 of each
(GPT 22B, tp 2, full recompute: the dry run's 377.8 MB against the even mix's 346.0 MB;
found by plan10's random layouts, tests/test_plan11.py).

:func:`peak_bytes` walks the rank's order in the schedule the estimate simulates (its
forwards add a chunk's bytes, its backwards release them, as ``plan.dryrun`` walks the
same schedule with the bytes it measured) and returns the largest sum.
"""
from __future__ import annotations

from functools import lru_cache

__all__ = ["schedule", "in_flight_counts", "peak_bytes"]


@lru_cache(maxsize=64)
def schedule(kind: str, pp: int, m: int, v: int):
    """The (frozen) ``parallel.schedules`` Schedule of ``kind``, built and its structure
    checked once per shape: a search simulates many layouts of one (pp, m, v), and
    building an interleaved one of m = 48, v = 12 takes as long as simulating it."""
    from ..parallel.schedules import gpipe, interleaved_1f1b, one_f_one_b
    from ..parallel.schedules.validate import check_structure
    build = {"1f1b": one_f_one_b, "gpipe": gpipe}.get(kind)
    sched = build(pp, m) if build else interleaved_1f1b(pp, m, v)
    check_structure(sched)
    return sched


@lru_cache(maxsize=1024)
def in_flight_counts(kind: str, pp: int, m: int, v: int, rank: int) -> tuple:
    """The vectors (micro-batches in flight of each of ``rank``'s chunks, chunk order) at
    the instants a peak can be at: right after a forward that a backward (or the end)
    follows, none below another in every chunk (a count only grows between two such
    instants, and chunk bytes are not negative).  Interleaved 1F1B walks the rank's own
    order (``schedules.interleaved.rank_order``) without building the schedule's p rows:
    a search asks this of hundreds of shapes before it prices any."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < pp:
        raise ValueError(f"in_flight_counts(rank={rank!r}): a pipeline rank 0 .. {pp - 1}")
    if kind == "interleaved_1f1b" and v > 1:
        from ..parallel.schedules._check import check_pm
        from ..parallel.schedules.interleaved import _steps, rank_order
        check_pm("interleaved_1f1b", pp, m, v)
        if m % pp:                                   # the schedule's own message
            schedule(kind, pp, m, v)
        group = [c for _, c in _steps(pp, v, m * v)]
        steps = [(fwd, group[k] if fwd else v - 1 - group[k])
                 for fwd, k in rank_order(pp, m, v, rank)]
    else:
        sched = schedule(kind, pp, m, v)
        release = "W" if sched.split_backward else "B"
        steps = [(a.kind == "F", a.chunk) for a in sched.actions[rank]
                 if a.kind in ("F", release)]
        v = sched.v
    cur, seen = [0] * v, set()
    for i, (fwd, c) in enumerate(steps):
        if fwd:
            cur[c] += 1
            if i + 1 == len(steps) or not steps[i + 1][0]:
                seen.add(tuple(cur))
        else:
            cur[c] -= 1
    top = [x for x in seen
           if not any(y != x and all(b >= a for a, b in zip(x, y)) for y in seen)]
    return tuple(sorted(top))


def peak_bytes(kind: str, pp: int, m: int, v: int, rank: int, chunk_bytes) -> float:
    """The largest sum of ``chunk_bytes[c]`` (one micro-batch of ``rank``'s chunk c) over
    the chunks in flight at once on ``rank`` (module docstring)."""
    if any(b < 0 for b in chunk_bytes):
        raise ValueError(f"peak_bytes(chunk_bytes={list(chunk_bytes)!r}): bytes of a chunk's "
                         f"micro-batch cannot be negative")
    return max(sum(n * b for n, b in zip(counts, chunk_bytes))
               for counts in in_flight_counts(kind, pp, m, v, rank))
