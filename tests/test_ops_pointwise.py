"""rms_norm, swiglu, rotary_embedding, linear: every backend against the reference
(forward and backward, fp32 / bf16 / fp16), the references against the papers'
formulas in float64, and the errors."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import workbench.ops as ops
from workbench.ops.testing import assert_close

FAST = settings(max_examples=20, deadline=None)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PATHS = ("unfused", "native")


def randn(*shape, dtype=torch.float32, seed=0, grad=True):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return t.to(dtype).requires_grad_(grad)


def paths_agree(op, inputs, kwargs=None, dout_seed=9):
    """Run ``op`` on every path; outputs and input gradients must match the reference."""
    kwargs = kwargs or {}
    results = {}
    for backend in ("reference", *PATHS):
        with ops.use(backend):
            out = op(*inputs, **kwargs)
        dout = randn(*out.shape, dtype=out.dtype, seed=dout_seed, grad=False)
        diff = [t for t in inputs if t.requires_grad]
        results[backend] = (out, *torch.autograd.grad(out, diff, dout))
    for backend in PATHS:
        for i, (a, b) in enumerate(zip(results[backend], results["reference"])):
            assert a.dtype == b.dtype == inputs[0].dtype
            assert_close(a, b, f"{op.__name__} {backend} output/grad #{i}")
    return results["reference"]


# --- RMSNorm -------------------------------------------------------------------------


@FAST
@given(lead=st.lists(st.integers(1, 5), min_size=0, max_size=3), n=st.integers(1, 70),
       two_dims=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_rms_norm_paths(lead, n, two_dims, dtype):
    norm_shape = (3, n) if two_dims else (n,)
    x = randn(*lead, *norm_shape, dtype=dtype, seed=n)
    w = randn(*norm_shape, dtype=dtype, seed=n + 1)
    paths_agree(ops.rms_norm, (x, w), dict(eps=0.5))     # large: a dropped eps shows


def test_rms_norm_reference_is_the_formula_in_float64():
    x, w = randn(4, 7, 16, dtype=torch.float64), randn(16, dtype=torch.float64, seed=1)
    with ops.use("reference"):
        got = ops.rms_norm(x, w, eps=1e-6)
        assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, w), (x[:2, :2], w))
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w   # Zhang & Sennrich eq. 4
    assert_close(got, want)


# --- SwiGLU --------------------------------------------------------------------------


@FAST
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), half=st.integers(1, 40),
       dtype=st.sampled_from(DTYPES), data=st.data())
def test_swiglu_paths(shape, half, dtype, data):
    dim = data.draw(st.integers(-len(shape) - 1, len(shape)))
    full = list(shape)
    full.insert(dim % (len(shape) + 1), 2 * half)
    x = randn(*full, dtype=dtype, seed=half)
    paths_agree(ops.swiglu, (x,), dict(dim=dim))


def test_swiglu_reference_is_the_formula_in_float64():
    x = randn(3, 10, dtype=torch.float64)
    with ops.use("reference"):
        got = ops.swiglu(x, dim=-1)
        assert torch.autograd.gradcheck(ops.swiglu, (x,))
    a, b = x[:, :5], x[:, 5:]
    assert_close(got, a * torch.sigmoid(a) * b)              # Shazeer 2020, eq. 6 (no bias)


# --- RoPE ----------------------------------------------------------------------------


@FAST
@given(B=st.integers(1, 2), H=st.integers(1, 3), S=st.integers(1, 33),
       half_d=st.integers(1, 12), mode=st.sampled_from(["half", "interleave"]),
       dtype=st.sampled_from(DTYPES), cos_grad=st.booleans())
def test_rotary_paths(B, H, S, half_d, mode, dtype, cos_grad):
    x = randn(B, H, S, 2 * half_d, dtype=dtype, seed=S)
    cos, sin = ops.rope_cos_sin(S, 2 * half_d, mode=mode, dtype=dtype)
    cos, sin = cos.requires_grad_(cos_grad), sin.requires_grad_(cos_grad)
    paths_agree(ops.rotary_embedding, (x, cos, sin), dict(mode=mode))


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_is_a_rotation_that_encodes_relative_position(mode):
    """RoFormer eq. 16: <R(m) q, R(n) k> depends on m - n only; norms are preserved."""
    D, S = 16, 12
    cos, sin = ops.rope_cos_sin(S, D, mode=mode, dtype=torch.float64)
    q, k = randn(D, dtype=torch.float64, grad=False), randn(D, dtype=torch.float64, seed=1,
                                                             grad=False)
    with ops.use("reference"):
        rq = ops.rotary_embedding(q.expand(S, D), cos, sin, mode=mode)     # (S, D)
        rk = ops.rotary_embedding(k.expand(S, D), cos, sin, mode=mode)
    scores = rq @ rk.T                                                      # (S, S)
    for offset in range(-3, 4):
        diag = torch.diagonal(scores, offset)
        assert_close(diag, diag[:1].expand_as(diag), f"offset {offset}")
    assert_close(rq.norm(dim=-1), q.norm().expand(S))


def test_rotary_half_and_interleave_are_the_same_rotation_with_features_permuted():
    D, S = 8, 5
    x = randn(2, S, D, dtype=torch.float64, grad=False)
    perm = torch.arange(D).view(2, D // 2).T.reshape(-1)        # 0, 4, 1, 5, ...: pairs adjacent
    ch, sh = ops.rope_cos_sin(S, D, mode="half", dtype=torch.float64)
    ci, si = ops.rope_cos_sin(S, D, mode="interleave", dtype=torch.float64)
    with ops.use("reference"):
        half = ops.rotary_embedding(x, ch, sh, mode="half")
        inter = ops.rotary_embedding(x[..., perm], ci, si, mode="interleave")
    assert_close(inter, half[..., perm])


def test_rotary_gradcheck():
    x = randn(1, 2, 3, 4, dtype=torch.float64)
    cos, sin = (t.requires_grad_() for t in ops.rope_cos_sin(3, 4, dtype=torch.float64))
    with ops.use("reference"):
        for mode in ("half", "interleave"):
            assert torch.autograd.gradcheck(
                lambda x, c, s: ops.rotary_embedding(x, c, s, mode=mode), (x, cos, sin))


# --- linear --------------------------------------------------------------------------


@FAST
@given(lead=st.lists(st.integers(1, 5), min_size=0, max_size=2), n_in=st.integers(1, 40),
       n_out=st.integers(1, 40), bias=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_linear_paths(lead, n_in, n_out, bias, dtype):
    x = randn(*lead, n_in, dtype=dtype, seed=n_in)
    w = randn(n_out, n_in, dtype=dtype, seed=n_out) / n_in ** 0.5
    b = (randn(n_out, dtype=dtype, seed=3),) if bias else ()
    inputs = (x, w.detach().requires_grad_(), *b)
    ref = paths_agree(ops.linear, inputs)
    assert_close(ref[0], F.linear(*inputs))


# --- saved memory, measured against the cost model -----------------------------------


def saved_bytes(fn):
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("name, make", [
    ("rms_norm", lambda: (randn(8, 64), randn(64, seed=1))),
    ("swiglu", lambda: (randn(8, 64),)),
    ("rotary_embedding", lambda: (randn(2, 4, 8, 16), *ops.rope_cos_sin(8, 16))),
    ("linear", lambda: (randn(8, 32), randn(16, 32, seed=1), randn(16, seed=2))),
])
def test_saved_bytes_match_the_cost_model(name, make):
    inputs = make()
    op = getattr(ops, name)
    c = ops.cost(name, *inputs)
    with ops.use("reference"):
        assert saved_bytes(lambda: op(*inputs)) == c.saved_bytes_fused
    with ops.use("unfused"):
        assert saved_bytes(lambda: op(*inputs)) == c.saved_bytes_unfused


# --- errors --------------------------------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda: ops.rms_norm(randn(4, 8), randn(7)), r"weight.shape=\(7,\) must equal the trailing"),
    (lambda: ops.rms_norm(randn(4, 8), randn(8).long()), "weight.dtype is torch.int64"),
    (lambda: ops.rms_norm(randn(4, 8), randn(8), eps=-1.0), "eps=-1.0; it must be >= 0"),
    (lambda: ops.rms_norm(randn(4, 8).long(), randn(8)), "x.dtype is torch.int64"),
    (lambda: ops.swiglu(randn(4, 7)), r"x.shape\[-1\]=7 is odd"),
    (lambda: ops.swiglu(randn(4, 8), dim=2), "dim=2 is out of range"),
    (lambda: ops.rotary_embedding(randn(2, 8), *ops.rope_cos_sin(2, 8), mode="neox"),
     "mode='neox'; use 'half'"),
    (lambda: ops.rotary_embedding(randn(3, 8), *ops.rope_cos_sin(2, 8)),
     r"cos.shape=\(2, 8\) must broadcast to x.shape=\(3, 8\)"),
    (lambda: ops.rotary_embedding(randn(2, 7), randn(2, 7), randn(2, 7)), "is odd"),
    (lambda: ops.rope_cos_sin(4, 7), "head_dim must be even"),
    (lambda: ops.linear(randn(4, 8), randn(3, 7)), r"weight.shape=\(3, 7\); need weight"),
    (lambda: ops.linear(randn(4, 8), randn(3, 8), randn(4)),
     r"bias.shape=\(4,\) does not broadcast to the result.s shape \(4, 3\); expected \(3,\)"),
    (lambda: ops.linear([1.0], randn(3, 8)), "x must be a torch.Tensor, got list"),
])
def test_errors_name_the_argument(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()
