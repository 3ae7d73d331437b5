"""Checks for the exercises of notebooks 04 (SPMD propagation) and 07 (pipeline parallelism).

As in :mod:`.checks`: a right answer prints one "Correct: ..." line; a wrong one raises
:class:`~.checks.CheckError` saying what is wrong, e.g.

    your rule lets the scanned dim stay sharded ([S(1)] -> [S(1)]) for a cumsum over
    dim 1: each rank scans only its own piece, so rank 1's values miss the sums of
    rank 0's piece ...

Expected values are derived here, not by the code under test: the MLP plan's output is
compared with one device's; cumsum strategies with ``torch.cumsum``; the best hand
schedule by an exhaustive search priced with this module's own list scheduler
(:func:`_makespan`); the micro-batch counts and the zero-bubble idle time from the
published formulas.  The student's own answer is interpreted with the library
(``explain``, ``validate``, ``simulate``), as a notebook would.
"""
from __future__ import annotations

import copy
import inspect
import itertools
import math
import operator

import torch

from ..parallel import layout as _layout
from ..parallel.dist_tensor import TensorSpec, from_local, shard_tensor
from ..parallel.explain import explain
from ..parallel.module import STYLES, dist_parameters, parallelize
from ..parallel.placement import Partial, Replicate, Shard, fmt_placements
from ..parallel.validate_inputs import partial_slot
from ..parallel.rules import RULES, combine, infer
from ..parallel.schedules import (Schedule, ScheduleError, interleaved_1f1b, one_f_one_b,
                                  simulate, validate)
from ..sim_mesh.mesh import Mesh
from ..sim_mesh.profiles import get_profile
from ..text_width import wrap
from .checks import _number, _whole
from .feedback import CheckError, exercise

__all__ = ["check_mlp_plan", "check_cumsum_rule", "check_hand_schedule",
           "check_min_microbatches", "check_zb_bubble"]

R = Replicate()


def _ok(msg: str, wrapped: bool = True) -> None:
    """Print the one "Correct: ..." line within text_width.WIDTH characters, continuations
    indented (JupyterLab breaks a longer line mid-word)."""
    print(wrap("Correct: " + msg))


def _fmt(ps) -> str:
    return fmt_placements(ps) if ps is not None else "-"


# ---- 04 SPMD propagation: Megatron's MLP plan --------------------------------------------------

def _mlp_hint(op: str, params: dict, hidden: int) -> str | None:
    """What the placements of the student's plan did wrong when ``op`` inserted a
    collective (nn.Linear stores its weight as (out_features, in_features))."""
    w0, w2 = params["0.weight"].placements[0], params["2.weight"].placements[0]
    if op == "relu":
        if w0.is_shard(1):
            return ("layer 0's weight [S(1)] splits its input features (nn.Linear's weight is "
                    "(out_features, in_features)), so each rank's output is a partial sum over "
                    "its share of the inputs. relu is not linear: it cannot act on partial "
                    "sums, so the planner reduces them first. Split layer 0's output features "
                    "instead: its output is then split by features, and relu acts on each "
                    "shard alone")
        return ("relu is not linear: it cannot act on partial sums, so the planner reduces "
                "them first. Split layer 0's output features (dim 0 of its (out_features, "
                "in_features) weight): relu then acts on each shard alone")
    if op == "linear" and w2.is_shard(0):
        return (f"layer 2's weight [S(0)] splits its output features, so each rank needs "
                f"all {hidden} input features of the rows it computes, and the hidden "
                "activations, split by features, must move. Split its input features instead (dim 1 of its (out_features, "
                "in_features) weight), exactly as layer 0 split its outputs: each rank's "
                "partial sum then needs nothing from the others")
    return None


