"""Measure one GPU's components the planner prices: GEMMs over a grid of shapes, the
attention kernels PyTorch has (FlashAttention-2 and cuDNN's), memory-bound kernels
(norms, GeLU, dropout, cross-entropy, fused AdamW, a copy), FP8 GEMMs, a sustained
GEMM with the clocks it ran at, and whole GPT and Llama layers.

    python benchmarks/gpu_components.py --out measured.json        # a CUDA GPU, ~4 min
    python benchmarks/gpu_components.py --smoke --out /tmp/x.json  # CPU, tiny, seconds

These are component measurements (issue 21: calibrate the clock from kernels and
collectives, never from end-to-end training steps).  The profile
``workbench/sim_mesh/profiles/h100.json`` takes its measured GEMM table and kernel
rates from the JSON this script wrote on an H100 80GB HBM3 (the file
``profiles/h100_measured.json``, with the software and clocks it ran under); run it
on your own GPU to see how yours compares.

Method (the workplace's device notes): random bf16 data (never zeros), a warm-up,
then three timed groups of back-to-back calls between CUDA events, each group about
``--target`` seconds; the median group's mean per call.  FLOPs of a causal attention
count the unmasked half (4 s^2 d h / 2 forward; backward 2.5x forward, FlashAttention-2's
convention, Dao 2023 sec. 4.1).  Bytes of memory-bound kernels count each input read
once and each output written once.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

GRID_M = [512, 1024, 2048, 4096, 8192, 16384]
GRID_NK = [256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576,
           32768, 49152]
MAX_GRID_FLOPS = 4e13           # bigger products run at the plateau: not measured


class Clock:
    def __init__(self, device, target):
        self.cuda = device.type == "cuda"
        self.device, self.target = device, target

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def _time(self, fn, reps):
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    def __call__(self, fn, groups=3, max_reps=200):
        """Median over ``groups`` of the mean seconds per call."""
        fn()
        self._sync()
        one = self._time(fn, 1)
        reps = max(2, min(max_reps, int(self.target / max(one, 1e-7))))
        times = sorted(self._time(fn, reps) for _ in range(groups))
        return times[len(times) // 2]


def smi(fields="name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,"
               "power.limit,temperature.gpu,clocks_throttle_reasons.active"):
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return dict(zip(fields.split(","), [v.strip() for v in out.stdout.split(",")]))
    except Exception as exc:        # no nvidia-smi (CPU smoke run)
        return {"error": repr(exc)}


def environment(device):
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "device": str(device), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(name=p.name, sm_count=p.multi_processor_count,
                   memory_bytes=p.total_memory, cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(),
                   capability=f"{p.major}.{p.minor}", smi=smi())
        try:
            env["cublas"] = torch._C._cuda_getCompiledVersion()
        except Exception:
            pass
    return env


def sustained(clock, device, dtype, seconds, n):
    """One n x n x n GEMM back to back for ``seconds``: TFLOP/s per second of it and
    nvidia-smi's clocks and power at the end of each second."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n ** 3
    one = clock(lambda: a @ b, 1, 2)
    rows, t_end = [], time.time() + seconds
    while time.time() < t_end:
        reps = max(1, int(1.0 / max(one, 1e-6)))
        t = clock._time(lambda: a @ b, reps)
        row = {"tflops": round(flops / t / 1e12, 1)}
        if device.type == "cuda":
            now = smi()
            row.update({k: now.get(k) for k in ("clocks.sm", "power.draw", "temperature.gpu",
                                                "clocks_throttle_reasons.active")})
        rows.append(row)
    return {"n": n, "per_second": rows}


def gemm_grid(clock, device, dtype, grid_m, grid_nk, max_flops):
    """y = linear(x, W): x (M, K), W (N, K), the forward of nn.Linear (cuBLAS 'TN')."""
    big_m, big_nk = max(grid_m), max(grid_nk)
    xs = torch.randn(big_m * big_nk, device=device, dtype=dtype)
    ws = torch.randn(big_nk * big_nk if max_flops > 0 else 1, device=device, dtype=dtype) \
        if big_nk * big_nk * 2 < 12e9 else torch.randn(int(6e9), device=device, dtype=dtype)
    rows = []
    for m in grid_m:
        for n in grid_nk:
            for k in grid_nk:
                f = 2.0 * m * n * k
                if f > max_flops or n * k > ws.numel():
                    continue
                x, w = xs[:m * k].view(m, k), ws[:n * k].view(n, k)
                t = clock(lambda: F.linear(x, w))
                rows.append([m, n, k, float(f"{f / t / 1e12:.5g}")])
    return rows


