"""Browser review nb18 (notebooks 01, 11, 12 as a student): the precision an exercise asks
for is the one its check accepts; a check run before its exercise is answered says so
instead of a bare NameError, and never grades a value the notebook computed earlier; a log
x axis puts its labels under the points; a widget's live line is not printed again as a
static one."""
import ast
import json
import linecache
from pathlib import Path

import pytest

import workbench.exercises.checks as C
from workbench.exercises import reset_tries
from workbench.exercises.feedback import CheckError, _check_arguments, unanswered_name
from workbench.exercises.student import BEGIN, strip_solutions

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _cells(path):
    return json.loads(Path(path).read_text())["cells"]


def _source(cell) -> str:
    return "".join(cell["source"])


def _message(check, value) -> str:
    reset_tries()
    with pytest.raises(CheckError) as err:
        check(value)
    return str(err.value)


def _passes(check, value, capsys) -> str:
    reset_tries()
    check(value)
    return capsys.readouterr().out


# ---- 01, 11: each exercise's precision, in its prompt and in its check-------------------------

def _prompt(check_name: str, notebook: str = "01_why_distribute") -> str:
    """The markdown cell that states the exercise whose check cell calls ``check_name``."""
    cells = _cells(ROOT / "notebooks" / f"{notebook}.ipynb")
    i = next(i for i, c in enumerate(cells) if f"check_{check_name}(" in _source(c))
    return _source(cells[i - 2])


@pytest.mark.parametrize("notebook, check_name, phrase, step", [
    ("01_why_distribute", "training_days", "(to 0.1 day)", C.DAYS_STEP),
    ("01_why_distribute", "zero2_memory_gb", "Give it to 0.01 GB.", C.GB_STEP),
    ("01_why_distribute", "allreduce_seconds", "(to 0.01 s)", C.SECONDS_STEP),
    ("11_memory_and_recompute", "zero_states_gb", "(to 0.01 GB)", C.GB_STEP),
])
def test_prompts_say_the_precision_the_checks_hold(notebook, check_name, phrase, step):
    text = _prompt(check_name, notebook)
    assert phrase in text, text
    assert f"{step:g}" in phrase


def test_11_exercise1_to_the_hundredth(capsys):
    """21.6 passed for 21.5625 and 21 read "you left out the 16-bit gradients" (20.625 lies
    1.8% from 21)."""
    from workbench.exercises import checks_plan as P
    for ok in (21.5625, 21.56):
        assert "Correct" in _passes(P.check_zero_states_gb, ok, capsys)
    for rounded in (21, 21.6, 21.5, 22):
        msg = _message(P.check_zero_states_gb, rounded)
        assert "rounded too far" in msg and "gradients" not in msg, msg
    assert "not the nearest 0.01 GB" in _message(P.check_zero_states_gb, 21.57)
    assert "left out the 16-bit gradients" in _message(P.check_zero_states_gb, 20.625)


def test_01_exercise2_accepts_026_25_only_to_the_hundredth(capsys):
    """26 passed for 26.25 (the 1% tolerance); the prompt asks for 0.01 GB."""
    want = (2 * 7e9 + 14 * 7e9 / 8) / 1e9
    assert want == 26.25
    for ok in (want, 26.25 + 1e-12, 26.254, 26.246):
        assert "Correct" in _passes(C.check_zero2_memory_gb, ok, capsys)
    for rounded in (26, 26.2, 26.3, 27, 30):
        msg = _message(C.check_zero2_memory_gb, rounded)
        assert "rounded too far" in msg and "0.01 GB" in msg, msg
        assert "26.25" not in msg                         # a hint, not the answer
    # a wrong answer near it is not called a rounding
    msg = _message(C.check_zero2_memory_gb, 26.1)
    assert "rounded" not in msg and "too low" in msg


def test_01_exercises_1_and_3_name_rounding_instead_of_the_formula(capsys):
    days = 6 * 7e9 * 2e12 / (1024 * C.get_profile("ascend-910b").peak("bfloat16") * 0.4) / 86400
    for ok in (days, 7.58, 7.6):
        assert "Correct" in _passes(C.check_training_days, ok, capsys)
    for rounded in (8, 7, 10):
        msg = _message(C.check_training_days, rounded)
        assert "rounded too far" in msg and "0.1 days" in msg and "compare each factor" not in msg
    assert "not the nearest" in _message(C.check_training_days, 7.5)
    # the A100-peak slip (7.608, 0.3% off) stays named, not read as a rounding
    assert "A100" in _message(C.check_training_days, days * 313e12 / 312e12)

    seconds = 2 * 7 * 3e-6 + 2 * 7 / 8 * 14e9 / 28e9
    for ok in (seconds, 0.88, 0.875):
        assert "Correct" in _passes(C.check_allreduce_seconds, ok, capsys)
    assert "not the nearest" in _message(C.check_allreduce_seconds, 0.87)   # 1% passed it
    for rounded in (0.9, 1, 0.8):
        assert "rounded too far" in _message(C.check_allreduce_seconds, rounded)
    assert "p = 7" in _message(C.check_allreduce_seconds, 2 * 6 * 3e-6 + 2 * 6 / 7 * 14e9 / 28e9)