@exercise
def check_mlp_plan(plan, d: int = 16, hidden: int = 64, tp: int = 4,
                   profile: str = "ascend-910b", styles: bool = False) -> None:
    """A ``parallelize`` plan for nn.Sequential(Linear(d, hidden), ReLU(), Linear(hidden, d))
    on ``tp`` ranks that shards both weights and needs no forward communication, given
    with placements per parameter (``styles``: style names such as 'colwise' allowed too;
    notebook 04's section 5 shows the plan with them, so its exercise asks placements)."""
    from torch import nn
    if not isinstance(plan, dict):
        raise CheckError(f"plan should be a dict from parameter names to placements, e.g. "
                         f"{{'0.weight': ['S(0)']}}; got {type(plan).__name__}")
    named = {k: v for k, v in plan.items() if isinstance(v, str) and v in STYLES}
    if named and not styles:
        raise CheckError(f"your plan names styles ({named}): section 5 already wrote the plan "
                         "that way. Give placements, one entry per parameter, e.g. "
                         "{'0.weight': ['S(?)'], ...}: which dim of each (out_features, "
                         "in_features) weight does each layer split?")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))
        X = torch.randn(8, d)
    ref = copy.deepcopy(model)
    mesh = Mesh.grid(tp, ["tp"])
    try:
        parallelize(model, mesh, plan)
    except (ValueError, TypeError) as e:
        raise CheckError(f"parallelize rejected your plan: {e}") from None
    params = dict(dist_parameters(model))
    for layer in ("0", "2"):
        w = params[f"{layer}.weight"]
        if all(p.is_replicate() for p in w.placements):
            raise CheckError(f"layer {layer}'s weight is replicated {_fmt(w.placements)}: every "
                             f"rank stores all {w.numel()} values and nothing is split. Give "
                             f"'{layer}.weight' a Shard placement")
    table = explain(model, shard_tensor(X, mesh, [R]), profile=profile)
    for i, row in enumerate(table.rows):
        if row.collectives:
            colls = ", ".join(f"{k} on {dim}" for k, dim in row.collectives)
            raise CheckError(f"with your plan {row.op} (layer {i}) inserts {colls} "
                             f"({row.bytes:,d} B per rank) in the forward: "
                             + (_mlp_hint(row.op, params, hidden) or row.reason))
    y = table.result
    if not torch.allclose(y.full(), ref(X), rtol=1e-5, atol=1e-5):
        raise CheckError("no communication, but the output differs from one device's: "
                         "a rule is wrong (please report it)")
    outs = " -> ".join(f"{r.op} {_fmt(r.outputs[0])}" for r in table.rows)
    b0 = params["0.bias"]
    note = (f" (0.bias stays {_fmt(b0.placements)}: every rank stores all {hidden} values and "
            f"cuts out its {hidden // tp}; Megatron splits it with the weight, ['S(0)'])"
            if all(p.is_replicate() for p in b0.placements) else "")
    _ok(f"{outs} with no forward communication; the output is {y.notation()}: one all-reduce "
        f"when it is needed whole (Megatron's g){note}", wrapped=True)


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


# ---- 07 pipelines: a schedule by hand -----------------------------------------------------------

