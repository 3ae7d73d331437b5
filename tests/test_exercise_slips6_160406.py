"""Checker slips found in the browser review of notebooks 16, 06 and 04 (nbr160406): a
student's own error shown as an empty or many-line message, and a right value refused
with a hint the student had already followed.  Each test failed before its fix."""
import pytest
import torch

from workbench.exercises import checks_compile as C
from workbench.exercises import checks_strategies as S
from workbench.exercises.feedback import reset_tries

from .exercise_helpers import fails, message


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def test_sp_f_g_stub_asks_for_the_code():
    """06, exercise 2: the stub's bare NotImplementedError read "Not yet: your f raised
    NotImplementedError: " with nothing after the colon."""
    import workbench as wb

    def f(x):
        raise NotImplementedError

    def g(y):
        return wb.reshard(y, y.mesh, [wb.Shard(1)])

    msg = message(S.check_sp_f_g, f, g)
    assert "your f raised NotImplementedError: replace the stub with your code" in msg
    assert not msg.rstrip().endswith(":")


def test_graph_break_item_in_clamp_is_one_line_with_a_hint():
    """16, exercise 1: torch.clamp(x.abs().amax().item(), min=1.0) raised torch's TypeError,
    shown whole: its list of clamp's overloads, five lines, and no word on .item()."""
    def scale_rows_static(x):
        return torch.relu(x / torch.clamp(x.abs().amax().item(), min=1.0))

    msg = message(C.check_no_graph_break, scale_rows_static)
    assert "\n" not in msg and "expected one of" not in msg and "Tensor input" not in msg
    assert "your function raised TypeError: clamp() received an invalid combination" in msg
    assert ".item()" in msg


def test_graph_break_student_error_keeps_its_one_line_message():
    """A one-line error of the student's own code still reads whole (not cut)."""
    def scale_rows_static(x):
        raise ValueError("m must be positive")

    fails(r"your function raised ValueError: m must be positive$",
          C.check_no_graph_break, scale_rows_static)


def test_sp_max_microbatch_float_from_floor_division_says_int():
    """06, exercise 3: b = 20e9 // per_microbatch is 1.0, a float; the check read "b should
    be an int (a number of whole sequences: round down), got 1.0", though the student had
    rounded down: the slip is the float that // of floats gives."""
    b = 20e9 // (8 * 12 * 106_954_752.0)          # 1.0
    assert b == 1.0 and isinstance(b, float)
    fails(r"should be an int.*`//` of floats gives a float.*int\(", S.check_sp_max_microbatch, b)
    fails(r"should be an int \(a number of whole sequences", S.check_sp_max_microbatch, 1.5)
