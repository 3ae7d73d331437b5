"""perf13: the toy TP step's per-op overhead cut without changing results (behaviour only;
the instruction counts are in benchmarks/sim_instr.py and the commit messages).

* the column-parallel linear (``ops_table/matmul._linear_plain``) with one rank dim and a
  2-d input gives its views' sizes as ints and transposes instead of ``movedim(1, 0)``:
  the same tensors (values, sizes, strides, offset) and gradients as the view chain it
  replaces, and that branch is the one taken (its output's ``grad_fn``);
* a one-input pointwise op's local implementation calls torch's op directly (no
  ``align``): every unary op below equals torch's on the global tensor bit for bit;
* ``sum`` with no dtype passes keepdim positionally (the same overload);
* ``storage.backward_scalar`` and dispatch's fast path give ``expand`` ints.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import dispatch as D
from workbench.parallel.ops_table import matmul as M
from tests.test_perf11 import _tp, assert_one_device


def _old_column_parallel(x, w, b=None):
    """The view chain ``_linear_plain`` ran before perf13 (nd = 1)."""
    x0 = x.select(0, 0)
    ws = w.shape
    n, k = ws[-2], ws[-1]
    y = F.linear(x0, w.reshape(ws[0] * n, k))
    ys = y.shape
    nb = len(ys) - 1
    y = y.view(ys[:-1] + ws[:1] + (n,)).movedim(nb, 0)
    if b is not None:
        y = y + b.unsqueeze(1)
    return y


def _same_tensor(a, b):
    assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    assert a.storage_offset() == b.storage_offset()
    assert torch.equal(a, b)


@pytest.mark.parametrize("L,T,n,k,bias,dtype", [(8, 32, 32, 64, False, torch.float32),
                                                 (4, 5, 3, 7, True, torch.float64),
                                                 (2, 1, 1, 4, False, torch.float32),
                                                 (3, 6, 2, 1, True, torch.float32)])
def test_column_parallel_same_tensors_and_grads_as_the_view_chain(L, T, n, k, bias, dtype):
    g = torch.Generator().manual_seed(L * 100 + T)
    X = torch.randn(1, T, k, generator=g, dtype=dtype)
    W = torch.randn(L, n, k, generator=g, dtype=dtype)
    B = torch.randn(L, n, generator=g, dtype=dtype) if bias else None
    G = torch.randn(L, T, n, generator=g, dtype=dtype)
    outs = []
    for f in (M._linear_plain, None):
        x = X.expand(L, T, k).clone().requires_grad_()    # per-rank copies, grads kept
        x = x[:1].expand(L, T, k)                         # stride 0 on the ranks
        w = W.clone().requires_grad_()
        b = B.clone().requires_grad_() if bias else None
        y = f(1, None, x, w, b) if f else _old_column_parallel(x, w, b)
        y.backward(G)
        outs.append((y.detach(), w.grad, None if b is None else b.grad))
        if f is not None and not bias:
            assert type(y.grad_fn).__name__ == "TransposeBackward0"   # the new branch
    for p, q in zip(*outs):
        if p is None:
            assert q is None
        else:
            _same_tensor(p, q)


def test_toy_step_matches_one_device_and_takes_the_fast_path():
    X, W1, W2, x, w1, w2 = _tp()
    for _ in range(3):
        w1.grad = None
        w2.grad = None
        h = F.linear(x, w1)
        y = F.linear(torch.relu(h), w2)
        y.sum().backward()
    assert type(h._local.grad_fn).__name__ == "TransposeBackward0"
    assert_one_device(X, W1, W2, y, w1, w2)
    # the prepared column-parallel linear runs on the fast path (no run_prepared call)
    calls = []
    real = D.run_prepared
    D.run_prepared = lambda *a: calls.append(a[0].name) or real(*a)
    try:
        F.linear(torch.relu(F.linear(x, w1)), w2).sum()
    finally:
        D.run_prepared = real
    assert calls == []


_UNARY = [torch.relu, torch.tanh, torch.exp, torch.neg, torch.abs, torch.sigmoid,
          lambda t: F.gelu(t, approximate="tanh"), lambda t: F.leaky_relu(t, 0.1),
          lambda t: F.softplus(t, beta=2.0), torch.sin, torch.rsqrt]


@pytest.mark.parametrize("f", _UNARY)
@pytest.mark.parametrize("placements", [[wb.Shard(0), wb.Replicate()],
                                        [wb.Replicate(), wb.Shard(1)]])
def test_unary_pointwise_equals_torch_bit_for_bit(f, placements):
    g = torch.Generator().manual_seed(3)
    X = torch.rand(4, 6, generator=g, dtype=torch.float64) + 0.5
    mesh = wb.Mesh.grid((2, 2), ["a", "b"])
    x = wb.shard_tensor(X, mesh, placements)
    for _ in range(2):                        # first call, then the prepared op
        out = f(x)
        assert out.dtype == f(X).dtype and tuple(out.shape) == tuple(X.shape)
        assert torch.equal(out.full(), f(X))


def test_sum_with_and_without_dtype():
    g = torch.Generator().manual_seed(4)
    X = torch.randn(4, 6, generator=g)
    mesh = wb.Mesh.grid(2, ["a"])
    x = wb.shard_tensor(X, mesh, [wb.Shard(0)])
    for _ in range(2):
        a = x.sum(1)
        assert a.dtype == torch.float32 and torch.equal(a.full(), X.sum(1))
        b = x.sum(1, keepdim=True, dtype=torch.float64)
        assert b.dtype == torch.float64 and b.shape == (4, 1)
        assert torch.equal(b.full(), X.sum(1, keepdim=True, dtype=torch.float64))
        c = x.sum(dim=(1,), keepdim=True)
        assert torch.equal(c.full(), X.sum(dim=(1,), keepdim=True))


@pytest.mark.parametrize("how", ["partial_sum", "replicated", "mean"])
def test_backward_from_a_scalar_matches_one_device(how):
    X, W1, W2, x, w1, w2 = _tp(T=4, H=8, n=4, seed=5)
    a, b = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    for _ in range(2):
        w1.grad = None
        w2.grad = None
        a.grad = b.grad = None
        y = F.linear(torch.relu(F.linear(x, w1)), w2)
        y1 = F.linear(torch.relu(F.linear(X, a)), b)
        if how == "partial_sum":
            y.sum().backward()
            y1.sum().backward()
        elif how == "replicated":
            wb.reshard(y, y.mesh, [wb.Replicate()]).sum().backward()
            y1.sum().backward()
        else:
            y.mean().backward()
            y1.mean().backward()
    torch.testing.assert_close(w1.grad.full(), a.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w2.grad.full(), b.grad, rtol=1e-5, atol=1e-6)


def test_bad_input_still_raises_once_warm():
    X, W1, W2, x, w1, w2 = _tp(T=4, H=8, n=4)
    h = None
    for _ in range(3):
        h = torch.relu(F.linear(x, w1))
    with pytest.raises(RuntimeError, match="same dtype"):
        F.linear(wb.shard_tensor(X.double(), x.mesh, [wb.Replicate()]), w1)
    with pytest.raises(RuntimeError):
        F.linear(wb.shard_tensor(torch.randn(4, 5), x.mesh, [wb.Replicate()]), w1)
    with pytest.raises(RuntimeError):                 # torch's: no such approximation
        F.gelu(h, approximate="cubic")
    with pytest.raises(TypeError):                    # torch's argument parser
        h.sum(1, dtype="float64")
