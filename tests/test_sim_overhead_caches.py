"""The first call of an op on a new layout, made cheaper without changing any result
(task simperf; ``benchmarks/sim_overhead.py --only ops`` times the dispatcher):

* ``strategy.combine`` transposes each combination with ``zip`` (the strategies are the
  generator version's, element for element);
* the rule runs once per new layout: ``free_choice.choose`` hands the strategies its
  shortcut got to the full decision that follows (it ran the rule twice);
* the reduce-scatter price of a deferred reduction is memoized per (mesh, dim, bytes,
  profile) (``strategy.deferred_price``);
* torch's meta check (``checks.torch_meta_outputs``) and the local implementation's
  output shapes on meta tensors (``dispatch._out_shapes``) are memoized on what the meta
  call reads (shapes, dtypes, constants by type and value, attributes, default dtype),
  not placements: every layout of the same shapes asked again.

Each cached path is held to the uncached one, and each cache to a change that matters
(other shapes, dtypes, meshes, attributes, default dtype; a call that raised).
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import dispatch as D
from workbench.parallel.ops_table import checks
from workbench.parallel.ops_table import free_choice as FC
from workbench.parallel.ops_table import strategy as ST
from workbench.parallel.ops_table.matmul import linear_rule
from workbench.parallel.ops_table.table import TABLE
from workbench.parallel.spec import TensorSpec

R, S, P = wb.Replicate(), wb.Shard, wb.Partial()
MESH = wb.Mesh.grid((2, 2), ["a", "b"])


def cold():
    """Forget every decision, prepared op, plan template and memo."""
    D._PREPARED.clear()
    D._OUT_SHAPES.clear()
    checks._MEMO.clear()
    ST._infer_cached.cache_clear()
    ST._DEFERRED.clear()
    FC._TEMPLATES.clear()


def _combine_reference(mesh_ndim, per_dim, n_inputs, n_outputs=1):
    """``combine`` as it was written (a generator per input and output)."""
    out = []
    for combo in itertools.product(*per_dim):
        ins = []
        for k in range(n_inputs):
            ins.append(None if combo[0][0][k] is None else tuple(c[0][k] for c in combo))
        outs = tuple(tuple(c[1][j] for c in combo) for j in range(n_outputs))
        notes = [c[2] for c in combo if len(c) > 2 and c[2]]
        out.append(ST.Strategy(tuple(ins), outs, "; ".join(notes)))
    return out


def test_combine_gives_the_generator_versions_strategies():
    opts = [((R, None, S(0)), (R, S(1)), "a"), ((S(0), None, R), (S(0), P), ""),
            ((P, None, P), (P, R))]
    for nd in (1, 2, 3):
        got = ST.combine(nd, [opts] * nd, 3, 2)
        want = _combine_reference(nd, [opts] * nd, 3, 2)
        assert got == want and [s.note for s in got] == [s.note for s in want]
    # an option short of an output's placement raises, as it did
    with pytest.raises(IndexError):
        ST.combine(1, [[((R,), (R,))]], 1, 2)


def test_the_rule_runs_once_per_new_layout():
    # before: free_choice's shortcut ran the rule, found no free candidate, and the full
    # decision ran it again (2 calls per new layout)
    cold()
    calls = []
    entry = TABLE["linear"]
    orig = ST.RULES["linear"]

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)
    ST.RULES["linear"] = counting
    try:
        x = wb.shard_tensor(torch.randn(4, 6), MESH, [P, R])   # P x P: an all-reduce
        w = wb.shard_tensor(torch.randn(8, 6), MESH, [P, R])
        FC.COUNTS["full"] = 0
        F.linear(x, w)
        assert FC.COUNTS["full"] == 1 and len(calls) == 1
    finally:
        ST.RULES["linear"] = orig
        cold()
    assert entry.rule is orig


def _decision_fields(dec):
    return ([(c.strategy, c.plans, c.time, c.bytes, c.deferred_time, c.deferred_bytes)
             for c in dec.candidates], dec.reason, dec.chosen)


@pytest.mark.parametrize("xps, wps, bps", [
    ((S(1), R), (R, S(0)), (R, R)),
    ((P, R), (R, R), (R, S(0))),
    ((S(0), S(2)), (S(1), R), (R, P)),
])
def test_handed_strategies_give_the_decision_computed_alone(xps, wps, bps):
    specs = (TensorSpec((4, 5, 6), MESH, xps), TensorSpec((8, 6), MESH, wps),
             TensorSpec((8,), MESH, bps))
    cold()
    alone = ST._infer_cached("linear", specs, (), ST._profile_name())   # the rule runs here
    want = _decision_fields(alone)
    cold()
    dec = FC.choose("linear", specs, {})                           # shortcut, then full
    full = dec.full() if isinstance(dec, FC.FreeDecision) else dec
    assert _decision_fields(full) == want
    assert ST._HANDOFF[0] is None


def test_a_handoff_is_not_taken_by_other_arguments():
    specs = (TensorSpec((4, 6), MESH, (S(1), R)), TensorSpec((8, 6), MESH, (R, R)), None)
    other = (TensorSpec((4, 6), MESH, (R, R)), TensorSpec((8, 6), MESH, (R, R)), None)
    cold()
    ST.hand_off("linear", specs, (), ST.RULES["linear"], list(linear_rule(*specs)))
    got = ST._infer_cached("linear", other, (), "a100")    # other specs: the rule runs
    cold()
    assert _decision_fields(got) == _decision_fields(ST._infer_cached("linear", other, (),
                                                                      "a100"))
    # frozen attributes that thaw to other objects (a slice) are never handed over
    ST.hand_off("getitem", specs, (("index", ST._freeze(slice(1, 3))),), None, [])
    assert ST._HANDOFF[0] is None


def test_deferred_price_memo_equals_the_price_and_keys_the_mesh():
    from workbench.sim_mesh import cost as C
    other = wb.Mesh([[0, 4], [8, 12]], ["a", "b"])      # same shape, ranks on other nodes
    for mesh in (MESH, other, MESH):
        for dim, nb in ((0, 4096), (1, 4096), (1, 4096.0), (0, 1 << 24)):
            prof = wb.get_profile("a100")
            g = mesh.groups(dim)
            want = (max(C.price("reduce_scatter", nb, grp, prof) for grp in g),
                    C.wire_bytes("reduce_scatter", nb, len(g[0])))
            got = ST.deferred_price(mesh, dim, nb, "a100")
            assert got == want and type(got[1]) is type(want[1])


def test_meta_check_runs_once_per_global_shapes_and_not_stale(monkeypatch):
    # before: every layout of the same global shapes ran torch's meta check again
    cold()
    metas = []
    orig = checks._to_meta
    # (the args tuple of each meta call; _to_meta then recurses into its elements)
    monkeypatch.setattr(checks, "_to_meta",
                        lambda x: (type(x) is tuple and metas.append(1), orig(x))[1])
    X, W = torch.randn(4, 6), torch.randn(8, 6)
    outs = []
    for xps, wps in (((R, R), (R, S(0))), ((S(0), R), (R, R)), ((R, S(1)), (R, S(1)))):
        x, w = wb.shard_tensor(X, MESH, xps), wb.shard_tensor(W, MESH, wps)
        outs.append(F.linear(x, w).full())
    # the first layout's two meta calls only, torch's check and the output shapes (both
    # through checks.on_meta since fixlist6); was one per layout for each
    assert len(metas) == 2
    for o in outs:
        torch.testing.assert_close(o, F.linear(X, W), rtol=0, atol=1e-6)
    # other shapes, dtype, or a bad shape are checked again (the bad one raises as torch)
    x = wb.shard_tensor(X.double(), MESH, [R, R])
    assert F.linear(x, wb.shard_tensor(W.double(), MESH, [R, R])).dtype == torch.float64
    with pytest.raises(RuntimeError):
        F.linear(wb.shard_tensor(X, MESH, [R, R]), wb.shard_tensor(torch.randn(8, 5), MESH,
                                                                     [R, R]))
    with pytest.raises(RuntimeError):            # a call that raised is not kept
        F.linear(wb.shard_tensor(X, MESH, [S(0), R]), wb.shard_tensor(torch.randn(8, 5),
                                                                        MESH, [R, R]))


def test_call_key_separates_what_changes_the_meta_result():
    t = torch.randn(2, 3)
    k = checks.call_key
    assert k(torch.mul, (t, 2), {}) != k(torch.mul, (t, 2.0), {})       # int vs float
    assert k(torch.mul, (t, True), {}) != k(torch.mul, (t, 1), {})
    assert k(torch.sum, (t,), {"dim": 0}) != k(torch.sum, (t,), {"dim": 1})
    assert k(torch.sum, (t,), {}) != k(torch.sum, (t.double(),), {})
    assert k(torch.sum, (t,), {}) != k(torch.sum, (t.T,), {})
    assert k(torch.sum, (t,), {}) == k(torch.sum, (torch.zeros(2, 3),), {})
    assert k(torch.sum, ([t, lambda: 0],), {}) is None                  # not memoized
    prev = torch.get_default_dtype()
    try:
        a = k(torch.mul, (t.long(), 2.5), {})
        torch.set_default_dtype(torch.float64)
        assert k(torch.mul, (t.long(), 2.5), {}) != a
    finally:
        torch.set_default_dtype(prev)


def test_memoized_output_dtype_follows_the_default_dtype():
    # an int tensor times a float: the default dtype decides the result's (torch's rule)
    cold()
    xi = torch.arange(8).reshape(2, 4)
    prev = torch.get_default_dtype()
    try:
        for dt in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(dt)
            got = wb.shard_tensor(xi, MESH, [S(0), R]) * 2.5
            assert got.dtype == (xi * 2.5).dtype == dt
            assert torch.equal(got.full(), xi * 2.5)
    finally:
        torch.set_default_dtype(prev)
        cold()


def test_warm_and_cold_caches_give_bit_identical_results_and_gradients():
    torch.manual_seed(0)
    X, W, B = torch.randn(6, 5, 8), torch.randn(12, 8), torch.randn(12)

    def run():
        res = []
        for xps, wps in (((S(0), R), (R, S(0))), ((R, S(2)), (R, S(1))), ((S(1), R), (R, R))):
            x = wb.shard_tensor(X, MESH, xps)
            w = wb.shard_tensor(W, MESH, wps).requires_grad_()
            b = wb.shard_tensor(B, MESH, [R, R]).requires_grad_()
            y = torch.tanh(F.linear(x, w, b)) * 2.0
            y.sum().backward()
            res += [y.full(), w.grad.full(), b.grad.full(), y.placements]
        return res
    cold()
    first = run()
    second = run()                 # every cache warm
    cold()
    with FC.disabled():
        third = run()              # the full decision, no shortcut, no handoff
    for a, b, c in zip(first, second, third):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and torch.equal(a, c)
        else:
            assert a == b == c
