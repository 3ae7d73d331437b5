"""Checker slips found in the browser review of notebooks 01, 02 and 03 (nbv0103): mistakes
named wrongly (the closest listed mistake was another one) or not at all.  Each test failed
before its fix."""
import pytest

import workbench as wb
from workbench.exercises import checks as C
from workbench.exercises import checks_layouts as L
from workbench.exercises.feedback import reset_tries

from .exercise_helpers import message, passes, fresh_tries  # noqa: F401 (autouse)
from .exercise_helpers import ring_all_reduce as _ring_all_reduce

NPU_BF16 = 313e12                        # the ascend-910b profile's bf16 peak
FLOPS = 6 * 7e9 * 2e12                   # 01 exercise 1: 6ND
PSI = 7e9                                # 01 exercise 2


def _days(flops=FLOPS, n=1024, peak=NPU_BF16, u=0.4):
    return flops / (n * peak * u) / 86_400




def test_training_days_names_a_forgotten_device_count():
    """6ND / (peak x u), without the 1,024 devices, read "1,024 times too large: a unit
    slip? (B, KiB, MiB, GiB)": the days have no binary unit, the device count is 1,024."""
    msg = message(C.check_training_days, _days(n=1))
    assert "device" in msg and "unit slip" not in msg and "KiB" not in msg


def test_training_days_names_a_forgotten_six_and_a_peak_in_tflops():
    """ND without the 6 (one sixth) and a peak typed as 313 (TFLOP/s taken for FLOP/s)
    both read only "too low / too high: compare each factor with the formula"."""
    msg = message(C.check_training_days, _days(flops=7e9 * 2e12))
    assert "6ND" in msg and "compare each factor" not in msg
    msg = message(C.check_training_days, _days(peak=313))
    assert "TFLOP/s" in msg and "FLOP/s" in msg and "compare each factor" not in msg


def test_training_days_still_passes_and_keeps_its_other_diagnoses(capsys):
    assert "7.583 days" in passes(capsys, C.check_training_days, _days())
    assert "that is hours" in message(C.check_training_days, _days() * 24)
    assert "forward pass" in message(C.check_training_days, _days() / 3)
    assert "instead of dividing" in message(C.check_training_days, _days(u=1) * 0.4)


def test_allreduce_at_the_port_between_servers_is_named_so():
    """25 GB/s (the 910B's RoCE port between servers, what print(NPU) shows beside HCCS)
    read "did you drop the (p-1)/p factor, or split the 196 GB/s over 8 links?": the
    closest listed mistake lies 2% away; neither was made."""
    msg = message(C.check_allreduce_seconds, _ring_all_reduce(25e9))
    assert "25 GB/s" in msg and "between servers" in msg and "(p-1)/p" not in msg
    # the mistake it was taken for is still named
    assert "(p-1)/p" in message(C.check_allreduce_seconds, _ring_all_reduce(196e9 / 8))


def test_zero2_without_the_gradients_is_not_told_gib():
    """2 psi + 12 psi / 8 = 24.5 GB (the gradients left out) read "that is GiB (2**30
    bytes)": the GiB answer, 24.45, lies 0.2% away.  The GiB slip keeps its message."""
    msg = message(C.check_zero2_memory_gb, (2 * PSI + 12 * PSI / 8) / 1e9)
    assert "gradient" in msg and "GiB" not in msg
    gib = message(C.check_zero2_memory_gb, (2 * PSI + 14 * PSI / 8) / 2**30)
    assert "GiB" in gib


def test_zero2_weights_only_is_named_beside_stage_3():
    """2 psi = 14 GB, the bf16 weights alone, equals stage 3 on 8 ranks (16 psi / 8) and
    read only "that is ZeRO stage 3": a student who counted the weights alone never
    learned what was missing."""
    msg = message(C.check_zero2_memory_gb, 2 * PSI / 1e9)
    assert "stage 3" in msg and "only the bf16 weights" in msg


def test_zero2_with_fp32_weights_is_named():
    """4 psi + 14 psi / 8 (4-byte weights kept whole) read "too high: compare each factor"."""
    msg = message(C.check_zero2_memory_gb, (4 * PSI + 14 * PSI / 8) / 1e9)
    assert "bf16" in msg and "compare each factor" not in msg


def test_notation_of_another_dtype_or_a_pasted_repr_is_named():
    """'f32[I, J_tp]{U_dp}' read "the dtype comes first, short: ..." (it does come first);
    TensorSpec's whole repr pasted read the same; dims in the wrong order read "compare
    each part"."""
    msg = message(L.check_notation, "f32[I, J_tp]{U_dp}")
    assert "f32" in msg and "comes first" not in msg and "bf16" in msg
    msg = message(L.check_notation, repr(wb.TensorSpec((16, 64), L.Mesh([[0, 1], [2, 3]],
                                                                       ["dp", "tp"]),
                                                       ["P(sum)", "S(1)"])))
    assert "repr" in msg and "comes first" not in msg
    msg = message(L.check_notation, "bf16[J_tp, I]{U_dp}")
    assert "order" in msg and "compare each part" not in msg


def test_training_days_with_the_a100_peak_left_in_peak_does_not_pass(capsys):
    """01's cell before the exercises sets ``peak = A100.peak("bfloat16")``: a student who
    reuses ``peak`` gets 7.608 days where 7.583 is due (the 910B's 313 TFLOP/s), 0.3% off,
    and the 1% tolerance passed it.  Rounded right answers still pass."""
    msg = message(C.check_training_days, _days(peak=312e12))
    assert "A100" in msg
    for rounded in (7.58, 7.6, 7.583):
        reset_tries()
        passes(capsys, C.check_training_days, rounded)


def _ring_all_gather(p, bandwidth, n=64 * 2**20, alpha=3e-6):
    return (p - 1) * alpha + (p - 1) / p * n / bandwidth


def test_allgather_with_the_notebooks_p_of_4_is_named():
    """03 sets p = 4 in section 1 (the table on 4 ranks); a ring formula that reuses it read
    only "too low: compare each factor", on either device."""
    msg = message(L.check_allgather_times, _ring_all_gather(4, 28e9), _ring_all_gather(8, 300e9))
    assert "p = 4" in msg and "compare each factor" not in msg
    msg = message(L.check_allgather_times, _ring_all_gather(8, 28e9), _ring_all_gather(4, 300e9))
    assert "p = 4" in msg and "compare each factor" not in msg


def test_allreduce_with_the_notebooks_a100_beta_or_4_mib_n_is_named():
    """01 sets n = 4 MiB and beta = 1 / 300 GB/s (the A100's NVLink) in section 3; the
    exercise's formula reusing either read only "too low: compare each factor"."""
    msg = message(C.check_allreduce_seconds, _ring_all_reduce(300e9))
    assert "A100" in msg and "compare each factor" not in msg
    msg = message(C.check_allreduce_seconds, _ring_all_reduce(28e9, n=4 * 2**20))
    assert "14e9" in msg.replace("1.4e+10", "14e9") and "compare each factor" not in msg
