"""SPMD rules: for one operator, which placements work and what comes out.

A rule looks at the input specs (shape, mesh, placements) and the attributes and
returns the *strategies* that are valid: for each input the placements it must
have, and the placements of each output.  The chooser prices every strategy with
the reshard planner on the current hardware profile (the communication needed to
bring each input to what the strategy requires) and picks the cheapest; ties go
to the first strategy in the rule's own order, so the choice is deterministic.

    def relu_rule(x, **attrs):              # one TensorSpec per tensor input
        opts = [((R,), (R,), "replicated")] + [
            ((Shard(d),), (Shard(d),), f"dim {d} sharded passes") for d in range(x.ndim)]
        return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)

Most rules are written per mesh dimension like this one: a list of (input placements,
output placements, note) choices for one mesh dim, combined over the mesh dims by
:func:`combine`. A built-in op's rule is registered with the op, by ``register(...,
rule=relu_rule, ...)`` in its family's module; ``@register_rule(name)`` (``wb.register_rule``)
replaces the rule of an op, or adds a rule to study with :func:`infer` (notebook 04).
"""
from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from ...sim_mesh.profiles import get_profile
from ...sim_mesh.trace import current_trace
from ...text_width import wrap
from .table import RULES, TABLE, on_change
from ..placement import Replicate, fmt_placements

__all__ = ["Strategy", "Candidate", "Decision", "register_rule", "get_rule", "infer", "infer_on",
           "combine", "RULES", "NoRuleError", "describe", "strategy_cost", "backward_price",
           "BACKWARD_OF", "BACKWARD_PRICED", "grad_reduction_steps"]

R = Replicate()


class NoRuleError(NotImplementedError):
    """An op has no SPMD rule."""


@dataclass(frozen=True)
class Strategy:
    """Required placements per tensor input (None: not a tensor) and per output.

    ``deferred``: ((mesh dim, bytes), ...) reductions the strategy's partial output
    defers beyond its inputs' (a partial input broadcast to a bigger output); ranked as
    the reduce-scatter of those bytes, as a zero-padded partial is."""
    inputs: tuple
    outputs: tuple
    note: str = ""
    deferred: tuple = ()


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    plans: tuple            # one reshard Plan (or None) per input
    time: float             # modeled seconds of the inserted communication
    bytes: int              # bytes each rank sends for it
    deferred_time: float = 0.0   # what a zero-padded partial will cost to reduce later
    deferred_bytes: int = 0
    backward_time: float = 0.0   # the plans' transposes for inputs that require grad
    backward_bytes: int = 0      # (:func:`backward_price`)

    @property
    def rank_key(self) -> tuple:
        """What the chooser minimizes: (time + deferred + backward, bytes + deferred +
        backward)."""
        return (self.time + self.deferred_time + self.backward_time,
                self.bytes + self.deferred_bytes + self.backward_bytes)

    @property
    def collectives(self) -> list[str]:
        return [k for p in self.plans if p is not None for k in p.collectives()]

    def __str__(self) -> str:
        ins = ", ".join(fmt_placements(p) if p is not None else "-" for p in self.strategy.inputs)
        outs = ", ".join(fmt_placements(p) for p in self.strategy.outputs)
        comm = ", ".join(self.collectives) or "no communication"
        why = ("a partial input broadcast to a bigger partial output" if self.strategy.deferred
               else "zero-padded into a partial sum")
        later = (f" ({why}: ranked as the reduce-scatter it defers, "
                 f"{self.deferred_bytes:,d} B, {self.deferred_time * 1e6:.2f} us)"
                 if self.deferred_bytes or self.deferred_time else "")
        if self.backward_bytes or self.backward_time:
            later += (f" (+ backward {self.backward_bytes:,d} B, "
                      f"{self.backward_time * 1e6:.2f} us)")
        return f"({ins}) -> ({outs}): {comm}, {self.bytes:,d} B, {self.time * 1e6:.2f} us{later}"


@dataclass(frozen=True)
class Decision:
    """What a rule decided for one call, and why."""
    op: str
    specs: tuple            # the input TensorSpecs (None for non-tensors)
    candidates: tuple       # every valid candidate, cheapest first
    reason: str

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]

    @property
    def inputs(self) -> tuple:
        return self.chosen.strategy.inputs

    @property
    def outputs(self) -> tuple:
        return self.chosen.strategy.outputs

    def __str__(self) -> str:
        """The reason, then the candidates (``*`` the chosen), each line within
        ``text_width.WIDTH`` characters (continuations indented)."""
        lines = [f"{self.op}: {self.reason}"]
        for i, c in enumerate(self.candidates[:8]):
            lines.append(f"  {'*' if i == 0 else ' '} {c}")
        if len(self.candidates) > 8:
            lines.append(f"    ... {len(self.candidates) - 8} more")
        return wrap("\n".join(lines))


