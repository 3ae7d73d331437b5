"""User-trial audit of the core (Mesh, DistTensor, reshard, op table): each test pins a
defect found by probing the public API against single-device torch (values, dtypes)
and PyTorch DTensor (names, placements, errors)."""
import pytest
import torch

import workbench as wb

M3 = wb.Mesh.grid(3, ["a"])
M23 = wb.Mesh.grid((2, 3), ["a", "b"])


def _partial(x, mesh, op):
    """A Partial(op) DistTensor of x on a 1-d mesh whose ranks hold unequal parts (the
    max / min spread over the ranks, so no single rank holds the answer)."""
    n = mesh.size
    if op == "avg":
        g = torch.Generator().manual_seed(0)
        parts = [torch.randn(x.shape, generator=g) * (k + 1) for k in range(n - 1)]
        parts.append(x * n - sum(parts))
    else:
        sign = -1 if op == "max" else 1
        parts = [x + sign * (k + 1) for k in range(n)]
        flat = [p.reshape(-1) for p in parts]
        for i in range(x.numel()):
            flat[i % n][i] = x.reshape(-1)[i]
    return wb.from_local(parts, mesh, [wb.Partial(op)], shape=x.shape)


@pytest.mark.parametrize("op", ["avg", "max", "min"])
def test_grad_of_a_partial_leaf_is_the_global_gradient(op):
    # was: the local shares labelled Replicate (avg: g / n; max / min: g on rank 0 only)
    x = torch.randn(2, 3)
    w = torch.arange(6.).reshape(2, 3)
    t = _partial(x, M3, op)
    torch.testing.assert_close(t.full(), x)
    t.requires_grad_()
    (t * w).sum().backward()
    # each rank's share of the gradient (DTensor reduces them to Replicate)
    assert t.grad.placements == (wb.Partial("sum"),)
    torch.testing.assert_close(t.grad.full(), w)
    torch.testing.assert_close(t.grad.full_tensor(), w)
    t.grad.zero_()                          # reaches the local gradients (no copy)
    (t * 2.0).sum().backward()
    torch.testing.assert_close(t.grad.full(), torch.full((2, 3), 2.0))
    (t * 2.0).sum().backward()
    torch.testing.assert_close(t.grad.full(), torch.full((2, 3), 4.0))


def test_grad_of_a_partial_leaf_on_a_2d_mesh_keeps_its_shards():
    x = torch.randn(5, 4)
    base = wb.shard_tensor(x, M23, [wb.Shard(0), wb.Replicate()])
    locs = []
    for r in M23.ranks:
        k = M23.coordinate(r)[1]
        locs.append(base.local(r) * (2.0 if k == 0 else 0.5) if k < 2 else base.local(r))
    avg = (2.0 + 0.5 + 1.0) / 3
    t = wb.from_local([loc / avg for loc in locs], M23, [wb.Shard(0), wb.Partial("avg")],
                      shape=x.shape)
    torch.testing.assert_close(t.full(), x)
    t.requires_grad_()
    (t * 3.0).sum().backward()
    assert t.grad.placements == (wb.Shard(0), wb.Partial("sum"))
    torch.testing.assert_close(t.grad.full(), torch.full((5, 4), 3.0))


@pytest.mark.parametrize("call", [lambda t: t.mul_(2.5), lambda t: t.pow_(0.5),
                                  lambda t: t.clamp_(0.5, 1.5)])
def test_inplace_float_result_into_an_int_tensor_raises_as_torch(call):
    # was: int.mul_(2.5) silently truncated (torch raises: result type Float can't be cast)
    ref = torch.arange(7)
    with pytest.raises(RuntimeError, match="can't be cast"):
        call(ref.clone())
    t = wb.shard_tensor(ref, M3, [wb.Shard(0)])
    with pytest.raises(RuntimeError, match="can't be cast"):
        call(t)
    assert torch.equal(t.full(), ref)                  # left untouched


def test_inplace_int_result_into_an_int_tensor_still_works():
    t = wb.shard_tensor(torch.arange(7), M3, [wb.Shard(0)])
    t.mul_(3)
    assert t.dtype == torch.int64 and torch.equal(t.full(), torch.arange(7) * 3)


