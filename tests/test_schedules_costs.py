"""simulate() checks every cost: NaN, inf, negative or non-numeric costs (given as a
number, a list, or returned by a cost function) are refused with the action, the
value and the fix, never turned into a NaN or too-short makespan."""
from __future__ import annotations

import math

import pytest

from workbench.parallel.schedules import interleaved_1f1b, one_f_one_b, simulate, zb_h1

BAD = [float("nan"), float("inf"), -float("inf"), -1.0, -1e-9]


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("arg", ["f", "b"])
def test_constant_costs_are_checked(arg, bad):
    with pytest.raises(ValueError, match=rf"simulate\({arg}={bad!r}\).*finite.*>= 0"):
        simulate(one_f_one_b(2, 2), **{arg: bad})


@pytest.mark.parametrize("bad", BAD)
def test_list_costs_name_the_bad_entry(bad):
    with pytest.raises(ValueError, match=rf"entry 1 is {bad!r}.*finite.*>= 0"):
        simulate(one_f_one_b(2, 2), f=[1.0, bad])
    with pytest.raises(ValueError, match=rf"entry 3 is {bad!r}"):
        simulate(interleaved_1f1b(2, 4, 2), b=[1.0, 1.0, 1.0, bad])


@pytest.mark.parametrize("bad", BAD + [None, "1.0", True, complex(1, 0)])
def test_cost_function_results_are_checked(bad):
    def f(a, r):                        # one bad action: F1 on rank 1
        return bad if (a.kind, a.mb, r) == ("F", 1, 1) else 1.0
    with pytest.raises(ValueError) as err:
        simulate(one_f_one_b(2, 2), f=f)
    msg = str(err.value)
    assert "simulate(f=<callable>)" in msg and "action F1 on rank 1" in msg
    assert f"is {bad!r}" in msg and "fix the cost function" in msg


def test_one_argument_cost_function_and_w_are_checked():
    with pytest.raises(ValueError, match=r"simulate\(w=<callable>\).*is nan"):
        simulate(zb_h1(2, 2), w=lambda a: float("nan"))
    with pytest.raises(ValueError, match=r"simulate\(w=-2\.0\)"):
        simulate(one_f_one_b(2, 2), w=-2.0)       # fused B+W backward: w checked too


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5, True, "0"])
def test_p2p_is_checked(bad):
    with pytest.raises(ValueError, match=r"simulate\(p2p=.*finite number of seconds >= 0"):
        simulate(one_f_one_b(2, 2), p2p=bad)


def test_valid_costs_still_give_the_exact_makespan():
    # 1F1B, p=2, m=2, f=1, b=2: (m + p - 1)(f + b) = 9 (GPipe/1F1B bubble formula)
    r = simulate(one_f_one_b(2, 2), f=lambda a, r: 1, b=[2, 2], p2p=0.0)
    assert r.makespan == 9.0 and math.isfinite(r.bubble_fraction)
    zero = simulate(one_f_one_b(2, 2), f=0, b=0)            # zero is a valid cost
    assert zero.makespan == 0.0 and zero.bubble_fraction == 0.0