LAYOUTS = {"fwd": lambda x, w, dy: F.linear(x, w),               # x W^T
           "dgrad": lambda x, w, dy: dy @ w,                      # dY W
           "wgrad": lambda x, w, dy: dy.t() @ x}                  # dY^T X


def model_gemms(clock, device, dtype, shapes):
    """Each (M, N, K) of ``shapes`` in the three layouts of a Linear's training step."""
    out = []
    for m, n, k in shapes:
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        dy = torch.randn(m, n, device=device, dtype=dtype)
        row = {"m": m, "n": n, "k": k}
        for name, fn in LAYOUTS.items():
            t = clock(lambda: fn(x, w, dy))
            row[name] = float(f"{2.0 * m * n * k / t / 1e12:.5g}")
        out.append(row)
    return out


def attention(clock, device, dtype, cases):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if device.type != "cuda":
        backends = {"math": SDPBackend.MATH}
    out = []
    for b, heads, s, d, causal in cases:
        q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(b, heads, s, d, device=device, dtype=dtype)
        fwd_flops = 4.0 * b * heads * s * s * d * (0.5 if causal else 1.0)
        for name, be in backends.items():
            row = {"batch": b, "heads": heads, "seq": s, "head_dim": d, "causal": causal,
                   "backend": name}
            try:
                with sdpa_kernel([be]):
                    fwd = clock(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))

                    def step():
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        torch.autograd.grad(o, (q, k, v), g)
                    both = clock(step)
                row.update(fwd_s=fwd, fwd_bwd_s=both,
                           fwd_tflops=round(fwd_flops / fwd / 1e12, 1),
                           bwd_tflops=round(2.5 * fwd_flops / max(both - fwd, 1e-9) / 1e12, 1),
                           fwd_bwd_tflops=round(3.5 * fwd_flops / both / 1e12, 1))
            except Exception as exc:
                row["error"] = repr(exc)[:200]
            out.append(row)
    return out


