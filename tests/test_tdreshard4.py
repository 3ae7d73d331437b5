"""An op's own gather whose plan also slices another mesh dim: a runnable backward.

``x`` laid out ``[R, S(0)]`` on dp x tp, read by matmuls whose weights are ``[S(0), S(1)]``:
each op's plan is ``local_slice(dp)`` (to ``S(1)``) then ``all_gather(tp)``.  The simulator
recorded, in backward, the dp slice's own backward (an all-gather over dp, sized as a tp
shard) once PER READER, then one reduce-scatter over tp: an order no processes can run
(the per-reader gathers need the one reduction first).  Now the readers' gradients meet in
the plan's layout (``[S(1), P]``) and one redistribution brings their sum back to
``[R, S(0)]``, reducing first (reduce-scatter over tp, then all-gather over dp), as DTensor
redistributes the readers' summed gradient once (torch 2.13 oracle below).  Values held
to one device in float64.
"""
from __future__ import annotations

import math

import pytest
import torch

import workbench as wb
from tests.dtensor_support import LocalTensorMode, distribute_tensor, oracle, to_dt  # noqa: F401
from tests.test_dtensor_ops_comm import CommRecorder

R, S, P = wb.Replicate, wb.Shard, wb.Partial
X, W = (4, 8), (8, 32)
SRC, WP = [R(), S(0)], [S(0), S(1)]


