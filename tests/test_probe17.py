"""probe17: wb.compile's O0 collectives held to eager's on the compile probe's seeds.

* narrow 236: ``t.contiguous()`` of an EMPTY P(sum) tensor all-reduced it in eager (its
  reshards cost nothing, so the chooser's tie went to the rule's first, replicated,
  strategy): a needless collective; a zero-cost tie now goes to the fewer collectives.
* narrow 227: ``torch.sum(x, -1, out=z)`` raised ``TypeError`` in sum's parse under
  capture; a write through ``out=`` now breaks with the tracer's own reason.
* wide 342: kthvalue of a 0-dim P(min) tensor cast its zero index from the partial
  (``zeros_like(x).long()``: an all-reduce for nothing); the index is made long at once.
* wide 350: ``_foreach_addcmul`` on a complex P(sum) tensor: capture records foreach's
  ``to`` of the same dtype, whose rule let no P(sum) of a complex tensor pass (a
  reduce-scatter eager never sends); a cast to its own dtype passes every partial.
* wide 321: the probe's program reads the plain index under capture (the harness's
  ``_pick``) and the DistTensor in eager; the same program reading one global DistTensor
  index records eager's collectives at O0 (test below).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import workbench as wb
from workbench.parallel import Partial, Replicate, Shard
from workbench.parallel.validate import distribute


def _comm(tr) -> Counter:
    return Counter(e.name for e in tr.events if e.stream == "comm" and 0 in e.ranks)


@pytest.mark.parametrize("seed,wide", [(236, False), (342, True), (350, True)])
def test_probe_seeds_compile_with_eager_collectives(seed, wide):
    """Differed at O0 (collective counts): compiled at every level, equal to eager (O0:
    exactly, its collectives eager's)."""
    from tests.compile_probe import probe
    p, out = probe(seed, wide)
    assert all(st == "compiled" for st, _ in out.values()), "\n".join(p.lines) + f"\n{out}"


def test_probe_seed_227_out_write_breaks_with_its_reason():
    from tests.compile_probe import probe
    p, out = probe(227, False)
    for st, why in out.values():
        assert st == "eager", out
        assert "TypeError" not in why and "sum writes into a traced tensor" in why, why


def test_sum_out_in_program_breaks_and_runs_eagerly():
    mesh = wb.Mesh([0, 1])
    x = distribute(torch.arange(6.0, dtype=torch.float64).reshape(2, 3), mesh, [Shard(0)])

    def f(t):
        z = torch.zeros(2, dtype=torch.float64)
        z = distribute(z, mesh, [Replicate()])
        torch.sum(t * 2, -1, out=z)
        return z + 1
    want = f(x)
    prog = wb.compile(f, x, level="O0")
    assert prog.breaks and "writes into a traced tensor" in prog.breaks[0].reason
    got = prog(x)
    assert torch.equal(got.full(), want.full())
    assert torch.equal(want.full(), (torch.arange(6.0, dtype=torch.float64).reshape(2, 3) * 2)
                       .sum(-1) + 1)


@pytest.mark.parametrize("op", ["contiguous", "clone", "reshape"])
def test_empty_partial_copy_sends_nothing(op):
    mesh = wb.Mesh([[0, 1], [2, 3]])
    x = distribute(torch.zeros((1, 1, 0), dtype=torch.float64), mesh,
                   [Replicate(), Partial("sum")], seed=1).requires_grad_(True)
    fn = {"contiguous": lambda t: t.contiguous(), "clone": lambda t: t.clone(),
          "reshape": lambda t: t.reshape(1, 0)}[op]
    with wb.trace() as tr:
        y = fn(x)
    assert _comm(tr) == Counter()
    assert y.full().shape == fn(x.full()).shape
    # a tensor with elements still chooses as before (nothing moved either way)
    z = distribute(torch.ones((2, 3), dtype=torch.float64), mesh, [Replicate(), Partial("sum")],
                   seed=1)
    with wb.trace() as tr:
        w = fn(z) if op != "reshape" else z.reshape(3, 2)
    assert _comm(tr) == Counter() and tuple(w.placements) == tuple(z.placements)


def test_kthvalue_0d_partial_min_one_all_reduce():
    mesh = wb.Mesh([1, 0])
    t = distribute(torch.tensor(-0.69, dtype=torch.float64), mesh, [Partial("min")],
                   seed=530).requires_grad_(True)
    ref = torch.kthvalue(t.full().detach(), 1, 0)
    with wb.trace() as tr:
        v, i = torch.kthvalue(t, 1, 0)
    # none: the value is a copy, which keeps P(min) as DTensor's clone does (was the
    # value's all-reduce before compile18; never the index's)
    assert _comm(tr) == Counter() and tuple(v.placements) == (Partial("min"),)
    assert torch.equal(v.full(), ref.values) and torch.equal(i.full(), ref.indices)
    assert i.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.complex128, torch.float64, torch.int64])
def test_cast_to_own_dtype_passes_partials(dtype):
    from workbench.parallel.ops_table.casts import cast_rule
    from workbench.parallel.spec import TensorSpec
    mesh = wb.Mesh([0, 1])
    spec = TensorSpec((3,), mesh, (Partial("sum"),), dtype)
    outs = {st.outputs[0] for st in cast_rule(spec, dtype=dtype)}
    assert (Partial("sum"),) in outs
    narrow = {st.outputs[0] for st in cast_rule(spec, dtype=torch.float32)}
    assert (Partial("sum"),) not in narrow          # a narrowing cast rounds each part


def test_global_dist_index_o0_collectives_are_eager():
    """Wide seed 321's program with the DistTensor index read by both runs."""
    mesh = wb.Mesh([[0, 7], [6, 1], [2, 3], [4, 5]])
    x = distribute(torch.randn(5, 3, 4, dtype=torch.float64,
                               generator=torch.Generator().manual_seed(0)),
                   mesh, [Replicate(), Replicate()]).requires_grad_(True)
    di = distribute(torch.tensor([2, 3, 4]), mesh, [Replicate(), Shard(0)])

    def f(t):
        return torch.index_select(t, 0, di) * 2
    with wb.trace() as te:
        want = f(x)
    prog = wb.compile(f, x, level="O0")
    with wb.trace() as tc:
        got = prog(x)
    assert torch.equal(got.full(), want.full())
    assert torch.equal(want.full(), x.full()[torch.tensor([2, 3, 4])] * 2)
    assert _comm(tc) == _comm(te) == Counter({"all_gather": 1})


@pytest.mark.parametrize("seed", [308, 325])
def test_probe_seeds_norm_root_reduced_twice(seed):
    """Wide 308 (matrix_norm 'fro'), 325 (torch.dist): O0 all_reduce 3 where eager sends 2
    (vector_norm._root's ``_reduced`` was a no-op under capture; now a ``reduced_copy``,
    compile18)."""
    from tests.compile_probe import probe
    p, out = probe(seed, True)
    assert out["O0"][0] == "compiled", "\n".join(p.lines) + f"\n{out}"
