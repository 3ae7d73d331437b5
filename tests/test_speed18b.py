"""The chooser's first-call speed-ups (task speed18b) change no decision: ``combine``'s
strategies built once per argument values, each decision's per-input prices memoized,
the shortcut's walk of the strategies handed to the full decision.  Each is held to the
unmemoized computation it replaces."""
import itertools

import pytest
import torch

import workbench as wb
from workbench.parallel.ops_table import free_choice as FC
from workbench.parallel.ops_table import strategy as ST
from workbench.parallel.reshard import plan_reshard_cached
from workbench.parallel.spec import TensorSpec

R, S, P = wb.Replicate(), wb.Shard, wb.Partial
MESH = wb.Mesh.grid((2, 2), ["a", "b"])


def _opts():
    return [((R, R), (R,), "replicated"), ((S(0), R), (S(0),), "rows"),
            ((S(1), S(0)), (P(),), "contraction"), ((P(), R), (P(),), "")]


def test_combine_returns_equal_strategies_in_a_new_list_each_call():
    per_dim = [_opts(), _opts()]
    want = ST._combine(2, per_dim, 2, 1, 512)          # the builder itself, uncached
    ST._COMBINED.clear()
    first = ST.combine(2, per_dim, 2)
    again = ST.combine(2, [_opts(), _opts()], 2)        # equal values, new objects: a hit
    assert first == want == again and len(first) == 16
    assert first is not again                            # a new list: a rule may edit it
    first.append("x")
    assert ST.combine(2, per_dim, 2) == want             # the cached strategies untouched
    with pytest.raises(Exception):                       # and frozen
        again[0].note = "changed"


def test_combine_keys_on_every_argument():
    per_dim = [_opts(), _opts()]
    base = ST.combine(2, per_dim, 2)
    # another note, placement, input count, output count or limit: another answer
    other = [_opts()[:3] + [((P(), R), (P(),), "linear")], _opts()]
    assert ST.combine(2, other, 2) != base
    assert ST.combine(2, other, 2) == ST._combine(2, other, 2, 1, 512)
    shard = [_opts()[:1] + [((S(1), R), (S(0),), "rows")] + _opts()[2:], _opts()]
    assert ST.combine(2, shard, 2) == ST._combine(2, shard, 2, 1, 512) != base
    assert ST.combine(2, per_dim, 1) == ST._combine(2, per_dim, 1, 1, 512) != base
    assert ST.combine(2, per_dim, 2, limit=4) == ST._combine(2, per_dim, 2, 1, 4) != base
    assert len(ST.combine(2, per_dim, 2, limit=4)) == 4


def test_combine_with_list_options_is_built_every_time():
    per_dim = [[([R, R], [R], "replicated"), ([S(0), R], [S(0)], "rows")]]
    got = ST.combine(1, per_dim, 2)
    assert got == ST._combine(1, per_dim, 2, 1, 512) and len(got) == 2
    assert got[1].inputs == ((S(0),), (R,))


def _specs(shapes, combo, dtype=torch.float32):
    return tuple(TensorSpec(s, MESH, ps, dtype) for s, ps in zip(shapes, combo))


def _unmemoized(op, specs, attrs):
    """The decision as it was made before: every input of every strategy priced by the
    planner, the rule's strategies deduplicated with a plain membership test."""
    rule = ST.get_rule(op)
    strategies = ST.call_rule(rule, specs, attrs)
    profile = ST._profile_name()
    cands, seen = [], set()
    for order, st in enumerate(strategies):
        key = (st.inputs, st.outputs)
        if key in seen or not ST._bool_ok(specs, st):
            continue
        seen.add(key)
        plans, t, b, dt, db = [], 0.0, 0, 0.0, 0
        for spec, req in zip(specs, st.inputs):
            if spec is None or req is None:
                plans.append(None)
                continue
            p = plan_reshard_cached(spec, req, profile)
            plans.append(p)
            t += p.total_time
            b += p.total_bytes
            for s_ in p.steps:
                if s_.kind == "local_pad":
                    t_, b_ = ST.deferred_price(spec.mesh, s_.mesh_dim, s_.buffer_bytes, profile)
                    dt += t_
                    db += b_
        for i, nb in st.deferred:
            t_, b_ = ST.deferred_price(MESH, i, nb, profile)
            dt += t_
            db += b_
        assert ST.strategy_cost(specs, st, profile) == (plans, t, b, dt, db)
        moves = sum(len(p.collectives()) for p in plans if p is not None) \
            if t + dt == 0 else 0
        cands.append(((t + dt, b + db, 0.0, 0, moves, order),
                      (st, tuple(plans), t, b, dt, db)))
    cands.sort(key=lambda c: c[0])
    return [c[1] for c in cands]


def _as_tuples(dec):
    return [(c.strategy, c.plans, c.time, c.bytes, c.deferred_time, c.deferred_bytes)
            for c in dec.candidates]


