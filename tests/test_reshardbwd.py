"""A user's reshard followed by an op: the backward communication DTensor's is.

PyTorch DTensor's ``Redistribute.backward`` redistributes the gradient, in whatever
placements the op's backward gave it, back to the input's placements
(torch/distributed/tensor/_redistribute.py, ``_redistribute_backward``, torch 2.13).  After
``reshard(x, [Replicate()])`` of a ``Shard(1)`` input, a linear with a row-sharded weight
gives a Partial gradient: one reduce-scatter.  We recorded the all-reduce of the
dispatcher's per-rank views and then a local slice (same numbers, twice the bytes), an
all-gather where the op sliced the gathered copy to another dim (DTensor: one all-to-all;
to the source's dim: nothing),
and one all-reduce per op reading the gathered tensor (DTensor: one reduce-scatter after
autograd summed the gradients).  ``workbench/parallel/reshard_backward.py`` records the
redistribution once.

Each case holds the gradient to one device, and the backward's collectives (kind, buffer
bytes) to DTensor's run on the same program under ``LocalTensorMode`` (``dtensor_support``).
The loss is ``(out * G).sum()`` with ``G`` laid out as ``out``, on both sides, so that the
gradient reaching the op has the op's output placements (a bare ``out.sum()`` gives DTensor a
Replicate gradient from its Partial scalar, where ours keeps the shards).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.dtensor_support import LocalTensorMode, distribute_tensor, oracle, to_dt  # noqa: F401
from tests.test_dtensor_ops_comm import CommRecorder

R, S, P = wb.Replicate, wb.Shard, wb.Partial
PROFILE = "a100"
X, W = (8, 16), (12, 16)


def _twice(y, w):
    return F.linear(y, w) + F.linear(y, w).relu()


# (id, mesh, source, target, op, other inputs); all but the last five (unchanged paths)
# recorded other collectives than DTensor before the fix
CASES = [
    # S(d) -> R, then an op that gives every rank its own view (Partial gradient)
    ("S1-R-linear-rowsharded", (4,), [S(1)], [R()], F.linear, [(W, [S(0)])]),
    ("S0-R-linear-rowsharded", (4,), [S(0)], [R()], F.linear, [(W, [S(0)])]),
    ("S1-R-matmul-colsharded", (4,), [S(1)], [R()], torch.matmul, [((16, 12), [S(1)])]),
    ("S1-R-two-ops", (4,), [S(1)], [R()], _twice, [(W, [S(0)])]),
    # ... on two mesh dims: both gathered, one of them used per rank, one gathered + one R
    ("S0S1-RR-linear-both", (2, 2), [S(0), S(1)], [R(), R()], F.linear, [(W, [S(0), S(0)])]),
    ("S1S1-RR-linear-both", (2, 2), [S(1), S(1)], [R(), R()], F.linear, [(W, [S(0), S(0)])]),
    ("S0S1-RR-linear-tp", (2, 2), [S(0), S(1)], [R(), R()], F.linear, [(W, [R(), S(0)])]),
    ("S0S1-S0R-linear-tp", (2, 2), [S(0), S(1)], [S(0), R()], F.linear, [(W, [R(), S(0)])]),
    ("S0R-RR-linear-both", (2, 2), [S(0), R()], [R(), R()], F.linear, [(W, [S(0), S(0)])]),
    # S(d) -> R, then an op that slices it to another dim: all-to-all back
    ("S1-R-mul-S0", (4,), [S(1)], [R()], torch.mul, [(X, [S(0)])]),
    ("S0S1-RR-mul-S1S0", (2, 2), [S(0), S(1)], [R(), R()], torch.mul, [(X, [S(1), S(0)])]),
    # ... or slices it back to the source's dim: nothing moves (we all-gathered)
    ("S1-R-mul-S1", (4,), [S(1)], [R()], torch.mul, [(X, [S(1)])]),
    # unchanged paths, held: the op uses the one copy (a local slice back); S -> S'
    # (all-to-all back); R -> S (all-gather back); P -> S (all-gather back)
    ("S1-R-linear-replicated", (4,), [S(1)], [R()], F.linear, [(W, [R()])]),
    ("S1-S0-linear", (4,), [S(1)], [S(0)], F.linear, [(W, [R()])]),
    ("R-S0-linear", (4,), [R()], [S(0)], F.linear, [(W, [R()])]),
    ("R-S1-relu", (4,), [R()], [S(1)], torch.relu, []),
    ("P-S0-linear", (4,), [P()], [S(0)], F.linear, [(W, [R()])]),
]


def _values(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).float()     # small integers: sums exact


def _ours(mesh_shape, src, dst, op, others):
    names = ["dp", "tp"][-len(mesh_shape):]
    mesh = wb.Mesh.grid(mesh_shape, names)
    xs = _values(X, 0)
    if any(p.is_partial() for p in src):        # (1-d) each rank a quarter: the sum is xs
        x = wb.from_local([xs / 4] * mesh.size, mesh, src)
    else:
        x = wb.shard_tensor(xs, mesh, src)
    x.requires_grad_()
    ins = [wb.shard_tensor(_values(s, k + 1), mesh, ps) for k, (s, ps) in enumerate(others)]
    with wb.trace(PROFILE) as tr:
        y = wb.reshard(x, mesh, dst)
        out = op(y, *ins)
        G = wb.shard_tensor(_values(out.shape, 9), mesh, list(out.placements))
        n = len(tr.collectives())
        (out * G).sum().backward()
    bwd = [(e.name, e.args["buffer_bytes"]) for e in tr.collectives()[n:] if 0 in e.ranks]
    return out, bwd, x.grad


def _reference(op, others):
    xs = _values(X, 0).requires_grad_()
    out = op(xs, *[_values(s, k + 1) for k, (s, _) in enumerate(others)])
    (out * _values(out.shape, 9)).sum().backward()
    return xs.grad


def _theirs(oracle, mesh_shape, src, dst, op, others):  # noqa: F811
    mesh = oracle.mesh(mesh_shape)
    with LocalTensorMode(int(torch.tensor(mesh_shape).prod())):
        xs = _values(X, 0)
        if any(p.is_partial() for p in src):
            from torch.distributed.tensor import DTensor
            x = DTensor.from_local(xs / 4, mesh, [to_dt(p) for p in src], run_check=False)
        else:
            x = distribute_tensor(xs, mesh, [to_dt(p) for p in src])
        x = x.detach().requires_grad_()
        ins = [distribute_tensor(_values(s, k + 1), mesh, [to_dt(p) for p in ps])
               for k, (s, ps) in enumerate(others)]
        rec = CommRecorder()
        with rec:
            out = op(x.redistribute(mesh, [to_dt(p) for p in dst]), *ins)
            G = distribute_tensor(_values(out.shape, 9), mesh, out.placements)
            n = len(rec.log)
            (out * G).sum().backward()
        placements = tuple(out.placements)
    return placements, [(kind, buf) for kind, _, buf, _ in rec.log[n:]]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_backward_collectives_as_dtensor(oracle, case):  # noqa: F811
    name, mesh_shape, src, dst, op, others = case
    t_ps, t_bwd = _theirs(oracle, mesh_shape, src, dst, op, others)
    from workbench.parallel.interop import to_dtensor_placements
    out, bwd, grad = _ours(mesh_shape, src, dst, op, others)
    assert to_dtensor_placements(out.placements) == t_ps     # the same op strategy
    torch.testing.assert_close(grad.full(), _reference(op, others), rtol=0, atol=0)
    assert Counter(bwd) == Counter(t_bwd), (name, bwd, t_bwd)


def test_issue_repro_reduce_scatter_not_all_reduce():
    """The review's program (notebook 06's browser review): backward recorded an all-reduce
    of the 512 B input gradient (768 B per rank), DTensor reduce-scatters it (384 B)."""
    torch.manual_seed(0)
    m = wb.Mesh.grid(4, ["tp"])
    Xv, Wv = torch.randn(8, 16), torch.randn(12, 16)
    x = wb.shard_tensor(Xv, m, [S(1)]).requires_grad_()
    w = wb.shard_tensor(Wv, m, [S(0)])
    with wb.trace(PROFILE) as tr:
        y = F.linear(wb.reshard(x, m, [R()]), w)
        fwd = tr.counts()
        y.sum().backward()
    bwd = tr.counts() - fwd
    assert bwd == Counter(reduce_scatter=1)             # one tp group of 4
    ev = [e for e in tr.collectives() if e.name == "reduce_scatter"]
    assert [e.bytes for e in ev] == [3 * 512 // 4]       # (p-1)/p of the 512 B gradient
    xr = Xv.clone().requires_grad_()
    F.linear(xr, Wv).sum().backward()
    torch.testing.assert_close(x.grad.full(), xr.grad)
    assert x.grad.placements == (S(1),)


def test_three_ops_reading_one_gathered_tensor_reduce_once():
    """q, k, v from one gathered input: autograd sums the three gradients, one reduce-scatter
    (before: three all-reduces)."""
    m = wb.Mesh.grid(2, ["tp"])
    x = wb.shard_tensor(_values(X, 0), m, [S(0)]).requires_grad_()
    ws = [wb.shard_tensor(_values(W, k), m, [S(0)]) for k in (1, 2, 3)]
    with wb.trace(PROFILE) as tr:
        y = wb.reshard(x, m, [R()])
        out = sum(F.linear(y, w).sum() for w in ws)
        fwd = tr.counts()
        out.backward()
    assert tr.counts() - fwd == Counter(reduce_scatter=1)
    xr = _values(X, 0).requires_grad_()
    sum(F.linear(xr, _values(W, k)).sum() for k in (1, 2, 3)).backward()
    torch.testing.assert_close(x.grad.full(), xr.grad, rtol=0, atol=0)


def test_partial_source_keeps_its_all_reduce():
    """P -> R, then an op with per-rank views: DTensor leaves the gradient Partial (no
    collective; the op that made the Partial value reduces it in its own backward rule);
    here the local backward of that op needs the whole gradient, so it is all-reduced
    once, and the leaf's gradient is Replicate (reshard_backward.py's docstring)."""
    m = wb.Mesh.grid(4, ["tp"])
    xs = _values(X, 0)
    x = wb.from_local([xs / 4] * 4, m, [P()]).requires_grad_()
    w = wb.shard_tensor(_values(W, 1), m, [S(0)])
    with wb.trace(PROFILE) as tr:
        y = F.linear(wb.reshard(x, m, [R()]), w)
        fwd = tr.counts()
        y.sum().backward()
    assert tr.counts() - fwd == Counter(all_reduce=1)
    xr = xs.clone().requires_grad_()
    F.linear(xr, _values(W, 1)).sum().backward()
    torch.testing.assert_close(x.grad.full(), xr.grad)


def test_no_grad_marks_nothing_and_no_trace_same_gradient():
    """Under no_grad nothing is marked; without a trace nothing is recorded and the
    gradient is one device's."""
    m = wb.Mesh.grid(4, ["tp"])
    x = wb.shard_tensor(_values(X, 0), m, [S(1)])
    w = wb.shard_tensor(_values(W, 1), m, [S(0)])
    with torch.no_grad():
        y = wb.reshard(x, m, [R()])
    assert wb.parallel.reshard_backward.KEY not in y._local.__dict__
    x.requires_grad_()
    F.linear(wb.reshard(x, m, [R()]), w).sum().backward()
    xr = _values(X, 0).requires_grad_()
    F.linear(xr, _values(W, 1)).sum().backward()
    torch.testing.assert_close(x.grad.full(), xr.grad, rtol=0, atol=0)
