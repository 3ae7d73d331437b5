"""Checker slips found in the browser review of notebooks 10, 11 and 12 (nbr1012): a
mistake named wrongly or not at all, a right number of another type refused, a call
without the trace shown as a TypeError through the checker.  Each test failed before
its fix."""
import math

import numpy as np
import pytest
import torch

import workbench as wb
from workbench.exercises import checks_overlap_profiling as C
from workbench.exercises import checks_plan as P
from workbench.exercises.feedback import reset_tries

from .exercise_helpers import fails, passes, message as _message


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def test_hidden_share_given_as_hidden_time_is_named():
    """10, exercise 1: 0.525 x M = 1.05 ms (the hidden time) read "you used M/C" (M/C
    gives 1.071, 2% away)."""
    msg = _message(C.check_hidden_share, 0.525 * 2.0)
    assert "hidden TIME in ms" in msg and "M/C" not in msg
    fails("you used M/C", C.check_hidden_share, 0.75 / 0.7)          # still named


def test_hidden_share_above_one_says_a_share_is_at_most_one():
    """A share of 1.3 got only "too high: compare each factor with the formula"."""
    assert "at most 1" in _message(C.check_hidden_share, 1.3)
    fails("percentage", C.check_hidden_share, 52.5)                  # not "at most 1"


def test_multi_copy_forward_names_two_schedule_slips():
    """10, exercise 2: 9.5 ms (A's FFN waiting for B's all-reduce too) and 6.5 ms (the
    end of the compute stream) got only "walk the two streams"."""
    fails("ITS OWN attention all-reduce", C.check_multi_copy_forward_ms, 9.5)
    fails("compute stream ends", C.check_multi_copy_forward_ms, 6.5)


@pytest.mark.parametrize("k", [np.int64(4), torch.tensor(4), 4.0])
def test_best_chunks_takes_an_integer_of_any_type(capsys, k):
    """10, exercise 3: min over a NumPy array of candidates gives numpy.int64(4), which
    read "k should be one of [1, 2, ...], an int"."""
    passes(capsys, C.check_best_chunks, k)
    fails("an int", C.check_best_chunks, 4.5)
    fails("an int", C.check_best_chunks, True)


@pytest.mark.parametrize("b", [np.int64(2), 2.0])
def test_biggest_micro_batch_takes_an_integer_of_any_type(capsys, b):
    """11, exercise 3: 2.0 (192 / 96) and numpy.int64(2) read "should be an int >= 1"."""
    passes(capsys, P.check_biggest_micro_batch, b)
    fails("an int >= 1", P.check_biggest_micro_batch, 2.5)


def test_fusion_names_rounded_mistakes():
    """12, exercise 1: the tolerance kept tight for the memory-efficiency slip (5002.6 vs
    5003.0 us) applied to every mistake, so the bytes alone (3.012 us) and the fused
    kernel's time (8.012 us) typed as printed got only "too low"."""
    fails("memory traffic only", C.check_fusion_us, 3.012, 8.012)
    fails("that is the fused kernel", C.check_fusion_us, 8.012, 8.012)
    fails("memory_efficiency", C.check_fusion_us, 5002.56, 8.012)      # still named
    msg = _message(C.check_fusion_us, 5003.5, 8.012)                    # near, no slip
    assert "launches alone" not in msg and "memory_efficiency" not in msg


def _step_trace():
    """A dp 2 x tp 2 step of the tiny Llama on the 910B clock, as notebook 12 records it."""
    from workbench.models import get_batch, get_config
    from workbench.recipes.hybrid import Hybrid
    cfg = get_config("tiny")
    tokens, targets = get_batch(cfg, 8, seed=0, step=0)
    strategy = Hybrid(dp=2, tp=2, pp=1)
    model = strategy.build_model(cfg, seed=0)
    opt = strategy.build_optimizer(model, lr=3e-3, weight_decay=0.01)
    with wb.trace("ascend-910b") as tr:
        strategy.forward_backward(model, tokens, targets)
        strategy.optimizer_step(opt)
    return tr


def test_idle_share_rounded_is_not_called_an_overlap_and_units_mixed_are_named():
    """12, exercise 3: 0.13 for 0.1276 read "close: merge overlapping compute intervals
    first" (no kernels overlap there), and idle microseconds over a step in seconds
    (1e6 too large) read "was something multiplied in once too often (the device
    count?)"."""
    tr = _step_trace()
    busy = tr.busy(0, "compute")
    idle = 1 - busy / tr.time()
    # a near miss a hundredth off, as 0.13 was for 0.1276 (the step's share is now 0.1401,
    # since dropout at p = 0 runs no kernel: its two-digit rounding, 0.14, is accepted)
    near = round(idle, 2) - 0.01
    assert not math.isclose(near, idle, rel_tol=1e-3)
    msg = _message(C.check_idle_share, near, tr)
    assert "overlapping" not in msg and "BETWEEN" not in msg
    msg = _message(C.check_idle_share, (tr.time() - busy) * 1e6 / tr.time(), tr)
    assert "microseconds" in msg and "device count" not in msg


def test_a_check_called_without_its_trace_says_how_to_call_it():
    """12: check_top_op('linear') without the trace showed a TypeError traceback through
    the checker (feedback.py); too many arguments likewise."""
    fails(r"check_top_op\(name, tr\): missing a required argument: 'tr'", C.check_top_op,
          "linear")
    fails(r"check_hidden_share\(share, compute_ms=1.4, comm_ms=2.0, k=4\): too many",
          C.check_hidden_share, 0.5, 1, 2, 3, 4)


def test_a_number_as_a_tensor_is_told_to_pass_item_and_numpy_floats_are_numbers(capsys):
    """A 0-d tensor read only "should be a number, got tensor(0.5250)"; a NumPy float32
    (not a Python float subclass) was refused as no number."""
    fails(r"x\.item\(\)", C.check_hidden_share, torch.tensor(0.525))
    passes(capsys, C.check_hidden_share, np.float32(0.525))
    fails("should be a number", C.check_hidden_share, np.bool_(True))


def test_top_op_type_message_gives_a_name_of_the_trace():
    """12, exercise 2: a non-str answer read "a str, e.g. 'mm'", an aten kernel's name that
    the same check then refuses ("not aten's kernels")."""
    msg = _message(C.check_top_op, None, _step_trace())
    assert "'mm'" not in msg and ".name" in msg


def test_idle_share_over_the_busy_time_is_named():
    """12, exercise 3: idle / busy (0.1463 for 0.1276) got only "too high: take the step
    from the first event's start ..."."""
    tr = _step_trace()
    busy = tr.busy(0, "compute")
    fails("over BUSY time", C.check_idle_share, (tr.time() - busy) / busy, tr)
