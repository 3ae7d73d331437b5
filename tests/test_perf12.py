"""perf12: the simulator's per-op overhead cut without changing results (behaviour only;
the instruction counts are in benchmarks/sim_instr.py and the commit messages).

* dispatch's fast path (``dispatch._fast_facts``, ``_Prepared.fast``): a prepared op
  whose layout leaves run_prepared nothing to do but run the local op and wrap its one
  output is run without it; the same values, gradients, output layouts and strides, bit
  for bit, as the general path (forced here by an explain hook, which the fast path
  leaves to run_prepared); what the cache key does not hold is checked on every call
  (an input that requires grad where the op expands it, a plain tensor in a
  DistTensor's place, global strides kept), and bad input still raises once the cache
  is warm;
* the row-parallel linear's backward (``ops_table/matmul._RankLinear``) builds its
  side-by-side operands and per-rank gradients with one ``as_strided`` each where every
  size is above 1: the same tensors (values, sizes, strides, offset) as the
  reshape / view / transpose chain it replaces, for operands of every layout.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import dispatch as D
from workbench.parallel.ops_table import matmul as M
from tests.test_perf11 import _tp as _tp11, assert_one_device


def _tp(T=8, H=16, n=4, seed=0):
    """perf11's toy TP MLP inputs, 8 tokens."""
    return _tp11(T=T, H=H, n=n, seed=seed)


def _step(x, w1, w2):
    w1.grad = None
    w2.grad = None
    h = torch.relu(F.linear(x, w1))
    y = F.linear(h, w2)
    loss = y.sum()
    loss.backward()
    return h, y, loss


def _bits(d):
    return [(tuple(t.shape), t.stride(), t.dtype, t.clone()) for t in
            (d.local(r) for r in d.mesh.ranks)] + [tuple(d.placements), tuple(d.shape)]


def _same(a, b):
    assert len(a) == len(b)
    for p, q in zip(a, b):
        if isinstance(p, tuple) and p and isinstance(p[-1], torch.Tensor):
            assert p[:3] == q[:3]
            assert torch.equal(p[3], q[3])
        else:
            assert p == q


def _general():
    """The general path: an explain hook makes dispatch leave every op to run_prepared."""
    return D.explain_hooks(lambda *a: None)


def _fast_preps():
    return [p for p in D._PREPARED.values() if p.fast]


def test_tp_step_fast_path_is_bit_identical_to_the_general_path():
    X, W1, W2, x, w1, w2 = _tp()
    outs = []
    for general in (True, False, False):      # general first: the fast path's facts are
        ctx = _general() if general else None  # set by the general path's first run
        if ctx is not None:
            with ctx:
                h, y, loss = _step(x, w1, w2)
        else:
            h, y, loss = _step(x, w1, w2)
        outs.append([_bits(h), _bits(y), _bits(loss), _bits(w1.grad), _bits(w2.grad)])
    assert _fast_preps(), "no prepared op took the fast path"
    for a, b in zip(outs[0], outs[2]):
        _same(a, b)
    for a, b in zip(outs[1], outs[2]):
        _same(a, b)
    assert_one_device(X, W1, W2, y, w1, w2)


def test_fast_facts_of_the_column_parallel_linear():
    """x replicated meets per-rank work (expanded per rank), w as it is, no bias: a
    constant; the output one layout."""
    X, W1, W2, x, w1, w2 = _tp(n=4)
    for _ in range(2):
        F.linear(x, w1)
    key = [k for k in D._PREPARED if k[0] == "linear" and k[1][:2] == (x.spec, w1.spec)
           and k[1][2] is None]
    assert len(key) == 1
    prep = D._PREPARED[key[0]]
    assert prep.fast == (((0, 4),), True, False)
    assert prep.nd == 1


