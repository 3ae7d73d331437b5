"""ops9: the fused ops against what F.rms_norm / scaled_dot_product_attention accept (torch
2.13, measured), and their torch_npu dispatch with torch_npu absent. Each fix's test failed
before it."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
import workbench.ops as ops

BACKENDS = ("reference", "unfused", "native")


def _rn(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed + 7 * sum(shape))
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _f_rms_norm(x, w, eps):
    with warnings.catch_warnings():          # "Mismatch dtype ... Cannot dispatch to fused"
        warnings.simplefilter("ignore")
        return F.rms_norm(x, tuple(w.shape), w, eps)


# ---- 1. rms_norm with a weight of another dtype, as F.rms_norm ---------------------------

MIXED = [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
         (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16),
         (torch.float32, torch.float64), (torch.float64, torch.float32)]


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize("xd, wd", MIXED)
def test_rms_norm_takes_a_weight_of_another_dtype_as_f_rms_norm(backend, xd, wd):
    """F.rms_norm returns x's dtype: (x_f32 * rstd) * weight in their promoted dtype, cast
    back; gradients in each input's dtype. Before: 'inputs must share one dtype'."""
    x0, w0, dy = _rn(4, 3, 16, dtype=xd), _rn(16, dtype=wd, seed=1), _rn(4, 3, 16, dtype=xd,
                                                                          seed=2)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    want = _f_rms_norm(x, w, 1e-6)
    dwant = torch.autograd.grad(want, (x, w), dy)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with ops.use(backend):
        got = ops.rms_norm(x, w, eps=1e-6)
    dgot = torch.autograd.grad(got, (x, w), dy)
    assert got.dtype == want.dtype == xd
    torch.testing.assert_close(got, want, rtol=0, atol=0)        # the same roundings
    for a, b in zip(dgot, dwant):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)


def test_rms_norm_float64_weight_multiplies_in_float64_as_f_rms_norm():
    """A float64 weight on float32 x: F.rms_norm multiplies in float64 then rounds once;
    casting the weight to float32 first (the old formula) rounds twice."""
    x, w = _rn(64, 33, dtype=torch.float32), _rn(33, seed=5) * 1.37
    want = _f_rms_norm(x, w, 1e-6)
    got = ops.rms_norm(x, w, eps=1e-6)
    assert torch.equal(got, want)


def test_rms_norm_unfused_mixed_returns_x_dtype_and_the_cost_counts_its_cast():
    x, w = _rn(4, 16, dtype=torch.bfloat16), _rn(16, dtype=torch.float32)
    with ops.use("unfused"):
        got = ops.rms_norm(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, _f_rms_norm(x, w, 1e-6), rtol=2e-2, atol=2e-2)
    same = ops.cost("rms_norm", x, w.bfloat16())
    mixed = ops.cost("rms_norm", x, w)
    # * weight reads a float32 weight (16 * 2 bytes more) and writes float32 (64 * 2 more);
    # a cast reads that (64 * 4) and writes bf16 (64 * 2)
    assert mixed.bytes_unfused - same.bytes_unfused == 16 * 2 + 64 * 2 + 64 * 4 + 64 * 2
    assert mixed.bytes_fused - same.bytes_fused == 16 * 2         # the weight's own bytes


def test_rms_norm_still_refuses_a_non_floating_weight():
    with pytest.raises(TypeError, match=r"weight.dtype is torch.int64; use one of"):
        ops.rms_norm(_rn(2, 8, dtype=torch.float32), torch.ones(8, dtype=torch.int64))


# ---- 2. flash_attention: dropout_p=1.0 and broadcast batch / heads, as sdpa -----------------

def _att(backend, *args, **kw):
    with ops.use(backend):
        return ops.flash_attention(*args, **kw)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_one_gives_zeros_and_zero_gradients_as_sdpa(backend, causal):
    """sdpa(dropout_p=1.0): all zeros, gradients all zero (torch's dropout multiplies by 0).
    Before: 'dropout_p=1.0; it must be in [0, 1)'."""
    q, k, v = (_rn(2, 4, 5 + i, 8, seed=i).requires_grad_() for i in (0, 2, 2))
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=1.0, is_causal=causal)
    dwant = torch.autograd.grad(want.sum(), (q, k, v))
    got = _att(backend, q, k, v, dropout_p=1.0, causal=causal)
    dgot = torch.autograd.grad(got.sum(), (q, k, v))
    assert bool((want == 0).all())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(dgot, dwant):
        assert bool((b == 0).all())
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("p", [1.5, -0.1, 1.0000001, float("nan")])
def test_dropout_outside_zero_one_is_refused_as_sdpa_refuses_it(p):
    q = _rn(1, 1, 3, 4)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q, q, dropout_p=p)
    with pytest.raises(ValueError, match=r"dropout_p=.*; it must be in \[0, 1\]"):
        ops.flash_attention(q, q, q, dropout_p=p)


