"""The pipeline executor: every schedule gives single-device gradients."""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.schedules.execute import run_pipeline

S = wb.schedules


def make(n_stages, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g) / 3, torch.randn(8, generator=g) / 3)
            for _ in range(n_stages)]


def single_device(weights, X, T):
    ws = [(w.clone().requires_grad_(), b.clone().requires_grad_()) for w, b in weights]
    h = X
    for i, (w, b) in enumerate(ws):
        h = F.linear(h, w, b)
        if i < len(ws) - 1:
            h = torch.tanh(h)
    loss = ((h - T) ** 2).mean()
    loss.backward()
    return loss, [(w.grad, b.grad) for w, b in ws]


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 4, 1), ("1f1b", 4, 8, 1),
                                        ("interleaved", 2, 4, 2), ("zb_h1", 4, 6, 1)])
def test_schedule_executor_matches_single_device(name, p, m, v):
    sched = {"gpipe": lambda: S.gpipe(p, m), "1f1b": lambda: S.one_f_one_b(p, m),
             "interleaved": lambda: S.interleaved_1f1b(p, m, v),
             "zb_h1": lambda: S.zb_h1(p, m)}[name]()
    n = p * v
    weights = make(n)
    X, T = torch.randn(4 * m, 8), torch.randn(4 * m, 8)
    ref_loss, ref_grads = single_device(weights, X, T)

    meshes = [wb.Mesh([r], ["pp"]) for r in range(p)]
    params, stages = [], []
    for s, (w, b) in enumerate(weights):
        mesh = meshes[s % p]
        dw = wb.shard_tensor(w, mesh, [wb.Replicate()]).requires_grad_()
        db = wb.shard_tensor(b, mesh, [wb.Replicate()]).requires_grad_()
        params.append([dw, db])
        last = s == n - 1
        stages.append(lambda x, dw=dw, db=db, last=last:
                      F.linear(x, dw, db) if last else torch.tanh(F.linear(x, dw, db)))
    xs = [wb.shard_tensor(c, meshes[0], [wb.Replicate()]) for c in X.chunk(m)]
    ts = T.chunk(m)
    last_mesh = meshes[(n - 1) % p]
    loss_fn = lambda out, i: ((out - wb.shard_tensor(ts[i], last_mesh, [wb.Replicate()])) ** 2).mean()
    with wb.trace() as tr:
        run = run_pipeline(sched, stages, meshes, xs, loss_fn, params=params)
    assert run.loss == pytest.approx(ref_loss.item(), rel=1e-5)
    for (dw, db), (gw, gb) in zip(params, ref_grads):
        torch.testing.assert_close(dw.grad.full(), gw, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(db.grad.full(), gb, rtol=1e-5, atol=1e-6)
    sends = [e for e in tr.collectives() if e.name == "send_recv"]
    assert len(sends) == 2 * m * (n - 1)              # one activation and one gradient per edge
    assert tr.time() > 0
