"""Autograd through every collective matches the analytic backward, and the
backward communication is recorded in the trace."""
import pytest
import torch

import workbench as wb
from workbench.sim_mesh import collectives as C

MESH = wb.Mesh.grid((2, 3), ("dp", "tp"))
AX = 1                       # collectives along "tp" (3 ranks), twice (2 dp groups)


def run(fn, x, g):
    x = x.clone().requires_grad_()
    with wb.trace() as tr:
        y = fn(x)
        n_fwd = len(tr.collectives())
        y.backward(g.expand_as(y) if g.shape != y.shape else g)
    bwd = tr.collectives()[n_fwd:]
    return y.detach(), x.grad, bwd


def test_all_reduce_backward_is_all_reduce():
    x = torch.randn(2, 3, 4)
    g = torch.randn(2, 3, 4)
    y, dx, bwd = run(lambda x: C.all_reduce(x, MESH, AX, expanded=True), x, g)
    torch.testing.assert_close(y, x.sum(1, keepdim=True).expand(2, 3, 4))
    torch.testing.assert_close(dx, g.sum(1, keepdim=True).expand(2, 3, 4))
    assert [e.name for e in bwd] == ["all_reduce"] * 2


def test_all_reduce_avg_and_max():
    x = torch.randn(2, 3, 4)
    g = torch.randn(2, 3, 4)
    _, dx, _ = run(lambda x: C.all_reduce(x, MESH, AX, "avg", expanded=True), x, g)
    torch.testing.assert_close(dx, g.sum(1, keepdim=True).expand(2, 3, 4) / 3)
    _, dx, _ = run(lambda x: C.all_reduce(x, MESH, AX, "max", expanded=True), x, g)
    is_max = x == x.amax(1, keepdim=True)
    torch.testing.assert_close(dx, torch.where(is_max, g.sum(1, keepdim=True), 0.0))


def test_all_gather_backward_is_reduce_scatter():
    x = torch.randn(2, 3, 2, 5)                    # each rank holds (2, 5); gather dim 0
    g = torch.randn(2, 3, 6, 5)
    y, dx, bwd = run(lambda x: C.all_gather(x, MESH, AX, 0, expanded=True), x, g)
    for k in range(3):
        torch.testing.assert_close(y[:, k], torch.cat([x[:, j] for j in range(3)], 1))
        # rank k's shard gets the sum over ranks of their gradient's chunk k
        torch.testing.assert_close(dx[:, k], g[:, :, 2 * k:2 * k + 2].sum(1))
    assert [e.name for e in bwd] == ["reduce_scatter"] * 2


def test_reduce_scatter_backward_is_all_gather():
    x = torch.randn(2, 3, 6, 5)
    g = torch.randn(2, 3, 2, 5)
    y, dx, bwd = run(lambda x: C.reduce_scatter(x, MESH, AX, 0), x, g)
    s = x.sum(1)
    for k in range(3):
        torch.testing.assert_close(y[:, k], s[:, 2 * k:2 * k + 2])
        torch.testing.assert_close(dx[:, k], torch.cat([g[:, j] for j in range(3)], 1))
    assert [e.name for e in bwd] == ["all_gather"] * 2


def test_all_to_all_backward_is_reverse_all_to_all():
    x = torch.randn(2, 3, 2, 6)                    # S(0) -> S(1): split dim 1, concat dim 0
    g = torch.randn(2, 3, 6, 2)
    y, dx, bwd = run(lambda x: C.all_to_all(x, MESH, AX, 1, 0), x, g)
    full = torch.cat([x[:, j] for j in range(3)], 1)          # (2, 6, 6) global per dp row
    for k in range(3):
        torch.testing.assert_close(y[:, k], full[:, :, 2 * k:2 * k + 2])
    gfull = torch.cat([g[:, j] for j in range(3)], 2)
    for k in range(3):
        torch.testing.assert_close(dx[:, k], gfull[:, 2 * k:2 * k + 2, :])
    assert [e.name for e in bwd] == ["all_to_all"] * 2