def test_dropout_p_of_another_type_names_it():
    q = _rn(1, 1, 3, 4)
    with pytest.raises(TypeError, match=r"dropout_p='0.1'; give a float in \[0, 1\]"):
        ops.flash_attention(q, q, q, dropout_p="0.1")


# (q, k, v) batch and heads that sdpa(enable_gqa=True) takes on CPU (torch 2.13, measured)
BROADCAST = {
    "kv batch 1": ((2, 4), (1, 4), (1, 4)),
    "k batch 1 only": ((2, 4), (1, 4), (2, 4)),
    "q batch 1": ((1, 4), (2, 4), (2, 4)),
    "q and v batch 1": ((1, 4), (2, 4), (1, 4)),
    "kv batch 1 with gqa": ((2, 4), (1, 2), (1, 2)),
    "k 1 head, v 2 heads": ((2, 4), (2, 1), (2, 2)),
    "q batch 1, k 2 heads, v 4": ((1, 4), (2, 2), (2, 4)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(BROADCAST))
def test_batch_and_kv_heads_broadcast_as_sdpa_values_and_gradients(backend, name):
    """Before: 'k.shape=... and v.shape=... must share (batch, heads, seq), and batch with q'."""
    (bq, hq), (bk, hk), (bv, hv) = BROADCAST[name]
    q = _rn(bq, hq, 5, 8).requires_grad_()
    k = _rn(bk, hk, 7, 8, seed=1).requires_grad_()
    v = _rn(bv, hv, 7, 6, seed=2).requires_grad_()
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(0)) > 0.3
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    dwant = torch.autograd.grad(want.sum(), (q, k, v))
    got = _att(backend, q, k, v, mask=mask, **(
        {"tile_q": 2, "tile_k": 3} if backend == "reference" else {}))
    dgot = torch.autograd.grad(got.sum(), (q, k, v))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    for a, b in zip(dgot, dwant):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["kv batch 1", "k 1 head, v 2 heads"])
def test_broadcast_attention_on_meta_and_its_flops(name):
    (bq, hq), (bk, hk), (bv, hv) = BROADCAST[name]
    q, k, v = (torch.empty(b, h, 5, 8, device="meta") for b, h in ((bq, hq), (bk, hk), (bv, hv)))
    assert ops.flash_attention(q, k, v, causal=True).shape == (2, 4, 5, 8)
    c = ops.cost("flash_attention", q, k, v, causal=True)
    full = ops.cost("flash_attention", torch.empty(2, 4, 5, 8, device="meta"),
                    *(torch.empty(2, 4, 5, 8, device="meta") for _ in range(2)), causal=True)
    assert c.flops == full.flops and c.backward_flops == full.backward_flops


from tests.test_ops_pointwise import saved_bytes as _saved_bytes  # noqa: E402


@pytest.mark.parametrize("dropout_p", [0.0, 1.0])
@pytest.mark.parametrize("name", list(BROADCAST))
def test_broadcast_attention_cost_counts_what_is_saved(name, dropout_p):
    """A batch-1 input is copied to B by the unfused matmuls (and saved so); k and v of
    different head counts are copied to one count by the reference kernel."""
    (bq, hq), (bk, hk), (bv, hv) = BROADCAST[name]
    q, k, v = (_rn(b, h, s, 8, dtype=torch.float32, seed=i).requires_grad_()
               for i, (b, h, s) in enumerate(((bq, hq, 5), (bk, hk, 7), (bv, hv, 7))))
    c = ops.cost("flash_attention", q, k, v, causal=True, dropout_p=dropout_p)
    for backend, want in (("unfused", c.saved_bytes_unfused), ("reference", c.saved_bytes_fused)):
        with ops.use(backend):
            got = _saved_bytes(lambda: ops.flash_attention(q, k, v, causal=True,
                                                           dropout_p=dropout_p))
        assert got == want, backend


