"""perf15: the simulator's per-op overhead cut without changing results (behaviour only;
the instruction counts are in benchmarks/sim_instr.py and the commit messages; the
bit-identity check is benchmarks/sim_bits.py).

* an input its prepared plan moves without communication (the row-parallel linear's
  replicated bias made Partial over tp: R -> P, kept on the group's first rank) takes
  dispatch's fast path: run_prepared's own per-input call (``dispatch._moved_input``) runs
  for it, so values, gradients, local tensors and a traced backward are the general
  path's, bit for bit.
* the toy step's per-call trims keep their behaviour: F.linear's dtype check (skipped
  only where the operands have one dtype), dispatch._summed (remembered per placements
  tuple), versions.explained (a class now: the in-place write's message, once).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import dispatch as D
from workbench.parallel import storage


def _general():
    """The general path (run_prepared) for every call inside: a listening hook turns the
    fast path off (dispatch runs prepared ops through run_prepared while one listens)."""
    return D.explain_hooks(lambda *a: None)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _same_local(a, b):
    assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    assert a.storage_offset() == b.storage_offset()
    assert torch.equal(a, b)


def _row_bias_step(general, traced_backward=False, n=3, grad=True):
    """Megatron's MLP with biases (column- then row-parallel linear) on a dp x tp mesh
    and a tp-only one: the row-parallel linear's bias is replicated and its strategy
    needs it Partial over tp (R -> P, no communication)."""
    out = []
    for mshape in ((2, 2), (4,)):
        g = torch.Generator().manual_seed(5)
        X = torch.randn(4, 6, 8, generator=g)
        W1, B1 = torch.randn(16, 8, generator=g), torch.randn(16, generator=g)
        W2, B2 = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
        mesh = wb.Mesh.grid(mshape, ["dp", "tp"][-len(mshape):])
        lead = [wb.Shard(0)] if len(mshape) == 2 else []
        rep = [wb.Replicate()] * len(mshape)
        w1 = wb.shard_tensor(W1, mesh, rep[:-1] + [wb.Shard(0)]).requires_grad_(grad)
        b1 = wb.shard_tensor(B1, mesh, rep[:-1] + [wb.Shard(0)]).requires_grad_(grad)
        w2 = wb.shard_tensor(W2, mesh, rep[:-1] + [wb.Shard(1)]).requires_grad_(grad)
        b2 = wb.shard_tensor(B2, mesh, rep).requires_grad_(grad)
        for _ in range(n):
            x = wb.shard_tensor(X, mesh, lead + [wb.Replicate()])
            for p in (w1, b1, w2, b2):
                p.grad = None
            with _general() if general else _nothing():
                y = F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2)
                loss = (y * y).sum()
            if grad and traced_backward:
                with wb.trace() as tr:
                    loss.backward()
                out.append([(e.name, e.stream, e.start, e.duration, e.ranks, e.bytes,
                             e.label) for e in tr.events])
                out.append(sorted(tr._clock.items()))
            elif grad:
                loss.backward()
            got = [y, loss] + ([w1.grad, b1.grad, w2.grad, b2.grad] if grad else [])
            out.append([d.full() for d in got])
            out.append([t for d in got for t in storage.tensors(d._local)])
            out.append([(tuple(d.placements), tuple(d.shape)) for d in got])
    return out


def _compare(fast, slow):
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert len(a) == len(b)
        if a and isinstance(a[0], torch.Tensor):
            for p, q in zip(a, b):
                _same_local(p, q)
        else:
            assert a == b


def _count_general(fn):
    calls = []
    real = D.run_prepared
    D.run_prepared = lambda *a: calls.append(a[0].name) or real(*a)
    try:
        return fn(), calls
    finally:
        D.run_prepared = real


def test_row_parallel_bias_fast_path_equals_general_path():
    fast, calls = _count_general(lambda: _row_bias_step(False))
    slow = _row_bias_step(True)
    _compare(fast, slow)
    # 2 meshes x 3 steps x 2 linears: only each linear's first call (the one that
    # prepares it) runs run_prepared; the row-parallel one's warm calls (its bias R -> P
    # over tp) are fast (on the base every call of it ran run_prepared: 6 of 12)
    assert calls.count("linear") == 4, calls


def test_row_parallel_bias_fast_path_no_grad():
    with torch.no_grad():
        fast, calls = _count_general(lambda: _row_bias_step(False, grad=False))
        slow = _row_bias_step(True, grad=False)
    _compare(fast, slow)
    assert calls.count("linear") == 4, calls


def test_row_parallel_bias_fast_path_backward_trace_unchanged():
    """Forward untraced (the fast path), backward traced: the same events and clock as
    the general path's (the bias's gradient all-reduce over dp)."""
    fast = _row_bias_step(False, traced_backward=True, n=2)
    slow = _row_bias_step(True, traced_backward=True, n=2)
    _compare(fast, slow)
    events = [e for lst in fast if lst and isinstance(lst[0], tuple) and len(lst[0]) == 7
              for e in lst]
    assert events and any(e[0] == "all_reduce" for e in events), events[:5]


def test_row_parallel_bias_values_match_one_device():
    fast = _row_bias_step(False, n=2)
    g = torch.Generator().manual_seed(5)
    X = torch.randn(4, 6, 8, generator=g)
    W1, B1 = torch.randn(16, 8, generator=g), torch.randn(16, generator=g)
    W2, B2 = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    ps = [t.clone().requires_grad_() for t in (W1, B1, W2, B2)]
    y = F.linear(torch.relu(F.linear(X, ps[0], ps[1])), ps[2], ps[3])
    (y * y).sum().backward()
    for k in (0, 3, 6, 9):                 # each (mesh, step)'s full values: y, loss, grads
        vals = fast[k]
        torch.testing.assert_close(vals[0], y, rtol=1e-5, atol=1e-5)
        for got, p in zip(vals[2:], ps):
            torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-4)


def test_row_parallel_bias_write_after_forward_raises_as_general_path():
    """The bias's R -> P copy is derived from the bias (versions.derive, as run_prepared):
    a write into the bias between forward and backward is what autograd sees as torch's."""
    def run(general):
        mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
        g = torch.Generator().manual_seed(1)
        x = wb.shard_tensor(torch.randn(4, 16, generator=g), mesh,
                            [wb.Shard(0), wb.Shard(1)])
        w = wb.shard_tensor(torch.randn(8, 16, generator=g), mesh,
                            [wb.Replicate(), wb.Shard(1)]).requires_grad_()
        b = wb.shard_tensor(torch.randn(8, generator=g), mesh,
                            [wb.Replicate(), wb.Replicate()]).requires_grad_()
        res = []
        for _ in range(3):
            with _general() if general else _nothing():
                y = F.linear(x, w, b)
                z = (y * b).sum()
            with torch.no_grad():
                b.mul_(1.0)
            try:
                z.backward()
                res.append(None)
            except RuntimeError as e:
                res.append(type(e).__name__)
            w.grad = b.grad = None
        return res
    assert run(False) == run(True)


