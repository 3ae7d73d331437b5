"""The one op table: everything the library knows about an op, in one registration.

    register("relu", [torch.relu, F.relu, Tensor.relu], parse=..., rule=..., local=...,
             cost=..., op_class="elementwise", sample=...)

Each op family registers its ops in its own module of this package (``pointwise.py``,
``matmul.py``, ``norm.py``...), every registration beside the rule, parse, local
implementation, cost and validator sample it names; :func:`load` in ``__init__.py``
imports them all.

One :class:`OpEntry` per op name holds

* ``funcs``: the PyTorch callables it answers to (``torch.x``, ``Tensor.x``, ``F.x``,
  operator dunders); the dispatcher looks them up in :data:`BY_FUNC`;
* ``parse(*args, **kwargs) -> (inputs, attrs)``: the tensor-or-constant inputs in the
  order the rule sees them, and hashable attributes;
* ``rule(*specs, **attrs) -> [Strategy]``: the SPMD rule (``strategy.py``: what a
  strategy is, how the cheapest is chosen);
* ``local(nd, ctx, *locals, **attrs)``: the op on stacked local tensors (``nd``
  leading device axes; ``nd == 0`` and ``ctx is None`` on the meta device);
* ``cost(ins, outs, **attrs) -> Cost``: FLOPs and bytes, forward and backward, from
  the per-rank (local) meta tensors (``costs.py``);
* ``op_class``: "matmul", "attention", "elementwise", "norm", "reduction",
  "data_movement", "view" (no kernel), "loss", "embedding";
* ``sample(g) -> [Sample]``: the validator's calls of the op on data drawn from ``g``
  (``samples.py``), or a str saying why the op cannot be validated.

``RULES`` (``wb.spmd``), ``wb.register_rule``, the dispatcher, ``explain`` and the
validator all read this table.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["OpEntry", "TABLE", "BY_FUNC", "RULES", "OP_CLASSES", "register", "unregister",
           "entry", "on_change"]

OP_CLASSES = ("matmul", "attention", "elementwise", "norm", "reduction", "data_movement",
              "view", "loss", "embedding")


@dataclass
class OpEntry:
    """Everything about one op (see the module docstring)."""
    name: str
    funcs: tuple = ()
    parse: Callable | None = None
    rule: Callable | None = None
    local: Callable | None = None
    cost: Callable | None = None
    op_class: str | None = None
    n_out: int = 1
    multi: bool = False      # returns a tuple of outputs (any number, e.g. split)
    meta_check: bool = True  # run the torch callable on meta tensors to check shape/dtype/errors
    sample: Callable | str | None = None   # the validator's calls (or why there are none)
    extra: dict = field(default_factory=dict)

    @property
    def runs(self) -> bool:
        """It can run on DistTensors: callables, a parse and a local implementation."""
        return bool(self.funcs) and self.parse is not None and self.local is not None


TABLE: dict[str, OpEntry] = {}
BY_FUNC: dict[Any, tuple] = {}          # callable -> (entry, parse for that callable)
_LISTENERS: list[Callable] = []        # caches to clear when a rule changes


def on_change(fn: Callable) -> Callable:
    """Call ``fn()`` whenever a rule or an entry changes (caches keyed by op name)."""
    _LISTENERS.append(fn)
    return fn


def _changed():
    for fn in _LISTENERS:
        fn()


def entry(name: str) -> OpEntry:
    """The entry of ``name`` (created empty if absent)."""
    e = TABLE.get(name)
    if e is None:
        e = TABLE[name] = OpEntry(name)
    return e


def register(name: str, funcs=(), *, parse=None, rule=None, local=None, cost=None,
             op_class=None, n_out=1, multi=False, meta_check=True, sample=None,
             override=False) -> OpEntry:
    """Register op ``name``: its callables, parse, rule, local implementation, cost and
    validator sample. One call per op; ``override=True`` replaces a registration."""
    if op_class is not None and op_class not in OP_CLASSES:
        raise ValueError(f"register({name!r}): op_class={op_class!r}; use one of {OP_CLASSES}")
    if sample is not None and not (callable(sample) or isinstance(sample, str)):
        raise TypeError(f"register({name!r}): sample={sample!r:.60}; give a function "
                        "g -> [Sample] (see samples.py), a str saying why the op cannot be "
                        "validated, or None")
    old = TABLE.get(name)
    if old is not None and old.runs and not override:
        raise ValueError(f"op {name!r} is registered already; pass override=True to replace it")
    e = entry(name)
    e.funcs = ()
    e.parse, e.local, e.cost, e.op_class = parse, local, cost, op_class
    e.rule = rule if rule is not None else e.rule
    e.n_out, e.multi, e.meta_check, e.sample = n_out, multi, meta_check, sample
    add_funcs(name, funcs)
    _changed()
    return e


def unregister(name: str) -> None:
    """Remove op ``name``: its entry, rule and callables (a toy op in a test)."""
    e = TABLE.pop(name, None)
    if e is None:
        raise KeyError(f"unregister({name!r}): no op of that name in the table")
    for f in e.funcs:
        if BY_FUNC.get(f, (None,))[0] is e:
            del BY_FUNC[f]
    _changed()


def add_funcs(name: str, funcs, parse=None) -> None:
    """More callables answering to op ``name``. An item may be ``(callable, parse)``
    for a callable with its own argument order (``Tensor.__rsub__(x, c)`` is
    ``sub(c, x)``); ``parse`` applies to the plain callables given here."""
    e = TABLE[name]
    for f in funcs:
        own = parse or e.parse
        if isinstance(f, tuple):
            f, own = f
        if f is None:
            continue
        e.funcs = e.funcs + (f,)
        BY_FUNC[f] = (e, own)


class _Rules(MutableMapping):
    """``RULES[name]``: the SPMD rule of op ``name``, a view of :data:`TABLE`.

    Setting a rule for a name the table lacks creates a rule-only entry (an op to
    study with ``wb.spmd.infer``; it runs once it has callables and a local)."""

    def __getitem__(self, name):
        e = TABLE.get(name)
        if e is None or e.rule is None:
            raise KeyError(name)
        return e.rule

    def __setitem__(self, name, rule):
        if not callable(rule):
            raise TypeError(f"RULES[{name!r}] = {rule!r}: a rule is a function "
                            "rule(*specs, **attrs) -> strategies")
        if name not in TABLE:
            entry(name).extra["user"] = True         # a rule to study; not a built-in op
        TABLE[name].rule = rule
        _changed()

    def __delitem__(self, name):
        e = TABLE.get(name)
        if e is None or e.rule is None:
            raise KeyError(name)
        e.rule = None
        if not e.runs:
            del TABLE[name]
        _changed()

    def __iter__(self):
        return iter([n for n, e in TABLE.items() if e.rule is not None])

    def __len__(self):
        return sum(1 for e in TABLE.values() if e.rule is not None)

    def __repr__(self):
        return f"RULES({len(self)} ops: {', '.join(sorted(self))})"


RULES = _Rules()
