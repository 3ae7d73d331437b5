"""The width the library's printed text keeps to, and the wrapping that keeps it there.

JupyterLab wraps a text output at about 100-105 characters (a 1300-1400 px window with
the file browser open), mid-token; ``Ranking.table``, ``Ranking.explain`` and
``Estimate.explain`` (the planner), ``Decision`` and ``Explanation.reasons`` (the SPMD
rules' choices) and the exercises' feedback print lines of at most ``WIDTH`` characters
instead.  Below every layer: it knows nothing of meshes or placements."""
from __future__ import annotations

import re
import textwrap

__all__ = ["HANG", "WIDTH", "wrap"]

WIDTH = 100
HANG = 4                # a continuation's indent beyond its line's own
# the spaces a line is never broken at, so that a figure stays beside its name and its
# unit, and a change beside its arrow ("bubble 0.109", "tp 2 -> 1", "-0.021 s", "#4"):
# the space before a number (signed, "#"- or "("-led), before an arrow or an operator
# (->, +, =, x, ..), before a unit, and after an arrow or "="
_GLUE = re.compile(r" (?=[-+(#]?\d|(?:->|\+|=|x|\.\.|s|ms|GB|MB|B|s/step)(?:[,;:)]*(?: |$)))"
                   r"|(?<=->) |(?<= =) ")
_NBSP = "\u00a0"


def wrap(text: str, width: int = WIDTH, keep_parens: bool = False) -> str:
    """``text`` with each line longer than ``width`` wrapped at spaces (not those
    ``_GLUE`` keeps), every continuation indented ``HANG`` spaces beyond the line's own
    indent (a hanging indent), so a reader sees where each line starts.  A no-break space
    (``"\\u00a0"``) in ``text`` also holds its two words together; it prints as a space.
    ``keep_parens``: a parenthesised phrase that fits on a continuation line is never
    split (:func:`_glue_parens`; the exercises' feedback: "a unit slip? (s, ms, us; B, KB,
    MB, GB)" broke after "B,").
    Words are never broken and nothing is dropped: the words of the result are ``text``'s."""
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line.replace(_NBSP, " "))
            continue
        body = line.lstrip(" ")
        indent = line[:len(line) - len(body)]
        if keep_parens:
            body = _glue_parens(body, width - len(indent) - HANG)
        wrapped = textwrap.fill(_GLUE.sub(_NBSP, body.rstrip(" ")), width,
                                initial_indent=indent, subsequent_indent=indent + " " * HANG,
                                break_long_words=False, break_on_hyphens=False)
        out.append(wrapped.replace(_NBSP, " "))
    return "\n".join(out)


def _glue_parens(text: str, fits: int) -> str:
    """``text`` with the spaces of each parenthesised phrase ("(...)", with what sticks to
    its closing parenthesis up to the next space: "GB):") made no-break where the phrase
    is at most ``fits`` characters; a longer one keeps its spaces, and its inner phrases
    are glued by the same rule."""
    out = list(text)

    def glue(start: int, end: int) -> None:       # text[start:end] is "(...)" + tail
        depth, inner = 0, None
        for i in range(start + 1, end - 1):
            if text[i] == "(":
                depth += 1
                if depth == 1:
                    inner = i
            elif text[i] == ")" and depth:
                depth -= 1
                if depth == 0:
                    k = _tail(i + 1)
                    if k - inner <= fits:
                        for j in range(inner, k):
                            if out[j] == " ":
                                out[j] = _NBSP
                    else:
                        glue(inner, k)

    def _tail(i: int) -> int:               # past the characters stuck to a ")"
        while i < len(text) and text[i] != " ":
            i += 1
        return i

    glue(-1, len(text) + 1)
    return "".join(out)
