"""The op table: one registration per op (callables, parse, SPMD rule, local
implementation, cost). ``table.py`` holds the table; the other modules register the
ops (shape, norm, attention and embedding ops register beside their rules, in
``rules/``). :func:`load` imports them all."""
from .table import BY_FUNC, OP_CLASSES, RULES, TABLE, OpEntry, register  # noqa: F401


def load():
    """Import every module that registers ops (idempotent)."""
    from .. import rules  # noqa: F401  (shape, norm, attention, embedding, dropout)
    from . import contractions, indexing, pointwise, reductions, tensor_habits  # noqa: F401
    TABLE["topk"].extra["result_type"] = reductions.TOPK_RESULT
