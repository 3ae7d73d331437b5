"""Student versions: solutions stripped (nbgrader's markers and stubs), and each
generated notebook runs up to its first exercise, where it stops with the
NotImplementedError of the stub and nowhere before."""
import importlib.util
import os
from pathlib import Path

import pytest

from workbench.exercises.student import (BEGIN, END, make_student_versions, strip_solutions,
                                         student_notebook)

nbformat = pytest.importorskip("nbformat")
ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


# ---- the transformation ---------------------------------------------------------------------

def test_strip_keeps_code_around_and_indentation():
    src = "x = 1\n### BEGIN SOLUTION\ny = 2\n### END SOLUTION\ncheck(y)"
    assert strip_solutions(src) == (
        "x = 1\n# YOUR CODE HERE\nraise NotImplementedError()\ncheck(y)", 1)
    src = "def f(a):\n    ### BEGIN SOLUTION\n    return a\n    ### END SOLUTION\n"
    out, n = strip_solutions(src)
    assert n == 1 and out == "def f(a):\n    # YOUR CODE HERE\n    raise NotImplementedError()\n"


def test_strip_several_regions_and_none():
    src = f"{BEGIN}\na\n{END}\nb\n{BEGIN}\nc\n{END}"
    out, n = strip_solutions(src)
    assert n == 2 and out.count("raise NotImplementedError()") == 2 and "\nb\n" in out
    assert strip_solutions("print(1)") == ("print(1)", 0)


@pytest.mark.parametrize("src, match", [
    (f"{BEGIN}\nx", "never closed"),
    (f"x\n{END}", "line 2.*without"),
    (f"{BEGIN}\n{BEGIN}\n{END}", "line 2.*inside a solution region"),
])
def test_strip_rejects_unbalanced_markers(src, match):
    with pytest.raises(ValueError, match=match):
        strip_solutions(src, where="nb.ipynb, cell 3")


def test_student_notebook_clears_outputs_and_markdown_answers():
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output
    nb = new_notebook(cells=[
        new_markdown_cell(f"Why?\n{BEGIN}\nBecause.\n{END}"),
        new_code_cell(f"{BEGIN}\nx = 1\n{END}\nprint(x)", execution_count=3,
                      outputs=[new_output("stream", name="stdout", text="1\n")]),
    ])
    out = student_notebook(nb)
    assert out.cells[0].source == "Why?\nYOUR ANSWER HERE"
    assert out.cells[1].source == "# YOUR CODE HERE\nraise NotImplementedError()\nprint(x)"
    assert out.cells[1].outputs == [] and out.cells[1].execution_count is None
    assert nb.cells[1].outputs            # the instructor notebook is untouched


def test_make_student_versions_refuses_to_overwrite_the_source(tmp_path):
    with pytest.raises(ValueError, match="overwritten"):
        make_student_versions(ROOT / "notebooks", ROOT / "notebooks")
    with pytest.raises(ValueError, match="no notebooks match"):
        make_student_versions(tmp_path, tmp_path / "out")


# ---- the course's notebooks -------------------------------------------------------------------

@pytest.fixture(scope="session")
def student_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    written = make_student_versions(ROOT / "notebooks", out)
    assert [p.name for p in written] == [p.name for p in NOTEBOOKS]
    return out


def test_course_has_notebooks():
    assert len(NOTEBOOKS) >= 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_exercise_has_a_solution_and_a_locked_check(path):
    """nbgrader's conventions: each answer cell is a solution cell, followed by a locked,
    graded test cell calling its check; grade ids unique."""
    nb = nbformat.read(path, as_version=4)
    cells = nb.cells
    solved = [i for i, c in enumerate(cells) if c.cell_type == "code" and BEGIN in c.source]
    assert 2 <= len(solved) <= 4, f"{path.name}: {len(solved)} exercises"
    ids = [c.metadata["nbgrader"]["grade_id"] for c in cells if "nbgrader" in c.metadata]
    assert len(ids) == len(set(ids)), ids
    for i in solved:
        meta = cells[i].metadata.get("nbgrader", {})
        assert meta.get("solution") is True and meta.get("grade") is False, cells[i].source
        assert "exercises.check_" not in cells[i].source
        test = cells[i + 1]
        tmeta = test.metadata.get("nbgrader", {})
        assert "wb.exercises.check_" in test.source and BEGIN not in test.source
        assert tmeta.get("grade") is True and tmeta.get("locked") is True and \
            tmeta.get("points", 0) > 0 and tmeta.get("solution") is False, test.metadata
    checks = [c for c in cells if c.cell_type == "code" and "exercises.check_" in c.source
              and "raises-exception" not in c.metadata.get("tags", [])]
    assert all(c.metadata.get("nbgrader", {}).get("grade") for c in checks)


