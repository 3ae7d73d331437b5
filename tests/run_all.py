"""The whole test suite in one command (`make test`): library tests, then the notebooks.

pytest's exit code 5 (no tests collected) is a failure here, never a silent pass.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args: list[str]) -> int:
    print("+", " ".join(args), flush=True)
    return subprocess.call(args, cwd=ROOT)


def main() -> int:
    # 2 cores shared by 2 test workers: one thread each (torch's default of one thread
    # per core makes every worker spin against the other)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    py = sys.executable
    # every torchrun worker, subprocess and notebook kernel imports workbench; where
    # PYTHONDONTWRITEBYTECODE is set (this project's machines set it) each recompiled it
    # from source, 0.35 s of CPU a process (measured: 1.82 s -> 1.47 s for `import
    # workbench, workbench.plan, workbench.recipes`); compiling once first (0.6 s) lets
    # them read the bytecode, which that variable does not forbid
    steps = [[py, "-m", "compileall", "-q", "workbench"],
             [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", "-n", "2",
              "--timeout", "600"]]
    nbs = sorted(os.path.join("notebooks", f) for f in os.listdir(os.path.join(ROOT, "notebooks"))
                 if f.endswith(".ipynb")) if os.path.isdir(os.path.join(ROOT, "notebooks")) else []
    if nbs:
        steps.append([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                      "--nbval-current-env", "--nbval-sanitize-with", "notebooks/sanitize.cfg",
                      "-n", "2", "--dist", "loadfile", *nbs])
    for s in steps:
        rc = run(s)
        if rc != 0:
            print(f"FAILED (exit code {rc}{', no tests collected' if rc == 5 else ''})", flush=True)
            return rc or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
