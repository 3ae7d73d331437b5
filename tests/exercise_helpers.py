"""Helpers for the tests of the course's exercise checks."""
import pytest

from workbench.exercises.checks import CheckError


def fails(match, fn, *args, **kw):
    """``fn`` rejects the answer with a CheckError whose message matches ``match``."""
    with pytest.raises(CheckError, match=match):
        fn(*args, **kw)


def passes(capsys, fn, *args, **kw):
    """``fn`` accepts the answer and prints one "Correct: ..." line."""
    fn(*args, **kw)
    out = capsys.readouterr().out
    assert out.startswith("Correct: ") and out.count("\n") == 1
    return out
