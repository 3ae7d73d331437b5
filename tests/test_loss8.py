"""loss_parallel and tensor-parallel leftovers (loss8), held to one device and to PyTorch's
DTensor (``torch/distributed/tensor/parallel/loss.py`` under ``LocalTensorMode``,
``tests/dtensor_support.py``):

* a vocabulary the tp size does not divide (uneven ``torch.chunk`` shards, DTensor's
  uneven ``Shard(-1)``) is computed, every reduction, ignore_index, label_smoothing and
  class weights, with torch's three all-reduces forward and none backward;
* ``log_softmax`` inside ``loss_parallel`` keeps ``Shard(class dim)`` as torch's (two
  all-reduces), and its gradient is exact for any consumer (torch's handler passes the
  output gradient through unchanged: right only when ``nll_loss`` follows);
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.dtensor_support import (CommDebugMode, DShard, LocalTensorMode,  # noqa: F401
                                   distribute_tensor, oracle)

R, S, P = wb.Replicate, wb.Shard, wb.Partial
DT = torch.float64


def _kw(kw, v):
    kw = dict(kw)
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(v, dtype=DT, generator=torch.Generator().manual_seed(1))
    return kw


def _ours(x, t, mesh, placements, kw, tplace=None):
    """loss_parallel cross-entropy on x laid out ``placements``: (loss, grad, fwd, bwd)."""
    xd = wb.shard_tensor(x, mesh, placements).requires_grad_()
    td = t if tplace is None else wb.shard_tensor(t, mesh, tplace)
    with wb.trace("a100") as tr:
        with wb.loss_parallel():
            got = F.cross_entropy(xd, td, **kw)
        fwd = Counter(tr.counts())
        (got.sum() if got.ndim else got).backward()
        bwd = Counter(tr.counts()) - fwd
    return got, xd.grad.full(), fwd, bwd


def _one_device(x, t, kw):
    xr = x.clone().requires_grad_()
    want = F.cross_entropy(xr, t, **kw)
    want.sum().backward()
    return want, xr.grad


# ---- 1. uneven vocabulary --------------------------------------------------------------

@pytest.mark.parametrize("v, tp", [(10, 4), (5, 4), (7, 2)])          # 5 on 4: an empty rank
@pytest.mark.parametrize("kw", [{}, {"reduction": "none"}, {"reduction": "sum"},
                                {"label_smoothing": 0.2},
                                {"reduction": "none", "label_smoothing": 0.3, "weight": True},
                                {"weight": True}, {"weight": True, "reduction": "sum"},
                                {"ignore_index": 3}])
def test_uneven_vocabulary_equals_one_device(v, tp, kw):
    torch.manual_seed(0)
    kw = _kw(kw, v)
    x, t = torch.randn(6, v, dtype=DT), torch.randint(0, v, (6,))
    t[1] = kw.get("ignore_index", -100)
    want, gwant = _one_device(x, t, kw)
    got, grad, fwd, bwd = _ours(x, t, wb.Mesh.grid(tp, ["tp"]), [S(1)], kw)
    assert got.placements == (R(),)
    torch.testing.assert_close(got.full(), want, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, gwant, atol=1e-12, rtol=0)
    # torch's three (max, sum of exp, the masked target logit); the row sum of the
    # logits with label_smoothing; none backward (softmax - one_hot is local)
    assert fwd == Counter(all_reduce=3 + bool(kw.get("label_smoothing"))) and not bwd


@pytest.mark.parametrize("red", ["mean", "sum", "none"])
def test_uneven_vocabulary_dp_by_tp(red):
    """Rows sharded on dp, an uneven vocabulary on tp, a DistTensor target (torch's
    layout: Shard(0), Replicate): "mean" is the global mean (torch refuses it on an n-d
    mesh)."""
    torch.manual_seed(1)
    x, t = torch.randn(6, 10, dtype=DT), torch.randint(0, 10, (6,))
    t[3] = -100
    kw = {"reduction": red, "label_smoothing": 0.1}
    want, gwant = _one_device(x, t, kw)
    got, grad, _, bwd = _ours(x, t, wb.Mesh.grid((2, 4), ["dp", "tp"]), [S(0), S(1)], kw,
                              tplace=[S(0), R()])
    torch.testing.assert_close(got.full(), want, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, gwant, atol=1e-12, rtol=0)
    assert got.placements[1] == R() and not bwd


def test_uneven_vocabulary_nd_and_1d_logits_and_bad_targets():
    mesh = wb.Mesh.grid(4, ["tp"])
    x, t = torch.randn(2, 10, 3, dtype=DT), torch.randint(0, 10, (2, 3))
    with wb.loss_parallel():
        got = F.cross_entropy(wb.shard_tensor(x, mesh, [S(1)]), t, reduction="none")
        torch.testing.assert_close(got.full(), F.cross_entropy(x, t, reduction="none"))
        x1 = torch.randn(10, dtype=DT)
        got = F.cross_entropy(wb.shard_tensor(x1, mesh, [S(0)]), torch.tensor(9))
        torch.testing.assert_close(got.full(), F.cross_entropy(x1, torch.tensor(9)))
        xd = wb.shard_tensor(torch.randn(3, 10), mesh, [S(1)])
        with pytest.raises(IndexError, match="target 10 is out of bounds for 10 classes"):
            F.cross_entropy(xd, torch.tensor([1, 10, 2]))       # the mask would drop it
        with pytest.raises(RuntimeError, match="expected scalar type"):
            F.cross_entropy(xd, torch.tensor([1, 2, 2]), weight=torch.rand(10, dtype=DT))
        with pytest.raises(ValueError, match="exactly one mesh dim"):
            F.cross_entropy(wb.shard_tensor(torch.randn(3, 10), mesh, [S(0)]),
                            torch.tensor([1, 2, 2]))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")   # CommDebugMode's
@pytest.mark.parametrize("kw", [{}, {"reduction": "none"}, {"weight": True}])
def test_uneven_vocabulary_as_pytorch_dtensor(oracle, kw):  # noqa: F811
    """torch's loss_parallel on the same uneven Shard(1) logits (10 classes on 4: 3, 3, 3,
    1): the same loss, the same gradient, three all-reduces forward, none backward.
    (torch's backward raises on an ignore_index target under LocalTensorMode: none here.)"""
    from torch.distributed.tensor.parallel import loss_parallel
    torch.manual_seed(2)
    kw = _kw(kw, 10)
    x, t = torch.randn(6, 10, dtype=DT), torch.randint(0, 10, (6,))
    with LocalTensorMode(4):
        d = distribute_tensor(x, oracle.mesh((4,)), [DShard(1)]).requires_grad_()
        with CommDebugMode() as cm:
            with loss_parallel():
                lt = F.cross_entropy(d, t, **kw)
                fwd_t = sum(cm.get_comm_counts().values())
                (lt.sum() if lt.ndim else lt).backward()
            bwd_t = sum(cm.get_comm_counts().values()) - fwd_t
        lt0 = lt.full_tensor()._local_tensors[0]
        g0 = d.grad.full_tensor()._local_tensors[0]
    got, grad, fwd, bwd = _ours(x, t, wb.Mesh.grid(4, ["tp"]), [S(1)], kw)
    torch.testing.assert_close(got.full(), torch.as_tensor(lt0), atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, torch.as_tensor(g0), atol=1e-12, rtol=0)
    assert (sum(fwd.values()), sum(bwd.values())) == (fwd_t, bwd_t) == (3, 0)


def test_cross_entropy_loss_module_uneven_twice():
    """nn.CrossEntropyLoss, twice (a second call of the same layout)."""
    mesh = wb.Mesh.grid(4, ["tp"])
    x, t = torch.randn(5, 30, dtype=DT), torch.randint(0, 30, (5,))
    for _ in range(2):
        with wb.loss_parallel():
            got = nn.CrossEntropyLoss(label_smoothing=0.1)(wb.shard_tensor(x, mesh, [S(1)]), t)
        torch.testing.assert_close(got.full(), F.cross_entropy(x, t, label_smoothing=0.1))


# ---- 2. log_softmax keeps Shard(class dim) ----------------------------------------------

@pytest.mark.parametrize("v", [12, 10])
@pytest.mark.parametrize("fn", [lambda x: F.log_softmax(x, -1), lambda x: x.log_softmax(1),
                                lambda x: torch.log_softmax(x, dim=1)])
def test_log_softmax_keeps_the_class_shard_and_its_exact_gradient(v, fn):
    """torch keeps Shard(-1) with two all-reduces; any consumer gets the true gradient
    (one all-reduce backward: the row sum of the output gradient; torch's handler skips
    it and is wrong here by about 2)."""
    torch.manual_seed(3)
    mesh = wb.Mesh.grid(4, ["tp"])
    x, w = torch.randn(6, v, dtype=DT), torch.randn(6, v, dtype=DT)
    xr = x.clone().requires_grad_()
    (F.log_softmax(xr, -1) * w).sum().backward()
    xd = wb.shard_tensor(x, mesh, [S(1)]).requires_grad_()
    wd = wb.shard_tensor(w, mesh, [S(1)])
    with wb.trace("a100") as tr:
        with wb.loss_parallel():
            y = fn(xd)
            fwd = Counter(tr.counts())
            (y * wd).sum().backward()
        bwd = Counter(tr.counts()) - fwd
    assert y.placements == (S(1),)
    assert fwd == Counter(all_reduce=2) and bwd == Counter(all_reduce=1)
    torch.testing.assert_close(y.full(), F.log_softmax(x, -1), atol=1e-12, rtol=0)
    torch.testing.assert_close(xd.grad.full(), xr.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("v", [12, 10])
def test_log_softmax_then_nll_loss_one_pick(v):
    """nll_loss on the class-sharded log-probabilities: torch's masked pick, one
    all-reduce (three in all with log_softmax's two), weights and ignore_index."""
    torch.manual_seed(4)
    mesh = wb.Mesh.grid(4, ["tp"])
    x, t = torch.randn(6, v, dtype=DT), torch.randint(0, v, (6,))
    t[0] = -100
    wt = torch.rand(v, dtype=DT)
    for kw in ({}, {"weight": wt}, {"reduction": "none"}):
        xr = x.clone().requires_grad_()
        want = F.nll_loss(F.log_softmax(xr, -1), t, **kw)
        want.sum().backward()
        xd = wb.shard_tensor(x, mesh, [S(1)]).requires_grad_()
        with wb.trace("a100") as tr:
            with wb.loss_parallel():
                got = F.nll_loss(F.log_softmax(xd, -1), t, **kw)
            assert tr.counts() == Counter(all_reduce=3)
        got.sum().backward()
        assert got.placements == (R(),)
        torch.testing.assert_close(got.full(), want, atol=1e-12, rtol=0)
        torch.testing.assert_close(xd.grad.full(), xr.grad, atol=1e-12, rtol=0)


def test_log_softmax_over_another_dim_is_left_to_the_dispatcher():
    torch.manual_seed(5)
    x = torch.randn(6, 12, dtype=DT)
    xd = wb.shard_tensor(x, wb.Mesh.grid(4, ["tp"]), [S(1)])
    with wb.loss_parallel():
        y = F.log_softmax(xd, 0)
    assert y.placements == (S(1),)
    torch.testing.assert_close(y.full(), F.log_softmax(x, 0))
