"""Audit of eager DistTensor dispatch against plain PyTorch: a user's custom
``torch.autograd.Function`` on DistTensors, ``torch.autocast``, and ``wb.parallelize``'s
plan argument.  Every value and gradient is held to one device's."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench import Partial, Replicate, Shard


# ---- wb.parallelize(model, mesh, "colwise") --------------------------------------------

def test_parallelize_style_string_on_a_sequential_names_the_fix():
    # was: "dictionary update sequence element #0 has length 1; 2 is required"
    mesh = wb.Mesh.grid((2,))
    m = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"plan='colwise'.*no parameters of its own.*'0'"):
        wb.parallelize(m, mesh, "colwise")
    assert type(m[0].weight) is nn.Parameter          # nothing changed


@pytest.mark.parametrize("plan", [3, ["colwise"], "col"])
def test_parallelize_plan_of_the_wrong_type_names_the_argument(plan):
    with pytest.raises(TypeError, match=r"parallelize\(plan=.*expected a dict"):
        wb.parallelize(nn.Linear(4, 4), wb.Mesh.grid((2,)), plan)


def test_parallelize_given_a_parallel_style_points_to_parallelize_module():
    with pytest.raises(TypeError, match="wb.parallelize_module"):
        wb.parallelize(nn.Linear(4, 4), wb.Mesh.grid((2,)), wb.ColwiseParallel())


def test_parallelize_style_string_applies_to_the_module_itself():
    # as torch's parallelize_module(linear, mesh, ColwiseParallel())
    torch.manual_seed(0)
    lin, ref = nn.Linear(4, 6), nn.Linear(4, 6)
    ref.load_state_dict(lin.state_dict())
    mesh = wb.Mesh.grid((2,))
    wb.parallelize(lin, mesh, "colwise")
    assert lin.weight.placements == (Shard(0),) and lin.bias.placements == (Shard(0),)
    x = torch.randn(3, 4)
    torch.testing.assert_close(lin(wb.shard_tensor(x, mesh, [Replicate()])).full(), ref(x))


# ---- a user's torch.autograd.Function on DistTensors ----------------------------------------
# was: the Function's forward ran under no_grad with the DistTensor as a constant; the
# output did not require grad and the gradient was silently lost

from torch.autograd.function import once_differentiable  # noqa: E402


class _Cube(torch.autograd.Function):
    """x ** 3 * k with a non-tensor argument and a saved input."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        ctx.k = k
        return x * x * x * k

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g * ctx.k, None


class _Linear(torch.autograd.Function):
    """x @ w.T + b, needs_input_grad read in backward."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.T + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g @ w if ctx.needs_input_grad[0] else None
        gw = g.T @ x if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


class _SortedWithIndex(torch.autograd.Function):
    """Two outputs, one marked non-differentiable; the backward is once_differentiable."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        idx = (x > 0).to(torch.int64)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(y)
        return y, idx

    @staticmethod
    @once_differentiable
    def backward(ctx, g, gidx):
        (y,) = ctx.saved_tensors
        return g * y


class _SetupStyle(torch.autograd.Function):
    """forward without ctx, setup_context apart (torch >= 2.0's style)."""

    @staticmethod
    def forward(x, scale=2.0):
        return x.sin() * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, scale = inputs
        ctx.save_for_backward(x)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos() * ctx.scale, None


MESHES = {"1": (1,), "2": (2,), "3": (3,), "2x2": (2, 2)}


