"""SPMD rules, one module per family. The rules are registered in the op table
(``parallel/ops_table``) together with each op's callables, local implementation and
cost; ``RULES`` is the table's view name -> rule."""
from .registry import (RULES, Candidate, Decision, NoRuleError, Strategy, combine,  # noqa: F401
                       describe, get_rule, infer, register_rule)
from ..ops_table.table import TABLE  # noqa: F401  (wb.spmd.TABLE: every op, its rule and cost)
from . import matmul, pointwise, reduction, indexing  # noqa: F401

# Families that register their ops beside their rules.
from . import norm, embedding, dropout, shape, attention  # noqa: F401,E402