def test_replicated_input_that_requires_grad_takes_the_general_path():
    """The expanded input's gradient is each rank's share summed (an all-reduce): the
    fast path leaves it to run_prepared, so x.grad is the one-device gradient, and the
    trace holds the all-reduce."""
    X, W1, W2, x, w1, w2 = _tp()
    F.linear(x, w1)
    F.linear(x, w1)                     # the prepared op's facts set, no grad on x
    xg = wb.shard_tensor(X, x.mesh, [wb.Replicate()]).requires_grad_()
    for _ in range(2):
        xg.grad = None
        w1.grad = None
        F.linear(xg, w1).pow(2).sum().backward()
    a = X.clone().requires_grad_()
    b = W1.clone().requires_grad_()
    F.linear(a, b).pow(2).sum().backward()
    torch.testing.assert_close(xg.grad.full(), a.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1.grad.full(), b.grad, rtol=1e-5, atol=1e-5)
    xg.grad = None
    with wb.trace() as tr:
        F.linear(xg, w1).pow(2).sum().backward()
    kinds = [getattr(e, "kind", None) or getattr(e, "name", "") for e in tr.events]
    assert any("all_reduce" in str(k) for k in kinds), kinds


def test_no_grad_and_grad_mode_give_the_same_values():
    X, W1, W2, x, w1, w2 = _tp()
    xg = wb.shard_tensor(X, x.mesh, [wb.Replicate()]).requires_grad_()
    with_grad = [F.linear(xg, w1) for _ in range(2)][-1]
    with torch.no_grad():
        without = [F.linear(xg, w1) for _ in range(2)][-1]
    assert without._local.requires_grad is False
    _same(_bits(with_grad), _bits(without))


def test_plain_tensor_in_a_disttensor_place_after_the_cache_is_warm():
    """A plain tensor has a replicated spec, the key of a replicated DistTensor: the
    fast path checks each input's type per call and leaves it to run_prepared."""
    X, W1, W2, x, w1, w2 = _tp()
    for _ in range(2):
        F.linear(x, w1)
    out = F.linear(X, w1)
    ref = F.linear(x, w1)
    _same(_bits(out), _bits(ref))


def test_bad_input_still_raises_once_the_cache_is_warm():
    X, W1, W2, x, w1, w2 = _tp()
    for _ in range(3):
        torch.relu(F.linear(x, w1))
    x64 = wb.shard_tensor(X.double(), x.mesh, [wb.Replicate()])
    with pytest.raises(RuntimeError, match="same dtype"):
        F.linear(x64, w1)
    wrong = wb.shard_tensor(torch.randn(8, 5), x.mesh, [wb.Replicate()])
    with pytest.raises(RuntimeError):
        F.linear(wrong, w1)
    h = torch.relu(F.linear(x, w1))
    other = wb.shard_tensor(torch.randn(8, 64), wb.Mesh.grid(4, ["tp"], start=4),
                            [wb.Shard(1)])
    with pytest.raises(ValueError, match="different meshes"):
        h + other


def test_kept_global_strides_still_tracked():
    """An input whose global strides are kept (``_gstride``) is left to the general
    path, which tracks the output's strides as torch's."""
    g = torch.Generator().manual_seed(3)
    A = torch.randn(6, 8, generator=g)
    mesh = wb.Mesh.grid(2, ["tp"])
    a = wb.shard_tensor(A, mesh, [wb.Shard(0)])
    for _ in range(2):
        torch.relu(a)
    at = a.t()                                        # a transposed view: torch's strides
    outs = [torch.relu(at) for _ in range(2)]
    assert outs[-1].stride() == torch.relu(A.t()).stride()
    assert torch.equal(outs[-1].full(), torch.relu(A.t()))


def test_hybrid_mesh_fast_path_keeps_one_copy_of_replicated_outputs():
    """On a 2-d mesh an output replicated on one dim is kept once (run_prepared's keep):
    the fast path keeps it the same way; values equal one device, layouts equal the
    general path's."""
    g = torch.Generator().manual_seed(5)
    A = torch.randn(8, 6, generator=g)
    B = torch.randn(8, 6, generator=g)
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    a = wb.shard_tensor(A, mesh, [wb.Shard(0), wb.Replicate()])
    b = wb.shard_tensor(B, mesh, [wb.Shard(0), wb.Replicate()])
    with _general():
        ref = (a * b).tanh()
    outs = [(a * b).tanh() for _ in range(3)]
    assert any(p.fast and p.keep for p in D._PREPARED.values())
    _same(_bits(outs[-1]), _bits(ref))
    assert outs[-1]._local.shape[1] == 1               # one copy along tp
    assert torch.equal(outs[-1].full(), (A * B).tanh())


