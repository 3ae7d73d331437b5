"""Profile a block of code and write a Chrome trace the course can open.

On Ascend this uses ``torch_npu.profiler`` (plain ``torch.profiler`` does not
see NPU kernels); elsewhere ``torch.profiler`` with CPU (and CUDA) activities.
Either way the result is one Chrome-trace JSON file: open it in
``chrome://tracing`` or https://ui.perfetto.dev.

    with wb.npu.profile("step.json") as prof:
        loss = model(x).sum(); loss.backward()
    print(prof.summary())         # the top ops by self time

The same Chrome-trace format is what the simulator writes (``Trace.to_chrome_trace``), so
:func:`complete_events`, :func:`top_ops` and :func:`idle_gaps` read a real profile and a
modeled one alike: the ops that take the time, and where a stream sits idle.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from .device import _best_device, device_type, torch_npu_module

__all__ = ["Profile", "profile", "complete_events", "top_ops", "idle_gaps"]


@dataclass
class Profile:
    """What :func:`profile` produced: the trace file and the profiler behind it."""
    path: Path          # the Chrome trace JSON, written when the block exits
    backend: str        # "torch_npu.profiler" | "torch.profiler"
    activities: tuple[str, ...]
    profiler: Any       # the underlying profiler object, for anything not wrapped here

    def summary(self, row_limit: int = 10, sort_by: str = "self_cpu_time_total",
                max_name_column_width: int = 55) -> str:
        """The profiler's table of the ``row_limit`` most expensive ops. Its name column is
        ``max_name_column_width`` characters wide (torch's argument and default; longer
        names are cut with "..."): narrow it where the table must fit a notebook's width."""
        if isinstance(max_name_column_width, bool) or not isinstance(
                max_name_column_width, int) or max_name_column_width < 4:
            raise ValueError(f"summary(max_name_column_width={max_name_column_width!r}): "
                             "give the name column's width in characters, an int >= 4 "
                             "(torch's default is 55)")
        return self.profiler.key_averages().table(
            sort_by=sort_by, row_limit=row_limit, max_name_column_width=max_name_column_width)


@contextmanager
def profile(path: str | Path = "trace.json", *, device: torch.device | str | None = None,
            record_shapes: bool = False, profile_memory: bool = False,
            with_stack: bool = False) -> Iterator[Profile]:
    """Profile the ``with`` block; on exit write a Chrome trace to ``path``.

    ``device`` picks the profiler (default: :func:`workbench.npu.device`):
    ``npu`` -> ``torch_npu.profiler`` with CPU + NPU activities, ``cuda`` ->
    ``torch.profiler`` with CPU + CUDA, ``cpu`` -> ``torch.profiler`` with CPU.
    """
    path = Path(path)
    if path.suffix != ".json":
        raise ValueError(f"profile(path={str(path)!r}): the Chrome trace is JSON; "
                         f"give a path ending in .json, e.g. {path.stem or 'trace'}.json")
    kind = device_type(_best_device() if device is None else device)
    if kind == "npu":
        prof_mod = torch_npu_module().profiler
        backend = "torch_npu.profiler"
        names = ("CPU", "NPU")
    else:
        prof_mod = torch.profiler
        backend = "torch.profiler"
        names = ("CPU", "CUDA") if kind == "cuda" else ("CPU",)
    activities = [getattr(prof_mod.ProfilerActivity, n) for n in names]
    prof = prof_mod.profile(activities=activities, record_shapes=record_shapes,
                            profile_memory=profile_memory, with_stack=with_stack)
    session = Profile(path=path, backend=backend, activities=names, profiler=prof)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _without_profiler_chatter():
        prof.__enter__()
    try:
        yield session
    finally:
        with _without_profiler_chatter():
            prof.__exit__(None, None, None)
    prof.export_chrome_trace(str(path))


_CHATTER = ("USDT:", "STAGE:", "INFO:")   # Kineto's progress lines, written straight to fd 2


@contextmanager
def _without_profiler_chatter():
    """Drop Kineto's "profiler_start"/"Completed Stage" lines from stderr, keep the rest.

    Kineto writes them from C++ to file descriptor 2 whatever Python's logging
    says (only KINETO_LOG_LEVEL, read when torch loads, turns them off), so fd 2
    is pointed at a temporary file for the start/stop calls and every other line
    is passed on to ``sys.stderr``.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(True)
                    if not line.startswith(_CHATTER)]
            if kept:
                sys.stderr.write("".join(kept))


# ---- reading a Chrome trace (a real profile or the simulator's) ---------------------------

def complete_events(source) -> list[dict]:
    """The complete ("ph": "X") events of a Chrome trace: ``source`` is a path to its JSON,
    the loaded dict (e.g. ``Trace.to_chrome_trace()``) or a :class:`Profile`. Times are
    microseconds (the format's unit)."""
    if isinstance(source, Profile):
        source = source.path
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise ValueError(f"complete_events: {str(path)!r} does not exist; profile a block "
                             f"first (with wb.npu.profile({str(path)!r}): ...)")
        source = json.loads(path.read_text())
    if not isinstance(source, dict) or not isinstance(source.get("traceEvents"), list):
        raise ValueError(f"complete_events: give a Chrome trace (a dict with 'traceEvents', a "
                         f"path to its JSON, or a Profile); got {type(source).__name__}")
    return [e for e in source["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def top_ops(source, n: int = 10, *, cat: str | None = None) -> list[tuple[str, float, int]]:
    """(name, total microseconds, calls) of the ``n`` names with the most time, most first
    (ties by name). ``cat`` keeps one category only (the simulator's "compute" or "comm";
    torch's "cpu_op", "kernel"...). Times are inclusive: in a real profile an op's time
    contains the ops it calls (``aten::linear`` contains its ``aten::addmm``); the
    profiler's own table (``Profile.summary``) gives self times."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"top_ops: n={n!r} must be an int >= 1 (how many names to list)")
    total: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in complete_events(source):
        if cat is not None and e.get("cat") != cat:
            continue
        total[e["name"]] = total.get(e["name"], 0.0) + float(e["dur"])
        calls[e["name"]] = calls.get(e["name"], 0) + 1
    order = sorted(total, key=lambda k: (-total[k], k))[:n]
    return [(k, total[k], calls[k]) for k in order]


def idle_gaps(source, pid, tid, *, min_us: float = 0.0) -> list[tuple[float, float]]:
    """(start, end) microseconds when thread ``tid`` of process ``pid`` runs nothing,
    between its first event's start and its last event's end; gaps shorter than
    ``min_us`` are dropped. In the simulator's trace pid is the rank and tid 0 its
    compute stream, 1 its comm stream."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]))
                   for e in complete_events(source) if e.get("pid") == pid and e.get("tid") == tid)
    if not spans:
        raise ValueError(f"idle_gaps: no events on pid={pid!r}, tid={tid!r}; look up the "
                         f"pids and tids in complete_events(source)")
    gaps, end = [], spans[0][1]
    for s, e in spans[1:]:
        if s > end and s - end >= min_us:
            gaps.append((end, s))
        end = max(end, e)
    return gaps
