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


def wrap(text: str, width: int = WIDTH) -> str:
    """``text`` with each line longer than ``width`` wrapped at spaces (not those
    ``_GLUE`` keeps), every continuation indented ``HANG`` spaces beyond the line's own
    indent (a hanging indent), so a reader sees where each line starts.  A no-break space
    (``"\\u00a0"``) in ``text`` also holds its two words together; it prints as a space.
    Words are never broken and nothing is dropped: the words of the result are ``text``'s."""
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line.replace(_NBSP, " "))
            continue
        body = line.lstrip(" ")
        indent = line[:len(line) - len(body)]
        wrapped = textwrap.fill(_GLUE.sub(_NBSP, body.rstrip(" ")), width,
                                initial_indent=indent, subsequent_indent=indent + " " * HANG,
                                break_long_words=False, break_on_hyphens=False)
        out.append(wrapped.replace(_NBSP, " "))
    return "\n".join(out)