def _dist(x, mesh, kind, seed=0):
    """x laid out by kind: 'S0', 'S1', 'R', 'P' (asymmetric partial sum), 'Pavg', 'Pmax'."""
    nd = mesh.ndim
    if kind in ("S0", "S1"):
        return wb.shard_tensor(x, mesh, [Shard(int(kind[1]))] + [Replicate()] * (nd - 1))
    if kind == "R":
        return wb.shard_tensor(x, mesh, [Replicate()] * nd)
    g = torch.Generator().manual_seed(seed)
    n = mesh.size
    if kind == "P":
        parts = [torch.randn(x.shape, generator=g, dtype=x.dtype) for _ in range(n - 1)]
        parts.append(x - sum(parts) if parts else x)
        return wb.from_local(parts, mesh, [Partial("sum")] * nd)
    if kind == "Pavg":
        parts = [torch.randn(x.shape, generator=g, dtype=x.dtype) for _ in range(n - 1)]
        parts.append(x * n - sum(parts) if parts else x)
        return wb.from_local(parts, mesh, [Partial("avg")] * nd)
    assert kind == "Pmax"
    parts = [x - torch.rand(x.shape, generator=g, dtype=x.dtype) for _ in range(n - 1)] + [x]
    return wb.from_local(parts[::-1], mesh, [Partial("max")] * nd)


def _x(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("mesh_shape", list(MESHES))
@pytest.mark.parametrize("kind", ["S0", "S1", "R", "P", "Pavg", "Pmax"])
def test_custom_function_values_and_grads_equal_one_device(mesh_shape, kind):
    mesh = wb.Mesh.grid(MESHES[mesh_shape])
    x = _x((5, 3))
    d = _dist(x, mesh, kind).requires_grad_()
    y = _Cube.apply(d, 0.5)
    assert isinstance(y, wb.DistTensor) and y.requires_grad
    xr = x.clone().requires_grad_()
    yr = _Cube.apply(xr, 0.5)
    torch.testing.assert_close(y.full(), yr)
    go = _x((5, 3), 1)
    y.backward(go)
    yr.backward(go)
    torch.testing.assert_close(d.grad.full(), xr.grad)
    assert d.grad.shape == xr.grad.shape and d.grad.dtype == xr.grad.dtype


@pytest.mark.parametrize("mesh_shape", ["1", "2", "2x2"])
@pytest.mark.parametrize("wkind", ["S0", "S1", "R"])
def test_custom_linear_function_with_sharded_weight(mesh_shape, wkind):
    mesh = wb.Mesh.grid(MESHES[mesh_shape])
    x, w, b = _x((4, 6)), _x((8, 6), 1), _x((8,), 2)
    dx = _dist(x, mesh, "S0").requires_grad_()
    dw = _dist(w, mesh, wkind).requires_grad_()
    db = _dist(b, mesh, "R")                       # no gradient wanted
    out = _Linear.apply(dx, dw, db)
    refs = [t.clone().requires_grad_(r) for t, r in ((x, True), (w, True), (b, False))]
    ref = _Linear.apply(*refs)
    torch.testing.assert_close(out.full(), ref)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    torch.testing.assert_close(dx.grad.full(), refs[0].grad)
    torch.testing.assert_close(dw.grad.full(), refs[1].grad)
    assert db.grad is None
    # a second iteration accumulates, as on one device
    _Linear.apply(dx, dw, db).pow(2).sum().backward()
    _Linear.apply(*refs).pow(2).sum().backward()
    torch.testing.assert_close(dw.grad.full(), refs[1].grad)


def test_custom_function_needs_input_grad_and_mixed_plain_tensor():
    # was also: a DistTensor gradient for the plain tensor input raised
    mesh = wb.Mesh.grid((2,))
    seen = []

    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, tag):
            seen.append(ctx.needs_input_grad)
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            assert isinstance(g, wb.DistTensor) == isinstance(a, wb.DistTensor)
            # a DistTensor gradient for the plain tensor b: its global value is b's
            return g * b, g * a if ctx.needs_input_grad[1] else None, None

    a, b = _x((4, 2)), _x((4, 2), 1)
    da = _dist(a, mesh, "S0").requires_grad_()
    bb = b.clone().requires_grad_()                # a plain tensor beside a DistTensor
    out = Mul.apply(da, bb, "tag")
    out.sum().backward()
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    Mul.apply(ar, br, "tag").sum().backward()
    assert seen == [(True, True, False)] * 2
    torch.testing.assert_close(da.grad.full(), ar.grad)
    torch.testing.assert_close(bb.grad, br.grad)


