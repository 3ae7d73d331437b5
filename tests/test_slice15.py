"""slice15: a slice of a reshard's gathered result, priced by its recorded way back, eager
and compiled O0 alike.

``wb.reshard(x, [R])`` of a sharded ``x`` (and a program's ``t.redistribute``) records the
gradient's way back once, to the reshard's source (``reshard_backward.mark``): an op that
slices the gathered copy to ``S(k)`` sends its gradient back by one plan ``S(k) -> S(d)``
(an all-to-all; nothing where ``k == d``), as DTensor's ``Redistribute.backward``.  The
chooser priced that slice as a plain input's (an all-gather in backward) and gathered the
other operand instead (tests/test_reshardbwd.py, three cases, xfailed).  Now it prices the
way (``strategy.backward_price``; the dispatcher's ``_grads`` gives the way's key), and O0
gives a program's ``t.redistribute`` the same key (``propagate.pinned_way``), marks that
copy when it runs and lets its consumers' input reshards note their use on the way
(``reshard_backward.execute_marked``): eager and O0 move the same collectives, forward and
backward, and values and gradients are one device's.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import workbench as wb
from workbench.parallel import dispatch as _dispatch
from workbench.parallel.ops_table.strategy import infer

R, S = wb.Replicate, wb.Shard
PROFILE = "a100"

# (id, mesh, x's placements, the other operand's, its shape): x (8, 16) gathered to R
# everywhere, times the other; the output takes the other's layout (DTensor's choice,
# forward 0 B beyond the reshard; tests/test_reshardbwd.py holds the first three to it)
CASES = [
    ("S1-R-mul-S0", (4,), [S(1)], [S(0)], (8, 16)),
    ("S1-R-mul-S1", (4,), [S(1)], [S(1)], (8, 16)),
    ("S0S1-RR-mul-S1S0", (2, 2), [S(0), S(1)], [S(1), S(0)], (8, 16)),
    # a row the output broadcasts, split as x was: priced as a plain input's slice (its
    # all-gather in backward, 768 B) the row was gathered instead (96 B), where the way
    # back to x's own S(1) sends nothing
    ("S1-R-mul-row-S0", (4,), [S(1)], [S(0)], (16,)),
]
OUT = {"S1-R-mul-row-S0": (S(1),)}


def _v(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).double()    # small integers: exact sums


def _comm(tr):
    return [(e.name, e.args["buffer_bytes"]) for e in tr.events
            if e.stream == "comm" and 0 in e.ranks]


def _program(mesh):
    def f(t, o):
        return t.redistribute(mesh, [R()] * mesh.ndim) * o
    return f


def traced_run(mesh_shape, src, oth, oshape, level):
    """The program run (eager, or compiled at ``level``) forward and backward under a
    trace: (f, trace, y, x, the number of rank 0's forward collectives)."""
    mesh = wb.Mesh.grid(mesh_shape, ["dp", "tp"][-len(mesh_shape):])
    x = wb.shard_tensor(_v((8, 16), 0), mesh, src).requires_grad_()
    o = wb.shard_tensor(_v(oshape, 1), mesh, oth)
    f = _program(mesh)
    if level != "eager":
        f = wb.compile(f, x, o, level=level)
        assert not f.breaks, f.breaks
    g = _v((8, 16), 2)
    with wb.trace(PROFILE) as tr:
        y = f(x, o)
        n = len(_comm(tr))
        (y * wb.shard_tensor(g, mesh, list(y.placements))).sum().backward()
    return f, tr, y, x, n


def _run(mesh_shape, src, oth, oshape, level):
    f, tr, y, x, n = traced_run(mesh_shape, src, oth, oshape, level)
    if level != "eager":
        assert sum(n.op == "kept_copy" for n in f.graph.nodes) == 1
    c = _comm(tr)
    return tuple(y.placements), c[:n], c[n:], y.full().detach(), x.grad


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_programs_redistribute_then_slice_eager_equals_o0(case):
    """Eager and O0: the same strategy, the same collectives (kind, buffer bytes) forward
    and backward on rank 0; the backward is the way back to x's layout, no all-gather;
    values and gradients one device's, the gradient in x's layout."""
    name, mesh_shape, src, oth, oshape = case
    xr = _v((8, 16), 0).requires_grad_()
    ref = xr * _v(oshape, 1)
    (ref * _v((8, 16), 2)).sum().backward()
    got = {}
    for level in ("eager", "O0"):
        ps, fwd, bwd, out, grad = _run(mesh_shape, src, oth, oshape, level)
        torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)
        torch.testing.assert_close(grad.full(), xr.grad, rtol=0, atol=0)
        assert grad.placements == tuple(src)
        # the op slices the gathered x to the other operand's layout (DTensor's strategy:
        # tests/test_reshardbwd.py holds it to DTensor's run), the other moves nothing
        assert ps == OUT.get(name, tuple(oth)), (level, ps)
        assert [k for k, _ in fwd] == ["all_gather"] * len(mesh_shape), (level, fwd)
        assert all(k != "all_gather" for k, _ in bwd) or len(mesh_shape) > 1, (level, bwd)
        got[level] = (ps, Counter(fwd), Counter(bwd))
    assert got["eager"] == got["O0"], got
    if name in ("S1-R-mul-S1", "S1-R-mul-row-S0"):     # sliced back to the source's dim
        assert got["eager"][2] == Counter()


