"""perf14: the simulator's per-op overhead cut without changing results (behaviour only;
the instruction counts are in benchmarks/sim_instr.py and the commit messages; the
bit-identity check over 10,272 records is benchmarks/sim_bits.py).

* view ops (transpose, view, reshape, permute, getitem, ...) whose prepared layout moves
  nothing take dispatch's fast path, and their output is told to ``views.note_views`` as
  run_prepared tells it: the same local tensor (values, sizes, strides, offset), the same
  ``_view`` record, and writes through the view reach the base (and the base's reach the
  view) as on the general path and as torch's.
"""
from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.parallel import dispatch as D
from workbench.parallel import storage


def _general():
    """The general path (run_prepared) for every call inside: a listening hook turns the
    fast path off (dispatch runs prepared ops through run_prepared while one listens)."""
    return D.explain_hooks(lambda *a: None)


def _same_local(a, b):
    assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    assert a.storage_offset() == b.storage_offset()
    assert torch.equal(a, b)


_VIEWS = [
    ("transpose", lambda t: t.transpose(0, 1)),
    ("transpose_neg", lambda t: t.transpose(-1, -2)),
    ("view", lambda t: t.view(4, 4, 2, 3)),
    ("reshape", lambda t: t.reshape(16, 6)),
    ("permute", lambda t: t.permute(2, 0, 1)),
    ("getitem", lambda t: t[1:3]),
    ("unsqueeze", lambda t: t.unsqueeze(1)),
    ("flatten", lambda t: t.flatten(1)),
    ("select", lambda t: t[:, 0]),
]
_LAYOUTS = [((2,), [wb.Replicate()]),
            ((2,), [wb.Shard(2)]),
            ((2, 2), [wb.Shard(0), wb.Replicate()]),
            ((2, 2), [wb.Replicate(), wb.Shard(1)])]


def _base(mshape, placements, requires_grad=False):
    g = torch.Generator().manual_seed(7)
    X = torch.randn(4, 4, 6, generator=g)
    mesh = wb.Mesh.grid(mshape, ["a", "b"][:len(mshape)])
    x = wb.shard_tensor(X, mesh, placements)
    if requires_grad:
        x = x.requires_grad_()
    return X, x


@pytest.mark.parametrize("name,f", _VIEWS, ids=[v[0] for v in _VIEWS])
@pytest.mark.parametrize("mshape,placements", _LAYOUTS, ids=lambda v: str(v))
def test_view_fast_path_same_output_and_view_record(name, f, mshape, placements):
    X, x = _base(mshape, placements)
    calls = []
    real = D.run_prepared
    D.run_prepared = lambda *a: calls.append(a[0].name) or real(*a)
    try:
        outs = [f(x) for _ in range(3)]               # first call, then prepared
    finally:
        D.run_prepared = real
    with _general():
        ref = f(x)
    for o in outs:
        assert tuple(o.shape) == tuple(f(X).shape)
        assert o.placements == ref.placements
        assert torch.equal(o.full(), f(X))
        _same_local(o._local, ref._local)
        assert o._view is not None and ref._view is not None
        assert o._view[0] is x and o._view[1:] == ref._view[1:]
    # on a replicated layout the prepared view runs without run_prepared after its first
    # call; elsewhere a layout that moves data (uneven shards, a reshard) keeps the
    # general path on every call
    if placements == [wb.Replicate()]:
        assert len(calls) <= 1, calls
    else:
        assert len(calls) in (0, 1, 3), calls


@pytest.mark.parametrize("name,f", [v for v in _VIEWS if v[0] != "reshape"],
                         ids=[v[0] for v in _VIEWS if v[0] != "reshape"])
@pytest.mark.parametrize("mshape,placements", _LAYOUTS, ids=lambda v: str(v))
def test_writes_through_a_fast_view_reach_the_base(name, f, mshape, placements):
    X, x = _base(mshape, placements)
    for _ in range(2):
        f(x)                                          # warm: the next call is fast
    v = f(x)
    v.mul_(2.0)                                       # into the view: the base sees it
    Y = X.clone()
    f(Y).mul_(2.0)
    assert torch.equal(x.full(), Y)
    x.add_(1.0)                                       # into the base: the view sees it
    Y.add_(1.0)
    assert torch.equal(v.full(), f(Y))


