"""The storage interface the dispatcher, pricing and the pipeline executor use: each
function is held to what the per-rank shards say (``DistTensor.local``), for the stacked
and the uneven (cells) form alike."""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import storage
from workbench.parallel.schedules.execute import run_pipeline

M4 = wb.Mesh.grid(4)
M22 = wb.Mesh.grid((2, 2), ("dp", "tp"))
X = torch.arange(30.).reshape(5, 6)


def layouts():
    return {"even": wb.shard_tensor(X, M22, [wb.Shard(1), wb.Replicate()]),
            "uneven": wb.shard_tensor(X, M22, [wb.Shard(0), wb.Shard(1)])}   # 5 rows: 3, 2


@pytest.mark.parametrize("kind", ["even", "uneven"])
def test_for_run_holds_every_rank_in_the_form_asked(kind):
    t = layouts()[kind]
    for even in ([True, False] if kind == "even" else [False]):
        loc = storage.for_run(t._local, M22, even)
        assert storage.form(loc, M22) == ("stacked" if even else "cells")
        for r in M22.ranks:
            assert torch.equal(storage.rank_view(loc, M22, r), t.local(r))


@pytest.mark.parametrize("kind", ["even", "uneven"])
def test_rank_bytes_is_the_largest_shard(kind):
    t = layouts()[kind]
    want = max(t.local(r).numel() for r in M22.ranks) * X.element_size()
    assert storage.rank_bytes(t._local, 2) == want
    assert want == (3 * 3 if kind == "uneven" else 5 * 3) * 4


@pytest.mark.parametrize("kind", ["even", "uneven"])
def test_with_tensors_swaps_the_tensors_and_keeps_the_form(kind):
    t = layouts()[kind]
    ts = [x * 2 for x in storage.tensors(t._local)]
    loc = storage.with_tensors(t._local, ts)
    assert storage.form(loc, M22) == storage.form(t._local, M22)
    for r in M22.ranks:
        assert torch.equal(storage.rank_view(loc, M22, r), 2 * t.local(r))


def test_run_per_cell_gives_each_cell_its_own_piece():
    t = layouts()["uneven"]
    rep = wb.shard_tensor(torch.tensor([10.]), M22, [wb.Replicate(), wb.Replicate()])
    seen = []

    def fn(c, args):
        x, r = args
        seen.append(c)
        assert x.shape[:2] == (1, 1) and r.shape == (1, 1, 1)
        return (x + r,)
    (out,) = storage.run_per_cell(fn, [t._local, rep._local], (2, 2), 1)
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in M22.ranks:
        assert torch.equal(storage.rank_view(out, M22, r), t.local(r) + 10)


def test_keep_first_replica_keeps_one_copy_and_checks_it():
    ps = (wb.Replicate(),)
    same = torch.arange(3.).expand(4, 3).clone()
    (o,) = storage.keep_first_replica((same,), (ps,), (torch.Size([3]),), [], M4, check=True)
    assert o.shape == (1, 3) and torch.equal(o[0], torch.arange(3.))
    differ = torch.arange(12.).reshape(4, 3)
    with pytest.raises(AssertionError, match="announced Replicate on mesh dim"):
        storage.keep_first_replica((differ,), (ps,), (torch.Size([3]),), [], M4, check=True)
    (o,) = storage.keep_first_replica((differ,), (ps,), (torch.Size([3]),), [], M4)
    assert torch.equal(o, differ[:1])
    # cells of a layout that is even are stacked again
    cells = storage.to_cells(differ, 1)
    (o,) = storage.keep_first_replica((cells,), ((wb.Shard(0),),), (torch.Size([12]),), [], M4)
    assert storage.form(o, M4) == "stacked" and torch.equal(o, differ)


def test_replicated_operand_is_a_view_and_from_global_a_copy():
    x = torch.randn(3, 2)
    assert storage.replicated(x, M22).data_ptr() == x.data_ptr()
    assert storage.from_global(x, M22).data_ptr() != x.data_ptr()


