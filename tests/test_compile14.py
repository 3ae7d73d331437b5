"""Helper compile14: the wide probe's O0 collective-count differences (tests/compile_probe.py,
wide seeds 30, 84, 116) were the probe's own program skipping its drawn ``redistribute`` /
``wb.reshard`` on capture's meta stand-ins (``if isinstance(t, DistTensor) else t``): the
capture saw a program without the call, eager ran it.  Capture drops no call: a user's
explicit reshard on a traced tensor is a graph break (the program runs eagerly, eager's
collectives).  Now a ``t.redistribute`` on the program's mesh is kept in the graph (a
``kept_copy`` pinned to its placements: seeds 30 and 84 compile at every level, O0's
collectives eager's); ``wb.reshard`` and other meshes still break (seed 116)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import workbench as wb
from workbench.parallel import Partial, Replicate


def _comm(tr):
    return Counter(e.name for e in tr.events if e.stream == "comm" and 0 in e.ranks)


@pytest.mark.parametrize("seed", [30, 84, 116])
def test_probe_programs_with_a_drawn_reshard_run_eagers_collectives_at_o0(seed):
    """Wide seeds 30 (redistribute twice: eager 2 all-reduces, compiled O0 1), 84, 116
    (wb.reshard to another mesh and back): at O0 equal to eager, collectives too."""
    from tests.compile_probe import probe
    p, out = probe(seed, True, levels=("O0",))
    assert out["O0"][0] in ("compiled", "eager"), "\n".join(p.lines) + f"\n{out}"


def _redistributes(mesh, how):
    def f(t):
        if how == "method":
            u = t.redistribute(mesh, [Partial("min"), Replicate()])
        else:
            u = wb.reshard(t, mesh, [Partial("min"), Replicate()])
        return (u * 1.5).redistribute(mesh, [Replicate(), Replicate()]) + t
    return f


def test_a_programs_redistribute_is_kept_in_the_graph():
    """``t.redistribute(mesh, placements)`` inside the compiled function: captured (a
    ``kept_copy`` of t, its output pinned to the placements), no break; at O0 the forward's
    collectives are eager's, call for call; values and gradients exactly eager's (O1:
    equal values)."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    v = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.25, -1.0], [2.0, 2.0, -0.5], [0.0, 1.5, 4.0]],
                     dtype=torch.float64)
    f = _redistributes(mesh, "method")
    g = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)
    xe = wb.distribute_tensor(v, mesh, [Replicate(), Partial("avg")]).requires_grad_()
    with wb.trace() as te:
        want = f(xe)
    (want.full() * g).sum().backward()
    for level in ("O0", "O1"):
        x = wb.distribute_tensor(v, mesh, [Replicate(), Partial("avg")]).requires_grad_()
        prog = wb.compile(f, x, level=level)
        assert not prog.breaks
        assert sum(n.op == "kept_copy" for n in prog.graph.nodes) == 2
        with wb.trace() as tc:
            got = prog(x)
        assert torch.equal(got.full(), want.full())
        assert tuple(got.placements) == tuple(want.placements) or level != "O0"
        if level == "O0":
            assert [(e.name, e.ranks) for e in tc.events if e.stream == "comm"] == \
                [(e.name, e.ranks) for e in te.events if e.stream == "comm"]
        (got.full() * g).sum().backward()
        assert torch.equal(x.grad.full(), xe.grad.full())


def test_a_reshard_the_graph_cannot_hold_breaks_it():
    """A redistribute to another mesh: a graph break naming the call (the program runs
    eagerly, eager's values and collectives), never a program without the call.
    (``wb.reshard(t, ...)`` broke here too; it is captured since compile15:
    tests/test_compile15.py.)"""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    x = wb.distribute_tensor(torch.arange(4.0, dtype=torch.float64), mesh,
                             [Replicate(), Partial("avg")])
    other = wb.Mesh([[4, 5], [6, 7]])
    for f, code in [
            (lambda t: t.redistribute(other, [Replicate(), Replicate()]) * 2,
                     "(lambda t: t.redistribute(other")]:
        with wb.trace() as te:
            want = f(x)
        prog = wb.compile(f, x, level="O0")
        with wb.trace() as tc:
            got = prog(x)
        assert torch.equal(got.full(), want.full())
        assert _comm(tc) == _comm(te) and sum(_comm(te).values()) > 0
        assert prog.breaks and prog.breaks[0].code.startswith(code), prog.breaks


