"""Where a timeline writes each bar's label: inside the bar where the label fits, else a
circled number in the bar and the label in a key under the axis ("① attention A").

A short bar (notebook 10's all-reduce of one copy, "attention A"; a short backward
kernel, "wqkv dW A") keeps its name this way instead of losing it.  One number per
distinct label: the same label on several ranks or bars reads with one key entry.  A bar
too narrow even for its number (under ``MARK_PT`` points) stays unmarked, as do labels
past the tenth keyed one (the font has circled numbers ① to ⑩ only); ``place_labels``
returns what it left out so that a caller or a test can see it.

Widths are estimated from the character count (7 pt text, about ``CHAR_PT`` points a
character in DejaVu Sans), which is what the timeline has always used to decide.
"""
from __future__ import annotations

__all__ = ["MARKS", "CHAR_PT", "MARK_PT", "fits", "place_labels", "key_lines"]

MARKS = "①②③④⑤⑥⑦⑧⑨⑩"            # U+2460..2469, in DejaVu Sans
CHAR_PT = 4.2                          # points per character of 7 pt DejaVu Sans (estimate)
MARK_PT = 10.0                         # a circled number (9 pt) plus a point of margin each side
KEY_CHARS = 120                        # characters per key line (8 pt, the axes' width)


def fits(text: str, width_pt: float) -> bool:
    """Whether ``text`` fits a bar ``width_pt`` points wide (2 pt margin each side)."""
    return width_pt >= CHAR_PT * len(text) + 4


def place_labels(texts, pt_per_unit: float):
    """Split ``texts`` [(x, y, label, width in axis units)] into (inside, marked, key,
    left_out): ``inside`` [(x, y, label)] written in their bars, ``marked`` [(x, y,
    mark)] circled numbers, ``key`` {label: mark} in order of first appearance,
    ``left_out`` the labels drawn nowhere (bars too narrow, or past the tenth mark)."""
    inside, marked, key, left_out = [], [], {}, []
    for x, y, label, w in texts:
        width = w * pt_per_unit
        if fits(label, width):
            inside.append((x, y, label))
        elif width >= MARK_PT and (label in key or len(key) < len(MARKS)):
            mark = key.setdefault(label, MARKS[len(key)])
            marked.append((x, y, mark))
        else:
            left_out.append(label)
    return inside, marked, key, left_out


def key_lines(key: dict) -> list[str]:
    """The key's text, "① attention A   ② attention B", wrapped at ``KEY_CHARS``."""
    lines, line = [], ""
    for label, mark in key.items():
        entry = f"{mark} {label}"
        if line and len(line) + 3 + len(entry) > KEY_CHARS:
            lines.append(line)
            line = entry
        else:
            line = f"{line}   {entry}" if line else entry
    return lines + ([line] if line else [])