def register_rule(*names: str, override: bool = False):
    """Register ``fn(*specs, **attrs) -> Iterable[Strategy]`` as the rule of ``names``
    (in the op table: an op that runs keeps its callables, local and cost)."""
    def deco(fn):
        for n in names:
            if n in RULES and not override:
                raise ValueError(f"a rule for {n!r} exists; pass override=True to replace it")
            RULES[n] = fn
        return fn
    return deco


def get_rule(op: str):
    try:
        return RULES[op]
    except KeyError:
        raise NoRuleError(
            f"no SPMD rule for {op!r}. Register one with "
            f"@workbench.register_rule({op!r}) (see notebook 04), or opt in to the "
            "replicate fallback with `with workbench.allow_replicate_fallback():` "
            "(it gathers every input, runs the op on one device's copy, and is "
            "recorded in the trace)") from None


def combine(mesh_ndim: int, per_dim: Sequence[Sequence[tuple]], n_inputs: int,
            n_outputs: int = 1, limit: int = 512) -> list[Strategy]:
    """Combine per-mesh-dim options into strategies.

    ``per_dim[i]`` lists options for mesh dim i, each
    ``(input placements (one per input, None for non-tensors), output placements
    (one per output), note)``.

    The strategies depend on nothing but the arguments' values, and are frozen: they are
    built once per distinct argument values (:data:`_COMBINED`) and each call gets a new
    list of them (a rule may extend or filter its list).  Building them was ~40% of a
    first call of linear on a 2 x 2 mesh (49 strategies, ~0.7 ms; task speed18b); the
    key's hash reads every option (placements compare by value)."""
    try:
        key = (mesh_ndim, tuple(map(tuple, per_dim)), n_inputs, n_outputs, limit)
        hit = _COMBINED.get(key)
    except TypeError:           # an option holding a list: built every time
        key = hit = None
    if hit is None:
        hit = tuple(_combine(mesh_ndim, per_dim, n_inputs, n_outputs, limit))
        if key is not None:
            if len(_COMBINED) > 4096:
                _COMBINED.clear()
            _COMBINED[key] = hit
    return list(hit)


_COMBINED: dict = {}    # combine's arguments -> its strategies (a tuple of frozen ones)


def _combine(mesh_ndim, per_dim, n_inputs, n_outputs, limit) -> list[Strategy]:
    out = []
    sizes = [len(o) for o in per_dim]
    if math.prod(sizes) > limit:
        per_dim = [o[:max(1, int(limit ** (1 / mesh_ndim)))] for o in per_dim]
    # (the transposes below are zip(*...), one C call per strategy instead of a generator
    # per input: the first call of an op on a new layout builds every combination, e.g.
    # 49 of linear's on a 2 x 2 mesh; the strategies are the same)
    for combo in itertools.product(*per_dim):
        first = combo[0][0]
        cols = list(zip(*[c[0] for c in combo]))[:n_inputs]
        # (an option short of an input's placement: cols[k] raises the IndexError the
        # generator did; short of an output's: the generator below raises it)
        ins = tuple(None if first[k] is None else cols[k] for k in range(n_inputs))
        outs = tuple(zip(*[c[1] for c in combo]))[:n_outputs]
        if len(outs) < n_outputs:
            outs = tuple(tuple(c[1][j] for c in combo) for j in range(n_outputs))
        notes = [c[2] for c in combo if len(c) > 2 and c[2]]
        out.append(Strategy(ins, outs, "; ".join(notes)))
    return out


# ---- choosing ----------------------------------------------------------------------------

def _profile_name():
    tr = current_trace()
    return tr.profile.name if tr is not None else get_profile(None).name


def infer(op: str, *specs, _grads: tuple = (), **attrs) -> Decision:
    """Decide placements for ``op`` on inputs ``specs`` (TensorSpec, or None for
    non-tensor arguments), without running anything. ``attrs``: the op's attributes as
    torch names them (``dim=-1``, ``keepdim=True``); a name the op does not take is a
    TypeError (a rule would ignore it: ``dims=-1`` on sum would reduce every dim).
    ``_grads``: per input, whether its gradient is wanted (the dispatcher's: the input
    requires grad under grad mode), or, for a ``wb.reshard`` result with its way back,
    that way's ``reshard_backward.way_key``; those inputs' plans are also priced in
    backward (:func:`backward_price`).  () prices the forward alone."""
    attrs = _check_attr_names(op, specs, attrs)
    frozen = tuple(sorted((k, _freeze(v)) for k, v in attrs.items()))
    return _infer_cached(op, tuple(specs), frozen, _profile_name(), grads_key(_grads))


def infer_on(profile: str, op: str, *specs, _grads: tuple = (), **attrs) -> Decision:
    """:func:`infer` priced on the hardware profile named ``profile`` (not the current
    trace's): what the dispatcher decides when it runs under that profile's clock."""
    attrs = _check_attr_names(op, specs, attrs)
    frozen = tuple(sorted((k, _freeze(v)) for k, v in attrs.items()))
    return _infer_cached(op, tuple(specs), frozen, get_profile(profile).name,
                         grads_key(_grads))