@pytest.mark.parametrize("ps", [[wb.Shard(0)], [wb.Shard(1)], [wb.Partial()], [wb.Replicate()]])
def test_allclose_equal_isclose(ps):
    # were: NoRuleError
    x = torch.randn(5, 7)
    t = wb.shard_tensor(x, M3, ps)
    y = x.clone()
    y[4, 6] += 1e-3
    assert torch.allclose(t, x) and t.allclose(x)
    assert torch.allclose(t, wb.shard_tensor(x, M3, [wb.Shard(1)]))
    assert not torch.allclose(t, y)
    assert torch.allclose(t, y, atol=1e-2)
    assert torch.allclose(t, x[0:1]) == torch.allclose(x, x[0:1])        # broadcasts
    assert torch.equal(t, x) and not torch.equal(t, y) and not torch.equal(t, x[None])
    assert torch.equal(t, x.double())                   # dtypes may differ, as torch
    c = torch.isclose(t, y)
    assert isinstance(c, wb.DistTensor) and c.dtype == torch.bool
    assert torch.equal(c.full(), torch.isclose(x, y))
    with pytest.raises(TypeError, match="must be Tensor"):
        torch.allclose(t, 1.0)
    with pytest.raises(RuntimeError, match="Float did not match Double"):
        torch.allclose(t, x.double())


def test_dtensor_names():
    # were: AttributeError
    x = torch.randn(5, 7)
    t = wb.shard_tensor(x, M23, [wb.Shard(0), wb.Shard(1)])
    assert t.device_mesh is t.mesh
    assert torch.equal(t.full_tensor(), x)
    r = t.redistribute(t.device_mesh, [wb.Replicate(), wb.Shard(0)])
    assert r.placements == (wb.Replicate(), wb.Shard(0)) and torch.equal(r.full(), x)
    assert t.redistribute(placements=["R", "R"]).placements == (wb.Replicate(),) * 2
    with pytest.raises(RuntimeError, match="placements"):
        t.redistribute(t.mesh)
    # differentiable, as DTensor's
    t.requires_grad_()
    (t.redistribute(placements=[wb.Replicate(), wb.Replicate()]).full_tensor() * 2).sum().backward()
    torch.testing.assert_close(t.grad.full(), torch.full((5, 7), 2.0))


@pytest.mark.parametrize("dst", [[wb.Replicate(), wb.Replicate()], [wb.Shard(1), wb.Shard(0)]])
def test_gradients_accumulate_on_uneven_partial_leaves(dst):
    # was: the second backward added the gradient once per rank of the Partial group (3x):
    # torch.stack's backward handed every rank a view of one expanded gradient, which
    # autograd kept as each leaf's .grad (shared memory)
    x = torch.randn(5, 7, dtype=torch.float64)
    w = torch.randn(5, 7, dtype=torch.float64)
    base = wb.shard_tensor(x, M23, [wb.Shard(0), wb.Replicate()])
    locs = [base.local(r) if M23.coordinate(r)[1] == 0 else torch.zeros_like(base.local(r))
            for r in M23.ranks]
    t = wb.from_local(locs, M23, [wb.Shard(0), wb.Partial()], shape=x.shape).requires_grad_()
    assert not t.is_even
    for k in (1, 2, 3):
        (wb.reshard(t, M23, dst) * w).sum().backward()
        torch.testing.assert_close(t.grad.full(), k * w)
    z = torch.randn(5, 7, dtype=torch.float64)
    t.grad = None
    for k in (1, 2):
        (torch.softmax(t + z, -1) * w).sum().backward()
    x0 = x.clone().requires_grad_()
    (torch.softmax(x0 + z, -1) * w).sum().backward()
    torch.testing.assert_close(t.grad.full(), 2 * x0.grad)


