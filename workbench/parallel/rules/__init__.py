"""SPMD rules, one module per family; importing this registers them all."""
from .registry import (RULES, Candidate, Decision, NoRuleError, Strategy, combine,  # noqa: F401
                       describe, get_rule, infer, register_rule)
from . import matmul, pointwise, reduction  # noqa: F401