def test_views_in_autograd_match_one_device_and_general_path():
    """Views between ops that need gradients (the GPT block's head split): values and
    gradients equal to the general path's bit for bit and to one device's."""
    g = torch.Generator().manual_seed(3)
    X = torch.randn(2, 8, 12, generator=g)
    W = torch.randn(12, 12, generator=g)
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])

    def run(general):
        x = wb.shard_tensor(X, mesh, [wb.Shard(0), wb.Replicate()])
        w = wb.shard_tensor(W, mesh, [wb.Replicate(), wb.Shard(0)]).requires_grad_()
        got = []
        for _ in range(3):
            w.grad = None
            with _general() if general else _nothing():
                h = torch.nn.functional.linear(x, w)            # (2, 8, 12) S(0), S(2)
                q = h.view(2, 8, 3, 4).transpose(1, 2)          # heads
                y = (q * q).transpose(1, 2).reshape(2, 8, 12)
                y.sum().backward()
            got.append((y.full(), w.grad.full(), *storage.tensors(y._local),
                        *storage.tensors(w.grad._local)))
        return got
    fast, slow = run(False), run(True)
    for a, b in zip(fast, slow):
        assert len(a) == len(b)
        for p, q in zip(a, b):
            _same_local(p, q)
    w1 = W.clone().requires_grad_()
    h = torch.nn.functional.linear(X, w1)
    q = h.view(2, 8, 3, 4).transpose(1, 2)
    y = (q * q).transpose(1, 2).reshape(2, 8, 12)
    y.sum().backward()
    torch.testing.assert_close(fast[-1][0], y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast[-1][1], w1.grad, rtol=1e-5, atol=1e-5)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ---- a replicated input the gradient flows back through, on the fast path ----------------

def _grad_step(general, traced_backward=False, n=3):
    """gpt-like: an activation replicated over tp meets column-parallel linears and a
    layer norm (reshard_backward.gather's readers), on a 2x2 mesh and a 1-d one."""
    out = []
    for mshape in ((2, 2), (4,)):
        g = torch.Generator().manual_seed(11)
        X = torch.randn(4, 6, 8, generator=g)
        W1 = torch.randn(16, 8, generator=g)
        W2 = torch.randn(8, 16, generator=g)
        mesh = wb.Mesh.grid(mshape, ["dp", "tp"][-len(mshape):])
        lead = [wb.Shard(0)] if len(mshape) == 2 else []
        ln = torch.nn.LayerNorm(8)
        lw = wb.shard_tensor(ln.weight.detach(), mesh, [wb.Replicate()] * len(mshape))
        lw.requires_grad_()
        w1 = wb.shard_tensor(W1, mesh, lead + [wb.Shard(0)]).requires_grad_()
        w2 = wb.shard_tensor(W2, mesh, lead[:0] + [wb.Replicate()] * (len(mshape) - 1)
                             + [wb.Shard(1)]).requires_grad_()
        for _ in range(n):
            x = wb.shard_tensor(X, mesh, lead + [wb.Replicate()]).requires_grad_()
            for p in (lw, w1, w2):
                p.grad = None
            with _general() if general else _nothing():
                h = torch.nn.functional.layer_norm(x, (8,), lw)
                a = torch.nn.functional.linear(h, w1)
                b = torch.nn.functional.linear(h, w1 * 0.5)
                y = torch.nn.functional.linear(torch.relu(a) + b, w2)
                loss = y.sum()
            if traced_backward:
                with wb.trace() as tr:
                    loss.backward()
                out.append([(e.name, e.stream, e.start, e.duration, e.ranks, e.bytes,
                             e.label) for e in tr.events])
            else:
                loss.backward()
            out.append([y.full(), x.grad.full(), lw.grad.full(), w1.grad.full(),
                        w2.grad.full()])
            out.append([t for d in (y, x.grad, lw.grad, w1.grad, w2.grad)
                        for t in storage.tensors(d._local)])
    return out


def test_replicated_input_with_grad_fast_path_equals_general_path():
    calls = []
    real = D.run_prepared
    D.run_prepared = lambda *a: calls.append(a[0].name) or real(*a)
    try:
        fast = _grad_step(False)
    finally:
        D.run_prepared = real
    slow = _grad_step(True)
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert len(a) == len(b)
        for p, q in zip(a, b):
            _same_local(p, q)
    # the warm steps' layer norms (an input the gradient flows back through, replicated
    # over tp) ran without run_prepared, and so did some of the 18 linears
    assert calls.count("layer_norm") == 2 and calls.count("linear") < 18, calls


def test_replicated_input_with_grad_fast_path_backward_trace_unchanged():
    """Forward untraced (the fast path), backward traced: the gradient all-reduces and
    their clock as the general path's (reshard_backward.gather's one way per input)."""
    fast = _grad_step(False, traced_backward=True, n=2)
    slow = _grad_step(True, traced_backward=True, n=2)
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        if a and isinstance(a[0], tuple):
            assert a == b
        else:
            assert len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))
    events = [e for lst in fast if lst and isinstance(lst[0], tuple) for e in lst]
    assert any("grad of a replicated input" in e[6] for e in events), events[:5]
