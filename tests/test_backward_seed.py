"""backward() from a Partial value seeds each rank's partial directly, as torch does
(DDP: each rank backprops its own loss; DTensor: ``ones_like`` of a Partial is Replicate
without communication): d sum/d x_i = g, d avg/d x_i = g/n.  A max / min Partial is
reduced first (which rank wins needs the reduced value).  Every gradient is held to one
device: the global value is built from the same per-rank leaves in plain torch."""
import itertools

import pytest
import torch

import workbench as wb
from workbench.parallel import storage

P, R, S = wb.Partial, wb.Replicate, wb.Shard
M4 = wb.Mesh.grid((4,), ("dp",))
M23 = wb.Mesh.grid((2, 3), ("dp", "tp"))


def reference_global(leaves, mesh, ps):
    """The global tensor in plain torch from every rank's leaf (a dict coord -> tensor),
    combining the last mesh axis first: Partial -> its reduction, Shard(d) -> cat on d,
    Replicate -> the first copy."""
    cur = dict(leaves)
    for i in reversed(range(mesh.ndim)):
        nxt = {}
        for c in {k[:i] for k in cur}:
            parts = [cur[c + (j,)] for j in range(mesh.shape[i])]
            p = ps[i]
            if p.is_partial():
                st = torch.stack(parts)
                nxt[c] = {"sum": st.sum(0), "avg": st.mean(0), "max": st.amax(0),
                          "min": st.amin(0)}[p.reduce_op]
            elif p.is_shard():
                nxt[c] = torch.cat(parts, p.dim)
            else:
                nxt[c] = parts[0]
        cur = nxt
    return cur[()]


def build(mesh, ps, shape, seed):
    """A leaf DistTensor from distinct per-rank locals (asymmetric partials: no ties) and
    the same locals as plain leaves for the reference."""
    g = torch.Generator().manual_seed(seed)
    glob = torch.randn(shape, generator=g, dtype=torch.float64)
    # the local shapes torch.chunk gives; Partial locals differ per rank, Replicate copies agree
    leaves = {}
    for r in mesh.ranks:
        c = tuple(mesh.coordinate(r))
        first = tuple(0 if p.is_replicate() else ci for p, ci in zip(ps, c))
        if first in leaves:
            leaves[c] = leaves[first]
            continue
        local = wb.shard_tensor(glob, mesh, [R() if p.is_partial() else p for p in ps]).local(r)
        leaves[c] = local + torch.randn(local.shape, generator=g, dtype=torch.float64) \
            if any(p.is_partial() for p in ps) else local.clone()
    x = wb.from_local([leaves[tuple(mesh.coordinate(r))] for r in mesh.ranks], mesh, ps)
    x.requires_grad_()
    ref = {c: t.clone().requires_grad_() for c, t in leaves.items()
           if all(ci == 0 or not p.is_replicate() for p, ci in zip(ps, c))}
    full = {c: ref[tuple(0 if p.is_replicate() else ci for p, ci in zip(ps, c))]
            for c in leaves}
    return x, ref, full


def check_grads(x, ref, mesh, ps):
    for r in mesh.ranks:
        c = tuple(mesh.coordinate(r))
        want = ref[tuple(0 if p.is_replicate() else ci for p, ci in zip(ps, c))].grad
        torch.testing.assert_close(x.grad.local(r), want, msg=f"rank {r} {ps}")


CASES = [
    (M4, [P("sum")], (4, 6)), (M4, [P("avg")], (4, 6)), (M4, [P("max")], (4, 6)),
    (M4, [P("min")], (4, 6)), (M4, [S(0)], (4, 6)), (M4, [R()], (4, 6)),
    (M23, [P("sum"), S(1)], (4, 6)), (M23, [S(0), P("avg")], (4, 6)),
    (M23, [P("sum"), R()], (4, 6)), (M23, [R(), P("sum")], (4, 6)),
    (M23, [P("sum"), P("sum")], (4, 6)), (M23, [P("avg"), P("avg")], (4, 6)),
    (M23, [P("max"), S(1)], (4, 6)), (M23, [R(), P("min")], (4, 6)),
    (M23, [S(0), P("sum")], (5, 6)),            # uneven rows (3, 2): held as cells
    (M23, [P("avg"), S(1)], (4, 7)),            # uneven columns (3, 3, 1)
]


