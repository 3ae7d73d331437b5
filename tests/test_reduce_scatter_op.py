"""``torch.ops.workbench.reduce_scatter`` (``sim_mesh.reduce_scatter_op``): the stacked
reduce-scatter as one operator, held bit for bit to its aten form (the sum or mean over
the ranks' axis, then the chunk views) in value and gradient, seen as one op by a
dispatch mode, and counted only when it runs."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from workbench.sim_mesh import collectives as C
from workbench.sim_mesh import reduce_scatter_op as R
from workbench.sim_mesh.mesh import Mesh
from workbench.sim_mesh.trace import trace


def _aten_form(x, nd, axis, dim, op):
    """The reduce-scatter written as aten ops (what grid.Stacked ran before the operator)."""
    n = x.shape[axis]
    s = x.sum(axis, keepdim=True) if op == "sum" else x.mean(axis, keepdim=True)
    L = s.shape[nd + dim]
    if axis == nd - 1 and dim == 0:
        return s.view(s.shape[:axis] + (n, L // n) + s.shape[nd + 1:])
    y = s.squeeze(axis)
    d = nd - 1 + dim
    return y.unflatten(d, (n, -1)).movedim(d, axis)


CASES = [((2, 4, 8, 3), 2, 1, 0), ((4, 2, 6, 8), 2, 0, 1), ((4, 8, 5), 1, 0, 0),
         ((2, 4, 3, 8), 2, 1, 1), ((4, 1, 8, 3), 2, 0, 0), ((3, 2, 2, 6), 2, 0, 1)]


@pytest.mark.parametrize("fn", [R.reduce_scatter, R.run], ids=["operator", "run"])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_value_and_gradient_are_the_aten_forms(case, op, fn):
    """The operator, and ``run`` (plain aten ops when no dispatch mode is on)."""
    shape, nd, axis, dim = case
    torch.manual_seed(0)
    x = torch.randn(shape).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    runs = R.RUNS[0]
    y, want = fn(x, nd, axis, dim, op), _aten_form(x2, nd, axis, dim, op)
    assert R.RUNS[0] == runs + 1
    assert y.shape == want.shape and torch.equal(y, want)
    g = torch.randn(y.shape)
    y.backward(g)
    want.backward(g)
    assert torch.equal(x.grad, x2.grad)
    # every rank k holds the k-th chunk of the group's reduction
    n = shape[axis]
    full = x.detach().sum(axis) if op == "sum" else x.detach().mean(axis)
    for k in range(n):
        got = y.detach().select(axis, k)
        torch.testing.assert_close(got, full.chunk(n, nd - 1 + dim)[k], rtol=0, atol=1e-6)


def test_integers_keep_their_dtype_and_meta_runs():
    x = torch.arange(16, dtype=torch.int32).view(2, 8)
    y = R.reduce_scatter(x, 1, 0, 0, "sum")
    assert y.dtype == torch.int32 and y.tolist() == [[8, 10, 12, 14], [16, 18, 20, 22]]
    m = R.reduce_scatter(torch.empty(4, 8, 5, device="meta"), 1, 0, 0, "sum")
    assert m.shape == (4, 2, 5) and m.device.type == "meta"
    with pytest.raises(ValueError, match="op='max'"):
        R.reduce_scatter(torch.zeros(2, 4), 1, 0, 0, "max")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_one_operator_and_the_trace_one_collective():
    mesh = Mesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    x = torch.randn(2, 2, 4, 3, requires_grad=True)
    runs = R.RUNS[0]
    with trace() as tr, _Ops() as mode:
        y = C.reduce_scatter(x, mesh, 1, 0)
    assert torch.ops.workbench.reduce_scatter.default in mode.seen
    assert torch.ops.aten.sum.dim_IntList not in mode.seen       # the sum is inside it
    assert R.RUNS[0] == runs + 1
    assert [e.name for e in tr.collectives()] == ["reduce_scatter"] * 2    # one per tp group
    assert y.shape == (2, 2, 2, 3)


def test_a_cache_hit_records_no_collective():
    """A mode that hands back a kept output without running the operator (as selective
    checkpointing's recompute does): nothing moved, nothing recorded; the value is the
    kept one."""
    mesh = Mesh([0, 1], dim_names=["tp"])
    x = torch.randn(2, 4, 3)
    kept = C.reduce_scatter(x, mesh, 0, 0)

    class _Cache(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.workbench.reduce_scatter.default:
                return kept.clone()
            return func(*args, **(kwargs or {}))
    with trace() as tr, _Cache():
        y = C.reduce_scatter(x, mesh, 0, 0)
    assert tr.collectives() == [] and torch.equal(y, kept)
    with trace() as tr:                      # without the cache: recorded
        C.reduce_scatter(x, mesh, 0, 0)
    assert [e.name for e in tr.collectives()] == ["reduce_scatter"]