def grads_key(grads) -> tuple:
    """``grads`` as the decision's cache key holds it: () where no input wants a gradient
    (the forward-only decision, shared by every such call)."""
    grads = tuple(g if type(g) is tuple else bool(g) for g in grads)
    return grads if any(grads) else ()


def _check_attr_names(op, specs, attrs) -> dict:
    """``attrs`` as the op's rule takes them, checked.  Every attribute is one the op's
    rule or local implementation names, where they list them (a local without
    ``**kwargs``: the dispatcher's parse gives it every attribute, so the names it takes
    are all the op has). NumPy's ``axis`` / ``keepdims`` are renamed in place to torch's
    ``dim`` / ``keepdim``, as torch's argument parser takes them (``torch.sum(x,
    axis=-1)``).  Torch's own arguments where the rule names them otherwise
    (``transpose``'s ``dim0`` / ``dim1``, the rule's ``dims`` permutation; ``unsqueeze``'s
    ``dim``, the rule's ``shape``) go through the op's parse on meta tensors of the
    specs, as the dispatcher's call would.  A required attribute left out raises naming
    it, both spellings and an example (it was a bare ``TypeError`` from the rule:
    ``permute_rule() missing 1 required positional argument: 'dims'``)."""
    n_specs = len(specs)
    names = _attr_names(TABLE[op].rule, TABLE[op].local, n_specs) if op in TABLE else None
    for np_name, name in (("axis", "dim"), ("keepdims", "keepdim")):   # as torch's parser
        if np_name in attrs and name not in attrs and names and name in names:
            attrs[name] = attrs.pop(np_name)
    bad = sorted(set(attrs) - names) if names is not None else []
    if bad:
        parsed = _torch_attrs(op, specs, attrs)
        if parsed is None:
            raise TypeError(f"infer({op!r}): unexpected attribute {bad[0]}={attrs[bad[0]]!r}; "
                            f"{op} takes {', '.join(sorted(names)) or 'no attributes'}"
                            f"{_torch_names_note(op, n_specs)}")
        attrs = parsed
    rule = TABLE[op].rule if op in TABLE else None
    missing = [n for n in _required_names(rule, n_specs) if n not in attrs]
    if missing:
        raise TypeError(
            f"infer({op!r}): missing attribute {missing[0]!r}, which {op}'s rule needs; give "
            f"it by name as the rule takes it ({op} takes {', '.join(sorted(names or missing))}"
            f"{_example(op)}){_torch_names_note(op, n_specs)}")
    return attrs


@lru_cache(maxsize=1024)
def _required_names(rule, n_specs) -> tuple:
    """The attributes ``rule`` cannot do without (no default, after its tensor inputs)."""
    if rule is None:
        return ()
    try:
        ps = list(inspect.signature(rule).parameters.values())
    except (TypeError, ValueError):
        return ()
    pos = [p for p in ps if p.kind is p.POSITIONAL_OR_KEYWORD][n_specs:]
    if any(p.kind is p.VAR_POSITIONAL for p in ps):     # cat_rule(*xs, dim): keywords only
        pos = []
    return tuple(p.name for p in pos + [p for p in ps if p.kind is p.KEYWORD_ONLY]
                 if p.default is p.empty)


def _torch_names(op, n_specs) -> tuple:
    """The argument names of the op's parse (torch's, e.g. ``dim0``, ``dim1``) after its
    tensor inputs, or () where it has none to tell."""
    e = TABLE.get(op)
    return _parse_names(e.parse, e.rule, n_specs) if e is not None else ()


@lru_cache(maxsize=1024)
def _parse_names(parse, rule, n_specs) -> tuple:
    try:
        ps = list(inspect.signature(parse).parameters.values())
        if any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(rule).parameters.values()):
            return ()           # cat_rule(*xs): its parse takes the tensors as one list
    except (TypeError, ValueError):
        return ()
    if any(p.kind is p.VAR_POSITIONAL for p in ps[:n_specs]):
        return ()
    return tuple(p.name for p in ps[n_specs:]
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and
                 not p.name.startswith("_") and p.name != "out")


def _torch_names_note(op, n_specs) -> str:
    torch_names = _torch_names(op, n_specs)
    return (f", or torch's arguments ({', '.join(f'{n}=' for n in torch_names)}), which "
            "infer turns into the rule's through the op's parse") if torch_names else ""


def _example(op) -> str:
    """``; e.g. dims=(1, 0, 2), as transpose(float32[5, 3, 4], 0, 1) parses``: the op's
    first validator sample through its parse, or '' where it has none."""
    e = TABLE.get(op)
    if e is None or e.parse is None or not callable(e.sample):
        return ""
    try:
        from .samples import Gen
        smp = e.sample(Gen(0))[0]
        _, attrs = e.parse(*smp.args, **smp.kwargs)
    except Exception:   # an example is a courtesy: the error says what is missing anyway
        return ""
    return f"; e.g. {', '.join(f'{k}={v!r}' for k, v in attrs.items())}, as {smp} parses"


