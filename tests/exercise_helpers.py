"""Helpers for the tests of the course's exercise checks."""
import pytest

from workbench.exercises.feedback import CheckError, reset_tries


def fails(match, fn, *args, **kw):
    """``fn`` rejects the answer with a CheckError whose message matches ``match`` (a first
    try: the counts of earlier tries are reset)."""
    reset_tries()
    with pytest.raises(CheckError, match=match):
        fn(*args, **kw)


def passes(capsys, fn, *args, **kw):
    """``fn`` accepts the answer and prints one "Correct: ..." line, wrapped at
    text_width.WIDTH (continuations indented); returns it as one line, the wrapping's
    line breaks and indents read as the one space they replaced."""
    from workbench.text_width import WIDTH
    fn(*args, **kw)
    out = capsys.readouterr().out
    assert out.startswith("Correct: ") and out.endswith("\n")
    lines = out.splitlines()
    assert all(len(line) <= WIDTH for line in lines), out
    assert all(line.startswith("    ") for line in lines[1:]), out
    return " ".join(line.strip() for line in lines) + "\n"


def message(fn, *args, **kw) -> str:
    """The CheckError message ``fn`` gives for a wrong answer (a first try: the counts of
    earlier tries are reset)."""
    reset_tries()
    with pytest.raises(CheckError) as err:
        fn(*args, **kw)
    return str(err.value)


@pytest.fixture
def fresh_cumsum_rule():
    """Tries reset before and after a test, and the "cumsum" rule a test registers (as a
    student's notebook 04 does) put back as it was."""
    from workbench.parallel.rules import RULES
    reset_tries()
    saved = RULES.get("cumsum")
    yield
    reset_tries()
    RULES["cumsum"] = saved


def ring_all_reduce(bandwidth, n=14e9, p=8, alpha=3e-6):
    """Notebook 01's ring all-reduce time: 2 (p-1) alpha + 2 (p-1)/p n / bandwidth."""
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bandwidth


@pytest.fixture(autouse=True)
def fresh_tries():
    """Each test starts (and leaves) the checks' try counts at zero: import it into a test
    module to make it that module's autouse fixture."""
    reset_tries()
    yield
    reset_tries()
