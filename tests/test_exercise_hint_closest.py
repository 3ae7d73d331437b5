"""checks._hint names the mistake closest to the answer, not the first one within 2%.

Two slips can lie within ``rel`` of one answer (notebook 16's exercise 2: the whole
tensor, 6,144 B, lies 1.6% from the op-by-op count, 6,048 B); the first match used to win,
so an answer equal to the second slip was told it was the first."""
from workbench.exercises import checks


WRONG = [(6048.0, "that is the op-by-op count"), (6144.0, "that is the whole tensor")]


def test_the_closest_mistake_is_named():
    assert checks._hint(6144, 4096, WRONG) == "that is the whole tensor"
    assert checks._hint(6048, 4096, WRONG) == "that is the op-by-op count"
    assert checks._hint(6050, 4096, WRONG) == "that is the op-by-op count"


def test_ties_keep_the_listed_order():
    assert checks._hint(100, 50, [(100.0, "first"), (100.0, "second")]) == "first"


def test_own_tolerance_still_bounds_a_match():
    # a mistake with its own tight tolerance is not matched beyond it, even when closest
    assert checks._hint(101, 200, [(100.0, "tight", 0.001)]).startswith("too low")
