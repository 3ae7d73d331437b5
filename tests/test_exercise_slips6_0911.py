"""Slips found in the browser review of notebooks 09, 10 and 11 (nbv0911): wrong answers named
as another mistake or not at all, and a widget's message broken inside its words.  Each
test failed before its fix."""
import pytest

import workbench as wb
from workbench.exercises import checks_fused as F
from workbench.exercises import checks_overlap_profiling as O
from workbench.exercises import checks_plan as P
from workbench.exercises.feedback import reset_tries

from .exercise_helpers import message, passes

PSI, N_D = 7.5e9, 16                     # 11 exercise 1: ZeRO-2, 7.5B parameters on 16 GPUs
C_MS, M_MS, K = 1.4, 2.0, 4              # 10 exercise 1
SHARE = (1 - 1 / K) * min(1.0, C_MS / M_MS)


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def _zero2_gb(k=12, grads=2, weights=2):
    return (weights * PSI + (grads + k) * PSI / N_D) / 1e9


# ---- 11 exercise 1 ----------------------------------------------------------------------------

def test_zero2_with_adam_states_only_is_not_told_gib():
    """K = 8 (Adam's momentum and variance, the fp32 copy of the weights forgotten):
    19.69 GB read "use GB = 1e9 bytes": the GiB answer, 20.08, lies 2% away, within the
    hint's reach; the student never learned what K holds."""
    msg = message(P.check_zero_states_gb, _zero2_gb(k=8), stage=2)
    assert "GiB" not in msg and "1e9" not in msg
    assert "fp32 copy of the weights" in msg and "K = 12" in msg
    # the GiB slip keeps its own message
    assert "GB = 1e9" in message(P.check_zero_states_gb, _zero2_gb() * 1e9 / 2**30, stage=2)


def test_zero2_without_the_gradients_is_named():
    """2 psi + K psi / N_d (the gradients left out altogether): 20.62 GB read only "too
    low: compare each factor with the formula"."""
    msg = message(P.check_zero_states_gb, _zero2_gb(grads=0), stage=2)
    assert "gradients" in msg and "compare each factor" not in msg


def test_zero2_right_answer_still_passes(capsys):
    assert "21.56 GB" in passes(capsys, P.check_zero_states_gb, _zero2_gb(), stage=2)


# ---- 09 exercise 2 ----------------------------------------------------------------------------

def test_window_tiles_skipped_count_is_named():
    """64 - 21 = 43, the tiles skipped (what the section-3 printout lists beside the
    computed ones), read "draw the 8 x 8 grid"."""
    msg = message(F.check_window_tiles, 43)
    assert "skipped" in msg.lower() and "draw the" not in msg


def test_window_tiles_full_or_partial_tiles_alone_are_named():
    """Only the tiles kept whole (7: those one left of the diagonal) or only the partial
    ones (14: the diagonal and the window's far edge) read "draw the 8 x 8 grid"; the
    figure of section 3 draws both kinds as computed."""
    full = message(F.check_window_tiles, 7)
    assert "partial" in full and "draw the" not in full
    partial = message(F.check_window_tiles, 14)
    assert "whole" in partial and "draw the" not in partial


def test_window_tiles_right_answer_still_passes(capsys):
    assert "21 of 64 tiles" in passes(capsys, F.check_window_tiles, 21)


# ---- 10 exercise 1 ----------------------------------------------------------------------------

def test_hidden_share_exposed_share_and_time_are_named():
    """1 - share (0.475: the share left exposed) and the exposed time (0.95 ms) read only
    "too low / too high: compare each factor with the formula"."""
    msg = message(O.check_hidden_share, 1 - SHARE)
    assert "exposed" in msg.lower() and "compare each factor" not in msg
    msg = message(O.check_hidden_share, (1 - SHARE) * M_MS)
    assert "exposed" in msg.lower() and " ms" in msg and "compare each factor" not in msg


@pytest.mark.parametrize("k", [K - 1, K + 1])
def test_hidden_share_with_k_off_by_one_is_named(k):
    """(1 - 1/3) C/M and (1 - 1/5) C/M read "compare each factor"."""
    msg = message(O.check_hidden_share, (1 - 1 / k) * C_MS / M_MS)
    assert f"k = {k}" in msg and f"k = {K}" in msg and "compare each factor" not in msg


def test_hidden_share_right_answer_and_old_diagnoses_hold(capsys):
    assert "0.525" in passes(capsys, O.check_hidden_share, SHARE)
    assert "hidden TIME" in message(O.check_hidden_share, SHARE * M_MS)
    assert "percentage" in message(O.check_hidden_share, 100 * SHARE)


# ---- 11 memory widget -------------------------------------------------------------------------

def test_memory_widget_message_wraps_at_spaces():
    """A choice that is not a layout (ZeRO-3 with a pipeline) prints a 180-character line
    under the bars; JupyterLab's <pre> broke it inside a word ("DeepSpeed a|llows").  The
    status now wraps at spaces, as the pipeline explorer's does."""
    pytest.importorskip("ipywidgets")
    from workbench.viz.memory import memory_widget
    cfg = wb.models.get_config("gpt3-175b")
    w = memory_widget(cfg, devices=1024, profile="ascend-910b", global_batch=1536,
                      tp=8, pp=16, micro_batch=1, recompute="selective", zero=3)
    assert "zero<=1 or pp=1" in w.message and len(w.message) > 100
    style = w.status.value.split(">", 1)[0]
    assert "white-space: pre-wrap" in style and "word-break: normal" in style


# ---- 09 exercise 1 ----------------------------------------------------------------------------

def test_online_softmax_tuple_of_the_wrong_length_says_how_many():
    """An update returning (m, l) read "update must return the tuple (m, l, acc), got
    tuple": a tuple was what it returned; the message now counts the values.  An update
    without a return statement read "got NoneType"."""
    msg = message(F.check_online_softmax, lambda m, l, acc, s, v: (m, l))
    assert "2 values" in msg
    assert "list of 3 values" in message(F.check_online_softmax,
                                         lambda m, l, acc, s, v: [m, l, acc])
    assert "return m, l, acc" in message(F.check_online_softmax, lambda m, l, acc, s, v: None)


# ---- 11 exercise 3 ----------------------------------------------------------------------------

def test_biggest_micro_batch_names_the_slip_behind_b_1():
    """b = 1 is what a count without ZeRO-1 (16 bytes per parameter) or with the
    no-recompute row gives; it read only "a bigger divisor fits too: activations grow
    linearly in b", which the student's own count contradicted."""
    msg = message(P.check_biggest_micro_batch, 1)
    assert "ZeRO-1" in msg and "10 + 24/t" in msg


@pytest.mark.parametrize("b, slip", [(6, "sequence parallelism"), (32, "min(p, m)")])
def test_biggest_micro_batch_names_the_slip_behind_a_too_big_b(b, slip):
    """b = 6 (Table 2's SP row, sbh 34/t) and b = 32 (one micro-batch in flight) read the
    same "too big: model states do not grow with b" as any other."""
    msg = message(P.check_biggest_micro_batch, b)
    assert "too big" in msg and slip in msg and "do not grow with b" not in msg


def test_biggest_micro_batch_right_answer_and_plain_too_big_hold(capsys):
    assert "b = 2" in passes(capsys, P.check_biggest_micro_batch, 2)
    msg = message(P.check_biggest_micro_batch, 4)          # no slip gives 4: the old hint
    assert "do not grow with b" in msg and "Check your count" not in msg
