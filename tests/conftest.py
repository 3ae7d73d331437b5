"""Shared test setup: one torch thread per test worker; every test's random draws seeded.

The suite runs two workers on two cores; with torch's default of one thread per core
each worker's kernels spin against the other's (tiny ops become ~1000x slower).

Determinism (the developers' guide: tests seed every random choice): each test starts
from the same seeds (torch, Python's ``random``, numpy's global generator), so a test's
data does not depend on which tests ran before it in its process (test order, xdist's
split); and hypothesis runs derandomized (examples drawn from a seed derived from the
test itself, not from the clock or the example database), so the same examples run on
every machine and every run.  A test that wants other data seeds its own generator.
"""
import random

import numpy as np
import pytest
import torch
from hypothesis import settings

# registered and loaded at import, before any test module builds its own ``settings(...)``
# (those inherit the profile loaded when they are created).  deadline=None: timings on a
# shared 2-core machine are not a property of the code; print_blob: a failure prints the
# @reproduce_failure blob that replays it.
settings.register_profile("workbench", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("workbench")


def _no_local_constants():
    """Hypothesis (6.131+) also draws "local constants": the numbers and strings in the
    source of every local module in ``sys.modules`` when an example is drawn.  Which
    modules are loaded depends on the tests that ran before (test files collected, lazy
    imports, xdist's split), so derandomized examples still changed with the order: the
    random-programs property test drew another program after ten other files and failed
    (sweep5).  An empty pool makes the examples a function of the test alone.  A private
    hook of hypothesis: skipped where a version has no such pool."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:                 # pragma: no cover - another hypothesis layout
        return
    if callable(getattr(providers, "_get_local_constants", None)) and \
            hasattr(providers, "Constants"):
        empty = providers.Constants()
        providers._get_local_constants = lambda: empty


_no_local_constants()

SEED = 0


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seeded():
    """The same seeds before every test (torch's CPU generator, ``random``, numpy)."""
    torch.manual_seed(SEED)
    random.seed(SEED)
    np.random.seed(SEED)
    yield


def pytest_configure(config):
    """Under pytest-xdist, before the workers start: pytest's assertion rewrite of the test
    modules given, cached where every worker reads it (tests/rewrite_cache.py), in two
    processes.  PYTHONDONTWRITEBYTECODE (this project's machines set it) keeps pytest from
    writing that cache itself, so each worker rewrote every module at collection: 15 s of
    CPU a worker for the whole suite (measured: `pytest --collect-only tests` 26.9 s ->
    12.3 s of CPU with the cache; writing it, 10.9 s in one process, 0.7 s once up to
    date).  Not in a worker, nor without -n, nor where pytest writes its cache itself."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None) \
            or not sys.dont_write_bytecode:
        return
    files = set()
    for arg in config.args:
        p = Path(config.invocation_params.dir, arg.split("::")[0])
        if not p.exists():                       # testpaths: relative to the rootdir
            p = Path(config.rootpath, arg.split("::")[0])
        if p.is_dir():
            files.update(p.rglob("test_*.py"))
            files.update(p.rglob("conftest.py"))
        elif p.suffix == ".py" and p.is_file():
            files.add(p)
    files = sorted(str(f) for f in files)
    if not files:
        return
    root = str(Path(__file__).resolve().parent.parent)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.rewrite_cache", *files[k::2]],
                              cwd=root, env=dict(os.environ, PYTHONPATH=root))
             for k in range(2)]
    for p in procs:
        p.wait()