def ids(case):
    mesh, ps, shape = case
    return f"{mesh.ndim}d-{'-'.join(str(p) for p in ps)}-{'x'.join(map(str, shape))}"


@pytest.mark.parametrize("case", CASES, ids=[ids(c) for c in CASES])
@pytest.mark.parametrize("given", ["tensor", "dist"])
def test_gradient_given_matches_one_device_and_sends_nothing_for_sum_avg(case, given):
    mesh, ps, shape = case
    x, ref, full = build(mesh, ps, shape, seed=len(ps) * 7 + shape[1])
    G = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (reference_global(full, mesh, ps) * G).sum().backward()
    grad = G if given == "tensor" else wb.shard_tensor(G, mesh, [R()] * mesh.ndim)
    with wb.trace() as tr:
        x.backward(grad)
    check_grads(x, ref, mesh, ps)
    reduced = [p for p in ps if p.is_partial() and p.reduce_op in ("max", "min")]
    names = [e.name for e in tr.collectives()]
    if reduced:
        assert "all_reduce" in names         # which rank holds the max needs the max
    else:
        assert names == [], f"the seed sent {names}"


SCALAR_CASES = [(M4, [P("sum")]), (M4, [P("avg")]), (M4, [P("max")]),
                (M23, [P("sum"), R()]), (M23, [R(), P("avg")]), (M23, [P("sum"), P("sum")]),
                (M23, [P("avg"), P("avg")]), (M23, [P("min"), R()])]


@pytest.mark.parametrize("case", SCALAR_CASES,
                         ids=[f"{m.ndim}d-{'-'.join(map(str, ps))}" for m, ps in SCALAR_CASES])
@pytest.mark.parametrize("retain", [None, True])
def test_scalar_backward_matches_one_device_and_sends_nothing_for_sum_avg(case, retain):
    mesh, ps = case
    x, ref, full = build(mesh, ps, (), seed=11)
    reference_global(full, mesh, ps).backward()
    with wb.trace() as tr:           # retain_graph: the general path (_seed), else the fast one
        x.backward(retain_graph=retain)
    check_grads(x, ref, mesh, ps)
    names = [e.name for e in tr.collectives()]
    if any(p.reduce_op in ("max", "min") for p in ps if p.is_partial()):
        assert "all_reduce" in names
    else:
        assert names == [], f"the seed sent {names}"


def test_autograd_grad_seeds_partial_without_communication():
    x, ref, full = build(M23, [P("sum"), S(1)], (4, 6), seed=5)
    G = torch.randn(4, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (reference_global(full, M23, [P("sum"), S(1)]) * G).sum().backward()
    with wb.trace() as tr:
        (gx,) = torch.autograd.grad(x, x, G)
    assert tr.collectives() == []
    for r in M23.ranks:
        c = tuple(M23.coordinate(r))
        torch.testing.assert_close(gx.local(r), ref[c].grad)


def test_ddp_style_loss_backward_sends_only_the_weight_gradient():
    """The data-parallel loss (a sum over the batch shards: Partial over dp) backprops on
    every rank without the 4-byte all-reduce; the one collective is the replicated
    weight's gradient all-reduce.  Gradients as one device."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(8, 5, generator=g)
    W = torch.randn(5, 3, generator=g)
    Wr = W.clone().requires_grad_()
    (X @ Wr).square().mean().backward()
    x = wb.shard_tensor(X, M4, [S(0)])
    w = wb.shard_tensor(W, M4, [R()]).requires_grad_()
    loss = (x @ w).square().mean()
    assert loss.placements[0].is_partial()
    with wb.trace() as tr:
        loss.backward()
    torch.testing.assert_close(w.grad.full(), Wr.grad)
    ev = tr.collectives()
    assert [e.name for e in ev] == ["all_reduce"] and ev[0].bytes > 4 * 3, \
        [(e.name, e.bytes) for e in ev]


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_seed_like_spreads_partial_axes_and_keeps_first_copy_on_replicated(op):
    g = torch.arange(1., 3.).reshape(1, 1, 2)           # lead (1, 1): one copy
    like = torch.zeros(2, 3, 2)                         # per-rank along both axes
    out = storage.seed_like(g, like, M23, (P(op), R()))
    share = 2 if op == "avg" else 1
    want = torch.zeros(2, 3, 2)
    want[:, 0] = g[0, 0] / share                        # every dp rank, first tp copy
    assert torch.equal(out, want)
