"""A REPLICATED input read per rank by several ops: one gradient reduction, as DTensor's.

``x`` replicated over tp and read by column-parallel linears (q, k and v; gate and up of a
SwiGLU): each op's backward gives ``x`` a Partial gradient.  We recorded one all-reduce per
reader (each reader's ``expand_replicas``).  PyTorch DTensor (torch 2.13) sums the
readers' Partial gradients without communication (``P + P -> P``, a linear pointwise
rule) and reduces once where the placement is needed; Megatron-LM's one fused QKV / fc1
has one ``copy_to_tensor_model_parallel_region`` whose backward all-reduces once
(megatron/core/tensor_parallel/mappings.py, ``_CopyToModelParallelRegion.backward``).
``reshard_backward.gather`` now gives such an input one identity node where the readers
meet (as for a gathered shard).

The oracle: DTensor's backward under ``LocalTensorMode`` and its gradient redistributed to
``x``'s layout (``tests/test_reshardbwd_op.py`` explains that normalization).  Values in
float64, held exactly to one device.
"""
from __future__ import annotations

import math
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


def _values(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _qkv(x, wq, wk, wv):
    return F.linear(x, wq) * F.linear(x, wk) + F.linear(x, wv)


def _swiglu(x, wg, wu):
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def _relu_then_qkv(x, wq, wk, wv):
    return _qkv(x.relu(), wq, wk, wv)      # an intermediate read three times


# (id, mesh, x's placements, op, the weights' shape and placements).  Before the fix each
# recorded one all-reduce of x's gradient per reader.
CASES = [
    ("R-qkv", (4,), [R()], _qkv, [(W, [S(0)])] * 3),
    ("R-swiglu", (4,), [R()], _swiglu, [(W, [S(0)])] * 2),
    ("R-relu-qkv", (4,), [R()], _relu_then_qkv, [(W, [S(0)])] * 3),
    ("S0R-qkv-tp", (2, 2), [S(0), R()], _qkv, [(W, [R(), S(0)])] * 3),
    ("RR-qkv-both", (2, 2), [R(), R()], _qkv, [(W, [S(0), S(0)])] * 3),
]


def _ours(mesh_shape, src, op, others):
    mesh = wb.Mesh.grid(mesh_shape, ["dp", "tp"][-len(mesh_shape):])
    x = wb.shard_tensor(_values(X, 0), mesh, src).requires_grad_()
    ins = [wb.shard_tensor(_values(s, k + 1), mesh, ps) for k, (s, ps) in enumerate(others)]
    with wb.trace(PROFILE) as tr:
        out = op(x, *ins)
        G = wb.shard_tensor(_values(out.shape, 9), mesh, list(out.placements))
        n = len(tr.collectives())
        (out * G).sum().backward()
    bwd = [e for e in tr.collectives()[n:] if 0 in e.ranks]
    return out, bwd, x.grad


def _reference(op, others):
    xs = _values(X, 0).requires_grad_()
    out = op(xs, *[_values(s, k + 1) for k, (s, _) in enumerate(others)])
    (out * _values(out.shape, 9)).sum().backward()
    return out.detach(), xs.grad


def _theirs(oracle, mesh_shape, src, op, others):  # noqa: F811
    mesh = oracle.mesh(mesh_shape)
    with LocalTensorMode(math.prod(mesh_shape)):
        x = distribute_tensor(_values(X, 0), mesh, [to_dt(p) for p in src])
        x = x.detach().requires_grad_()
        ins = [distribute_tensor(_values(s, k + 1), mesh, [to_dt(p) for p in ps])
               for k, (s, ps) in enumerate(others)]
        rec = CommRecorder()
        with rec:
            out = op(x, *ins)
            G = distribute_tensor(_values(out.shape, 9), mesh, out.placements)
            n = len(rec.log)
            (out * G).sum().backward()
            x.grad.redistribute(mesh, [to_dt(p) for p in src])
        placements = tuple(out.placements)
    return placements, [(kind, buf) for kind, _, buf, _ in rec.log[n:]]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_reduction_per_replicated_input(oracle, case):  # noqa: F811
    name, mesh_shape, src, op, others = case
    t_ps, t_bwd = _theirs(oracle, mesh_shape, src, op, others)
    from workbench.parallel.interop import to_dtensor_placements
    out, bwd, grad = _ours(mesh_shape, src, op, others)
    assert to_dtensor_placements(out.placements) == t_ps       # the same op strategies
    ref_out, ref_grad = _reference(op, others)
    torch.testing.assert_close(out.full(), ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad.full(), ref_grad, rtol=1e-12, atol=1e-12)
    assert grad.placements == tuple(src)
    ours = Counter((e.name, e.args["buffer_bytes"]) for e in bwd)
    assert ours == Counter(t_bwd), (name, ours, t_bwd)


def test_reduced_after_every_reader():
    """The one all-reduce is recorded after the last reader's backward kernel (the
    gradients are summed first), not after the first one."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    x = wb.shard_tensor(_values(X, 0), mesh, [R()]).requires_grad_()
    ws = [wb.shard_tensor(_values(W, k + 1), mesh, [S(0)]) for k in range(3)]
    with wb.trace(PROFILE) as tr:
        out = _qkv(x, *ws)
        n = len(tr.events)
        out.sum().backward()
    ev = [e for e in tr.events[n:] if 0 in e.ranks]
    linear_bwd = [k for k, e in enumerate(ev) if e.stream != "comm" and "linear" in e.name]
    red = [k for k, e in enumerate(ev) if e.name == "all_reduce"]
    assert len(linear_bwd) == 3 and len(red) == 1, [(e.name, e.label) for e in ev]
    assert red[0] > max(linear_bwd)


# ---- compiled programs record what eager records ----------------------------------------

class _QKV(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.nn.Linear(256, 1024, bias=False, dtype=torch.float64)
                                  for _ in range(3))

    def forward(self, x):
        return self.q(x) * self.k(x) + self.v(x)


@pytest.mark.parametrize("src", [[R()], [S(0)]], ids=["R", "S0"])
def test_compiled_records_and_prices_what_eager_records(src):
    """Column-parallel q, k, v reading one input, replicated or sharded: eager records one
    reduction of its gradient (an all-reduce; a reduce-scatter for the op's own gather).
    Before, the compiled program ran and priced one all-reduce per reader (3 x 8,192 B:
    for S(0), where eager reduce-scatters once), and the search's estimate priced
    likewise.  Now the run, its schedule and the search's estimate are eager's."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    x_plain = _values((4, 256), 5)
    runs = []
    for level in (None, "O1"):
        m = wb.parallelize(_QKV(), mesh, {k: "colwise" for k in ("q", "k", "v")})
        x = wb.shard_tensor(x_plain, mesh, src).requires_grad_()
        f = m if level is None else wb.compile(m, x, level=level, profile=PROFILE)
        with wb.trace(PROFILE) as tr:
            out = f(x)
            n = len(tr.collectives())
            out.sum().backward()
        runs.append((Counter((e.name, e.args["buffer_bytes"]) for e in tr.collectives()[n:]
                             if 0 in e.ranks), out.full(), x.grad.full()))
    (eager, e_out, e_grad), (comp, c_out, c_grad) = runs
    want = "all_reduce" if src[0].is_replicate() else "reduce_scatter"
    assert eager == comp == Counter({(want, 4 * 256 * 8): 1})
    priced = Counter((it.coll, it.nbytes) for it in f.schedule.items
                     if it.kind == "comm" and it.phase == "backward")
    assert priced == comp
    assert f.assignment.time == pytest.approx(f.step().time, rel=1e-12, abs=0)
    torch.testing.assert_close(c_out, e_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c_grad, e_grad, rtol=1e-12, atol=1e-12)