# what sdpa(enable_gqa=True) refuses: refused here, naming the shapes
REFUSED = {
    "batch 2 vs 3": ((2, 4, 5, 8), (3, 4, 7, 8), (3, 4, 7, 8), "batch sizes do not broadcast"),
    "q heads 2, kv heads 4": ((2, 2, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8),
                              "q heads to be a multiple of k heads and of v heads"),
    "q heads 1, kv heads 4": ((2, 1, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8),
                              "q heads to be a multiple of k heads and of v heads"),
    "q heads 4, v heads 3": ((2, 4, 5, 8), (2, 4, 7, 8), (2, 3, 7, 8),
                             "q heads to be a multiple of k heads and of v heads"),
    "head_dim": ((2, 4, 5, 8), (2, 4, 7, 1), (2, 4, 7, 8), "q head_dim 8 != k head_dim 1"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_sdpa_with_gqa_refuses_is_refused_naming_the_shapes(name):
    *shapes, message = REFUSED[name]
    q, k, v = (_rn(*s) for s in shapes)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=message):
            _att(backend, q, k, v)
    with pytest.raises(ValueError, match=message):
        ops.cost("flash_attention", q, k, v)


def test_keys_and_values_of_different_lengths_are_refused():
    """sdpa on CPU returns a number for k of 7 keys and v of 6 values (its flash kernel does
    not check; its math kernel raises): refused here."""
    q, k, v = _rn(2, 4, 5, 8), _rn(2, 4, 7, 8), _rn(2, 4, 6, 8)
    with pytest.raises(ValueError, match="k has 7 keys and v 6 values"):
        ops.flash_attention(q, k, v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [(0, 0, 0), (0, 2, 2)])
def test_no_query_heads_gives_the_empty_output_sdpa_gives(backend, heads):
    """Before: 'q has 0 heads, ...; grouped-query attention needs ...' (sdpa: (2, 0, 3, 4))."""
    q, k, v = (_rn(2, h, s, 4, seed=i).requires_grad_()
               for i, (h, s) in enumerate(zip(heads, (3, 5, 5))))
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    got = _att(backend, q, k, v, causal=True)
    assert got.shape == want.shape == (2, 0, 3, 4)
    grads = torch.autograd.grad(got.sum(), (q, k, v), allow_unused=True)
    assert [None if g is None else g.shape for g in grads] in (
        [q.shape, k.shape, v.shape], [q.shape, None, None])
    assert ops.cost("flash_attention", q, k, v).flops == 0


@pytest.mark.parametrize("heads", [(2, 0, 0), (0, 0, 2)])
def test_k_or_v_without_heads_is_refused(heads):
    """sdpa gives (2, 2, 3, 4) of uninitialised numbers for k, v without heads, and crashes
    the process (SIGFPE) for q and k without heads but v with 2: refused here."""
    q, k, v = (_rn(2, h, s, 4) for h, s in zip(heads, (3, 5, 5)))
    with pytest.raises(ValueError, match=r"each at least 1"):
        ops.flash_attention(q, k, v)


# ---- 3. linear as F.linear: a 1-d weight, a broadcast bias, no input features ---------------

LINEAR = {
    "1-d weight": ((3, 8), (8,), None),
    "1-d x and weight": ((8,), (8,), None),
    "bias (1,)": ((3, 8), (4, 8), (1,)),
    "bias ()": ((3, 8), (4, 8), ()),
    "bias (3, 1)": ((3, 8), (4, 8), (3, 1)),
    "bias (3, 4) on 3-d x": ((2, 3, 8), (4, 8), (3, 4)),
    "no input features": ((3, 0), (4, 0), (4,)),
    "no input features, 1-d weight": ((3, 0), (0,), None),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(LINEAR))
def test_linear_takes_what_f_linear_takes_values_and_gradients(backend, name):
    """Before: 'need weight (out, in)', 'bias.shape=(1,); expected (4,)', and the reference
    backward raised 'cannot reshape tensor of 0 elements into shape [-1, 0]'."""
    xs, ws, bs = LINEAR[name]
    args = [_rn(*xs).requires_grad_(), _rn(*ws, seed=1).requires_grad_()]
    if bs is not None:
        args.append(_rn(*bs, seed=2).requires_grad_())
    want = F.linear(*args)
    dy = _rn(*want.shape, seed=3)
    dwant = torch.autograd.grad(want, args, dy)
    with ops.use(backend):
        got = ops.linear(*args)
    dgot = torch.autograd.grad(got, args, dy)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    for a, b in zip(dgot, dwant):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)
    c = ops.cost("linear", *args)
    assert c.flops == 2 * want.numel() * xs[-1] + (want.numel() if bs is not None else 0)


