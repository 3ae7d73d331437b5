"""Notebook 16's Exercise 1 feedback for capture's refusals that are not value reads
(a reseed, a random draw, a global written): the checker gives capture's own reason and
not the advice about `if` on a tensor, which would be wrong there; and `.max()`, captured
since compile10, passes as `amax()` does."""
import pytest
import torch

from workbench.exercises import checks_compile as C
from workbench.exercises.feedback import CheckError, reset_tries

from .exercise_helpers import fails, passes


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def _reseeds(x):
    torch.manual_seed(0)
    return torch.relu(x / torch.clamp(x.abs().amax(), min=1.0))


def _draws(x):
    return torch.relu(x / torch.clamp(x.abs().amax(), min=1.0)) + 0 * torch.rand(x.shape)


_COUNT = 0


def _writes_global(x):
    global _COUNT
    _COUNT += 1
    return torch.relu(x / torch.clamp(x.abs().amax(), min=1.0))


@pytest.mark.parametrize("fn, reason", [(_reseeds, "reseeds the random generator"),
                                        (_draws, "draws random numbers"),
                                        (_writes_global, "writes Python state")])
def test_refusal_gets_its_own_reason_not_value_advice(fn, reason):
    with pytest.raises(CheckError) as e:
        C.check_no_graph_break(fn)
    msg = str(e.value)
    assert "still falls back to eager" in msg and reason in msg
    assert "must not read a tensor's value" not in msg


def test_value_read_still_gets_value_advice():
    def branchy(x):
        m = x.abs().max()
        if m > 1:
            x = x / m
        return torch.relu(x)
    fails("line.*must not read a tensor's value", C.check_no_graph_break, branchy)


def test_max_is_taken_like_amax(capsys):
    passes(capsys, C.check_no_graph_break,
           lambda x: torch.relu(x / torch.clamp(x.abs().max(), min=1.0)))
    fails("ABSOLUTE value.*x.max", C.check_no_graph_break,
          lambda x: torch.relu(x / torch.clamp(x.max(), min=1.0)))