def _values(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _op(x, *ws):
    out = x @ ws[0]
    for w in ws[1:]:
        out = out * (x @ w)
    return out


def _ours(readers):
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    x = wb.shard_tensor(_values(X, 0), mesh, SRC).requires_grad_()
    ws = [wb.shard_tensor(_values(W, k + 1), mesh, WP) for k in range(readers)]
    with wb.trace("a100") as tr:
        out = _op(x, *ws)
        G = wb.shard_tensor(_values(out.shape, 9), mesh, list(out.placements))
        n = len(tr.events)
        (out * G).sum().backward()
    ev = [e for e in tr.events[n:] if 0 in e.ranks]
    return out, x.grad, ev


def _reference(readers):
    xs = _values(X, 0).requires_grad_()
    out = _op(xs, *[_values(W, k + 1) for k in range(readers)])
    (out * _values(out.shape, 9)).sum().backward()
    return out.detach(), xs.grad


def _x_grad_program(ev):
    """x's gradient collectives after the last matmul backward: (name, bytes, mesh dim)."""
    last = max(k for k, e in enumerate(ev) if e.stream != "comm" and "matmul" in e.name)
    before = [e for e in ev[:last] if e.stream == "comm" and e.name != "all_reduce"]
    after = [(e.name, e.args["buffer_bytes"], e.label.rsplit(" on ", 1)[-1])
             for e in ev[last + 1:] if e.stream == "comm"]
    return before, after


@pytest.mark.parametrize("readers", [2, 3])
def test_values_equal_one_device(readers):
    out, grad, _ = _ours(readers)
    ref_out, ref_grad = _reference(readers)
    torch.testing.assert_close(out.full(), ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad.full(), ref_grad, rtol=1e-12, atol=1e-12)
    assert grad.placements == tuple(SRC)


def test_reduced_once_then_gathered():
    """Before: [('all_gather', 128, 'dp')] per reader between the matmul backwards, then
    one reduce_scatter over tp: unrunnable.  Now nothing on x's gradient until every reader
    is done, then the tp reduce-scatter of the dp slice's summed gradient, then the dp
    all-gather of its reduced (tp-sharded) piece; the same program for 2 and 3 readers."""
    programs = []
    for readers in (2, 3):
        _, _, ev = _ours(readers)
        before, after = _x_grad_program(ev)
        assert before == [], [(e.name, e.label) for e in before]
        programs.append(after)
    assert programs[0] == programs[1]
    item = 8                                                 # float64
    dp_slice = math.prod(X) * item // 2                      # the readers' [S(1), P] local
    assert programs[0] == [("reduce_scatter", dp_slice, "tp"),
                           ("all_gather", dp_slice, "dp")], programs[0]


def test_dtensor_reduces_the_readers_sum_once(oracle):  # noqa: F811
    """DTensor 2.13, same strategy (out ``[P, S(1)]``): no collective on x's gradient per
    reader, one redistribution of the summed gradient with one reduction over tp; ours too
    (its mm backward leaves the gradient Partial on dp where ours keeps the slice, so the
    dp step differs: an all-reduce there, an all-gather here)."""
    mesh = oracle.mesh((2, 2))
    with LocalTensorMode(4):
        x = distribute_tensor(_values(X, 0), mesh, [to_dt(p) for p in SRC])
        x = x.detach().requires_grad_()
        ws = [distribute_tensor(_values(W, k + 1), mesh, [to_dt(p) for p in WP])
              for k in range(2)]
        rec = CommRecorder()
        with rec:
            out = _op(x, *ws)
            G = distribute_tensor(_values(out.shape, 9), mesh, out.placements)
            (out * G).sum().backward()
            n = len(rec.log)
            x.grad.redistribute(mesh, [to_dt(p) for p in SRC])
        t_out = tuple(out.placements)
        theirs = [kind for kind, *_ in rec.log[n:]]
    from workbench.parallel.interop import to_dtensor_placements
    ours_out, _, ev = _ours(2)
    assert to_dtensor_placements(ours_out.placements) == t_out
    _, after = _x_grad_program(ev)
    assert theirs.count("reduce_scatter") == 1
    assert [k for k, _, d in after if d == "tp"] == ["reduce_scatter"]


@pytest.mark.parametrize("w2", [[R(), R()], [S(1), S(1)], [R(), S(1)]],
                         ids=["RR", "S1S1", "RS1"])
def test_readers_with_other_plans_equal_one_device(w2):
    """A second reader whose plan differs (its gradient meets elsewhere, or on its own
    node keyed by its layout): values and gradient still one device's."""
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    x = wb.shard_tensor(_values(X, 0), mesh, SRC).requires_grad_()
    ws = [wb.shard_tensor(_values(W, 1), mesh, WP), wb.shard_tensor(_values(W, 2), mesh, w2)]
    with wb.trace("a100"):
        out = _op(x, *ws)
        (out * 1.5).sum().backward()
    xs = _values(X, 0).requires_grad_()
    ref = _op(xs, _values(W, 1), _values(W, 2))
    (ref * 1.5).sum().backward()
    torch.testing.assert_close(out.full(), ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad.full(), xs.grad, rtol=1e-12, atol=1e-12)


def test_eager_records_what_the_compiled_program_runs_and_prices():
    """The compiled program (O1) makes one reshard of x for both matmuls and runs and prices
    its gradient's way back as reduce-scatter over tp then all-gather over dp (128 B each).
    Eager recorded two all-gathers over dp (128 B) and one reduce-scatter of 256 B: it
    failed before; now the same backward collectives, kinds and bytes."""
    from collections import Counter

    def fn(x, w1, w2):
        return _op(x, w1, w2).sum()

    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    runs = []
    for level in (None, "O1"):
        x = wb.shard_tensor(_values(X, 0), mesh, SRC).requires_grad_()
        ws = [wb.shard_tensor(_values(W, k + 1), mesh, WP) for k in range(2)]
        f = fn if level is None else wb.compile(fn, x, *ws, level=level, profile="a100")
        with wb.trace("a100") as tr:
            out = f(x, *ws)
            n = len(tr.events)
            out.backward()
        runs.append((Counter((e.name, e.args["buffer_bytes"]) for e in tr.events[n:]
                             if e.stream == "comm" and 0 in e.ranks), x.grad.full()))
    (eager, e_grad), (comp, c_grad) = runs
    priced = Counter((it.coll, it.nbytes) for it in f.schedule.items
                     if it.kind == "comm" and it.phase == "backward")
    assert eager == comp == priced, (eager, comp, priced)
    torch.testing.assert_close(e_grad, c_grad, rtol=1e-12, atol=1e-12)
