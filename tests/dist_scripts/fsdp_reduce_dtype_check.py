"""Run under torchrun (gloo): ``FullyShardedDataParallel(compute_dtype=bf16,
reduce_dtype=fp32)`` on the default process group.  Each rank computes FSDP2's answer by
hand (every rank's bf16 gradients on its rows, cast to fp32, summed, divided by the world
size) and compares its own fp32 shard of the gradient; rank 0 prints one JSON line: the
largest difference, the shards' dtype and the reduce-scatters' bytes."""
import json

import torch
import torch.distributed as dist

import workbench as wb
from tests.test_fsdp_reduce_dtype import BF, F32, Block, batch, fsdp2_reference, loss_of, make


def main():
    wb.distributed.init(timeout_s=60)
    n, k = dist.get_world_size(), dist.get_rank()
    ids, y = batch(n)
    f = wb.FullyShardedDataParallel(make(), compute_dtype=BF, units={Block}, reduce_dtype=F32)
    with wb.trace() as tr:
        loss_of(f(ids.chunk(n)[k]), y.chunk(n)[k]).backward()
    want = fsdp2_reference(n, ids, y, F32)
    diff, dtypes = 0.0, set()
    for (name, p), w in zip(f.named_parameters(), want.values()):
        flat = w.reshape(-1)
        flat = torch.cat([flat, flat.new_zeros(-flat.numel() % n)]).view(n, -1)[k]
        g = p.grad.detach().as_subclass(torch.Tensor).reshape(-1)
        dtypes.add(str(g.dtype))
        diff = max(diff, (g - flat).abs().max().item())
    rs = [e.args["buffer_bytes"] for e in tr.collectives() if e.name == "reduce_scatter"]
    numel = sum(p.numel() for p in f.parameters()) * n          # every rank's padded chunks
    if k == 0:
        print(json.dumps({"diff": diff, "dtypes": sorted(dtypes), "rs_bytes": sum(rs),
                          "fp32_bytes": 4 * numel}), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