def test_custom_function_non_differentiable_output_and_once_differentiable():
    mesh = wb.Mesh.grid((2, 2))
    x = _x((4, 4))
    d = _dist(x, mesh, "S1").requires_grad_()
    y, idx = _SortedWithIndex.apply(d)
    assert y.requires_grad and not idx.requires_grad and idx.dtype == torch.int64
    xr = x.clone().requires_grad_()
    yr, idxr = _SortedWithIndex.apply(xr)
    torch.testing.assert_close(idx.full(), idxr)
    (y * 3).sum().backward()
    (yr * 3).sum().backward()
    torch.testing.assert_close(d.grad.full(), xr.grad)


def test_custom_function_setup_context_style_and_keyword_argument():
    mesh = wb.Mesh.grid((3,))
    x = _x((5, 2))
    d = _dist(x, mesh, "S0").requires_grad_()
    y = _SetupStyle.apply(d, scale=3.0)
    xr = x.clone().requires_grad_()
    yr = _SetupStyle.apply(xr, scale=3.0)
    torch.testing.assert_close(y.full(), yr)
    y.sum().backward()
    yr.sum().backward()
    torch.testing.assert_close(d.grad.full(), xr.grad)


def test_custom_function_double_backward():
    mesh = wb.Mesh.grid((2,))
    x = _x((4, 3))
    d = _dist(x, mesh, "S0").requires_grad_()
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(_Cube.apply(d, 1.0).sum(), d, create_graph=True)
    (gr,) = torch.autograd.grad(_Cube.apply(xr, 1.0).sum(), xr, create_graph=True)
    torch.testing.assert_close(g.full(), gr)
    g.sum().backward()
    gr.sum().backward()
    torch.testing.assert_close(d.grad.full(), xr.grad)


def test_custom_function_under_no_grad_and_without_grad_inputs():
    mesh = wb.Mesh.grid((2,))
    d = _dist(_x((4, 3)), mesh, "S0").requires_grad_()
    with torch.no_grad():
        assert not _Cube.apply(d, 1.0).requires_grad
    assert not _Cube.apply(d.detach(), 1.0).requires_grad


def test_custom_function_second_backward_and_in_place_edit_raise_as_torch():
    mesh = wb.Mesh.grid((2,))
    d = _dist(_x((4, 3)), mesh, "S0").requires_grad_()
    y = _Cube.apply(d, 1.0).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.backward()


