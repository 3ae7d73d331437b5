"""perf10: the dispatcher's per-call shortcuts and memos give the answers they replace.

Each memo or shortcut added to the hot path (benchmarks/sim_overhead.py --only ops) is
held here to what it replaces: two calls that differ in one field of its key give
different, correct answers (torch's own, or the single-device reference).  No timing.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import dispatch as D
from workbench.parallel.dispatch_local import VALIDATE
from workbench.parallel.ops_table import _util, norm
from workbench.parallel.tensor_methods import METHOD_HOOKS

R, S, P = wb.Replicate(), wb.Shard, wb.Partial


@pytest.fixture
def mesh():
    return wb.Mesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])


# ---- broadcast_shapes: torch's answer, memoized --------------------------------------

@pytest.mark.parametrize("shapes", [
    ((2, 1, 3), (4, 1)), ((2, 1, 3), (4, 3)), ((), (5,)), ((0, 1), (1, 3)), ((1,), (0,)),
    ((2, 2, 2, 64, 64), (2, 2, 1, 1, 64)), (torch.Size([3, 1]), torch.Size([1, 7])), ()])
def test_broadcast_shapes_is_torchs(shapes):
    want = torch.broadcast_shapes(*shapes)
    for _ in range(2):                      # the second call reads the memo
        got = _util.broadcast_shapes(*shapes)
        assert got == want and type(got) is torch.Size


def test_broadcast_shapes_key_is_every_size():
    # shapes differing in one size: different answers, each torch's
    assert _util.broadcast_shapes((2, 1), (1, 3)) == (2, 3)
    assert _util.broadcast_shapes((2, 1), (1, 4)) == (2, 4)
    assert _util.broadcast_shapes((2, 1), (1, 1, 4)) == (1, 2, 4)


@pytest.mark.parametrize("shapes", [((2, 3), (4, 3)), ((0,), (3,)), ((2, 3), (3, 2))])
def test_broadcast_shapes_refuses_as_torch(shapes):
    with pytest.raises(RuntimeError) as theirs:
        torch.broadcast_shapes(*shapes)
    for _ in range(2):                      # a refusal is never memoized as an answer
        with pytest.raises(RuntimeError) as ours:
            _util.broadcast_shapes(*shapes)
        assert str(ours.value) == str(theirs.value)


def test_broadcast_shapes_hands_other_forms_to_torch():
    assert _util.broadcast_shapes(3, (2, 3)) == torch.broadcast_shapes(3, (2, 3))
    with pytest.raises(ValueError, match="negative"):        # torch's own refusal
        _util.broadcast_shapes((-1, 2), (2,))


# ---- layer_norm's dtype check: keyed on the dtypes and autocast -----------------------

def _torch_refuses(x_dt, w_dt, b_dt):
    try:
        F.layer_norm(torch.empty(0, 4, dtype=x_dt), (4,), torch.empty(4, dtype=w_dt),
                     torch.empty(4, dtype=b_dt), 1e-5)
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize("autocast", [False, True])
def test_layer_norm_dtype_check_key(autocast):
    x32 = torch.randn(3, 4)
    w32, wbf = torch.randn(4), torch.randn(4).bfloat16()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.no_grad()
    with ctx:
        for _ in range(2):
            norm._check_dtypes(x32, w32, w32, (4,), 1e-5)     # accepted, then memoized
        refuses = _torch_refuses(torch.float32, torch.bfloat16, torch.bfloat16)
        for _ in range(2):                       # differs in the weight's dtype only
            if refuses:
                with pytest.raises(RuntimeError, match="layer_norm"):
                    norm._check_dtypes(x32, wbf, wbf, (4,), 1e-5)
            else:
                norm._check_dtypes(x32, wbf, wbf, (4,), 1e-5)


def test_layer_norm_dtype_check_refusal_reaches_a_dist_layer_norm(mesh):
    torch.manual_seed(0)
    x = wb.shard_tensor(torch.randn(4, 6), mesh, [S(0), R])
    w = wb.shard_tensor(torch.randn(6), mesh, [R, R])
    out = F.layer_norm(x, (6,), w, w)
    torch.testing.assert_close(out.full(), F.layer_norm(x.full(), (6,), w.full(), w.full()))
    if _torch_refuses(torch.float32, torch.bfloat16, torch.bfloat16):
        wbf = wb.shard_tensor(torch.randn(6).bfloat16(), mesh, [R, R])
        with pytest.raises(RuntimeError):
            F.layer_norm(x, (6,), wbf, wbf)


# ---- pointwise: the 0-d promotion memo and align's shortcut ---------------------------

def test_pointwise_zero_dim_promotion_per_layout(mesh):
    torch.manual_seed(0)
    X = torch.randn(8, 4).bfloat16()
    s32 = torch.tensor(1.3)
    x = wb.shard_tensor(X, mesh, [S(0), R])
    s = wb.shard_tensor(s32, mesh, [R, R])
    y = wb.shard_tensor(torch.randn(8, 4).bfloat16(), mesh, [S(0), R])
    for _ in range(2):
        a = x * s                             # a 0-d f32 does not promote a bf16 tensor
        assert a.dtype == torch.bfloat16 == (X * s32).dtype
        torch.testing.assert_close(a.full(), X * s32, rtol=0, atol=0)
        b = x * y                             # same shapes: nothing to promote
        torch.testing.assert_close(b.full(), X * y.full(), rtol=0, atol=0)


def test_pointwise_align_of_different_ranks(mesh):
    torch.manual_seed(0)
    X, B3, V = torch.randn(8, 4, 3), torch.randn(4, 3), torch.randn(3)
    x = wb.shard_tensor(X, mesh, [S(0), S(1)])
    b = wb.shard_tensor(B3, mesh, [R, S(0)])
    v = wb.shard_tensor(V, mesh, [R, R])
    for _ in range(2):
        torch.testing.assert_close((x + b).full(), X + B3)       # ranks 3 and 2
        torch.testing.assert_close((x + v).full(), X + V)        # ranks 3 and 1
        torch.testing.assert_close((x + x).full(), X + X)        # one rank
        torch.testing.assert_close(torch.where(x > 0, x, v).full(), torch.where(X > 0, X, V))


# ---- run_prepared: kept first copy and per-input shortcuts ----------------------------

def test_replicated_output_kept_once_with_and_without_validation(mesh):
    torch.manual_seed(0)
    X, W = torch.randn(8, 6), torch.randn(6, 5)
    x = wb.shard_tensor(X, mesh, [S(0), R])
    w = wb.shard_tensor(W, mesh, [R, R])
    want = X @ W
    for check in (False, True):
        VALIDATE.append(check)
        try:
            for _ in range(2):
                out = x @ w                   # replicated on tp, computed per rank there
                assert out.placements == (S(0), R)
                assert out._local.shape[1] == 1       # one copy stored
                torch.testing.assert_close(out.full(), want)
        finally:
            VALIDATE.pop()


def test_prepared_op_reused_across_storage_forms(mesh):
    """Equal specs, a compact replicated local and an expanded one: the prepared op's
    shortcuts read the storage at each call."""
    torch.manual_seed(0)
    X, W = torch.randn(8, 6), torch.randn(6, 4)
    w = wb.shard_tensor(W, mesh, [R, R])                 # stored once: (1, 1, 6, 4)
    w2 = wb.from_local([W] * 4, mesh, [R, R])           # the same layout, other storage
    assert w.spec == w2.spec
    x = wb.shard_tensor(X, mesh, [S(0), R])
    for ww in (w, w2, w):
        got = wb.reshard(x @ ww, mesh, [R, R]).full()
        torch.testing.assert_close(got, X @ W)
        torch.testing.assert_close((ww + ww).full(), W + W)


def test_gather_memo_per_input_layout_gradients(mesh):
    """The gradient of a replicated weight read per rank by two ops (one way back,
    memoized facts per prepared op) and of a tp-sharded one: the single-device gradients,
    and the trace's reductions as before, step after step."""
    torch.manual_seed(0)
    X, W1, W2 = torch.randn(8, 6), torch.randn(6, 6), torch.randn(6, 6)
    x = wb.shard_tensor(X, mesh, [S(0), R])
    for step in range(2):
        w1 = wb.shard_tensor(W1, mesh, [R, R]).requires_grad_()
        w2 = wb.shard_tensor(W2, mesh, [R, S(1)]).requires_grad_()
        with wb.trace() as tr:
            y = (x @ w1 + x @ w1) @ w2
            y.sum().backward()
        a, b = W1.clone().requires_grad_(), W2.clone().requires_grad_()
        ((X @ a + X @ a) @ b).sum().backward()
        torch.testing.assert_close(w1.grad.full(), a.grad)
        torch.testing.assert_close(w2.grad.full(), b.grad)
        labels = [e.label for e in tr.events if (e.label or "").startswith("grad of")]
        # x's gradient is not asked for: the weights' ways only, one per input and layout
        # (w1's two readers meet on one way), as before the memo (same trace every step)
        dp = "grad of a replicated input P(sum)->R on dp"
        tp = "grad of a replicated input P(sum)->R on tp"
        assert labels == [dp, dp, tp, tp, dp, dp]