@pytest.mark.parametrize("op,shapes,dtype", [
    ("linear", [(3, 5, 6), (4, 6), (4,)], torch.float32),
    ("add", [(5, 6), (5, 6)], torch.float32),
    ("add", [(5, 6), (5, 6)], torch.bool),        # bools: _bool_ok refuses P(sum)
])
def test_decisions_equal_the_unmemoized_ranking(op, shapes, dtype):
    # (a bool partial sum has no plan to anything: bools start replicated or sharded)
    opts = lambda n: [R] + [S(d) for d in range(n)] + [P()] * (dtype != torch.bool)  # noqa
    per = [list(itertools.product(opts(len(s)), repeat=2)) for s in shapes]
    combos = list(itertools.product(*per))
    combos = combos[::max(1, len(combos) // 40)]       # a spread of layouts
    assert len(combos) >= 40
    for combo in combos:
        specs = _specs(shapes, combo, dtype)
        ST._infer_cached.cache_clear()
        dec = FC.choose(op, specs, {}, check=True)      # the shortcut, then the full one
        full = dec.full() if isinstance(dec, FC.FreeDecision) else dec
        assert _as_tuples(full) == _unmemoized(op, specs, {}), combo
        # the decision made alone (no handed-off walk) is the same
        ST._infer_cached.cache_clear()
        alone = ST._infer_cached(op, specs, (), ST._profile_name(), ())
        assert _as_tuples(alone) == _as_tuples(full) and alone.reason == full.reason


def test_bool_inputs_still_refuse_a_partial_sum():
    sts = ST.call_rule(ST.get_rule("add"), _specs([(5, 6), (5, 6)], [(R, R), (R, R)]), {})
    asks = lambda st: any(p.is_partial() for ps in st.inputs if ps for p in ps)  # noqa: E731
    assert any(asks(st) for st in sts)
    bools = _specs([(5, 6), (5, 6)], [(R, R), (R, R)], torch.bool)
    kept = [st for _, st in ST.distinct(bools, sts)]
    assert kept == [st for st in sts if not asks(st)]
    # float inputs: every strategy kept, each once, in the rule's order
    floats = _specs([(5, 6), (5, 6)], [(R, R), (R, R)])
    assert ST.distinct(floats, sts + sts[:3]) == list(enumerate(sts))


@pytest.mark.parametrize("mesh_shape", [(2, 2), (1, 2)])
def test_shortcut_skips_only_searches_whose_plan_has_a_collective(mesh_shape):
    """free_choice._needs_collective: where it says no local path exists, the planner's
    plan has a step that is not free; and the shortcut's classification of every move
    equals the planner's (the plan's steps where all are free, else None)."""
    from workbench.parallel.reshard import plan_reshard_cached
    mesh = wb.Mesh.grid(mesh_shape, ["a", "b", "c"][:len(mesh_shape)])
    opts = [R, S(0), S(1), P()]
    profile = ST._profile_name()
    layouts = list(itertools.product(opts, repeat=len(mesh_shape)))
    skipped = searched = 0
    for src in layouts:
        spec = TensorSpec((4, 6), mesh, src)
        for dst in layouts:
            steps = plan_reshard_cached(spec, dst, profile).steps
            free = steps if all(s.kind in FC._LOCAL_FREE for s in steps) else None
            FC._TEMPLATES.clear()
            assert FC._steps(spec, dst, profile) == free, (src, dst)
            if FC._needs_collective(src, dst, mesh.shape):
                assert free is None, (src, dst)
                skipped += 1
            else:
                searched += 1
    # most moves skip the search; some that do search are free, some are not
    assert skipped > searched > 0


def test_input_price_memo_gives_a_fresh_prices_answer():
    from workbench.parallel.reshard import plan_reshard_cached
    prof = ST._profile_name()
    spec = TensorSpec((5, 6), MESH, (S(0), P()))
    ST._PRICES.clear()
    a = ST.input_price(spec, (R, S(1)), prof)
    p = plan_reshard_cached(spec, (R, S(1)), prof)
    assert a == (p, p.total_time, p.total_bytes, ()) and p.total_bytes > 0
    # an equal spec built again: the memo's answer; a list of placements: not memoized,
    # the same answer
    assert ST.input_price(TensorSpec((5, 6), MESH, (S(0), P())), (R, S(1)), prof) is a
    assert ST.input_price(spec, [R, S(1)], prof) == a and len(ST._PRICES) == 1
    # float64: another key, twice the bytes
    d = ST.input_price(TensorSpec((5, 6), MESH, (S(0), P()), torch.float64), (R, S(1)), prof)
    assert d[2] == 2 * a[2] and len(ST._PRICES) == 2
    # a zero-pad (S -> P(sum)) carries its deferred reduce-scatter's price
    z = ST.input_price(spec, (P(), P()), prof)
    pz = plan_reshard_cached(spec, (P(), P()), prof)
    pads = [s_ for s_ in pz.steps if s_.kind == "local_pad"]
    assert pads and z[3] == tuple(ST.deferred_price(MESH, s_.mesh_dim, s_.buffer_bytes, prof)
                                  for s_ in pads)
