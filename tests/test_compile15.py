"""Helper compile15: ``wb.reshard(t, mesh, placements)`` called as a function inside a
compiled program is captured (a ``kept_copy`` pinned to the placements, as
``t.redistribute`` since compile14: reshard hands a plain stand-in to the torch function
mode, ``parallel/reshard.py``); a round trip to another mesh or a submesh and straight
back is captured (``compile/mesh_trips.py``: the run makes eager's two calls); anything
else on another mesh still breaks the graph (eager's values and collectives).  The ops the op table gained last session are
captured and run as eager runs them.  The compile probe's new seeds: an integer partial
sum meeting another dtype (the dispatcher reduces it first, ``dispatch._int_summed``) is
lowered as eager runs it (O0's collectives eager's) and no longer raises at O1."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import Partial, Replicate, Shard


def _comm(tr):
    return [(e.name, e.ranks, e.bytes) for e in tr.events if e.stream == "comm"]


def _counts(tr):
    return Counter(e.name for e in tr.events if e.stream == "comm")


_MESHES = {"1d": lambda: wb.Mesh([0, 1, 2]), "2d": lambda: wb.Mesh([[0, 1], [2, 3]])}


def _reshard_program(kind, mesh, form):
    ps = ([Shard(1)], [Replicate()]) if kind == "1d" else \
        ([Shard(1), Replicate()], [Replicate(), Replicate()])

    def f(t):
        if form == "positional":
            u = wb.reshard(t, mesh, ps[0])
        else:
            u = wb.reshard(t, placements=ps[0])          # its own mesh
        w = (u * 1.5).sin()
        return wb.reshard(w, mesh, placements=ps[1]) + t
    return f


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.parametrize("form", ["positional", "own_mesh"])
def test_a_programs_wb_reshard_is_captured_as_eager_runs_it(kind, form):
    """``wb.reshard`` inside the program broke the graph (the meta stand-in is no
    DistTensor: TypeError on the meta run); now two ``kept_copy`` nodes, no break.  O0:
    values and gradients exactly eager's, each collective (name, ranks, bytes) eager's in
    order, forward and backward, and the modeled clock eager's; O1: equal values and
    gradients."""
    mesh = _MESHES[kind]()
    f = _reshard_program(kind, mesh, form)
    v = torch.arange(24, dtype=torch.float64).reshape(4, 6) / 7
    g = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(4, 6)
    src = [Shard(0)] if kind == "1d" else [Shard(0), Partial("sum")]
    xe = wb.distribute_tensor(v, mesh, src).requires_grad_()
    with wb.trace() as te:
        want = f(xe)
        (want.full() * g).sum().backward()
    for level in ("O0", "O1"):
        x = wb.distribute_tensor(v, mesh, src).requires_grad_()
        prog = wb.compile(f, x, level=level)
        assert not prog.breaks, prog.breaks
        assert [n.op for n in prog.graph.nodes].count("kept_copy") == 2
        with wb.trace() as tc:
            got = prog(x)
            (got.full() * g).sum().backward()
        if level == "O0":
            assert torch.equal(got.full(), want.full())
            assert tuple(got.placements) == tuple(want.placements)
            assert torch.equal(x.grad.full(), xe.grad.full())
            assert _comm(tc) == _comm(te) and _comm(te)
            assert tc.time() == te.time()
        else:
            torch.testing.assert_close(got.full(), want.full())
            torch.testing.assert_close(x.grad.full(), xe.grad.full())


def test_a_wb_reshard_eager_refuses_breaks_and_eager_says_why():
    """Placements that do not fit the mesh, a Partial sum of bools, or a profile of the
    call's own: a graph break at the call (the program runs eagerly; the call raises
    eager's own error), never a graph that reshards otherwise."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    x = wb.distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh, [Shard(0), Replicate()])
    b = wb.distribute_tensor(torch.tensor([True, False, True, True]), mesh,
                             [Replicate(), Replicate()])
    for f, arg, err in [(lambda t: wb.reshard(t * 2, mesh, [Replicate()]), x, ValueError),
                        (lambda t: wb.reshard(t & t, mesh, [Partial("sum"), Replicate()]),
                         b, ValueError)]:
        prog = wb.compile(f, arg, level="O0")
        assert prog.breaks and "wb.reshard(" in prog.breaks[0].code, prog.breaks
        with pytest.raises(err) as e_eager:
            f(arg)
        with pytest.raises(err) as e_comp:
            prog(arg)
        assert str(e_comp.value) == str(e_eager.value)

    def own_profile(t):
        return wb.reshard(t * 2, mesh, [Replicate(), Replicate()], profile="h100") + 1
    prog = wb.compile(own_profile, x, level="O0")
    assert prog.breaks and "profile=" in prog.breaks[0].reason
    assert torch.equal(prog(x).full(), own_profile(x).full())


