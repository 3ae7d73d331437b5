"""chooser17: several readers slicing one marked copy are priced as the run sends their
gradient back: once.

``wb.reshard(x, [R])`` of a sharded ``x`` (a program's ``t.redistribute`` alike) records the
gradient's way back once (``reshard_backward.mark``); autograd sums its readers' gradients
and the way plans one redistribution per merged layout (``reshard_backward._merged``).  The
chooser priced each reader's slice as if alone (``strategy.way_steps``): the second slice of
the gathered copy to the other operand's ``S(0)`` paid the all-to-all back again (192 B)
and the chooser gathered that operand instead (48 B), its output Replicate, which the sum
then sliced (an all-gather in backward) or gathered.  Now the way's key carries the layouts
its earlier readers noted (``_Way.key_with_uses``; O0: ``reshard_backward.way_noted`` in
``propagate.greedy`` and the step's ``schedule.build_schedule``): a read that merges into
theirs adds nothing.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import workbench as wb
from workbench.parallel import dispatch as _dispatch
from workbench.parallel.ops_table.strategy import infer
from tests.dtensor_support import oracle  # noqa: F401  (the DTensor oracle fixture)

R, S = wb.Replicate, wb.Shard
PROFILE = "a100"


def _v(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).double()    # small integers: exact sums


def _prog(mesh):
    def f(t, o1, o2):
        y = t.redistribute(mesh, [R()])
        return y * o1 + y * o2
    return f


def _inputs(mesh, o2_shape=(8, 1)):
    x = wb.shard_tensor(_v((8, 16), 0), mesh, [S(1)]).requires_grad_()
    o1 = wb.shard_tensor(_v((8, 16), 1), mesh, [S(0)])
    o2 = wb.shard_tensor(_v(o2_shape, 2), mesh, [S(0)])
    return x, o1, o2


def _traced(level, o2_shape=(8, 1)):
    mesh = wb.Mesh.grid((4,), ["tp"])
    x, o1, o2 = _inputs(mesh, o2_shape)
    f = _prog(mesh)
    if level != "eager":
        f = wb.compile(f, x, o1, o2, level=level)
    with wb.trace(PROFILE) as tr:
        out = f(x, o1, o2)
        n = len([e for e in tr.collectives() if 0 in e.ranks])
        out.sum().backward()
    ev = [(e.name, e.bytes) for e in tr.collectives() if 0 in e.ranks]
    return f, out, x, ev[:n], ev[n:], tr.time()


@pytest.mark.parametrize("level", ["eager", "O0"])
def test_second_slice_adds_nothing_to_the_way_back(level):
    """Eager and O0: both readers slice the gathered copy to S(0) (the second priced as
    what it adds to the way back: nothing), the sum moves nothing; forward one all-gather
    (768 B wire), backward one all-to-all (192 B), as the O1 search's program.  Before:
    the second reader gathered o2 (48 B) and the sum gathered the first product (768 B):
    forward 1,584 B and 28.07 us traced, now 768 B and 18.04 us.  Values and the gradient
    one device's, in x's layout."""
    _, out, x, fwd, bwd, t = _traced(level)
    _, out1, _, fwd1, bwd1, t1 = _traced("O1")
    xr = _v((8, 16), 0).requires_grad_()
    ref = xr * _v((8, 16), 1) + xr * _v((8, 1), 2)
    ref.sum().backward()
    torch.testing.assert_close(out.full(), ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(x.grad.full(), xr.grad, rtol=0, atol=0)
    assert x.grad.placements == (S(1),)
    assert out.placements == (S(0),)
    assert fwd == [("all_gather", 768)], fwd
    assert bwd == [("all_to_all", 192)], bwd
    assert (fwd, bwd) == (fwd1, bwd1)
    assert t == pytest.approx(t1, rel=1e-12)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_modeled_step_is_the_run(level):
    """The compiled step models the way back once for the two readers (O0 modeled it per
    reader: two all-to-alls where the run sends one), and its collectives are the run's."""
    prog, _, _, fwd, bwd, _ = _traced(level)
    st = prog.step()
    modeled = Counter((e.name, e.bytes) for e in st.trace.events
                      if e.stream == "comm" and 0 in e.ranks)
    assert modeled == Counter(fwd + bwd), (modeled, fwd, bwd)


