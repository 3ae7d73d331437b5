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


def test_sp_max_microbatch_float_from_floor_division_is_not_a_slip(capsys):
    """06, exercise 3: b = 20e9 // per_microbatch is 1.0, a float; the check read "b should
    be an int (a number of whole sequences: round down), got 1.0", though the student had
    rounded down.  (nbfix06: 1.0 is now taken as 1, as notebook 11's check takes 2.0;
    tests/test_exercise_slips7_06.py.)  A fraction is still refused."""
    b = 20e9 // (8 * 12 * 106_954_752.0)          # 1.0
    assert b == 1.0 and isinstance(b, float)
    S.check_sp_max_microbatch(b)
    assert capsys.readouterr().out.startswith("Correct: b = 1")
    fails(r"should be a whole number of sequences, got 1\.5: round down",
          S.check_sp_max_microbatch, 1.5)


# 16, exercise 2: a (24, 64) float32 tensor on 8 ranks
FULL, RANKS = 24 * 64 * 4, 8
GREEDY = (RANKS - 1) / RANKS * FULL / RANKS + (RANKS - 1) / RANKS * FULL     # 6048 B
WHOLE = (RANKS - 1) / RANKS * FULL                                            # 5376 B
BYTES = dict(rows=24, cols=64, p=8)


def test_greedy_bytes_with_a_whole_all_gather_is_named():
    """The all_to_all right and the all_gather sending the whole tensor (672 + 6,144 B)
    read only "too high: compare each factor with the formula"."""
    fails(r"all_gather.*keeps its own shard", C.check_greedy_vs_whole_bytes,
          (RANKS - 1) / RANKS * FULL / RANKS + FULL, WHOLE, **BYTES)


def test_one_over_p_instead_of_p_minus_one_over_p_is_named():
    """1/p of each buffer (96 + 768 B op by op; 768 B compiled, one shard) read only "too
    low: compare each factor with the formula"."""
    fails(r"\(p-1\)/p of its buffer.*not 1/p", C.check_greedy_vs_whole_bytes,
          FULL / RANKS / RANKS + FULL / RANKS, WHOLE, **BYTES)
    fails(r"one shard, 1/p of the tensor", C.check_greedy_vs_whole_bytes,
          GREEDY, FULL / RANKS, **BYTES)


def test_tp_sp_layer_bytes_in_values_not_bytes_is_named():
    """06, exercise 1: n counted in values (no x 2 for bf16) halves both answers; the check
    read "half of it: either only the forward's 2 all-reduces ..., or (t-1)/t n per
    all-reduce", nothing on bytes per value."""
    n_values = 1 * 2048 * 12288
    tp = 4 * 2 * (8 - 1) / 8 * n_values
    fails(r"both are 1/2 of the bytes: n counts the activation's values.*2 bytes",
          S.check_tp_sp_layer_bytes, tp, tp)
    fails(r"half of it: either only the forward", S.check_tp_sp_layer_bytes, tp, 2 * tp)


def test_reveal_after_wrong_code_answers_does_not_say_no_wrong_try():
    """16, exercise 1 (a function) and 06, exercise 4 (a plan): after wrong tries,
    reveal() read "has no wrong try yet: run it once with your answer", since their
    messages carry no single expected value."""
    import workbench as wb
    from workbench.exercises.feedback import CheckError

    for _ in range(3):
        with pytest.raises(CheckError):
            C.check_no_graph_break(lambda x: torch.relu(x / x.abs().amax()))
    text = wb.exercises.reveal("check_no_graph_break")
    assert "no wrong try yet" not in text and "no value to reveal" in text
    reset_tries()
    assert "no wrong try yet" in wb.exercises.reveal("check_no_graph_break")
