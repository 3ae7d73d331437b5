"""Every test starts from the same random state (tests/conftest.py): torch's generator,
Python's ``random`` and numpy's seeded alike whatever ran before in the process, and
hypothesis derandomized (its examples a function of the test, not of the run)."""
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st


def _draws():
    return (torch.randn(4).tolist(), random.random(), float(np.random.rand()))


def _expected():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, generator=g).tolist(), random.Random(0).random(),
            float(np.random.RandomState(0).rand()))


@pytest.mark.parametrize("run", [0, 1])
def test_every_test_starts_from_seed_0(run):
    """Run 1 comes after run 0, which drew from every generator: both start at seed 0."""
    assert _draws() == _expected()


def test_hypothesis_runs_derandomized_without_deadlines():
    assert settings.default.derandomize is True
    assert settings.default.deadline is None and settings.default.print_blob is True


_seen = []


@settings(max_examples=5)
@given(st.integers(0, 2**30))
def _record(x):
    _seen.append(x)


def test_hypothesis_draws_the_same_examples_every_run():
    _record()
    first = list(_seen)
    _seen.clear()
    _record()
    assert first == _seen and len(first) == 5
