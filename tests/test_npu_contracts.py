"""Contract tests: the NPU path against the documented torch_npu contracts
(/work/shared/reference/torch_npu.md), with a stand-in ``torch_npu`` module.

The stand-in implements each documented kernel from its documentation alone,
*including the traps*: ``npu_fusion_attention``'s scale defaults to 1.0, its
mask is True = masked OUT, dropout is given as keep_prob, every argument must
be positional (the first parameter's name differs across versions).  If the
workbench's NPU path forgot any of these, its output would differ from the
reference and these tests would fail.
"""
import json
import math
import sys
import types

import pytest
import torch

import workbench.npu as npu
import workbench.ops as ops
from workbench.ops.testing import assert_close

FUSION_PARAMS = ("query", "key", "value", "head_num", "input_layout", "pse", "padding_mask",
                 "atten_mask", "scale", "keep_prob", "pre_tockens", "next_tockens",
                 "inner_precise", "prefix", "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")
FUSION_DEFAULTS = dict(pse=None, padding_mask=None, atten_mask=None, scale=1.0, keep_prob=1.0,
                       pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                       prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0)


class StandInTorchNpu(types.ModuleType):
    """torch_npu as documented, computed with plain torch ops on the CPU."""

    def __init__(self):
        super().__init__("torch_npu")
        self.__version__ = "2.13.0"
        self.calls = []
        self.npu = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)
        self.profiler = types.SimpleNamespace(
            ProfilerActivity=types.SimpleNamespace(CPU=torch.profiler.ProfilerActivity.CPU,
                                                   NPU="NPU"),
            profile=self._profile)

    def _positional(self, name, args, kwargs, params, defaults):
        assert not kwargs, f"{name} must be called positionally, got keywords {sorted(kwargs)}"
        assert len(args) <= len(params), f"{name}: too many arguments"
        bound = dict(defaults, **dict(zip(params, args)))
        missing = [p for p in params if p not in bound]
        assert not missing, f"{name}: missing {missing}"
        self.calls.append((name, bound))
        return bound

    def npu_fusion_attention(self, *args, **kwargs):
        a = self._positional("npu_fusion_attention", args, kwargs, FUSION_PARAMS, FUSION_DEFAULTS)
        q, k, v = a["query"], a["key"], a["value"]
        assert a["input_layout"] == "BNSD" and a["head_num"] == q.shape[1]
        assert q.shape[1] % k.shape[1] == 0, "GQA: query heads a multiple of kv heads"
        assert q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        B, N, S, _ = q.shape
        Sk = k.shape[2]
        masked_out = a["atten_mask"]                       # True = masked OUT
        if a["sparse_mode"] == 2:                          # left-up causal, compressed mask
            assert masked_out.shape == (2048, 2048)
            assert torch.equal(masked_out, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
            masked_out = torch.ones(S, Sk, dtype=torch.bool).triu(1)
        elif masked_out is not None:
            assert a["sparse_mode"] == 0
            assert masked_out.dtype in (torch.bool, torch.uint8)
            shape = tuple(masked_out.shape)
            assert shape in ((B, N, S, Sk), (B, 1, S, Sk), (1, 1, S, Sk), (S, Sk)), shape
            masked_out = masked_out.bool()
        g = N // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = q @ k.transpose(-1, -2) * a["scale"]
        if masked_out is not None:
            s = s.masked_fill(masked_out, float("-inf"))
        p = torch.softmax(s, -1)
        if a["keep_prob"] < 1:
            p = p * (torch.rand_like(p) < a["keep_prob"]) / a["keep_prob"]
        out = p @ v
        return out, None, None, None, 0, 0, 0              # 7 outputs, attention first

    def npu_rms_norm(self, *args, **kwargs):
        a = self._positional("npu_rms_norm", args, kwargs, ("x", "gamma", "epsilon"),
                             dict(epsilon=1e-6))
        x, gamma = a["x"], a["gamma"]
        dims = tuple(range(-gamma.dim(), 0))
        rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + a["epsilon"])
        return (x.float() * rstd).to(x.dtype) * gamma, rstd

    def npu_swiglu(self, *args, **kwargs):
        a = self._positional("npu_swiglu", args, kwargs, ("x", "dim"), dict(dim=-1))
        first, second = a["x"].chunk(2, a["dim"])
        return torch.nn.functional.silu(first) * second

    def npu_rotary_mul(self, *args, **kwargs):
        a = self._positional("npu_rotary_mul", args, kwargs, ("x", "r1", "r2", "rotary_mode"),
                             dict(rotary_mode="half"))
        x, cos, sin = a["x"], a["r1"], a["r2"]
        assert x.dim() == 4 and cos.dim() == 4 and sin.dim() == 4
        if a["rotary_mode"] == "half":
            x1, x2 = x.chunk(2, -1)
            rotated = torch.cat((-x2, x1), -1)
        else:
            assert a["rotary_mode"] == "interleave"
            rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
        return x * cos + rotated * sin

    def npu_apply_adam_w(self, *args, **kwargs):
        raise AssertionError("npu_apply_adam_w has an unconfirmed bias-correction convention; "
                             "the workbench must not call it")

    def _profile(self, activities, **kwargs):
        self.calls.append(("profiler.profile", dict(activities=activities, **kwargs)))
        cpu_only = [a for a in activities if a != "NPU"]
        return torch.profiler.profile(activities=cpu_only, **kwargs)


