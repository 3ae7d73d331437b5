"""On a real Ascend NPU (pytest -m npu): the npu path against the CPU reference.

Skipped where no NPU is usable.  NPU float32 matmuls may run in reduced
internal precision (HF32), so float32 is held to bfloat16's tolerance here.
"""
import warnings

import pytest
import torch

import workbench.npu as npu
import workbench.ops as ops
from workbench.ops.testing import TOLERANCES

pytestmark = [pytest.mark.npu,
              pytest.mark.skipif(not npu.is_available(), reason="needs an Ascend NPU")]


def close(a, b, dtype):
    atol, rtol = TOLERANCES[torch.bfloat16 if dtype == torch.float32 else dtype]
    scale = max(1.0, float(b.abs().max()))
    torch.testing.assert_close(a.detach().cpu().to(b.dtype), b.detach(), atol=atol * scale,
                               rtol=rtol)


def on_npu_and_reference(fn, inputs, dtype):
    """fn on NPU copies (auto dispatch) and on the CPU reference: outputs and grads."""
    dev = npu.device()
    cpu_in = [t.detach().to(dtype).requires_grad_() for t in inputs]
    dev_in = [t.detach().to(dev, dtype).requires_grad_() for t in inputs]
    out = fn(*dev_in)
    with ops.use("reference"):
        ref = fn(*cpu_in)
    dout = torch.randn(ref.shape).to(dtype)
    got = (out, *torch.autograd.grad(out, dev_in, dout.to(dev)))
    want = (ref, *torch.autograd.grad(ref, cpu_in, dout))
    for a, b in zip(got, want):
        close(a, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True), dict(mask=ops.SlidingWindow(16))])
def test_flash_attention(dtype, kwargs):
    q, k, v = torch.randn(2, 8, 128, 64), torch.randn(2, 2, 128, 64), torch.randn(2, 2, 128, 64)
    on_npu_and_reference(lambda q, k, v: ops.flash_attention(q, k, v, **kwargs), (q, k, v), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_swiglu_rotary_linear(dtype):
    x = torch.randn(2, 4, 16, 64)
    on_npu_and_reference(lambda x, w: ops.rms_norm(x, w), (x, torch.randn(64)), dtype)
    on_npu_and_reference(lambda x: ops.swiglu(x), (x,), dtype)
    for mode in ("half", "interleave"):
        cos, sin = ops.rope_cos_sin(16, 64, mode=mode, dtype=dtype)
        on_npu_and_reference(
            lambda x: ops.rotary_embedding(x, cos.to(x.device), sin.to(x.device), mode=mode),
            (x,), dtype)
    on_npu_and_reference(ops.linear, (x, torch.randn(32, 64) / 8, torch.randn(32)), dtype)


def test_adamw_and_float64_warning():
    dev = npu.device()
    p = [torch.randn(100, device=dev)]
    g = [torch.randn(100, device=dev)]
    m, v = [torch.zeros(100, device=dev)], [torch.zeros(100, device=dev)]
    ref = [t[0].cpu() for t in (p, g, m, v)]
    ops.adamw(p, g, m, v, 1, lr=0.1)
    with ops.use("reference"):
        ops.adamw([ref[0]], [ref[1]], [ref[2]], [ref[3]], 1, lr=0.1)
    close(p[0], ref[0], torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops.rms_norm(torch.randn(4, 8, dtype=torch.float64, device=dev),
                     torch.ones(8, dtype=torch.float64, device=dev))
    assert any(issubclass(w.category, npu.NpuDtypeWarning) for w in caught)


def test_device_report_and_profile(tmp_path):
    assert npu.device().type == "npu" and npu.dist_backend() == "hccl"
    assert npu.report().npu_count >= 1
    with npu.profile(tmp_path / "npu.json") as prof:
        (torch.randn(64, 64, device=npu.device()) @ torch.randn(64, 64, device=npu.device())).sum()
    assert prof.backend == "torch_npu.profiler" and (tmp_path / "npu.json").exists()