# ---- tensor methods kept on the class ------------------------------------------------

def test_tensor_method_cached_on_class_reads_hooks_each_call(mesh):
    x = wb.shard_tensor(torch.arange(8.).reshape(2, 4), mesh, [R, S(1)])
    assert x.flatten().shape == (8,)
    assert "flatten" in type(x).__dict__              # kept after the first lookup
    METHOD_HOOKS["flatten"] = lambda self, args, kwargs: "hooked"
    try:
        assert x.flatten() == "hooked"                # a hook added later is still read
    finally:
        del METHOD_HOOKS["flatten"]
    assert x.flatten().shape == (8,)


def test_tensor_method_lookup_refusals_unchanged(mesh):
    x = wb.shard_tensor(torch.ones(2, 4), mesh, [R, S(1)])
    assert not hasattr(x, "no_such_method")
    assert "no_such_method" not in type(x).__dict__
    with pytest.raises(AttributeError, match="no attribute '_private'"):
        x._private
    x.mul_(3)                                         # in place, through the cached method
    x.mul_(2)
    torch.testing.assert_close(x.full(), torch.full((2, 4), 6.))


# ---- dispatch: meshes, strides, spec -------------------------------------------------

def test_inputs_on_two_meshes_still_refused(mesh):
    other = wb.Mesh([[4, 5], [6, 7]], dim_names=["dp", "tp"])
    a = wb.shard_tensor(torch.ones(4, 4), mesh, [S(0), R])
    b = wb.shard_tensor(torch.ones(4, 4), other, [S(0), R])
    with pytest.raises(ValueError, match="different meshes"):
        a + b


def test_strides_tracked_after_an_input_kept_them(mesh):
    X = torch.randn(4, 6)
    x = wb.shard_tensor(X, mesh, [R, R])
    t = x.t()
    assert t.stride() == X.t().stride()
    assert (t * 2).stride() == (X.t() * 2).stride()
    assert (x * 2).stride() == (X * 2).stride()


def test_dist_tensor_keeps_given_tuple_and_size(mesh):
    loc = torch.zeros(1, 1, 4)
    d = wb.DistTensor(loc, mesh, [R, R], [4])
    assert type(d.placements) is tuple and type(d.shape) is torch.Size and d.shape == (4,)
    ps, sz = (R, R), torch.Size([4])
    e = wb.DistTensor(loc, mesh, ps, sz)
    assert e.placements is ps and e.shape is sz


def test_prepared_key_keeps_profile_and_attrs(mesh):
    x = wb.shard_tensor(torch.randn(8, 4), mesh, [S(0), R])
    a = x.sum(0)
    b = x.sum(1)
    torch.testing.assert_close(a.full(), x.full().sum(0))
    torch.testing.assert_close(b.full(), x.full().sum(1))
    n = len(D._PREPARED)
    x.sum(0)
    assert len(D._PREPARED) == n                      # the same op read from the cache