def _torch_attrs(op, specs, attrs):
    """``attrs`` named as torch's call names them, turned into the rule's by the op's
    parse on meta tensors of ``specs``; None where that does not apply."""
    import torch
    e = TABLE.get(op)
    if e is None or e.parse is None or not attrs or any(s is None for s in specs) or \
            not set(attrs) <= set(_torch_names(op, len(specs))):
        return None
    metas = [torch.empty(tuple(s.shape), dtype=s.dtype, device="meta") for s in specs]
    try:
        _, parsed = e.parse(*metas, **attrs)
    except TypeError:
        return None
    return dict(parsed)


@lru_cache(maxsize=1024)
def _attr_names(rule, local, n_specs):
    """The attribute names ``rule`` and ``local`` take after their ``n_specs`` tensor
    inputs, or None where they cannot be told (no local, or one taking ``**kwargs``)."""
    if local is None or rule is None:
        return None
    names = set()
    for fn, skip in ((rule, 0), (local, 2)):      # local(nd, ctx, *inputs, **attrs)
        try:
            ps = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            return None
        if fn is local and any(p.kind is p.VAR_KEYWORD for p in ps):
            return None
        pos = [p.name for p in ps[skip:] if p.kind is p.POSITIONAL_OR_KEYWORD]
        names |= set(pos[n_specs:]) | {p.name for p in ps if p.kind is p.KEYWORD_ONLY}
    return frozenset(names)


class _Slice(tuple):
    """A slice as a hashable cache key (``index=(slice(1, 4),)`` for getitem)."""


def _freeze(v):
    if isinstance(v, list) or type(v) is tuple:
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, slice):
        return _Slice((_freeze(v.start), _freeze(v.stop), _freeze(v.step)))
    return v


def _thaw(v):
    """The attribute as the user gave it (a frozen slice back to a slice)."""
    if isinstance(v, _Slice):
        return slice(*v)
    if type(v) is tuple and any(isinstance(x, (tuple, _Slice)) for x in v):
        return tuple(_thaw(x) for x in v)
    return v


# free_choice.choose hands the strategies its shortcut got from the rule to the full
# decision that follows at once, when the rule saw the very same arguments (these
# objects, attributes needing no thaw): the rule runs once per new layout, not twice.
# One slot, cleared by every read and by choose() after the call.
_HANDOFF: list = [None]     # (op, specs, frozen_attrs, rule, strategies) or None