@pytest.mark.parametrize("how", ["other", "submesh", "other_shape"])
def test_a_round_trip_to_another_mesh_is_captured_as_eager_runs_it(how):
    """``wb.reshard(wb.reshard(t, other, ps1), mesh, ps2)``: the tensor moved to another
    mesh (same shape, a submesh, another shape) and straight back broke the graph; now
    the second copy is pinned to ps2 via (other, ps1) and the run makes eager's two calls:
    O0 values, gradients, every collective and send (name, ranks, bytes) in order, forward
    and backward, and the modeled clock eager's; O1 equal values and gradients."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    other, tps = {"other": (wb.Mesh([[4, 5], [6, 7]]), [Replicate(), Shard(1)]),
                  "submesh": (wb.Mesh([0, 1]), [Shard(1)]),
                  "other_shape": (wb.Mesh([5, 6, 7]), [Partial("sum")])}[how]

    def f(t):
        u = wb.reshard(t * 2, other, tps)
        return wb.reshard(u, mesh, [Replicate(), Shard(0)]).cos() + t
    v = torch.arange(24.0, dtype=torch.float64).reshape(4, 6) / 5
    g = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(4, 6)
    xe = wb.distribute_tensor(v, mesh, [Shard(0), Partial("sum")]).requires_grad_()
    with wb.trace() as te:
        want = f(xe)
        (want.full() * g).sum().backward()
    assert "send_recv" in _counts(te)
    for level in ("O0", "O1"):
        x = wb.distribute_tensor(v, mesh, [Shard(0), Partial("sum")]).requires_grad_()
        prog = wb.compile(f, x, level=level)
        assert not prog.breaks, prog.breaks
        assert prog.graph.vias and next(iter(prog.graph.vias.values()))[0] == other
        with wb.trace() as tc:
            got = prog(x)
            (got.full() * g).sum().backward()
        if level == "O0":
            assert torch.equal(got.full(), want.full())
            assert torch.equal(x.grad.full(), xe.grad.full())
            assert _comm(tc) == _comm(te)
            assert tc.time() == te.time()
        else:
            torch.testing.assert_close(got.full(), want.full())
            torch.testing.assert_close(x.grad.full(), xe.grad.full())


@pytest.mark.parametrize("how", ["op_there", "two_readers", "returned", "own_mesh_back",
                                 "compile_mesh"])
def test_a_tensor_living_on_another_mesh_still_breaks(how):
    """An op on the moved tensor, a second reader of it, returning it, or a reshard from
    it naming no mesh (its own: the other): the graph holds one mesh, so the call is a
    break naming it and the program runs eagerly (eager's values and collectives, sends
    included).  ``compile(mesh=)`` for a program of plain tensors: a reshard onto another
    mesh than that one breaks too (it was pinned on the program's mesh, unchecked)."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    other = wb.Mesh([[4, 5], [6, 7]])
    R2 = [Replicate(), Replicate()]
    if how == "compile_mesh":
        def f(t):
            return t.redistribute(other, R2) * 2
        x = torch.arange(8.0, dtype=torch.float64).reshape(2, 4)
        prog = wb.compile(f, x, level="O0", mesh=mesh)
        assert prog.breaks and "a mesh other than the program's" in prog.breaks[0].reason
        return
    fs = {"op_there": lambda t: wb.reshard(wb.reshard(t * 2, other, R2).cos(), mesh, R2) + t,
          "two_readers": lambda t: (lambda u: wb.reshard(u, mesh, R2) +
                                    wb.reshard(u, mesh, [Shard(0), Replicate()]))(
                                        wb.reshard(t * 2, other, R2)),
          "returned": lambda t: wb.reshard(t * 2, other, R2),
          "own_mesh_back": lambda t: wb.reshard(wb.reshard(t * 2, other, R2),
                                                placements=[Shard(1), Replicate()])}
    f = fs[how]
    x = wb.distribute_tensor(torch.arange(8.0, dtype=torch.float64).reshape(2, 4), mesh,
                             [Shard(0), Replicate()])
    with wb.trace() as te:
        want = f(x)
    prog = wb.compile(f, x, level="O0")
    assert prog.breaks and "not moved straight back" in prog.breaks[0].reason, prog.breaks
    with wb.trace() as tc:
        got = prog(x)
    assert got.mesh == want.mesh and torch.equal(got.full(), want.full())
    assert _comm(tc) == _comm(te) and "send_recv" in _counts(te)


_A = torch.tensor([[0.7, 1.3, 0.55, 1.2, 0.9], [1.45, 0.6, 1.05, 0.75, 1.4],
                   [0.8, 1.1, 0.65, 1.35, 0.95], [1.25, 0.5, 1.15, 0.85, 1.0]],
                  dtype=torch.float64)
_I = torch.tensor([[12, 7, 30, 9, 4], [6, 15, 21, 8, 3], [18, 5, 10, 27, 14],
                   [2, 24, 11, 16, 20]])
_OPS = {
    "mode": (lambda t: torch.mode((t * 2).round(), 1), _A, "mode"),
    "mode_method": (lambda t: (t * 2).round().mode(0, keepdim=True).values, _A, "mode"),
    "unfold": (lambda t: (t * 2).unfold(1, 2, 1), _A, "unfold"),
    "renorm": (lambda t: torch.renorm(t * 2, 2, 0, 1.5), _A, "renorm"),
    "renorm_inplace": (lambda t: (t * 1).renorm_(1, 1, 1.0), _A, "renorm"),
    "logaddexp": (lambda t: torch.logaddexp(t, t * 2), _A, "logaddexp"),
    "logaddexp2": (lambda t: (t * 0.5).logaddexp2(t.sin()), _A, "logaddexp2"),
    "nextafter": (lambda t: torch.nextafter(t, t * 0), _A, "nextafter"),
    "ldexp": (lambda t: torch.ldexp(t, (t * 3).floor()), _A, None),
    "xlog1py": (lambda t: torch.special.xlog1py(t, t * 2), _A, "xlog1py"),
    "zeta": (lambda t: torch.special.zeta(t + 1.5, t), _A, "zeta"),
    "igamma": (lambda t: torch.igamma(t, t * 2), _A, "igamma"),
    "igammac": (lambda t: (t * 1).igammac(t * 2), _A, "igammac"),
    "gcd": (lambda t: torch.gcd(t, t * 3 + 2), _I, "gcd"),
    "lcm": (lambda t: (t + 1).lcm(t + 2), _I, "lcm"),
    "pairwise_distance": (lambda t: F.pairwise_distance(t, t.cos(), p=1.0, keepdim=True),
                          _A, None),
}


@pytest.mark.parametrize("name", list(_OPS))
def test_last_sessions_ops_are_captured_and_run_as_eager(name):
    """Each op the table gained last session (torch.mode, Tensor.unfold, renorm,
    logaddexp/2, nextafter, ldexp, special.xlog1py/zeta, igamma/igammac, gcd/lcm,
    F.pairwise_distance) under wb.compile: no break, its node in the graph (ldexp and
    pairwise_distance are compositions of table ops), on uneven shards of a 2-d mesh:
    O0 values, dtypes and gradients exactly eager's (or the same error from backward,
    where torch has no derivative: zeta, igamma's input), eager's values one device's."""
    f, v, op = _OPS[name]
    mesh = wb.Mesh([[0, 1], [2, 3]])
    grad = v.is_floating_point()

    def make():
        x = wb.distribute_tensor(v, mesh, [Shard(0), Shard(1)])
        return x.requires_grad_() if grad else x
    xe = make()
    want = f(xe)
    ref = f(v)
    x = make()
    prog = wb.compile(f, x, level="O0")
    assert not prog.breaks, prog.breaks
    if op is not None:
        assert op in [n.op for n in prog.graph.nodes], [n.op for n in prog.graph.nodes]
    got = prog(x)
    outs = (lambda o: list(o) if isinstance(o, tuple) else [o])
    assert type(got) is type(want)
    for a, b, r in zip(outs(got), outs(want), outs(ref)):
        assert a.dtype == b.dtype and torch.equal(a.full(), b.full())
        torch.testing.assert_close(b.full(), r)
    if grad and outs(want)[0].requires_grad:
        errs = []
        for o, leaf in ((outs(want)[0], xe), (outs(got)[0], x)):
            try:
                (o.full() * 1.25).sum().backward()
                errs.append(None)
            except NotImplementedError as e:
                errs.append(str(e))
        assert errs[0] == errs[1]
        if errs[0] is None:
            assert torch.equal(x.grad.full(), xe.grad.full())


def test_trapezoid_without_a_rule_breaks_and_raises_eagers_error():
    """torch.trapezoid has no rule (the op the notebooks name as such): capture breaks
    there, and the compiled call raises eager's own NoRuleError."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    x = wb.distribute_tensor(_A, mesh, [Shard(0), Replicate()])

    def f(t):
        return torch.trapezoid(t * 2, dx=0.5)
    prog = wb.compile(f, x, level="O0")
    assert prog.breaks and "trapezoid" in prog.breaks[0].reason
    with pytest.raises(Exception) as e_eager:
        f(x)
    with pytest.raises(type(e_eager.value)) as e_comp:
        prog(x)
    assert str(e_comp.value) == str(e_eager.value)


def _int_partial(mesh):
    k = torch.tensor([[1, -2, 3, 0], [4, 1, -1, 2], [0, 2, 2, -3], [1, 1, 0, 5]])
    return wb.distribute_tensor(k, mesh, [Replicate(), Partial("sum")])


def test_an_int_partial_sum_meeting_a_float_is_reduced_first_as_eager():
    """``k + x`` with k an int64 P(sum) and x float64: the dispatcher reduces k first
    (all-reduce, then its own choice on the replicated k); O0 reduce-scattered it where
    eager all-reduces (narrow probe seed 141).  Now O0's collectives are eager's, call
    for call; values exact at O0, O1 and O2."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    k = _int_partial(mesh)
    v = torch.linspace(-2, 2, 16, dtype=torch.float64).reshape(4, 4)

    def f(x, k):
        return k + x.sin()
    x = wb.distribute_tensor(v, mesh, [Replicate(), Shard(0)])
    with wb.trace() as te:
        want = f(x, k)
    assert torch.equal(want.full(), k.full() + v.sin())
    for level in ("O0", "O1", "O2"):
        prog = wb.compile(f, x, k, level=level)
        assert not prog.breaks
        with wb.trace() as tc:
            got = prog(x, k)
        assert torch.equal(got.full(), want.full())
        if level == "O0":
            assert _comm(tc) == _comm(te)


def test_an_int_partial_stacked_with_a_float_runs_at_o1():
    """``torch.vstack([k, x])`` with k an int64 P(sum): the whole-graph search chose a
    strategy keeping k partial, which the dispatcher (reducing an integer partial first)
    does not offer: O1 and O2 raised RuntimeError in lower._pick (wide probe seed 173).
    Such candidates are passed over: values and gradients equal eager's."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    k = _int_partial(mesh)
    v = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4)

    def f(x, k):
        return (torch.vstack([k * k + k, x]) * 0.5).sum()
    xe = wb.distribute_tensor(v, mesh, [Shard(1), Shard(0)]).requires_grad_()
    want = f(xe, k)
    want.backward()
    for level in ("O0", "O1", "O2"):
        x = wb.distribute_tensor(v, mesh, [Shard(1), Shard(0)]).requires_grad_()
        prog = wb.compile(f, x, k, level=level)
        got = prog(x, k)
        torch.testing.assert_close(got.full(), want.full())
        got.backward()
        torch.testing.assert_close(x.grad.full(), xe.grad.full())


def test_an_int_made_partial_for_a_float_op_is_laid_out_inside_the_op():
    """``c - y`` with c an int64 constant (replicated) and y a float64 P(sum): eager's op
    lays c out partial itself; lowered as a reshard before the op, the dispatcher saw an
    integer partial and reduced both inputs first: two all-reduces more than eager at O0
    (wide probe seed 189).  Now O0's collectives are eager's."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    y = wb.distribute_tensor(torch.tensor([0.5, -1.25, 2.0, 0.75], dtype=torch.float64),
                             mesh, [Replicate(), Partial("sum")])
    c = torch.tensor([3, 1, -2, 4])

    def f(t):
        return (c - t).abs()
    with wb.trace() as te:
        want = f(y)
    prog = wb.compile(f, y, level="O0")
    assert not prog.breaks
    with wb.trace() as tc:
        got = prog(y)
    assert torch.equal(got.full(), want.full())
    assert _comm(tc) == _comm(te)


@pytest.mark.parametrize("seed,wide", [(141, False), (173, True), (189, True), (132, True)])
def test_probe_seeds_now_compile(seed, wide):
    """The probe's new seeds that differed (narrow 141, wide 189: O0 collectives), raised
    (wide 173 at O1 / O2) or broke at a round trip to another mesh (wide 132: ``wb.reshard(
    wb.reshard(t, other, ...), mesh, ...)``): compiled at every level, equal to eager (O0:
    exactly, collectives too)."""
    from tests.compile_probe import probe
    p, out = probe(seed, wide)
    assert all(st == "compiled" for st, _ in out.values()), "\n".join(p.lines) + f"\n{out}"
