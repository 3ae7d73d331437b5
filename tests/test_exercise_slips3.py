"""Three checker diagnoses found in the browser review of 07 and 17 (nbr0117): each
named the wrong mistake or none."""
import pytest

from workbench.exercises import checks_plan as C
from workbench.exercises import checks_spmd_pipeline as ex
from workbench.exercises.feedback import reset_tries

from .exercise_helpers import fails


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def test_zb_bubble_names_every_mistake_a_value_matches():
    """p=4, f=b=2, w=1: the off-by-one p(f+b-w) = 12 equals (p-1)(f+b); the student was
    told only "leaves W out ... subtract w"."""
    fails(r"leaves W out(.|\n)*or p\(f\+b-w\) counts p gaps", ex.check_zb_bubble, 12)
    # costs where the two differ: each alone
    fails("counts p gaps", ex.check_zb_bubble, 4 * (3 + 2 - 1), 4, 8, 3.0, 2.0, 1.0)
    with pytest.raises(Exception) as err:
        ex.check_zb_bubble(3 * (3 + 2), 4, 8, 3.0, 2.0, 1.0)
    assert "leaves W out" in str(err.value) and "p gaps" not in str(err.value)


def test_a_share_off_by_1024_is_no_byte_unit_slip():
    """check_mfu(mfu / 1024) read "1,024 times too small: a unit slip? (B, KiB, MiB, GiB)";
    an MFU has no unit: the device count divided in twice."""
    t = 20.0
    want = C._gpt3_model_flops(1536) / (t * 1024 * 312e12)
    with pytest.raises(Exception) as err:
        C.check_mfu(want / 1024, t)
    msg = str(err.value)
    assert "KiB" not in msg and "unit slip" not in msg
    assert "1,024 times too small" in msg and "device count" in msg
    reset_tries()
    with pytest.raises(Exception) as err:
        C.check_mfu(want / 1000, t)
    assert "ms, us" not in str(err.value) and "1,000 times too small" in str(err.value)


def test_tp_comm_names_a_and_b_swapped():
    """check_tp_comm_ms(b_ms, a_ms, ...) got only "too high: compare each factor"."""
    t8, t16 = 0.4, 0.58
    a, b = 6 * 6 * t8, 12 * 6 * t16
    fails("that is layout B's figure", C.check_tp_comm_ms, b, a, "A", t8, t16)