def test_custom_function_bad_backward_raises_as_torch():
    mesh = wb.Mesh.grid((2,))
    d = _dist(_x((4, 3)), mesh, "S0").requires_grad_()

    class WrongShape(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return torch.ones(5)

    class TooFew(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k):
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g

    class Dirty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(RuntimeError, match=r"invalid gradient at index 0 - got \[5\]"):
        WrongShape.apply(d).sum().backward()
    with pytest.raises(RuntimeError, match="incorrect number of gradients"):
        TooFew.apply(d, 2.0).sum().backward()
    with pytest.raises(NotImplementedError, match="mark_dirty"):
        Dirty.apply(d)
    with pytest.raises(TypeError, match="save_for_backward can only save variables"):
        class SaveInt(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(3)
                return x

            @staticmethod
            def backward(ctx, g):
                return g
        SaveInt.apply(d)


def test_custom_function_on_plain_tensors_is_torchs_own():
    # the check in front of Function.apply leaves plain calls to torch
    x = _x((3,)).requires_grad_()
    y = _Cube.apply(x, 2.0)
    assert type(y) is torch.Tensor and type(y.grad_fn).__name__ == "_CubeBackward"


def test_reentrant_checkpoint_on_dist_tensors_keeps_the_gradient():
    # was: "none of output has requires_grad=True" at backward (the reentrant Function
    # kept the DistTensor as a constant)
    import torch.utils.checkpoint as cp
    torch.manual_seed(0)
    mesh = wb.Mesh.grid((2,))
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    ref.load_state_dict(m.state_dict())
    wb.parallelize(m, mesh, {"0": "colwise", "2": "rowwise"})
    x = _x((4, 6))
    d = wb.shard_tensor(x, mesh, [Replicate()]).requires_grad_()
    import warnings
    with warnings.catch_warnings():          # torch's: no *tensor* input requires grad
        warnings.simplefilter("ignore", UserWarning)
        y = cp.checkpoint(m, d, use_reentrant=True)
    xr = x.clone().requires_grad_()
    yr = cp.checkpoint(ref, xr, use_reentrant=True)
    torch.testing.assert_close(y.full(), yr)
    y.pow(2).sum().backward()
    yr.pow(2).sum().backward()
    torch.testing.assert_close(m[0].weight.grad.full(), ref[0].weight.grad)
    torch.testing.assert_close(d.grad.full(), xr.grad)


# ---- torch.autocast on DistTensors ----------------------------------------------------------
# was: ops kept float32 under autocast where torch's run in bfloat16 (F.linear, addmm), or
# stayed bfloat16 where torch's run in float32 (mse_loss, l1_loss, kl_div, nll_loss...)

import torch.nn.functional as F  # noqa: E402

from workbench.parallel.ops_table.samples import samples as _samples  # noqa: E402

BF = torch.bfloat16


def _lay(a, mesh, shard=False):
    if isinstance(a, torch.Tensor):
        ps = [Shard(0) if shard and a.dim() and a.shape[0] >= mesh.size else Replicate()]
        return wb.shard_tensor(a, mesh, ps + [Replicate()] * (mesh.ndim - 1))
    if isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in a):
        return type(a)(_lay(b, mesh, shard) for b in a)
    return a


def _flat(o):
    if isinstance(o, (wb.DistTensor, torch.Tensor)):
        return [o.full() if isinstance(o, wb.DistTensor) else o]
    if isinstance(o, (list, tuple)):
        return [t for b in o for t in _flat(b)]
    return []


def _recast(a, mode, k):
    """Sample tensors in float32 as they are ('f32'), all bfloat16, every other one
    bfloat16 ('mixed'), or float64."""
    if isinstance(a, torch.Tensor) and a.dtype == torch.float32:
        k[0] += 1
        if mode == "bf16" or mode == "mixed" and k[0] % 2 == 0:
            return a.to(BF)
        return a.double() if mode == "f64" else a
    if isinstance(a, (list, tuple)):
        return type(a)(_recast(b, mode, k) for b in a)
    return a


@pytest.mark.parametrize("mode", ["f32", "bf16", "mixed", "f64"])
def test_every_table_op_under_cpu_autocast_gives_torchs_dtypes(mode):
    mesh = wb.Mesh.grid((2,))
    bad = []
    for name, ss in sorted(_samples(known_bugs=False).items()):
        for s in ss:
            if type(s.fn).__name__ in ("method_descriptor", "wrapper_descriptor"):
                continue                # Tensor methods called unbound: not user code
            k = [0]
            args = [_recast(a, mode, k) for a in s.args]
            kw = {key: _recast(v, mode, k) for key, v in s.kwargs.items()}
            with torch.autocast("cpu", dtype=BF):
                try:
                    ref = s.fn(*args, **kw)
                except Exception:
                    continue                 # torch refuses it too
                if name == "einsum" and mode == "mixed":
                    continue                 # known: see the report (meta check of mixed dtypes)
                got = s.fn(*[_lay(a, mesh) for a in args],
                           **{key: _lay(v, mesh) for key, v in kw.items()})
            r, g = _flat(ref), _flat(got)
            if [t.dtype for t in r] != [t.dtype for t in g]:
                bad.append(f"{s}: torch {[t.dtype for t in r]}, ours {[t.dtype for t in g]}")
                continue
            for a, b in zip(r, g):
                if a.is_floating_point() and not torch.allclose(
                        a.double(), b.double(), rtol=2e-2, atol=2e-2, equal_nan=True):
                    bad.append(f"{s}: values differ")
    assert not bad, "\n".join(bad)


_LOSSES = ["mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "cross_entropy", "nll_loss",
           "binary_cross_entropy_with_logits"]


@pytest.mark.parametrize("loss", _LOSSES)
def test_losses_run_in_float32_under_autocast(loss):
    mesh = wb.Mesh.grid((2, 2))
    x = _x((4, 6)).to(BF)
    t = _x((4, 6), 1).sigmoid().to(BF) if loss != "cross_entropy" and loss != "nll_loss" \
        else torch.tensor([0, 5, 2, 3])
    fn = getattr(F, loss)
    with torch.autocast("cpu", dtype=BF):
        ref = fn(x, t)
        got = fn(_dist(x, mesh, "S0"), wb.shard_tensor(t, mesh, [Shard(0), Replicate()]))
    assert ref.dtype == got.dtype == torch.float32
    torch.testing.assert_close(got.full(), ref)


@pytest.mark.parametrize("mesh_shape", ["1", "2", "2x2"])
def test_tensor_parallel_mlp_under_autocast_equals_plain_torch(mesh_shape):
    torch.manual_seed(0)
    mesh = wb.Mesh.grid(MESHES[mesh_shape])
    m = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))
    ref = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))
    ref.load_state_dict(m.state_dict())
    wb.parallelize(m, mesh, {"0": "colwise", "2": "rowwise"})
    x = _x((5, 6))
    d = wb.shard_tensor(x, mesh, [Replicate()] * mesh.ndim)
    with torch.autocast("cpu", dtype=BF):
        y, yr = m(d), ref(x)
        assert y.dtype == yr.dtype == BF
        loss, loss_r = F.mse_loss(y, torch.zeros(5, 6)), F.mse_loss(yr, torch.zeros(5, 6))
    assert loss.dtype == loss_r.dtype == torch.float32
    torch.testing.assert_close(y.full(), yr, rtol=2e-2, atol=2e-2)
    loss.backward()
    loss_r.backward()
    for (n, p), pr in zip(m.named_parameters(), ref.parameters()):
        assert p.grad.dtype == pr.grad.dtype == torch.float32, n
        torch.testing.assert_close(p.grad.full(), pr.grad, rtol=5e-2, atol=5e-2)


