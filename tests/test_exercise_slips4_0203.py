"""Checker slips found in the browser review of notebooks 02 and 03 (nbr0203): a wrong answer
that passed, diagnoses that named the wrong mistake or gave the recipe away, and messages
that JupyterLab broke mid-word.  Each test failed before its fix."""
import re

import pytest

import workbench as wb
from workbench.exercises import checks_layouts as C
from workbench.exercises.feedback import CheckError, reset_tries
from workbench.plan.text_width import WIDTH

from .exercise_helpers import fails, passes

N = 64 * 2**20                                         # 03 exercise 2: the gathered output
RIGHT = {"910b": 7 * 3e-6 + 7 / 8 * N / 28e9, "a100": 7 * 3e-6 + 7 / 8 * N / 300e9}
P, S, R = wb.Partial(), wb.Shard, wb.Replicate()


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def _message(fn, *args) -> str:
    with pytest.raises(CheckError) as err:
        fn(*args)
    return str(err.value)


def test_not_yet_is_wrapped_at_the_text_width():
    """JupyterLab broke the one-line message mid-word ("co" / "ls 0:3", "t" / "ry 3"): the
    rendered message keeps to text_width.WIDTH, word for word the message."""
    with pytest.raises(CheckError) as err:
        C.check_rank1_layout([S(0), S(1)])
    shown = err.value._render_traceback_()
    plain = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(shown))
    assert max(len(line) for line in plain.splitlines()) <= WIDTH
    assert len(plain.splitlines()) > 1
    assert plain.split() == ("Not yet: " + str(err.value)).split()


def test_correct_lines_of_03_fit_the_text_width(capsys):
    """The 'Correct:' lines of 03's exercises 2 and 3 were 121 and 117 characters."""
    out = passes(capsys, C.check_allgather_times, RIGHT["910b"], RIGHT["a100"])
    assert len(out.rstrip("\n")) <= WIDTH and "ratio 9.8" in out
    out = passes(capsys, C.check_uneven_receive, [112, 112, 112, 144])
    assert len(out.rstrip("\n")) <= WIDTH and "144 B" in out     # the plan's (plan17b)


def test_uneven_receive_takes_numbers_only():
    """[112.7, 112, 112, 144] passed (int() truncated it), strings passed, and KB read as
    "your bytes are [0, 0, 0, 0]"."""
    fails("not whole numbers", C.check_uneven_receive, [112.7, 112, 112, 144])
    fails("byte counts \\(numbers\\)", C.check_uneven_receive, ["112", "112", "112", "144"])
    fails("look like KB", C.check_uneven_receive, [0.112, 0.112, 0.112, 0.144])


def test_uneven_receive_names_rows_and_another_split_without_the_recipe():
    """Rows for bytes, and the bytes of a 3, 3, 2, 2 split, got the answer's recipe
    "rank r receives (10 - its rows) x 16 B; its rows are [3, 3, 3, 1]"."""
    fails("those are rows", C.check_uneven_receive, [7, 7, 7, 9])
    fails(r"fit shards of \[3, 3, 2, 2\] rows", C.check_uneven_receive, [112, 112, 128, 128])
    fails("whole tensor", C.check_uneven_receive, [160] * 4)
    msg = _message(C.check_uneven_receive, [100] * 4)
    assert "(10 - its rows)" not in msg and "[3, 3, 3, 1]" not in msg


def test_nested_rows_says_which_split_is_off():
    """[5, 5, 0, 0] and [4, 1, 4, 1] read "... not an even split": neither is one."""
    msg = _message(C.check_nested_rows, [5, 5, 0, 0])
    assert "even split" not in msg and "add up to 10 and 0" in msg
    msg = _message(C.check_nested_rows, [4, 1, 4, 1])
    assert "even split" not in msg and "tp's cut" in msg


def test_cheapest_path_that_reduces_first_is_told_of_its_detour():
    """A path that reduce-scatters first, then detours through [S(0), S(0)], was told to
    "reduce first"; a flat list of placements got "path entry=['P(sum)'] has 1 entry"."""
    msg = _message(C.check_cheapest_path, [[P, S(1)], [S(0), S(1)], [S(0), S(0)], [S(0), R]])
    assert "another order" not in msg and "you reduce first" in msg
    msg = _message(C.check_cheapest_path, [[P, S(1)], [P, R], [S(0), R]])
    assert "before it reduces them" in msg
    fails("a list of placement lists", C.check_cheapest_path, [P, S(1)])


def test_allgather_names_every_slip_a_time_matches():
    """196 GB/s split over the 8 NPUs gives exactly the time without (p-1)/p and was told
    only "did you drop the (p-1)/p factor?"; both directions of a link (600 GB/s NVLink,
    56 GB/s HCCS) read "too low: compare each factor"."""
    msg = _message(C.check_allgather_times, 7 * 3e-6 + 7 / 8 * N / (196e9 / 8), RIGHT["a100"])
    assert "(p-1)/p factor" in msg and "over the 8 NPUs" in msg
    fails("A100 time.*600 GB/s, the link's two directions",
          C.check_allgather_times, RIGHT["910b"], 7 * 3e-6 + 7 / 8 * N / 600e9)
    fails("910B time.*56 GB/s, the link's two directions",
          C.check_allgather_times, 7 * 3e-6 + 7 / 8 * N / 56e9, RIGHT["a100"])


def test_allgather_rejects_p_alphas_on_the_910b():
    """p alpha instead of (p-1) alpha is 0.14% off the 910B's time: it passed the 0.2%
    tolerance.  A time rounded to 3 digits still passes."""
    fails(r"910B time.*\(p-1\) alpha, not p alpha", C.check_allgather_times,
          8 * 3e-6 + 7 / 8 * N / 28e9, RIGHT["a100"])
    fails(r"A100 time.*\(p-1\) alpha, not p alpha", C.check_allgather_times,
          RIGHT["910b"], 8 * 3e-6 + 7 / 8 * N / 300e9)
    reset_tries()
    C.check_allgather_times(2.12e-3, 2.17e-4)              # 2118.2 us, 216.7 us rounded


def test_notation_ignores_any_whitespace_and_sizes_take_no_bool(capsys):
    """"bf16[I, J_tp]{U_dp}\\n" (a trailing newline, a tab) read "compare each part"; a True
    among the sizes was read as 1 row ("add up to 9")."""
    passes(capsys, C.check_notation, "bf16[I, J_tp]{U_dp}\n")
    passes(capsys, C.check_notation, "bf16[I,\tJ_tp]{U_dp}")
    fails("a list of 4 ints", C.check_nested_rows, [3, 2, 3, True])