def test_uneven_chain_prices_its_backward_and_matches_one_device():
    A = torch.randn(7, 5)
    a = wb.shard_tensor(A, M4, [wb.Shard(0)]).requires_grad_()     # 7 rows: 2, 2, 2, 1
    assert not a.is_even
    with wb.trace() as tr:
        y = (torch.tanh(a) * 3).sum()
        y.backward()
    ref = A.clone().requires_grad_()
    (torch.tanh(ref) * 3).sum().backward()
    torch.testing.assert_close(a.grad.full(), ref.grad)
    back = [e.name for e in tr.events if e.stream == "compute" and e.label == "backward"]
    assert "tanh" in back and "mul" in back


def test_split_backward_reaches_uneven_weights():
    """zb_h1's W step computes the weight gradients of parameters held as cells."""
    g = torch.Generator().manual_seed(0)
    W, B = torch.randn(8, 8, generator=g) / 3, torch.randn(8, generator=g) / 3
    Xs, T = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    p, m = 2, 2
    meshes = [wb.Mesh([3 * r, 3 * r + 1, 3 * r + 2], ["tp"]) for r in range(p)]
    params, stages = [], []
    for s in range(p):
        mesh = meshes[s]
        dw = wb.shard_tensor(W, mesh, [wb.Shard(0)]).requires_grad_()   # 8 rows on 3: uneven
        db = wb.shard_tensor(B, mesh, [wb.Shard(0)]).requires_grad_()
        assert not dw.is_even
        params.append([dw, db])
        stages.append(lambda x, dw=dw, db=db, mesh=mesh:
                      wb.reshard(torch.tanh(F.linear(x, dw, db)), mesh, [wb.Replicate()]))
    xs = [wb.shard_tensor(c, meshes[0], [wb.Replicate()]) for c in Xs.chunk(m)]
    ts = T.chunk(m)
    loss_fn = lambda out, i: ((out - wb.shard_tensor(ts[i], meshes[-1], [wb.Replicate()])) ** 2).mean()  # noqa: E731
    run = run_pipeline(wb.schedules.zb_h1(p, m), stages, meshes, xs, loss_fn, params=params)
    ws = [(W.clone().requires_grad_(), B.clone().requires_grad_()) for _ in range(p)]
    h = Xs
    for w, b in ws:
        h = torch.tanh(F.linear(h, w, b))
    loss = ((h - T) ** 2).mean()
    loss.backward()
    assert run.loss == pytest.approx(loss.item(), rel=1e-5)
    for (dw, db), (w, b) in zip(params, ws):
        torch.testing.assert_close(dw.grad.full(), w.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(db.grad.full(), b.grad, rtol=1e-5, atol=1e-6)


# ---- the row-parallel linear's backward: one GEMM when the gradient is the same ---------

@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("loss", ["sum", "weighted"])
def test_row_parallel_linear_gradients_match_one_device(loss, traced):
    # "sum": the output gradient is the same on every rank (held once: the single-GEMM
    # backward; traced, it comes through the all-reduce's backward); "weighted": a product
    # with a replicated tensor first, whose gradient arrives computed per rank (torch's
    # bmm backward)
    g = torch.Generator().manual_seed(3)
    X, W = torch.randn(6, 8, generator=g), torch.randn(5, 8, generator=g)
    R = torch.randn(6, 5, generator=g)
    mesh = wb.Mesh.grid(4, ["tp"])
    x = wb.shard_tensor(X, mesh, [wb.Shard(1)]).requires_grad_()
    w = wb.shard_tensor(W, mesh, [wb.Shard(1)]).requires_grad_()
    a, b = X.clone().requires_grad_(), W.clone().requires_grad_()
    y, y1 = F.linear(x, w), F.linear(a, b)
    assert y.placements == (wb.Partial(),)
    if loss == "weighted":
        y, y1 = y * wb.shard_tensor(R, mesh, [wb.Replicate()]), y1 * R
    if traced:
        with wb.trace():
            y.sum().backward()
    else:
        y.sum().backward()
    y1.sum().backward()
    torch.testing.assert_close(x.grad.full(), a.grad)
    torch.testing.assert_close(w.grad.full(), b.grad)
    assert x.grad.placements == w.grad.placements == (wb.Shard(1),)