def test_autocast_blas_promote_and_unlisted_ops():
    mesh = wb.Mesh.grid((2,))
    m, w, b = _x((4, 6)), _x((6, 6), 1), _x((6,), 2)
    cases = [lambda m, w, b: torch.addmm(b, m, w),                  # lower
             lambda m, w, b: torch.baddbmm(b, m.reshape(2, 2, 6), w.expand(2, 6, 6)),
             lambda m, w, b: torch.mv(m, b),                        # not on the list
             lambda m, w, b: torch.cat([m.to(BF), w]),              # promote
             lambda m, w, b: torch.stack([m.to(BF), m.double()]),
             lambda m, w, b: torch.mm(m.double(), w.double()),      # float64 is not cast
             lambda m, w, b: F.linear(m, w.to(BF), b)]
    for f in cases:
        with torch.autocast("cpu", dtype=BF):
            ref = f(m, w, b)
            got = f(*[_dist(t, mesh, "R") for t in (m, w, b)])
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got.full(), ref, rtol=2e-2, atol=2e-2)
    with torch.autocast("cpu", dtype=torch.float16):             # the autocast dtype read
        assert (_dist(m, mesh, "S0") @ _dist(w, mesh, "R")).dtype == torch.float16
    with torch.autocast("cpu", dtype=BF, enabled=False):
        assert F.linear(_dist(m, mesh, "S0"), _dist(w, mesh, "R")).dtype == torch.float32