VIEW_WRITES = {
    # was silently lost: the inner view is a copy (uneven rows re-cut), the outer aliases it
    "view then slice": lambda t: t.view(35)[3:9].mul_(0.0),
    "reshape then row": lambda t: t.reshape(7, 5)[1].mul_(3.0),
    "flatten then step": lambda t: t.flatten()[::4].fill_(1.0),
    # were NotImplementedError (a copy with no way back to the base)
    "chunk": lambda t: t.chunk(3, dim=1)[1].fill_(-1.0),
    "split": lambda t: t.split(2)[1].copy_(torch.ones(2, 7)),
    "unbind": lambda t: t.unbind(0)[2].zero_(),
    "view": lambda t: t.view(7, 5).add_(1.0),
    # were NoRuleError
    "narrow": lambda t: t.narrow(1, 2, 3).zero_(),
    "select": lambda t: t.select(1, -1).fill_(5.0),
}


@pytest.mark.parametrize("name", sorted(VIEW_WRITES))
@pytest.mark.parametrize("mesh,ps", [(M3, ["S(0)"]), (M3, ["S(1)"]), (M23, ["S(0)", "S(1)"]),
                                     (M23, ["P", "S(0)"]), (M23, ["R", "P(max)"])])
def test_a_write_into_a_view_reaches_the_base(name, mesh, ps):
    x = torch.randn(5, 7)
    ref = x.clone()
    VIEW_WRITES[name](ref)
    t = wb.shard_tensor(x, mesh, ps)
    VIEW_WRITES[name](t)
    torch.testing.assert_close(t.full(), ref)
    assert t.placements == tuple(wb.parallel.placement.normalize_placements(ps, mesh, 2))


def test_narrow_and_select_are_views_with_torchs_errors():
    x = torch.randn(5, 7)
    t = wb.shard_tensor(x, M3, [wb.Shard(0)])
    for args in [(0, 3, 2), (0, -2, 2), (0, 5, 0), (-1, 2, 3)]:
        assert torch.equal(t.narrow(*args).full(), x.narrow(*args))
        assert torch.equal(torch.narrow(t, *args).full(), torch.narrow(x, *args))
    for args in [(0, 4), (0, -5), (-1, 2)]:
        assert torch.equal(t.select(*args).full(), x.select(*args))
    for bad, err in [((0, 3, 5), RuntimeError), ((0, 6, 0), IndexError), ((0, 2, -1), RuntimeError)]:
        with pytest.raises(err):
            x.narrow(*bad)
        with pytest.raises(err):                 # after the valid calls above (cached)
            t.narrow(*bad)
    with pytest.raises(IndexError):
        t.select(0, 5)


@pytest.mark.parametrize("mesh,ps", [(M3, ["S(0)"]), (M23, ["S(0)", "S(1)"]), (M23, ["P", "S(0)"]),
                                     (M23, ["R", "P(max)"])])
def test_views_see_later_writes_into_the_base(mesh, ps):
    # was: a view that had to move data (rows 1:3 of 5 rows on 3 ranks) kept the old values
    x = torch.randn(5, 7)
    t = wb.shard_tensor(x, mesh, ps)
    views = {"rows": lambda a: a[1:3], "flat": lambda a: a.view(35), "piece": lambda a: a.chunk(3, 1)[1],
             "narrow": lambda a: a.narrow(0, 2, 3), "row of flat": lambda a: a.view(35)[4:20:3]}
    ours = {k: f(t) for k, f in views.items()}
    ref = x.clone()
    theirs = {k: f(ref) for k, f in views.items()}
    for write in (lambda a: a.add_(1.0), lambda a: a.mul_(torch.arange(7.)),
                  lambda a: a.__setitem__((slice(None), 0), -3.0), lambda a: a.zero_()):
        write(t)
        write(ref)
        for k in views:
            torch.testing.assert_close(ours[k].full(), theirs[k], msg=k)


def test_views_see_a_write_recorded_by_autograd():
    w = torch.randn(5, 7, requires_grad=True)
    t = wb.shard_tensor(w.detach(), M3, [wb.Shard(0)]).requires_grad_()
    y, yr = t * 2, w * 2
    v, vr = y[1:3], yr[1:3]
    y.mul_(3.0)
    yr.mul_(3.0)
    torch.testing.assert_close(v.full(), vr)
    (v * torch.arange(7.)).sum().backward()
    (vr * torch.arange(7.)).sum().backward()
    torch.testing.assert_close(t.grad.full(), w.grad)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")   # torch's own