def _makespan(rows) -> float:
    """Makespan of a schedule (rows of "F<i>"/"B<i>" per rank, f = b = 1, no p2p cost), by
    list scheduling: F<i> on rank r waits for F<i> on rank r-1, B<i> for B<i> on rank
    r+1; each rank runs its row in order.  inf when the rows deadlock."""
    p = len(rows)
    done, clock, nxt = {}, [0.0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while nxt[r] < len(rows[r]):
                act = rows[r][nxt[r]]
                dep = (act[0], int(act[1:]), r - 1 if act[0] == "F" else r + 1)
                if 0 <= dep[2] < p and dep not in done:
                    break
                start = max(clock[r], done.get(dep, 0.0))
                clock[r] = done[(act[0], int(act[1:]), r)] = start + 1.0
                nxt[r] += 1
                progress = True
    return max(clock) if all(n == len(row) for n, row in zip(nxt, rows)) else math.inf


def _best_makespan(p: int, m: int, memory_limit: int) -> float:
    """The shortest makespan (f = b = 1) of any schedule whose rows run F's and B's in
    micro-batch order, within ``memory_limit`` activations per rank (exhaustive)."""
    def rows():
        out = []
        for fb in itertools.combinations(range(2 * m), m):     # positions of the F's
            row, nf, nb, held, ok = [], 0, 0, 0, True
            for i in range(2 * m):
                if i in fb:
                    row.append(f"F{nf}"); nf += 1; held += 1
                else:
                    if nb >= nf:
                        ok = False; break
                    row.append(f"B{nb}"); nb += 1; held -= 1
                if held > memory_limit:
                    ok = False; break
            if ok:
                out.append(row)
        return out
    return min(_makespan(list(combo)) for combo in itertools.product(rows(), repeat=p))


@exercise
def check_hand_schedule(schedule, p: int = 3, m: int = 3, memory_limit: int = 2) -> None:
    """A hand-written schedule for p ranks and m micro-batches that runs, holds at most
    ``memory_limit`` micro-batch activations on every rank, and is as fast as possible.

    A schedule that runs but holds too much or is slow gets its timeline (f = b = 1) in
    the message, to show where it idles or piles up."""
    from ..viz.pipeline import render_text
    if not isinstance(schedule, Schedule):
        raise CheckError(f"give a Schedule, got {type(schedule).__name__}: build it with "
                         "wb.schedules.Schedule.from_text(['F0 F1 ...', ...]), one row per rank")
    if schedule.p != p:
        raise CheckError(f"your schedule has {schedule.p} rows; the exercise has p={p} ranks: "
                         "one row of actions per rank")
    if schedule.m != m:
        raise CheckError(f"your schedule runs m={schedule.m} micro-batches; the exercise has "
                         f"m={m}: every rank runs F0..F{m - 1} and B0..B{m - 1}")
    try:
        validate(schedule)
    except ScheduleError as e:
        raise CheckError(f"your schedule cannot run: {e}") from None
    if schedule.split_backward:
        # timed with w = 1 on top of b = 1 it read "a faster one exists" for the best order
        raise CheckError("your schedule splits each backward into B and W (section 4); this "
                         "exercise has one backward per micro-batch, B, as long as a forward "
                         "(f = b = 1): write F's and B's only")
    w = None
    got = simulate(schedule, w=w)
    timeline = "\n" + render_text(got).split("\n", 1)[1] + "\n"   # the rows and the bubble
    try:
        validate(schedule, memory_limit=memory_limit)
    except ScheduleError as e:
        raise CheckError(f"your schedule runs, but holds too much:{timeline}{e}") from None
    best = _best_makespan(p, m, memory_limit)
    ref = simulate(one_f_one_b(p, m))
    if got.makespan > best + 1e-9:
        raise CheckError(f"your schedule runs and fits in memory, but takes {got.makespan:g} "
                         f"time units (bubble {got.bubble_fraction:.0%}):{timeline}a faster one "
                         f"exists within {memory_limit} activations: start each backward as "
                         "soon as its gradient can arrive, and let later ranks run ahead",
                         expected=f"{best:g} time units")
    _ok(f"{got.makespan:g} time units, bubble {got.bubble_fraction:.2%}, at most "
        f"{max(got.peak_inflight)} activations per rank (1F1B: {ref.makespan:g} units, "
        f"bubble {ref.bubble_fraction:.2%}, {max(ref.peak_inflight)} on rank 0)")


# ---- 07 pipelines: how many micro-batches --------------------------------------------------------

def _int(name, value) -> int:
    """``value`` as an int: a Python, NumPy or torch integer (np.argmax over a table of
    bubbles gives np.int64) or a float with no fraction (64.0, what ``math.ceil`` of a
    NumPy float or a division gives, is 64, as 06's and 11's checks of a count take it);
    not a bool, not 64.5."""
    got = _whole(value)
    if got is None:
        raise CheckError(f"{name} should be a whole number of micro-batches (an int), "
                         f"got {value!r}")
    return got


@exercise
def check_min_microbatches(m_1f1b, m_interleaved, p: int = 8, v: int = 2,
                           target: float = 0.10) -> None:
    """The fewest micro-batches for which 1F1B (and interleaved 1F1B with v chunks, m a
    multiple of p) keep the bubble below ``target`` of the step, p stages."""
    a, b = _int("m_1f1b", m_1f1b), _int("m_interleaved", m_interleaved)
    want_a = next(m for m in range(1, 10_000) if (p - 1) / (m + p - 1) < target)
    want_b = next(m for m in range(p, 10_000, p) if (p - 1) / (v * m + p - 1) < target)
    # the answers over the ideal time instead of the step: (p-1)/m and (1/v)(p-1)/m
    ideal_a = next(m for m in range(1, 10_000) if (p - 1) / m < target)
    ideal_b = next(m for m in range(p, 10_000, p) if (p - 1) / (v * m) < target)
    for got, want, ideal, name, build, formula, over_ideal in (
            (a, want_a, ideal_a, "1F1B", lambda m: one_f_one_b(p, m), "(p-1)/(m+p-1)",
             "(p-1)/m"),
            (b, want_b, ideal_b, f"interleaved 1F1B (v={v})",
             lambda m: interleaved_1f1b(p, m, v), "(p-1)/(v m+p-1)", "(p-1)/(v m)")):
        if got == want:
            continue
        if got < 1:
            raise CheckError(f"{name}: m={got}: a step has at least one micro-batch")
        if name != "1F1B" and got % p:
            raise CheckError(f"{name}: m={got} is not a multiple of p={p}; interleaved 1F1B "
                             "needs one (Megatron-LM's rule, and the generator's)")
        frac = simulate(build(got)).bubble_fraction
        if frac < target and name != "1F1B" and got == next(
                k for k in range(p, 10_000, p) if (p - 1) / (k + p - 1) < target):
            hint = (f"with m={got} the bubble is {frac:.2%}, below {target:.0%}, but that m is "
                    f"the one plain 1F1B needs: with v={v} chunks the pipeline fills and drains "
                    f"v times faster, so the share of the step is {formula}")
        elif frac < target and got == ideal:
            hint = (f"with m={got} the bubble is {frac:.2%}, below {target:.0%}, but a smaller m "
                    f"also is: did you use {over_ideal}, the bubble over the ideal time? The "
                    f"share of the step is {formula}")
        elif frac < target:
            hint = (f"with m={got} the bubble is {frac:.2%}, below {target:.0%}, but a smaller m "
                    f"also is: find the first m at which {formula} drops below {target:.0%}"
                    + (" (m a multiple of p)" if name != "1F1B" else ""))
        elif math.isclose(frac, target):
            hint = f"with m={got} the bubble is exactly {target:.0%}; below means less than"
        else:
            hint = f"with m={got} the simulator measures {frac:.2%}, not below {target:.0%}"
        raise CheckError(f"{name}: your m is {got}: {hint}", expected=f"{name} m={want}")
    _ok(f"1F1B needs m={want_a} ({(p - 1) / (want_a + p - 1):.2%}); interleaved with v={v} "
        f"m={want_b} ({(p - 1) / (v * want_b + p - 1):.2%}): {want_a / want_b:.1f}x fewer "
        f"micro-batches per step, each crossing pv-1 = {p * v - 1} stage boundaries each way "
        f"instead of p-1 = {p - 1}")


# ---- 07 pipelines: the zero-bubble saving --------------------------------------------------------

@exercise
def check_zb_bubble(bubble, p: int = 4, m: int = 8, f: float = 2.0, b: float = 2.0,
                    w: float = 1.0) -> None:
    """ZB-H1's idle time per rank with per-micro-batch costs f (forward), b (input
    gradient), w (weight gradient): (p-1)(f + b - w), as the simulator measures it."""
    from ..parallel.schedules import zb_h1
    if isinstance(bubble, (tuple, list)) and len(bubble) == p:
        raise CheckError(f"bubble should be one number; {tuple(bubble)!r} holds one idle time "
                         "per rank (SimulationResult.bubble_time): give the idle time of one "
                         "rank (under ZB-H1 every rank idles as long)")
    bubble = _number("bubble", bubble)      # a Python or NumPy number (a tensor: .item())
    want = (p - 1) * (f + b - w)            # Qi et al. 2024, sec. 3.1 (w <= f, b)
    if math.isclose(bubble, want, rel_tol=1e-6):
        sim = simulate(zb_h1(p, m), f=f, b=b, w=w)
        _ok(f"(p-1)(f+b-w) = {want:g} time units per rank; the simulator measures "
            f"{sim.bubble_time[0]:g}; 1F1B idles (p-1)(f+b+w) = {(p - 1) * (f + b + w):g}")
        return
    wrong = [((p - 1) * (f + b + w), "that is 1F1B's bubble, (p-1)(f+b+w): ZB-H1 moves the "
              "W's into it"),
             ((p - 1) * (f + b), "(p-1)(f+b) leaves W out; ZB-H1's deferred W's also fill "
              "part of the warm-up's idle time: subtract w"),
             (want / (m * (f + b + w) + want), "that is the bubble's share of the step; give "
              "the idle time per rank, in the units of f, b, w"),
             ((p - 1) * (f + b - 2 * w), "that is ZB-H2's, (p-1)(f+b-2w), at the price of "
              "2p-1 activations in flight"),
             (p * (f + b - w), "p(f+b-w) counts p gaps: a pipeline of p stages idles "
              "through p-1 of them"),
             (m * (f + b + w) + want, "that is the whole step (its makespan); the bubble is "
              "the part of it each rank idles"),
             (100 * want / (m * (f + b + w) + want), "that is the bubble's share of the step "
              "as a percentage; give the idle time per rank, in the units of f, b, w")]
    if (f, b, w) != (1, 1, 1):      # section 4's costs in place of the exercise's
        wrong.append(((p - 1) * (1 + 1 - 1), f"that is with f = b = w = 1, section 4's costs; "
                      f"the exercise has f={f:g}, b={b:g}, w={w:g}"))
    # with some costs two mistakes give one number (p=4, f=b=2, w=1: (p-1)(f+b) = p(f+b-w)
    # = 12): name every mistake it matches, not only the first
    named = [text for value, text in wrong if math.isclose(bubble, value, rel_tol=1e-6)]
    if named:
        raise CheckError(f"your bubble is {bubble:g}: " + "; or ".join(named),
                         expected=f"{want:g}")
    raise CheckError(f"your bubble is {bubble:g}: ZB-H1 idles (p-1)(f+b-w) per rank, with "
                     f"p={p}, f={f:g}, b={b:g}, w={w:g}", expected=f"{want:g} = (p-1)(f+b-w)")