@pytest.mark.parametrize("form", ["method", "function"])
def test_nanmedian_without_dim_is_captured_as_eager_runs_it(form):
    """``x.nanmedian()`` / ``torch.nanmedian(x)`` (every element) broke the graph (the
    entry's parse wants a dim: TypeError on the meta run) where ``x.median()`` was
    captured; now recorded as ``nanmedian_all``, the op eager dispatches: values (NaNs
    skipped, ties) and gradients exactly eager's and one device's."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    v = torch.tensor([[0.5, float("nan"), 0.25, 2.0], [0.25, -1.0, float("nan"), 0.25],
                      [3.0, 0.25, 1.5, -2.0], [0.25, float("nan"), 0.5, 1.0]],
                     dtype=torch.float64)

    def f(t):
        u = t * 2
        return u.nanmedian() if form == "method" else torch.nanmedian(u)

    from workbench.parallel import Shard
    g = torch.tensor(1.75, dtype=torch.float64)
    ref = v.clone().requires_grad_()
    (f(ref) * g).sum().backward()
    for level in ("O0", "O1"):
        x = wb.distribute_tensor(v, mesh, [Shard(0), Shard(1)]).requires_grad_()
        prog = wb.compile(f, x, level=level)
        assert not prog.breaks
        assert "nanmedian_all" in [n.op for n in prog.graph.nodes]
        out = prog(x)
        assert torch.equal(out.full(), f(v))
        (out * g).sum().backward()
        assert torch.equal(x.grad.full(), ref.grad)


def test_the_count_norm_function_refusal_keeps_eagers_requires_grad():
    """``vector_norm(x, 0)`` applies workbench's ``_CountNonzero`` (an output that requires
    grad, no gradient to ``x``, as torch's).  Captured, its forward would be recorded
    without autograd and the compiled output would not require grad where eager's does
    (``backward`` would raise): the refusal (a break, the program runs eagerly) keeps
    eager's flag and ``x.grad`` None (wide probe seed 92 refuses it too, where only the
    count's sort indices leave the program: harmless there, not in general)."""
    from workbench.parallel import Shard
    mesh = wb.Mesh([[0, 1], [2, 3]])
    v = torch.tensor([[0.0, 1.5, -2.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.5], [2.0, 2.0, 0.0]],
                     dtype=torch.float64)

    def f(t):
        return torch.linalg.vector_norm(t * 2, 0, dim=1)

    x = wb.distribute_tensor(v, mesh, [Shard(0), Replicate()]).requires_grad_()
    want = f(x)
    prog = wb.compile(f, x, level="O0")
    assert prog.breaks and "_CountNonzero" in prog.breaks[0].reason
    got = prog(x)
    assert torch.equal(got.full(), torch.linalg.vector_norm(v * 2, 0, dim=1))
    assert torch.equal(got.full(), want.full())
    assert want.requires_grad and got.requires_grad
    got.sum().backward()
    assert x.grad is None


def test_a_constant_the_program_reads_is_left_as_it_is():
    """Capture gives its meta stand-ins a ``redistribute``; a plain constant the program
    reads (the user's object) gets none."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    c = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    x = wb.distribute_tensor(torch.arange(4.0, dtype=torch.float64), mesh,
                             [Replicate(), Replicate()])
    prog = wb.compile(lambda t: t * c, x, level="O0")
    assert not prog.breaks and torch.equal(prog(x).full(), torch.arange(4.0) * c)
    assert "redistribute" not in c.__dict__
