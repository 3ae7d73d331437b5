"""Checker slips found in the browser review of notebook 06 (nbfix06).  Each test failed
before its fix."""
import pytest

from workbench.exercises import checks_plan as P
from workbench.exercises import checks_strategies as S
from workbench.exercises.feedback import reset_tries
from workbench.sim_mesh import estimates

from .exercise_helpers import fails, message, passes

# notebook 06, exercise 3: GPT-3's first stage, t = 8, TP + SP + selective recompute, 12
# layers, 8 micro-batches in flight under 1F1B (the checker's defaults)
PER_LAYER = estimates.activation_bytes_per_layer(2048, 1, 12288, 96, tp=8, case="tp+sp+selective")
STAGE = 8 * 12 * PER_LAYER                                  # bytes per micro-batch of one sequence


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def test_sp_max_microbatch_takes_a_whole_float_as_notebook_11_does(capsys):
    """06, exercise 3 asks for the largest micro-batch b, a count of sequences, as 11's
    exercise 3 does; 11's check takes 2.0 for 2, 06's refused 1.0, the value that
    ``20e9 // per_microbatch`` (floor division of floats, rounded down right) gives."""
    b = 20e9 // STAGE
    assert b == 1.0 and isinstance(b, float)
    assert "b = 1:" in passes(capsys, S.check_sp_max_microbatch, b)
    # the same kind of answer in 11: a whole float is its int there too
    assert "b = 2" in passes(capsys, P.check_biggest_micro_batch, 2.0)
    # a fraction is still no micro-batch, in both
    fails(r"whole number of sequences, got 1\.94.*round down", S.check_sp_max_microbatch,
          20e9 / STAGE)
    fails(r"should be an int >= 1, got 2\.5", P.check_biggest_micro_batch, 2.5)
    fails("should be a whole number", S.check_sp_max_microbatch, True)


def test_sp_max_microbatch_gib_budget_is_named():
    """The budget read as 20 GiB (20 * 2**30 bytes) gives b = 2, a floor division done
    right; the check said only "round down: b = 2 needs 20.54 GB", to a student who had
    rounded down."""
    b = int(20 * 2**30 // STAGE)
    assert b == 2
    msg = message(S.check_sp_max_microbatch, b)
    assert "1e9 bytes" in msg and "2**30" in msg and "needs 20.5" in msg, msg
    assert "your b is 2" in msg and "b = 1" not in msg            # no answer given away


def test_sp_max_microbatch_bytes_counted_twice_is_named():
    """34 sbh / t is in bytes already (16-bit activations); counted again at 2 (or 4) bytes
    an element, nothing fits and b = 0, which the check named only as SP or selective
    recompute left out."""
    assert int(20e9 // (2 * STAGE)) == 0
    msg = message(S.check_sp_max_microbatch, 0)
    assert "bytes already" in msg and "without sequence parallelism" in msg, msg
