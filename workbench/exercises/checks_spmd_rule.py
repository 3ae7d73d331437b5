"""Checks for the exercises of notebook 04 (SPMD propagation), second part: a student's
SPMD rule for cumsum.

Every strategy the rule offers is run on asymmetric shards and compared with
``torch.cumsum`` on one device; the rule must offer the cheapest one."""
from __future__ import annotations

import inspect
import itertools

import torch

from ..parallel import layout as _layout
from ..parallel.dist_tensor import TensorSpec, from_local, shard_tensor
from ..parallel.placement import Partial, Shard
from ..parallel.validate_inputs import partial_slot
from ..parallel.rules import RULES, combine, infer
from ..sim_mesh.mesh import Mesh
from ..sim_mesh.profiles import get_profile
from .checks_spmd import R, _fmt, _ok
from .feedback import CheckError, exercise

__all__ = ["check_cumsum_rule"]


# ---- 04 SPMD propagation: a rule for cumsum ------------------------------------------------------

def _reference_cumsum(x, dim):
    """The solution: R -> R; S(d) -> S(d) for d != dim; P(sum) -> P(sum) (linear)."""
    dim = dim % x.ndim
    opts = [((R,), (R,), "replicated")]
    opts += [((Shard(d),), (Shard(d),), f"dim {d} sharded: each rank scans its own rows")
             for d in range(x.ndim) if d != dim and x.shape[d] > 1]
    opts.append(((Partial("sum"),), (Partial("sum"),), "linear: cumsum(a + b) = cumsum(a) + "
                 "cumsum(b)"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


def _parts(x: torch.Tensor, n: int, op: str, seed: int) -> list[torch.Tensor]:
    """n tensors whose ``op`` over them is x, deliberately unequal (no coincidences)."""
    g = torch.Generator().manual_seed(seed)
    noise = [torch.rand(x.shape, generator=g, dtype=x.dtype) * (k + 1) for k in range(n)]
    if op == "sum":
        return noise[:-1] + [x - sum(noise[:-1])] if n > 1 else [x]
    if op == "avg":
        centred = [z - sum(noise) / n for z in noise]
        return [x + z for z in centred]
    sign = -1 if op == "max" else 1
    return [x] + [x + sign * (z + 0.5) for z in noise[1:]]


def _distribute(X, mesh, ps, seed=0):
    base = [R if p.is_partial() else p for p in ps]
    t = shard_tensor(X, mesh, base)
    pdims = [i for i, p in enumerate(ps) if p.is_partial()]
    if not pdims:
        return [t.local(r) for r in mesh.ranks]
    ops = {ps[i].reduce_op for i in pdims}
    if len(ops) > 1:
        return None                       # mixed partial ops: not a layout we test
    op = ops.pop()
    out = []
    for r in mesh.ranks:
        k, n = partial_slot(mesh, ps, r)
        out.append(_parts(t.local(r), n, op, seed)[k])
    return out


def _strategy_error(st, mesh, shape, dim) -> str | None:
    """Why strategy ``st`` computes a wrong cumsum (None when it is right)."""
    ins, outs = st.inputs[0], st.outputs[0]
    X = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    locs = _distribute(X, mesh, ins)
    if locs is None:
        return None
    what = f"{_fmt(ins)} -> {_fmt(outs)}"
    d = dim % len(shape)
    scanned = [i for i, p in enumerate(ins) if p.is_shard(d)]
    hint = (f" (dim={dim} is dim {d} of a {len(shape)}-d tensor: normalise it with "
            f"dim % x.ndim)" if dim < 0 else "")
    if scanned:
        return (f"your rule lets the scanned dim stay sharded ({what}) for a cumsum over "
                f"dim {dim}: each rank scans only its own piece, so rank 1's values miss the "
                f"sums of rank 0's piece. The scanned dim must be whole on every rank{hint}")
    # linear: a sum or a mean of the ranks' pieces passes (PyTorch DTensor's linear
    # pointwise rules keep P(sum) and P(avg): torch/distributed/tensor/_ops/_pointwise_ops.py,
    # _UNARY_LINEAR_RULES); max and min do not
    bad_partial = [p for p in ins if p.is_partial() and p.reduce_op not in ("sum", "avg")]
    if bad_partial:
        return (f"your rule accepts {bad_partial[0]} ({what}): cumsum is linear, so it "
                f"commutes with a sum (and a mean), but not with {bad_partial[0].reduce_op}")
    outs_local = [torch.cumsum(t, d) for t in locs]
    try:
        y = from_local(outs_local, mesh, outs, shape=shape)
    except ValueError as e:
        if "different tensor than its replica" in str(e):
            axes = [mesh.dim_names[i] for i, p in enumerate(outs) if p.is_replicate()
                    and not ins[i].is_replicate()]
            return (f"your strategy {what} announces Replicate on mesh dim {axes} but the "
                    f"ranks along it compute different values: the output keeps the input's "
                    f"layout there")
        r = next((r for r, t in zip(mesh.ranks, outs_local)
                  if tuple(t.shape) != _layout.local_shape(shape, mesh, outs, r)), None)
        if r is None:
            return f"your strategy {what} announces an output the results cannot have: {e}"
        return (f"your strategy {what} announces the output {_fmt(outs)}, but rank {r}'s "
                f"result has the shape of its input shard "
                f"{tuple(outs_local[mesh.index(r)].shape)}, not the "
                f"{_layout.local_shape(shape, mesh, outs, r)} that {_fmt(outs)} gives it: "
                f"cumsum keeps each shard's shape, so the output is laid out as the input")
    err = (y.full() - torch.cumsum(X, d)).abs().max().item()
    if err > 1e-9:
        return (f"with your strategy {what} the gathered result differs from "
                f"torch.cumsum(x, {dim}) by up to {err:.3g}: the output must be laid out as "
                f"the input was")
    return None


def _cheapest(strategies, spec, profile):
    """The reference's best strategy, ranked as the chooser ranks (deferred costs included)."""
    from ..parallel.rules import strategy_cost
    best = None
    for st in strategies:
        plans, t, b, dt, db = strategy_cost((spec,), st, profile)
        key = (t + dt, b + db)
        if best is None or key < best[0]:
            best = (key, st, plans[0])
    return best


def _cumsum_cases():
    m4, m22 = Mesh.grid(4, ["x"]), Mesh.grid((2, 2), ["x", "y"])
    for dim in (1, 0, -1):
        yield m4, (4, 8), dim
    yield m22, (4, 4, 6), 1


def _check_rule_signature(rule) -> None:
    """A rule the dispatcher cannot call as rule(x, dim=...): said in its own words (the
    dispatcher's error lists the rule's parameters beside torch's, which reads as if cumsum
    took them all)."""
    try:
        sig = inspect.signature(rule)
    except (TypeError, ValueError):
        return                                  # a builtin or a C callable: let infer try
    try:
        sig.bind(None, dim=1)
    except TypeError:
        params = ", ".join(sig.parameters)
        raise CheckError(f"your rule takes ({params}); the dispatcher calls rule(x, dim=...): "
                         "x first (a TensorSpec), then cumsum's attribute by its torch name, "
                         "as a keyword") from None


@exercise
def check_cumsum_rule(rule, op: str = "cumsum") -> None:
    """Your rule for ``torch.cumsum(x, dim)``: registered with one decorator, every strategy
    it offers computes the right values, and it offers the cheapest one for every input."""
    if not callable(rule):
        got = (f"{type(rule).__name__} of {len(rule)} strategies, what a call of your rule "
               f"returns: pass the function itself, check_cumsum_rule(cumsum_rule), without "
               f"calling it" if isinstance(rule, (list, tuple)) else repr(rule))
        raise CheckError(f"pass your rule function (the one under @wb.register_rule), got "
                         f"{got}")
    if RULES.get(op) is not rule:
        raise CheckError(
            f"no rule is registered for {op!r}: put @wb.register_rule({op!r}, override=True) "
            f"on the line above `def {getattr(rule, '__name__', 'rule')}`" if op not in RULES else
            f"the rule registered for {op!r} is not your function: decorate it with "
            f"@wb.register_rule({op!r}, override=True) (override=True replaces an older one)")
    _check_rule_signature(rule)
    profile = get_profile(None).name
    seen = set()
    for mesh, shape, dim in _cumsum_cases():
        d0 = dim % len(shape)       # the scanned dim's shards last: simpler mistakes first
        opts = [R] + [Shard(d) for d in range(len(shape)) if d != d0] + [Partial("sum"),
                                                                          Shard(d0)]
        for ps in itertools.product(opts, repeat=mesh.ndim):
            spec = TensorSpec(shape, mesh, ps, torch.float64)
            where = f"x {_fmt(ps)} of shape {shape} on {mesh.size} ranks, dim={dim}"
            try:
                dec = infer(op, spec, dim=dim)
            except Exception as e:          # the student's code: any error is an answer
                sig = ""
                if isinstance(e, TypeError) and "argument" in str(e):
                    sig = (" The dispatcher calls rule(x, dim=...): one TensorSpec per tensor "
                           "input, the attributes as keywords.")
                elif isinstance(e, TypeError) and "'NoneType'" in str(e):
                    sig = (" Does your rule return anything? It returns the list of "
                           "strategies that combine(...) builds.")
                elif isinstance(e, (TypeError, IndexError)):
                    sig = (" combine(x.mesh.ndim, per_dim, 1) takes one list of options per "
                           "mesh dim ([options] * x.mesh.ndim); an option is (input "
                           "placements, output placements, note), each a tuple even for one "
                           "placement, such as ((R,), (R,), 'replicated'); the last argument "
                           "counts the tensor inputs (cumsum has 1).")
                elif isinstance(e, AttributeError) and "'TensorSpec'" in str(e):
                    sig = (" x is a TensorSpec, a shape and placements without data: it has "
                           "x.shape, x.ndim, x.mesh and x.placements.")
                elif isinstance(e, AttributeError) and "inputs" in str(e):
                    sig = (" A rule returns Strategy objects: build them from per-mesh-dim "
                           "options with combine(x.mesh.ndim, [options] * x.mesh.ndim, 1).")
                elif isinstance(e, ValueError) and "no reshard plan" in str(e):
                    sig = (f" A strategy needs one placement per mesh dim (this mesh has "
                           f"{mesh.ndim}): combine(x.mesh.ndim, [options] * x.mesh.ndim, 1) "
                           "builds them for any mesh.")
                elif isinstance(e, ValueError) and "no valid placement" in str(e):
                    sig = (" A rule lists every valid strategy; a replicated x can always "
                           "give a replicated cumsum: offer ((R,), (R,), ...) at least.")
                raise CheckError(f"your rule failed for {where}: {type(e).__name__}: {e}.{sig}"
                                 ) from None
            for cand in dec.candidates:
                st = cand.strategy
                key = (mesh, shape, dim, st.inputs, st.outputs)
                if key in seen:
                    continue
                seen.add(key)
                msg = _strategy_error(st, mesh, shape, dim)
                if msg:
                    raise CheckError(msg)
            (t_ref, b_ref), st_ref, _ = _cheapest(list(_reference_cumsum(spec, dim)), spec,
                                                  profile)
            got = dec.chosen
            if got.rank_key[0] > t_ref * (1 + 1e-9) + 1e-15:
                colls = ", ".join(got.collectives) or "a local step"
                raise CheckError(
                    f"for {where} your rule's cheapest strategy {_fmt(got.strategy.inputs[0])} "
                    f"-> {_fmt(got.strategy.outputs[0])} needs {colls} ({got.bytes:,d} B per "
                    f"rank); {_fmt(st_ref.inputs[0])} -> {_fmt(st_ref.outputs[0])} needs "
                    f"{b_ref:,d} B and is valid: {st_ref.note}")
            # free but wasteful: a shard made Partial (zero-padded) where x could stay as it is
            as_is = [st for st in _reference_cumsum(spec, dim) if st.inputs[0] == tuple(ps)]
            padded = any(q.is_partial() and not p.is_partial()
                         for p, q in zip(ps, got.strategy.inputs[0]))
            offered = [c for c in dec.candidates if c.strategy.inputs[0] == tuple(ps)]
            # how a free Partial is made: a replicated x is kept on one rank (zeros on the
            # others), a shard is zero-padded to the whole shape
            made = [p for p, q in zip(ps, got.strategy.inputs[0])
                    if q.is_partial() and not p.is_partial()]
            how = " and ".join(dict.fromkeys(
                "each rank pads its piece with zeros" if p.is_shard() else
                "x is kept on one rank, zeros on the others" for p in made))
            if as_is and padded and offered:
                raise CheckError(
                    f"for {where} your rule offers {_fmt(ps)} -> "
                    f"{_fmt(offered[0].strategy.outputs[0])}, but lists it after "
                    f"{_fmt(got.strategy.inputs[0])} -> {_fmt(got.strategy.outputs[0])}: both "
                    f"are free, and a tie goes to the rule's first strategy, so x is made a "
                    f"Partial ({how}: every rank then holds a whole-size tensor, and a "
                    f"reduction comes later). List the options that keep x as it is before "
                    f"the Partial one")
            if as_is and padded:
                raise CheckError(
                    f"for {where} your rule first turns x into {_fmt(got.strategy.inputs[0])}: "
                    f"free ({how}), but every rank then holds a "
                    f"whole-size tensor and a reduction comes later. x can be used as it is: "
                    f"{_fmt(as_is[0].inputs[0])} -> {_fmt(as_is[0].outputs[0])} "
                    f"({as_is[0].note})")
            # free but a change of layout: a replicated x cut into shards (a local slice), so
            # the cumsum comes out sharded where x was whole
            if as_is and got.strategy.inputs[0] != tuple(ps):
                cut = (f"so each rank cuts its slice of x (free) and the cumsum comes out "
                       f"{_fmt(got.strategy.outputs[0])}, sharded where x was replicated: an "
                       f"op that needs it whole then pays an all-gather")
                if offered:
                    raise CheckError(
                        f"for {where} your rule offers {_fmt(ps)} -> "
                        f"{_fmt(offered[0].strategy.outputs[0])}, but lists it after "
                        f"{_fmt(got.strategy.inputs[0])} -> {_fmt(got.strategy.outputs[0])}: "
                        f"both are free, and a tie goes to the rule's first strategy, {cut}. "
                        f"List the options that keep x as it is first")
                raise CheckError(
                    f"for {where} your rule offers no strategy that uses x as it is, {cut}. "
                    f"Offer {_fmt(as_is[0].inputs[0])} -> {_fmt(as_is[0].outputs[0])} too "
                    f"({as_is[0].note})")
    spec = TensorSpec((4, 8), Mesh.grid(4, ["x"]), ["S(1)"])
    dec = infer(op, spec, dim=1)
    _ok(f"{len(seen)} strategies computed right, the cheapest always offered; e.g. x [S(1)], "
        f"cumsum over dim 1: {_fmt(dec.inputs[0])} -> {_fmt(dec.outputs[0])}, "
        f"{dec.chosen.bytes:,d} B", wrapped=True)
