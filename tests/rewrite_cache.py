"""pytest's assertion rewrite of the test modules, done once and cached where pytest reads it.

pytest rewrites every test module's ``assert`` statements (parse, rewrite, compile) when it
imports it, and caches the result in ``__pycache__`` -- unless ``sys.dont_write_bytecode``
is set, as PYTHONDONTWRITEBYTECODE sets it on this project's machines: then each pytest
process, each pytest-xdist worker among them, rewrites all of them again on every run.
pytest still READS a cached rewrite where one exists (``AssertionRewritingHook.exec_module``:
"even if we're in a read-only directory, I'm going to check for a cached pyc"), checked
against the source's hash (a PEP 552 checked-hash pyc: an edited file is rewritten again).

``python -m tests.rewrite_cache FILE...`` writes that cache for the files given, with
pytest's own functions (``_rewrite_test``, ``_write_pyc``: private, so any failure only
prints a note and leaves the workers to rewrite as before; the cache is an optimization,
never a result). tests/conftest.py runs it in two processes under pytest-xdist, before
the workers start (``make test`` runs pytest so: tests/run_all.py).
"""
import sys
from pathlib import Path


def main(files: list[str]) -> int:
    try:
        from _pytest.assertion import rewrite as R
    except ImportError as e:                       # pragma: no cover - another pytest
        print(f"rewrite_cache: not written ({e}); pytest rewrites as it imports", flush=True)
        return 0

    class _State:                                  # _write_pyc reports errors to trace only
        @staticmethod
        def trace(msg):
            pass

    done = 0
    for f in files:
        fn = Path(f).resolve()
        try:
            pyc = R.get_cache_dir(fn) / (fn.name[:-3] + R.PYC_TAIL)
            if R._read_pyc(fn, pyc) is not None:    # up to date already
                continue
            # config None: no assertion-pass hook, as pyproject.toml's pytest options
            source_hash, co = R._rewrite_test(fn, None)
            R.try_makedirs(pyc.parent)
            done += R._write_pyc(_State, co, source_hash, pyc)
        except Exception as e:  # noqa: BLE001 - a cache: pytest rewrites what is missing
            print(f"rewrite_cache: {f} not cached ({type(e).__name__}: {e})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
