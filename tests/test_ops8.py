"""ops8: the fused ops probed as an adversarial user would (against PyTorch's own ops),
and the fixes that probing led to: each fix's test failed before it."""
import pytest
import torch
import torch.nn.functional as F

import workbench.ops as ops

BACKENDS = ("reference", "unfused", "native")


def _rn(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, dtype=dtype)


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


# ---- held right: attention against scaled_dot_product_attention ------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Sq, Sk", [(5, 9), (9, 5)])
def test_causal_with_unequal_lengths_is_top_left_as_sdpa_values_and_gradients(backend, Sq, Sk):
    q, k, v = (_rn(2, 4, s, 6, seed=i).requires_grad_() for i, s in enumerate((Sq, Sk, Sk)))
    k2, v2 = k[:, ::2].detach().requires_grad_(), v[:, ::2].detach().requires_grad_()   # GQA
    want = F.scaled_dot_product_attention(q, k2, v2, is_causal=True, enable_gqa=True)
    dwant = torch.autograd.grad(want.sum(), (q, k2, v2))
    with ops.use(backend):
        got = ops.flash_attention(q, k2, v2, causal=True, **(
            {"tile_q": 2, "tile_k": 3} if backend == "reference" else {}))   # tiles not dividing
    dgot = torch.autograd.grad(got.sum(), (q, k2, v2))
    torch.testing.assert_close(got, want)
    for a, b in zip(dgot, dwant):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fully_masked_row_gives_zeros_as_sdpa_does_and_finite_gradients(backend):
    q, k, v = _rn(2, 2, 5, 4).requires_grad_(), _rn(2, 2, 7, 4), _rn(2, 2, 7, 4)
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[0, 0, 2] = False                                 # row 2 of batch 0: no key at all
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with ops.use(backend):
        got = ops.flash_attention(q, k, v, mask=mask)
    torch.testing.assert_close(got, want)
    assert bool((got[0, :, 2] == 0).all())
    (dq,) = torch.autograd.grad(got.sum(), (q,))
    assert bool(dq.isfinite().all()) and bool((dq[0, :, 2] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_output_dtype_and_noncontiguous_inputs_as_sdpa(backend, dtype):
    q, k, v = (_rn(2, 9, 3, 8, dtype=dtype, seed=i).transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    with ops.use(backend):
        got = ops.flash_attention(q, k, v, causal=True, scale=0.3)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


# ---- fixed: head_dim 0 raised ZeroDivisionError (1/sqrt(0)); torch returns mean(v) -----

@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_zero_gives_what_sdpa_gives_instead_of_zero_division(backend):
    q, k, v = _rn(1, 2, 3, 0), _rn(1, 2, 4, 0), _rn(1, 2, 4, 5)
    want = F.scaled_dot_product_attention(q, k, v)           # every score 0: the mean of v
    with ops.use(backend):
        got = ops.flash_attention(q, k, v)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, v.mean(2, keepdim=True).expand(1, 2, 3, 5))


# ---- fixed: adamw wrote some tensors, then failed on a mixed-dtype group ---------------

def _adamw_lists(what):
    p, g = [_rn(4), _rn(3, seed=1)], [_rn(4, seed=2), _rn(3, seed=3)]
    m, v = [torch.zeros(4, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)], \
        [torch.zeros(4, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)]
    lists = dict(params=p, grads=g, exp_avgs=m, exp_avg_sqs=v)
    lists[what][1] = lists[what][1].float()
    return lists


@pytest.mark.parametrize("what", ["grads", "exp_avgs", "exp_avg_sqs"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_refuses_a_state_in_another_dtype_before_writing_anything(backend, what):
    lists = _adamw_lists(what)
    before = {n: [t.clone() for t in s] for n, s in lists.items()}
    with ops.use(backend), pytest.raises(TypeError, match=rf"{what}\[1\] is torch.float32 .* "
                                                          r"params\[1\] is torch.float64.*\.to\("):
        ops.adamw(*lists.values(), 1, lr=0.1)
    for n, s in lists.items():                           # nothing stepped, nothing half-done
        for a, b in zip(s, before[n]):
            assert torch.equal(a, b), n


def test_adamw_refuses_a_bool_step_and_the_cost_of_lists_it_refuses():
    one = [[torch.zeros(2)] for _ in range(4)]
    with pytest.raises(ValueError, match="step=True"):
        ops.adamw(*one, True, lr=0.1)
    with pytest.raises(ValueError, match=r"shape=\(3,\) differs"):
        ops.cost("adamw", [meta(2)], [meta(3)], [meta(2)], [meta(2)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_three_steps_equal_torch_optim_adamw(backend, dtype):
    ps = [_rn(5, 3, dtype=dtype), _rn(4, dtype=dtype, seed=1)]
    a = [p.clone().requires_grad_() for p in ps]
    b = [p.clone().requires_grad_() for p in ps]
    oa = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1, foreach=False)
    with ops.use(backend):
        ob = ops.AdamW(b, lr=1e-2, weight_decay=0.1)
        for step in range(3):
            for pa, pb in zip(a, b):
                pa.grad = _rn(*pa.shape, dtype=dtype, seed=10 + step)
                pb.grad = pa.grad.clone()
            oa.step(), ob.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pb, pa)


# ---- fixed: cost() priced calls the op refuses (a number for a call that cannot run) ---

@pytest.mark.parametrize("op, args", [
    ("flash_attention", (meta(2, 6, 8, 4), meta(2, 4, 8, 4), meta(2, 4, 8, 4))),   # 6 % 4
    ("flash_attention", (meta(6, 8, 4), meta(6, 8, 4), meta(6, 8, 4))),            # 3-d
    ("flash_attention", (meta(2, 2, 8, 4), meta(2, 2, 8, 5), meta(2, 2, 8, 4))),   # D
    ("rms_norm", (meta(8, 16), meta(7))),
    ("linear", (meta(8, 64), meta(32, 63))),
    ("linear", (meta(8, 64), meta(32, 64), meta(31))),
    ("swiglu", (meta(8, 1023),)),
    ("rotary_embedding", (meta(2, 5, 8), meta(5, 4), meta(5, 4))),
])
def test_cost_refuses_what_the_op_refuses(op, args):
    with pytest.raises(ValueError, match=op):
        ops.cost(op, *args)


def test_cost_still_counts_valid_calls_by_the_formulas():
    b, h, s, d = 2, 4, 64, 16
    qkv = (meta(b, h, s, d),) * 3
    assert ops.cost("flash_attention", *qkv).flops == 4 * b * h * s * s * d     # FA2 paper
    causal = ops.cost("flash_attention", *qkv, causal=True)
    assert causal.flops == 4 * b * h * d * s * (s + 1) // 2                     # ~half
    assert causal.backward_flops == 10 * b * h * d * s * (s + 1) // 2           # 2.5x
    assert ops.cost("rms_norm", meta(8, 16), meta(16)).flops == 4 * 8 * 16
    assert ops.cost("linear", meta(8, 64), meta(32, 64)).flops == 2 * 8 * 64 * 32


def test_rms_norm_eps_tensor_says_give_a_float_not_that_it_is_negative():
    x, w = _rn(3, 8), torch.ones(8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"eps=tensor\(1.0000e-06.*Python float"):
        ops.rms_norm(x, w, torch.tensor(1e-6))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (8,), w, 1e-6))


# ---- npu: without torch_npu, use('npu') raises naming the fix -------------------------

def _npu_calls():
    q = _rn(1, 2, 1, 4)
    cos, sin = ops.rope_cos_sin(3, 4, dtype=torch.float64)
    return {
        "flash_attention": lambda: ops.flash_attention(q, q, q),
        "rms_norm": lambda: ops.rms_norm(_rn(2, 4), torch.ones(4, dtype=torch.float64)),
        "swiglu": lambda: ops.swiglu(_rn(2, 4)),
        "rotary_embedding": lambda: ops.rotary_embedding(_rn(3, 4), cos, sin),
        "paged_attention": lambda: ops.paged_attention(q, _rn(2, 2, 2, 4), _rn(2, 2, 2, 4),
                                                       torch.tensor([[1]]), torch.tensor([2])),
    }


@pytest.mark.parametrize("op", sorted(_npu_calls()))
def test_npu_backend_without_torch_npu_raises_naming_the_fix(op):
    from workbench.npu.device import probe
    if probe().module is not None:
        pytest.skip("torch_npu is installed here")
    with ops.use("npu"), pytest.raises(RuntimeError, match=r"torch_npu is not installed.*"
                                                          r"use\('native'\)"):
        _npu_calls()[op]()


def test_npu_linear_and_adamw_are_plain_torch_kernels_that_run_anywhere():
    """Their npu paths are F.linear and the foreach kernels (torch_npu implements both),
    so without torch_npu they give native's numbers rather than raising."""
    x, w, b = _rn(3, 4), _rn(2, 4, seed=1), _rn(2, seed=2)
    with ops.use("npu"):
        torch.testing.assert_close(ops.linear(x, w, b), F.linear(x, w, b))
    lists = [[_rn(3)], [_rn(3, seed=1)], [torch.zeros(3, dtype=torch.float64)],
             [torch.zeros(3, dtype=torch.float64)]]
    twin = [[t.clone() for t in s] for s in lists]
    with ops.use("npu"):
        ops.adamw(*lists, 1, lr=0.1)
    with ops.use("native"):
        ops.adamw(*twin, 1, lr=0.1)
    for a, c in zip(lists, twin):
        torch.testing.assert_close(a[0], c[0])


def test_a_broadcast_mask_costs_its_own_bytes_not_its_broadcast_view():
    q = meta(2, 4, 64, 16)
    base = ops.cost("flash_attention", q, q, q)
    for mask in (torch.ones(2, 1, 1, 64, dtype=torch.bool),      # key padding: B * Sk
                 torch.ones(64, 64, dtype=torch.bool).tril()):   # one (Sq, Sk) for all
        c = ops.cost("flash_attention", q, q, q, mask=mask)
        assert c.bytes_fused - base.bytes_fused == mask.numel()


@pytest.mark.parametrize("lengths", [(2.5, 3.5), ("2", 3), (True, 4), (torch.tensor(2.5), 3)])
def test_block_diagonal_refuses_lengths_int_would_truncate(lengths):
    with pytest.raises(TypeError, match="BlockDiagonal.*int token count"):
        ops.BlockDiagonal(lengths)


def test_block_diagonal_takes_integer_sequences_and_sliding_window_refuses_a_bool():
    import numpy as np
    for lengths in ([2, 3], (2, 3), torch.tensor([2, 3]), np.array([2, 3])):
        assert ops.BlockDiagonal(lengths).lengths == (2, 3)
    with pytest.raises(ValueError, match="window=True"):
        ops.SlidingWindow(True)


def test_adamw_step_with_a_group_edited_into_a_bad_lr_changes_nothing():
    a = torch.nn.Parameter(_rn(3))
    b = torch.nn.Parameter(_rn(2, seed=1))
    opt = ops.AdamW([{"params": [a]}, {"params": [b]}], lr=0.1)
    a.grad, b.grad = _rn(3, seed=2), _rn(2, seed=3)
    opt.step()
    opt.param_groups[1]["lr"] = -1.0
    before = [a.detach().clone(), b.detach().clone()]
    state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
             for p in (a, b)}
    with pytest.raises(ValueError, match="lr=-1.0"):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])   # group 0 not stepped
    for p in (a, b):
        for k, v in opt.state[p].items():                             # no step count bumped
            assert (torch.equal(v, state[id(p)][k]) if torch.is_tensor(v)
                    else v == state[id(p)][k]), k


