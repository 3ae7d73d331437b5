"""The op table: one registration per op, in the module of its op family.

Shared machinery:

    table.py     the table (``register``, ``TABLE``, ``RULES``, ``BY_FUNC``)
    strategy.py  what a rule returns and how the cheapest strategy is chosen
                 (``Strategy``, ``combine``, ``infer``, ``register_rule``)
    costs.py     FLOPs and bytes helpers; pricing.py: compute events on the trace
                 (loss_pricing.py: the loss at a profile's measured rate;
                 attention_pricing.py: fused attention at the profile's rate for its shape)
    samples.py   the validator's sample calls; checks.py: torch as the judge on meta
    _util.py     dims and stacked-tensor helpers of the local implementations

Op families, each op's callables, parse, rule, local implementation, cost and validator
sample side by side (adding an op touches one of them and its test): ``pointwise``,
``casts``, ``select``, ``matmul``, ``reduction``, ``indexing``, ``shape``, ``reshape``,
``norm``, ``embedding``, ``cross_entropy``, ``dropout``, ``attention``, ``fused``, ``moe``,
``sampling``, ``reorder``, ``sort``, ``pointwise_math``, ``pad``, ``scans``,
``accumulate``, ``diagonal``, ``complex``, ``datadep``, ``index_bounds``, and for CNNs
``conv``, ``pool``, ``batch_norm``, ``group_norm`` (group and instance norm).
:func:`load` imports them all.

Adding an op is one ``register`` call in the module of its family, beside its rule::

    register("relu", [torch.relu, F.relu, Tensor.relu],
             parse=lambda x: ((x,), {}),                  # (inputs, attributes)
             rule=relu_rule,                              # strategy.py: what it returns
             local=lambda nd, ctx, x: torch.relu(x),      # on the stacked local tensors
             cost=costs.elementwise(1), op_class="elementwise",
             sample=lambda g: [Sample(torch.relu, (g.rn(5, 6),))])   # for the validator

and a test (``tests/test_op_toy.py`` adds one from a module of its own)."""
from .table import (BY_FUNC, OP_CLASSES, RULES, TABLE, OpEntry, register,  # noqa: F401
                    unregister)

# the op families' modules, in registration order (a new family is added here)
FAMILIES = ("norm", "embedding", "cross_entropy", "dropout", "shape", "reshape", "attention",
            "fused", "matmul", "indexing", "pointwise", "casts", "select", "reduction",
            "tensor_habits", "moe")
FAMILIES += ("ring_attention",)     # context parallelism's step (strategies/context_parallel.py)
FAMILIES += ("sampling",)           # argmax / topk / multinomial: decoding (serve)
FAMILIES += ("reorder", "sort")     # flip / roll; sort / argsort / msort
FAMILIES += ("pointwise_math",)     # exp2, log2, trunc, isinf, hardswish, fmax... and aliases
FAMILIES += ("pad", "scans")        # F.pad (constant); cummax / cummin / logcumsumexp
FAMILIES += ("accumulate",)         # scatter_add / index_add
FAMILIES += ("diagonal",)           # diagonal (trace, diag: composites.py)
FAMILIES += ("complex",)            # view_as_complex / view_as_real / complex / polar
FAMILIES += ("datadep",)            # masked_select / nonzero / unique / x[mask]: replicated
FAMILIES += ("conv", "pool", "batch_norm", "group_norm")   # CNNs: conv, pooling, BN / GN / IN
FAMILIES += ("take",)               # torch.take: the input whole, the index sharded
FAMILIES += ("quantile", "searchsorted")    # order statistics; binary search in a sorted dim
FAMILIES += ("index_bounds",)     # a computed index checked where its values are known
FAMILIES += ("layout_hooks",)     # the recipes' layout hooks (Megatron f, g), captured
FAMILIES += ("overwrite",)        # a value written over one with history (wb.compile's writes)
FAMILIES += ("mode", "unfold", "distances")   # torch.mode; Tensor.unfold; renorm


def load():
    """Import every op family's module (idempotent)."""
    import importlib
    for name in FAMILIES:
        importlib.import_module(f"{__name__}.{name}")
