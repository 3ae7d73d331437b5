"""Where the test suite's time goes, in CPU seconds per test (a measurement, not a test).

On a shared machine a test's wall time (``pytest --durations``) says more about the load
than about the test (task speed15: 11.5 s of CPU took 164 s of wall at load 20 on 2
cores).  This pytest plugin records, per test, the CPU seconds of the worker process
(``getrusage(RUSAGE_SELF)``) and of the child processes it waited for
(``RUSAGE_CHILDREN``: torchrun jobs, notebook kernels once shut down, subprocesses), with
the wall time and which xdist worker ran it; the suite's wall on an idle 2-core machine is
about the sum over the two workers plus their start-up.

    SUITE_CPUTIME_DIR=/tmp/cpu PYTHONPATH=$PWD:$PWD/benchmarks OMP_NUM_THREADS=1 \\
        python -m pytest -p suite_cputime -q -p no:cacheprovider tests -n 2
    python benchmarks/suite_cputime.py /tmp/cpu [N]     # the N costliest tests and files

A shared torchrun launch (tests/torchrun_support.py ``shared``) is counted on the test
whose fixture ran it; a session-scoped kernel's CPU on the test during which it was reaped.
"""
import glob
import json
import os
import resource
import sys
import time
from collections import Counter

try:
    import pytest
except ImportError:                      # the report below needs no pytest
    pytest = None


def _cpu() -> tuple:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


if pytest is not None:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        out = os.environ.get("SUITE_CPUTIME_DIR")
        if not out:
            yield
            return
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        t0, (s0, c0) = time.time(), _cpu()
        yield
        t1, (s1, c1) = time.time(), _cpu()
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"cpu_{worker}.jsonl"), "a") as f:
            f.write(json.dumps({"id": item.nodeid, "w": worker, "t0": t0, "t1": t1,
                                "cpu": s1 - s0, "child": c1 - c0}) + "\n")


def report(directory: str, n: int = 20) -> str:
    rows = [json.loads(line) for f in sorted(glob.glob(os.path.join(directory, "cpu_*.jsonl")))
            for line in open(f)]
    if not rows:
        raise ValueError(f"no cpu_*.jsonl in {directory!r}: run pytest with -p suite_cputime "
                         "and SUITE_CPUTIME_DIR set to it")
    cost = lambda r: r["cpu"] + r["child"]              # noqa: E731
    total = sum(cost(r) for r in rows)
    lines = [f"{len(rows)} tests, {total:.0f} s of CPU (own + waited children)"]
    for th in (0.1, 1.0, 5.0):
        big = [cost(r) for r in rows if cost(r) >= th]
        lines.append(f"  tests of >= {th:g} s: {len(big)}, {sum(big):.0f} s "
                     f"({100 * sum(big) / total:.0f}%)")
    lines.append(f"the {n} costliest tests (CPU s: own + children; wall s; worker):")
    for r in sorted(rows, key=cost, reverse=True)[:n]:
        lines.append(f"  {cost(r):7.1f} ({r['cpu']:.1f} + {r['child']:.1f}) "
                     f"{r['t1'] - r['t0']:7.1f} {r['w']:>4} {r['id']}")
    files = Counter()
    for r in rows:
        files[r["id"].split("::")[0]] += cost(r)
    lines.append(f"the {n} costliest files:")
    lines += [f"  {c:7.1f} {f}" for f, c in files.most_common(n)]
    for w in sorted({r["w"] for r in rows}):
        mine = [r for r in rows if r["w"] == w]
        lines.append(f"worker {w}: {len(mine)} tests, {sum(cost(r) for r in mine):.0f} s of "
                     f"CPU, last ended {max(r['t1'] for r in mine) - min(r['t0'] for r in rows):.0f} s "
                     "after the first began")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20))