def test_expand_replicas_backward_is_traced_all_reduce():
    x = torch.randn(2, 1, 4)                       # replicated along tp: stored once
    g = torch.randn(2, 3, 4)
    y, dx, bwd = run(lambda x: C.expand_replicas(x, MESH, [AX]), x, g)
    assert y.shape == (2, 3, 4) and y.stride(1) == 0
    torch.testing.assert_close(dx, g.sum(1, keepdim=True))
    assert [e.name for e in bwd] == ["all_reduce"] * 2


def test_broadcast_takes_root():
    x = torch.randn(2, 3, 4)
    y = C.broadcast(x, MESH, AX, root=2)
    torch.testing.assert_close(y, x[:, 2:3])


def test_uneven_cells_match_stacked_math():
    mesh = wb.Mesh.grid(4)
    x = torch.randn(10, 3, requires_grad=True)
    t = wb.shard_tensor(x, mesh, [wb.Shard(0)])
    assert not t.is_even
    with wb.trace() as tr:
        y = wb.reshard(t, mesh, [wb.Replicate()])
        (y.local(0) * torch.arange(30.).reshape(10, 3)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(30.).reshape(10, 3))
    assert tr.counts()["all_gather"] == 2          # forward, and the backward of the slice


def test_leaf_grads_are_dist_tensors_with_placements():
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    w = torch.randn(4, 6)
    ws = wb.shard_tensor(w, mesh, [wb.Replicate(), wb.Shard(1)]).requires_grad_()
    r = wb.reshard(ws, mesh, [wb.Replicate(), wb.Replicate()])
    (r.local(0) ** 2).sum().backward()
    assert isinstance(ws.grad, wb.DistTensor) and ws.grad.placements == ws.placements
    torch.testing.assert_close(ws.grad.full(), 2 * w)


def test_errors_name_the_problem():
    x = torch.randn(2, 1, 4)
    with pytest.raises(ValueError, match="same on every rank"):
        C.all_reduce(x, MESH, AX)
    with pytest.raises(ValueError, match="unknown reduction"):
        C.all_reduce(torch.randn(2, 3, 4), MESH, AX, "prod")


@pytest.mark.parametrize("call,exc,match", [
    (lambda: C.all_reduce(torch.randn(2, 3, 4), MESH, 5), ValueError, r"mesh dim 5 out of range.*'tp'"),
    (lambda: C.all_gather(torch.randn(2, 3, 4), MESH, AX, 3), IndexError,
     r"all_gather\(dim=3\): the local tensor has 1 dims.*\[-1, 0\]"),
    (lambda: C.all_to_all(torch.randn(2, 3, 4, 6), MESH, AX, 0, -3), IndexError, r"concat_dim=-3"),
    (lambda: C.reduce_scatter(torch.randn(3), MESH, AX, 0), ValueError, r"shape \(3,\).*leading axis"),
    (lambda: C.all_reduce([1.0], MESH, AX), TypeError, r"all_reduce\(x=list\)"),
    (lambda: C.broadcast(torch.randn(2, 3, 4), MESH, AX, root=3), ValueError, r"root=3.*\[0, 2\]"),
    (lambda: C.reduce_scatter(torch.randn(2, 3, 4), MESH, AX, 0), ValueError, r"4 does not split.*Cells"),
])
def test_bad_arguments_name_argument_value_and_fix(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_axis_by_name_and_negative_dims():
    x = torch.randn(2, 3, 4, 6)
    torch.testing.assert_close(C.all_gather(x, MESH, "tp", -1), C.all_gather(x, MESH, AX, 1))
    torch.testing.assert_close(C.all_reduce(x, MESH, "tp"), x.sum(1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8])
@pytest.mark.parametrize("uneven", [False, True])
def test_integer_reductions_keep_dtype(dtype, uneven):
    # torch.sum turns int32 into int64; torch.distributed's all-reduce keeps int32
    x = torch.arange(2 * 3 * 6, dtype=dtype).reshape(2, 3, 6)
    if uneven:
        x = C.Cells((2, 3), [t[:k] for t, k in zip(x.reshape(6, 6).unbind(0), [6, 6, 6, 4, 4, 4])])
    for y in (C.all_reduce(x, MESH, AX), C.reduce_scatter(x, MESH, AX, 0)):
        ts = y.items if uneven else [y]
        assert all(t.dtype == dtype for t in ts)