@pytest.mark.parametrize("xs, ws, bs, message", [
    ((3, 8), (8,), (1,), r"weight.shape=\(8,\) is 1-d, which takes no bias"),
    ((3, 8), (4, 8), (2,), r"bias.shape=\(2,\) does not broadcast to the result's shape \(3, 4\)"),
    ((3, 8), (4, 8), (2, 3, 4), r"bias.shape=\(2, 3, 4\) does not broadcast"),
])
def test_linear_refuses_what_f_linear_refuses(xs, ws, bs, message):
    x, w, b = _rn(*xs), _rn(*ws), _rn(*bs)
    with pytest.raises(RuntimeError):
        F.linear(x, w, b)
    with pytest.raises(ValueError, match=message):
        ops.linear(x, w, b)


def test_linear_refuses_a_bias_torch_takes_or_not_by_memory_layout():
    """F.linear(contiguous 3-d x, w, bias (3, 1)) raises; the same x made non-contiguous
    gives a number (torch 2.13): refused here, naming the expand that works on both."""
    x, w, b = _rn(2, 3, 8), _rn(4, 8, seed=1), _rn(3, 1, seed=2)
    with pytest.raises(RuntimeError):
        F.linear(x, w, b)
    F.linear(x.transpose(0, 1).contiguous().transpose(0, 1), w, b)
    with pytest.raises(ValueError, match=r"bias.expand\(\*bias.shape\[:-1\], 4\)"):
        ops.linear(x, w, b)
    torch.testing.assert_close(ops.linear(x, w, b.expand(3, 4)), F.linear(x, w, b.expand(3, 4)))


# ---- 3. second derivatives: exact, or refused (never autograd's silent zeros) -------------

GRADGRAD = {
    "swiglu": (ops.swiglu, [(3, 6)]),
    "rotary_embedding": (ops.rotary_embedding, [(2, 5, 4), (5, 4), (5, 4)]),
    "rotary_embedding interleave": (lambda x, c, s: ops.rotary_embedding(x, c, s, "interleave"),
                                    [(2, 5, 4), (5, 4), (5, 4)]),
    "linear": (ops.linear, [(2, 3, 4), (5, 4), (5,)]),
    "rms_norm": (ops.rms_norm, [(3, 5), (5,)]),
}


@pytest.mark.parametrize("name", list(GRADGRAD))
def test_reference_backwards_are_twice_differentiable(name):
    """Before: @once_differentiable, so hessian() through the reference backend gave zeros."""
    fn, shapes = GRADGRAD[name]
    args = [_rn(*s, seed=i).requires_grad_() for i, s in enumerate(shapes)]
    with ops.use("reference"):
        assert torch.autograd.gradgradcheck(fn, args, eps=1e-6, atol=1e-5)
        h = torch.autograd.functional.hessian(lambda a: fn(a, *args[1:]).pow(2).sum(),
                                              args[0].detach())
    want = torch.autograd.functional.hessian(
        lambda a: GRADGRAD_REF[name](a, *[t.detach() for t in args[1:]]).pow(2).sum(),
        args[0].detach())
    torch.testing.assert_close(h, want)


def _rotate(x, mode):
    if mode == "half":
        a, b = x.chunk(2, -1)
        return torch.cat((-b, a), -1)
    p = x.unflatten(-1, (-1, 2))
    return torch.stack((-p[..., 1], p[..., 0]), -1).flatten(-2)


GRADGRAD_REF = {
    "swiglu": lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1],
    "rotary_embedding": lambda x, c, s: x * c + _rotate(x, "half") * s,
    "rotary_embedding interleave": lambda x, c, s: x * c + _rotate(x, "interleave") * s,
    "linear": F.linear,
    "rms_norm": lambda x, w: F.rms_norm(x, tuple(w.shape), w, 1e-6),
}


def test_flash_reference_second_derivative_raises_instead_of_zeros():
    """Its backward treats the saved log-sum-exp as a constant: no double backward (torch's
    fused kernels have none either). Before: hessian() returned zeros."""
    q = _rn(1, 2, 3, 4).requires_grad_()
    with ops.use("reference"):
        out = ops.flash_attention(q, q, q)
        with pytest.raises(RuntimeError, match="reference backward is not differentiable"):
            torch.autograd.functional.hessian(lambda a: ops.flash_attention(a, a, a).sum(),
                                              q.detach())
    g, = torch.autograd.grad(out.sum(), q, create_graph=True)    # first order still runs
    want = F.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(g, torch.autograd.grad(want.sum(), q)[0])
    with pytest.raises(RuntimeError, match="use wb.ops.use\\('unfused'\\)"):
        torch.autograd.grad(g.sum(), q)


