"""How a check talks to a student: a short message, a hint first, the value on request.

A wrong answer raises :class:`CheckError`.  In a notebook IPython shows only its
message (``_render_traceback_``), not a traceback through the checker's source; the
cell still fails.  A check decorated with :func:`exercise` counts the wrong tries of
its exercise: the first ``REVEAL_AFTER - 1`` messages give the diagnosis and a hint
only; from try ``REVEAL_AFTER`` on (or at once with :func:`reveal`) the expected
value is shown too, so that the value is not the first thing a student reads::

    >>> wb.exercises.check_training_days(11.0)          # doctest: +SKIP
    Not yet: your training time is 11 days, too high: ... (try 1; ...)
    >>> wb.exercises.reveal("check_training_days")      # doctest: +SKIP
    check_training_days expects 7.583 days

A check cell run before its exercise is answered (a student version's stub raises before
it sets the answer) fails with NameError before any check runs; in IPython the message is
"Not yet: gb is not defined yet: answer the exercise above first ..." (:func:`unanswered_name`,
through an IPython custom exception handler registered when this module is imported).
"""
from __future__ import annotations

import ast
import functools
import inspect
import linecache
import re
import sys

from ..text_width import wrap

__all__ = ["CheckError", "REVEAL_AFTER", "exercise", "raised", "reveal", "reset_tries",
           "unanswered_name"]

REVEAL_AFTER = 3            # the wrong try from which the expected value is shown
_tries: dict = {}           # check name -> wrong tries since its last right answer
_expected: dict = {}        # check name -> the expected value of its last wrong try


class CheckError(AssertionError):
    """An exercise answer is not right yet; the message says what is wrong.

    ``expected`` (text) is the right value, shown only after repeated tries or on
    request; None where the message needs no value (a wrong type, a wrong shape)."""

    def __init__(self, message: str, expected: str | None = None):
        super().__init__(message)
        self.expected = expected

    def _render_traceback_(self) -> list:
        """What IPython prints instead of a traceback: the message alone, wrapped at
        ``text_width.WIDTH`` characters at spaces (JupyterLab would break its words), a
        parenthesised phrase that fits on a line kept whole ("a unit slip? (s, ms, us; B,
        KB, MB, GB)" broke after "B,")."""
        text = wrap(f"Not yet: {self}", keep_parens=True)
        return ["\x1b[1;31mNot yet:\x1b[0m" + text[len("Not yet:"):]]


def _name(check) -> str:
    name = check if isinstance(check, str) else getattr(check, "__name__", None)
    if not isinstance(name, str) or not name.startswith("check_"):
        raise ValueError(f"reveal(check={check!r}): give a check function or its name, e.g. "
                         "wb.exercises.reveal(wb.exercises.check_training_days)")
    return name


def exercise(fn):
    """Count the wrong tries of check ``fn``; add the expected value to its message from
    try ``REVEAL_AFTER`` on.  A right answer resets the count."""
    name = fn.__name__
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def check(*args, **kwargs):
        try:                        # a call the check cannot take: say how to call it,
            signature.bind(*args, **kwargs)      # not a TypeError through its source
        except TypeError as err:
            raise CheckError(f"{name}({_params(signature)}): {err}; call it as the "
                             "exercise's cell does") from None
        try:
            out = fn(*args, **kwargs)
        except CheckError as err:
            n = _tries[name] = _tries.get(name, 0) + 1
            if err.expected is not None:
                _expected[name] = err.expected
                if n >= REVEAL_AFTER:
                    err.args = (f"{err.args[0]} (expected {err.expected})",)
                else:
                    err.args = (f"{err.args[0]} (try {n}; the expected value shows from try "
                                f"{REVEAL_AFTER} on, or now with "
                                f"wb.exercises.reveal({name!r}))",)
            raise
        _tries.pop(name, None)
        return out
    return check


def raised(what: str, err: BaseException) -> str:
    """What to tell a student whose own code (``what``: "your function", "your f") raised
    ``err`` inside a check: the stub's bare NotImplementedError asks for the code (it read
    "raised NotImplementedError: " with nothing after the colon), and a message of several
    lines (torch's list of an op's overloads) is cut to its first line."""
    name = type(err).__name__
    if isinstance(err, NotImplementedError) and not str(err).strip():
        return f"{what} raised {name}: replace the stub with your code"
    lines = str(err).strip().splitlines()
    first = re.sub(r",? *but expected one of:?$", "", lines[0]).rstrip(": ") if lines else ""
    return f"{what} raised {name}" + (f": {first}" if first else "")


