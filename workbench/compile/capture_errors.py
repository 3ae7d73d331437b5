"""How capture says it cannot go on: :class:`CaptureError` (an op or a habit it cannot
map onto the op table) and :class:`Broken` (a graph break), the user's source line they
point at (:func:`_user_frame`), and the breaks read off ``torch.export``'s messages."""
from __future__ import annotations

import os
import re
import traceback

import torch

from .graph import GraphBreak


class CaptureError(RuntimeError):
    """The program calls something capture cannot map onto the op table; ``where``: the
    user's (file, line, code) that did it, where known."""

    def __init__(self, msg: str, where: tuple | None = None):
        super().__init__(msg)
        self.where = where


class Broken(Exception):
    """Capture stopped at a graph break (``.brk``)."""

    def __init__(self, brk: GraphBreak):
        super().__init__(str(brk))
        self.brk = brk


_HERE = os.path.dirname(__file__)
_TORCH = os.path.dirname(torch.__file__)


def _data_dependent(func, e):
    """Raise a CaptureError that says so where ``func`` raised ``e`` on the meta stand-ins
    because its output's shape or value is the data's (``nonzero``, ``masked_select``,
    ``unique``, ``torch.equal``: torch has no meta kernel for them, as none can know it)."""
    msg = str(e)
    if not isinstance(e, NotImplementedError) or not (
            "Meta tensors" in msg or "register_meta" in msg or "data-dependent" in msg):
        return
    f, line, code = _user_frame()
    raise CaptureError(
        f"{getattr(func, '__name__', func)} at {f}:{line} ({code}): its output's shape or "
        "value depends on the tensor's data (data-dependent), which capture, running the "
        "program on meta tensors of the global shapes, cannot know: a graph break, the "
        "program runs eagerly (compute it outside the compiled function, or give a fixed "
        "size: torch.where for a mask, topk for a count)", where=(f, line, code))


def _user_frame(tb=None, skip=()):
    """(file, line, code) of the innermost frame outside torch and this package (of the
    stack now, or of the traceback ``tb`` of an exception), and outside the files
    ``skip`` (``parallel/reshard.py`` for a ``wb.reshard`` the tracer is handed)."""
    frames = traceback.extract_stack() if tb is None else traceback.extract_tb(tb)
    # (an exception raised inside workbench, wb.reshard on a meta tensor, is the user's
    # call of it that raised)
    ours = _HERE if tb is None else os.path.dirname(_HERE)
    for fr in reversed(frames):
        f = os.path.abspath(fr.filename)
        if f.startswith(_TORCH) or f.startswith(ours) or "/contextlib.py" in f or f in skip:
            continue
        return f, fr.lineno or 0, (fr.line or "").strip()
    return "?", 0, ""


def break_from_export_error(e: Exception) -> GraphBreak | None:
    """The source line of a data-dependent guard in ``torch.export``'s message."""
    msg = str(e)
    if "data-dependent" not in msg and "GuardOnDataDependent" not in type(e).__name__:
        return None
    m = list(re.finditer(r'File "([^"]+)", line (\d+), in \S+\n\s+(.*)', msg))
    if not m:
        return GraphBreak(msg.splitlines()[0][:200], "?", 0, "")
    f, line, code = m[-1].group(1), int(m[-1].group(2)), m[-1].group(3).strip()
    return GraphBreak("torch.export: " + msg.splitlines()[0][:160], f, line, code)