def memory_bound(clock, device, dtype, tokens, hiddens, vocabs):
    out = []

    def rec(name, shape, nbytes, fn):
        t = clock(fn)
        out.append({"kernel": name, "shape": list(shape), "bytes": nbytes, "seconds": t,
                    "gb_per_s": round(nbytes / t / 1e9, 1)})

    e = torch.finfo(dtype).bits // 8
    for h in hiddens:
        x = torch.randn(tokens, h, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(h, device=device, dtype=dtype, requires_grad=True)
        bb = torch.randn(h, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(tokens, h, device=device, dtype=dtype)
        n = tokens * h * e
        rec("layer_norm_forward", x.shape, 2 * n, lambda: F.layer_norm(x, (h,), w, bb))
        y = F.layer_norm(x, (h,), w, bb)
        rec("layer_norm_backward", x.shape, 3 * n,
            lambda: torch.autograd.grad(y, (x, w, bb), dy, retain_graph=True))
        rec("rms_norm_forward", x.shape, 2 * n, lambda: F.rms_norm(x, (h,), w))
        y2 = F.rms_norm(x, (h,), w)
        rec("rms_norm_backward", x.shape, 3 * n,
            lambda: torch.autograd.grad(y2, (x, w), dy, retain_graph=True))
        x4 = torch.randn(tokens, 4 * h, device=device, dtype=dtype, requires_grad=True)
        dy4 = torch.randn(tokens, 4 * h, device=device, dtype=dtype)
        rec("gelu_forward", x4.shape, 2 * 4 * n, lambda: F.gelu(x4))
        y4 = F.gelu(x4)
        rec("gelu_backward", x4.shape, 3 * 4 * n,
            lambda: torch.autograd.grad(y4, x4, dy4, retain_graph=True))
        rec("dropout_forward", x.shape, 2 * n + tokens * h,
            lambda: F.dropout(x, 0.1, training=True))
        rec("add", x.shape, 3 * n, lambda: x + dy)
    for v in vocabs:
        logits = torch.randn(tokens, v, device=device, dtype=dtype, requires_grad=True)
        tgt = torch.randint(0, v, (tokens,), device=device)

        def ce():
            loss = F.cross_entropy(logits.float(), tgt)
            torch.autograd.grad(loss, logits)
        rec("cross_entropy_fwd_bwd_fp32", logits.shape, 2 * tokens * v * e, ce)
    n = tokens * max(hiddens) * 64
    a = torch.randn(n, device=device, dtype=dtype)
    b = torch.empty_like(a)
    rec("copy", a.shape, 2 * n * e, lambda: b.copy_(a))
    del a, b
    n = min(n, 2 ** 28)                 # 1 GiB per fp32 state: 4 GiB in all
    params = [torch.nn.Parameter(torch.randn(n // 8, device=device)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    # fp32 param, grad, exp_avg, exp_avg_sq read; param, exp_avg, exp_avg_sq written
    rec("adamw_fused_fp32", (n,), 7 * 4 * n, opt.step)
    return out


def fp8_gemms(clock, device, shapes):
    out = []
    if device.type != "cuda" or not hasattr(torch, "float8_e4m3fn"):
        return out
    one = torch.tensor(1.0, device=device)
    for m, n, k in shapes:
        row = {"m": m, "n": n, "k": k}
        try:
            a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
            w = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
            t = clock(lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one,
                                               out_dtype=torch.bfloat16))
            row["tflops"] = round(2.0 * m * n * k / t / 1e12, 1)
        except Exception as exc:
            row["error"] = repr(exc)[:200]
        out.append(row)
    return out


class GPTLayer(torch.nn.Module):
    """Megatron's GPT block in plain PyTorch: pre-LN, fused QKV, causal SDPA, GeLU MLP,
    hidden dropout (attention dropout 0: SDPA's backends differ there)."""

    def __init__(self, h, heads, dropout=0.1):
        super().__init__()
        self.h, self.heads, self.p = h, heads, dropout
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv, self.proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, s, h)), self.p)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p)


class LlamaLayer(torch.nn.Module):
    """Llama's block: RMSNorm, GQA with RoPE, SwiGLU, no biases, no dropout."""

    def __init__(self, h, heads, kv_heads, ffn):
        super().__init__()
        self.h, self.heads, self.kv, self.d = h, heads, kv_heads, h // heads
        self.n1, self.n2 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
        self.qkv = torch.nn.Linear(h, (heads + 2 * kv_heads) * self.d, bias=False)
        self.o = torch.nn.Linear(h, h, bias=False)
        self.gate_up = torch.nn.Linear(h, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, h, bias=False)

    def rope(self, t, cos, sin):
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-t2, t1), -1) * sin

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        qkv = self.qkv(self.n1(x)).view(b, s, self.heads + 2 * self.kv, self.d).transpose(1, 2)
        q, k, v = qkv.split([self.heads, self.kv, self.kv], dim=1)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        rep = self.heads // self.kv        # K/V repeated per query group (no GQA kernel)
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                           v.repeat_interleave(rep, 1), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        g, u = self.gate_up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def layers(clock, device, dtype, cases, seq):
    out = []
    for case in cases:
        torch.manual_seed(0)
        if case["arch"] == "gpt":
            mod = GPTLayer(case["h"], case["heads"]).to(device, dtype)
            args = ()
        else:
            mod = LlamaLayer(case["h"], case["heads"], case["kv_heads"], case["ffn"]).to(
                device, dtype)
            d = case["h"] // case["heads"]
            ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32),
                              1.0 / 500000 ** (torch.arange(0, d, 2, device=device) / d))
            ang = torch.cat((ang, ang), -1)
            args = (ang.cos().to(dtype), ang.sin().to(dtype))
        x = torch.randn(1, seq, case["h"], device=device, dtype=dtype, requires_grad=True)
        g = torch.randn_like(x)
        params = [p for p in mod.parameters()]
        fwd = clock(lambda: mod(x, *args), groups=3, max_reps=20)

        def step():
            torch.autograd.grad(mod(x, *args), [x, *params], g)
        both = clock(step, groups=3, max_reps=20)
        out.append({**case, "seq": seq, "batch": 1, "fwd_s": fwd, "bwd_s": both - fwd,
                    "fwd_bwd_s": both})
    return out


