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


def own_launch(script: str, nproc: int = 2, timeout: int = 240, tmp_path_factory=None) -> dict:
    """``tests/dist_scripts/<script>`` in its own torchrun job (``nproc`` processes,
    standalone), which must end well; its JSON rows keyed ``(rank, case)``.  With
    ``tmp_path_factory`` (the fixture) the job runs once a test session (:func:`run_once`):
    pytest-xdist's load scheduling may hand one module's tests to both workers, each
    running the module's fixture (test_dist10's 4-process job ran twice so: 10.9 + 10.7 s
    of CPU, task speed18)."""
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(root, "tests", "dist_scripts", script)]
    kwargs = dict(timeout=timeout, cwd=root,
                  env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root))
    if tmp_path_factory is None:
        out = run_job(cmd, **kwargs)
    else:
        out = run_once(cmd, tmp_path_factory, "own-launch", [script, nproc], **kwargs)
    assert out.returncode == 0, out.stderr[-3000:]
    return {(r["rank"], r["case"]): r for r in json_rows(out.stdout)}


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
        out = run_once(cmd, tmp_path_factory, "several", [n, parts], **kwargs)
    return out, (split_parts(out.stdout, len(parts)) if out.returncode == 0 else None)


def run_once(cmd, tmp_path_factory, name: str, key, **kwargs):
    """:func:`run_job` of ``cmd`` once a test session, whichever tests ask for it, on
    whichever pytest-xdist worker: the first runs the job, under a file lock, and leaves
    its output for the others in the session's temporary root (``name`` and the JSON of
    ``key`` name the file)."""
    from filelock import FileLock
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    root = tmp_path_factory.getbasetemp()          # the session's; under xdist a worker's
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / f"{name}-{digest}.json"
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return subprocess.CompletedProcess(cmd, **json.loads(path.read_text()))
        out = run_job(cmd, **kwargs)
        path.write_text(json.dumps({"returncode": out.returncode, "stdout": out.stdout,
                                    "stderr": out.stderr}))
    return out


# tests/dist_scripts/ddp_unused_check.py's cases: test_fixlist2's (fixlist2_check.py), then
# test_review_revI's (review_revI_check.py), both ending in os._exit, in one launch
DDP_UNUSED = (["A_unused_everywhere", "B_used_rank0", "C_zero_used_rank0", "D_stale_then_rank0",
               "E_zero_used_rank0_strict", "F_stale_strict"],
              ["dataclass_output", "unused_keeps_stale_grad", "loss_outside_output",
               "buckets_after_no_sync", "graph_changes_under_static_graph", "used_on_one_rank",
               "disttensor_used_on_one_rank", "disttensor_used_on_one_rank_bucket_bytes"])


