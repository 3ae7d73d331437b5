"""Checker slips found in the browser review of notebooks 16 and 17 (nbr1617): a mistake
named wrongly (a compiled count of the whole tensor read "that is the op-by-op count";
eq. 7 without its s/(6h) term read "leaves out ... the head") or not at all.  Each test
failed before its fix."""
import pytest

from workbench.exercises import checks_compile as C
from workbench.exercises import checks_plan as P
from workbench.exercises.feedback import reset_tries

from .exercise_helpers import fails, message as _message

# 16, exercise 2: a (24, 64) float32 tensor on 8 ranks
FULL, RANKS = 24 * 64 * 4, 8
GREEDY = (RANKS - 1) / RANKS * FULL / RANKS + (RANKS - 1) / RANKS * FULL     # 6048 B
WHOLE = (RANKS - 1) / RANKS * FULL                                            # 5376 B
BYTES = dict(rows=24, cols=64, p=8)

# 17, exercise 1: GPT-3 175B, the measured run's step
B, S, L, H, V = 1536, 2048, 96, 12288, 51200
STEP = 34 * 86400 / (300e9 / (B * S))
DENOM = STEP * 1024 * 312e12
EQ7 = 72 * B * S * L * H * H * (1 + S / (6 * H) + V / (12 * L * H))


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def test_compiled_bytes_of_the_whole_tensor_is_not_called_the_op_by_op_count():
    """The whole tensor's 6,144 B (no (p-1)/p) lies 1.6% from the op-by-op 6,048 B and
    read "that is the op-by-op count"."""
    msg = _message(C.check_greedy_vs_whole_bytes, GREEDY, FULL, **BYTES)
    assert "op-by-op count" not in msg and "(p-1)/p" in msg
    fails("op-by-op count", C.check_greedy_vs_whole_bytes, GREEDY, GREEDY, **BYTES)  # named


def test_op_by_op_all_to_all_of_a_whole_shard_is_named():
    """An all_to_all sending its whole shard (full/p + the gather: 6,144 B) got only
    "too high: compare each factor with the formula"."""
    fails(r"all_to_all.*\(p-1\)/p of its shard", C.check_greedy_vs_whole_bytes,
          FULL / RANKS + WHOLE, WHOLE, **BYTES)


def test_bytes_summed_over_all_ranks_is_named():
    """p times the op-by-op count (every rank's sends added up) got only "too high"; the
    compiled count times p is (p - 1) whole copies, named already."""
    fails("per rank", C.check_greedy_vs_whole_bytes, GREEDY * RANKS, WHOLE, **BYTES)
    fails("whole copies", C.check_greedy_vs_whole_bytes, GREEDY, WHOLE * RANKS, **BYTES)


def test_mfu_without_the_attention_term_does_not_blame_the_head():
    """Eq. 7 without s/(6h) (which is 6ND with the embedding counted) read "6ND leaves out
    attention's s^2 terms and the head": the V/(12Lh) term, the head, was in it."""
    msg = _message(P.check_mfu, 72 * B * S * L * H * H * (1 + V / (12 * L * H)) / DENOM, STEP)
    assert "head" not in msg and "s/(6h)" in msg


def test_mfu_given_as_the_step_flops_is_named():
    """The step's model FLOPs (3.4e18) passed as the MFU got only "too high"."""
    fails("FLOPs", P.check_mfu, EQ7, STEP)


def test_tp_comm_with_l_over_tp_layers_is_named():
    """L / (t p) layers per device (the exercise's compute share) got only "too low"."""
    t8, t16 = 0.431, 0.6055
    fails("L / p", P.check_tp_comm_ms, L / (8 * 16) * 6 * t8, L / (16 * 8) * 6 * t16, "A",
          t8, t16)
