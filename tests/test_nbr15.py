"""Browser review of notebooks 02, 03 and 05 (nbr15): what the review mended, held here.

05's ZeRO figure drew its dashed line at ``A100.memory_bytes`` (85.1 GB, the 79.25 GiB
that CUDA reports on an A100 80GB) but labelled it "one A100 (80 GB)": on the GB axis the
line sat at 85 under a label that said 80.  A figure's memory line must say the figure it
is drawn at, so its label is computed from the same value (as notebook 01's already was).
Reads the notebooks' JSON only (no kernel).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _memory_lines(source: str):
    """(line, value expression, label node) of each ``hline=(v, label)`` / ``hlines=[...]``
    in ``source`` whose value reads a ``memory_bytes``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:                 # a cell with IPython magics: nothing to read here
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.keyword) or node.arg not in ("hline", "hlines"):
            continue
        pairs = [node.value] if node.arg == "hline" else getattr(node.value, "elts", [])
        for pair in pairs:
            if isinstance(pair, ast.Tuple) and len(pair.elts) == 2 and \
                    "memory_bytes" in ast.unparse(pair.elts[0]):
                out.append((pair.lineno, pair.elts[0], pair.elts[1]))
    return out


def _reads(label: ast.AST, value: ast.AST) -> bool:
    """Whether the label is an f-string that formats the line's own value (or the
    ``memory_bytes`` it is computed from)."""
    if not isinstance(label, ast.JoinedStr):
        return False
    want = {ast.dump(value)} | {ast.dump(n) for n in ast.walk(value)
                                if isinstance(n, ast.Attribute) and n.attr == "memory_bytes"}
    return any(ast.dump(n) in want for part in label.values
               if isinstance(part, ast.FormattedValue) for n in ast.walk(part.value))


def _cells(path: Path):
    for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        if cell["cell_type"] == "code":
            yield i, "".join(cell["source"])


def test_the_checker_tells_a_literal_label_from_a_computed_one():
    """The rule itself: the old 05 line fails it, 01's and the mended 05's pass."""
    old = 'bars({}, unit="GB", hline=(A100.memory_bytes / 1e9, "one A100 (80 GB)"))'
    new = ('bars({}, unit="GB", hline=(A100.memory_bytes / 1e9,\n'
           '     f"one A100 80GB ({A100.memory_bytes / 1e9:.1f} GB)"))')
    other = 'bars({}, hline=(A100.memory_bytes / 1e9, f"{H100.memory_bytes / 1e9:.1f} GB"))'
    (_, v_old, l_old), = _memory_lines(old)
    (_, v_new, l_new), = _memory_lines(new)
    (_, v_oth, l_oth), = _memory_lines(other)
    assert not _reads(l_old, v_old)
    assert _reads(l_new, v_new)
    assert not _reads(l_oth, v_oth)             # another device's memory is not the line's
    assert _memory_lines('lines([], hlines=[(0.10, "10%")])') == []


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_memory_lines_say_the_value_they_are_drawn_at(path):
    bad = [f"cell {i} line {line}: {ast.unparse(label)}"
           for i, src in _cells(path) for line, value, label in _memory_lines(src)
           if not _reads(label, value)]
    assert not bad, ("a dashed memory line whose label does not format the value it is "
                     "drawn at (e.g. '80 GB' over a line at 85.1): " + "; ".join(bad))


def test_05_zero_figure_is_labelled_with_its_value():
    """The mended cell is there, and the notebook still draws the figure it stored."""
    cells = json.loads((NOTEBOOKS / "05_data_parallel_and_zero.ipynb").read_text())["cells"]
    src, cell = next(("".join(c["source"]), c) for c in cells if c["cell_type"] == "code"
                     and "zero_model_state_bytes(7.5e9" in "".join(c["source"])
                     and "hline=" in "".join(c["source"]))
    assert '"one A100 (80 GB)"' not in src
    assert 'f"one A100 80GB ({A100.memory_bytes / 1e9:.1f} GB)"' in src
    assert any("image/png" in o.get("data", {}) for o in cell["outputs"])
