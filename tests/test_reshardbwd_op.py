"""The op's OWN gather of a sharded input: the backward communication DTensor's is.

When an op's strategy asks for Replicate from a sharded input (``F.linear(x, W)`` with
``x`` laid out ``[Shard(0)]`` and ``W`` row-sharded), the dispatcher gathers ``x`` and, where
the op's outputs diverge, gives every rank a view of the gathered copy.  We recorded the
views' gradient all-reduce and then a local slice (twice the bytes of a reduce-scatter),
once per op reading ``x``.  PyTorch DTensor runs that redistribute inside the op's
dispatch, below autograd (torch 2.13, git cf30153, torch/distributed/tensor/_dispatch.py):
the op's backward gives ``x`` a Partial gradient, autograd sums the uses' Partial
gradients, and what brings the sum to ``x``'s layout is one redistribution, P -> S(d): one
reduce-scatter (``reshard_backward.gather``).

The oracle: DTensor's backward on the same program under ``LocalTensorMode``, then its
gradient redistributed to the layout ours has (``x``'s placements, a Partial one read as
Replicate, as ``_redistribute_backward`` normalizes it where the gradient is not Partial:
_redistribute.py:1828-1833).  DTensor leaves a leaf's gradient Partial until something
consumes it; ours is laid out as its tensor (PyTorch's ``grad`` has its tensor's metadata),
so the consumer's redistribution is counted here.  Gradients are held to one device.
"""
from __future__ import annotations

import gc
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.dtensor_support import LocalTensorMode, distribute_tensor, oracle, to_dt  # noqa: F401
from tests.test_dtensor_ops_comm import CommRecorder
from tests.test_reshardbwd import _values

R, S, P = wb.Replicate, wb.Shard, wb.Partial
PROFILE = "a100"
X, W = (8, 16), (12, 16)
GATHERED = "grad of a gathered input"        # reshard_backward.gather's label


def _twice(y, w):
    return F.linear(y, w) + F.linear(y, w).relu()


def _as_weight(w, a):
    return F.linear(a, w)                 # x plays the weight: the op gathers a parameter


# (id, mesh, x's shape, x's placements, op, other inputs).  Before the fix the gathered
# cases recorded an all-reduce per op reading x (of the gathered bytes) where DTensor's
# gradient reduce-scatters once; the last one (S -> S') is an unchanged path, held.
CASES = [
    # S(d) -> R on one mesh dim, given every rank a view
    ("S0-linear-rowsharded", (4,), X, [S(0)], F.linear, [(W, [S(0)])]),
    ("S0-matmul-colsharded", (4,), X, [S(0)], torch.matmul, [((16, 12), [S(1)])]),
    ("S0-two-ops", (4,), X, [S(0)], _twice, [(W, [S(0)])]),
    # ... on two mesh dims: both gathered; one of two; one gathered + one replicated (f)
    ("S0S0-linear-both", (2, 2), X, [S(0), S(0)], F.linear, [(W, [S(0), S(0)])]),
    ("S1S1-linear-both", (2, 2), X, [S(1), S(1)], F.linear, [(W, [S(0), S(0)])]),
    ("S0S1-linear-tp", (2, 2), X, [S(0), S(1)], F.linear, [(W, [R(), S(0)])]),
    ("S1S0-linear-dp", (2, 2), X, [S(1), S(0)], F.linear, [(W, [S(0), R()])]),
    ("S0R-linear-both", (2, 2), X, [S(0), R()], F.linear, [(W, [S(0), S(0)])]),
    ("S1R-linear-both", (2, 2), X, [S(1), R()], F.linear, [(W, [S(0), S(0)])]),
    # S -> S': the op's all-to-all, its own reverse all-to-all back (unchanged)
    ("S1-mul-S0", (4,), X, [S(1)], torch.mul, [(X, [S(0)])]),
]


def _x(mesh, shape, src):
    xs = _values(shape, 0)
    if any(p.is_partial() for p in src):        # each rank a 1/n part: the sum is xs
        return wb.from_local([xs / mesh.size] * mesh.size, mesh, src)
    return wb.shard_tensor(xs, mesh, src)