def _old_rank_backward(x, w, g, need_x, need_w):
    """_RankLinear's backward before perf12 (the reshape / view / transpose chain)."""
    G = g.select(0, 0)
    if need_x and need_w:
        G = G.contiguous()
    L, n, k = w.shape
    T = G.size(0)
    gx = gw = None
    if need_x:
        gx = torch.mm(G, w.transpose(0, 1).reshape(n, L * k)).view(T, L, k).transpose(0, 1)
    if need_w:
        gw = torch.mm(G.t(), x.transpose(0, 1).reshape(T, L * k)).view(n, L, k).transpose(0, 1)
    return gx, gw


def _operand(a, b, c, layout, g):
    if layout == 0:
        return torch.randn(a, b, c, generator=g)
    if layout == 1:                                     # a column output's layout
        return torch.randn(b, a, c, generator=g).transpose(0, 1)
    if layout == 2:
        return torch.randn(a, c, b, generator=g).transpose(1, 2)
    return torch.randn(a + 1, b, c + 2, generator=g)[1:, :, 1:c + 1]   # offset and gaps


@pytest.mark.parametrize("L,T,n,k", [(2, 3, 4, 5), (4, 1, 3, 2), (3, 2, 1, 4), (2, 2, 3, 1),
                                     (8, 6, 8, 4)])
def test_rank_linear_backward_same_tensors_as_the_view_chain(L, T, n, k):
    g = torch.Generator().manual_seed(L * 1000 + T * 100 + n * 10 + k)
    for lx, lw in itertools.product(range(4), range(4)):
        for need_x, need_w in ((True, True), (True, False), (False, True)):
            x = _operand(L, T, k, lx, g).requires_grad_(need_x)
            w = _operand(L, n, k, lw, g).requires_grad_(need_w)
            G = torch.randn(T, n, generator=g)
            grad = G.unsqueeze(0).expand(L, T, n)
            grad = grad.as_strided(grad.shape, (0,) + grad.stride()[1:])   # stride 0
            got = torch.autograd.grad(M._RankLinear.apply(x, w),
                                      [t for t in (x, w) if t.requires_grad], grad)
            want = [t for t in _old_rank_backward(x.detach(), w.detach(), grad, need_x,
                                                  need_w) if t is not None]
            for a, b in zip(got, want):
                assert torch.equal(a, b)
                assert (a.shape, a.stride(), a.storage_offset()) == \
                    (b.shape, b.stride(), b.storage_offset())


def test_side_by_side_is_the_reshape_view_or_none():
    g = torch.Generator().manual_seed(7)
    for layout in range(4):
        t = _operand(3, 4, 5, layout, g)
        got = M._side_by_side(t, 4, 3, 5)
        want = t.transpose(0, 1).reshape(4, 15)
        if got is None:                        # the reshape copies: not a view of t
            assert want.data_ptr() != t.data_ptr() or want._base is None
            continue
        assert torch.equal(got, want)
        assert (got.stride(), got.storage_offset(), got.data_ptr()) == \
            (want.stride(), want.storage_offset(), want.data_ptr())


def test_disttensor_with_unset_optional_slots_runs():
    """A DistTensor restored without its optional slots (an older pickle: ``__getstate__``
    keeps only the slots that are set) runs as the general path runs it, which reads
    them with defaults."""
    X, W1, W2, x, w1, w2 = _tp()
    h = torch.relu(F.linear(x, w1))
    ref = torch.relu(h)
    for _ in range(2):
        torch.relu(h)
    del h._ring_order
    del h._gstride
    out = torch.relu(h)
    _same(_bits(out), _bits(ref))
