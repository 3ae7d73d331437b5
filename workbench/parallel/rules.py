"""``wb.spmd``: the SPMD rules' public names (:func:`infer`, :func:`register_rule`,
:data:`RULES`, :data:`TABLE`, :func:`combine`, ...).

Each op's rule is registered with the op itself, beside its callables, parse, local
implementation, cost and validator sample, in the module of its op family in
``parallel/ops_table/`` (``pointwise.py``, ``matmul.py``, ``norm.py``...); what a rule
returns and how the cheapest strategy is chosen is ``ops_table/strategy.py``.
``RULES`` is the op table's view name -> rule."""
from .ops_table.strategy import (Candidate, Decision, NoRuleError, Strategy,  # noqa: F401
                                 combine, describe, get_rule, infer, register_rule,
                                 strategy_cost)
from .ops_table.table import RULES, TABLE  # noqa: F401  (wb.spmd.TABLE: every op)

__all__ = ["infer", "register_rule", "get_rule", "combine", "describe", "strategy_cost",
           "Strategy", "Candidate", "Decision", "NoRuleError", "RULES", "TABLE"]