def _ours(mesh_shape, shape, src, op, others):
    mesh = wb.Mesh.grid(mesh_shape, ["dp", "tp"][-len(mesh_shape):])
    x = _x(mesh, shape, src).requires_grad_()
    ins = [wb.shard_tensor(_values(s, k + 1), mesh, ps) for k, (s, ps) in enumerate(others)]
    with wb.trace(PROFILE) as tr:
        out = op(x, *ins)
        G = wb.shard_tensor(_values(out.shape, 9), mesh, list(out.placements))
        n = len(tr.collectives())
        (out * G).sum().backward()
    bwd = [e for e in tr.collectives()[n:] if 0 in e.ranks]
    return out, bwd, x.grad


def _reference(shape, op, others):
    xs = _values(shape, 0).requires_grad_()
    out = op(xs, *[_values(s, k + 1) for k, (s, _) in enumerate(others)])
    (out * _values(out.shape, 9)).sum().backward()
    return xs.grad


def _theirs(oracle, mesh_shape, shape, src, op, others):  # noqa: F811
    from torch.distributed.tensor import DTensor
    mesh = oracle.mesh(mesh_shape)
    with LocalTensorMode(math.prod(mesh_shape)):
        xs = _values(shape, 0)
        ps = [to_dt(p) for p in src]
        x = (DTensor.from_local(xs / math.prod(mesh_shape), mesh, ps, run_check=False)
             if any(p.is_partial() for p in src) else distribute_tensor(xs, mesh, ps))
        x = x.detach().requires_grad_()
        ins = [distribute_tensor(_values(s, k + 1), mesh, [to_dt(p) for p in ps])
               for k, (s, ps) in enumerate(others)]
        rec = CommRecorder()
        with rec:
            out = op(x, *ins)
            G = distribute_tensor(_values(out.shape, 9), mesh, out.placements)
            n = len(rec.log)
            (out * G).sum().backward()
            x.grad.redistribute(mesh, [to_dt(R() if p.is_partial() else p) for p in src])
        placements = tuple(out.placements)
    return placements, [(kind, buf) for kind, _, buf, _ in rec.log[n:]]


# where ours takes another strategy than DTensor's, cheaper over forward and backward: the
# output placements ours gives
CHEAPER = {"S1-mul-S0": (to_dt(S(1)),)}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_backward_collectives_as_dtensor(oracle, case):  # noqa: F811
    name, mesh_shape, shape, src, op, others = case
    t_ps, t_bwd = _theirs(oracle, mesh_shape, shape, src, op, others)
    from workbench.parallel.interop import to_dtensor_placements
    out, bwd, grad = _ours(mesh_shape, shape, src, op, others)
    if name in CHEAPER:
        # DTensor prices forward only: it moves x (all-to-all) and moves its gradient back
        # (the reverse all-to-all); ours prices an input's backward where it requires grad
        # (ops_table/strategy.backward_price) and moves the operand that does not: one
        # all-to-all in all, none in backward
        assert t_ps != to_dtensor_placements(out.placements) == CHEAPER[name]
        torch.testing.assert_close(grad.full(), _reference(shape, op, others), rtol=0, atol=0)
        assert grad.placements == tuple(src) and bwd == [] and len(t_bwd) == 1
        return
    assert to_dtensor_placements(out.placements) == t_ps     # the same op strategy
    torch.testing.assert_close(grad.full(), _reference(shape, op, others), rtol=0, atol=0)
    assert grad.placements == tuple(src)
    ours = Counter((e.name, e.args["buffer_bytes"]) for e in bwd)
    assert ours == Counter(t_bwd), (name, ours, t_bwd)


