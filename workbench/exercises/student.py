"""Student versions of the course notebooks: instructor solutions removed.

In a code cell, every region between a ``### BEGIN SOLUTION`` line and a
``### END SOLUTION`` line (markers included) becomes, at the marker's indentation,

    # YOUR CODE HERE
    raise NotImplementedError()

and a markdown cell holding such a region becomes "YOUR ANSWER HERE".  Outputs
and execution counts are cleared.

These are nbgrader's own markers and stubs (its ``ClearSolutions`` preprocessor),
and the notebooks carry nbgrader's cell metadata (solution cells; locked, graded
test cells with points), so ``nbgrader generate_assignment`` releases the same
student cells; ``tests/test_student_versions.py`` runs both and compares.  This
module needs no nbgrader: of its course directory, database and server
extensions, a student version needs only this one transformation.

    >>> make_student_versions("notebooks", "student")    # python -m workbench course student

:func:`make_work_copy` copies the notebooks a learner opens (``make course``), so that
JupyterLab's autosave never writes executed outputs into the course's own files.
"""
from __future__ import annotations

import copy
from pathlib import Path

__all__ = ["BEGIN", "END", "CODE_STUB", "TEXT_STUB", "strip_solutions", "student_notebook",
           "make_student_versions", "make_work_copy"]

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
CODE_STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")
TEXT_STUB = "YOUR ANSWER HERE"


def strip_solutions(source: str, stub=CODE_STUB, where: str = "cell") -> tuple[str, int]:
    """(source with each solution region replaced by ``stub``, number of regions).

    Markers are whole lines (surrounding spaces allowed).  An END without BEGIN, a
    BEGIN inside a region or a region left open is an error naming ``where`` and
    the line."""
    out, inside, count, indent = [], False, 0, ""
    lines = source.split("\n")
    for k, line in enumerate(lines, 1):
        mark = line.strip()
        if mark == BEGIN:
            if inside:
                raise ValueError(f"{where}, line {k}: {BEGIN!r} inside a solution region; "
                                 f"close the first one with {END!r}")
            inside, indent = True, line[:len(line) - len(line.lstrip())]
            out += [indent + s for s in stub]
            count += 1
        elif mark == END:
            if not inside:
                raise ValueError(f"{where}, line {k}: {END!r} without a {BEGIN!r} before it")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN!r} is never closed; add a line {END!r}")
    return "\n".join(out), count


def student_notebook(nb, name: str = "notebook"):
    """A copy of the nbformat notebook ``nb`` with solutions stripped and outputs cleared."""
    nb = copy.deepcopy(nb)
    for i, cell in enumerate(nb.cells):
        src = cell.source if isinstance(cell.source, str) else "".join(cell.source)
        where = f"{name}, cell {i}"
        if cell.cell_type == "code":
            cell.source, _ = strip_solutions(src, where=where)
            cell.outputs = []
            cell.execution_count = None
        elif cell.cell_type == "markdown":
            new, n = strip_solutions(src, stub=(TEXT_STUB,), where=where)
            cell.source = new if n else src
    return nb


def _course_notebooks(src_dir, out_dir, pattern: str, why: str) -> tuple[list[Path], Path]:
    """The notebooks ``src_dir/pattern`` (sorted) and the created ``out_dir``; refuses
    ``out_dir`` = ``src_dir`` (``why`` says what that would destroy)."""
    src, out = Path(src_dir), Path(out_dir)
    if not src.is_dir():
        raise ValueError(f"src_dir={str(src)!r} is not a directory of notebooks")
    if out.resolve() == src.resolve():
        raise ValueError(f"out_dir={str(out)!r} is the source directory: {why}; choose "
                         "another directory")
    paths = sorted(src.glob(pattern))
    if not paths:
        raise ValueError(f"no notebooks match {pattern!r} in {str(src)!r}")
    out.mkdir(parents=True, exist_ok=True)
    return paths, out


def make_student_versions(src_dir="notebooks", out_dir="student",
                          pattern: str = "[0-9][0-9]_*.ipynb") -> list[Path]:
    """Write a student version of every notebook ``src_dir/pattern`` into ``out_dir``
    (created if needed); returns the written paths, sorted.  Refuses to write into
    ``src_dir`` itself, which would destroy the instructor versions."""
    import nbformat
    paths, out = _course_notebooks(src_dir, out_dir, pattern,
                                   "the instructor notebooks would be overwritten")
    written = []
    for p in paths:
        nb = nbformat.read(p, as_version=4)
        dest = out / p.name
        nbformat.write(student_notebook(nb, p.name), dest)
        written.append(dest)
    return written


def make_work_copy(src_dir="notebooks", out_dir="work",
                   pattern: str = "[0-9][0-9]_*.ipynb") -> list[tuple[Path, bool]]:
    """Copy every notebook ``src_dir/pattern`` into ``out_dir`` unless a copy is already
    there (a learner's work is never overwritten); returns (path, copied) pairs, sorted.
    Refuses ``out_dir`` = ``src_dir``: the point is to keep the course's files clean."""
    import shutil
    paths, out = _course_notebooks(src_dir, out_dir, pattern,
                                   "autosave would write into the course's notebooks")
    done = []
    for p in paths:
        dest = out / p.name
        new = not dest.exists()
        if new:
            shutil.copyfile(p, dest)
        done.append((dest, new))
    return done