class _Gram(torch.autograd.Function):
    """x @ x.T in float32 under autocast (torch.amp.custom_fwd(cast_inputs=))."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x @ x.T

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return (g + g.T) @ x


def test_custom_fwd_cast_inputs_on_dist_tensors():
    # was: torch's custom_fwd cast iterated the DistTensor into a generator
    mesh = wb.Mesh.grid((2,))
    x = _x((4, 4)).to(BF)
    d = _dist(x, mesh, "S0").requires_grad_()
    xr = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=BF):
        y, yr = _Gram.apply(d), _Gram.apply(xr)
    assert y.dtype == yr.dtype == torch.float32
    torch.testing.assert_close(y.full(), yr)
    y.sum().backward()
    yr.sum().backward()
    assert d.grad.dtype == xr.grad.dtype == BF
    torch.testing.assert_close(d.grad.full(), xr.grad)


def test_custom_function_communicates_as_the_same_ops_do():
    # the Function's forward and backward run through the op table: its collectives are
    # those of the same computation written with torch ops (the weight and bias gradients'
    # all-reduces; the Partial loss seeds each rank's part, no all-reduce, as torch)
    mesh = wb.Mesh.grid((2,))
    x, w, b = _x((4, 6)), _x((8, 6), 1), _x((8,), 2)
    counts = []
    for custom in (True, False):
        dx = _dist(x, mesh, "S0").requires_grad_()
        dw, db = _dist(w, mesh, "R").requires_grad_(), _dist(b, mesh, "R").requires_grad_()
        with wb.trace(profile="a100") as tr:
            out = _Linear.apply(dx, dw, db) if custom else F.linear(dx, dw, db)
            (_Cube.apply(out, 0.5) if custom else out ** 3 * 0.5).pow(2).sum().backward()
        counts.append((dict(tr.counts()), tr.total_bytes()))
    assert counts[0] == counts[1] and counts[0][0] == {"all_reduce": 2}


def test_once_differentiable_double_backward_raises_as_torch():
    mesh = wb.Mesh.grid((2,))
    for dist in (False, True):
        x, v = _x((4, 4)), _x((4, 4), 1)
        if dist:
            x, v = _dist(x, mesh, "S0"), _dist(v, mesh, "S0")
        x, v = x.requires_grad_(), v.requires_grad_()      # v: a gradient that needs one
        y, _ = _SortedWithIndex.apply(x)
        (g,) = torch.autograd.grad(y, x, grad_outputs=v, create_graph=True)
        assert g.requires_grad
        with pytest.raises(RuntimeError, match="differentiate twice"):
            g.sum().backward()


class _MM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.T @ x


@pytest.mark.parametrize("layout", ["S0,S1", "row-parallel"])
def test_custom_function_on_a_2x2_mesh_with_partial_output(layout):
    # row-parallel: x and w split along the contraction: the Function's output is Partial
    mesh = wb.Mesh.grid((2, 2))
    x, w, b = _x((4, 6)), _x((8, 6), 1), _x((8,), 2)
    ps = [Shard(0), Shard(1)] if layout == "S0,S1" else [Replicate(), Shard(1)]
    dx = wb.shard_tensor(x, mesh, ps).requires_grad_()
    dw = wb.shard_tensor(w, mesh, [Replicate(), Shard(1)]).requires_grad_()
    db = wb.shard_tensor(b, mesh, [Replicate(), Replicate()]).requires_grad_()
    mid = _MM.apply(dx, dw)
    if layout == "row-parallel":
        assert any(p.is_partial() for p in mid.placements)
    y = _Cube.apply(mid, 0.5) + db
    refs = [t.clone().requires_grad_() for t in (x, w, b)]
    yr = _Cube.apply(_MM.apply(refs[0], refs[1]), 0.5) + refs[2]
    torch.testing.assert_close(y.full(), yr)
    g = _x((4, 8), 9)
    y.backward(g)
    yr.backward(g)
    for d, r in zip((dx, dw, db), refs):
        torch.testing.assert_close(d.grad.full(), r.grad)