def test_backward_takes_retain_graph_create_graph_and_inputs():
    # was: TypeError (unexpected keyword argument 'retain_graph')
    x = torch.randn(5, 7)
    for ps in (["S(0)"], ["P"], ["R"]):
        t = wb.shard_tensor(x, M3, ps).requires_grad_()
        u = wb.shard_tensor(x, M3, ["S(1)"]).requires_grad_()
        s = (t * t * u).sum()
        s.backward(retain_graph=True)
        s.backward()
        torch.testing.assert_close(t.grad.full(), 4 * x * x)
        t.grad = None
        u.grad = None
        (t * u).sum().backward(inputs=[u])
        assert t.grad is None
        torch.testing.assert_close(u.grad.full(), x)
    t = wb.shard_tensor(x, M3, ["S(0)"]).requires_grad_()
    (t ** 3).sum().backward(create_graph=True)
    g = t.grad
    assert g.requires_grad
    torch.testing.assert_close(g.full(), 3 * x * x)
    t.grad = None


TIES = torch.tensor([[1., 3., 3.], [2., 0., 2.], [5., 5., 1.], [0., -1., 4.], [7., 7., 7.]])


@pytest.mark.parametrize("call", [lambda a: a.max(), lambda a: torch.min(a),
                                  lambda a: a.max(1), lambda a: torch.min(a, 0, keepdim=True),
                                  lambda a: a.max(dim=-1), lambda a: torch.max(a, a * 2 - 3),
                                  lambda a: torch.min(a, other=-a)])
@pytest.mark.parametrize("mesh,ps", [(M3, ["S(0)"]), (M3, ["S(1)"]), (M23, ["S(0)", "S(1)"]),
                                     (M23, ["R", "R"])])
def test_max_min_as_torch_overloads_them(call, mesh, ps):
    # were: NoRuleError
    x0 = TIES.clone().requires_grad_()
    ref = call(x0)
    t = wb.shard_tensor(TIES, mesh, ps).requires_grad_()
    out = call(t)
    assert isinstance(out, tuple) == isinstance(ref, tuple)
    if isinstance(ref, tuple):
        assert type(out) is type(ref)
        torch.testing.assert_close(out.values.full(), ref.values)
        torch.testing.assert_close(out.indices.full(), ref.indices)      # the first extreme
        ref, out = ref.values, out.values
    torch.testing.assert_close(out.full(), ref)
    (ref * 1.5).sum().backward()
    (out * 1.5).sum().backward()
    torch.testing.assert_close(t.grad.full(), x0.grad)                 # ties, as torch
    ints = torch.arange(35).reshape(5, 7) % 6
    assert torch.equal(torch.max(wb.shard_tensor(ints, mesh, ps), 1).indices.full(),
                       torch.max(ints, 1).indices)
    with pytest.raises(IndexError):
        t.max(2)


@pytest.mark.parametrize("mesh,ps", [(M3, ["S(0)"]), (M3, ["P"]), (M23, ["S(1)", "S(0)"]),
                                     (M23, ["R", "R"])])
def test_torch_autograd_grad_and_backward(mesh, ps):
    # were: NoRuleError
    x = torch.randn(5, 7)
    w = torch.randn(7, requires_grad=True)
    t = wb.shard_tensor(x, mesh, ps).requires_grad_()
    x0 = x.clone().requires_grad_()
    g, gw = torch.autograd.grad((t * w).tanh().sum(), [t, w])
    r, rw = torch.autograd.grad((x0 * w).tanh().sum(), [x0, w])
    assert isinstance(g, wb.DistTensor) and g.placements == t._grad_placements()
    torch.testing.assert_close(g.full(), r)
    torch.testing.assert_close(gw, rw)
    gy, = torch.autograd.grad(t * 2, t, grad_outputs=torch.ones(5, 7))
    torch.testing.assert_close(gy.full(), torch.full((5, 7), 2.0))
    g2, = torch.autograd.grad((t ** 3).sum(), t, create_graph=True)          # double backward
    h, = torch.autograd.grad(g2.sum(), t)
    torch.testing.assert_close(h.full(), 6 * x)
    u = wb.shard_tensor(x, mesh, ps).requires_grad_()
    assert torch.autograd.grad((t * 2).sum(), [t, u], allow_unused=True)[1] is None
    torch.autograd.backward([(t * t).sum()])
    torch.testing.assert_close(t.grad.full(), 2 * x)
    assert t.grad is not None and u.grad is None


