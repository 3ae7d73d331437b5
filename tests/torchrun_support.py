"""Running a torchrun job from a test, the same way in every test file."""
import hashlib
import json
import os
import subprocess
import sys

SEVERAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts", "several.py")

# A gloo worker thread that still holds finished async work when the interpreter tears
# down can abort the process ("terminate called without an active exception": the race
# pytorch/pytorch#179291 describes). It is rare (about 1 run in 8 of a 2-process job on a
# loaded 2-core machine, after every row was printed; about 1 in 3 with eight other jobs
# on the two cores; 1 in 6 for the 4-process wrappers_check job on an idle machine,
# every row printed); a job that ends that way is run again, at most eight times more
# (five aborts in a row of the 4-process job were seen once in a CI run under the
# suite's own load). Any other failure is reported at once.
TEARDOWN_ABORT = "terminate called without an active exception"


def run_job(cmd, **kwargs):
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``, rerun (at most
    eight times) while the job ends in the teardown abort above."""
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    for _ in range(8):
        if out.returncode == 0 or TEARDOWN_ABORT not in out.stderr:
            break
        out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    return out


def json_rows(text: str) -> list:
    """Every JSON object the processes printed: several processes share one pipe and
    torchrun runs them unbuffered (``python -u``: print writes the text and its newline
    apart), so two rows may land on one line."""
    dec, rows, i = json.JSONDecoder(), [], text.find("{")
    while i != -1:
        row, end = dec.raw_decode(text, i)
        rows.append(row)
        i = text.find("{", end)
    return rows


def run_several(n: int, parts: list[str], tmp_path_factory=None, **kwargs):
    """One torchrun launch of ``n`` processes running ``parts`` one after another
    (tests/dist_scripts/several.py: a part is a script with its arguments or ``-m module
    args``, one string); returns the finished job (:func:`run_job`) and, when it succeeded,
    each part's stdout (:func:`split_parts`).

    With ``tmp_path_factory`` (the fixture), the same launch (``n`` and ``parts``) runs
    once a test session, whichever modules' fixtures ask for it, on whichever
    pytest-xdist worker (xdist's load scheduling may hand one module's tests to both
    workers, each running the module's fixture): the first runs the job, under a file
    lock, and leaves its output for the others in the session's temporary root
    (pytest-xdist's documented recipe for a session's one-time work; filelock comes with
    torch)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", SEVERAL, *parts]
    if tmp_path_factory is None:
        out = run_job(cmd, **kwargs)
    else:
        from filelock import FileLock
        key = hashlib.sha256(json.dumps([n, parts]).encode()).hexdigest()[:16]
        root = tmp_path_factory.getbasetemp()          # the session's; under xdist a worker's
        if os.environ.get("PYTEST_XDIST_WORKER"):
            root = root.parent
        path = root / f"several-{key}.json"
        with FileLock(str(path) + ".lock"):
            if path.is_file():
                out = subprocess.CompletedProcess(cmd, **json.loads(path.read_text()))
            else:
                out = run_job(cmd, **kwargs)
                path.write_text(json.dumps({"returncode": out.returncode, "stdout": out.stdout,
                                            "stderr": out.stderr}))
    return out, (split_parts(out.stdout, len(parts)) if out.returncode == 0 else None)


# Scripts that share one launch a session (run_several), each test reading its own
# script's rows: the first script's timeout_s is the process group's (120 s in both).
# The rows of each script of TP_2X2 and of TWO_PROC were checked equal with the group run
# in its order and in the reverse order (task testspeed4).
# The 2 x 2 dp x tp checks over tp_optim_model.py, 4 processes:
TP_2X2 = ["tp_grad_2x2_check.py", "fixlist3_check.py", "review_revP_check.py",
          "habits4_clip_check.py", "habits13_check.py"]
# 2-process checks without arguments that init and shut down through wb.distributed
# (habits7_check and habits9_check call init_process_group / destroy_process_group
# themselves: they keep their own launches)
TWO_PROC = ["zero_grads_check.py", "wrappers_check.py", "replicas_check.py", "habits_check.py",
            "habits6_check.py", "cnn_check.py", "datadep_check.py", "generate_check.py",
            "engine_tp_check.py", "tp_styles_check.py"]


def shared(group: list[str], tmp_path_factory, script: str):
    """The session's one launch of every script in ``group`` (:data:`TP_2X2`, 4 processes,
    or :data:`TWO_PROC`, 2): the job and ``script``'s stdout ("" when the job failed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    n = 4 if group is TP_2X2 else 2
    out, texts = run_several(n, [os.path.join(root, "tests", "dist_scripts", s) for s in group],
                             tmp_path_factory, timeout=500, cwd=root,
                             env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root))
    return out, texts[group.index(script)] if texts else ""


def tp_2x2(tmp_path_factory, script: str):
    return shared(TP_2X2, tmp_path_factory, script)


def two_proc(tmp_path_factory, script: str):
    return shared(TWO_PROC, tmp_path_factory, script)


def split_parts(stdout: str, n: int) -> list[str]:
    """A launch of ``n`` parts' output cut at the markers: one text per part (each read with
    :func:`json_rows`); raises if a marker is missing."""
    out, start = [], 0
    for k in range(n):
        mark = json.dumps({"part_done": k})
        end = stdout.find(mark, start)
        if end == -1:
            raise ValueError(f"no {mark} in the output after part {k - 1}'s: the job "
                             f"ended in part {k}?\n{stdout[start:][-2000:]}")
        out.append(stdout[start:end])
        start = end + len(mark)
    return out
