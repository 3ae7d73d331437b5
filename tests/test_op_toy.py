"""Adding an op touches one module: a toy op whose callable, parse, rule, local
implementation, cost and validator sample sit in one small module file (written here,
as a user would write it) runs on DistTensors like one device, ``explain`` describes
it, the cost model prices it on the trace, the validator checks every candidate of its
rule; unregistering it leaves the op table as it was."""
import importlib
import sys

import pytest
import torch

import workbench as wb
from workbench.parallel.ops_table import TABLE, unregister
from workbench.parallel.ops_table.table import BY_FUNC
from workbench.parallel.validate import validate

TOY_MODULE = '''
"""toy_axpy(x, y, alpha) = alpha * x + y: one op, one registration."""
import torch
from torch.overrides import handle_torch_function, has_torch_function

from workbench.parallel.ops_table import costs
from workbench.parallel.ops_table.samples import Sample
from workbench.parallel.ops_table.strategy import combine
from workbench.parallel.ops_table.table import register
from workbench.parallel.placement import Partial, Replicate, Shard


def toy_axpy(x, y, alpha=2.0):
    if has_torch_function((x, y)):                   # a DistTensor: the dispatcher
        return handle_torch_function(toy_axpy, (x, y), x, y, alpha)
    return alpha * x + y


def toy_axpy_rule(x, y, *, alpha):
    """toy_axpy: elementwise on inputs of one shape; linear in (x, y) jointly."""
    R = Replicate()
    opts = [((R, R), (R,), "replicated")]
    opts += [((Shard(d), Shard(d)), (Shard(d),), f"toy: dim {d} sharded passes")
             for d in range(x.ndim) if x.shape[d] > 1]
    opts.append(((Partial(), Partial()), (Partial(),), "toy: linear in (x, y)"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 2)


def _parse(x, y, alpha=2.0):
    if x.shape != y.shape:
        raise ValueError(f"toy_axpy: x.shape={tuple(x.shape)} != y.shape={tuple(y.shape)}")
    return (x, y), {"alpha": float(alpha)}


register("toy_axpy", [toy_axpy], parse=_parse, rule=toy_axpy_rule,
         local=lambda nd, ctx, x, y, alpha: alpha * x + y,
         cost=costs.elementwise(2), op_class="elementwise",          # a multiply, an add
         sample=lambda g: [Sample(toy_axpy, (g.rn(5, 6), g.rn(5, 6)), {"alpha": 3.0})])
'''

M2 = wb.Mesh.grid(2, ["a"])


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / "toy_axpy_op.py").write_text(TOY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = dict(TABLE)
    mod = importlib.import_module("toy_axpy_op")
    try:
        yield mod
    finally:
        unregister("toy_axpy")
        sys.modules.pop("toy_axpy_op", None)
        assert TABLE == before and mod.toy_axpy not in BY_FUNC
        assert "toy_axpy" not in wb.spmd.RULES


def test_a_toy_op_in_one_module_runs_is_explained_priced_and_validated(toy):
    torch.manual_seed(0)
    X, Y = torch.randn(5, 6), torch.randn(5, 6)
    want = 3.0 * X + Y
    assert TABLE["toy_axpy"].runs and wb.spmd.RULES["toy_axpy"] is toy.toy_axpy_rule

    # the dispatcher: rows sharded stay sharded, no communication; P(sum) stays P(sum)
    x, y = (wb.shard_tensor(t, M2, [wb.Shard(0)]) for t in (X, Y))
    with wb.trace() as tr:
        out = toy.toy_axpy(x, y, 3.0)
    assert out.placements == (wb.Shard(0),)
    torch.testing.assert_close(out.full(), want)
    assert not [e for e in tr.events if e.stream != "compute"]
    px, py = (wb.from_local([t / 4, 3 * t / 4], M2, [wb.Partial()]) for t in (X, Y))
    p_out = toy.toy_axpy(px, py, 3.0)
    assert p_out.placements == (wb.Partial(),)
    torch.testing.assert_close(p_out.full(), want)

    # the cost model: 2 FLOPs per output element of the busiest rank (3 of 5 rows),
    # x and y read and the output written in float32
    ev = [e for e in tr.events if e.stream == "compute" and e.name == "toy_axpy"]
    assert len(ev) == 1 and ev[0].args["op_class"] == "elementwise"
    assert ev[0].flops == 2 * 3 * 6 and ev[0].bytes == 3 * (3 * 6 * 4) and ev[0].duration > 0

    # explain: the op, its rule's choice and why, its class and FLOPs
    yr = wb.shard_tensor(Y, M2, [wb.Replicate()])
    ex = wb.explain(lambda a, b: toy.toy_axpy(a, b, 3.0), x, yr)
    (row,) = ex.rows
    assert row.op == "toy_axpy" and row.op_class == "elementwise" and row.flops == 36
    assert row.required == ((wb.Shard(0),), (wb.Shard(0),)) and row.outputs == ((wb.Shard(0),),)
    assert "toy: dim 0 sharded passes" in row.reason and row.candidates >= 3
    assert "toy_axpy" in str(ex)
    torch.testing.assert_close(ex.result.full(), want)

    # the validator: every candidate of the rule, on the registered sample
    rep = validate(["toy_axpy"], meshes=((3,), (2, 2)), max_layouts=12)
    assert rep.ops == ["toy_axpy"] and rep.runs > 50 and rep.layouts == 24 and not rep.skipped
    assert rep.wrong == [], rep.format()
    # and searches the layouts the rule misses: the mean of the parts is affine too
    assert [f.candidate for f in rep.missing] == ["([P(avg)], [P(avg)]) -> ([P(avg)])"]


def test_the_validator_catches_a_wrong_rule_of_the_toy_op(toy):
    from workbench.parallel.ops_table.strategy import combine
    from workbench.parallel.placement import Partial, Replicate

    def wrong(x, y, *, alpha):            # claims y may stay replicated beside a P(sum) x
        return combine(x.mesh.ndim, [[((Replicate(), Replicate()), (Replicate(),), ""),
                                      ((Partial(), Replicate()), (Partial(),), "wrong")]]
                       * x.mesh.ndim, 2)
    wb.register_rule("toy_axpy", override=True)(wrong)
    rep = validate(["toy_axpy"], meshes=((2,),), missing=False)
    assert {f.candidate for f in rep.wrong} == {"([P(sum)], [R]) -> ([P(sum)])"}


def test_register_refuses_a_sample_that_is_neither_a_function_nor_a_reason():
    from workbench.parallel.ops_table import register
    with pytest.raises(TypeError, match=r"register\('_toy_bad'\): sample=\[1, 2\]"):
        register("_toy_bad", [], sample=[1, 2])
    assert "_toy_bad" not in TABLE