ADV = {"tensor": lambda a: a[torch.tensor([0, 2, 2, -1])], "cols": lambda a: a[:, torch.tensor([6, 0, -7])],
       "list": lambda a: a[[0, 3]], "mask": lambda a: a[torch.tensor([True, False, True, True, False])],
       "2-d index": lambda a: a[torch.tensor([[0, 1], [4, 4]])],
       "ellipsis": lambda a: a[..., torch.tensor([1, 1])], "0-d": lambda a: a[torch.tensor(3)],
       "empty": lambda a: a[torch.tensor([], dtype=torch.long)]}


@pytest.mark.parametrize("name", sorted(ADV))
@pytest.mark.parametrize("mesh,ps", [(M3, ["S(0)"]), (M3, ["S(1)"]), (M23, ["S(1)", "S(0)"]),
                                     (M23, ["P", "R"])])
def test_advanced_indexing_with_one_index_tensor(name, mesh, ps):
    # was: NotImplementedError
    x = torch.randn(5, 7)
    x0 = x.clone().requires_grad_()
    ref = ADV[name](x0)
    t = wb.shard_tensor(x, mesh, ps).requires_grad_()
    out = ADV[name](t)
    torch.testing.assert_close(out.full(), ref)
    if ref.numel():
        (ref * 2).sum().backward()
        (out * 2).sum().backward()
        torch.testing.assert_close(t.grad.full(), x0.grad)        # repeated rows accumulate


def test_advanced_indexing_errors_as_torch():
    x = torch.randn(5, 7)
    t = wb.shard_tensor(x, M3, ["S(0)"])
    for bad in ([torch.tensor([5])], [torch.tensor([-6])], [torch.tensor([True, False])]):
        with pytest.raises(IndexError):
            x[bad[0]]
        with pytest.raises(IndexError):
            t[bad[0]]
    with pytest.raises(IndexError):
        t[torch.tensor([0.0])]
    # two index tensors: torch's result now (was refused; tests/test_mixed_index.py)
    torch.testing.assert_close(t[torch.tensor([0]), torch.tensor([1])].full(),
                               x[torch.tensor([0]), torch.tensor([1])])


F_ = torch.nn.functional
TGT = torch.tensor([1, 6, -100, 3, 0])
COMPOSITE_CALLS = {
    "var": lambda a: a.var(), "var(1)": lambda a: a.var(1), "var keepdim": lambda a: torch.var(a, 0, keepdim=True),
    "var unbiased=False": lambda a: a.var(-1, unbiased=False, keepdim=True),
    "var correction=0": lambda a: a.var(dim=(0, 1), correction=0), "var(False)": lambda a: a.var(False),
    "var(dim, unbiased, keepdim)": lambda a: a.var(1, False, True), "std": lambda a: a.std(),
    "std(1)": lambda a: torch.std(a, 1),
    "mse": lambda a: F_.mse_loss(a, a * 0 + 1.5),
    "mse sum": lambda a: F_.mse_loss(a, torch.ones(5, 7, dtype=torch.float64), reduction="sum"),
    "mse none": lambda a: F_.mse_loss(a, torch.ones(5, 7, dtype=torch.float64), reduction="none"),
    "nll": lambda a: F_.nll_loss(a.log_softmax(1), TGT),
    "nll sum": lambda a: F_.nll_loss(a.log_softmax(1), TGT, reduction="sum"),
    "nll none": lambda a: F_.nll_loss(a.log_softmax(1), TGT, reduction="none"),
    "nll ignore_index": lambda a: F_.nll_loss(a, TGT.clamp(min=0), ignore_index=3),
    "nll one sample": lambda a: F_.nll_loss(a[0], torch.tensor(2)),
}