@pytest.fixture
def fake():
    """Install the stand-in as ``torch_npu`` and make the probe see it; undo afterwards."""
    previous = sys.modules.get("torch_npu")
    stand_in = StandInTorchNpu()
    sys.modules["torch_npu"] = stand_in
    npu.probe(refresh=True)
    try:
        with ops.use("npu"):
            yield stand_in
    finally:
        if previous is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous
        npu.probe(refresh=True)


def qkv(B=2, Hq=4, Hkv=2, S=24, Sk=24, D=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=gen).to(dtype).requires_grad_()
                 for shape in ((B, Hq, S, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D)))


def both(fn, inputs, dout_seed=1):
    """fn on the NPU path and on the reference: outputs and gradients."""
    results = []
    for backend in ("npu", "reference"):
        with ops.use(backend):
            out = fn(*inputs)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(dout_seed))
        results.append((out, *torch.autograd.grad(out, inputs, dout.to(out.dtype))))
    return results


@pytest.mark.parametrize("kwargs", [dict(), dict(scale=0.3), dict(causal=True)])
def test_fusion_attention_gets_bnsd_head_num_scale_and_keep_prob(fake, kwargs):
    q, k, v = qkv()
    got, want = both(lambda q, k, v: ops.flash_attention(q, k, v, **kwargs), (q, k, v))
    for a, b in zip(got, want):
        assert_close(a, b)
    (name, call), = fake.calls
    expected_scale = kwargs.get("scale", 1 / math.sqrt(16))
    assert name == "npu_fusion_attention" and call["scale"] == expected_scale   # passed explicitly
    assert call["keep_prob"] == 1.0 and call["head_num"] == 4
    assert call["sparse_mode"] == (2 if kwargs.get("causal") else 0)


@pytest.mark.parametrize("mask_shape", [(24, 24), (2, 1, 24, 24), (1, 4, 24, 24), (2, 4, 24, 24)])
def test_fusion_attention_inverts_the_mask_and_uses_an_accepted_layout(fake, mask_shape):
    q, k, v = qkv()
    keep = torch.rand(mask_shape, generator=torch.Generator().manual_seed(2)) > 0.3
    keep[..., :, 0] = True                      # every row keeps a key
    got, want = both(lambda q, k, v: ops.flash_attention(q, k, v, mask=keep), (q, k, v))
    for a, b in zip(got, want):
        assert_close(a, b)
    sent = fake.calls[0][1]["atten_mask"]
    assert sent.dtype == torch.bool and torch.equal(sent, ~keep.expand(sent.shape))