def test_gathered_weight_reduce_scatters_then_all_reduces_the_shard(oracle):  # noqa: F811
    """A weight laid out ``[R, S(0)]`` (replicated over dp, sharded over tp) that the op
    gathers, where the activations are sharded on both mesh dims: its gradient is Partial
    on both and goes back to ``[R, S(0)]``.  Before: an all-reduce of the whole gathered
    gradient on each mesh dim (768 B twice).  DTensor (_redistribute.py's transform order,
    mesh dim by mesh dim) all-reduces the whole gradient over dp, then reduce-scatters it
    over tp; our planner reduce-scatters over tp first and all-reduces the shard over dp,
    half the all-reduce's bytes: the order of FSDP2's HSDP (torch 2.13, git cf30153,
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:618-662, ``foreach_reduce``:
    reduce_scatter on the shard group, then all_reduce of its output on the replicate
    group).  The same two collectives; ours moves fewer bytes."""
    case = ((2, 2), W, [R(), S(0)], _as_weight, [((64, 16), [S(0), S(0)])])
    t_ps, t_bwd = _theirs(oracle, *case)
    out, bwd, grad = _ours(*case)
    from workbench.parallel.interop import to_dtensor_placements
    assert to_dtensor_placements(out.placements) == t_ps
    torch.testing.assert_close(grad.full(), _reference(*case[1:2], *case[3:]), rtol=0, atol=0)
    assert Counter(t_bwd) == Counter([("all_reduce", 768), ("reduce_scatter", 768)])
    assert [(e.name, e.args["mesh_dim"], e.args["buffer_bytes"]) for e in bwd] == \
        [("reduce_scatter", "tp", 768), ("all_reduce", "dp", 384)]
    assert all(e.label.startswith(GATHERED) for e in bwd)


