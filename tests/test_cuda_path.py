"""The CUDA path: the fused operators on a CUDA device against their CPU reference, and
a training run on CUDA against the same run on the CPU.  Skipped without a CUDA device
(CI has none); run on a GPU with ``pytest tests/test_cuda_path.py``."""
import json
import math
import subprocess
import sys

import pytest
import torch

import workbench.ops as ops
from workbench.ops.testing import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("backend", ["reference", "unfused", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attention_on_cuda_equals_the_cpu_reference(backend, dtype):
    q, k, v = (_rand(2, 4, 64, 32, seed=i, dtype=dtype) for i in range(3))
    with ops.use("reference"):
        ref = ops.flash_attention(q.float(), k.float(), v.float(), causal=True)
    with ops.use(backend):
        out = ops.flash_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), causal=True)
    assert out.device.type == "cuda" and out.dtype == dtype
    assert_close(out.cpu().float(), ref, f"{backend} {dtype}") if dtype == torch.float32 \
        else assert_close(out.cpu(), ref.to(dtype), f"{backend} {dtype}")


@pytest.mark.parametrize("backend", ["reference", "unfused", "native"])
def test_pointwise_and_linear_ops_on_cuda(backend):
    x, w = _rand(8, 64), _rand(64, seed=1)
    big, wl, b = _rand(8, 128, seed=2), _rand(96, 64, seed=3), _rand(96, seed=4)
    ang = _rand(8, 16, seed=5)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    xr = _rand(2, 4, 8, 32, seed=6)
    with ops.use("reference"):
        refs = (ops.rms_norm(x, w), ops.swiglu(big), ops.linear(x, wl, b),
                ops.rotary_embedding(xr, cos, sin))
    with ops.use(backend):
        outs = (ops.rms_norm(x.to(CUDA), w.to(CUDA)), ops.swiglu(big.to(CUDA)),
                ops.linear(x.to(CUDA), wl.to(CUDA), b.to(CUDA)),
                ops.rotary_embedding(xr.to(CUDA), cos.to(CUDA), sin.to(CUDA)))
    for name, o, r in zip(("rms_norm", "swiglu", "linear", "rotary"), outs, refs):
        assert o.device.type == "cuda"
        assert_close(o.cpu(), r, f"{backend} {name}")


def test_adamw_on_cuda_equals_the_cpu_step():
    p, g, m, v = (_rand(1000, seed=i) for i in range(4))
    v = v.abs()
    cpu = [t.clone() for t in (p, m, v)]
    gpu = [t.clone().to(CUDA) for t in (p, m, v)]
    with ops.use("reference"):
        ops.adamw([cpu[0]], [g], [cpu[1]], [cpu[2]], 3, lr=1e-2)
    with ops.use("native"):
        ops.adamw([gpu[0]], [g.to(CUDA)], [gpu[1]], [gpu[2]], 3, lr=1e-2)
    for a, b in zip(gpu, cpu):
        assert_close(a.cpu(), b, "adamw")


def _losses(device, *extra):
    preset = () if "--preset" in extra else ("--preset", "small")
    out = subprocess.run([sys.executable, "-m", "workbench", "train", *preset,
                          "--steps", "3", "--device", device, *extra],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line)["loss"] for line in out.stdout.splitlines()
            if line.startswith("{") and '"loss"' in line]


@pytest.mark.parametrize("extra", [(), ("--recompute", "selective"),
                                   ("--recompute", "full", "--preset", "gpt-tiny"),
                                   ("--moe-experts", "4", "--moe-topk", "2")])
def test_training_on_cuda_follows_the_cpu_run(extra):
    """The same seed, batches and dropout masks (drawn by the CPU generator) on both
    devices: the losses agree to float32 rounding across 3 AdamW steps."""
    cpu, gpu = _losses("cpu", *extra), _losses("cuda", *extra)
    assert len(cpu) == len(gpu) == 3
    for a, b in zip(cpu, gpu):
        assert math.isclose(a, b, rel_tol=1e-3), (cpu, gpu)
