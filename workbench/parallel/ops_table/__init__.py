"""The op table: one registration per op, in the module of its op family.

Shared machinery:

    table.py     the table (``register``, ``TABLE``, ``RULES``, ``BY_FUNC``)
    strategy.py  what a rule returns and how the cheapest strategy is chosen
                 (``Strategy``, ``combine``, ``infer``, ``register_rule``)
    costs.py     FLOPs and bytes helpers; pricing.py: compute events on the trace
    samples.py   the validator's sample calls; checks.py: torch as the judge on meta
    _util.py     dims and stacked-tensor helpers of the local implementations

Op families, each op's callables, parse, rule, local implementation, cost and validator
sample side by side (adding an op touches one of them and its test): ``pointwise``,
``casts``, ``select``, ``matmul``, ``reduction``, ``indexing``, ``shape``, ``reshape``,
``norm``, ``embedding``, ``cross_entropy``, ``dropout``, ``attention``, ``fused``.
:func:`load` imports them all."""
from .table import (BY_FUNC, OP_CLASSES, RULES, TABLE, OpEntry, register,  # noqa: F401
                    unregister)

FAMILIES = ("norm", "embedding", "cross_entropy", "dropout", "shape", "reshape", "attention",
            "fused", "matmul", "indexing", "pointwise", "casts", "select", "reduction")


def load():
    """Import every op family's module (idempotent)."""
    import importlib
    for name in FAMILIES:
        importlib.import_module(f"{__name__}.{name}")
