"""The per-candidate strategy validator (workbench.parallel.validate): every candidate
of a sample of rules is forced and held to one device; a deliberately wrong rule and a
rule that misses layouts are caught."""
from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.parallel.ops_table.samples import samples
from workbench.parallel.ops_table.strategy import RULES, _infer_cached, combine, register_rule
from workbench.parallel.ops_table.table import register, unregister
from workbench.parallel.placement import Partial, Replicate, Shard
from workbench.parallel.validate import Sample, distribute, validate

# one or two ops of each rule family (benchmarks/validate_rules.py runs them all)
SAMPLE_OPS = ["relu", "neg", "add", "mul", "div", "gt", "where", "sum", "amax", "softmax",
              "matmul", "reshape", "cat", "getitem", "layer_norm", "embedding",
              "cross_entropy", "half"]


def test_a_sample_of_rules_has_no_wrong_candidate():
    rep = validate(SAMPLE_OPS, meshes=((3,), (2, 2)), max_layouts=3,
                   table=samples(known_bugs=False), missing=False)
    assert rep.ops == SAMPLE_OPS and rep.runs > 250 and not rep.skipped
    assert rep.wrong == [], rep.format()


def test_missing_layouts_are_searched_on_1d_meshes():
    rep = validate(["neg", "relu"], meshes=((2,),), table=samples(known_bugs=False))
    got = {(f.op, f.candidate) for f in rep.missing}
    # neg maps max to min (min(-a_i) = -max(a_i)): the rule does not offer it, so the
    # search reports it; relu is monotone and its rule offers P(min) -> P(min): not missing
    assert ("neg", "([P(max)]) -> ([P(min)])") in got
    assert ("relu", "([P(min)]) -> ([P(min)])") not in got
    assert rep.wrong == []
    assert "missing for neg" in str(rep)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("shape", [(2,), (3,), (2, 2)])
def test_partial_inputs_are_unequal_parts_of_the_value(op, shape):
    mesh = wb.Mesh.grid(shape)
    x = torch.randn(5, 3, dtype=torch.float64)
    t = distribute(x, mesh, [Partial(op)] * len(shape))
    torch.testing.assert_close(t.full(), x)
    locs = t.locals()
    n = len(locs)
    for a in locs:                       # no rank holds the value, nor value / n
        assert not torch.allclose(a, x) and not torch.allclose(a, x / n)
    assert not torch.allclose(locs[0], locs[1])


# ---- the validator catches wrong rules ---------------------------------------------------

def _private_op(name, rule):
    """A private op running relu locally, with ``rule`` as its SPMD rule."""
    def fn(x):
        return torch.relu(x)
    fn.__name__ = name
    register(name, [fn], parse=lambda x: ((x,), {}), rule=rule,
             local=lambda nd, ctx, x: torch.relu(x))
    return fn


@pytest.fixture
def private_ops():
    made = []

    def make(name, rule):
        fn = _private_op(name, rule)
        made.append((name, fn))
        return fn
    yield make
    for name, fn in made:
        unregister(name)
    _infer_cached.cache_clear()


def test_a_wrong_candidate_is_reported(private_ops):
    R, P = Replicate(), Partial("sum")

    def bad_rule(x):             # claims relu is linear: P(sum) -> P(sum) (it is not)
        return combine(x.mesh.ndim, [[((R,), (R,), ""), ((Shard(0),), (Shard(0),), ""),
                                      ((P,), (P,), "wrong on purpose")]] * x.mesh.ndim, 1)
    fn = private_ops("_test_bad_relu", bad_rule)
    x = torch.randn(5, 4)
    rep = validate(["_test_bad_relu"], meshes=((2,), (2, 2)),
                   table={"_test_bad_relu": [Sample(fn, (x,))]}, missing=False)
    bad = {f.candidate for f in rep.wrong}
    assert bad == {"([P(sum)]) -> ([P(sum)])", "([P(sum), P(sum)]) -> ([P(sum), P(sum)])",
                   "([P(sum), R]) -> ([P(sum), R])", "([R, P(sum)]) -> ([R, P(sum)])",
                   "([S(0), P(sum)]) -> ([S(0), P(sum)])", "([P(sum), S(0)]) -> ([P(sum), S(0)])"}
    # every input layout that can reach the wrong candidate reports it, with its error
    # on one mesh dim, only a real P(sum) input reaches it wrong: R, S and the other
    # partials reshard to P(sum) by keeping the value on one rank, where relu is exact
    assert {f.inputs for f in rep.wrong if f.mesh == (2,)} == {"[P(sum)]"}
    assert all(f.max_error > 0.01 and "values differ" in f.detail for f in rep.wrong)
    assert "wrong: _test_bad_relu(float32[5, 4]) on mesh (2,)" in str(rep)


def test_a_rule_that_misses_layouts_is_reported(private_ops):
    def narrow_rule(x):          # only the replicated strategy
        return combine(x.mesh.ndim, [[((Replicate(),), (Replicate(),), "")]] * x.mesh.ndim, 1)
    fn = private_ops("_test_narrow_relu", narrow_rule)
    rep = validate(["_test_narrow_relu"], meshes=((2,),),
                   table={"_test_narrow_relu": [Sample(fn, (torch.randn(5, 4),))]})
    assert rep.wrong == []
    assert {f.candidate for f in rep.missing} == {
        "([S(0)]) -> ([S(0)])", "([S(1)]) -> ([S(1)])",
        "([P(max)]) -> ([P(max)])", "([P(min)]) -> ([P(min)])"}


def test_rules_without_a_local_implementation_are_counted_not_failed(private_ops):
    register_rule("_test_rule_only")(lambda x: [])
    try:
        rep = validate(["_test_rule_only", "relu"], meshes=((2,),), missing=False)
        assert rep.skipped == {"_test_rule_only": "no local implementation"}
        assert rep.ops == ["relu"] and "skipped 1 (no local implementation)" in str(rep)
    finally:
        RULES.pop("_test_rule_only")


# ---- bugs the validator and issue 10 found, fixed: each stays a test ----------------------

def test_partial_plus_scalar_has_no_wrong_candidate():
    tab = {k: [s for s in v if any(not isinstance(a, torch.Tensor) for a in s.args)]
           for k, v in samples().items() if k in ("add", "sub")}
    assert validate(["add", "sub"], meshes=((2,),), table=tab, missing=False).wrong == []


@pytest.mark.parametrize("op", ["log", "sqrt"])
def test_monotone_rules_outside_the_domain(op):
    assert validate([op], meshes=((2,),), missing=False).wrong == []


def test_int_amin_with_an_empty_shard():
    x = torch.arange(21).reshape(7, 3) % 5
    rep = validate(["amin"], meshes=((2, 2),), max_layouts=1, missing=False,
                   table={"amin": [Sample(torch.amin, (x, 1))]})
    assert rep.wrong == [], rep.format()


def test_flash_attention_heads_split_unevenly():
    q, k = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 7, 4)
    rep = validate(["flash_attention"], meshes=((3,),), max_layouts=1, missing=False,
                   table={"flash_attention": [Sample(wb.ops.flash_attention, (q, k, k))]})
    assert rep.wrong == [], rep.format()
