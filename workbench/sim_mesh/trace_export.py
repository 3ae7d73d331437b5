"""A trace read out: its summary text and its Chrome trace-event JSON (``Trace.summary``,
``Trace.to_chrome_trace``)."""
from __future__ import annotations

import json
from collections import defaultdict

__all__ = ["summary", "chrome_trace", "fmt_s", "fmt_bytes"]


def summary(tr) -> str:
    """One line per collective kind: events, bytes sent by the busiest rank, and the
    summed duration of the events."""
    lines = [f"{len(tr.events)} events, modeled time {fmt_s(tr.time())} "
             f"on {tr.profile.name}"]
    by = defaultdict(lambda: [0, 0.0])
    for e in tr.collectives():
        row = by[e.name]
        row[0] += 1
        row[1] += e.duration
    for name, (n, t) in sorted(by.items()):
        per_rank = max(tr.bytes_per_rank(name).values(), default=0)
        lines.append(f"  {name:<15} x{n:<4} {fmt_bytes(per_rank):>10} per rank  {fmt_s(t)}")
    return "\n".join(lines)


def chrome_trace(tr, path=None) -> dict:
    """Chrome trace-event JSON of ``tr``: one process per rank, one thread per stream;
    written to ``path`` when given."""
    from .trace import STREAMS
    out = []
    ranks = sorted({r for e in tr.events for r in e.ranks})
    for r in ranks:
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                    "args": {"name": f"rank {r}"}})
        for tid, s in enumerate(STREAMS):
            out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                        "args": {"name": s}})
    for e in tr.events:
        args = {"bytes": e.bytes, "flops": e.flops, "ranks": list(e.ranks)}
        if e.label:
            args["label"] = e.label
        args.update({k: _jsonable(v) for k, v in e.args.items()})
        for r in e.ranks:
            out.append({"ph": "X", "name": e.name, "cat": e.stream, "pid": r,
                        "tid": STREAMS.index(e.stream) if e.stream in STREAMS else 2,
                        "ts": e.start * 1e6, "dur": e.duration * 1e6, "args": args})
    doc = {"traceEvents": out, "displayTimeUnit": "ns",
           "otherData": {"profile": tr.profile.name, "clock": "modeled"}}
    if path is not None:
        with open(path, "w") as f:
            json.dump(doc, f)
    return doc


def _jsonable(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)


def fmt_s(t: float) -> str:
    """Seconds, in s, ms or us."""
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.2f} us"


def fmt_bytes(n: float) -> str:
    """Bytes, in B, KiB, MiB, GiB or TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
