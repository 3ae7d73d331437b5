"""perf11: the toy TP step's per-op overhead cut without changing results (behaviour only;
the speed figures are in benchmarks/sim_overhead.py and the commit messages).

* the row-parallel linear calls torch's C ``Function.apply`` directly
  (``ops_table/matmul._rank_linear``): the same values and gradients, bit for bit, as
  ``_RankLinear.apply``; under a functorch transform torch's own path (and its error);
* its backward's GEMMs are ``torch.mm`` (what ``@`` of 2-d tensors runs): bit-identical;
* the dispatcher's cache key for an op with a None input (``F.linear`` without bias)
  is built without the plain-input path: the same key fields (spec None, ``NoneType``
  among the constants), so a linear with and without bias, or with a plain bias, each
  get their own prepared op and the right answer;
* ``same_dtype``: one dtype passes, two still raise.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import dispatch as D
from workbench.parallel.ops_table import matmul as M


def _tp(T=32, H=16, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, H, generator=g)
    W1 = torch.randn(4 * H, H, generator=g) / H ** 0.5
    W2 = torch.randn(H, 4 * H, generator=g) / H ** 0.5
    mesh = wb.Mesh.grid(n, ["tp"])
    x = wb.shard_tensor(X, mesh, [wb.Replicate()])
    w1 = wb.shard_tensor(W1, mesh, [wb.Shard(0)]).requires_grad_()
    w2 = wb.shard_tensor(W2, mesh, [wb.Shard(1)]).requires_grad_()
    return X, W1, W2, x, w1, w2


def test_tp_step_matches_one_device():
    X, W1, W2, x, w1, w2 = _tp()
    for _ in range(2):                       # the second step runs the prepared ops
        w1.grad = None
        w2.grad = None
        y = F.linear(torch.relu(F.linear(x, w1)), w2)
        y.sum().backward()
    assert_one_device(X, W1, W2, y, w1, w2)


def assert_one_device(X, W1, W2, y, w1, w2):
    """The toy MLP's output and both weights' gradients equal one device's."""
    a, b = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    ref = F.linear(torch.relu(F.linear(X, a)), b)
    ref.sum().backward()
    torch.testing.assert_close(y.full(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1.grad.full(), a.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w2.grad.full(), b.grad, rtol=1e-5, atol=1e-5)


def _rank_operands(seed):
    g = torch.Generator().manual_seed(seed)
    base_x = torch.randn(6, 4 * 5, generator=g)          # (T, L*k): a column output's layout
    base_w = torch.randn(3, 4 * 5, generator=g)          # (n, L*k): a row-sharded weight
    x = base_x.view(6, 4, 5).transpose(0, 1).detach().requires_grad_()
    w = base_w.view(3, 4, 5).transpose(0, 1).detach().requires_grad_()
    return x, w


@pytest.mark.parametrize("expanded", [True, False])
def test_rank_linear_fast_apply_bit_identical(expanded):
    """The direct C apply and torch's Function.apply: equal outputs and gradients, for the
    gradient the same on every rank (stride 0: the mm path) and a per-rank one (bmm)."""
    outs = []
    for fn in (M._rank_linear, M._RankLinear.apply):
        x, w = _rank_operands(1)
        y = fn(x, w)
        assert y.grad_fn is not None and type(y.grad_fn).__name__ == "_RankLinearBackward"
        if expanded:
            g = torch.full((), 0.5).expand(y.shape)
        else:
            g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        y.backward(g)
        outs.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    # and the values are each rank's x_r @ w_r.T with its gradients
    x, w = _rank_operands(1)
    ref = torch.bmm(x, w.transpose(1, 2))
    torch.testing.assert_close(outs[0][0], ref)
    ref.backward(g.contiguous())
    torch.testing.assert_close(outs[0][1], x.grad)
    torch.testing.assert_close(outs[0][2], w.grad)


def test_rank_linear_one_input_needing_grad():
    for need in ((True, False), (False, True)):
        res = []
        for fn in (M._rank_linear, M._RankLinear.apply):
            x, w = _rank_operands(3)
            x.requires_grad_(need[0])
            w.requires_grad_(need[1])
            y = fn(x, w)
            y.backward(torch.ones(()).expand(y.shape))
            res.append((x.grad, w.grad))
        for a, b in zip(*res):
            assert (a is None) == (b is None)
            assert a is None or torch.equal(a, b)
        assert (res[0][0] is None) != need[0] and (res[0][1] is None) != need[1]


def test_rank_linear_under_functorch_takes_torchs_path():
    """Inside a functorch transform the fast path is not taken: torch's Function.apply
    runs, and raises its own error (the Function defines no setup_context)."""
    x, w = _rank_operands(4)
    x, w = x.detach(), w.detach()
    with pytest.raises(RuntimeError, match="setup_context") as fast:
        torch.func.grad(lambda a: M._rank_linear(a, w).sum())(x)
    with pytest.raises(RuntimeError, match="setup_context") as ref:
        torch.func.grad(lambda a: M._RankLinear.apply(a, w).sum())(x)
    assert str(fast.value) == str(ref.value)


def test_linear_none_bias_key_fields():
    """Three calls on one layout differing only in the bias (None, a DistTensor, a plain
    tensor): each is right, and the None call's cache key holds what the plain path
    gave it (spec None, NoneType among the constants)."""
    mesh = wb.Mesh.grid(2, ["tp"])
    g = torch.Generator().manual_seed(5)
    X, W, Bv = torch.randn(3, 4, generator=g), torch.randn(6, 4, generator=g), \
        torch.randn(6, generator=g)
    x = wb.shard_tensor(X, mesh, [wb.Replicate()])
    w = wb.shard_tensor(W, mesh, [wb.Shard(0)])
    b = wb.shard_tensor(Bv, mesh, [wb.Shard(0)])
    seen = []
    real_get = D._PREPARED.get

    class Spy(dict):
        def get(self, key, default=None):
            if key[0] == "linear":
                seen.append(key)
            return real_get(key, default)
    old = D._PREPARED
    D._PREPARED = Spy(old)
    try:
        for _ in range(2):
            y0 = F.linear(x, w)
            y1 = F.linear(x, w, b)
            y2 = F.linear(x, w, Bv)
            y3 = F.linear(x, w, None)
    finally:
        old.update(D._PREPARED)
        D._PREPARED = old
    torch.testing.assert_close(y0.full(), F.linear(X, W))
    torch.testing.assert_close(y3.full(), F.linear(X, W))
    torch.testing.assert_close(y1.full(), F.linear(X, W, Bv))
    torch.testing.assert_close(y2.full(), F.linear(X, W, Bv))
    none_keys = [k for k in seen if k[1][2] is None]
    assert none_keys and all(k[4] == (type(None),) for k in none_keys)
    assert len({k for k in seen}) == 3          # None, DistTensor bias, plain bias
    plain = [k for k in seen if k[1][2] is not None and k[1][2].mesh is mesh and
             k[1][2].placements == (wb.Replicate(),)]
    assert plain and all(k[4] == () for k in plain)


def test_same_dtype_one_and_two_dtypes():
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    assert M.same_dtype("linear", a, b, None) == (a, b, None)
    with pytest.raises(RuntimeError, match="same dtype"):
        M.same_dtype("linear", a, b.double())
    mesh = wb.Mesh.grid(2, ["tp"])
    x = wb.shard_tensor(a, mesh, [wb.Replicate()])
    w = wb.shard_tensor(b.double(), mesh, [wb.Shard(0)])
    with pytest.raises(RuntimeError, match="same dtype"):
        F.linear(x, w)


def test_column_parallel_2d_mesh_batched():
    """The column-parallel path's shapes on a 2-d mesh with a 3-d input (nd 2)."""
    mesh = wb.Mesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    g = torch.Generator().manual_seed(6)
    X, W = torch.randn(2, 3, 4, generator=g), torch.randn(8, 4, generator=g)
    x = wb.shard_tensor(X, mesh, [wb.Replicate(), wb.Replicate()])
    w = wb.shard_tensor(W, mesh, [wb.Shard(0), wb.Shard(0)]).requires_grad_()
    y = F.linear(x, w)
    ref_w = W.clone().requires_grad_()
    ref = F.linear(X, ref_w)
    torch.testing.assert_close(y.full(), ref)
    y.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(w.grad.full(), ref_w.grad)