def ddp_unused_rows(tmp_path_factory) -> dict:
    """The session's one launch of ddp_unused_check.py (2 processes, :data:`DDP_UNUSED`),
    which must end well: its JSON rows keyed ``(case, rank)``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    first, second = DDP_UNUSED
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(root, "tests", "dist_scripts", "ddp_unused_check.py"),
           *first, "--", *second]
    out = run_once(cmd, tmp_path_factory, "ddp-unused", DDP_UNUSED, timeout=240, cwd=root,
                   env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root))
    assert out.returncode == 0, out.stderr[-3000:]
    return {(r["case"], r["rank"]): r for r in json_rows(out.stdout)}


# Parts that share one launch a session (run_several), each test reading its own part's
# rows.  A part is a script of tests/dist_scripts with its arguments, or ``-m module args``;
# ``{dir}`` in a part is that part's own directory for the session (made empty before the
# launch; read it back with :func:`part_dir`).  The first part's timeout_s is the process
# group's (120 s: pipeline_clip_eval_check's, zero_grads_check's, tdreshard_check's).
# The rows of each script of TP_2X2 and of the first ten of TWO_PROC were checked equal
# with the group run in its order and in the reverse order (task testspeed4); every part
# task testspeed5 added, and the 2 x 2 checks behind pipeline_clip_eval_check, gave the
# same rows (but measured wall times, "ms") in the group as in a launch of its own.
# The 2 x 2 dp x tp checks over tp_optim_model.py, 4 processes:
TP_2X2 = ["tp_grad_2x2_check.py", "fixlist3_check.py", "review_revP_check.py",
          "habits4_clip_check.py", "habits13_check.py", "habits15_check.py",
          "zero1tp_check.py", "eager13_check.py"]
TRAIN = "-m workbench train --preset tiny --seed 0 --backend torch "
# Every 4-process part (tests that launched 4 processes each: test_pipeline_clip_eval_
# torchrun, test_distributed_engine, test_context_parallel_train, test_compile_dist,
# test_dropout_layouts, test_device_mesh_torchrun, test_moe_cli, test_ddp_torchrun,
# test_sp_norms_torchrun, test_ulysses4);
# pipeline_clip_eval_check first (its simulated step before any real mesh), then the 2 x 2
# checks:
FOUR_PROC = ["pipeline_clip_eval_check.py {dir}"] + TP_2X2 + [
    TRAIN + "--steps 3 --dp 2 --tp 2 --sp", TRAIN + "--steps 3 --dp 4 --zero 3",
    TRAIN + "--steps 3 --tp 2 --pp 2 --schedule zb-h1", "interop_check.py",
    "-m workbench train --preset tiny --seed 0 --steps 2 --backend torch --cp 2 --tp 2",
    "-m workbench train --preset gpt-tiny --seed 0 --steps 2 --backend torch --cp 2 --dp 2",
    "compile_check.py", "dropout_check.py", "device_mesh_slice_check.py",
    "-m workbench train --preset tiny --steps 2 --moe-experts 4 --moe-topk 2 --seed 0 "
    "--backend torch --ep 2 --tp 2",
    "-m workbench train --preset tiny --seed 0 --steps 2 --backend torch --cp 2 --tp 2 "
    "--cp-comm a2a",
    "-m workbench train --preset tiny --seed 0 --steps 2 --backend torch --cp 2 --tp 2 --sp "
    "--cp-comm a2a",
    "wrappers_check.py", "sp_norms_check.py {dir}/torchrun.pt", "fixlist14_check.py",
    "tdway17_check.py", "uneven18_check.py"]
# (wrappers_check not last: its 4-process job ended in TEARDOWN_ABORT about 1 in 6, and a
# job that ends so is run again whole)
# The 8-process parts (test_tdreshard's programs and test_distributed_engine's dp 2 x tp 2
# x pp 2 run):
EIGHT_PROC = ["tdreshard_check.py {dir}",
              TRAIN + "--steps 3 --dp 2 --tp 2 --pp 2 --sp"]
# 2-process checks that init and shut down through wb.distributed (or init only when
# torch.distributed is not up and end with backends.shutdown: habits7/9/11/12_check)
TWO_PROC = ["zero_grads_check.py", "wrappers_check.py", "replicas_check.py", "habits_check.py",
            "habits6_check.py", "cnn_check.py", "datadep_check.py", "generate_check.py",
            "engine_tp_check.py", "tp_styles_check.py",
            # (task testspeed5: each of these had its own launch)
            "ddp_buckets_check.py", "fixlist11_check.py", "fixlist9_check.py",
            "fsdp_reduce_dtype_check.py", "fully_shard_check.py", "checkpoint_check.py {dir}",
            "resume_check.py {dir}", "state_dict_helpers_check.py {dir}",
            "audit_run_check.py {dir}/ck", "tp_optim_state_check.py {dir}",
            "habits7_check.py", "habits9_check.py", "habits11_check.py", "habits12_check.py",
            "-m workbench.tools.activation_check",
            "-m workbench train --preset tiny --seed 0 --steps 2 --recompute full "
            "--backend torch --cp 2",
            "-m workbench train --backend torch --preset tiny --seed 0 --steps 1 --pp 2",
            "-m workbench train --backend torch --preset tiny --seed 0 --steps 2 --dp 2 --zero 3",
            "-m workbench train --backend torch --preset tiny --seed 0 --steps 2 --dp 2 --zero 2",
            "pipeline_clip_eval_check.py {dir}", "optim8_check.py", "loss8_check.py",
            "sweep17_extreme_check.py", "fsdpdata17_check.py", "fsdpdata18_check.py",
            "sweep18_check.py"]
# (fixlist2_check and review_revI_check end in os._exit: they keep their own launches,
# as test_distributed_engine's wrong process count and test_dist_faults' faults do)
# 2-process checks of a read one process makes alone, which waits init()'s timeout_s=5
# (TWO_PROC's first part sets 60 s for its launch): the first part's init sets it for
# both, the second's init finds the group up (each had its own launch before: task speed17)
LONE_READS = ["readsync_check.py", "fixlist16_check.py"]


def part_dir(group: list[str], tmp_path_factory, part: str):
    """The directory ``{dir}`` names in ``part`` of ``group`` for this session (the same on
    every pytest-xdist worker)."""
    root = tmp_path_factory.getbasetemp()          # the session's; under xdist a worker's
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    key = hashlib.sha256(json.dumps(group).encode()).hexdigest()[:16]
    return root / f"several-{key}-dirs" / f"part{group.index(part)}"


def shared(group: list[str], tmp_path_factory, part: str):
    """The session's one launch of every part of ``group`` (:data:`FOUR_PROC`, 4 processes,
    :data:`TWO_PROC`, 2, :data:`EIGHT_PROC`, 8, or :data:`LONE_READS`, 2): the job and
    ``part``'s stdout ("" when the job failed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    n = {id(FOUR_PROC): 4, id(TWO_PROC): 2, id(EIGHT_PROC): 8, id(LONE_READS): 2}.get(id(group))
    if n is None:
        raise ValueError("shared: give torchrun_support.FOUR_PROC, TWO_PROC, EIGHT_PROC or "
                         "LONE_READS as group")
    if part not in group:
        raise ValueError(f"shared: part {part!r} is not in the group; add it to the group's "
                         "list in tests/torchrun_support.py (spelled the same)")
    k = group.index(part)
    parts = []
    for p in group:
        if "{dir}" in p:
            d = part_dir(group, tmp_path_factory, p)
            d.mkdir(parents=True, exist_ok=True)
            p = p.replace("{dir}", str(d))
        if not p.startswith("-m "):
            p = os.path.join(root, "tests", "dist_scripts", p)
        parts.append(p)
    # 500 s: under run_all's pytest --timeout 600 (the longest group, TWO_PROC, took 99 s
    # of wall on 2 cores at load 14: task testspeed5)
    out, texts = run_several(n, parts, tmp_path_factory, timeout=500, cwd=root,
                             env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root))
    return out, texts[k] if texts else ""


def tp_2x2(tmp_path_factory, script: str):
    return shared(FOUR_PROC, tmp_path_factory, script)


def four_proc(tmp_path_factory, part: str):
    return shared(FOUR_PROC, tmp_path_factory, part)


def two_proc(tmp_path_factory, part: str):
    return shared(TWO_PROC, tmp_path_factory, part)


def eight_proc(tmp_path_factory, part: str):
    return shared(EIGHT_PROC, tmp_path_factory, part)


def lone_reads(tmp_path_factory, part: str) -> dict:
    """``part``'s JSON rows keyed ``(rank, case)``, from the session's one launch of
    :data:`LONE_READS`, which must end well (as :func:`own_launch`'s)."""
    out, text = shared(LONE_READS, tmp_path_factory, part)
    assert out.returncode == 0, out.stderr[-3000:]
    return {(r["rank"], r["case"]): r for r in json_rows(text)}


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