def _params(signature) -> str:
    """A check's parameters as a student writes them: names and defaults, no annotations."""
    return ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}"
                     for p in signature.parameters.values())


class _Printed(str):
    """Text already printed: as a cell's last value it shows no second time."""

    def _ipython_display_(self) -> None:
        pass


def reveal(check) -> str:
    """Print (and return) the expected value of ``check``'s exercise, as its last wrong
    try computed it, wrapped at ``text_width.WIDTH`` characters.  The returned text is a ``str`` that a notebook does not display
    again as the cell's value (``reveal(...)`` alone in a cell showed it twice)."""
    name = _name(check)
    if name not in _expected and _tries.get(name):
        # wrong tries refused before a value was compared, or whose answer is code or a
        # plan: no one value to show
        text = (f"{name} has no value to reveal for your tries: their messages say what to "
                "change (an answer that is code or a plan has no single value)")
    elif name not in _expected:
        text = (f"{name} has no wrong try yet: run it once with your answer, then "
                f"reveal({name!r}) shows what it expects")
    else:
        text = f"{name} expects {_expected[name]}"
    text = wrap(text)           # at text_width.WIDTH, as the checks' messages
    print(text)
    return _Printed(text)


def reset_tries() -> None:
    """Forget every count and expected value (a fresh start, e.g. between tests)."""
    _tries.clear()
    _expected.clear()


# ---- a check run before its exercise is answered ----------------------------------------------
# In a student version (student.py) the answer cell holds nbgrader's stub, which raises
# NotImplementedError before it sets the answer's name; the check cell run next failed with
# a bare "NameError: name 'gb' is not defined" (browser review nb18).  The NameError is
# raised by the cell's own code, before any check runs, so only IPython can tell the
# student: a custom exception handler (IPython's InteractiveShell.set_custom_exc), for a
# NameError raised in a cell's own line that passes the undefined name to a
# wb.exercises.check_*; every other NameError gets IPython's usual traceback.


def _check_arguments(source: str) -> set:
    """The names passed (as arguments, or inside them) to ``exercises.check_*(...)`` calls
    in the cell ``source``; empty where it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr.startswith("check_") \
                and isinstance(node.func.value, (ast.Attribute, ast.Name)) \
                and getattr(node.func.value, "attr", getattr(node.func.value, "id", "")) \
                == "exercises":
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                names |= {n.id for n in ast.walk(arg) if isinstance(n, ast.Name)}
    return names


def unanswered_name(err: BaseException, tb=None) -> str | None:
    """What to tell a student whose check cell failed with NameError ``err`` (traceback
    ``tb``, by default ``err.__traceback__``) because an exercise's answer is not defined
    yet; None where the NameError is another one (raised in a function the cell called, or
    for a name no check is given)."""
    tb = tb if tb is not None else err.__traceback__
    name = getattr(err, "name", None)
    if not isinstance(err, NameError) or not name or tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if code.co_name != "<module>":          # raised inside a function: not the cell's line
        return None
    if name not in _check_arguments("".join(linecache.getlines(code.co_filename))):
        return None
    return (f"{name} is not defined yet: answer the exercise above first. Replace its "
            f"raise NotImplementedError() with code that sets {name}, run that cell, then "
            "this check")


def _name_handler(shell, etype, value, tb, tb_offset=None):
    """IPython's custom exception handler for NameError: the hint of
    :func:`unanswered_name` instead of a traceback (the cell still fails, with NameError),
    else IPython's own traceback."""
    text = unanswered_name(value, tb)
    if text is None:
        stb = shell.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
    else:
        # the stub's line kept whole ("raise" ended one line, NotImplementedError() began
        # the next): a no-break space, which wrap prints as a space
        text = wrap("Not yet: " + text.replace("raise NotImplementedError()",
                                               "raise\u00a0NotImplementedError()"),
                    keep_parens=True)
        stb = ["\x1b[1;31mNot yet:\x1b[0m" + text[len("Not yet:"):]]
    shell._showtraceback(etype, value, stb)
    return None


def _install_name_handler() -> bool:
    """Register :func:`_name_handler` with the running IPython shell, if any; a handler
    another tool set is kept (IPython holds one).  True when ours is in place."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or not hasattr(shell, "set_custom_exc"):
        return False
    if getattr(shell, "_workbench_name_handler", False):
        return True
    if shell.custom_exceptions not in ((), None):
        return False
    shell.set_custom_exc((NameError,), _name_handler)
    shell._workbench_name_handler = True
    return True


_install_name_handler()
