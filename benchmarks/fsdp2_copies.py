"""FSDP2's copy kernels timed on a GPU at a Llama 3 8B block's sizes (plan/fsdp2_cost.py):
the all-gather copy-in (fp32 shard -> bf16 with torch._foreach_copy_, then into the
gather buffer), the copy-out (torch.split_with_sizes_copy of the gathered buffer viewed
(world, -1) into the parameters), the reduce-scatter copy-in (torch._chunk_cat of the
bf16 gradients into an fp32 (world, -1) buffer) and the fp32 gradient accumulation.
Prints each kernel's bytes read + written per second, the figure fsdp2_cost prices at
the profile's memory rate (memory_bandwidth x memory_efficiency).

    python benchmarks/fsdp2_copies.py [--world 8]

benchmarks/fsdp2_copies_h100.json: its output on one H100 80GB HBM3 (PyTorch 2.11.0+cu130,
2026-11-26), the shares ``plan/fsdp2_cost.py``'s COPY_RATE takes.
"""
import argparse
import json

import torch


def _shapes(h=4096, f=14336, kv=1024):
    # Llama 3 8B block: wq, wk, wv, wo, w1, w3, w2, two RMSNorm weights
    return [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]


def _time(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=8)
    w = ap.parse_args().world
    dev = "cuda"
    shapes = _shapes()
    numels = [torch.Size(s).numel() for s in shapes]
    shard = [-(-n // w) for n in numels]           # dim-0 padded shards, flattened
    total = sum(shard) * w
    out = {"dev": torch.cuda.get_device_name(), "torch": torch.__version__,
           "numel": sum(numels), "k": {}}
    # copy-in: fp32 shards -> bf16 flat (foreach), then into the gather buffer's slice
    master = [torch.randn(n, device=dev) for n in shard]
    flat16 = torch.empty(sum(shard), device=dev, dtype=torch.bfloat16)
    gather = torch.empty(total, device=dev, dtype=torch.bfloat16)
    dst = list(torch.split(gather.narrow(0, 0, sum(shard)), shard))
    cast_dst = list(torch.split(flat16, shard))
    srcs = list(torch.split(flat16, shard))
    k = out["k"]
    t = _time(lambda: torch._foreach_copy_(cast_dst, master))
    k["copy_in_cast"] = (6 * sum(shard), t)
    t = _time(lambda: torch._foreach_copy_(dst, srcs))
    k["copy_in_copy"] = (4 * sum(shard), t)
    # copy-out: the gathered (world, -1) buffer split along dim 1 into the parameters
    params = [torch.empty(w, s, device=dev, dtype=torch.bfloat16) for s in shard]
    view = gather.view(w, -1)
    t = _time(lambda: torch.split_with_sizes_copy(view, shard, dim=1, out=params))
    k["copy_out"] = (4 * total, t)
    # reduce-scatter copy-in: bf16 gradients chunk-cat into fp32 (world, -1)
    grads = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in shapes]
    rs_in = torch.empty(w, total // w, device=dev, dtype=torch.float32)
    t = _time(lambda: torch._chunk_cat(grads, dim=0, num_chunks=w, out=rs_in))
    k["rs_copy_in"] = (6 * sum(numels), t)
    # the reduced fp32 shard accumulated into the sharded gradient
    g, r = torch.zeros(sum(shard), device=dev), torch.randn(sum(shard), device=dev)
    t = _time(lambda: g.add_(r))
    k["grad_accumulate"] = (12 * sum(shard), t)
    big = torch.empty(800_000_000, device=dev, dtype=torch.uint8)
    big2 = torch.empty_like(big)
    t = _time(lambda: big2.copy_(big))
    k["plain_copy"] = (2 * big.numel(), t)
    for name, (nbytes, sec) in k.items():
        k[name] = {"bytes": nbytes, "s": sec, "GBps": nbytes / sec / 1e9}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
