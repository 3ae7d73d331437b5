"""Profile a block of code and write a Chrome trace the course can open.

On Ascend this uses ``torch_npu.profiler`` (plain ``torch.profiler`` does not
see NPU kernels); elsewhere ``torch.profiler`` with CPU (and CUDA) activities.
Either way the result is one Chrome-trace JSON file: open it in
``chrome://tracing`` or https://ui.perfetto.dev.

    with wb.npu.profile("step.json") as prof:
        loss = model(x).sum(); loss.backward()
    print(prof.summary())         # the top ops by self time
"""
from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from .device import _best_device, device_type, torch_npu_module

__all__ = ["Profile", "profile"]


@dataclass
class Profile:
    """What :func:`profile` produced: the trace file and the profiler behind it."""
    path: Path          # the Chrome trace JSON, written when the block exits
    backend: str        # "torch_npu.profiler" | "torch.profiler"
    activities: tuple[str, ...]
    profiler: Any       # the underlying profiler object, for anything not wrapped here

    def summary(self, row_limit: int = 10, sort_by: str = "self_cpu_time_total") -> str:
        """The profiler's table of the ``row_limit`` most expensive ops."""
        return self.profiler.key_averages().table(sort_by=sort_by, row_limit=row_limit)


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