# ---- the toy step's per-call trims: same behaviour -------------------------------------

def test_linear_dtype_mismatch_still_raises_as_torch():
    """_linear_parse skips same_dtype only where every operand has one dtype: a float64
    weight or bias beside a float32 input still raises torch's RuntimeError."""
    mesh = wb.Mesh.grid((2,), ["tp"])
    x = wb.shard_tensor(torch.randn(3, 4), mesh, [wb.Replicate()])
    w32 = wb.shard_tensor(torch.randn(5, 4), mesh, [wb.Shard(0)])
    w64 = wb.shard_tensor(torch.randn(5, 4, dtype=torch.float64), mesh, [wb.Shard(0)])
    b64 = wb.shard_tensor(torch.randn(5, dtype=torch.float64), mesh, [wb.Shard(0)])
    for w, b in ((w64, None), (w32, b64)):
        with pytest.raises(RuntimeError) as ours:
            F.linear(x, w, b)
        with pytest.raises(RuntimeError):
            F.linear(x.full(), w.full(), None if b is None else b.full())
        assert "same dtype" in str(ours.value)
    torch.testing.assert_close(F.linear(x, w32).full(), F.linear(x.full(), w32.full()))


def test_summed_remembered_per_placements():
    """dispatch._summed's answer per placements tuple: P(sum) / P(avg) yes, P(max) and
    Shard / Replicate no, the same answer asked twice, plain tensors no."""
    mesh = wb.Mesh.grid((2,), ["tp"])
    t = torch.randn(4, 3)
    cases = [([wb.Partial("sum")], True), ([wb.Partial("avg")], True),
             ([wb.Partial("max")], False), ([wb.Shard(0)], False), ([wb.Replicate()], False)]
    for ps, want in cases:
        d = wb.DistTensor(torch.stack([t, t]), mesh, ps, (4, 3))
        assert D._summed(d) is want and D._summed(d) is want
    assert D._summed(t) is False


def test_inplace_write_before_backward_message_unchanged():
    """versions.explained (now a class): torch's in-place error gets the DistTensor write
    and the fix appended once; other errors pass through as they are."""
    mesh = wb.Mesh.grid((2,), ["tp"])
    w = wb.shard_tensor(torch.randn(4, 4), mesh, [wb.Replicate()]).requires_grad_()
    y = w * 1.0
    z = (y * y).sum()
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(RuntimeError) as e:
        z.backward()
    msg = str(e.value)
    assert "modified by an inplace operation" in msg and msg.count("On DistTensors") == 1
    from workbench.parallel.versions import explained
    with pytest.raises(ValueError, match="^other$"):
        with explained():
            raise ValueError("other")
    with pytest.raises(RuntimeError, match="^plain$"):
        with explained():
            raise RuntimeError("plain")
