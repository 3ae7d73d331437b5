"""compile17b: an op that reduces a partial sum first, decided from the values.

``R * P(sum)`` with a factor holding 0 (a float partial sum's signed zeros) or inf: the
dispatcher reduces the partial sum first (``dispatch._unsafe_factor``), from the values at
run time.  At O0 the program's forced strategy (chosen for the Partial input) then ran on
the reduced value and made it Partial again: O0 gave (R, P) where eager gives (R, R),
with eager's all-reduce besides.  Now the op runs as eager's once its input is reduced:
eager's placements, values, gradients and collectives; later reshards run from the layout
made.  The step cannot know values: ``prog.data_dependent`` and ``prog.step().assumed``
name each such op instead of being silently short.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import workbench as wb
from workbench.parallel import Partial, Replicate


def _comm(events):
    return Counter((e.name, tuple(e.ranks), e.bytes) for e in events if e.stream == "comm")


def _layouts(ndim):
    if ndim == 2:
        return wb.Mesh([[0, 1], [2, 3]]), [Replicate()] * 2, [Replicate(), Partial("sum")]
    return wb.Mesh([0, 1]), [Replicate()], [Partial("sum")]


_A = torch.arange(6.0, dtype=torch.float64).reshape(2, 3) / 3        # holds a 0
_B = torch.linspace(-1, 1, 6, dtype=torch.float64).reshape(2, 3)
_G = torch.linspace(-2, 1, 6, dtype=torch.float64).reshape(2, 3)


def _inputs(ndim, a):
    mesh, R, P = _layouts(ndim)
    return (wb.distribute_tensor(a, mesh, R).requires_grad_(),
            wb.distribute_tensor(_B, mesh, P).requires_grad_())


def _run(fn, r, p):
    with wb.trace() as tf:
        y = fn(r, p)
    g = wb.distribute_tensor(_G, y.mesh, [Replicate()] * y.mesh.ndim)
    with wb.trace() as tb:
        (y * g).sum().backward()
    return y, tf, tb


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("zero", [True, False])
def test_o0_r_times_partial_is_eager(ndim, zero):
    """O0's placements, values, gradients and forward / backward collectives are eager's,
    with a factor holding 0 (reduced first) and without (kept Partial)."""
    def f(r, p):
        return r * p
    a = _A if zero else _A + 1
    re, pe = _inputs(ndim, a)
    want, wf, wb_ = _run(f, re, pe)
    prog = wb.compile(f, *_inputs(ndim, a), level="O0")
    rc, pc = _inputs(ndim, a)
    got, gf, gb = _run(prog, rc, pc)
    assert tuple(got.placements) == tuple(want.placements)
    assert any(q.is_partial() for q in want.placements) != zero
    assert torch.equal(got.full_tensor(), want.full_tensor())
    assert torch.equal(rc.grad.full_tensor(), re.grad.full_tensor())
    assert torch.equal(pc.grad.full_tensor(), pe.grad.full_tensor())
    assert _comm(gf.events) == _comm(wf.events)
    assert _comm(gb.events) == _comm(wb_.events)


@pytest.mark.parametrize("ndim", [1, 2])
def test_the_step_states_what_values_decide(ndim):
    """The step models the Partial kept; the run that reduces it records an all-reduce the
    step does not hold, and the step says so (``assumed``); none where nothing is read
    beside a partial sum."""
    prog = wb.compile(lambda r, p: r * p, *_inputs(ndim, _A), level="O0")
    st = prog.step()
    assert len(st.assumed) == 1 and "mul" in st.assumed[0] and "all-reduce" in st.assumed[0]
    assert prog.data_dependent == list(st.assumed)
    with wb.trace() as t:
        prog(*_inputs(ndim, _A))
    fwd = [e for e in st.trace.events if not e.label.startswith("backward")]
    assert sum(_comm(t.events).values()) == ndim and not _comm(fwd)
    plain = wb.compile(lambda r, p: r + p, *_inputs(ndim, _A), level="O0")
    assert plain.data_dependent == [] and plain.step().assumed == ()


def test_a_later_reshard_runs_from_the_layout_made():
    """An op after the reduced product reads it where the plan had it Partial: the
    reshard runs from the layout made; values and gradients are eager's at every level."""
    def f(r, p):
        return (r * p).cos() * 2
    re, pe = _inputs(1, _A)
    want, _, _ = _run(f, re, pe)
    for level in ("O0", "O1", "O2"):
        prog = wb.compile(f, *_inputs(1, _A), level=level)
        rc, pc = _inputs(1, _A)
        got, _, _ = _run(prog, rc, pc)
        assert torch.equal(got.full_tensor(), want.full_tensor()), level
        assert torch.equal(pc.grad.full_tensor(), pe.grad.full_tensor()), level
        assert torch.equal(rc.grad.full_tensor(), re.grad.full_tensor()), level


@pytest.mark.parametrize("op", ["matmul", "div"])
def test_o0_reduced_first_by_an_inf_or_a_zero_is_eager(op):
    """``P(sum) @ w`` with w holding inf, ``P(sum) / d`` with d holding 0: reduced first in
    eager (dispatch._unsafe_factor); O0's placements, values and collectives are eager's."""
    mesh = wb.Mesh([0, 1])
    w = torch.eye(3, dtype=torch.float64)
    w[1, 2] = float("inf") if op == "matmul" else 0.0
    w = w + (0 if op == "matmul" else 1) * (w == 0)
    if op == "div":
        w[0, 1] = 0.0

    def f(p, d):
        return p @ d if op == "matmul" else p / d

    def ins():
        return (wb.distribute_tensor(_B[:, :3] if op == "matmul" else _B[:, :3] * 0 + _B[0, :3],
                                     mesh, [Partial("sum")]).requires_grad_(),
                wb.distribute_tensor(w if op == "matmul" else w[:2], mesh, [Replicate()]))
    with wb.trace() as te:
        want = f(*ins())
    prog = wb.compile(f, *ins(), level="O0")
    with wb.trace() as tc:
        got = prog(*ins())
    assert tuple(got.placements) == tuple(want.placements) == (Replicate(),)
    assert torch.equal(got.full_tensor().isnan(), want.full_tensor().isnan())
    assert torch.equal(torch.nan_to_num(got.full_tensor()), torch.nan_to_num(want.full_tensor()))
    assert _comm(tc.events) == _comm(te.events) and sum(_comm(te.events).values()) == 1
    assert len(prog.step().assumed) == 1