def model_shapes(tokens=4096):
    """The per-GPU Linear shapes (M tokens, N out, K in) of the published H100 rows
    (GPT, h / tp) and of Llama 3 8B / 70B at tp 1, 2, 4, 8."""
    shapes = set()
    for h, tps in ((2048, (1,)), (4096, (1, 2)), (6144, (4,)), (7168, (8,)), (8192, (8,)),
                   (10240, (8,)), (12288, (8,)), (16384, (8,)), (18432, (8,))):
        for tp in tps:
            shapes |= {(tokens, 3 * h // tp, h), (tokens, h, h // tp),
                       (tokens, 4 * h // tp, h), (tokens, h, 4 * h // tp),
                       (tokens, 131072 // tp, h)}
    for h, ffn, kv, heads in ((4096, 14336, 8, 32), (8192, 28672, 8, 64)):
        d = h // heads
        for tp in (1, 2, 4, 8):
            shapes |= {(tokens, (heads + 2 * kv) * d // tp, h), (tokens, h, h // tp),
                       (tokens, 2 * ffn // tp, h), (tokens, h, ffn // tp),
                       (tokens, 128256 // tp, h)}
    return sorted(shapes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--target", type=float, default=0.015, help="seconds per timed group")
    ap.add_argument("--sustain", type=float, default=12.0, help="seconds of sustained GEMM")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16
    clock = Clock(device, 0.001 if args.smoke else args.target)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True   # the default
    res = {"environment": environment(device), "method": __doc__.split("Method")[1].strip()}

    def save(part, value):
        res[part] = value
        res["elapsed_s"] = round(time.perf_counter() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=0)
        print(f"{part}: done at {res['elapsed_s']} s", flush=True)

    t0 = time.perf_counter()
    torch.manual_seed(0)
    if args.smoke:
        save("sustained", sustained(clock, device, dtype, 0.5, 64))
        save("gemm_grid", gemm_grid(clock, device, dtype, [16, 32], [16, 64], 1e12))
        save("model_gemms", model_gemms(clock, device, dtype, [(32, 48, 16), (32, 16, 48)]))
        save("attention", attention(clock, device, dtype, [(1, 2, 64, 16, True)]))
        save("memory_bound", memory_bound(clock, device, dtype, 32, [16], [64]))
        save("fp8", fp8_gemms(clock, device, [(64, 64, 64)]))
        save("layers", layers(clock, device, dtype,
                              [dict(arch="gpt", name="t", h=32, heads=2),
                               dict(arch="llama", name="l", h=32, heads=4, kv_heads=2,
                                    ffn=48)], 16))
        return res
    res["smi_before"] = smi()
    save("sustained", sustained(clock, device, dtype, args.sustain, 8192))
    save("gemm_grid", gemm_grid(clock, device, dtype, GRID_M, GRID_NK, MAX_GRID_FLOPS))
    save("model_gemms", model_gemms(clock, device, dtype, model_shapes()))
    save("attention", attention(clock, device, dtype,
                                [(1, hd, s, 128, c) for s in (2048, 4096, 8192)
                                 for hd in (8, 16, 32) for c in (True, False)]
                                + [(1, 16, 4096, 64, True)]))
    save("memory_bound", memory_bound(clock, device, dtype, 4096,
                                      [2048, 4096, 8192, 12288], [51200 // 8, 131072 // 8,
                                                                  131072, 128256]))
    save("fp8", fp8_gemms(clock, device, [(4096, 4096, 4096), (8192, 8192, 8192),
                                          (16384, 16384, 16384), (4096, 12288, 4096),
                                          (4096, 4096, 16384)]))
    save("layers", layers(clock, device, dtype,
                          [dict(arch="gpt", name="GPT 1.7B (tp1)", h=2048, heads=16),
                           dict(arch="gpt", name="GPT 7.1B (tp1)", h=4096, heads=32),
                           dict(arch="llama", name="Llama 3 8B", h=4096, heads=32,
                                kv_heads=8, ffn=14336)], 4096))
    res["smi_after"] = smi()
    save("done", True)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