def _as_one_device(fn, mesh, ps):
    """``fn`` on a float64 (5, 7) DistTensor laid out as ``ps``: its value, dtype, shape and
    gradient equal one device's."""
    x = torch.randn(5, 7, dtype=torch.float64)
    x0 = x.clone().requires_grad_()
    ref = fn(x0)
    t = wb.shard_tensor(x, mesh, ps).requires_grad_()
    out = fn(t)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.full(), ref.detach())
    ref.sum().backward()
    out.sum().backward()
    torch.testing.assert_close(t.grad.full(), x0.grad)



@pytest.mark.parametrize("name", sorted(COMPOSITE_CALLS))
@pytest.mark.parametrize("mesh,ps", [(M3, ["S(0)"]), (M3, ["S(1)"]), (M23, ["S(1)", "S(0)"]),
                                     (M23, ["P", "S(1)"])])
def test_var_std_mse_nll(name, mesh, ps):
    # were: NoRuleError
    _as_one_device(COMPOSITE_CALLS[name], mesh, ps)


def test_composites_errors():
    t = wb.shard_tensor(torch.randn(5, 7), M3, ["S(0)"])
    with pytest.raises(RuntimeError, match="floating point"):
        wb.shard_tensor(torch.arange(6), M3, ["S(0)"]).var()
    with pytest.raises(Exception):
        F_.nll_loss(t, torch.tensor([1, 2]))               # batch sizes differ, as torch
    with pytest.raises(ValueError, match="not a valid value"):
        F_.mse_loss(t, t, reduction="avg")
    with pytest.warns(UserWarning, match="degrees of freedom"):     # torch's value and
        v = t.requires_grad_().var(0, correction=5)               # gradient (test_sweep8)
    assert torch.isinf(v.full()).all()


@pytest.mark.parametrize("call", [lambda a: a / 0, lambda a: a * float("inf"), lambda a: a * float("-inf"),
                                  lambda a: torch.div(a, 0.0), lambda a: a / torch.tensor(0.0),
                                  lambda a: a * torch.tensor(float("inf")), lambda a: a * float("nan")])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_a_partial_sum_times_a_non_finite_number(call, op):
    # was: each part became +-inf and their sum nan (torch: the sum times inf is +-inf)
    x = torch.tensor([1.5, -2.0, 0.0, 3.0])
    t = _partial(x, M3, op) if op != "sum" else wb.from_local(
        [x * 2, -x, torch.zeros(4)], M3, [wb.Partial()])
    torch.testing.assert_close(t.full(), x)
    torch.testing.assert_close(call(t).full(), call(x), equal_nan=True)
    y = t.clone()
    y.mul_(float("inf"))
    torch.testing.assert_close(y.full(), x * float("inf"), equal_nan=True)


def test_distribute_tensor_is_dtensors_name_for_shard_tensor():
    x = torch.randn(5, 7)
    t = wb.distribute_tensor(x, M23, [wb.Shard(0), wb.Shard(1)])
    assert t.placements == (wb.Shard(0), wb.Shard(1)) and torch.equal(t.full(), x)
    r = wb.distribute_tensor(x, M23)                          # Replicate everywhere, as DTensor
    assert r.placements == (wb.Replicate(),) * 2 and torch.equal(r.full_tensor(), x)


@pytest.mark.parametrize("mesh,ps", [(M3, ["S(0)"]), (M3, ["P"]), (M23, ["S(1)", "P(max)"]),
                                     (M23, ["R", "S(0)"])])