@pytest.fixture(scope="module")
def nbgrader_release(tmp_path_factory):
    """The course run through nbgrader's own ``generate_assignment`` (no database)."""
    import shutil
    import subprocess
    import sys
    if importlib.util.find_spec("nbgrader") is None:
        pytest.skip("nbgrader is not installed (pip install -r requirements.txt adds it): "
                    "the nbgrader conventions are checked above, generate_assignment is not run")
    root = tmp_path_factory.mktemp("course")
    (root / "source" / "course").mkdir(parents=True)
    for p in NOTEBOOKS:
        shutil.copy(p, root / "source" / "course" / p.name)
    run = subprocess.run([sys.executable, "-m", "nbgrader", "generate_assignment", "course",
                          "--no-db", "--force", f"--CourseDirectory.root={root}"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return root / "release" / "course"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_nbgrader_generate_assignment_agrees(nbgrader_release, student_dir, path):
    """nbgrader's release of a notebook and ours have the same code, stubs where the
    solutions were, and the check cells locked."""
    theirs = nbformat.read(nbgrader_release / path.name, as_version=4)
    ours = nbformat.read(student_dir / path.name, as_version=4)
    code = lambda nb: [c.source.strip() for c in nb.cells if c.cell_type == "code"]  # noqa: E731
    assert code(theirs) == code(ours)
    locked = [c for c in theirs.cells if c.metadata.get("nbgrader", {}).get("locked")]
    assert locked and all("exercises.check_" in c.source for c in locked
                          if c.cell_type == "code")
    assert sum("raise NotImplementedError()" in s for s in code(theirs)) >= 2


# Smaller inputs for the longest cells before a first exercise (the same code runs, on
# fewer steps / sweep points): this test checks that the student version runs up to its
# stub, not the cells' numbers, which nbval checks on the full inputs (tests/run_all.py).
# Each text must occur exactly once before the first exercise, so a notebook edit that
# moves it fails here instead of silently running the full input.
SMALLER = {
    "05_data_parallel_and_zero.ipynb": [
        ("sweep = [2**k for k in range(12, 24, 2)] + [8 * N]",   # 7 bucket sizes x 2 profiles
         "sweep = [2**k for k in range(12, 14, 2)] + [8 * N]")],
    "15_train_to_serve.ipynb": [
        ('records = train("tiny", steps=150, seed=0,',           # 150 training steps
         'records = train("tiny", steps=3, seed=0,')],
    # torchrun jobs on one process instead of two (the same module or file, launched the
    # same way; a process's start-up, ~3 s of CPU, is most of such a job): the 2-process
    # numbers are nbval's (the instructor notebook's outputs) and, for activation_check,
    # tests/test_distributed_engine.py's (TWO_PROC's launch)
    "06_tensor_and_sequence_parallel.ipynb": [
        ('"--nproc-per-node=2", "-m", "workbench.tools.activation_check"]',
         '"--nproc-per-node=1", "-m", "workbench.tools.activation_check"]')],
    "13_your_own_model.ipynb": [
        ('"--standalone", "--nproc-per-node=2",\n       str(script)]',
         '"--standalone", "--nproc-per-node=1",\n       str(script)]')],
}


def _smaller(nb, name, cells):
    for old, new in SMALLER.get(name, []):
        hits = [i for i in cells if old in nb.cells[i].source]
        assert len(hits) == 1 and nb.cells[hits[0]].source.count(old) == 1, (
            f"{name}: {old!r} is not in exactly one cell before the first exercise "
            f"(cells {hits}); update SMALLER in {__file__}")
        nb.cells[hits[0]].source = nb.cells[hits[0]].source.replace(old, new)


# Each notebook's own kernel spent most of this test's time starting up (the kernel, then
# ``import torch`` and the workbench in the first cell: 2 to 5 s a notebook, 18 notebooks);
# one kernel per test process runs them one after another instead, its user namespace
# reset (IPython's ``%reset -f``: every name a notebook defined or imported is gone) and
# its working directory set back before each, so that a name a notebook uses without
# defining it still fails.  What stays is the process: the modules imported and their
# state (torch's global RNG among them); this test checks that the cells run, not their
# numbers, which nbval checks with a fresh kernel per notebook (tests/run_all.py).
RESET = "import os as _os\n_os.chdir({dir!r})\n%reset -f"


@pytest.fixture(scope="session")
def kernel(student_dir):
    """One Jupyter kernel for the notebooks this test process runs (its manager), started
    in ``student_dir`` with this checkout's workbench first on PYTHONPATH; session-scoped,
    as ``student_dir``: pytest-xdist may hand this module's tests to a worker between
    other modules' (a module-scoped kernel would start again each time)."""
    nbclient = pytest.importorskip("nbclient")
    from nbclient.util import run_sync
    from nbformat.v4 import new_notebook

    import workbench
    # the kernel starts in student_dir: a relative PYTHONPATH entry (PYTHONPATH=. from a
    # checkout) would resolve there, and the kernel would import another workbench (an
    # installed one) than the one under test
    mine = str(Path(workbench.__file__).resolve().parent.parent)
    entries = [str(Path(e).resolve()) for e in os.environ.get("PYTHONPATH", "").split(os.pathsep)
               if e]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([mine] + entries))
        client = nbclient.NotebookClient(new_notebook(), kernel_name="python3",
                                         resources={"metadata": {"path": str(student_dir)}})
        km = client.create_kernel_manager()
        client.km = km
        client.start_new_kernel()
    try:
        with client.setup_kernel(cleanup_kc=False):       # the kernel stays up
            try:
                fresh = _names(client)              # what a fresh kernel's namespace holds
            finally:
                client.kc.stop_channels()
        yield km, fresh
    finally:
        run_sync(km.shutdown_kernel)(now=True)     # an async manager: its methods are coroutines


def _names(client) -> str:
    """The user namespace's public names in ``client``'s kernel, as printed there."""
    from nbformat.v4 import new_code_cell
    cell = new_code_cell("print(sorted(k for k in globals() if not k.startswith('_')))")
    client.nb.cells.append(cell)                      # nbclient writes into its notebook
    client.execute_cell(cell, len(client.nb.cells) - 1)
    return "".join(o.get("text", "") for o in cell.outputs).strip()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_student_version_runs_up_to_its_first_exercise(student_dir, path, kernel):
    """Every cell before the first exercise runs; the first exercise cell stops with
    the stub's NotImplementedError."""
    nbclient = pytest.importorskip("nbclient")
    from nbclient.exceptions import CellExecutionError
    from nbclient.util import run_sync
    from nbformat.v4 import new_code_cell

    import workbench
    nb = nbformat.read(student_dir / path.name, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    assert not [ln for i in code for ln in nb.cells[i].source.splitlines()
                if ln.strip() in (BEGIN, END)]
    stubs = [i for i in code if "# YOUR CODE HERE" in nb.cells[i].source]
    assert stubs, f"{path.name} has no exercise (no {BEGIN!r} region in a code cell)"
    first = stubs[0]
    _smaller(nb, path.name, [i for i in code if i < first])
    kernel, fresh = kernel
    client = nbclient.NotebookClient(nb, km=kernel, timeout=120,
                                     resources={"metadata": {"path": str(student_dir)}})
    failed = None
    with client.setup_kernel():
        try:
            reset = new_code_cell(RESET.format(dir=str(student_dir)))
            nb.cells.append(reset)
            client.execute_cell(reset, len(nb.cells) - 1)
            assert _names(client) == fresh           # the last notebook's names are gone
            for i in code:
                try:
                    client.execute_cell(nb.cells[i], i)
                except CellExecutionError as err:
                    failed = (i, err.ename, str(err).splitlines()[-1] if str(err) else "")
                    break
            which = new_code_cell("import workbench; print(workbench.__file__)")
            nb.cells.append(which)
            client.execute_cell(which, len(nb.cells) - 1)
        except BaseException:
            # a cell left running: the next notebook gets a fresh kernel
            run_sync(kernel.restart_kernel)(now=True)
            raise
        finally:
            client.kc.stop_channels()
    ran = "".join(o.get("text", "") for o in which.outputs).strip()
    assert Path(ran).resolve() == Path(workbench.__file__).resolve(), (
        f"the kernel ran {ran}, not the workbench under test {workbench.__file__}")
    assert failed is not None and failed[:2] == (first, "NotImplementedError"), (
        f"{path.name}: expected the first failure in cell {first} (the first exercise) to be "
        f"NotImplementedError, got {failed}")


# ---- make course: a working copy, as root too --------------------------------------------------

def test_work_copy_never_overwrites(tmp_path):
    from workbench.exercises.student import make_work_copy
    out = tmp_path / "work"
    first = make_work_copy(ROOT / "notebooks", out)
    assert [p.name for p, new in first] == [p.name for p in NOTEBOOKS] and all(n for _, n in first)
    mine = out / NOTEBOOKS[0].name
    mine.write_text("my edited notebook")
    again = make_work_copy(ROOT / "notebooks", out)
    assert not any(new for _, new in again) and mine.read_text() == "my edited notebook"
    with pytest.raises(ValueError, match="autosave would write"):
        make_work_copy(ROOT / "notebooks", ROOT / "notebooks")


def test_make_course_opens_the_working_copy(tmp_path):
    """`make course` (dry run): JupyterLab opens the copy, never notebooks/, and gets
    --allow-root exactly when run as root."""
    import os
    import shutil
    import subprocess
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    stamp = tmp_path / "stamp"
    stamp.write_text("")
    run = subprocess.run(["make", "-n", "course", f"STAMP={stamp}", "WORK=mywork"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "course workcopy --notebooks notebooks --out mywork" in run.stdout
    assert "--notebook-dir=mywork" in run.stdout and "--notebook-dir=notebooks" not in run.stdout
    assert ("--allow-root" in run.stdout) == (os.getuid() == 0)