@lru_cache(maxsize=1024)
def _rule_keywords(rule):
    """The attribute names ``rule`` takes by keyword, or None where it takes any
    (``**kwargs``) or they cannot be told."""
    try:
        ps = inspect.signature(rule).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in ps):
        return None
    return frozenset(p.name for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def call_rule(rule, specs, attrs) -> list:
    """``rule(*specs, **attrs)``, given only the attributes the rule names.  The
    dispatcher's parse hands every attribute of the op (cumsum: ``dim`` and ``dtype``); a
    rule registered with :func:`register_rule` names those its placements depend on
    (notebook 04's ``cumsum_rule(x, dim)``), and one it does not name cannot change its
    strategies.  (It raised ``TypeError: cumsum_rule() got an unexpected keyword argument
    'dtype'`` from inside ``torch.cumsum``.)  A required attribute left out still raises."""
    names = _rule_keywords(rule)
    if names is not None and not names.issuperset(attrs):
        attrs = {k: v for k, v in attrs.items() if k in names}
    return list(rule(*specs, **attrs))


def hand_off(op, specs, frozen_attrs, rule, strategies, distinct=None) -> None:
    """``distinct``: :func:`distinct` of ``strategies``, where the caller walked them all."""
    if all(_thaw(v) is v for _, v in frozen_attrs):
        _HANDOFF[0] = (op, specs, frozen_attrs, rule, strategies, distinct)


def distinct(specs, strategies) -> list:
    """(the rule's order, strategy) of each strategy the chooser ranks: the first of each
    (inputs, outputs), where :func:`_bool_ok` allows it.  (Each key is hashed once: a
    strategy met again is skipped, and :func:`_bool_ok` reads nothing but the specs and
    the key's inputs, so adding the key before it is read skips the same strategies;
    :func:`_bool_ok` runs only where it can refuse one: task speed18b.)"""
    out, seen = [], set()
    bools = _dtype_checked(specs)
    for order, st in enumerate(strategies):
        n = len(seen)
        seen.add((st.inputs, st.outputs))
        if len(seen) == n or bools and not _bool_ok(specs, st):
            continue
        out.append((order, st))
    return out


@lru_cache(maxsize=8192)
def _infer_cached(op, specs, frozen_attrs, profile, grads=()) -> Decision:
    rule = get_rule(op)
    attrs = {k: _thaw(v) for k, v in frozen_attrs}
    handed, _HANDOFF[0] = _HANDOFF[0], None
    ranked = None
    if handed is not None and handed[0] == op and handed[1] is specs and \
            handed[2] is frozen_attrs and handed[3] is rule:
        strategies = handed[4]     # free_choice's call of the rule, on the same arguments
        ranked = handed[5]         # and its walk of them, where it walked them all
    else:
        strategies = call_rule(rule, specs, attrs)
    if not strategies:
        raise ValueError(f"{op}: the rule found no valid placement for inputs "
                         f"{[fmt_placements(s.placements) if s is not None else '-' for s in specs]}")
    cands = []
    ways = any(type(g) is tuple for g in grads)
    for order, st in (ranked if ranked is not None else distinct(specs, strategies)):
        plans, t, b, dt, db = strategy_cost(specs, st, profile)
        bt, bb = backward_price(specs, plans, grads, profile) if grads else (0.0, 0)
        # (where a reshard's result is read (its way back priced), a tie over forward and
        # backward goes to the cheaper forward, DTensor's ranking: a slice of the gathered
        # copy, its gradient sent back to the source in backward, against gathering the
        # other operand now and less back, tests/test_reshardbwd.py S0S1-RR-mul-S1S0.
        # Not elsewhere: the rule's order, as before (on every tie it moved a choice where
        # O0 and eager then record other gradient reductions: test_compile11's MoE + SP)
        fw = (t + dt, b + db) if ways else (0.0, 0)
        # (an empty tensor's reshards cost nothing: a tie broken by the rule's order sent
        # a needless collective, ``x.contiguous()`` of an empty P(sum) all-reduced it,
        # narrow probe seed 236: fewer collectives first, then the rule's order)
        moves = sum(len(p.collectives()) for p in plans if p is not None) \
            if t + dt + bt == 0 else 0
        cands.append((t + dt + bt, b + db + bb) + fw + (moves, order,
                      Candidate(st, tuple(plans), t, b, dt, db, bt, bb)))
    cands.sort(key=lambda c: c[:6])
    ranked = tuple(c[6] for c in cands)
    return Decision(op, specs, ranked, _reason(op, specs, ranked))


def _bool_ok(specs, st) -> bool:
    """A bool tensor cannot be made a partial sum (the sum of bools is not a bool), an
    integer tensor a partial average (x / n is not an integer; the planner has no such
    step), nor a complex tensor a partial max / min (complex numbers have no order): a
    strategy that asks for one is not offered."""
    import torch
    for spec, req in zip(specs, st.inputs):
        if spec is None or req is None:
            continue
        ops = ("sum", "avg") if spec.dtype == torch.bool else ("max", "min") if \
            spec.dtype.is_complex else () if spec.dtype.is_floating_point else ("avg",)
        if ops and any(p.is_partial() and p.reduce_op in ops and p not in spec.placements
                       for p in req):
            return False
    return True


def _dtype_checked(specs) -> bool:
    """Whether :func:`_bool_ok` can refuse a strategy for these specs: some input is not
    a real floating-point tensor (for those it refuses nothing)."""
    return any(s is not None and not s.dtype.is_floating_point for s in specs)


def strategy_cost(specs, st: Strategy, profile: str):
    """(plans, time, bytes, deferred time, deferred bytes) of bringing ``specs`` to what
    strategy ``st`` requires.  Zero-padding a shard into a partial sum moves nothing now,
    but the padded partial must be reduced later: it is ranked as the reduce-scatter it
    defers (the deferred part), so a free-looking detour does not win by accident."""
    plans, t, b, dt, db = [], 0.0, 0, 0.0, 0
    for spec, req in zip(specs, st.inputs):
        if spec is None or req is None:
            plans.append(None)
            continue
        p, pt, pb, pads = input_price(spec, req, profile)
        plans.append(p)
        t += pt
        b += pb
        for t_, b_ in pads:
            dt += t_
            db += b_
    mesh = next(s for s in specs if s is not None).mesh
    for i, nb in getattr(st, "deferred", ()):
        t_, b_ = deferred_price(mesh, i, nb, profile)
        dt += t_
        db += b_
    return plans, t, b, dt, db


_PRICES: dict = {}      # (spec, required placements, profile name) -> input_price's


def input_price(spec, req, profile: str) -> tuple:
    """(plan, its time, its bytes, ((time, bytes) of each zero-pad's deferred
    reduce-scatter, ...)) of bringing one input ``spec`` to ``req``: what
    :func:`strategy_cost` adds up, the same additions in the same order.  Memoized on
    (spec (by value, as the planner's cache keys it), req, profile name) (bounded; the
    built-in profiles by name do not change, as ``deferred_price`` and the planner's
    cache assume), the answer immutable (a frozen Plan, tuples): one decision's
    candidates ask for the same few moves again and again (linear's 49 on a 2 x 2 mesh,
    ~48 moves), and another layout of the other inputs asks again for this one's (task
    speed18b).  Placements given as lists, or a Profile object: not memoized."""
    key = (spec, req, profile)
    try:
        hit = _PRICES.get(key) if type(profile) is str else None
    except TypeError:           # an unhashable req
        key = None
        hit = None
    if hit is None:
        from ..reshard import plan_reshard_cached
        p = plan_reshard_cached(spec, req, profile)
        pads = tuple(deferred_price(spec.mesh, s_.mesh_dim, s_.buffer_bytes, profile)
                     for s_ in p.steps if s_.kind == "local_pad")
        hit = (p, p.total_time, p.total_bytes, pads)
        if key is not None and type(profile) is str:
            if len(_PRICES) > 65536:
                _PRICES.clear()
            _PRICES[key] = hit
    return hit


# The collective a forward reshard step's gradient passes through (sim_mesh/collectives.py
# records these backward events).  A reshard's all_gather (S -> R) and all_reduce (P -> R)
# make a compact replicated tensor: its gradient is one copy, already summed where the
# consumer's per-rank copies met (that all-reduce is the consumer's), so their backward is
# a local slice / the gradient itself, no communication (the reshard's all_gather and
# all_reduce record no backward event; DTensor's Redistribute.backward likewise takes
# R -> S by a local chunk, torch/distributed/tensor/_redistribute.py, torch 2.13 git
# cf30153, ``_redistribute_backward``).  ``compile/propagate.py`` prices the same map.
BACKWARD_OF = {"reduce_scatter": "all_gather", "all_to_all": "all_to_all",
               "local_slice": "all_gather"}
# What the chooser prices of them: the re-layouts (an all-to-all, a local slice of an
# input whose gradient then comes back whole).  Not a Partial's reduce-scatter: against
# the all-reduce it stands beside (P -> S against P -> R) it moves the same bytes over the
# step (reduce-scatter + all-gather = all-reduce) and its sharded result saves compute and
# memory downstream that one op's choice does not see (Megatron-LM's sequence parallelism
# makes that trade: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models", sec. 4.2.2); priced, the planner all-reduced before every
# element-wise op of a row-parallel output (notebook 04's exercise, tests/
# test_exercises_spmd_pipeline.py).
BACKWARD_PRICED = frozenset({"all_to_all", "local_slice"})


def backward_price(specs, plans, grads, profile: str):
    """(seconds, wire bytes) of the transposes of ``plans`` (one per input, None where
    none) for the inputs ``grads`` marks: each forward step in :data:`BACKWARD_PRICED`
    runs its collective on the gradient in backward (an all-to-all back, the all-gather
    of a local slice's gradient), priced as ``compile``'s
    ``_Pricer.backward_comm`` prices them (the slowest group; the step's buffer, a
    local slice's the source's shard).  The forward-only choice took ``x[2:14]`` of a
    row-sharded x by an all-to-all (forward 512 B) and paid 4,608 B in backward where
    DTensor's all-gather pays 2,048 + 0 (``benchmarks/eager_comm_probe.py``).  Not priced
    here: the reduction of a replicated input's gradient read per rank (its
    all-reduce), which DTensor's sharding propagation does not price either
    (:func:`grad_reduction_steps` says why, with what charging it would change).

    A ``wb.reshard`` result with its way back (``grads[k]`` its
    ``reshard_backward.way_key``, a tuple: the dispatcher's ``_grads``, and O0's for a
    program's ``t.redistribute``, ``compile/propagate.greedy``): where the op slices it
    along a dim the reshard gathered, that slice's own backward is muted and the way
    brings the gradient back to the reshard's source once (``reshard_backward.convert``):
    priced as that plan (an all-to-all where the op slices it to another dim than the
    source's, nothing back to the source's; DTensor's ``Redistribute.backward``), the
    plan's other dims as above, the way's reductions of a Partial gradient not priced
    (as above).  Priced as a plain input, a slice of it cost an all-gather in backward
    and the chooser gathered the other operand instead (tests/test_reshardbwd.py)."""
    from .. import layout
    prof = get_profile(profile)
    t, b = 0.0, 0
    for spec, plan, g in zip(specs, plans, grads):
        if not g or spec is None:
            continue
        skip = ()
        if type(g) is tuple:
            t_, b_, skip = _way_price(spec, plan, g, profile, prof)
            t += t_
            b += b_
        if plan is None:
            continue
        for s_ in plan.steps:
            kind = BACKWARD_OF.get(s_.kind)
            if kind is None or s_.kind not in BACKWARD_PRICED or s_.mesh_dim is None or \
                    s_.mesh_dim in skip:
                continue
            nb = s_.buffer_bytes
            if not nb:
                nb = math.prod(layout.max_local_shape(spec.shape, spec.mesh, s_.src)) * \
                    spec.dtype.itemsize
            t_, b_ = step_price(s_, spec, prof, back=True, nbytes=nb)
            t += t_
            b += b_
    return t, b


def back_step(s_):
    """Plan step ``s_``'s backward collective (``BACKWARD_OF``) as a step: from the
    step's target pieces back to its source's (a local slice's or a reduce-scatter's
    pieces all-gathered, an all-to-all reversed)."""
    from dataclasses import replace
    return replace(s_, kind=BACKWARD_OF[s_.kind], src=s_.dst, dst=s_.src)


def step_price(s_, spec, prof, back: bool = False, nbytes=None) -> tuple[float, int]:
    """(seconds of the slowest group, bytes of the busiest rank) of plan step ``s_`` of a
    tensor laid out ``spec`` (its shape, mesh, dtype), or with ``back`` of its backward
    collective (``BACKWARD_OF``: from the step's target pieces back to its source's), on
    the buffer ``nbytes`` (default the step's): where the pieces are uneven, each group's
    busiest rank priced as the buffer it sends (``reshard.step_records``, the bytes the
    run records on either executor; ``cost.sent_buffer``), else the ring formula on the
    buffer.  The chooser's and ``wb.compile``'s one price of a backward step (was the
    ring formula everywhere: x (8, 10) f64 S(1) on 4 ranks gathered, read by a
    column-parallel matmul, its way back priced 480 B where a rank sends 576 B)."""
    from ...sim_mesh import cost as _cost
    from ..reshard import step_records
    st = back_step(s_) if back else s_
    kind = st.kind
    nb = s_.buffer_bytes if nbytes is None else nbytes
    recs = step_records(st, tuple(spec.shape), spec.dtype, spec.mesh)
    if recs and "sent" in recs[0]:
        return (max(_cost.price(kind, _cost.sent_buffer(kind, kw["sent"], len(g)), g, prof)
                    for kw in recs for g in kw["groups"]),
                max(kw["sent"] for kw in recs))
    groups = spec.mesh.groups(s_.mesh_dim)
    return (max(_cost.price(kind, nb, grp, prof) for grp in groups),
            _cost.wire_bytes(kind, nb, len(groups[0])))


_NOT_PRICED_BACK = frozenset({"all_reduce", "reduce_scatter"})   # a Partial's reductions


def _way_price(spec, plan, way, profile, prof):
    """(seconds, wire bytes, the marked dims the way takes over) of an op's read of a
    reshard's result with way ``way`` (``reshard_backward.way_key``): the steps
    :func:`way_steps` gives, priced.  ((0, 0, ()) where the input is not laid out as
    marked any more or the op uses the one copy: the ordinary path.)"""
    steps, moved = way_steps(spec, plan, way, profile)
    t, b = 0.0, 0
    for s_ in steps:                  # (the plan's own gradient layout: its steps' spec)
        t_, b_ = step_price(s_, spec, prof)
        t += t_
        b += b_
    return t, b, moved


def way_steps(spec, plan, way, profile) -> tuple:
    """``(steps, moved)`` of an op's read of a reshard's result with way ``way``
    (``reshard_backward.way_key``, or ``_Way.key_with_uses``) laid out ``spec``, converted
    by ``plan``: the reshard steps of the plan from the gradient the op gives it
    (``reshard_backward.way_use``, as ``convert`` notes it) back to the source, as the way
    records it (``_Way.steps``), and the marked dims whose own backward the way takes over
    (the plan's steps there are muted: ``reshard_backward.execute_marked``).  ((), ())
    where the input is not laid out as marked any more or the op uses the one copy: the
    ordinary path.  The one rule of the chooser's price (:func:`_way_price`) and of
    ``wb.compile``'s search and step (``compile/propagate.py``, ``compile/schedule.py``).

    Several reads meet on the way and go back once (autograd sums their gradients; the
    way plans one redistribution per merged layout, ``reshard_backward._merged``).  A
    way's 4th element, where present, holds the gradient layouts earlier readers noted
    (``uses``): the steps are then this read's addition, the plans of the merged layouts
    the run did not plan already (none where this read's gradient merges into one of
    theirs: a second slice to the same dim adds nothing).  Each read priced alone, a
    second slice of the copy to the other operand's layout paid the all-to-all again
    and gathered the other operand instead (chooser17)."""
    from ..reshard import plan_reshard_cached
    from ..reshard_backward import _merged, way_use
    from ..spec import TensorSpec
    dst, back, axes = way[:3]
    uses = way[3] if len(way) > 3 else ()
    if tuple(spec.placements) != dst:
        return (), ()
    final = plan.dst if plan is not None and plan.steps else dst
    # (a dim given per rank, Partial, adds only a reduction, not priced: expand ())
    grad, moved = way_use(dst, axes, final, ())
    if not moved:
        return (), ()
    layouts = _merged(list(uses) + ([grad] if grad not in uses else []))
    if uses:
        before = _merged(list(uses))
        layouts = [g for g in layouts if g not in before]
    out = []
    for g in layouts:
        p = plan_reshard_cached(TensorSpec(spec.shape, spec.mesh, g, spec.dtype,
                                           _trusted=True), back, profile)
        out += [s_ for s_ in p.steps if s_.bytes and s_.kind not in _NOT_PRICED_BACK and
                s_.mesh_dim is not None]
    return tuple(out), moved


def grad_reduction_steps(spec, plan, dims, way=None, profile=None) -> tuple:
    """The reshard steps (those that move bytes) of the gradient reduction of an input
    copy laid out ``spec`` (the placements an op's strategy requires of it), reached by
    ``plan`` (None or a reshard plan), that the op reads per rank along mesh dims ``dims``
    (its outputs diverge there): the planner's plan from the gradient, Partial on ``dims``,
    back to the copy's layout (a copy the plan gathered, ``S(d) -> R``: back to the
    source's shards, a reduce-scatter), as the run records it once per input copy
    (``reshard_backward.gather``; compiled: ``compile/grad_ways.py``).  ``way``: the
    copy's way back where it is a marked reshard result read as it is (its ``back``).

    Priced by ``wb.compile``'s whole-graph search and greedy (``propagate._Pricer``); NOT
    by the dispatcher's chooser (:func:`backward_price`), as DTensor's selection does not
    price it either (torch 2.13 git cf30153, torch/distributed/tensor/_sharding_prop.py:
    295-360 ``_select_min_cost_strategy``: the forward redistribute cost; the Partial
    gradient is redistributed where it meets ``from_local``'s backward, ``_api.py:
    239-286``).  Charged to the chooser it changes the course's tensor-parallel layers'
    choices at toy sizes (``benchmarks/chooser17_grad_reduction_probe.py``)."""
    req = tuple(spec.placements)
    src = plan.src if plan is not None and plan.steps else req
    back = tuple(a if b.is_replicate() and a.is_shard() else b for a, b in zip(src, req)) \
        if any(a.is_shard() and b.is_replicate() for a, b in zip(src, req)) else req
    if way is not None and src == req and req == tuple(way[0]):
        back = tuple(way[1])
    from ..placement import Partial
    from ..reshard import plan_reshard_cached
    from ..spec import TensorSpec
    grad = tuple(Partial() if i in dims else p for i, p in enumerate(req))
    p = plan_reshard_cached(TensorSpec(spec.shape, spec.mesh, grad, spec.dtype, _trusted=True),
                            back, profile if profile is not None else _profile_name())
    return tuple(s_ for s_ in p.steps if s_.bytes)


_DEFERRED: dict = {}


def deferred_price(mesh, mesh_dim, nb, profile: str):
    """(seconds, wire bytes) of the reduce-scatter of ``nb`` bytes over mesh dim
    ``mesh_dim`` of ``mesh`` on the profile named ``profile``, as the chooser ranks a
    deferred reduction: the slowest group's price (``cost.price``) and
    ``cost.wire_bytes``.  Memoized on (mesh (by value), dim, nb and its type, profile
    name): every candidate of a new layout asks again (bounded; profiles by name are the
    built-in ones, which do not change)."""
    key = (mesh, mesh_dim, nb, type(nb), profile)
    hit = _DEFERRED.get(key) if type(profile) is str else None   # a Profile: not memoized
    if hit is None:
        from ...sim_mesh import cost as _cost
        prof = get_profile(profile)
        g = mesh.groups(mesh_dim)
        hit = (max(_cost.price("reduce_scatter", nb, grp, prof) for grp in g),
               _cost.wire_bytes("reduce_scatter", nb, len(g[0])))
        if type(profile) is str:
            if len(_DEFERRED) > 4096:
                _DEFERRED.clear()
            _DEFERRED[key] = hit
    return hit


def _reason(op, specs, cands) -> str:
    best = cands[0]
    st = best.strategy
    moved = [i for i, (s, r) in enumerate(zip(specs, st.inputs))
             if s is not None and r is not None and tuple(s.placements) != tuple(r)]
    why = st.note or "valid for this op"
    if not moved:
        head = "inputs used as they are"
    else:
        parts = []
        for i in moved:
            p = best.plans[i]
            how = ", ".join(p.collectives()) or " + ".join(
                {"local_slice": "a local slice", "local_partial": "keeping it on one rank",
                 "local_pad": "zero-padding each shard", "local_relabel": "a relabel"}[s_.kind]
                for s_ in p.steps) or "nothing"
            parts.append(f"input {i} {fmt_placements(specs[i].placements)} -> "
                         f"{fmt_placements(st.inputs[i])} by {how}")
        head = "; ".join(parts)
    alt = ""
    if len(cands) > 1:
        alt = (f"; cheapest of {len(cands)} candidates "
               f"(next: {cands[1].bytes:,d} B, {cands[1].time * 1e6:.2f} us)")
    return f"{head}; output {', '.join(fmt_placements(o) for o in st.outputs)} ({why}){alt}"


def describe(op: str) -> str:
    fn = RULES.get(op)
    return (fn.__doc__ or "").strip() if fn else f"no rule for {op!r}"


on_change(lambda: _infer_cached.cache_clear())