# ---- 4. Cluster(None, n): get_profile's default, documented --------------------------------

def test_cluster_none_profile_is_get_profiles_default_and_says_so():
    from workbench.sim_mesh.profiles import DEFAULT_PROFILE, get_profile
    c = wb.plan.Cluster(None, 8)
    assert c.profile is get_profile(None) is get_profile(DEFAULT_PROFILE)
    assert str(c) == str(wb.plan.Cluster("a100", 8))
    doc = " ".join(wb.plan.Cluster.__doc__.split())
    assert "or None for :func:`~workbench.sim_mesh.profiles.get_profile`'s default" in doc
    assert f'(``DEFAULT_PROFILE``, ``"{DEFAULT_PROFILE}"``)' in doc


# ---- the torch_npu path (a stand-in torch_npu, as tests/test_npu_contracts.py) ---------------

from .test_npu_contracts import fake  # noqa: E402,F401  (the stand-in torch_npu fixture)


def test_public_ops_are_the_dispatch_tables_ops_each_with_an_npu_path():
    assert sorted(f.__name__ for f in ops.PUBLIC_OPS) == list(ops.op_names())
    assert all("npu" in ops.backends(name) for name in ops.op_names())


def test_npu_rms_norm_with_a_weight_of_another_dtype_runs_the_formula(fake):
    """npu_rms_norm's mixed-dtype contract is unconfirmed: the formula in torch ops instead,
    which gives F.rms_norm's numbers."""
    x, w = _rn(4, 16, dtype=torch.bfloat16), _rn(16, dtype=torch.float32, seed=1)
    got = ops.rms_norm(x, w)
    assert fake.calls == []
    torch.testing.assert_close(got, _f_rms_norm(x, w, 1e-6), rtol=0, atol=0)
    ops.rms_norm(x, w.bfloat16())
    assert [name for name, _ in fake.calls] == ["npu_rms_norm"]


def test_npu_attention_with_dropout_one_is_zeros_without_keep_prob_zero(fake):
    q, k, v = (_rn(2, 4, 6, 8, dtype=torch.float32, seed=i).requires_grad_() for i in range(3))
    out = ops.flash_attention(q, k, v, dropout_p=1.0)
    assert fake.calls[0][1]["keep_prob"] == 1.0
    assert bool((out == 0).all())
    assert all(bool((g == 0).all()) for g in torch.autograd.grad(out.sum(), (q, k, v)))


def test_npu_attention_gets_one_batch_and_one_kv_head_count(fake):
    q = _rn(2, 4, 6, 8, dtype=torch.float32).requires_grad_()
    k = _rn(1, 1, 6, 8, dtype=torch.float32, seed=1).requires_grad_()
    v = _rn(1, 2, 6, 8, dtype=torch.float32, seed=2).requires_grad_()
    got = ops.flash_attention(q, k, v)
    call = fake.calls[0][1]
    assert call["key"].shape == call["value"].shape == (2, 2, 6, 8)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)),
                    torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("op", ["flash_attention", "sdpa"])
def test_broadcast_batch_on_dist_tensors_is_refused_naming_the_expand(op):
    """On DistTensors (wb.ops.flash_attention or sdpa) a k/v batch of 1 raised "shape
    '[1, 2, 4, 8]' is invalid for input of size 0"; now a clear refusal, and its fix runs."""
    mesh = wb.Mesh.grid((2,))
    q, k, v = _rn(2, 2, 4, 8), _rn(1, 2, 4, 8, seed=1), _rn(1, 2, 4, 8, seed=2)
    fn = ops.flash_attention if op == "flash_attention" else F.scaled_dot_product_attention
    dq = wb.shard_tensor(q, mesh, [wb.Shard(0)])
    dk, dv = (wb.shard_tensor(t, mesh, [wb.Replicate()]) for t in (k, v))
    with pytest.raises(ValueError, match=r"must share the batch size .* k.expand\(2, -1, -1, -1\)"):
        fn(dq, dk, dv)
    out = fn(dq, dk.expand(2, -1, -1, -1), dv.expand(2, -1, -1, -1))
    torch.testing.assert_close(out.full(), F.scaled_dot_product_attention(q, k, v))


# ---- 3. arguments: each refusal names the argument, its value and the fix -----------------