@pytest.mark.parametrize("args, kwargs, error", [
    ((2.5, 8), {}, ValueError), ((-1, 8), {}, ValueError), ((4, 8), {"base": 0.0}, ValueError),
    ((4, 8), {"base": -2.0}, ValueError), ((4, 8), {"base": float("inf")}, ValueError),
    ((4, 8), {"dtype": torch.int64}, TypeError)])
def test_rope_cos_sin_refuses_what_gave_wrong_numbers(args, kwargs, error):
    with pytest.raises(error, match="rope_cos_sin"):
        ops.rope_cos_sin(*args, **kwargs)


def test_rope_cos_sin_still_gives_the_roformer_angles():
    cos, sin = ops.rope_cos_sin(4, 8, base=500000.0, mode="interleave", dtype=torch.float64)
    angles = torch.arange(4.0, dtype=torch.float64)[:, None] * 500000.0 ** (
        -torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    torch.testing.assert_close(cos, angles.cos().repeat_interleave(2, -1))
    torch.testing.assert_close(sin, angles.sin().repeat_interleave(2, -1))


@pytest.mark.parametrize("scale", ["0.5", "a", True, torch.tensor([1, 2])])
def test_attention_scale_must_be_a_number(scale):
    q = _rn(1, 1, 2, 4)
    with pytest.raises(TypeError, match=r"flash_attention: scale=.*give a float"):
        ops.flash_attention(q, q, q, scale=scale)
    with pytest.raises(TypeError, match=r"paged_attention: scale=.*give a float"):
        ops.paged_attention(q[:, :, :1], _rn(1, 1, 2, 4), _rn(1, 1, 2, 4), torch.tensor([[0]]),
                            torch.tensor([2]), scale=scale)
    torch.testing.assert_close(ops.flash_attention(q, q, q, scale=torch.tensor(0.5)),
                               F.scaled_dot_product_attention(q, q, q, scale=0.5))


def test_cost_takes_meta_beside_real_tensors():
    """wb.ops.cost prices shapes: a meta tensor beside a CPU one (notebook 09's GQA bytes,
    ``full = torch.empty(..., device="meta")``) is priced, as before the shared shape
    checks; the op itself still refuses inputs on two devices."""
    q = torch.randn(1, 8, 16, 4)
    k = torch.randn(1, 2, 16, 4)
    full = torch.empty(1, 8, 16, 4, device="meta")
    two = ops.cost("flash_attention", q, k, k, causal=True).bytes_fused
    eight = ops.cost("flash_attention", q, full, full, causal=True).bytes_fused
    assert eight > two > 0
    with pytest.raises(ValueError, match="one device"):
        ops.flash_attention(q, full, full)