def test_issue_repro_op_gather_reduce_scatters():
    """The brief's program: a plain ``x`` laid out ``[Shard(0)]`` into ``F.linear(x, W)``
    with ``W`` ``[Shard(0)]`` on a 4-rank tp mesh.  Backward recorded an all-reduce of the
    512 B gathered gradient (768 B sent per rank) then a local slice; DTensor's gradient
    is one reduce-scatter (384 B per rank)."""
    torch.manual_seed(0)
    m = wb.Mesh.grid(4, ["tp"])
    Xv, Wv = torch.randn(8, 16), torch.randn(12, 16)
    x = wb.shard_tensor(Xv, m, [S(0)]).requires_grad_()
    w = wb.shard_tensor(Wv, m, [S(0)])
    with wb.trace(PROFILE) as tr:
        y = F.linear(x, w)
        fwd = tr.counts()
        y.sum().backward()
    assert fwd == Counter(all_gather=1)
    assert tr.counts() - fwd == Counter(reduce_scatter=1)
    ev = [e for e in tr.collectives() if e.name == "reduce_scatter"]
    assert [e.bytes for e in ev] == [3 * 512 // 4]
    xr = Xv.clone().requires_grad_()
    F.linear(xr, Wv).sum().backward()
    torch.testing.assert_close(x.grad.full(), xr.grad)
    assert x.grad.placements == (S(0),)


def _qkv(x, ws):
    q, k, v = (F.linear(x, w) for w in ws)
    return (q * k + v).sum()


def test_three_ops_gathering_one_input_reduce_once():
    """q, k and v each gather the sequence-parallel input (three all-gathers forward, as
    DTensor runs them); autograd sums their Partial gradients first, so one reduce-scatter
    back (before: three all-reduces)."""
    m = wb.Mesh.grid(2, ["tp"])
    x = wb.shard_tensor(_values(X, 0), m, [S(0)]).requires_grad_()
    ws = [wb.shard_tensor(_values(W, k), m, [S(0)]) for k in (1, 2, 3)]
    with wb.trace(PROFILE) as tr:
        out = _qkv(x, ws)
        fwd = tr.counts()
        out.backward()
    assert fwd == Counter(all_gather=3)
    assert tr.counts() - fwd == Counter(reduce_scatter=1)
    xr = _values(X, 0).requires_grad_()
    _qkv(xr, [_values(W, k) for k in (1, 2, 3)]).backward()
    torch.testing.assert_close(x.grad.full(), xr.grad, rtol=0, atol=0)


def test_partial_source_keeps_its_all_reduce():
    """A Partial input the op all-reduces itself and gives every rank a view (forced: the
    rules here, as DTensor's, keep a linear op Partial instead).  DTensor's gradient comes
    back Partial and reads as Replicate in our layout (one all-reduce); ours records the
    views' all-reduce, as before: gather leaves Partial dims alone."""
    from workbench.parallel.dispatch import force_candidate
    m = wb.Mesh.grid(4, ["tp"])
    xs = _values(X, 0)
    x = wb.from_local([xs / 4] * 4, m, [P()]).requires_grad_()
    w = wb.shard_tensor(_values(W, 1), m, [S(0)])

    def pick(d):
        return next(c for c in d.candidates if c.strategy.inputs[0] == (R(),))
    with wb.trace(PROFILE) as tr:
        with force_candidate(pick):
            y = F.linear(x, w)
        assert tr.counts() == Counter(all_reduce=1) and y.placements == (S(1),)
        loss = (y * wb.shard_tensor(_values((8, 12), 9), m, [S(1)])).sum()
        fwd = tr.counts()
        loss.backward()
    assert tr.counts() - fwd == Counter(all_reduce=1)
    assert not any(e.label.startswith(GATHERED) for e in tr.collectives())
    xr = xs.clone().requires_grad_()
    (F.linear(xr, _values(W, 1)) * _values((8, 12), 9)).sum().backward()
    torch.testing.assert_close(x.grad.full(), xr.grad)
    assert x.grad.placements == (R(),)


def _step(a, w):
    """The gathered weight's backward collectives of one forward and backward."""
    with wb.trace(PROFILE) as tr:
        F.linear(a, w).sum().backward()
    return Counter(e.name for e in tr.collectives() if e.label.startswith(GATHERED))


def test_a_parameter_over_steps_and_micro_batches_reduces_once_per_backward():
    """The meeting point is kept per input while its local is unchanged: two micro-batches
    (two forwards, two backwards) record one reduce-scatter each, and an in-place update
    between uses (an optimizer step) starts a new one; the gradients are one device's."""
    m = wb.Mesh.grid(2, ["tp"])
    w_full, a_full = _values(W, 1), _values((32, 16), 0)
    w = wb.shard_tensor(w_full, m, [S(0)]).requires_grad_()     # the op gathers the weight
    a = wb.shard_tensor(a_full, m, [S(0)])
    wr = w_full.clone().requires_grad_()
    for k in range(4):
        assert _step(a, w) == Counter(reduce_scatter=1), k
        F.linear(a_full, wr).sum().backward()
        torch.testing.assert_close(w.grad.full(), wr.grad, rtol=0, atol=0)
        if k % 2:                      # an SGD step after two micro-batches
            with torch.no_grad():
                w.sub_(w.grad * 0.5)
                wr.sub_(wr.grad * 0.5)
            w.grad = wr.grad = None
    torch.testing.assert_close(w.full(), wr.detach(), rtol=0, atol=0)


def test_in_place_between_uses_and_no_grad():
    """An in-place write to the input between two ops that gather it: two meeting points
    (the first one's view cannot be read after its base changed), each reduce-scatters its
    own use's gradient, where DTensor sums first and reduces once (a limit the module
    docstring states); the gradient is one device's.  Under no_grad nothing is kept."""
    from workbench.parallel import reshard_backward as rb
    m = wb.Mesh.grid(2, ["tp"])
    x = wb.shard_tensor(_values(X, 0), m, [S(0)]).requires_grad_()
    w = wb.shard_tensor(_values(W, 1), m, [S(0)])
    with wb.trace(PROFILE) as tr:
        a = F.linear(x, w).sum()
        with torch.no_grad():
            x.mul_(2)
        (a + F.linear(x, w).sum()).backward()
    got = Counter(e.name for e in tr.collectives() if e.label.startswith(GATHERED))
    assert got == Counter(reduce_scatter=2)
    xr = _values(X, 0).requires_grad_()
    ar = F.linear(xr, _values(W, 1)).sum()
    with torch.no_grad():
        xr.mul_(2)
    (ar + F.linear(xr, _values(W, 1)).sum()).backward()
    torch.testing.assert_close(x.grad.full(), xr.grad, rtol=0, atol=0)
    n = len(rb._GATHERED)
    with torch.no_grad():
        F.linear(wb.shard_tensor(_values(X, 0), m, [S(0)]), w)
    assert len(rb._GATHERED) == n


def test_meeting_point_dies_with_its_input():
    """The kept meeting point holds the input's local, not the DistTensor: dropping the
    input drops it (no cycle for the collector to find)."""
    from workbench.parallel import reshard_backward as rb
    m = wb.Mesh.grid(2, ["tp"])
    w = wb.shard_tensor(_values(W, 1), m, [S(0)])
    gc.disable()
    try:
        x = wb.shard_tensor(_values(X, 0), m, [S(0)]).requires_grad_()
        y = F.linear(x, w)
        assert id(x) in rb._GATHERED
        key = id(x)
        del x, y
        assert key not in rb._GATHERED
    finally:
        gc.enable()