def test_eager_equals_o0_decisions_and_prices():
    """O0's choice and backward price for the second reader are eager's: the way's key
    with the first reader's noted S(0) gradient, the slice priced 0 B back; the way
    priced alone (the key without uses) charges the all-to-all again."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    x, o1, o2 = _inputs(mesh)
    prog = wb.compile(_prog(mesh), x, o1, o2, level="O0")
    muls = [n for n in prog.graph.nodes if n.op == "mul"]
    c_o0 = prog.greedy.choice[muls[1].nid]
    with wb.trace(PROFILE):
        y = wb.reshard(x, mesh, [R()])
        first = y * o1
        grads = _dispatch._grads((y, o2))
        second = infer("mul", y.spec, o2.spec, _grads=grads)
        alone = infer("mul", y.spec, o2.spec, _grads=(grads[0][:3], False))
        del first
    assert len(grads[0]) == 4 and grads[0][3] == ((S(0),),)     # the first reader's use
    assert c_o0.strategy == second.chosen.strategy
    assert (c_o0.backward_time, c_o0.backward_bytes) == (second.chosen.backward_time,
                                                         second.chosen.backward_bytes)
    assert second.chosen.strategy.outputs == ((S(0),),)
    assert second.chosen.backward_bytes == 0
    sliced = next(c for c in alone.candidates if c.strategy == second.chosen.strategy)
    assert sliced.backward_bytes == 192
    assert alone.chosen.strategy.outputs == ((R(),),)           # the old choice


def test_readers_slicing_differently_each_priced():
    """A reader whose gradient does not merge into the earlier readers' (S(0) then S(1) on
    one mesh dim: the way plans each) is priced as its own plan, as before."""
    from workbench.parallel.ops_table.strategy import way_steps
    from workbench.parallel.reshard import plan_reshard
    mesh = wb.Mesh.grid((4,), ["tp"])
    spec = wb.TensorSpec((8, 16), mesh, [R()], torch.float64)
    way = ((R(),), (S(1),), (0,))
    to0 = plan_reshard(spec, placements=[S(0)], profile=PROFILE)
    alone, _ = way_steps(spec, to0, way, PROFILE)
    again, _ = way_steps(spec, to0, way + (((S(0),),),), PROFILE)
    other, _ = way_steps(spec, to0, way + (((S(1),),),), PROFILE)
    assert [s.kind for s in alone] == ["all_to_all"]
    assert again == ()
    assert [(s.kind, s.buffer_bytes) for s in other] == [(s.kind, s.buffer_bytes)
                                                          for s in alone]


def _two_slices(y, o1, o2):
    return y * o1 + y * o2


def test_two_slices_as_dtensor(oracle):  # noqa: F811
    """DTensor's run of ``wb.reshard(x, [R]) * o1 + ... * o2`` (x S(1), o1 and o2 S(0) on
    4 ranks): both products slice the gathered copy (DTensor's zero-cost strategy, its
    output S(0)), and the summed gradient goes back by one all-to-all; ours the same
    output placements and backward collectives (kind, buffer bytes), the gradient one
    device's.  Before, our second product gathered o2 and its output was Replicate."""
    from tests.test_reshardbwd import _ours, _reference, _theirs
    from workbench.parallel.interop import to_dtensor_placements
    others = [((8, 16), [S(0)]), ((8, 1), [S(0)])]
    t_ps, t_bwd = _theirs(oracle, (4,), [S(1)], [R()], _two_slices, others)
    out, bwd, grad = _ours((4,), [S(1)], [R()], _two_slices, others)
    assert to_dtensor_placements(out.placements) == t_ps
    torch.testing.assert_close(grad.full(), _reference(_two_slices, others), rtol=0, atol=0)
    assert Counter(bwd) == Counter(t_bwd) == Counter({("all_to_all", 8 * 16 * 4 // 4): 1}), \
        (bwd, t_bwd)