def test_o0_prices_the_pinned_copy_as_eager_prices_the_reshard():
    """O0's decision for the op reading the program's redistribute is eager's: the same
    candidate, its backward priced as the way (one all-to-all) and not as the slice's
    all-gather (which gathers the row instead)."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    x = wb.shard_tensor(_v((8, 16), 0), mesh, [S(1)]).requires_grad_()
    o = wb.shard_tensor(_v((16,), 1), mesh, [S(0)])
    prog = wb.compile(_program(mesh), x, o, level="O0")
    mul = next(n for n in prog.graph.nodes if n.op == "mul")
    c_o0 = prog.greedy.choice[mul.nid]
    with wb.trace(PROFILE):
        y = wb.reshard(x, mesh, [R()])
        grads = _dispatch._grads((y, o))
        eager = infer("mul", y.spec, o.spec, _grads=grads).chosen
        plain = infer("mul", y.spec, o.spec, _grads=(True, False))
    assert type(grads[0]) is tuple and grads[1] is False        # the way's key
    assert c_o0.strategy == eager.strategy
    assert (c_o0.backward_time, c_o0.backward_bytes) == (eager.backward_time,
                                                         eager.backward_bytes)
    # priced as a plain input, the slice's all-gather in backward: another choice
    sliced = next(c for c in plain.candidates if c.strategy == eager.strategy)
    assert sliced.backward_bytes > eager.backward_bytes
    assert plain.chosen.strategy != eager.strategy


def test_way_price_is_what_the_backward_sends():
    """The backward bytes the chooser prices for the sliced reshard result are the bytes
    the recorded way back sends (rank 0's all-to-all, wire bytes)."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    x = wb.shard_tensor(_v((8, 16), 0), mesh, [S(1)]).requires_grad_()
    o = wb.shard_tensor(_v((8, 16), 1), mesh, [S(0)])
    with wb.trace(PROFILE) as tr:
        y = wb.reshard(x, mesh, [R()])
        dec = infer("mul", y.spec, o.spec, _grads=_dispatch._grads((y, o)))
        out = y * o
        n = len(tr.collectives())
        out.sum().backward()
    ev = [e for e in tr.collectives()[n:] if 0 in e.ranks]
    assert [e.name for e in ev] == ["all_to_all"]
    assert dec.chosen.backward_bytes == ev[0].bytes > 0
    assert out.placements == (S(0),)


def test_no_grad_or_no_mark_prices_as_before():
    """Without a gradient, the forward price alone (the slice is free: S(0), nothing
    moved); an unmarked replicated input that requires grad: its slice's all-gather."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    y = wb.TensorSpec((8, 16), mesh, [R()], torch.float64)
    o = wb.TensorSpec((8, 16), mesh, [S(0)], torch.float64)
    with wb.trace(PROFILE):
        fwd = infer("mul", y, o)
        way = ((R(),), (S(1),), (0,))
        marked = infer("mul", y, o, _grads=(way, False))
        # a way whose layout is not the input's any more: the ordinary price
        stale = infer("mul", y, o, _grads=(((S(1),), (S(1),), (0,)), False))
        plain = infer("mul", y, o, _grads=(True, False))
    assert fwd.chosen.strategy.outputs == ((S(0),),) and fwd.chosen.bytes == 0
    assert marked.chosen.strategy.outputs == ((S(0),),)
    def prices(d):
        return {c.strategy: (c.time, c.bytes, c.backward_time, c.backward_bytes)
                for c in d.candidates}
    assert prices(stale) == prices(plain)
