"""Checker slips found in the browser review of notebook 06 (nbfix06).  Each test failed
before its fix."""
import pytest

from workbench.exercises import checks_plan as P
from workbench.exercises import checks_strategies as S
from workbench.exercises import checks_tp_api as T
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


def test_sp_max_microbatch_string_is_not_told_to_round_down():
    """b = "1" (a str) read "got '1': round down", a hint for a fraction."""
    msg = message(S.check_sp_max_microbatch, "1")
    assert "round down" not in msg and "give an int" in msg, msg


# notebook 06, exercise 1: one GPT-3 layer, bf16, t = 8 (the checker's defaults)
N = 1 * 2048 * 12288 * 2                                    # bytes of one b s h activation
TP, SP = 4 * 2 * 7 / 8 * N, 8 * 7 / 8 * N                   # 4 all-reduces; 4 AG + 4 RS


def test_tp_sp_bytes_forward_only_is_named():
    """Both answers for the forward only (2 all-reduces; 2 AG + 2 RS) are half of each, as
    values in place of bytes are; the check named only the bytes, to a student who had
    counted them and left out the backward."""
    msg = message(S.check_tp_sp_layer_bytes, TP / 2, SP / 2)
    assert "only the forward" in msg and "2 bytes" in msg, msg


def test_tp_sp_bytes_summed_over_ranks_is_named():
    """Every rank's bytes summed (x t = 8) read "8 times too large: that is bits, not
    bytes", to a student who had counted bytes."""
    for tp, sp, which in ((8 * TP, SP, "TP"), (TP, 8 * SP, r"TP\+SP")):
        fails(rf"your {which} bytes .*bits, not bytes, or the sum over all 8 ranks",
              S.check_tp_sp_layer_bytes, tp, sp)


def test_tp_mlp_plan_names_a_style_that_lays_out_no_weight():
    """06, exercise 4: PrepareModuleInput put on mlp.w1 (in place of ColwiseParallel) read
    "mlp.w1 is not in your plan", though the plan had a key for it."""
    from workbench import ColwiseParallel, PrepareModuleInput, Replicate, RowwiseParallel
    enter = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    msg = message(T.check_tp_mlp_plan, {"mlp.w1": enter, "mlp.w3": ColwiseParallel(),
                                        "mlp.w2": RowwiseParallel()})
    assert "not in your plan" not in msg, msg
    assert "gives mlp.w1 PrepareModuleInput, which lays out no weight" in msg, msg



def test_sp_max_microbatch_warm_up_counted_as_in_notebook_7():
    """b = 15 (one micro-batch in flight) was told "the warm-up sends p forwards before the
    first backward"; notebook 7 defines rank r's warm-up as p - r - 1 forwards (7 on the
    first of 8 stages), the 8th being the steady state's first."""
    msg = message(S.check_sp_max_microbatch, 15)
    assert "warm-up sends p forwards" not in msg, msg
    assert "warm-up of p - 1 forwards" in msg and "8 micro-batches in flight" in msg, msg