def test_rounded_too_far_never_lists_an_accepted_value():
    for want, step in ((26.25, 0.01), (7.583, 0.1), (0.875042, 0.01), (1e-3, 1e-4)):
        for value, _, tol in C._rounded_too_far(want, step, "u"):
            assert abs(value - want) > step / 2 and value != 0 and tol == 1e-9


# ---- a check run before its exercise is answered --------------------------------------------

def _run_as_cell(source: str, name: str):
    """Run ``source`` as IPython runs a cell: compiled under a file name linecache keeps
    (IPython's cells stay there for the session, as these do)."""
    filename = f"<nb18 cell {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        exec(compile(source, filename, "exec"), {"wb": _WB})
    except NameError as err:
        return err
    raise AssertionError("no NameError")


class _WB:                                 # stands for `import workbench as wb` in a cell
    class exercises:
        @staticmethod
        def check_zero2_memory_gb(gb):
            return gb

        @staticmethod
        def helper():
            return undefined_inside_a_function  # noqa: F821


def test_unanswered_name_says_answer_the_exercise_first():
    err = _run_as_cell("wb.exercises.check_zero2_memory_gb(gb)\n", "a")
    text = unanswered_name(err)
    assert text.startswith("gb is not defined yet: answer the exercise above first")
    assert "raise NotImplementedError()" in text and "sets gb" in text
    # a keyword argument, a second line, an expression around the name
    err = _run_as_cell("x = 1\nwb.exercises.check_zero2_memory_gb(gb=round(my_gb, 2))\n", "b")
    assert "my_gb is not defined yet" in unanswered_name(err)


def test_other_name_errors_keep_their_traceback():
    assert unanswered_name(_run_as_cell("y = typo + 1\n", "c")) is None
    # raised inside a function the cell called: not the cell's own line
    assert unanswered_name(_run_as_cell("wb.exercises.helper()\n", "d")) is None
    # a name the cell uses but does not pass to a check
    assert unanswered_name(_run_as_cell("z = q\nwb.exercises.check_zero2_memory_gb(1)\n",
                                        "e")) is None
    assert unanswered_name(ValueError("x")) is None
    assert _check_arguments("wb.exercises.check_x(a, b=c + d)\n") == {"a", "c", "d"}
    assert _check_arguments("not python (") == set()


def _stores(source: str) -> set:
    source = "\n".join(ln for ln in source.split("\n") if not ln.lstrip().startswith(("%", "!")))
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_an_unanswered_check_never_grades_an_earlier_value(path):
    """In the student version, each check cell reads at least one name that only its
    exercise's answer sets: run before the answer, it stops (NameError, told to answer
    first) instead of grading a value an earlier cell computed.  06's exercise 3 read `b`,
    set to 1 by an earlier cell, and 1 is its answer: "Correct" with no answer written."""
    cells = _cells(path)
    earlier = set()
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        src = _source(cell)
        if BEGIN in src:
            answer = _stores(src) - _stores(strip_solutions(src)[0])
            check = _source(cells[i + 1])
            read = _check_arguments(check)
            assert read, f"{path.name} cell {i + 1}: no check call found"
            assert read & answer, (f"{path.name} cell {i + 1} reads {sorted(read)}, none of "
                                   f"them set only by the answer in cell {i}")
            assert read & answer - earlier, (
                f"{path.name} cell {i + 1}: every name it reads that the answer sets "
                f"({sorted(read & answer)}) is already set before the exercise: an "
                "unanswered check grades that earlier value; name the answer apart")
        earlier |= _stores(strip_solutions(src)[0])