def test_fusion_attention_with_patterns_and_causal_sends_one_full_mask(fake):
    q, k, v = qkv(S=32, Sk=32)
    for mask in (ops.SlidingWindow(5), ops.BlockDiagonal((10, 22))):
        got, want = both(lambda q, k, v: ops.flash_attention(q, k, v, mask=mask, causal=True),
                         (q, k, v))
        for a, b in zip(got, want):
            assert_close(a, b)
    assert all(call["sparse_mode"] == 0 and call["atten_mask"].shape == (1, 1, 32, 32)
               for _, call in fake.calls)


def test_fusion_attention_gets_keep_prob_not_dropout_p(fake):
    q, k, v = qkv()
    ops.flash_attention(q, k, v, dropout_p=0.1)
    assert fake.calls[0][1]["keep_prob"] == pytest.approx(0.9)


def test_fusion_attention_low_precision_and_refusing_float64(fake):
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = qkv(dtype=dtype)
        got, want = both(lambda q, k, v: ops.flash_attention(q, k, v, causal=True), (q, k, v))
        for a, b in zip(got, want):
            assert_close(a, b, str(dtype))
    with pytest.raises(TypeError, match="npu_fusion_attention takes float16, bfloat16 or float32"):
        ops.flash_attention(*qkv(dtype=torch.float64))


def test_rms_norm_passes_epsilon_positionally_and_takes_y(fake):
    x = torch.randn(3, 5, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    got, want = both(lambda x, w: ops.rms_norm(x, w, eps=0.5), (x, w))
    for a, b in zip(got, want):
        assert_close(a, b)
    assert fake.calls[0][1]["epsilon"] == 0.5


def test_swiglu_passes_dim(fake):
    x = torch.randn(6, 4, 5, requires_grad=True)
    got, want = both(lambda x: ops.swiglu(x, dim=0), (x,))
    for a, b in zip(got, want):
        assert_close(a, b)
    assert fake.calls[0][1]["dim"] == 0


@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("shape", [(2, 3, 8, 16), (8, 16)])
def test_rotary_mul_gets_4d_cos_sin_and_the_mode(fake, mode, shape):
    x = torch.randn(shape, requires_grad=True)
    cos, sin = ops.rope_cos_sin(8, 16, mode=mode)
    got, want = both(lambda x: ops.rotary_embedding(x, cos, sin, mode=mode), (x,))
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert_close(a, b)
    (_, call), = fake.calls
    assert call["r1"].dim() == 4 and call["rotary_mode"] == mode


def test_adamw_runs_multi_tensor_kernels_not_npu_apply_adam_w(fake):
    params = [torch.randn(5, 3), torch.randn(7)]
    grads = [torch.randn_like(p) for p in params]
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    ref = [p.clone() for p in params]
    ref_state = [[t.clone() for t in s] for s in state]
    ops.adamw(params, grads, *state, 1, lr=0.1)
    with ops.use("reference"):
        ops.adamw(ref, grads, *ref_state, 1, lr=0.1)
    for a, b in zip(params, ref):
        assert_close(a, b)


def test_linear_on_the_npu_path(fake):
    x, w, b = (torch.randn(4, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True),
               torch.randn(3, requires_grad=True))
    got, want = both(ops.linear, (x, w, b))
    for a, c in zip(got, want):
        assert_close(a, c)


def test_profiler_on_npu_asks_for_cpu_and_npu_activities(fake, tmp_path):
    path = tmp_path / "npu.json"
    with npu.profile(path, device="npu") as prof:
        torch.randn(16, 16) @ torch.randn(16, 16)
    assert prof.backend == "torch_npu.profiler" and prof.activities == ("CPU", "NPU")
    (name, call), = fake.calls
    assert name == "profiler.profile" and call["activities"][1] == "NPU"
    assert "traceEvents" in json.loads(path.read_text())


def test_detection_with_a_working_torch_npu(fake):
    fake.npu.is_available = lambda: True
    fake.npu.device_count = lambda: 2
    assert npu.is_available() and npu.device_count() == 2
    assert npu.dist_backend("npu:1") == "hccl"
    found = npu.probe()
    assert found.imported and found.module is fake and npu.torch_npu_module() is fake
