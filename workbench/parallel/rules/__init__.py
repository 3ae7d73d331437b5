"""SPMD rules, one module per family; importing this registers them all."""
from .registry import (RULES, Candidate, Decision, NoRuleError, Strategy, combine,  # noqa: F401
                       describe, get_rule, infer, register_rule)
from . import matmul, pointwise, reduction  # noqa: F401

# Rule families written in parallel; each module registers its rules and ops.
import importlib as _importlib

for _m in ("norm", "embedding", "dropout", "shape", "attention"):
    try:
        _importlib.import_module(f"{__name__}.{_m}")
    except ModuleNotFoundError as _e:
        if _e.name != f"{__name__}.{_m}":
            raise