def test_the_handler_in_a_kernel(tmp_path):
    """A real kernel: the check cell after a stub fails with NameError whose shown text is
    the hint; another NameError keeps IPython's traceback."""
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("nbformat")
    import os

    from nbformat.v4 import new_code_cell, new_notebook
    nb = new_notebook(cells=[
        new_code_cell("import workbench as wb"),
        new_code_cell("# YOUR CODE HERE\nraise NotImplementedError()"),
        new_code_cell("wb.exercises.check_zero2_memory_gb(gb)"),
        new_code_cell("typo_name + 1"),
        new_code_cell("gb = 26.25\nwb.exercises.check_zero2_memory_gb(gb)"),
    ])
    env_path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", env_path)
        mp.setenv("OMP_NUM_THREADS", "1")
        nbclient.NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    err = lambda k: [o for o in nb.cells[k].outputs if o.output_type == "error"]  # noqa: E731
    assert err(1)[0].ename == "NotImplementedError"
    (hint,) = err(2)
    assert hint.ename == "NameError"
    shown = "\n".join(hint.traceback)
    assert "Not yet:" in shown and "answer the exercise above first" in shown
    assert "Traceback" not in shown and "Cell In[" not in shown
    assert any("raise NotImplementedError()" in line for line in shown.splitlines()), shown
    assert "\u00a0" not in shown                              # printed as a plain space
    (other,) = err(3)
    assert other.ename == "NameError" and "answer the exercise" not in "\n".join(other.traceback)
    assert "typo_name" in "\n".join(other.traceback)
    assert not err(4) and "Correct: memory = 26.25 GB" in nb.cells[4].outputs[0].text


# ---- figures and widgets ------------------------------------------------------------------

def test_log_x_ticks_sit_on_the_points():
    """12's add sweep, 2^10 ... 2^28 every other octave: the locator ticked the odd octaves,
    between the points."""
    from workbench.viz.charts import lines
    x = [2 ** e for e in range(10, 29, 2)]
    fig = lines(x, {"a": [float(i + 1) for i in range(len(x))]}, logx=True, logy=True)
    axis = fig.axes[0].xaxis
    assert list(axis.get_majorticklocs()) == x
    labels = [t.get_text() for t in axis.get_ticklabels()]
    assert labels == ["1K", "4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M", "256M"]
    # 05's sweep: powers of 4, then one bucket of 8N bytes (no power of 2)
    x = [2 ** k for k in range(12, 24, 2)] + [8 * 1575168]
    fig = lines(x, {"a": [1.0] * len(x)}, logx=True)
    assert list(fig.axes[0].xaxis.get_majorticklocs()) == x


def test_point_ticks_thin_many_points_but_stay_on_them():
    from workbench.viz.charts import lines
    from workbench.viz.ticks import POINT_TICKS, point_ticks
    x = [2 ** e for e in range(0, 30)]                     # 30 points: every third
    fig = lines(x, {"a": [1.0] * len(x)}, logx=True)
    ticks = list(fig.axes[0].xaxis.get_majorticklocs())
    assert len(ticks) <= POINT_TICKS and set(ticks) <= set(x) and ticks[0] == x[0]
    assert ticks == x[::3]
    with pytest.raises(ValueError, match="most=0"):
        point_ticks(fig.axes[0].xaxis, x, most=0)


def _shown_names(tree) -> set:
    last = tree.body[-1] if tree.body else None
    return {last.value.id} if isinstance(last, ast.Expr) and isinstance(last.value, ast.Name) \
        else set()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_shown_widget_is_not_preceded_by_its_message_unlabelled(path):
    """11 printed `explorer.message` above the memory widget: a line that looked live but
    stayed put when the sliders moved (the widget's own line under the bars follows them).
    A printed copy must say it is the start (07: "at the defaults:")."""
    for i, cell in enumerate(_cells(path)):
        if cell["cell_type"] != "code":
            continue
        src = _source(cell)
        try:
            tree = ast.parse("\n".join(ln for ln in src.split("\n")
                                       if not ln.lstrip().startswith(("%", "!"))))
        except SyntaxError:
            continue
        shown = _shown_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "print" \
                    and len(node.args) == 1 and isinstance(node.args[0], ast.Attribute) \
                    and node.args[0].attr == "message" \
                    and getattr(node.args[0].value, "id", None) in shown:
                pytest.fail(f"{path.name} cell {i}: prints {node.args[0].value.id}.message "
                            "unlabelled above the live widget")


def test_11_widget_cell_shows_the_widget_only():
    cells = _cells(ROOT / "notebooks" / "11_memory_and_recompute.ipynb")
    (cell,) = [c for c in cells if c["cell_type"] == "code" and "memory_widget(" in _source(c)]
    kinds = [o["output_type"] for o in cell["outputs"]]
    assert kinds == ["execute_result"], kinds           # no printed copy of the status
    data = cell["outputs"][0]["data"]
    assert "does NOT fit" in "".join(data["text/plain"]) and "image/png" in data
