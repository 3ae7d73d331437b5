"""Defects found by the third random sweep (benchmarks/random_sweep.py on the extended
generator, tests/random_programs_more.py), each in its smallest form."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.placement import Partial, Replicate, Shard
from workbench.parallel.validate import distribute

MESH = wb.Mesh.grid(2)


def test_repeat_of_a_0d_tensor_with_no_repeats_is_torchs():
    # seed 910110: x.repeat([]) on a 0-d tensor is x in torch; the rule's torch check
    # called repeat(*()) and raised a raw TypeError
    x = torch.tensor(1.5)
    d = wb.shard_tensor(x, MESH, [Replicate()])
    torch.testing.assert_close(d.repeat([]).full(), x.repeat([]))
    torch.testing.assert_close(d.repeat(()).full(), x.repeat(()))


def test_repeat_keeps_torchs_checks():
    d = wb.shard_tensor(torch.randn(4, 3), MESH, [Shard(0)])
    torch.testing.assert_close(d.repeat(2, 1).full(), d.full().repeat(2, 1))
    try:
        torch.randn(4, 3).repeat(2)
    except RuntimeError:
        pass
    else:
        raise AssertionError("torch accepted fewer repeats than dims")
    try:
        d.repeat(2)
    except RuntimeError:
        return
    raise AssertionError("repeat with fewer repeats than dims returned a result")


def test_searchsorted_of_a_python_float_in_an_int_sequence_promotes_as_torch():
    # silent before: the scalar was cast to the sequence's dtype (2.5 -> 2), position 1
    # where torch (the scalar wrapped as a number, compared promoted) gives 2
    seq = torch.tensor([1, 2, 3, 4])
    f32 = torch.tensor([0.0, 0.1, 0.2], dtype=torch.float32)
    for s, v in ((seq, 2.5), (seq, 2), (f32, 0.1), (f32.double(), 0.1)):
        for ps in ([Replicate()], [Shard(0)]):
            d = wb.shard_tensor(s, MESH, ps)
            for right in (False, True):
                got = torch.searchsorted(d, v, right=right)
                want = torch.searchsorted(s, v, right=right)
                assert got.full().dtype == want.dtype
                assert torch.equal(got.full(), want), (s, v, ps, right)


def test_quantile_of_a_0d_tensor_along_its_dim_is_torchs():
    # torch.quantile(0-d, q, dim=0) is the element; the local searched dim 1 of the
    # stacked local tensors: a raw IndexError
    x = torch.tensor(0.7, dtype=torch.float64)
    q1 = torch.tensor([0.2, 0.9], dtype=torch.float64)
    for ps in ([Replicate()], [Partial("sum")]):
        d = distribute(x, MESH, ps, seed=3)
        for call in (lambda t: torch.quantile(t, 0.3, 0), lambda t: torch.quantile(t, q1, -1),
                     lambda t: torch.quantile(t, 0.3, 0, keepdim=True),
                     lambda t: torch.nanquantile(t, q1, 0, keepdim=True)):
            got, want = call(d).full(), call(x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want)


def test_dim_ops_of_a_0d_tensor_are_torchs():
    # var / std / logsumexp read input.shape[0] of a 0-d tensor, scatter scattered along
    # dim 1 of the stacked local: raw IndexErrors where torch takes dim 0 / -1
    x = torch.tensor(0.7, dtype=torch.float64)
    calls = [lambda t: t.var(0, correction=0), lambda t: torch.std(t, -1, correction=0),
             lambda t: t.logsumexp(0), lambda t: torch.logsumexp(t, -1, keepdim=True),
             lambda t: t.scatter(0, torch.tensor(0), 5.0),
             lambda t: t.scatter(-1, torch.tensor(0), torch.tensor(2.5, dtype=torch.float64))]
    for ps in ([Replicate()], [Partial("sum")]):
        d = distribute(x, MESH, ps, seed=3)
        for call in calls:
            got, want = call(d).full(), call(x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want)


def test_linear_of_a_1d_input_has_torchs_shape_values_and_gradients():
    # silent before: F.linear(vector, w) on DistTensors (any layout computed by the general
    # path: x and w both replicated, or x S(0) with w S(1)) held (1, n) local results under
    # a (n,) shape: .full() was (1, n), and a later reduce-scatter or gather failed
    # (sweep seed 600022: a (2, 3, 1) mesh, uneven shards)
    torch.manual_seed(0)
    x, w, b = (torch.randn(*s, dtype=torch.float64) for s in ((3,), (2, 3), (2,)))
    g = torch.randn(2, dtype=torch.float64)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    (F.linear(xr, wr, br) * g).sum().backward()
    for mesh, px, pw in ((MESH, [Replicate()], [Replicate()]), (MESH, [Shard(0)], [Shard(1)]),
                         (wb.Mesh([[[0], [1], [2]], [[3], [4], [5]]]),
                          [Replicate(), Partial("avg"), Replicate()],
                          [Replicate(), Replicate(), Partial("max")])):
        dx = distribute(x, mesh, px, seed=1).requires_grad_()
        dw = distribute(w, mesh, pw, seed=2).requires_grad_()
        db = distribute(b, mesh, [Replicate()] * mesh.ndim, seed=3).requires_grad_()
        y = F.linear(dx, dw, db)
        assert y.full().shape == (2,)
        torch.testing.assert_close(y.full(), F.linear(x, w, b))
        (y * g).sum().backward()
        if not any(p.is_partial() for p in px + pw):
            torch.testing.assert_close(dx.grad.full(), xr.grad)
            torch.testing.assert_close(dw.grad.full(), wr.grad)
        torch.testing.assert_close(db.grad.full(), br.grad)


def test_gradient_of_sgn_on_uneven_shards_gathers():
    # sweep seed 600019: torch's sgn backward on real inputs gives ZeroTensors
    # (at::_efficientzerotensor); reshard's memory-sharing check asked them for a data
    # pointer: a raw RuntimeError from .grad.full()
    mesh = wb.Mesh([[1, 6, 3, 7], [0, 2, 4, 5]])
    x = torch.tensor([[-1.5, -0.13, 0.85, 1.2, 2.7]], dtype=torch.float64)
    d = distribute(x, mesh, [Shard(1), Shard(1)], seed=6).requires_grad_()
    r = x.clone().requires_grad_()
    (torch.sgn(d) * 2).sum().backward()
    (torch.sgn(r) * 2).sum().backward()
    torch.testing.assert_close(d.grad.full(), r.grad)
    assert d.grad.local(0).shape == (1, 1)


def test_max_and_min_along_a_dim_of_a_bool_tensor_are_torchs():
    # sweep seed 600815: torch.max(bool, dim) is defined; ours took argmax of the bool
    # tensor, which torch refuses: a raw RuntimeError
    x = torch.tensor([[True, False, True], [False, False, True]])
    for ps in ([Replicate()], [Shard(0)], [Shard(1)]):
        d = wb.shard_tensor(x, MESH, ps)
        for fn in (torch.max, torch.min):
            for dim, keep in ((0, False), (1, True), (-1, False)):
                got, want = fn(d, dim, keepdim=keep), fn(x, dim, keepdim=keep)
                assert torch.equal(got[0].full(), want[0]) and torch.equal(got[1].full(), want[1])
        got, want = torch.max(d[0, 0], 0), torch.max(x[0, 0], 0)
        assert torch.equal(got[0].full(), want[0]) and torch.equal(got[1].full(), want[1])


def test_mse_loss_of_a_bool_input_promotes_as_torch():
    # sweep seed 600218: F.mse_loss(bool, float64) is defined in torch (promoted); the
    # composite's input - target raised on the bool tensor
    x = torch.tensor([[True, False], [False, True]])
    y = torch.tensor([[0.5, -1.0], [2.0, 0.25]], dtype=torch.float64)
    dx, dy = wb.shard_tensor(x, MESH, [Shard(0)]), wb.shard_tensor(y, MESH, [Replicate()])
    for red in ("mean", "sum", "none"):
        want = F.mse_loss(x, y, reduction=red)
        got = F.mse_loss(dx, dy, reduction=red).full()
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)


def test_bucketize_of_a_python_number_is_torchs():
    # torch.bucketize(2.5, boundaries) is defined; ours raised "ValueError: max() arg is an
    # empty sequence" from the rule (the number had no spec)
    for b in (torch.tensor([1, 2, 3, 4]), torch.tensor([0.0, 0.1, 0.2])):
        for ps in ([Replicate()], [Shard(0)]):
            d = wb.shard_tensor(b, MESH, ps)
            for v in (2.5, 2, 0.1):
                for right in (False, True):
                    got = torch.bucketize(v, d, right=right).full()
                    want = torch.bucketize(v, b, right=right)
                    assert got.dtype == want.dtype and torch.equal(got, want), (b, v, right)


def test_std_gradient_over_a_constant_slice_is_torchs_zero():
    # silent before (sweep seed 600053): std as sqrt(var) gave a nan gradient where the
    # std is 0 (one element, or equal values); torch's std_backward gives 0
    xs = [torch.tensor(0.3, dtype=torch.float64), torch.tensor([[0.3, 0.3], [0.2, 0.5]],
                                                                 dtype=torch.float64)]
    for x in xs:
        for ps in ([Replicate()], [Shard(0)] if x.dim() else [Partial("sum")]):
            for corr in (0, 1) if x.dim() else (0,):     # (one element, correction 1:
                r = x.clone().requires_grad_()             # refused with grad, documented)
                d = distribute(x, MESH, ps, seed=2).requires_grad_()
                want = torch.std(r, -1, correction=corr)
                got = torch.std(d, -1, correction=corr)
                torch.testing.assert_close(got.full(), want.detach(), equal_nan=True)
                want.sum().backward()
                got.sum().backward()
                if not any(p.is_partial() for p in ps):
                    torch.testing.assert_close(d.grad.full(), r.grad)