def test_index_put(mesh, ps):
    # was: NoRuleError
    x = torch.randn(5, 7)
    rows, cols = torch.tensor([0, 0, 4]), torch.tensor([1, 1, 6])
    v = torch.tensor([1.0, 2.0, 3.0])
    for acc in (False, True):
        ref = x.clone().index_put_((rows, cols), v, accumulate=acc)
        t = wb.shard_tensor(x, mesh, ps)
        assert t.index_put_((rows, cols), v, accumulate=acc) is t
        torch.testing.assert_close(t.full(), ref)
        assert t.placements == tuple(wb.parallel.placement.normalize_placements(ps, mesh, 2))
        u = wb.shard_tensor(x, mesh, ps)
        out = torch.index_put(u, (rows, cols), v, accumulate=acc)
        torch.testing.assert_close(out.full(), ref)
        torch.testing.assert_close(u.full(), x)                  # out of place: u unchanged
    # through autograd
    w0 = x.clone().requires_grad_()
    y0 = w0 * 2
    y0.index_put_((rows,), torch.tensor(0.0))
    (y0 * torch.arange(7.)).sum().backward()
    w = wb.shard_tensor(x, mesh, ps).requires_grad_()
    y = w * 2
    y.index_put_((rows,), torch.tensor(0.0))
    (y * torch.arange(7.)).sum().backward()
    torch.testing.assert_close(w.grad.full(), w0.grad)


def test_requires_grad_on_a_result_keeps_its_history():
    # was: y.requires_grad_() detached y, so backward never reached t (t.grad None)
    x = torch.randn(5, 7)
    t = wb.shard_tensor(x, M3, ["S(0)"]).requires_grad_()
    y = t * 2
    assert y.requires_grad_() is y and not y.is_leaf
    (y * 3).sum().backward()
    torch.testing.assert_close(t.grad.full(), torch.full((5, 7), 6.0))
    with pytest.raises(RuntimeError, match="leaf variables"):
        (t * 2).requires_grad = False


MORE = {"logsumexp": lambda a: torch.logsumexp(a, 1), "logsumexp keepdim": lambda a: a.logsumexp((0, 1), keepdim=True),
        "log1p": lambda a: (a * a).log1p(), "expm1": lambda a: a.expm1(),
        "dot": lambda a: torch.dot(a[0], a[1]), "outer": lambda a: torch.outer(a[0], a[1, :3])}


@pytest.mark.parametrize("name", sorted(MORE))
@pytest.mark.parametrize("mesh,ps", [(M3, ["S(0)"]), (M3, ["S(1)"]), (M23, ["P", "S(1)"])])
def test_more_ops(name, mesh, ps):
    # were: NoRuleError
    _as_one_device(MORE[name], mesh, ps)


def test_logsumexp_of_infinities_as_torch():
    x = torch.tensor([[float("-inf")] * 3, [1., 2., float("inf")], [float("nan"), 1., 2.], [1., 2., 3.]])
    for ps in (["S(0)"], ["S(1)"]):
        torch.testing.assert_close(torch.logsumexp(wb.shard_tensor(x, M3, ps), 1).full(),
                                   torch.logsumexp(x, 1), equal_nan=True)


def test_a_partial_sum_times_a_tensor_with_infinities_is_torchs():
    # was silently nan where torch gives +-inf (a tensor factor's values are not known to
    # the rule: checked on the local run), then refused; sweep9: the partial sum is reduced
    # first where a factor holds inf (a divisor 0), as for numbers: torch's values
    x = torch.tensor([1.5, -2.0, 0.0, 3.0])
    t = wb.from_local([x * 2, -x, torch.zeros(4)], M3, [wb.Partial()])
    for f in (lambda a: a * torch.tensor([1.0, float("inf"), 1.0, 1.0]),
              lambda a: a / torch.tensor([1.0, 0.0, 1.0, 1.0]),
              lambda a: a / torch.tensor([0.0, 1.0, 1.0, 1.0])):
        torch.testing.assert_close(f(t).full(), f(x), equal_nan=True)
    torch.testing.assert_close((t * torch.arange(4.)).full(), x * torch.arange(4.))  # finite: as before
    r = wb.reshard(t, M3, [wb.Replicate()]) * torch.tensor([1.0, float("inf"), 1.0, 1.0])
    torch.testing.assert_close(r.full(), x * torch.tensor([1.0, float("inf"), 1.0, 1.0]),
                               equal_nan=True)