_X = torch.ones(3, 8)
_Q = torch.ones(1, 2, 3, 4)
_LISTS = lambda: ([torch.ones(3)], [torch.ones(3)], [torch.zeros(3)], [torch.zeros(3)])  # noqa


@pytest.mark.parametrize("call, error, message", [
    # before: "tuple indices must be integers or slices, not float", "chunk(): argument 'dim'
    # ... must be int, not bool", "'<=' not supported between instances of 'int' and 'str'"
    (lambda: ops.swiglu(_X, 1.0), TypeError, r"swiglu: dim=1.0; give an int"),
    (lambda: ops.swiglu(_X, True), TypeError, r"swiglu: dim=True; give an int"),
    (lambda: ops.swiglu(_X, "a"), TypeError, r"swiglu: dim='a'; give an int"),
    (lambda: ops.swiglu(torch.tensor(1.0)), ValueError, r"swiglu: x is 0-d"),
    # before: IndexError: tuple index out of range
    (lambda: ops.rotary_embedding(torch.tensor(1.0), torch.ones(()), torch.ones(())),
     ValueError, r"rotary_embedding: x is 0-d; give x of shape \(\.\.\., head_dim\)"),
    # before: accepted as bool("yes") / bool(None); sdpa's is_causal refuses both
    (lambda: ops.flash_attention(_Q, _Q, _Q, causal="yes"), TypeError,
     r"causal='yes'; give True or False"),
    (lambda: ops.flash_attention(_Q, _Q, _Q, causal=None), TypeError,
     r"causal=None; give True or False"),
    (lambda: ops.flash_attention(_Q, _Q, _Q, tile_q=True), ValueError,
     r"tile_q=True; give a positive int"),
    (lambda: ops.flash_attention(_Q, _Q, _Q, dropout_p=True), TypeError,
     r"dropout_p=True; give a float in \[0, 1\]"),
    # before: "'<=' not supported between instances of 'int' and 'str'"
    (lambda: ops.adamw(*_LISTS(), 1, lr="0.1"), TypeError, r"adamw: lr='0.1'; give a real"),
    (lambda: ops.adamw(*_LISTS(), 1, lr=0.1, beta1=None), TypeError, r"adamw: beta1=None;"),
])
def test_bad_arguments_name_the_argument_value_and_fix(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_causal_rejection_matches_sdpa_and_a_zero_d_dropout_tensor_is_taken_as_sdpa():
    with pytest.raises(TypeError, match="is_causal"):
        F.scaled_dot_product_attention(_Q, _Q, _Q, is_causal="yes")
    q = _rn(1, 2, 3, 4)
    for backend in BACKENDS:
        torch.testing.assert_close(_att(backend, q, q, q, dropout_p=torch.tensor(0.0)),
                                   F.scaled_dot_product_attention(q, q, q,
                                                                  dropout_p=torch.tensor(0.0)))


def test_return_lse_has_the_broadcast_batch():
    q, k, v = _rn(1, 2, 3, 4), _rn(1, 2, 5, 4, seed=1), _rn(2, 2, 5, 4, seed=2)
    out, lse = ops.flash_attention(q, k, v, return_lse=True)
    assert out.shape == (2, 2, 3, 4) and lse.shape == (2, 2, 3)
    torch.testing.assert_close(lse[1], torch.logsumexp(q[0] @ k[0].transpose(-1, -2) / 2, -1))


def test_rms_norm_mixed_dtypes_on_dist_tensors_as_on_one_device():
    mesh = wb.Mesh.grid((2,))
    x, w = _rn(4, 8, dtype=torch.bfloat16), _rn(8, dtype=torch.float32, seed=1)
    want = _f_rms_norm(x, w, 1e-6)
    dx = wb.shard_tensor(x, mesh, [wb.Shard(0)])
    dw = wb.shard_tensor(w, mesh, [wb.Replicate()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for out in (ops.rms_norm(dx, dw, 1e-6), F.rms_norm(dx, (8,), dw, 1e-6)):
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.full(), want, rtol=0, atol=0)


@pytest.mark.parametrize("xd, wd", MIXED)
def test_rms_norm_mixed_cost_counts_what_is_saved(xd, wd):
    x, w = _rn(4, 16, dtype=xd).requires_grad_(), _rn(16, dtype=wd, seed=1).requires_grad_()
    c = ops.cost("rms_norm", x, w)
    for backend, want in (("reference", c.saved_bytes_fused), ("unfused", c.saved_bytes_unfused)):
        with ops.use(backend):
            assert _saved_bytes(lambda: ops.rms_norm(x, w)) == want, backend
