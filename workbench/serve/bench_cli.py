"""``python -m workbench serve --requests FILE``: a serving benchmark on the modeled clock.

The file is JSON lines, one request a line::

    {"arrival": 0.0, "prompt": 128, "output": 64}
    {"arrival": 0.05, "prompt": 300, "output": 16, "id": 7}

``arrival`` in seconds from the start (>= 0), ``prompt`` and ``output`` in tokens (>= 1),
``id`` optional (default: the request's position); blank lines are skipped
(:func:`.requests.read_trace`).  The trace runs under continuous batching and under static
batching (:mod:`.batching`), each step priced for ``--preset`` on ``--profile``'s roofline
(:class:`.batching.StepPricer`); the latency table (throughput, time to first token and per
output token, p50 / p99) goes to stdout, a progress bar to stderr when it is a terminal
(as ``train`` does).
"""
from __future__ import annotations

import os
import sys

__all__ = ["REQUESTS_HELP", "add_bench_arguments", "main_bench"]

REQUESTS_HELP = ("a serving benchmark instead of text: a JSON-lines file, one request a "
                 'line, {"arrival": seconds, "prompt": tokens, "output": tokens} (optional '
                 '"id"); runs continuous against static batching on the modeled clock of '
                 "--preset on --profile and prints the latency table")


def add_bench_arguments(p) -> None:
    g = p.add_argument_group("serving benchmark (--requests)")
    g.add_argument("--requests", default=None, metavar="FILE", help=REQUESTS_HELP)
    g.add_argument("--profile", default="a100",
                   help="hardware profile the steps are priced on (list_profiles())")
    g.add_argument("--max-batch", type=int, default=32, help="requests in one batch, at most")
    g.add_argument("--token-budget", type=int, default=512,
                   help="tokens in one continuous-batching step (chunked prefill)")


class _Bar:
    """``schedule 1/2 [############............] continuous`` in place on stderr."""

    def __init__(self, total: int, width: int = 24):
        self.total, self.width = total, width

    def update(self, done: int, name: str) -> None:
        fill = self.width * done // self.total
        sys.stderr.write(f"\rschedule {done}/{self.total} "
                         f"[{'#' * fill}{'.' * (self.width - fill)}] {name}\x1b[K")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def main_bench(args) -> int:
    from .batching import StepPricer, continuous, static
    from .requests import latency_table, read_trace
    for flag in ("max_batch", "token_budget"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag.replace('_', '-')} {getattr(args, flag)}: give an int >= 1",
                  file=sys.stderr)
            return 2
    if not os.path.exists(args.requests) or os.path.isdir(args.requests):
        print(f"error: --requests {args.requests}: no such file; give a JSON-lines file, "
              'one {"arrival": s, "prompt": n, "output": n} a line', file=sys.stderr)
        return 2
    try:
        trace = read_trace(args.requests)
        pricer = StepPricer(args.preset, args.profile)
        bar = _Bar(2) if sys.stderr.isatty() else None
        results = []
        for name, run in (("continuous", lambda: continuous(
                trace, pricer, args.max_batch, args.token_budget)),
                ("static", lambda: static(trace, pricer, args.max_batch))):
            if bar is not None:
                bar.update(len(results), name)
            results.append(run())
        if bar is not None:
            bar.update(len(results), "done")
            bar.close()
    except (ValueError, TypeError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(trace)} requests, {args.preset} on {args.profile}")
    print(latency_table(results))
    return 0
